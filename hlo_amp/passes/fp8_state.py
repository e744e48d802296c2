"""The amax history of delayed fp8 scaling, threaded through a module (for passes/fp8.py).

``hlo_amp.compile`` under ``scaling=delayed`` (runtime/fp8_state.py) calls the step with
one more argument, ``history: f32[L, S]`` (the amax of each of the S quantised tensors
over the last L steps, newest first), which the program returns through an
``optimization_barrier`` in the scope ``STATE_SCOPE``. This module finds that barrier,
gives every block holding a quantisation the largest amax of each tensor over the history
(``f32[S]``), collects the amax each tensor has this step, and makes the barrier's
returned value the new history: this step's amax first, the oldest dropped.

Blocks are reached through private functions (one more argument and result per function;
every call passes them) and ``stablehlo.while`` bodies (two more carries: the history
maximum, unchanged, and the running maximum of the amax over the iterations, so a
tensor quantised once per scanned layer has one scale for all layers). A quantisation
anywhere else (a conditional's branch, a function public besides ``main``) is not
reachable and keeps current scaling.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    callee_name,
    discard,
    function_name,
    functions,
    is_call,
    is_public,
    terminator,
    walk_operations,
)
from hlo_amp.ir.rebuild import call_with_extra, grow_signature, while_with_carries

# The scope of the barrier that carries the history through the step.
STATE_SCOPE = "hlo_amp_fp8_state"
_BARRIER = frozenset({"stablehlo.optimization_barrier"})


def find_state(module: ir.Module) -> Any | None:
    """The state barrier of ``module``'s public function, or None. Its operand is the
    history argument, its result what the function returns as the new history."""
    for fn in functions(module):
        if not is_public(fn):
            continue
        entry = fn.regions[0].blocks[0]
        for op in walk_operations(fn, names=_BARRIER):
            if (op.operation.block == entry and len(op.operands) == 1
                    and STATE_SCOPE in str(op.location)
                    and isinstance(op.operands[0].owner, ir.Block)):
                shape = ir.RankedTensorType(op.operands[0].type)
                if shape.rank == 2 and shape.element_type == ir.F32Type.get():
                    return op
    return None


def _f32_vector(size: int) -> ir.RankedTensorType:
    return ir.RankedTensorType.get([size], ir.F32Type.get())


def _zeros(size: int) -> ir.Value:
    vector = _f32_vector(size)
    return hlo.constant(ir.DenseElementsAttr.get_splat(vector, ir.FloatAttr.get_f32(0.0)))


def _reduce_max(value: ir.Value, dimensions: list[int], result: ir.Type) -> ir.Value:
    f32 = ir.F32Type.get()
    scalar = ir.RankedTensorType.get([], f32)
    init = hlo.constant(ir.DenseElementsAttr.get_splat(scalar, ir.FloatAttr.get(f32, 0.0)))
    reduce = hlo.ReduceOp([result], [value], [init], ir.DenseI64ArrayAttr.get(dimensions))
    body = reduce.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        hlo.return_([hlo.maximum(body.arguments[0], body.arguments[1])])
    return reduce.results[0]


class HistoryThreads:
    """Per block: the history maximum ``f32[S]`` reaching it, and the amax values that
    leave it (``contribute``); ``finish`` writes each block's running maximum out and
    the new history into the state barrier's place."""

    def __init__(self, module: ir.Module, barrier: Any):
        self.module = module
        self.barrier = barrier
        shape = ir.RankedTensorType(barrier.operands[0].type)
        self.length, self.columns = shape.shape
        self._inputs: dict[Any, ir.Value] = {}  # block -> history maximum there
        self._parts: dict[Any, list[ir.Value]] = {}  # block -> f32[S] amax vectors
        self._scalars: dict[Any, dict[int, ir.Value]] = {}  # block -> column -> amax
        self._exits: list[tuple[Any, Any]] = []  # (block, how its vector leaves it)
        self._callers: dict[str, list[Any]] = {}
        for fn in functions(module):
            for op in walk_operations(fn):
                if is_call(op):
                    self._callers.setdefault(callee_name(op), []).append(op)
        self._main_entry = barrier.operation.block

    # -- reaching a block --------------------------------------------------------------

    def reachable(self, block: Any, seen: frozenset = frozenset()) -> bool:
        """Whether the history can be threaded to ``block``."""
        if block == self._main_entry or block in self._inputs:
            return True
        if block in seen:
            return False  # recursion
        parent = block.owner
        name = parent.operation.name
        if name == "func.func":
            fn = parent.opview
            calls = self._callers.get(function_name(fn), [])
            return (not is_public(fn) and bool(calls) and block == fn.regions[0].blocks[0]
                    and all(self.reachable(c.operation.block, seen | {block}) for c in calls))
        if name == "stablehlo.while":
            return (block == parent.regions[1].blocks[0]
                    and self.reachable(parent.operation.block, seen | {block}))
        return False

    def history_max(self, block: Any) -> ir.Value:
        """The largest amax per column over the history, in ``block`` (threaded there
        first; ``reachable(block)`` must hold)."""
        found = self._inputs.get(block)
        if found is not None:
            return found
        vector = _f32_vector(self.columns)
        if block == self._main_entry:
            history = self.barrier.operands[0]
            with self.barrier.location, ir.InsertionPoint(self.barrier):
                found = _reduce_max(history, [0], vector)
        elif block.owner.operation.name == "func.func":
            found = self._thread_function(block.owner.opview, block, vector)
        else:
            found = self._thread_while(block.owner.opview, block, vector)
        self._inputs[block] = found
        return found

    def _thread_function(self, fn: Any, entry: Any, vector: ir.Type) -> ir.Value:
        argument = entry.add_argument(vector, fn.location)
        grow_signature(fn, arguments=1, results=[vector])
        for call in self._callers.get(function_name(fn), []):
            caller_block = call.operation.block
            new = call_with_extra(call, [self.history_max(caller_block)], [vector])
            self._parts.setdefault(caller_block, []).append(new.operation.results[-1])
        self._exits.append((entry, "return"))
        return argument

    def _thread_while(self, loop: Any, body: Any, vector: ir.Type) -> ir.Value:
        outer = self.history_max(loop.operation.block)
        with loop.location, ir.InsertionPoint(loop.operation):
            start = _zeros(self.columns)
        new, (given, running) = while_with_carries(loop, [outer, start])
        self._parts.setdefault(body, []).append(running)
        self._exits.append((body, "carry"))
        self._parts.setdefault(new.operation.block, []).append(new.operation.results[-1])
        return given

    # -- what leaves a block -----------------------------------------------------------

    def contribute(self, block: Any, column: int, amax: ir.Value) -> None:
        """``amax`` (an f32 scalar in ``block``) is column ``column``'s this step."""
        self._scalars.setdefault(block, {})[column] = amax

    def _vector(self, block: Any) -> ir.Value:
        """The running maximum of everything ``block`` contributes, before its end."""
        parts = list(self._parts.get(block, []))
        scalars = self._scalars.get(block, {})
        one = ir.RankedTensorType.get([1], ir.F32Type.get())
        with ir.InsertionPoint(terminator(block)), terminator(block).location:
            if scalars:
                zero = hlo.constant(ir.DenseElementsAttr.get_splat(
                    one, ir.FloatAttr.get_f32(0.0)))
                pieces = [hlo.reshape(one, scalars[c]) if c in scalars else zero
                          for c in range(self.columns)]
                parts.append(hlo.concatenate(pieces, ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(64), 0)))
            if not parts:
                return _zeros(self.columns)
            vector = parts[0]
            for part in parts[1:]:
                vector = hlo.maximum(vector, part)
        return vector

    def finish(self) -> None:
        """Write every threaded block's amax out, and the new history in place of the
        barrier's result."""
        for block, how in self._exits:
            vector = self._vector(block)
            end = terminator(block)
            operands = list(end.operands)
            if how == "return":
                operands.append(vector)
            else:  # a while body: the history maximum passes, the running maximum grows
                operands += [block.arguments[len(block.arguments) - 2], vector]
            with end.location, ir.InsertionPoint(end):
                if end.name == "func.return":
                    func_dialect.ReturnOp(operands)
                else:
                    hlo.ReturnOp(operands)
            discard(end)
        amax = self._vector(self._main_entry)
        history = self.barrier.operands[0]
        result = self.barrier.results[0]
        end = terminator(self._main_entry)
        with self.barrier.location, ir.InsertionPoint(end):
            # A non-finite amax (an overflowed step, which the loss scaler skips) is
            # recorded as 0, so it does not hold every scale at 1 for the whole history.
            finite = hlo.select(hlo.is_finite(amax), amax, _zeros(self.columns))
            newest = hlo.reshape(ir.RankedTensorType.get([1, self.columns],
                                                         ir.F32Type.get()), finite)
            if self.length > 1:
                older = hlo.slice(history, ir.DenseI64ArrayAttr.get([0, 0]),
                                  ir.DenseI64ArrayAttr.get([self.length - 1, self.columns]),
                                  ir.DenseI64ArrayAttr.get([1, 1]))
                newest = hlo.concatenate([newest, older], ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(64), 0))
        for use in list(result.uses):
            if use.owner == end:
                end.operands[use.operand_number] = newest
