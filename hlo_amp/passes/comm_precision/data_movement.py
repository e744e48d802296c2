"""Converts moved up through data movement (comm_precision's first step, the module
docstring of hlo_amp/passes/comm_precision/ says why): a narrowing float convert whose
operand an op only moves (a sharding constraint, a reshape, a transpose, a broadcast, a
data-moving collective) goes before that op, which then moves 16-bit data."""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    call_target,
    discard,
    element_type,
    live_uses,
    walk_operations,
    with_element,
)
from hlo_amp.ir.shardings import leaves_unreduced, reads_unreduced

# Ops that only move or replicate the elements of their first operand (the others, if
# any, are integer indices): one result of the first operand's element type, no smaller
# than it. A convert commutes with each of them. Ops that pick part of their operand
# (slice, dynamic_slice, gather) are left out: above them the convert would convert the
# whole operand (an embedding table, a scan's whole sequence) to use a part.
_MOVERS = frozenset({
    "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
    "stablehlo.reverse", "stablehlo.all_gather", "stablehlo.all_to_all", "stablehlo.collective_permute",
    "sdy.sharding_constraint", "sdy.reshard", "stablehlo.custom_call",
})
_MOVER_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
_CONVERT = "stablehlo.convert"


def _is_mover(op: ir.Operation) -> bool:
    if op.name not in _MOVERS or not op.operands or len(op.results) != 1:
        return False
    if op.regions and any(len(region.blocks) for region in op.regions):
        return False
    if any(isinstance(element_type(index), ir.FloatType) for index in op.operands[1:]):
        return False  # a second float operand (a padding value): not one value moved
    if op.name == "stablehlo.custom_call":
        return call_target(op) in _MOVER_CALLS
    # A sharding that leaves partial sums unreduced, or one that reads them (the sum
    # itself), is no move: jax's form keeps the unreduced sharding on the sum's producer.
    return not (leaves_unreduced(op) or reads_unreduced(op))


def _narrowing_target(converts: list[ir.Operation], source: ir.Type) -> ir.Type | None:
    """The one float type all ``converts`` narrow ``source`` to, else None."""
    targets = {str(element_type(c.results[0])) for c in converts}
    if len(targets) != 1:
        return None
    target = element_type(converts[0].results[0])
    if not (isinstance(source, ir.FloatType) and isinstance(target, ir.FloatType)):
        return None
    return target if target.width < source.width else None


def move_converts_up(fn: Any) -> int:
    """Move converts above movers in ``fn``, bottom up (a chain moves in one sweep)."""
    moved = 0
    for op in reversed(walk_operations(fn)):
        if not _is_mover(op):
            continue
        result, source = op.results[0], op.operands[0]
        source_element = element_type(source)
        if source_element is None or str(source_element) != str(element_type(result)):
            continue
        readers = [use.owner for use in live_uses(result)]
        if not readers or any(reader.name != _CONVERT for reader in readers):
            continue
        target = _narrowing_target(readers, source_element)
        if target is None:
            continue
        with op.location, ir.InsertionPoint(op):
            narrow = hlo.ConvertOp(with_element(source.type, target), source)
            result.set_type(with_element(result.type, target))
        op.operands[0] = narrow.result
        for reader in readers:
            reader.results[0].replace_all_uses_with(result)
            discard(reader)
        moved += 1
    return moved
