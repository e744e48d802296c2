"""Amaxes known together, reduced together: those a step records for delayed scaling
(per block), and those of the step's arguments (its weights under current scaling).

Under ``scaling=delayed`` each quantised tensor's amax this step is only recorded
(fp8_state.py gathers them, per block, into ``concatenate(reshape(amax_i), ...)``, one
f32[1] piece per history column); no scale waits for it. XLA:GPU reduces a tensor of
more than 16,384 elements to a scalar in two kernels: a maximum per row of its own split
of the tensor, which it fuses with the tensor's quantisation, and a one-block kernel that
reduces those rows, one per recorded tensor. This pass writes the split itself and
reduces the rows of the recorded amaxes of a block together, one kernel per row count:

    before:  piece_i = reshape(max(|x_i|))                                  f32[1]
    after:   rows_i  = max(|reshape(x_i, [p, n_i / p])|, axis 1)            [p]
             group   = max(concatenate(rows_i, rows_j, ...) as [k, p], axis 1)
             piece_i = slice(group, i)

``p`` is the smallest power of two that divides ``n_i`` and leaves rows of at most
16,384 elements (longer rows XLA splits again). A maximum is exact and does not depend
on order, NaN included, so every piece holds the same bits. Only amaxes of the form
fp8.py writes (hoist_amax.match_amax), recorded and used for nothing else, are batched,
and only with another of the same row count and type; a tensor computed from a
transpose (among the ops XLA fuses into its producer) is left to XLA: its rows would not
be contiguous in the layout XLA gives it, and XLA would copy it to reduce them. A
partitioned module is left alone: rows of a sharded tensor may cut across its shards.

Under current scaling each amax feeds its scale at once, so nothing waits to be batched,
except the amaxes of the public function's arguments (through converts: a weight's
16-bit copy), all known when the step starts. Those of the same row count and convert
chain are reduced the same way at the top of the function, and each amax becomes an
element of that reduction (``_batch_arguments``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.hoisting import converted
from hlo_amp.ir.modules import (
    defining_op,
    discard,
    erase_discarded,
    functions,
    is_discarded,
    is_public,
    producers,
    walk_operations,
)
from hlo_amp.ir.shardings import is_partitioned
from hlo_amp.passes.fp8 import max_abs
from hlo_amp.passes.fp8_state import vector_element
from hlo_amp.passes.hoist_amax import Amax, match_amax
from hlo_amp.report import Report

_CONCATENATE = frozenset({"stablehlo.concatenate"})
_Item = TypeVar("_Item")
# XLA:GPU reduces a row of up to this many elements in one kernel (measured on its h100
# target: 16,384 in one kernel, 32,768 in two).
_ROW_LIMIT = 16384
# Pieces per batched reduction: a fusion of many more operands XLA splits up again.
_GROUP_LIMIT = 32
# A transpose among the ops XLA fuses into a tensor's producer gives the tensor a layout
# whose rows (in the logical order) are not contiguous: XLA copies it to reduce them. Ops
# whose result XLA writes in a layout of its own end the search.
_FUSIBLE_DEPTH = 8
_MATERIALISED = frozenset({"stablehlo.dot_general", "stablehlo.convolution",
                           "stablehlo.reduce", "stablehlo.custom_call", "stablehlo.while",
                           "func.call", "stablehlo.optimization_barrier"})


@dataclass(frozen=True)
class _Recorded:
    """A piece ``reshape(convert?(reduce(abs(x))))`` of the recorded vector."""

    piece: ir.Operation  # the reshape to f32[1]
    chain: tuple[ir.Operation, ...]  # the ops only the piece reads, discarded with it
    x: ir.Value
    rows: int


@dataclass(frozen=True)
class BatchAmax:
    """Reduce the amaxes known together, together (see the module doc)."""

    name: str = "hlo-amp-batch-amax"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if is_partitioned(module):
            return  # a reshape of a sharded tensor into rows could make XLA regather it
        recorded = arguments = reductions = 0
        with module.context, ir.Location.unknown():
            for concat in walk_operations(module.operation, names=_CONCATENATE):
                for group in _groups(_recorded_pieces(concat), _recorded_kind):
                    _batch(concat, group)
                    recorded += len(group)
                    reductions += 1
            for entry, found in _argument_amaxes(module):
                for group in _groups(found, lambda item: (item[1], item[0].key)):
                    _batch_arguments(entry, group)
                    arguments += len(group)
                    reductions += 1
        erase_discarded(self.name)
        if report is not None and recorded + arguments:
            report.notes.append(f"batch-amax: {recorded + arguments} amax(es) reduced in "
                                f"{reductions} reduction(s), not one each ({recorded} "
                                f"recorded for delayed scaling, {arguments} of the step's "
                                "arguments)")


def _f32_vector(value: ir.Value) -> bool:
    shaped = ir.RankedTensorType(value.type)
    return shaped.rank == 1 and shaped.element_type == ir.F32Type.get()


def _only_use(value: ir.Value) -> bool:
    return len(list(value.uses)) == 1


def _rows(count: int) -> int | None:
    """The smallest power of two dividing ``count`` that leaves rows of at most
    ``_ROW_LIMIT`` elements; None for a tensor XLA reduces in one kernel anyway (one
    row) or that no such power divides."""
    rows = 1
    while count // rows > _ROW_LIMIT:
        if count % (rows * 2):
            return None
        rows *= 2
    return rows if rows > 1 else None


def _near_transpose(x: ir.Value) -> bool:
    """Whether a transpose is among the ops XLA would fuse into ``x``'s producer (the
    elementwise and data movement ops before it, ``_FUSIBLE_DEPTH`` deep)."""
    met, _ = producers(x, _FUSIBLE_DEPTH, lambda op: op.name not in _MATERIALISED)
    return any(op.name == "stablehlo.transpose" for op in met)


def _recorded_kind(r: _Recorded) -> tuple[int, str]:
    """What recorded pieces must share to be stacked: row count and element type."""
    return r.rows, str(ir.RankedTensorType(r.x.type).element_type)


def _recorded_pieces(concat: ir.Operation) -> list[_Recorded]:
    """The pieces of ``concat`` (a 1-D f32 vector of f32[1] pieces) that are amaxes used
    for nothing else."""
    if (ir.IntegerAttr(concat.attributes["dimension"]).value != 0
            or not _f32_vector(concat.results[0])):
        return []
    found = []
    for operand in concat.operands:
        piece = defining_op(operand)
        if (piece is None or piece.name != "stablehlo.reshape" or not _only_use(operand)
                or not _only_use(piece.operands[0])):
            continue
        chain = [piece]
        reduce = defining_op(piece.operands[0])
        if reduce is not None and reduce.name == "stablehlo.convert":  # a 16-bit amax
            convert = reduce
            chain.append(convert)
            reduce = defining_op(convert.operands[0]) if _only_use(convert.operands[0]) else None
        if (reduce is None or reduce.block != concat.block or match_amax(reduce) is None
                or not _only_use(reduce.results[0])):
            continue
        chain.append(reduce)
        magnitude = reduce.operands[0]  # abs(x), as match_amax found it
        if _only_use(magnitude):
            chain.append(magnitude.owner.operation)
        x = magnitude.owner.operation.operands[0]
        rows = _rows(math.prod(ir.RankedTensorType(x.type).shape))
        if rows is not None and not _near_transpose(x):
            found.append(_Recorded(piece, tuple(chain), x, rows))
    return found


def _groups(items: list[_Item], key: Callable[[_Item], Hashable]) -> list[list[_Item]]:
    """``items`` by ``key`` (what may be stacked together), in groups of two to
    ``_GROUP_LIMIT``."""
    by_key: dict[Hashable, list[_Item]] = {}
    for item in items:
        by_key.setdefault(key(item), []).append(item)
    return [group for members in by_key.values()
            for start in range(0, len(members), _GROUP_LIMIT)
            if len(group := members[start:start + _GROUP_LIMIT]) >= 2]


def _row_maxima(x: ir.Value, rows: int, converts: Sequence[ir.Type] = ()) -> ir.Value:
    """``max(|x|)`` per row of ``x`` split into ``rows`` rows (converted by ``converts``
    first), as one row ``[1, rows]`` of a stack, at the current insertion point."""
    shaped = ir.RankedTensorType(x.type)
    count = math.prod(shaped.shape)
    split = converted(hlo.reshape(ir.RankedTensorType.get(
        [rows, count // rows], shaped.element_type), x), converts)
    maxima = max_abs(split, [1])
    return hlo.reshape(ir.RankedTensorType.get(
        [1, rows], ir.RankedTensorType(maxima.type).element_type), maxima)


def _stack_maxima(stacked: list[ir.Value]) -> ir.Value:
    """The largest element of each row of the stacked ``[1, rows]`` rows: ``[k]``."""
    matrix = hlo.concatenate(stacked, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0))
    return max_abs(matrix, [1])  # abs of a magnitude: the same values


def _batch(concat: ir.Operation, group: list[_Recorded]) -> None:
    """Replace ``group``'s pieces of ``concat`` by slices of one reduction of their rows."""
    stacked = []
    for r in group:
        # At the amax's place: XLA fuses the rows' maximum with the quantisation there.
        with r.chain[-1].location, ir.InsertionPoint(r.chain[-1]):
            stacked.append(_row_maxima(r.x, r.rows))
    f32 = ir.F32Type.get()
    with concat.location, ir.InsertionPoint(concat):
        amaxes = _stack_maxima(stacked)
        if ir.RankedTensorType(amaxes.type).element_type != f32:
            amaxes = hlo.convert(ir.RankedTensorType.get([len(group)], f32), amaxes)
        for index, r in enumerate(group):
            r.piece.results[0].replace_all_uses_with(vector_element(amaxes, index))
    for r in group:
        for op in r.chain:
            discard(op)


# ---- the amaxes of the step's arguments ------------------------------------------------

def _argument_amaxes(module: ir.Module) -> list[tuple[ir.Block, list[tuple[Amax, int]]]]:
    """Per public function: the amaxes (fp8's form, not discarded) in its entry block of
    one of its arguments, through converts, with their row counts."""
    found = []
    for fn in functions(module):
        if not is_public(fn):
            continue
        entry = fn.regions[0].blocks[0]
        amaxes = []
        for op in entry.operations:
            op = op.operation
            if op.name != "stablehlo.reduce" or is_discarded(op):
                continue
            amax = match_amax(op)
            if (amax is None or not isinstance(amax.root, ir.BlockArgument)
                    or amax.root.owner != entry):
                continue
            rows = _rows(math.prod(ir.RankedTensorType(amax.root.type).shape))
            if rows is not None:
                amaxes.append((amax, rows))
        found.append((entry, amaxes))
    return found


def _batch_arguments(entry: ir.Block, group: list[tuple[Amax, int]]) -> None:
    """Replace each amax of ``group`` by an element of one reduction of their rows, all
    at the top of ``entry`` (the arguments are there; the amaxes' readers come later)."""
    scalar = ir.RankedTensorType(group[0][0].reduce.results[0].type)
    first = entry.operations[0]
    stacked = []
    for amax, rows in group:
        with amax.reduce.location, ir.InsertionPoint(first):
            stacked.append(_row_maxima(amax.root, rows, amax.converts))
    with group[0][0].reduce.location, ir.InsertionPoint(first):
        amaxes = _stack_maxima(stacked)
        values = [hlo.reshape(scalar, vector_element(amaxes, index)) for index in range(len(group))]
    for (amax, _), value in zip(group, values):
        amax.replace(value)
