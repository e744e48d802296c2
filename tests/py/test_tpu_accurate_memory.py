"""The accurate mode's temp on a sharded decoder step for TPU is at most f32's (issue 35, 3c).

XLA:TPU runs an f32 dot at DEFAULT precision as one bf16 pass (``Target.f32_dot_runs_as``),
so the accurate mode's converts would only change what XLA stores: one bf16 convert that
two dots read (the softmax backward's gradient, read by the dQ and dK dots) is a copy
XLA:TPU stores, where from the f32 value it fuses the producer into each dot. Measured on
benchmarks/llm.py's step at a small size (1 block, d 256, SwiGLU and vocab 64, 2
sequences of 3072 tokens, FSDP 2 x TP 2 on TPU v5e 2x2, ``memory_analysis()``): with
every dot converted 99,558,912 B of temp against f32's 84,262,912; with the dots that
share an operand left f32, f32's (and on the 16-layer v5e-16 step 2,382.4 MiB against
2,382.2). insert_converts now leaves every such dot f32, so the rewritten step is f32's
program (2,382.2 MiB on v5e-16, benchmarks/RESULTS.md): this test checks that on the small
step, without compiling it (two libtpu compiles were 38 s of ``make test``). The program
differs from f32's only where cleanup merged a duplicate convert of one value, which XLA
does too.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest

import hlo_amp
from benchmarks import llm

CONFIG = dataclasses.replace(llm.Config(), layers=1, dim=256, heads=4, kv_heads=2,
                             hidden=64, vocab=64, seq=3072, batch=2, scan_layers=False)
TARGET, AXES = "tpu-v5e:2x2", {"fsdp": 2, "tp": 2}
_NAME = re.compile(r"%[\w#.]+")


@pytest.fixture(scope="module")
def accurate() -> object:
    device = llm.device_target(TARGET)
    mesh = hlo_amp.target_mesh(device, AXES)
    step = llm.make_train_step(CONFIG, llm.jnp.float32, mesh)
    return hlo_amp.compile(step, "bf16").lower(*llm.abstract_state(CONFIG, mesh),
                                               target=device)


def _ops(text: str) -> list[str]:
    """The module's lines with SSA names blanked: what each op computes, in order."""
    return [_NAME.sub("%", line.strip()) for line in text.splitlines()]


def test_accurate_mode_leaves_the_step_f32s_program(accurate: object) -> None:
    rewritten, original = _ops(accurate.as_text()), _ops(accurate.original_text())
    assert "bf16" not in accurate.as_text()  # no 16-bit value: nothing more to store
    # The same ops, less the one convert cleanup merged with its twin.
    assert Counter(original) - Counter(rewritten) == Counter(
        ["% = stablehlo.convert % : (tensor<i32>) -> tensor<f32>"])
    assert not Counter(rewritten) - Counter(original)


def test_the_report_says_why_each_dot_stayed_f32(accurate: object) -> None:
    decisions = accurate.report().decisions
    kept = [d for d in decisions if d.reason.startswith("kept f32: XLA:TPU rounds")]
    # Every dot of the step, the attention's backward dots among them (dK and dV, whose
    # results are 4-D: [batch, kv head, token, head dim]).
    assert len(kept) == len(decisions) and all(d.op_kind == "dot_general" for d in kept)
    assert any(d.direction == "backward" and d.shape.count("x") == 3 for d in kept)
    assert all(not d.changed and d.operands_after == ("f32", "f32") and d.runs_as == "bf16"
               for d in kept)
    # The summary says so, with their share of the FLOPs (all of them here).
    summary = accurate.report().summary()
    assert f"{len(kept)} f32 ops left to XLA's own bf16 pass (100% of FLOPs)" in summary
