"""Write an add scatter of one update per position into a constant as a select.

JAX writes the gradient of ``take_along_axis`` (a cross-entropy's label pick) as an add
scatter of one value per row into zeros. XLA runs a scatter in place, as a kernel of its
own after the operand is written: the decoder's logits gradient (softmax part plus the
label part) is written in f32 and read back twice, and its 16-bit copy for the two
matrix ops comes after. ``select(iota == index, c + update, c)`` gives the same values
bit for bit (each element gets its one update or none; an index outside the operand
matches no position, as XLA's scatter skips it), and XLA fuses it with the softmax
part and the convert into one kernel.

Only a scatter into a constant (broadcast, reshaped or converted) is rewritten: there
the result is written in full either way. Into a computed operand (a cache updated in place in a loop) the
scatter touches one slot and the select form would rewrite the whole buffer.

In a partitioned module the select carries the sharding XLA's partitioner gives the
scatter's result (hlo_amp/ir/shardings.py), behind an open ``sdy.sharding_constraint``:
the scatter passes its indices' batch sharding (the token batch's) on early in Shardy's
propagation, the select only through a broadcast, late, and a decoder step without
activation constraints was partitioned another way (issue 48: 2.6 times the hand cast's
memory on 8 H100s). Where that sharding cannot be known (GSPMD shardings, no ``main``,
no Shardy in this jaxlib) the scatter stays. Where XLA writes such a scatter as a select itself before
partitioning (`Target.selects_scatters_before_partitioning`: XLA:TPU) the partitioner
sees a select either way, and the select carries nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import discard, from_constant, functions, walk_operations
from hlo_amp.ir.op_classes import single_update_scatter
from hlo_amp.ir.shardings import constrain, is_partitioned, result_shardings
from hlo_amp.report import Report
from hlo_amp.targets import NO_TARGET, Target

_SCATTER = frozenset({"stablehlo.scatter"})


@dataclass(frozen=True)
class ScatterToSelect:
    """Rewrite one-position add scatters of floats into a constant as selects."""

    target: Target = NO_TARGET
    name: str = "hlo-amp-scatter-select"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        found = [(op.opview, _placement(op.opview)) for fn in functions(module)
                 for op in walk_operations(fn, names=_SCATTER)]
        chosen = [(op, placement) for op, placement in found if placement is not None]
        shardings: dict[int, Any] = {}
        partitioned = (bool(chosen) and not self.target.selects_scatters_before_partitioning
                       and is_partitioned(module))
        if partitioned:
            shardings = result_shardings(module, [op.operation for op, _ in chosen])
        rewritten = constrained = 0
        for index, (op, placement) in enumerate(chosen):
            if partitioned and index not in shardings:
                continue  # its sharding unknown: the scatter keeps the plan as it is
            with op.location, ir.InsertionPoint(op):
                constrained += _rewrite(op, placement, shardings.get(index))
            rewritten += 1
        if report is not None and rewritten:
            report.notes.append(
                f"scatter-select: wrote {rewritten} one-position add scatter(s) into a "
                f"constant as select" + (f", {constrained} carrying the scatter's sharding"
                                         if constrained else ""))


@dataclass(frozen=True)
class _Placement:
    """Where the updates land, in operand dimensions."""

    indexed: tuple[tuple[int, int], ...]  # (operand dim, index vector component)
    at_zero: tuple[int, ...]  # size-1 window dims no index addresses: position 0
    index_vector_dim: int
    # indices dims that are batching dims (in order), the operand dim of each
    index_batch_dims: tuple[int, ...]
    index_batch_to_operand: tuple[int, ...]
    # the updates dims that are not size-1 scatter dims (in order), the operand dim of each
    update_dims: tuple[int, ...]
    update_to_operand: tuple[int, ...]


def _placement(op: Any) -> _Placement | None:
    """The placement of a rewritable scatter, or None to leave it."""
    if not single_update_scatter(op) or not from_constant(op.operation.operands[0]):
        return None  # into a computed buffer: see the module's docstring
    types = [v.type for v in op.operation.operands]
    if not all(isinstance(t, ir.RankedTensorType) for t in types):
        return None
    operand, indices, updates = (ir.RankedTensorType(t) for t in types)
    if not (all(t.has_static_shape for t in (operand, indices, updates))
            and isinstance(operand.element_type, ir.FloatType)
            and isinstance(indices.element_type, ir.IntegerType)):
        return None
    numbers = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    inserted = list(numbers.inserted_window_dims)
    operand_batch = list(numbers.input_batching_dims)
    index_batch = list(numbers.scatter_indices_batching_dims)
    addressed = list(numbers.scattered_dims_to_operand_dims)
    if any(dim not in inserted for dim in addressed):
        return None  # an index starting a longer window: not a position
    if any(operand.shape[dim] - 1 > _largest(indices.element_type) for dim in addressed):
        # XLA bounds-checks the index in its own type, where the dim's size wraps (an
        # int8 index 100 into a dim of 300 is dropped): left to XLA.
        return None
    window = [d for d in range(operand.rank) if d not in inserted and d not in operand_batch]
    update_window = list(numbers.update_window_dims)
    if len(update_window) != len(window) or any(
            updates.shape[u] != operand.shape[d] for u, d in zip(update_window, window)):
        return None  # a window shorter than its dim could start anywhere
    index_dims = [d for d in range(indices.rank) if d != numbers.index_vector_dim]
    update_scatter = [d for d in range(updates.rank) if d not in update_window]
    if len(update_scatter) != len(index_dims):
        return None
    mapped = {u: operand_batch[index_batch.index(i)]
              for u, i in zip(update_scatter, index_dims) if i in index_batch}
    mapped.update(zip(update_window, window))
    kept = sorted(mapped)
    return _Placement(
        indexed=tuple((dim, component) for component, dim in enumerate(addressed)),
        at_zero=tuple(d for d in inserted if d not in addressed),
        index_vector_dim=numbers.index_vector_dim,
        index_batch_dims=tuple(sorted(index_batch)),
        index_batch_to_operand=tuple(operand_batch[index_batch.index(d)]
                                     for d in sorted(index_batch)),
        update_dims=tuple(kept),
        update_to_operand=tuple(mapped[d] for d in kept),
    )


def _largest(index_type: ir.Type) -> int:
    """The largest value of an integer type."""
    integer = ir.IntegerType(index_type)
    return 2 ** (integer.width - (0 if integer.is_unsigned else 1)) - 1


def _rewrite(op: Any, placement: _Placement, sharding: Any) -> bool:
    """Replace ``op``; True where the select carries ``sharding``."""
    operand, indices, updates = op.operation.operands
    operand_type = ir.RankedTensorType(operand.type)
    indices_type = ir.RankedTensorType(indices.type)
    updates_type = ir.RankedTensorType(updates.type)
    shape = operand_type.shape
    # Positions compared in 32 bits at least: an 8- or 16-bit iota wraps over a dim the
    # type cannot count (a uint8 index 10 matched positions 10 and 266 of a dim of 300;
    # a size-1 window at 0, every 256th position); a narrow index widens by value.
    index_type = indices_type.element_type
    if ir.IntegerType(index_type).width < 32:
        index_type = ir.IntegerType.get_signless(32)
    positions_type = ir.RankedTensorType.get(shape, index_type)
    vector_dim = placement.index_vector_dim

    def equal_along(dim: int, position: ir.Value) -> ir.Value:
        iota = hlo.IotaOp(positions_type, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), dim))
        return hlo.CompareOp(iota.result, position,
                             hlo.ComparisonDirectionAttr.get("EQ")).result

    masks = []
    for dim, component in placement.indexed:
        starts, limits = [0] * indices_type.rank, list(indices_type.shape)
        if vector_dim < indices_type.rank:
            starts[vector_dim], limits[vector_dim] = component, component + 1
        piece = hlo.SliceOp(indices, _ints(starts), _ints(limits),
                            _ints([1] * indices_type.rank)).result
        if indices_type.element_type != index_type:
            piece = hlo.ConvertOp(ir.RankedTensorType.get(
                ir.RankedTensorType(piece.type).shape, index_type), piece).result
        per_batch = hlo.ReshapeOp(ir.RankedTensorType.get(
            [indices_type.shape[d] for d in placement.index_batch_dims], index_type), piece).result
        position = hlo.BroadcastInDimOp(positions_type, per_batch,
                                        _ints(placement.index_batch_to_operand)).result
        masks.append(equal_along(dim, position))
    for dim in placement.at_zero:
        zero = hlo.ConstantOp(ir.DenseElementsAttr.get_splat(
            positions_type, ir.IntegerAttr.get(index_type, 0))).result
        masks.append(equal_along(dim, zero))
    mask = masks[0]
    for other in masks[1:]:
        mask = hlo.AndOp(mask, other).result
    kept = hlo.ReshapeOp(ir.RankedTensorType.get(
        [updates_type.shape[d] for d in placement.update_dims], updates_type.element_type),
        updates).result
    placed = hlo.BroadcastInDimOp(operand_type, kept, _ints(placement.update_to_operand)).result
    # operand + update, in the scatter body's order, then the operand elsewhere
    added = hlo.AddOp(operand, placed).result
    selected = hlo.SelectOp(mask, added, operand).result
    result = constrain(selected, sharding)
    op.operation.results[0].replace_all_uses_with(result)
    discard(op)
    return result is not selected


def _ints(values: Any) -> ir.DenseI64ArrayAttr:
    return ir.DenseI64ArrayAttr.get(list(values))
