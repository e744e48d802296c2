"""The fast mode leaves XLA's partitioning plan as the hand cast's (issue 48).

A Llama-style step written plainly, without activation constraints (tests/py/
plain_decoder.py: parameters fsdp x tp, tokens on fsdp), compiled without devices. Before
the fix, on 8 H100s the mixed mode's select in place of the label pick's scatter
(passes/scatter_select.py) carried the token batch's sharding only late in Shardy's
propagation: the backward pass took the embedding table's model-dimension sharding, the
weights stayed sharded and every layer's activations were all-reduced. Measured here
before the fix: 215.6 against 102.2 MiB of temp (pytree), 316.2 against 107.7 (NNX),
263.2 against 240.2 (scanned, h100:2x8); the property test failed too, the TPU and
accurate-mode cases passed. And the pipeline's bf16 copy of a replicated norm scale was
sharded on the free fsdp axis and gathered back for the backward pass
(passes/keep_shardings.py).

Per case: per-device temp and collective bytes at most 1.02 times the hand cast's, and
the same collectives (kind, array shape, replica groups, executions) up to element type
(``plain_decoder.plan``). The accurate mode keeps f32 activations and f32 gradient sums
(docs/sharding.md), so its reference is the f32 step's plan.
"""

from __future__ import annotations

import dataclasses
import functools

import plain_decoder as pd
import pytest

# Wide enough that activations, not cuBLAS workspaces, set the temp. Five steps cover
# the forms (unrolled and scanned, GQA by repeat and by grouped einsum, pytrees
# and Flax NNX, the three targets) at two compiles each: every compile is seconds of
# the suite's time.
MEDIUM = pd.Cfg(dim=512, hidden=1408, vocab=4096, seq=512)
CASES = {
    "h100x8, pytree, unrolled, repeat": ("h100x8", MEDIUM),
    "h100x8, nnx, unrolled, einsum": ("h100x8", dataclasses.replace(MEDIUM, front="nnx",
                                                                      gqa="einsum")),
    # MaxText's scanned form: the blocks rematerialised.
    "h100:2x8, pytree, scanned, repeat": ("h100:2x8", dataclasses.replace(
        MEDIUM, scan=True, remat=True, layers=2)),
    # Scanned without remat the forward loop stacks each layer's residuals: 1.054 times
    # the hand cast's temp at the widths, from the silu's f32 values, until the
    # backward loop recomputed them (passes/stacked_residuals.py). One KV head, its head
    # dimension split over the TP pair: the roped K's repeat was taken for a statistic's
    # spread (f32, gathered over TP twice more), and a copy of a norm's output made from
    # its stacked statistic gathered that statistic over fsdp.
    "h100x8, pytree, scanned without remat, one KV head": ("h100x8", dataclasses.replace(
        MEDIUM, scan=True, layers=2, kv_heads=1)),
    # XLA:TPU compiles slowly: the small default size, whose temp is 0 there; its plan is
    # what moved when the select carried the scatter's sharding on TPU.
    "tpu-v5e:4x4, pytree, unrolled, repeat": ("tpu-v5e:4x4", pd.Cfg()),
}
SLACK = 1.02


@functools.cache
def _compiled(case: str, variant: str) -> tuple[int, int, object]:
    """(temp bytes, collective bytes, plan) of ``variant`` of ``case``."""
    target, cfg = CASES[case]
    compiled = pd.compile_step(cfg, variant, target)
    text = compiled.as_text()
    return (int(compiled.memory_analysis().temp_size_in_bytes), pd.collective_bytes(text),
            pd.plan(text))


@pytest.mark.parametrize("case", list(CASES))
def test_fast_mode_keeps_the_hand_casts_plan(case: str) -> None:
    temp, moved, plan = _compiled(case, "mixed_bfloat16")
    hand_temp, hand_moved, hand_plan = _compiled(case, "hand")
    assert hand_moved > 0 and plan, case  # a sharded step that moves data at all
    assert temp <= SLACK * hand_temp, (case, temp, hand_temp)
    assert moved <= SLACK * hand_moved, (case, moved, hand_moved)
    assert plan == hand_plan, (case, plan - hand_plan, hand_plan - plan)


def test_accurate_mode_keeps_the_f32_plan() -> None:
    case = "h100x8, pytree, unrolled, repeat"
    temp, moved, plan = _compiled(case, "bf16")
    f32_temp, f32_moved, f32_plan = _compiled(case, "f32")
    assert temp <= SLACK * f32_temp, (temp, f32_temp)
    assert moved <= SLACK * f32_moved, (moved, f32_moved)
    assert plan == f32_plan, (plan - f32_plan, f32_plan - plan)
