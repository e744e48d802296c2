"""passes/hoist_quantize.py on real fp8 steps: a scanned, checkpointed model's weights are
quantised once per step before the forward loop, each layer by its own scale, and the
step computes the same bits as without the pass, under current and delayed scaling
(tests/lit/hoist_quantize.mlir has the IR)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
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
from hlo_amp.passes import hoist_quantize
from hlo_amp.passes.hoist_quantize import HoistQuantize
from hlo_amp.targets.hlo_text import parse_module as parse_hlo

_FP8 = ("f8E4M3FN", "f8E5M2")


def _quantisations(text: str) -> dict[str, int]:
    """fp8 converts of the model's (3, 32, 32) weight stacks outside any loop, and of a
    (32, 32) weight in the forward and the backward loops' bodies (``fenced``: of those
    in the backward body, the ones read through a layout fence), or elsewhere (the
    loops' callees, and ``w_in`` in main)."""
    counts = {"stack": 0, "forward": 0, "backward": 0, "fenced": 0, "elsewhere": 0}
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
            counts["fenced"] += backward and _read_through_fence(op.results[0])
    return counts


def _read_through_fence(value: ir.Value) -> bool:
    """Whether a reader of ``value`` is a reshape to 1-D feeding an optimization_barrier
    (ir/layouts.py's fence)."""
    for use in value.uses:
        if use.owner.name != "stablehlo.reshape":
            continue
        flat = use.owner.results[0]
        if (ir.RankedTensorType(flat.type).rank == 1
                and [u.owner.name for u in flat.uses] == ["stablehlo.optimization_barrier"]):
            return True
    return False


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_step_is_the_same_bits_with_the_weights_quantised_before_the_loop(
        scaling, monkeypatch):
    policy = f"fp8,scaling={scaling},{ALL}"
    p, x = _args()
    hoisted, lowered, count, note = _compiled_with_count(_scan_step, scaling, (p, x),
                                                         "hoist-quantize:")
    # The two stacked weights in the forward loop.
    assert count >= 2, note
    (fence_note,) = [n for n in lowered.report().notes if n.startswith("hoist-quantize fence:")]
    with_pass = _three_steps(hoisted, p, x)

    monkeypatch.setattr(HoistQuantize, "run", lambda self, module, report=None: None)
    in_loop = hlo_amp.compile(_scan_step, policy)
    text_in_loop = in_loop.lower(p, x).as_text(debug_info=True)
    # Before the pass each weight is quantised per layer in the loops (in their bodies
    # or in callees, as the jax version lowers remat); after it, once per stack before
    # the forward loop, and per layer in the backward loop's body: the weight its
    # recomputed forward dot reads behind a layout fence, the other weight, which only
    # the backward's own dots read, as it was. No stack is held over the backward loop.
    before, after = _quantisations(text_in_loop), _quantisations(lowered.as_text(debug_info=True))
    assert before["stack"] == 0 and after["stack"] == 2, (before, after)
    assert after["forward"] == 0 and after["backward"] == 2, after
    assert before["fenced"] == 0 and after["fenced"] == 1, (before, after, fence_note)
    assert sum(after.values()) - after["stack"] - after["fenced"] == (
        sum(before.values()) - 2), (before, after)

    _assert_same_bits(with_pass, _three_steps(in_loop, p, x), hoisted, in_loop, scaling)
    # The layers' magnitudes differ 16-fold: a stack quantised with one layer's scale,
    # or scales along the wrong axis, changes the bits; and the steps moved the weights.
    assert not np.array_equal(with_pass[-1][1][0], np.asarray(jax.tree.leaves(p)[0]))


def _for_h100(monkeypatch, fence: bool) -> tuple[str, int]:
    """``_scan_step`` at width 256 (4 checkpointed layers, 256 x 1024) under fp8,
    compiled for an H100 without one, with or without the layout fence: (optimized HLO,
    temp bytes)."""
    if not fence:
        monkeypatch.setattr(hoist_quantize, "fenced", lambda value: value)
    f32 = jnp.float32
    params = {"w_in": jax.ShapeDtypeStruct((256, 256), f32),
              "layers": {"a": jax.ShapeDtypeStruct((4, 256, 1024), f32),
                         "b": jax.ShapeDtypeStruct((4, 1024, 256), f32)},
              "w_out": jax.ShapeDtypeStruct((256, 16), f32)}
    compiled = hlo_amp.compile(_scan_step, f"fp8,{ALL}").lower(
        params, jax.ShapeDtypeStruct((512, 256), f32), target="h100").compile()
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


# An f32 weight stack in a layout other than row-major: a transposed copy of it.
_TRANSPOSED_STACK = re.compile(r"f32\[4,(?:256,1024|1024,256)\]\{(?!2,1,0\})[0-9,]+\}")
_FP8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'


def _gpu_quantisations(hlo: str) -> list[list]:
    """The instructions of each computation of an optimized HLO that clamps and converts
    the clamped value to fp8 (a quantisation)."""
    found = []
    for body in parse_hlo(hlo)[0].values():
        by_name = {i.name: i for i in body}
        if any(i.op == "convert" and i.arrays and i.arrays[0].dtype.startswith("f8")
               and any(by_name.get(o) is not None and by_name[o].op == "clamp"
                       for o in i.operands) for i in body):
            found.append(body)
    return found


def test_xla_gpu_divides_by_the_scale_in_every_quantisation(monkeypatch):
    """The pass's bit-for-bit claim rests on XLA:GPU computing ``x / s`` as written,
    whether the scale is a scalar (a quantisation in a loop body) or a vector broadcast
    along the layers (one hoisted before the loop). XLA:CPU does not: its algebraic
    simplifier turns some divisions by a broadcast scale into products with the
    reciprocal and leaves others, so there a hoisted quantisation can round a value
    that sits at a tie of the fp8 grid the other way (docs/fp8.md)."""
    optimized, _ = _for_h100(monkeypatch, fence=True)
    quantisations = _gpu_quantisations(optimized)
    # The hoisted stacks, the forward's activations, the backward's fenced weights and
    # gradients.
    assert len(quantisations) >= 4, len(quantisations)
    for body in quantisations:
        assert any(i.op == "divide" and i.arrays[0].shape for i in body), [
            i.op for i in body]


def test_xla_gpu_transposes_the_fp8_slice_for_the_recomputed_forward_not_the_f32_stack(
        monkeypatch):
    """The recomputed forward's GEMM reads its fp8 weight transposed (Hopper's fp8 GEMMs
    take both operands K-major). Without the fence XLA:GPU's layout assignment carries
    the f32 stack into the backward loop in that layout, a whole-stack copy made before
    the loop; behind it XLA transposes each layer's fp8 slice, and every GEMM stays fp8."""
    fenced, fenced_temp = _for_h100(monkeypatch, fence=True)
    bare, bare_temp = _for_h100(monkeypatch, fence=False)
    assert _TRANSPOSED_STACK.findall(bare), "XLA no longer transposes the carried stack"
    assert not _TRANSPOSED_STACK.findall(fenced), _TRANSPOSED_STACK.findall(fenced)
    assert fenced_temp < bare_temp, (fenced_temp, bare_temp)
    assert fenced.count(_FP8_GEMM) == bare.count(_FP8_GEMM) > 0
    assert "__cublas$gemm" not in fenced and 'matmul"' not in fenced
