"""Two amaxes of one block computed from the same values, taken by one reduction.

Under current scaling each quantised tensor's amax is a reduction of its own, read at
once by the tensor's scale. XLA:GPU fuses an amax into the kernel that computes its
tensor, but two tensors computed from the same inputs keep a reduction each, and each
reads those inputs again: SwiGLU's two gradients (the gate's and the up projection's,
both from the gate, the up projection and the incoming gradient), the key and value
gradients of one attention. This pass takes such a pair in one variadic reduction:

    before:  a = max(|x|)   u = f(a) ...   y = g(...)   b = max(|y|)
    after:   y = g(...)   (a, b) = max(|x|), max(|y|)   u = f(a) ...

The ops that read ``a`` (directly or through each other) and sit before ``y``'s
producer move after it; none of them computes ``y`` (else the pair is left alone), so
every value is still defined before it is read. A maximum is exact and does not depend
on order: the same bits. XLA then reduces both tensors in one kernel that reads their
inputs once (the 1.1B decoder of benchmarks/llm.py, h100 without the device: roofline
138.85 to 136.28 ms, 2,466 to 2,402 kernel launches). Under delayed scaling the recorded
amaxes batch_amax leaves (a tensor XLA reduces in one kernel) pair the same way.

A pair: two amaxes of the form fp8.py writes (hoist_amax.match_amax) in one block, over
tensors of one type, neither computed from the other's amax, whose producers (followed
through elementwise ops, data movement and function calls, ``_SOURCE_DEPTH`` levels)
read a common value (a block argument or the result of another op). Only ops without
effects, and without regions other than a reduction's body, move, and at most
``_MOVE_LIMIT`` of them. Partitioned modules are left alone, as batch_amax leaves them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    defining_op,
    discard,
    erase_discarded,
    is_discarded,
    live_uses,
    op_key,
    producers,
    walk_operations,
)
from hlo_amp.ir.shardings import is_partitioned
from hlo_amp.passes.hoist_amax import Amax, match_amax
from hlo_amp.report import Report

_REDUCE = frozenset({"stablehlo.reduce"})
# Ops a tensor's producers are followed through to the values they read: XLA fuses them
# into the kernel that computes the tensor (elementwise ops and data movement; a function
# call is inlined first). A constant is followed to nothing: not a value two tensors
# share.
_THROUGH = frozenset({
    "func.call", "stablehlo.abs", "stablehlo.add", "stablehlo.and",
    "stablehlo.broadcast_in_dim", "stablehlo.clamp", "stablehlo.compare",
    "stablehlo.concatenate", "stablehlo.constant", "stablehlo.convert", "stablehlo.cosine",
    "stablehlo.divide", "stablehlo.exponential", "stablehlo.exponential_minus_one",
    "stablehlo.is_finite", "stablehlo.log", "stablehlo.log_plus_one",
    "stablehlo.logistic", "stablehlo.maximum", "stablehlo.minimum", "stablehlo.multiply",
    "stablehlo.negate", "stablehlo.not", "stablehlo.or", "stablehlo.pad",
    "stablehlo.power", "stablehlo.reshape", "stablehlo.reverse", "stablehlo.rsqrt",
    "stablehlo.select", "stablehlo.sine", "stablehlo.slice", "stablehlo.sqrt",
    "stablehlo.subtract", "stablehlo.tanh", "stablehlo.transpose"})
_SOURCE_DEPTH = 12
# Ops that may not move: effects, collectives (every device must run them in one
# order), and regions whose ops could read a moved value.
_UNMOVABLE = frozenset({
    "stablehlo.custom_call", "stablehlo.while", "stablehlo.if", "stablehlo.case",
    "stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed",
    "stablehlo.after_all", "stablehlo.create_token", "stablehlo.all_reduce",
    "stablehlo.all_gather", "stablehlo.all_to_all", "stablehlo.reduce_scatter",
    "stablehlo.collective_permute", "stablehlo.collective_broadcast",
    "stablehlo.optimization_barrier", "stablehlo.rng", "stablehlo.rng_bit_generator",
    "func.call", "func.return", "stablehlo.return"})
_MOVE_LIMIT = 64


@dataclass(frozen=True)
class MergeAmax:
    """Take two amaxes of tensors computed from the same values in one reduction (see
    the module doc)."""

    name: str = "hlo-amp-merge-amax"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if is_partitioned(module):
            return
        merged = 0
        with module.context, ir.Location.unknown():
            for block in _blocks_with_amaxes(module):
                merged += _merge_pairs(block)
        erase_discarded(self.name)
        if report is not None and merged:
            report.notes.append(f"merge-amax: {merged} pair(s) of amaxes of tensors computed "
                                "from the same values taken in one reduction each")


def _blocks_with_amaxes(module: ir.Module) -> list[ir.Block]:
    blocks: list[ir.Block] = []
    for reduce in walk_operations(module.operation, names=_REDUCE):
        if match_amax(reduce) is not None and not any(reduce.block == b for b in blocks):
            blocks.append(reduce.block)
    return blocks


def _sources(value: ir.Value) -> set[Any]:
    """The values ``value``'s producers read, followed through the ops of ``_THROUGH``:
    a block argument as ("argument", its block's op, number), another op's result as that
    op's key."""
    found: set[Any] = set()
    for end in producers(value, _SOURCE_DEPTH, lambda op: op.name in _THROUGH)[1]:
        op = defining_op(end)
        if op is None:
            argument = ir.BlockArgument(end)
            found.add(("argument", op_key(argument.owner.owner), argument.arg_number))
        else:
            found.add(op_key(op))
    return found


def _in_block(op: Any, block: ir.Block) -> ir.Operation | None:
    """``op``, or the op of ``block`` that holds it in a region; None outside it."""
    op = op.operation
    while op.block != block:
        parent = op.parent
        if parent is None:
            return None
        op = parent.operation
    return op


def _in_order(ops: list[ir.Operation]) -> list[ir.Operation]:
    return sorted(ops, key=functools.cmp_to_key(
        lambda a, b: 0 if a == b else -1 if a.is_before_in_block(b) else 1))


def _dependents_before(first: ir.Operation, end: ir.Operation
                       ) -> tuple[list[ir.Operation] | None, bool]:
    """(The ops before ``end`` that read ``first``'s result, directly, through each
    other or from inside their regions, in block order, or None where they may not all
    move; whether that None is for good: ``end`` is computed from ``first``, or one of
    them may never move, which no other merge changes).

    Only ops before ``end`` are followed (an op after it reaches nothing before it),
    and at most ``_MOVE_LIMIT`` of them: the search is bounded, not the block (MLIR
    keeps the block's order: ``is_before_in_block``)."""
    block = first.block
    found: dict[int, ir.Operation] = {}
    stack = [first]
    while stack:
        for result in stack.pop().results:
            for use in live_uses(result):
                reader = _in_block(use.owner, block)
                if reader is None or op_key(reader) in found:
                    continue
                if reader == end:
                    return None, True  # the second tensor is computed from the first amax
                if not reader.is_before_in_block(end):
                    continue
                if reader.name in _UNMOVABLE or (reader.regions
                                                 and reader.name != "stablehlo.reduce"):
                    return None, True
                found[op_key(reader)] = reader
                if len(found) > _MOVE_LIMIT:
                    return None, False
                stack.append(reader)
    return _in_order(list(found.values())), False


def _merge_pairs(block: ir.Block) -> int:
    """Merge the pairs of amaxes in ``block`` that qualify, in block order; how many.

    Whether two amaxes share a source, and whether one tensor is computed from the
    other's amax, hold for good (a merge moves ops and only adds reads): such a pair is
    checked once, and a search is bounded by the ops that may move (it restarted after
    every merge and searched the block per pair: 34 s on the 2,265 ops of six nested
    jax.checkpoint levels)."""
    operations = [op.operation for op in block.operations]
    amaxes = [a for a in (match_amax(op) for op in operations
                          if op.name == "stablehlo.reduce" and not is_discarded(op))
              if a is not None]
    sources = [_sources(a.reduce.operands[0]) for a in amaxes]
    never: set[tuple[int, int]] = set()
    done: set[int] = set()
    merged = 0
    while True:
        merged_this_round = 0
        for i, first in enumerate(amaxes):
            if i in done:
                continue
            for j in range(i + 1, len(amaxes)):
                if j in done or (i, j) in never:
                    continue
                second = amaxes[j]
                x, y = first.reduce.operands[0], second.reduce.operands[0]
                if x.type != y.type or not sources[i] & sources[j]:
                    never.add((i, j))
                    continue
                # The tensor computed last is "y" here: an earlier merge may have moved
                # the first amax's tensor after the second's (block order was taken once).
                earlier, later = ((first, second) if _computed_before(x, y)
                                  else (second, first))
                y_producer = defining_op(later.reduce.operands[0])  # the abs
                moving, for_good = _dependents_before(earlier.reduce, y_producer)
                if moving is None:
                    if for_good:
                        never.add((i, j))
                    continue
                _merge(earlier, later, y_producer, moving)
                done.update((i, j))
                merged_this_round += 1
                break
        merged += merged_this_round
        if not merged_this_round:
            return merged


def _computed_before(x: ir.Value, y: ir.Value) -> bool:
    """Whether ``x`` is computed before ``y`` in their block (two amaxes' abs values:
    match_amax takes no block argument)."""
    return defining_op(x).is_before_in_block(defining_op(y))


def _merge(first: Amax, second: Amax, y_producer: ir.Operation,
           moving: list[ir.Operation]) -> None:
    """Move ``moving`` after ``y_producer`` and take both amaxes in one reduction,
    placed before the first op that reads either."""
    anchor = y_producer
    for op in moving:
        op.move_after(anchor)
        anchor = op
    block = second.reduce.block
    readers = [reader for amax in (first, second) for use in live_uses(amax.reduce.results[0])
               if (reader := _in_block(use.owner, block)) is not None]
    # Every reader is after y's producer now (the first's moved there); read by
    # nothing: before the terminator.
    earliest = (_in_order(readers)[0] if readers
                else next(iter(reversed(block.operations))).operation)
    x, y = first.reduce.operands[0], second.reduce.operands[0]
    shaped = ir.RankedTensorType(x.type)
    scalar = ir.RankedTensorType.get([], shaped.element_type)
    with first.reduce.location, ir.InsertionPoint(earliest):
        zero = hlo.constant(ir.DenseElementsAttr.get_splat(
            scalar, ir.FloatAttr.get(shaped.element_type, 0.0)))
        reduce = hlo.ReduceOp([scalar, scalar], [x, y], [zero, zero],
                              ir.DenseI64ArrayAttr.get(list(range(shaped.rank))))
        body = reduce.regions[0].blocks.append(scalar, scalar, scalar, scalar)
        with ir.InsertionPoint(body):
            lhs_x, lhs_y, rhs_x, rhs_y = body.arguments
            hlo.return_([hlo.maximum(lhs_x, rhs_x), hlo.maximum(lhs_y, rhs_y)])
    first.reduce.results[0].replace_all_uses_with(reduce.results[0])
    second.reduce.results[0].replace_all_uses_with(reduce.results[1])
    discard(first.reduce)
    discard(second.reduce)
