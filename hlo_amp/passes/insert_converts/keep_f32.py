"""The accurate mode's rules that leave an all-f32 matrix op f32 where converting it
gains nothing on the target: a dot the target runs as one 16-bit pass anyway
(`Target.f32_dot_runs_as`: TPU), and an op bound by its result's bytes whose 16-bit
form the target writes once more (`Target.writes_16bit_form_twice`: GPU). Each takes
the op's `Plan` and returns it, kept or changed."""

from __future__ import annotations

import dataclasses
from typing import Any

from hlo_amp.ir.modules import element_count, is_public, live_uses
from hlo_amp.ir.op_classes import MATRIX_OP_NAMES
from hlo_amp.ir.sites import operand_precisions
from hlo_amp.passes.insert_converts.plan import Plan, TypeNames
from hlo_amp.policy import COMPUTE, DTYPE_TO_ELEMENT, Policy
from hlo_amp.targets import Target


def _at_default_precision(op: Any) -> bool:
    """Whether ``op`` leaves its precision to the backend: no algorithm, and a precision
    config absent or DEFAULT on every operand (not HIGH, not HIGHEST)."""
    entries = operand_precisions(op)
    return entries is not None and all("DEFAULT" in entry for entry in entries)


_DOT_KINDS = frozenset({"dot_general", "dot"})


def _accurate_f32_conversion(plan: Plan, policy: Policy, elements: tuple,
                             names: TypeNames) -> bool:
    """Whether ``plan`` is the accurate mode's conversion of an all-f32 matrix op (what
    the two rules below may leave f32): not the mixed modes, not fp8, something to
    convert."""
    return (not policy.propagate and plan.action == COMPUTE and plan.fp8 is None
            and (any(plan.operand_targets) or plan.result_target is not None)
            and all(names.name(t) == "f32" for t in (*elements[0], elements[1])))


def left_to_the_target(op: Any, kind: str, elements: tuple, plan: Plan, policy: Policy,
                        target: Target, names: TypeNames) -> Plan:
    """``plan`` for one op, with the accurate mode's f32×f32 dots left f32 where the
    target runs them as one pass of the compute dtype anyway (``Target.f32_dot_runs_as``:
    XLA:TPU at DEFAULT precision): the same arithmetic without a 16-bit copy in the
    program. XLA:TPU places its own converts (its optimized f32 program already shows
    most dots with bf16 operands); one of ours only changes what it fuses and stores: a
    bf16 convert that two dots share is a copy it stores (the softmax backward's
    gradient, read by the dQ and dK dots: 256 MiB per device on benchmarks/llm.py's v5e-16
    step), and the dots with their own operands converted still left that step's temp
    0.2 MiB above f32's. Not in the mixed modes (propagate seeds its 16-bit regions from
    the converted dots). The kept plan names the type the dot runs as (``Plan.runs_as``,
    then ``Decision.runs_as``): under a 16-bit ``reduce=`` comm_precision gives a kept dot
    whose sum crosses devices that result type, as it does a converted one."""
    why = target.f32_dot_runs_as(policy.compute_dtype)
    if (why is None or kind not in _DOT_KINDS or plan.result_target is not None
            or not _accurate_f32_conversion(plan, policy, elements, names)
            or not _at_default_precision(op)):
        return plan
    return dataclasses.replace(plan, operand_targets=(None,) * len(plan.operand_targets),
                               runs_as=DTYPE_TO_ELEMENT[policy.compute_dtype],
                               reason=f"kept f32: {why}")


def kept_for_its_result(op: Any, kind: str, elements: tuple, plan: Plan, policy: Policy,
                         target: Target, names: TypeNames) -> Plan:
    """``plan`` for one op, with the accurate mode's f32 matrix ops left f32 where the
    result outweighs the operands (as many elements or more: a weight gradient over a
    small batch, a squeeze-excite's or a 1x1 head's filter gradient) and the target
    writes the 16-bit form's result once more than f32's (``Target.
    writes_16bit_form_twice``: cuDNN's 16-bit convolution result, cuBLAS's padded GEMM).
    Such an op is bound by its result's bytes: rounding its operands saves at most half
    of theirs, fewer than the extra result costs, in time and in memory (the f32 weight
    gradient of a 1x1 convolution on 1x1 pixels, Keras MobileNetV3Small's head, is
    written by the convolution into the buffer the optimizer updates in place; its bf16
    form wrote a 1.1 MiB bf16 copy first). Not in the mixed modes, which write a 16-bit
    result anyway, as the hand cast does."""
    if not _accurate_f32_conversion(plan, policy, elements, names):
        return plan
    sizes = [element_count(value) for value in (*list(op.operands)[:2], op.result)]
    if None in sizes or sizes[2] < sizes[0] + sizes[1]:
        return plan
    why = target.writes_16bit_form_twice(op, kind)
    if why is None or not _read_on_the_way_out(op):
        return plan
    return dataclasses.replace(
        plan, operand_targets=(None,) * len(plan.operand_targets), result_target=None,
        reason=f"kept f32: its result outweighs its operands and {why}")


# Ops whose readers the walk below does not follow: any of them may lead to a matrix op
# (a region's terminator: a loop carry, a branch result; a composite's decomposition).
_OPAQUE_READERS = frozenset({"func.call", "stablehlo.while", "stablehlo.case",
                             "stablehlo.if", "stablehlo.custom_call", "stablehlo.composite",
                             "stablehlo.optimization_barrier", "stablehlo.return"})
_MAX_READERS_WALKED = 64


def _read_on_the_way_out(op: Any) -> bool:
    """Whether ``op``'s result reaches no matrix op, only a public function's return
    (through the ops of its own block): a weight gradient that only the optimizer reads,
    which XLA writes into the buffer the update overwrites. An input gradient reaches
    the previous layer's matrix ops instead; its f32 form is a larger buffer than its
    16-bit one, whose convert up XLA fuses into the readers."""
    pending, seen = [op.result], 0
    while pending:
        seen += 1
        if seen > _MAX_READERS_WALKED:
            return False
        for use in live_uses(pending.pop()):
            reader = use.owner.operation
            if reader.name == "func.return":
                if not is_public(reader.parent):
                    return False
                continue
            if reader.name in MATRIX_OP_NAMES or reader.name in _OPAQUE_READERS:
                return False
            pending.extend(reader.results)
    return True
