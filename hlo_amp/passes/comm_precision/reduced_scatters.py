"""The reduce precision on add scatters whose partial results XLA sums across devices (an
embedding's gradient): where it is 16-bit and the updates are 16-bit values converted up,
the scatter sums them in 16 bit, with a convert back."""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import discard, element_type, from_constant, live_uses, with_element
from hlo_amp.ir.op_classes import body_is_one_add, single_update_scatter
from hlo_amp.passes.comm_precision.axes import Axes, ModuleAxes, summed_everywhere

_CONVERT = "stablehlo.convert"
SCATTERS = frozenset({"stablehlo.scatter"})


def _low_updates(op: ir.Operation, wanted: ir.Type) -> ir.Value | None:
    """The 16-bit value behind an add scatter's updates when they are that value
    converted up to the scatter's wider float type (``wanted``: the 16-bit type), else
    None. Only one-input scatters whose body is one add and whose updates can meet, into
    a constant (the zeros of a gather's transpose): an accumulator the scatter added to
    would be rounded to 16 bit as well."""
    if len(op.operands) != 3 or not body_is_one_add(op) or single_update_scatter(op):
        return None
    if not from_constant(op.operands[0]):
        return None
    element = element_type(op.results[0])
    if not isinstance(element, ir.FloatType) or element.width <= ir.FloatType(wanted).width:
        return None
    updates = op.operands[2].owner
    if isinstance(updates, ir.Block) or updates.operation.name != _CONVERT:
        return None
    low = updates.operation.operands[0]
    return low if str(element_type(low)) == str(wanted) else None


def _scatter_summed_across_devices(op: ir.Operation, known: dict[Any, Axes]) -> bool:
    """Whether the partitioner sums ``op``'s partial results across devices: a mesh axis
    shards the updates' scatter dimensions (the batch of an embedding's gradient) or the
    indices, and the operand does not use it. Each device then scatters its share of
    the updates into its own copy of the operand, and XLA sums the copies."""
    operand, indices, updates = (known.get(value) for value in op.operands)
    numbers = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    windows = set(numbers.update_window_dims)
    spread = frozenset[str]()
    if updates is not None:
        spread |= frozenset().union(*(a for d, a in enumerate(updates) if d not in windows))
    if indices is not None:
        spread |= frozenset().union(*(a for d, a in enumerate(indices)
                                      if d != numbers.index_vector_dim))
    used = frozenset().union(*operand) if operand else frozenset()
    return bool(spread - used)


def chosen_scatters(module: ir.Module, axes: ModuleAxes, wanted: ir.Type
                     ) -> list[tuple[ir.Operation, ir.Value]]:
    """The add scatters with 16-bit updates summed across devices in every context, each
    with the 16-bit value behind its updates."""
    chosen = summed_everywhere(module, axes, SCATTERS, _scatter_summed_across_devices)
    return [(op, low) for op in chosen if (low := _low_updates(op, wanted)) is not None]


def sum_in_16bit(chosen: list[tuple[ir.Operation, ir.Value]], wanted: ir.Type) -> int:
    """Retype each scatter to ``wanted``: its operand converted down, its updates read
    before their convert up (``low``), its body's add in ``wanted``, and a convert back to
    the old type after it, so its readers (and the program's outputs) keep their types."""
    for op, low in chosen:
        updates_convert = op.operands[2].owner
        operand, result = op.operands[0], op.results[0]
        old_type = result.type
        readers = list(live_uses(result))
        with op.location, ir.InsertionPoint(op):
            scalar = ir.RankedTensorType.get([], wanted)
            narrow = hlo.ConvertOp(with_element(operand.type, wanted), operand)
            result.set_type(with_element(old_type, wanted))
        op.operands[0] = narrow.result
        op.operands[2] = low
        body = op.regions[0].blocks[0]
        for argument in body.arguments:
            argument.set_type(scalar)
        for inner in body.operations:
            for inner_result in inner.results:
                inner_result.set_type(scalar)
        with op.location, ir.InsertionPoint.after(op):
            back = hlo.ConvertOp(old_type, result)
        for use in readers:
            use.owner.operands[use.operand_number] = back.result
        if not any(True for _ in live_uses(updates_convert.results[0])):
            discard(updates_convert)
    return len(chosen)
