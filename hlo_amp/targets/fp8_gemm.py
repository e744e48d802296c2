"""The fp8 GEMM form: what XLA turns into an fp8 GEMM, the only one XLA has (XLA:GPU's
cuBLASLt call on Hopper and Ada), and the rule per dot that `Target.fp8_obstacle` applies.

insert_converts asks the target per dot whether it can take the form (else it falls back
to the compute dtype with the reason) and the fp8 pass writes the fp8 operands and their
scales. Nothing here depends on the machine the program runs on.

What this relies on, read from XLA's sources (openxla/xla, as vendored in
tensorflow/tensorflow, 2025):

- ``xla/service/gpu/transforms/gemm_rewriter.cc``: with ``GemmRewriterOptions::kFp8Only``
  (run before the Triton GEMM fusion) ``HandleDot`` rewrites a dot into the
  ``__cublas$lt$matmul$f8`` custom call when ``MatchFp8Param`` matches *both* operands:
  walking up from the dot operand, an fp8 value (the direct form the fp8 pass writes), or
  a ``convert`` of one to a wider type ``multiply``-ed (either order) or ``divide``-d by a
  ``broadcast`` of a *scalar* scale, through only ops that commute with dequantisation (bitcast, broadcast, copy, dynamic-slice,
  pad, reshape, select with a zero operand, slice, transpose; all-gather, all-to-all and
  collective-permute under SPMD). ``CreateF8CustomCall`` then requires: compute
  capability >= 8.9 (Ada/Hopper) and CUDA >= 12; both fp8 types in {F8E4M3FN, F8E5M2}
  and *not both* F8E5M2; scales scalar (converted to f32 if needed); output type BF16,
  F16 or F32 (or fp8); exactly one contracting dimension per operand and operands of
  rank batch + 2 (one free dimension each) after canonicalisation. It pads every
  non-batch dimension to a multiple of 16 (cuBLASLt's fp8 requirement) and slices the
  result back. The scales become the custom call's a_scale/b_scale operands, and the
  multiply of the result by a broadcast scalar scale product is folded into the call.
- ``xla/hlo/transforms/expanders/dot_decomposer.cc`` (run early by
  ``xla/service/gpu/gpu_compiler.cc``, after ``DotDimensionSorter``): any dot that is not
  canonical is rewritten as transpose + reshape of each operand into
  ``[batch, free, contracting]`` with the batch dimensions first, several contracting
  (or free) dimensions merged into one. Transpose and reshape commute with
  dequantisation, so several contracting dimensions, non-leading batch dimensions and
  rank-3 activations all reach the fp8 GEMM. What it cannot give the GEMM is a free
  dimension where the operand has none (or only size-1 ones): it drops a free product
  of 1, the operand's rank falls to batch + 1 and ``CreateF8CustomCall`` refuses it.

Hence the per-dot rule here (``fp8_obstacle``): static shapes; f32/bf16/f16 operands and
result; per operand a contracting and a free dimension, and after merging (the
canonical m, k, n) every one of them at least 16 -- below that the GEMM is padded to 16
and runs mostly on zeros, and matrix-vector products go to XLA's gemv path instead.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import element_type
from hlo_amp.targets.dot_dims import dot_layout

# Largest finite value of each fp8 format (ml_dtypes' finfo(...).max).
FP8_MAX = {"f8E4M3FN": 448.0, "f8E5M2": 57344.0}
# How a dot's report reason starts when it could not take the fp8 GEMM form.
FP8_FALLBACK = "fp8 fallback"

# cuBLASLt fp8 GEMMs pad every non-batch dimension to a multiple of this.
MIN_GEMM_EXTENT = 16
_WIDE_TYPES = ("f32", "bf16", "f16")


def fp8_obstacle(op: Any) -> str | None:
    """Why ``op`` (a ``stablehlo.dot_general``) cannot run as an XLA:GPU fp8 GEMM, in
    words for the report; None when it can."""
    types = [str(element_type(v)) for v in list(op.operands)[:2]] + [
        str(element_type(op.result))]
    if any(t == "f64" for t in types):
        return "f64 dot (the fp8 GEMM dequantises to f32, bf16 or f16)"
    if any(t not in _WIDE_TYPES for t in types):
        return f"{'x'.join(types[:2])}->{types[2]} dot (the fp8 GEMM takes f32, bf16, f16)"
    layout = dot_layout(op)
    if layout is None or not isinstance(op.result.type, ir.RankedTensorType) or any(
            size < 0 for size in ir.RankedTensorType(op.result.type).shape):
        return "dynamic shape"
    if not layout.lhs_contracting:
        return "no contracting dimension (an outer product)"
    m, k, n = layout.mkn
    if not layout.lhs_free or not layout.rhs_free or m == 1 or n == 1:
        return ("a matrix-vector product (the fp8 GEMM needs a free dimension on each "
                "operand)")
    small = [f"{name}={size}" for name, size in (("m", m), ("k", k), ("n", n))
             if size < MIN_GEMM_EXTENT]
    if small:
        return (f"{', '.join(small)} under {MIN_GEMM_EXTENT} (cuBLASLt pads fp8 GEMMs to "
                f"multiples of {MIN_GEMM_EXTENT})")
    return None


def dequantized_format(value: ir.Value) -> str | None:
    """The fp8 type of an operand already in fp8: an fp8 tensor (the direct form the fp8
    pass writes), or ``convert(q: fp8) * broadcast(scale)`` (either order, the
    dequantised form the GEMM rewriter also matches); else None."""
    own = str(element_type(value))
    if own in FP8_MAX:
        return own
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.name != "stablehlo.multiply":
        return None
    found = None
    names = []
    for operand in owner.operands:
        producer = operand.owner
        name = "" if isinstance(producer, ir.Block) else producer.name
        names.append(name)
        if name == "stablehlo.convert":
            source = str(element_type(producer.operands[0]))
            if source in FP8_MAX:
                found = source
    return found if found and "stablehlo.broadcast_in_dim" in names else None
