"""The accurate mode's temp on a sharded decoder step for TPU is at most f32's (issue 35, 3c).

benchmarks/llm.py's Llama-style step at a small size (1 block, d 256, SwiGLU and vocab
64, 2 sequences of 3072 tokens), FSDP 2 x TP 2, compiled without a device for a TPU v5e
2x2 slice; XLA's ``memory_analysis()`` is a compile-time fact. Smaller attention fits
v5e's 128 MiB of VMEM and reports 0 B of temp (1024 tokens, or 2 sequences of 2048); the
narrow MLP and head shorten libtpu's code generation, most of the compile's time.
XLA:TPU runs an f32 dot at DEFAULT precision as one bf16 pass
(``Target.f32_dot_runs_as``), so the accurate mode's converts would only change what XLA
stores: one bf16 convert that two dots read (the softmax backward's gradient, read by
the dQ and dK dots) is a copy XLA:TPU stores, where from the f32 value it fuses the
producer into each dot. insert_converts leaves every such dot f32 there; with only the
dots that share an operand left f32 this step's temp equalled f32's, and the benchmark's
16-layer step for v5e-16 stayed 0.2 MiB above it (2,382.4 MiB against 2,382.2); with
none, 99,558,912 B against f32's 84,262,912 here (2,549.0 MiB on v5e-16). Under
``reduce=bfloat16`` the kept dots whose sums cross devices return bf16 (comm_precision).
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import llm

CONFIG = dataclasses.replace(llm.Config(), layers=1, dim=256, heads=4, kv_heads=2,
                             hidden=64, vocab=64, seq=3072, batch=2, scan_layers=False)
TARGET, AXES = "tpu-v5e:2x2", {"fsdp": 2, "tp": 2}


@pytest.fixture(scope="module")
def f32_temp() -> int:
    return int(llm.compile_variant("f32", TARGET, CONFIG, AXES)
               .memory_analysis().temp_size_in_bytes)


@pytest.fixture(scope="module")
def accurate() -> object:
    return llm.compile_variant("hlo_amp bf16", TARGET, CONFIG, AXES)


def test_accurate_mode_temp_is_at_most_f32s(f32_temp: int, accurate: object) -> None:
    temp = int(accurate.memory_analysis().temp_size_in_bytes)
    assert 0 < temp <= f32_temp, (temp, f32_temp)


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
