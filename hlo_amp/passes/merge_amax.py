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

from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    defining_op,
    discard,
    erase_discarded,
    is_discarded,
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
                while _merge_one_pair(block):
                    merged += 1
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


def _computed_from(value: ir.Value, target: ir.Operation, position: dict[int, int]) -> bool:
    """Whether ``value`` is computed (in its block) from ``target``'s result."""
    floor = position[op_key(target)]
    seen: set[int] = set()
    stack = [value]
    while stack:
        op = defining_op(stack.pop())
        if op is None:
            continue
        key = op_key(op)
        if key == op_key(target):
            return True
        if key in seen or position.get(key, -1) <= floor:
            continue  # another block's op, or one before the target
        seen.add(key)
        stack.extend(op.operands)
    return False


def _reads(op: ir.Operation, keys: set[int]) -> bool:
    """Whether ``op`` or an op in its regions reads a result of an op in ``keys``."""
    def producer_in(operand: ir.Value) -> bool:
        producer = defining_op(operand)
        return producer is not None and op_key(producer) in keys

    if any(producer_in(v) for v in op.operands):
        return True
    return any(_reads(inner.operation, keys) for region in op.regions
               for inner_block in region.blocks for inner in inner_block.operations)


def _dependents_before(first: ir.Operation, limit: int, ops: list[ir.Operation]
                       ) -> list[ir.Operation] | None:
    """The ops before index ``limit`` that read ``first``'s result, directly or through
    each other, in block order; None when one of them may not move."""
    tainted = {op_key(first)}
    moving = []
    for op in ops[ops.index(first) + 1:limit]:
        if _reads(op, tainted):
            if op.name in _UNMOVABLE or (op.regions and op.name != "stablehlo.reduce"):
                return None
            tainted.add(op_key(op))
            moving.append(op)
    return moving if len(moving) <= _MOVE_LIMIT else None


def _merge_one_pair(block: ir.Block) -> bool:
    """Merge the first pair of amaxes in ``block`` that qualifies; whether one did."""
    ops = [op.operation for op in block.operations]
    position = {op_key(op): index for index, op in enumerate(ops)}
    amaxes = [a for a in (match_amax(op) for op in ops
                          if op.name == "stablehlo.reduce" and not is_discarded(op))
              if a is not None]
    sources = [_sources(a.reduce.operands[0]) for a in amaxes]
    for i, first in enumerate(amaxes):
        for j in range(i + 1, len(amaxes)):
            second = amaxes[j]
            x, y = first.reduce.operands[0], second.reduce.operands[0]
            if x.type != y.type or not sources[i] & sources[j]:
                continue
            if _computed_from(y, first.reduce, position):
                continue
            y_producer = defining_op(y)  # the abs
            moving = _dependents_before(first.reduce, position[op_key(y_producer)], ops)
            if moving is None:
                continue
            _merge(first, second, y_producer, moving)
            return True
    return False


def _merge(first: Amax, second: Amax, y_producer: ir.Operation,
           moving: list[ir.Operation]) -> None:
    """Move ``moving`` after ``y_producer`` and take both amaxes in one reduction,
    placed before the first op that reads either."""
    anchor = y_producer
    for op in moving:
        op.move_after(anchor)
        anchor = op
    readers = {op_key(use.owner) for amax in (first, second)
               for use in amax.reduce.results[0].uses}
    operations = [op.operation for op in second.reduce.block.operations]
    start = operations.index(y_producer)
    earliest = next((op for op in operations[start + 1:] if op_key(op) in readers),
                    operations[-1])  # read by nothing: before the terminator
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
