"""The site rules of insert_converts: what to do to one matrix op (a `Plan`) under the
action the policy decided for it: compute, a dtype, keep, or an fp8 format (the fp8
GEMM's conditions are `Target.fp8_obstacle`'s), with the target's ``only_if_faster``
and 16-bit result forms."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import chlo
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import defining_op, element_count, element_type, is_attention_matmul
from hlo_amp.policy import (
    COMPUTE,
    DTYPE_BITS,
    DTYPE_TO_ELEMENT,
    FP8_E5M2,
    FP8_SHORT,
    FP8_TO_ELEMENT,
    KEEP,
    Policy,
    is_fp8,
)
from hlo_amp.targets import NO_TARGET, Target
from hlo_amp.targets.fp8_gemm import FP8_FALLBACK, dequantized_format
from hlo_amp.targets.roofline import window_products


def estimate_flops(op: Any, kind: str) -> int | None:
    """2 × multiply-adds of a dot or conv; None when a shape is dynamic."""
    result = ir.RankedTensorType(op.result.type)
    if not result.has_static_shape:
        return None
    out = 1
    for size in result.shape:
        out *= size
    lhs = ir.RankedTensorType(op.operands[0].type)
    rhs = ir.RankedTensorType(op.operands[1].type)
    if not (lhs.has_static_shape and rhs.has_static_shape):
        return None
    if kind == "dot_general":
        numbers = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        contracted = 1
        for dim in numbers.lhs_contracting_dimensions:
            contracted *= lhs.shape[dim]
        return 2 * out * contracted
    if kind == "dot":
        return 2 * out * (lhs.shape[-1] if lhs.rank else 1)
    if kind == "ragged_dot":
        return _ragged_dot_flops(op, lhs, rhs)
    return _conv_flops(op, lhs, rhs, result)


def _conv_flops(op: Any, lhs: ir.RankedTensorType, rhs: ir.RankedTensorType,
                result: ir.RankedTensorType) -> int:
    """2 × the products a ``stablehlo.convolution`` computes: per output batch element and
    feature, the kernel's input features times, along each spatial dimension, the
    window positions that land on an input element (not on padding or on the holes of
    ``lhs_dilation``: a transposed convolution, a strided one's input gradient), as
    XLA's cost analysis and the roofline count them."""
    numbers = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    spatial = len(numbers.output_spatial_dimensions)

    def window(name: str, default: int) -> list[int]:
        if name not in op.attributes:
            return [default] * spatial
        return list(ir.DenseI64ArrayAttr(op.attributes[name]))

    strides, lhs_dilation, rhs_dilation = (window("window_strides", 1),
                                           window("lhs_dilation", 1), window("rhs_dilation", 1))
    padding = (list(ir.DenseIntElementsAttr(op.attributes["padding"]))
               if "padding" in op.attributes else [0] * 2 * spatial)
    products = (result.shape[numbers.output_batch_dimension]
                * result.shape[numbers.output_feature_dimension]
                * rhs.shape[numbers.kernel_input_feature_dimension])
    for d in range(spatial):
        products *= window_products(
            result.shape[numbers.output_spatial_dimensions[d]],
            lhs.shape[numbers.input_spatial_dimensions[d]],
            rhs.shape[numbers.kernel_spatial_dimensions[d]],
            strides[d], lhs_dilation[d], rhs_dilation[d], padding[2 * d])
    return 2 * products


def _ragged_dot_flops(op: Any, lhs: ir.RankedTensorType, rhs: ir.RankedTensorType) -> int:
    """A ``chlo.ragged_dot``: every lhs element meets each rhs column of its one group,
    2 × lhs × (rhs's dimensions neither contracting, group nor batch) in each of its
    modes. ``2 × result × contracted`` would count the ragged-contracting mode's
    ``[groups, k, n]`` result once per group too many."""
    numbers = chlo.RaggedDotDimensionNumbers(op.attributes["ragged_dot_dimension_numbers"])
    shared = {*numbers.rhs_contracting_dimensions, *numbers.rhs_group_dimensions,
              *numbers.rhs_batching_dimensions}
    return 2 * math.prod(lhs.shape) * math.prod(
        size for dim, size in enumerate(rhs.shape) if dim not in shared)


def float_bits(element: ir.Type | None) -> int | None:
    """Bit width of a float element type; None for int, complex, bool, unranked."""
    if element is None or not isinstance(element, ir.FloatType):
        return None
    return ir.FloatType(element).width



# Why a real op of a complex product stays as written: jax lowers a complex convolution
# as three real ones (Gauss's trick, jax/_src/lax/convolution.py) whose results are
# subtracted, so in 16 bit a small imaginary part was mostly rounding (1.59 relative
# error under bf16), where a complex op is never touched.
COMPLEX_PART = ("part of a complex product (jax computes a complex convolution as three "
                "real ones whose sums cancel): complex ops stay as written")
_COMPLEX_PARTS = frozenset({"stablehlo.real", "stablehlo.imag"})


def _complex_product_part(op: Any) -> bool:
    """Whether both operands of ``op`` (a convolution: jax writes Gauss's trick for those
    alone) are real or imaginary parts of complex values, or a sum or difference of two
    such parts (``(re + im) * re``)."""
    operands = list(op.operands)[:2]
    return len(operands) == 2 and all(_complex_part(v, sums=True) for v in operands)


def _complex_part(value: ir.Value, sums: bool) -> bool:
    """Whether ``value`` is a real or imaginary part (or, with ``sums``, a sum or
    difference of two). Module level: a nested recursive function is a reference cycle
    per call, garbage the passes must not leave (tests/py/test_pass_cost.py)."""
    owner = defining_op(value)
    if owner is None:
        return False
    if owner.name in _COMPLEX_PARTS:
        return True
    return sums and owner.name in ("stablehlo.add", "stablehlo.subtract") and all(
        _complex_part(v, sums=False) for v in owner.operands)


class TypeNames:
    """``str`` of element types, printed once per type (printing a type is slow)."""

    def __init__(self) -> None:
        self._names: dict[Any, str] = {}

    def name(self, element: ir.Type | None) -> str:
        found = self._names.get(element)
        if found is None:
            found = self._names[element] = str(element)
        return found


@dataclass(frozen=True)
class Plan:
    """The decision for one candidate op, before any IR is touched."""

    action: str | None
    rule: str
    operand_targets: tuple[str | None, ...]  # per operand: new element type or None
    result_target: str | None  # new result element type, or None to keep it
    reason: str
    # fp8: the (lhs, rhs) fp8 element types and the dequantise type D (the type the
    # scales are rounded to); the fp8 pass writes the quantisation and the direct-form
    # dot. None for every other plan.
    fp8: tuple[str, str, str] | None = None
    # An f32 dot kept f32 because the target runs it as one pass of this 16-bit element
    # type anyway (left_to_the_target); comm_precision reads it (Decision.runs_as).
    runs_as: str | None = None


def plan_op(op: Any, kind: str, policy: Policy, action: str | None, rule: str,
            target: Target = NO_TARGET,
            elements: tuple[list[ir.Type | None], ir.Type | None] | None = None,
            gradient: int | None = None, backward: bool = False) -> Plan:
    """What to do to one op under ``action``, given its operand and result types
    (``elements``: the element types of its first two operands and of its result, when
    the caller has read them already). For fp8 actions, ``gradient`` is the operand that
    carries the incoming gradient of a ``backward`` dot (None: no single one)."""
    if elements is None:
        elements = ([element_type(v) for v in list(op.operands)[:2]],
                    element_type(op.result))
    if kind == "convolution" and action not in (None, KEEP) and _complex_product_part(op):
        return Plan(action, rule, (None,) * len(elements[0]), None, COMPLEX_PART)
    if is_fp8(action):
        return _plan_fp8(op, kind, policy, action, rule, target, elements, gradient,
                         backward)
    operands, result = elements
    bits = [float_bits(t) for t in operands]
    result_bits = float_bits(result)
    none = (None,) * len(operands)
    if action is None:
        return Plan(action, rule, none, None, "no rule for this op kind")
    if action == KEEP:
        return Plan(action, rule, none, None, "kept as written")
    already = _program_fp8(op, kind, operands)
    if already is not None:
        # The program quantised both operands itself (Flax's fp8 ops): a 16-bit convert
        # between the dequantisation and the dot would hide the fp8 GEMM from XLA.
        return Plan(action, rule, none, None, ALREADY_FP8, fp8=already)
    if any(b is None for b in bits) or result_bits is None:
        return Plan(action, rule, none, None, "not a float op")
    # f64 only with f64=true, whatever the action (docs/policies.md).
    if 64 in bits + [result_bits] and not policy.include_f64:
        return Plan(action, rule, none, None, "f64 op (not asked: f64=true)")
    if action == COMPUTE:
        target_bits = DTYPE_BITS[policy.compute_dtype]
        targets = _to_compute(bits, policy)
        compute = DTYPE_TO_ELEMENT[policy.compute_dtype]
        # In the mixed_* modes the propagation pass gives such ops their 16-bit result.
        result_target = (compute if target.low_result(kind) and not
                         policy.propagate and result_bits > target_bits else None)
        if all(t is None for t in targets) and result_target is None:
            return Plan(action, rule, none, None, "already low precision")
        slower = policy.only_if_faster and target.slower_in_16bit(op, kind,
                                                                  policy.compute_dtype)
        if slower:
            return Plan(action, rule, none, None, slower)
        if result_target is not None:
            return Plan(action, rule, targets, result_target,
                        f"{compute} operands and result (cuDNN's form), converted to "
                        f"{result}")
        if result_bits == 64 and not target.accumulates_16bit_into_f64(kind):
            return Plan(action, rule, targets, "f32",
                        f"{compute} operands, f32 accumulation, converted to {result} "
                        f"(no {compute} GEMM into f64 on this target)")
        return Plan(action, rule, targets, None, f"{compute} operands, {result} accumulation")
    # As under compute, no 16-bit action on an op whose operands are 16-bit already (a
    # bf16 dot of the program went to f16 under scope:s=float16; one accumulating to an
    # f32 result, a model with bf16 parameters, overflowed f16 there: inf).
    if DTYPE_BITS[action] <= 16 and max(bits) <= 16:
        return Plan(action, rule, none, None, "already low precision")
    element = DTYPE_TO_ELEMENT[action]
    targets = tuple(element if str(t) != element else None for t in operands)
    result_target = element if str(result) != element else None
    if all(t is None for t in targets) and result_target is None:
        return Plan(action, rule, none, None, f"already {action}")
    return Plan(action, rule, targets, result_target, f"forced to {action}")


_E4M3, _E5M2 = FP8_TO_ELEMENT["float8_e4m3fn"], FP8_TO_ELEMENT[FP8_E5M2]
# Why an unfused attention's matmul (passes/fused_attention/ marks them) is not fp8 under
# an op rule: the fused kernel runs attention in the 16-bit compute type, and so do the
# fp8 recipes this follows (Transformer Engine, Flax: fp8 for the dense layers' GEMMs).
ATTENTION_FALLBACK = ("an attention's matmul, not fused (the report's attention section "
                      "says why): 16-bit as the fused kernel runs it; a scope rule can ask "
                      "for fp8")
# Why a ragged_dot (a mixture of experts' grouped matmul) under an fp8 action computes in
# the 16-bit compute type: the fp8 pass writes a dense dot_general's scaled form only.
RAGGED_DOT_NO_FP8 = "ragged_dot: no fp8 form yet (the fp8 pass scales dense dot_generals)"
# The reason of a dot whose operands already are fp8 (the direct form: the pipeline run on
# its own output), or dequantised fp8: nothing to do, but the report still shows the fp8
# types.
ALREADY_FP8 = "already fp8"


def _plan_fp8(op: Any, kind: str, policy: Policy, action: str, rule: str,
              target: Target, elements: tuple[list[ir.Type | None], ir.Type | None],
              gradient: int | None, backward: bool) -> Plan:
    """An fp8 plan for a dot that can run as an XLA:GPU fp8 GEMM; else the compute
    dtype's plan with the reason the dot cannot."""
    operands, result = elements
    none = (None,) * len(operands)
    bits = [float_bits(t) for t in operands]
    if any(b is None for b in bits) or float_bits(result) is None:
        return Plan(action, rule, none, None, "not a float op")
    already = _program_fp8(op, kind, operands)
    if already is not None:
        return Plan(action, rule, none, None, ALREADY_FP8, fp8=already)
    obstacle = (RAGGED_DOT_NO_FP8 if kind == "ragged_dot"
                else f"fp8 takes dot_general only, not {kind}" if kind != "dot_general"
                else ATTENTION_FALLBACK if rule.startswith("op:") and is_attention_matmul(op)
                else target.fp8_obstacle(op))
    if obstacle is not None:
        fallback = plan_op(op, kind, policy, COMPUTE, rule, target, elements)
        return dataclasses.replace(fallback, action=action,
                                   reason=f"{FP8_FALLBACK}: {obstacle}; {fallback.reason}")
    slower = policy.only_if_faster and target.fp8_slower()
    if slower:
        return Plan(action, rule, none, None, slower)
    # The fast mode quantises from 16-bit operands (so propagation keeps their producers
    # 16-bit), the accurate mode from what the program wrote.
    targets = _to_compute(bits, policy) if policy.propagate else none
    if policy.only_if_faster:  # per GEMM: does its fp8 form save what quantising costs?
        flops = estimate_flops(op, kind)
        read = [DTYPE_BITS[policy.compute_dtype] if t else b for t, b in zip(targets, bits)]
        loses = flops is not None and target.fp8_loses(
            flops, [(element_count(v) / _dots_reading(v), b)
                    for v, b in zip(list(op.operands)[:2], read)])
        if loses:
            fallback = plan_op(op, kind, policy, COMPUTE, rule, target, elements)
            return dataclasses.replace(fallback, action=action,
                                       reason=f"{FP8_FALLBACK}: {loses}; {fallback.reason}")
    formats = [_E4M3, _E4M3]
    how = ""
    if action == FP8_E5M2 and backward:
        if gradient is None:
            how = " (no single incoming-gradient operand found: e4m3fn for both)"
        else:
            formats[gradient] = _E5M2
            how = f" ({('lhs', 'rhs')[gradient]} is the incoming gradient)"
    # The dequantise type D: the type the scales are rounded to (Target.fp8_dequantize
    # says why, per target).
    result_name = str(result)
    dequantize = target.fp8_dequantize(result_name, policy.compute_dtype)
    # An f16 result is computed and scaled in f32, then converted (passes/fp8.py).
    made = "f32 result, converted to f16" if result_name == "f16" else f"{result_name} result"
    return Plan(action, rule, targets, None,
                f"fp8 {FP8_SHORT[formats[0]]} x {FP8_SHORT[formats[1]]}{how}, per-tensor "
                f"{dequantize} scales, {made}",
                fp8=(formats[0], formats[1], dequantize))


def _program_fp8(op: Any, kind: str, operands: list[ir.Type | None]
                 ) -> tuple[str, str, str] | None:
    """A dot whose operands are both fp8 or dequantised fp8: their fp8 types and the
    dequantised type (``Plan.fp8``); else None."""
    if kind != "dot_general":
        return None
    already = tuple(dequantized_format(v) for v in list(op.operands)[:2])
    if not all(already):
        return None
    return already[0], already[1], str(operands[0])


def _to_compute(bits: list[int], policy: Policy) -> tuple[str | None, ...]:
    """Per operand of these float widths: the compute dtype's element type where it is
    narrower, else None (the operand stays)."""
    width = DTYPE_BITS[policy.compute_dtype]
    return tuple(DTYPE_TO_ELEMENT[policy.compute_dtype] if b > width else None
                 for b in bits)


def _dots_reading(value: ir.Value) -> int:
    """How many dot_general ops read ``value``: its one quantisation serves them all
    (passes/fp8.py shares it per block), so each is charged its share."""
    return max(1, sum(1 for use in value.uses
                      if use.owner.operation.name == "stablehlo.dot_general"))
