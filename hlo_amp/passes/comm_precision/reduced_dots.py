"""``reduce=`` on dots: the dots whose partial results XLA's SPMD partitioner sums across
devices (a sharded contracting dimension) return the reduce dtype, with a convert back;
an f32 dot counts as the 16-bit type the target runs it as, read from its decision
through the op's decision mark (``Decision.runs_as``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import decision_of, element_type, live_uses, with_element
from hlo_amp.ir.shardings import leaves_unreduced
from hlo_amp.passes.comm_precision.axes import Axes, ModuleAxes, summed_everywhere
from hlo_amp.report import Report

_DOTS = frozenset({"stablehlo.dot_general"})


def _summed_across_devices(op: ir.Operation, known: dict[Any, Axes]) -> bool:
    """Whether the partitioner sums ``op``'s partial results across devices: a mesh axis
    shards a contracting dimension of both operands, or of one operand while the other
    does not use that axis at all (it is replicated there and gets sliced). An axis that
    shards one operand's contracting dimension and another dimension of the other
    operand (FSDP: a weight sharded over the data axis) makes XLA gather the weight."""
    lhs, rhs = known.get(op.operands[0]), known.get(op.operands[1])
    if lhs is None and rhs is None:
        return False
    numbers = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    pairs = zip(numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions)
    lhs_all = frozenset().union(*lhs) if lhs else frozenset()
    rhs_all = frozenset().union(*rhs) if rhs else frozenset()
    for lc, rc in pairs:
        left = lhs[lc] if lhs else frozenset()
        right = rhs[rc] if rhs else frozenset()
        if left & right or (left - rhs_all) or (right - lhs_all):
            return True
    return False


def retype_reduced_dots(module: ir.Module, axes: ModuleAxes, wanted: ir.Type,
                         report: Report | None) -> int:
    """Give ``wanted`` as the result element of the 16-bit and fp8 dots whose partial results are
    summed across devices in every context their function is called in, at any depth of
    loops and branches; a convert back keeps the readers' type."""
    # Decided before any is retyped: a retyped dot's readers read a convert.
    chosen = summed_everywhere(module, axes, _DOTS, _summed_across_devices)
    retyped = 0
    for op in chosen:
        operand_elements = {str(element_type(value)) for value in op.operands}
        result = op.results[0]
        have = element_type(result)
        if str(have) == str(wanted):
            continue
        # An fp8 GEMM (e5m2 x e4m3 in the backward pass) returns the type asked of it:
        # its partial sums cross devices in that type, the scale multiply after the sum.
        fp8 = all(isinstance(element_type(v), ir.FloatType) and element_type(v).width == 8
                  for v in op.operands)
        if not fp8:
            if len(operand_elements) != 1:
                continue
            operand_element = element_type(op.operands[0])
            # An f32 dot the target runs as one 16-bit pass (insert_converts' TPU rule)
            # counts as that type: f32 x f32 -> bf16 there is the converted dot's
            # arithmetic.
            operand_element = _runs_as(op, report) or operand_element
            if not isinstance(operand_element, ir.FloatType) or operand_element.width != 16:
                continue  # a dot the policy kept in f32: its reduction stays as written
            if str(wanted) not in (str(operand_element), "f32"):
                continue
        if any(leaves_unreduced(use.owner.operation) for use in live_uses(result)):
            continue  # jax leaves its partial sums unreduced: the program says where they are summed
        old_type = result.type
        readers = list(live_uses(result))
        with op.location, ir.InsertionPoint.after(op):
            result.set_type(with_element(old_type, wanted))
            back = hlo.ConvertOp(old_type, result)
        for use in readers:
            use.owner.operands[use.operand_number] = back.result
        retyped += 1
        index = decision_of(op)
        if report is not None and index is not None:  # why its result is 16-bit
            found = report.decisions[index]
            report.decisions[index] = dataclasses.replace(found, notes=found.notes + (
                f"result stored as {wanted}: reduce= sums it across devices in {wanted}",))
    return retyped


def _runs_as(op: ir.Operation, report: Report | None) -> ir.Type | None:
    """The 16-bit type the target runs ``op`` as, from its decision (``Decision.runs_as``,
    found by the op's decision mark); None for every other op."""
    index = decision_of(op)
    if report is None or index is None:
        return None
    element = report.decisions[index].runs_as
    return ir.Type.parse(element) if element else None
