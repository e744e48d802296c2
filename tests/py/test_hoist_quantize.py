"""passes/hoist_quantize.py on real fp8 steps: a scanned, checkpointed model's weights are
quantised once per step before the forward loop, each layer by its own scale, and the
step computes the same bits as without the pass, under current and delayed scaling
(tests/lit/hoist_quantize.mlir has the IR)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jaxlib.mlir import ir
from test_hoist_amax import (
    ALL,
    _args,
    _assert_same_bits,
    _compiled_with_count,
    _scan_step,
    _three_steps,
)

import hlo_amp
from hlo_amp.ir.loops import enclosing_while
from hlo_amp.ir.modules import parse_module, walk_operations
from hlo_amp.ir.sites import location_name, parse_name
from hlo_amp.passes.hoist_quantize import HoistQuantize

_FP8 = ("f8E4M3FN", "f8E5M2")


def _quantisations(text: str) -> dict[str, int]:
    """fp8 converts of the model's (3, 32, 32) weight stacks outside any loop, and of a
    (32, 32) weight in the forward and the backward loops' bodies, or elsewhere (the
    loops' callees, and ``w_in`` in main)."""
    counts = {"stack": 0, "forward": 0, "backward": 0, "elsewhere": 0}
    module = parse_module(text)  # held: its ops live as long as it does
    for op in walk_operations(module.operation, names=frozenset({"stablehlo.convert"})):
        result = ir.RankedTensorType(op.results[0].type)
        if str(result.element_type) not in _FP8 or result.shape not in ([3, 32, 32],
                                                                         [32, 32]):
            continue
        loop = enclosing_while(op)
        if result.shape == [3, 32, 32]:
            counts["stack"] += loop is None
        elif loop is None:
            counts["elsewhere"] += 1
        else:
            backward = parse_name(location_name(loop.location), "while").backward
            counts["backward" if backward else "forward"] += 1
    return counts


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_step_is_the_same_bits_with_the_weights_quantised_before_the_loop(
        scaling, monkeypatch):
    policy = f"fp8,scaling={scaling},{ALL}"
    p, x = _args()
    hoisted, lowered, count, note = _compiled_with_count(_scan_step, scaling, (p, x),
                                                         "hoist-quantize:")
    # The two stacked weights in the forward loop, and the recomputed layer's weight in
    # the backward loop (its quantisation in the remat'd function and in the body).
    assert count >= 3, note
    with_pass = _three_steps(hoisted, p, x)

    monkeypatch.setattr(HoistQuantize, "run", lambda self, module, report=None: None)
    in_loop = hlo_amp.compile(_scan_step, policy)
    text_in_loop = in_loop.lower(p, x).as_text(debug_info=True)
    # Before the pass each weight is quantised per layer in the loops (in their bodies
    # or in callees, as the jax version lowers remat); after it, once per stack before
    # the forward loop, and before the backward loop the weight its recomputed forward
    # dot reads (the forward's stack again); the other weight, which only the backward's
    # own dots read, per layer in the backward loop's body.
    before, after = _quantisations(text_in_loop), _quantisations(lowered.as_text(debug_info=True))
    assert before["stack"] == 0 and after["stack"] == 3, (before, after)
    assert after["forward"] == 0 and after["backward"] == 1, after
    assert sum(after.values()) - after["stack"] == sum(before.values()) - 3, (before, after)

    _assert_same_bits(with_pass, _three_steps(in_loop, p, x), hoisted, in_loop, scaling)
    # The layers' magnitudes differ 16-fold: a stack quantised with one layer's scale,
    # or scales along the wrong axis, changes the bits; and the steps moved the weights.
    assert not np.array_equal(with_pass[-1][1][0], np.asarray(jax.tree.leaves(p)[0]))
