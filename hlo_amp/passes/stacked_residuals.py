"""Residuals a scan stacks for its backward loop, recomputed there from stacked values
(part of the recompute-residuals pass, passes/recompute_residuals.py).

``jax.lax.scan``'s gradient lowers to two while loops: the forward loop writes each
iteration's residuals into stacked carries (``dynamic_update_slice`` at the iteration's
index) and the backward loop reads them back (``dynamic_slice`` at its own index). In the
mixed modes a SwiGLU's ``silu`` computes its logistic in f32 from the 16-bit gate, and the
forward loop stacks three f32 values of it (``x * s``, ``s``, ``s * (1 - s)``) beside the
16-bit gate itself: per layer, six bytes more per element than the hand cast stores
(issue 48: 1.054 times the hand cast's temp on 8 H100s, scanned without remat).

A stacked residual R is recomputed in the backward loop when:

- the forward body writes R into carry ``k`` at index ``i``, the forward loop's result
  ``k`` is read only as one operand of one other while (the backward loop), whose body
  only reads that carry at one index ``j`` (and returns it unchanged);
- R is made, in the forward body or in the private functions its calls enter, by
  elementwise ops, broadcasts, reshapes, converts and constants from leaves the backward
  body has: values the forward body stacks at the same ``i`` and the backward body
  reads at the same ``j`` (in a partitioned module, only values of R's size: a stacked
  statistic read at another layout was gathered by XLA's partitioner); loop-invariant
  carries whose start is a constant, or is also a loop-invariant carry of the backward
  loop; constants, and calls without operands of functions that only make constants
  (no effect is made twice);
- at most ``MAX_OPS`` ops make it.

The copy is the same ops on the same values, so the same values; it is written right
before the first reader of R's slice, which then reads the copy. The forward loop still
writes R's stack, which nothing reads any more: XLA's while-loop simplifier drops such a
carry from both loops, and then the ops that made R where nothing else reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxlib.mlir import ir

from hlo_amp.ir.loops import WHILE, counter_values, int_constant
from hlo_amp.ir.modules import (
    callee_name,
    discard,
    element_count,
    is_public,
    live_uses,
    op_key,
    terminator,
    walk_operations,
)
from hlo_amp.ir.op_classes import INFER, OP_CLASSES, short_name
from hlo_amp.ir.shardings import is_partitioned

MAX_OPS = 32
_ELEMENTWISE = frozenset(name for name, cls in OP_CLASSES.items() if cls == INFER)
_CLONED = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.convert",
                     "stablehlo.reshape"})
_WRITE = "stablehlo.dynamic_update_slice"
_READ = "stablehlo.dynamic_slice"


@dataclass
class _Loops:
    """A forward loop and the backward loop that reads its stacks."""

    forward: ir.Operation
    backward: ir.Operation
    # forward carry -> (stacked value, index) of the body's write into it
    writes: dict[int, tuple[ir.Value, ir.Value]] = field(default_factory=dict)
    # backward carry -> (slice read, index) of the body's one read of it
    reads: dict[int, tuple[ir.Value, ir.Value]] = field(default_factory=dict)
    # forward result -> backward operand position
    passed: dict[int, int] = field(default_factory=dict)


def recompute_stacked(module: ir.Module, loops_in_module: list[ir.Operation],
                      by_name: dict) -> tuple[int, int]:
    """Recompute every stacked residual the rules allow among ``module``'s while loops:
    how many, and the bytes of the stacks no longer read."""
    count = saved = 0
    partitioned = is_partitioned(module)
    for forward in loops_in_module:
        for loops in _backward_loops(forward, by_name):
            for carry in list(loops.passed):
                if loops.passed[carry] not in loops.reads:
                    continue
                stack_bytes = _recompute(loops, carry, by_name, partitioned)
                count += stack_bytes > 0
                saved += stack_bytes
    return count, saved


def _backward_loops(forward: ir.Operation, by_name: dict) -> list[_Loops]:
    """Each while that reads some of ``forward``'s stacked results, with its reads."""
    writes = _writes(forward, by_name)
    if not writes:
        return []
    found: dict[int, _Loops] = {}
    for carry in writes:
        uses = list(live_uses(forward.results[carry]))
        if len(uses) != 1 or uses[0].owner.name != WHILE:
            continue
        backward = uses[0].owner
        if backward.operands[uses[0].operand_number] != forward.results[carry]:
            continue
        loops = found.get(op_key(backward))
        if loops is None:
            loops = _Loops(forward, backward, writes=writes,
                           reads=_reads(backward.regions[1].blocks[0], by_name))
            found[op_key(backward)] = loops
        loops.passed[carry] = uses[0].operand_number
    return list(found.values())


def _writes(loop: ir.Operation, by_name: dict) -> dict[int, tuple[ir.Value, ir.Value]]:
    """Carry position -> (value, index) where the body returns the carry with ``value``
    written at ``index`` of its leading dimension and reads it nowhere else, and the
    iterations write every position of it once (so that a position holds what the
    iteration that wrote it computed)."""
    body = loop.regions[1].blocks[0]
    counter = counter_values(loop)
    if counter is None:
        return {}
    found = {}
    for position, returned in enumerate(terminator(body).operands):
        if isinstance(returned, ir.BlockArgument):
            continue
        carry = body.arguments[position]
        written = _write(returned.owner, by_name)
        if written is None or written[0] != carry:
            continue
        if sum(1 for _ in live_uses(carry)) != 1:
            continue
        length = ir.RankedTensorType(carry.type).shape[0]
        if sorted(_index_values(written[2], body, *counter) or []) != list(range(length)):
            continue
        found[position] = (written[1], written[2])
    return found


def _index_values(index: ir.Value, body: ir.Block, counter: int, values: list[int]
                  ) -> list[int] | None:
    """The value ``index`` holds in each iteration, when it is the counter, or the
    counter plus or minus a constant, or a constant minus it; None otherwise."""
    if isinstance(index, ir.BlockArgument):
        ok = index.owner == body and ir.BlockArgument(index).arg_number == counter
        return values if ok else None
    owner = index.owner
    if owner.name not in ("stablehlo.add", "stablehlo.subtract"):
        return None
    lhs, rhs = owner.operands
    lhs_values = _index_values(lhs, body, counter, values)
    rhs_values = _index_values(rhs, body, counter, values)
    if lhs_values is not None and int_constant(rhs) is not None:
        sign = 1 if owner.name == "stablehlo.add" else -1
        return [v + sign * int_constant(rhs) for v in lhs_values]
    if rhs_values is not None and int_constant(lhs) is not None:
        sign = 1 if owner.name == "stablehlo.add" else -1
        return [int_constant(lhs) + sign * v for v in rhs_values]
    return None


def _reads(body: ir.Block, by_name: dict) -> dict[int, tuple[ir.Value, ir.Value]]:
    """Carry position -> (slice, index) of a loop-invariant carry the body reads once,
    at one index of its leading dimension, and uses nowhere else."""
    found = {}
    returned = terminator(body).operands
    for position, carry in enumerate(body.arguments):
        if returned[position] != carry:
            continue
        uses = [use.owner for use in live_uses(carry) if use.owner != terminator(body)]
        if len(uses) != 1:
            continue
        read = _read(uses[0], by_name)
        if read is not None and read[0] == carry:
            found[position] = (read[1], read[2])
    return found


def _write(op: ir.Operation, by_name: dict) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(stack, value, index)`` when ``op`` returns ``stack`` with ``value`` written at
    ``index`` of its leading dimension: a ``dynamic_update_slice`` of a reshape (or a
    leading-1 broadcast) of the value, the other start indices 0, or a call of a
    private function that is only that (jax's ``dynamic_update_index_in_dim``)."""
    if op.name == "func.call":
        helper = _helper(op, by_name, 3)
        inner = None if helper is None else _write(helper[1], by_name)
        if inner is None or list(inner) != helper[0]:
            return None
        return op.operands[0], op.operands[1], op.operands[2]
    if op.name != _WRITE or not all(_is_zero(v) for v in op.operands[3:]):
        return None
    stack, update, index = op.operands[0], op.operands[1], op.operands[2]
    if isinstance(update, ir.BlockArgument) or not _is_leading_one(update.owner):
        return None
    value = update.owner.operands[0]
    if _shape(value) != _shape(stack)[1:]:
        return None
    return stack, value, index


def _read(op: ir.Operation, by_name: dict) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(stack, slice, index)`` when ``op`` reads the whole slice at ``index`` of
    ``stack``'s leading dimension: a ``dynamic_slice`` (the other start indices 0) whose
    one reader reshapes the leading 1 away, or a call of a private function that is only
    that (jax's ``dynamic_index_in_dim``)."""
    if op.name == "func.call":
        helper = _helper(op, by_name, 2)
        if helper is None or helper[1].name != "stablehlo.reshape":
            return None
        sliced = helper[1].operands[0]
        inner = None if isinstance(sliced, ir.BlockArgument) else _read(sliced.owner, by_name)
        if inner is None or [inner[0], inner[2]] != helper[0]:
            return None
        return op.operands[0], op.results[0], op.operands[1]
    if op.name != _READ or not all(_is_zero(v) for v in op.operands[2:]):
        return None
    stack, sliced = op.operands[0], op.results[0]
    if _shape(sliced) != [1, *_shape(stack)[1:]]:
        return None
    reshapes = [use.owner for use in live_uses(sliced)]
    if len(reshapes) != 1 or reshapes[0].name != "stablehlo.reshape":
        return None
    return stack, reshapes[0].results[0], op.operands[1]


def _helper(call: ir.Operation, by_name: dict, arity: int
            ) -> tuple[list[ir.Value], ir.Operation] | None:
    """``(arguments, op)`` of the private function ``call`` calls, ``op`` making what it
    returns, when it takes ``arity`` operands (the last a scalar index), returns one
    value and holds nothing but one slice or update, its reshape or broadcast, and
    constants."""
    fn = by_name.get(callee_name(call))
    if (fn is None or is_public(fn) or len(call.operands) != arity
            or len(call.results) != 1 or element_count(call.operands[arity - 1]) != 1):
        return None
    allowed = {_WRITE, _READ, "stablehlo.reshape", "stablehlo.broadcast_in_dim",
               "stablehlo.constant", "func.return"}
    names = [op.name for op in walk_operations(fn)]
    if any(name not in allowed for name in names) or (names.count(_WRITE)
                                                      + names.count(_READ)) != 1:
        return None
    entry = fn.regions[0].blocks[0]
    returned = terminator(entry).operands[0]
    if isinstance(returned, ir.BlockArgument):
        return None
    return list(entry.arguments), returned.owner


def _is_leading_one(op: ir.Operation) -> bool:
    """Whether ``op`` only puts a leading dimension of 1 in front of its operand."""
    if op.name not in ("stablehlo.reshape", "stablehlo.broadcast_in_dim"):
        return False
    shape, operand_shape = _shape(op.results[0]), _shape(op.operands[0])
    if shape != [1, *operand_shape]:
        return False
    if op.name == "stablehlo.broadcast_in_dim":
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
        return dims == list(range(1, len(shape)))
    return True


def _shape(value: ir.Value) -> list[int]:
    return list(ir.RankedTensorType(value.type).shape)


def _is_zero(value: ir.Value) -> bool:
    return int_constant(value) == 0


class _CannotRecompute(Exception):
    pass


def _makes_constants(fn: ir.Operation) -> bool:
    """Whether private function ``fn`` only makes values from constants (jax's
    ``silu()`` returning 1.0): a call of it may be made again anywhere, having no
    effects (no custom call, no random bits, no infeed)."""
    return all(op.name in _CLONED or op.name in ("stablehlo.constant", "func.return")
               or short_name(op.name) in _ELEMENTWISE for op in walk_operations(fn))


def _is_constant(op: ir.Operation, by_name: dict) -> bool:
    """Whether ``op`` makes constants alone: a ``stablehlo.constant``, or a call without
    operands of a private function that only makes constants (a copy computes the same)."""
    if op.name == "func.call":
        fn = by_name.get(callee_name(op))
        return (fn is not None and not is_public(fn) and not len(op.operands)
                and _makes_constants(fn))
    return op.name == "stablehlo.constant"


def _recompute(loops: _Loops, carry: int, by_name: dict, partitioned: bool) -> int:
    """Recompute the residual stacked in forward carry ``carry`` in the backward body;
    the stack's bytes, or 0 when the rules do not allow it."""
    residual = loops.writes[carry][0]
    read, read_index = loops.reads[loops.passed[carry]]
    readers = [use.owner for use in live_uses(read)]
    if not readers:
        return 0
    backward_body = loops.backward.regions[1].blocks[0]
    first = first_in_block(backward_body, readers)
    copier = _Copier(loops, carry, read_index, first, by_name, partitioned)
    try:
        copy = copier.make(residual, ())
    except _CannotRecompute:
        copier.undo()
        return 0
    read.replace_all_uses_with(copy)
    stack = loops.forward.results[carry]
    return (element_count(stack) or 0) * _bytes(stack)


def _bytes(value: ir.Value) -> int:
    element = ir.RankedTensorType(value.type).element_type
    width = getattr(element, "width", None)
    return max(1, (width or 32) // 8)


def first_in_block(block: ir.Block, readers: list[ir.Operation]) -> ir.Operation:
    """The first of ``readers`` in ``block`` (one nested in an op of it counts as that
    op); the recompute-residuals pass writes its copies before it."""
    first = None
    for reader in readers:
        op = reader.operation
        while op is not None and op.block != block:
            parent = op.parent
            op = parent.operation if parent is not None else None
        if op is not None and (first is None or op.is_before_in_block(first)):
            first = op
    if first is None:
        raise AssertionError("no reader of the residual in its block")
    return first


class _Copier:
    """Clones the ops that make a forward value into the backward body, before
    ``first``; a value is traced inside the private functions its calls enter (``calls``:
    the call ops from the forward body in)."""

    def __init__(self, loops: _Loops, carry: int, read_index: ir.Value,
                 first: ir.Operation, by_name: dict, partitioned: bool):
        self.loops, self.carry, self.read_index = loops, carry, read_index
        self.index = loops.writes[carry][1]
        self.size = element_count(loops.writes[carry][0])
        self.partitioned = partitioned
        self.first, self.by_name = first, by_name
        self.where = ir.InsertionPoint(first)
        self.made: list[tuple[tuple[int, ...], ir.Value, ir.Value]] = []
        self.clones: list[ir.Operation] = []
        self.cost = 0

    def undo(self) -> None:
        """Drop the clones made so far (nothing reads them): erased after the pass."""
        for clone in self.clones:
            discard(clone)
        self.clones = []

    def value(self, value: ir.Value, calls: tuple[ir.Operation, ...]) -> ir.Value:
        key = tuple(op_key(call) for call in calls)
        for known_key, known, copy in self.made:
            if known_key == key and known == value:
                return copy
        copy = self._leaf(value, calls)
        if copy is None:
            copy = self.make(value, calls)
        self.made.append((key, value, copy))
        return copy

    def make(self, value: ir.Value, calls: tuple[ir.Operation, ...]) -> ir.Value:
        """A copy of ``value`` made by cloning the ops that make it (never its slice)."""
        if isinstance(value, ir.BlockArgument):
            if not calls:
                return self._loop_invariant(value)
            call = calls[-1]
            entry = self.by_name[callee_name(call)].regions[0].blocks[0]
            if value.owner != entry:
                raise _CannotRecompute
            return self.value(call.operands[ir.BlockArgument(value).arg_number], calls[:-1])
        owner = value.owner.operation  # an OpView's .name can be an attribute's
        number = ir.OpResult(value).result_number
        if _is_constant(owner, self.by_name):
            return self._clone(owner, []).results[number]
        if owner.name == "func.call":
            fn = self.by_name.get(callee_name(owner))
            if fn is None or is_public(fn):
                raise _CannotRecompute
            returned = terminator(fn.regions[0].blocks[0]).operands[number]
            return self.value(returned, (*calls, owner))
        if ((short_name(owner.name) not in _ELEMENTWISE and owner.name not in _CLONED)
                or len(owner.regions) or len(owner.results) != 1):
            raise _CannotRecompute
        self.cost += 1
        if self.cost > MAX_OPS:
            raise _CannotRecompute
        operands = [self.value(operand, calls) for operand in owner.operands]
        return self._clone(owner, operands).results[0]

    def _leaf(self, value: ir.Value, calls: tuple[ir.Operation, ...]) -> ir.Value | None:
        """The backward body's slice of ``value`` when the forward body stacks it at the
        residual's index (and the backward body reads it at the residual's index)."""
        if calls:  # a value the innermost call returns may be stacked outside it
            call = calls[-1]
            fn_return = terminator(self.by_name[callee_name(call)].regions[0].blocks[0])
            for position, returned in enumerate(fn_return.operands):
                if returned == value:
                    outer = self._leaf(call.results[position], calls[:-1])
                    if outer is not None:
                        return outer
            return None
        # In a partitioned module a stacked statistic (a norm's rsqrt per row) is no
        # leaf: XLA's partitioner may make the copy at another layout than the stored
        # residual's and gather the statistic for it, where the stored residual needed
        # nothing (issue 48's KV head split over TP: two gathers the hand cast does not
        # have).
        if self.partitioned and element_count(value) != self.size:
            return None
        loops = self.loops
        for carry, (written, index) in loops.writes.items():
            if written != value or index != self.index or carry == self.carry:
                continue
            position = loops.passed.get(carry)
            read = loops.reads.get(position) if position is not None else None
            if read is not None and read[1] == self.read_index and (
                    isinstance(read[0], ir.BlockArgument)
                    or read[0].owner.is_before_in_block(self.first)):
                return read[0]
        return None

    def _loop_invariant(self, argument: ir.Value) -> ir.Value:
        """A loop-invariant carry of the forward loop, in the backward body: its start
        made again when a constant, else the backward loop's own invariant carry of the
        same start."""
        loops = self.loops
        position = ir.BlockArgument(argument).arg_number
        body = loops.forward.regions[1].blocks[0]
        if argument.owner != body or terminator(body).operands[position] != argument:
            raise _CannotRecompute
        start = loops.forward.operands[position]
        backward_body = loops.backward.regions[1].blocks[0]
        backward_returned = terminator(backward_body).operands
        for other, operand in enumerate(loops.backward.operands):
            if operand == start and backward_returned[other] == backward_body.arguments[other]:
                return backward_body.arguments[other]
        if isinstance(start, ir.BlockArgument):
            raise _CannotRecompute
        if _is_constant(start.owner, self.by_name):
            return self._clone(start.owner, []).results[ir.OpResult(start).result_number]
        raise _CannotRecompute

    def _clone(self, op: ir.Operation, operands: list[ir.Value]) -> ir.Operation:
        clone = op.clone(ip=self.where)
        for position, operand in enumerate(operands):
            clone.operands[position] = operand
        self.clones.append(clone)
        return clone
