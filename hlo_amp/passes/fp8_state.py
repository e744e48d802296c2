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
maximum, unchanged, and the running maximum of the amax over the iterations). A tensor
quantised in a loop of a known trip count of at most ``PER_ITERATION_LIMIT`` (a scan over
layers), or in a function every call of which sits in such loops, gets one column per
iteration, as current scaling takes one amax per iteration and Transformer Engine keeps
one history per layer: its scale and its amax are element ``c + k`` of the vectors, ``k``
the iteration (the loop's counter, passed to such a function as one more argument). A
longer loop's tensor, or one in a loop whose trip count cannot be read, has one column:
the largest amax over the iterations. A quantisation anywhere else (a conditional's
branch, a function public besides ``main``, a ``shard_map`` body, whose per-device amax
would make the replicated history differ between devices) is not reachable and keeps
current scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.loops import counter_values, loop_body
from hlo_amp.ir.modules import (
    PassError,
    call_sites,
    callee_name,
    discard,
    function_name,
    functions,
    is_public,
    terminator,
    walk_operations,
)
from hlo_amp.ir.rebuild import call_with_extra, grow_signature, while_with_carries
from hlo_amp.ir.shardings import GIVEN_SHARDINGS
from hlo_amp.ir.sites import location_name

# The scope of the barrier that carries the history through the step.
STATE_SCOPE = "hlo_amp_fp8_state"
_BARRIER = frozenset({"stablehlo.optimization_barrier"})
_CALL = frozenset({"func.call"})
# The most iterations a loop may have for the tensors quantised in it to get a history
# column per iteration: a scan over layers has tens; a scan over a long sequence's time
# steps would multiply the state by its length, so its tensors share one column.
PER_ITERATION_LIMIT = 256


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


def one_caller_each(module: ir.Module, holds: Callable[[Any], bool]) -> int:
    """Give each call of a private function that ``holds(fn)`` (or that calls one that
    does, at any depth) a copy of its own, so every quantised tensor has its own history
    column(s): a function called at two sites (a ``jax.jit`` layer called per layer, a
    scan unrolled twice) shared one, and a layer with small weights was scaled by
    another's amax. Returns the copies made."""
    by_name = {function_name(fn): fn for fn in functions(module)}
    calls_of = {name: [op for op in walk_operations(fn, names=_CALL)]
                for name, fn in by_name.items()}
    holding: dict[str, bool] = {}

    def holds_any(name: str, seen: frozenset = frozenset()) -> bool:
        if name not in holding:
            fn = by_name.get(name)
            holding[name] = fn is not None and not is_public(fn) and name not in seen and (
                holds(fn) or any(holds_any(callee_name(c), seen | {name})
                                 for c in calls_of[name]))
        return holding[name]

    claimed: set[str] = set()
    copies = 0
    pending = [name for name, fn in by_name.items() if is_public(fn)]
    while pending:
        for call in calls_of[pending.pop()]:
            callee = callee_name(call)
            if not holds_any(callee):
                continue
            if callee in claimed:
                copies += 1
                name = f"{callee}_hlo_amp_{copies}"
                while name in by_name:  # a name the module has already
                    copies += 1
                    name = f"{callee}_hlo_amp_{copies}"
                copy = by_name[callee].operation.clone(ip=ir.InsertionPoint(module.body))
                copy.attributes["sym_name"] = ir.StringAttr.get(name)
                call.attributes["callee"] = ir.FlatSymbolRefAttr.get(name)
                by_name[name] = copy.opview if hasattr(copy, "opview") else copy
                calls_of[name] = list(walk_operations(copy, names=_CALL))
                holding[name] = True
                callee = name
            claimed.add(callee)
            pending.append(callee)
    return copies


def callers_by_name(module: ir.Module) -> dict[str, list[Any]]:
    """The ``func.call`` ops of ``module`` by callee name."""
    return call_sites([op for fn in functions(module) for op in walk_operations(fn)])


def iterations(block: Any, callers: dict[str, list[Any]], seen: frozenset = frozenset()
               ) -> int | None:
    """The iterations a tensor quantised in ``block`` gets a history column each for: the
    trip count of the loop whose body ``block`` is, or that every call of ``block``'s
    function sits in (the same count for all); None: one column."""
    if block in seen:
        return None  # recursion
    owner = block.owner
    name = owner.operation.name
    if name == "stablehlo.while":
        values = counter_values(owner.operation)
        if block != loop_body(owner) or values is None:
            return None
        return len(values[1]) if 2 <= len(values[1]) <= PER_ITERATION_LIMIT else None
    if name == "func.func":
        fn = owner.opview
        calls = callers.get(function_name(fn), [])
        if is_public(fn) or not calls or block != fn.regions[0].blocks[0]:
            return None
        counts = {iterations(c.operation.block, callers, seen | {block}) for c in calls}
        return counts.pop() if len(counts) == 1 else None
    return None


def _f32_vector(size: int) -> ir.RankedTensorType:
    return ir.RankedTensorType.get([size], ir.F32Type.get())


def _i32_type() -> ir.RankedTensorType:
    return ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))


def i32_scalar(value: int) -> ir.Value:
    """An i32 scalar constant at the current insertion point (a history column's index)."""
    return hlo.constant(ir.DenseElementsAttr.get_splat(
        _i32_type(), ir.IntegerAttr.get(ir.IntegerType.get_signless(32), value)))


def vector_element(vector: ir.Value, index: int) -> ir.Value:
    """``vector[index:index + 1]`` of a 1-D vector (a history column, a recorded amax),
    at the current insertion point."""
    return hlo.slice(vector, ir.DenseI64ArrayAttr.get([index]),
                     ir.DenseI64ArrayAttr.get([index + 1]), ir.DenseI64ArrayAttr.get([1]))


# The name scope of the loss scaler's redo_on_nan loop's condition (runtime/scaler.py):
# each iteration retries the whole step at a lower loss scale, and only the last one's
# values leave the loop, so only its amaxes are recorded (a rejected try's, finite ones
# 2**r times the accepted try's, won the running maximum: review h107).
RETRY_SCOPE = "hlo_amp_redo_on_nan"


def _is_retry_loop(loop: Any) -> bool:
    """Whether ``loop`` (a stablehlo.while) is the loss scaler's retry loop: its
    condition's ops are in ``RETRY_SCOPE``."""
    return any(RETRY_SCOPE in location_name(op.location).split("/")
               for block in loop.operation.regions[0].blocks for op in block.operations)


def _finite(amaxes: ir.Value, size: int) -> ir.Value:
    """``amaxes`` (f32[S]) with each non-finite one 0: an overflowed step (which the loss
    scaler skips) records 0, so it does not hold every scale at 1 for the whole history;
    taken where a block records them, before the running maximum over a loop's
    iterations, so that the try a ``redo_on_nan`` loop accepts keeps its amax (an
    overflowed try's inf won that maximum, and the column recorded 0)."""
    return hlo.select(hlo.is_finite(amaxes), amaxes, _zeros(size))


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
        # block -> (column index, amax) of each tensor with a column per iteration
        self._placed: dict[Any, list[tuple[ir.Value, ir.Value]]] = {}
        self._iterations: dict[Any, ir.Value] = {}  # block -> its iteration number (i32)
        self._exits: list[tuple[Any, Any]] = []  # (block, how its vector leaves it)
        self.callers = callers_by_name(module)
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
            calls = self.callers.get(function_name(fn), [])
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
        # Where its tensors get a column per iteration, the iteration number too.
        per_iteration = iterations(entry, self.callers) is not None
        if per_iteration:
            self._iterations[entry] = entry.add_argument(_i32_type(), fn.location)
        grow_signature(fn, arguments=1 + per_iteration, results=[vector])
        for call in self.callers.get(function_name(fn), []):
            caller_block = call.operation.block
            extra = [self.history_max(caller_block)]
            if per_iteration:
                extra.append(self.iteration(caller_block))
            new = call_with_extra(call, extra, [vector])
            self._parts.setdefault(caller_block, []).append(new.operation.results[-1])
        self._exits.append((entry, "return"))
        return argument

    def iteration(self, block: Any) -> ir.Value:
        """The iteration number (i32, 0 first) in ``block``, one ``iterations(block)``
        counts (``reachable(block)`` must hold)."""
        found = self._iterations.get(block)
        if found is not None:
            return found
        if block.owner.operation.name == "func.func":
            self.history_max(block)  # threads the iteration number with the history
            return self._iterations[block]
        # The loop as it is now: threading the history rebuilds it (a block object
        # keeps the op it was first read from).
        loop = terminator(block).operation.parent
        position, values = counter_values(loop)
        counter = block.arguments[position]
        start, step = values[0], values[1] - values[0]
        with loop.location, ir.InsertionPoint.at_block_begin(block):
            number = counter
            if counter.type != _i32_type():
                number = hlo.convert(_i32_type(), counter)
            if start:
                number = hlo.subtract(number, i32_scalar(start))
            if step != 1:
                number = hlo.divide(number, i32_scalar(step))
        self._iterations[block] = number
        return number

    def _thread_while(self, loop: Any, body: Any, vector: ir.Type) -> ir.Value:
        outer = self.history_max(loop.operation.block)
        with loop.location, ir.InsertionPoint(loop.operation):
            start = _zeros(self.columns)
        retry = _is_retry_loop(loop)
        new, (given, running) = while_with_carries(loop, [outer, start])
        if not retry:  # the running maximum over the iterations
            self._parts.setdefault(body, []).append(running)
        self._exits.append((body, "carry"))
        self._parts.setdefault(new.operation.block, []).append(new.operation.results[-1])
        return given

    # -- what leaves a block -----------------------------------------------------------

    def contribute(self, block: Any, column: int, amax: ir.Value) -> None:
        """``amax`` (an f32 scalar in ``block``) is column ``column``'s this step."""
        self._scalars.setdefault(block, {})[column] = amax

    def contribute_at(self, block: Any, index: ir.Value, amax: ir.Value) -> None:
        """``amax`` (an f32 scalar in ``block``) is the column at ``index`` (an i32
        scalar in ``block``: a column per iteration) this step."""
        self._placed.setdefault(block, []).append((index, amax))

    def _vector(self, block: Any) -> ir.Value:
        """The running maximum of everything ``block`` contributes, before its end."""
        parts = list(self._parts.get(block, []))
        scalars = self._scalars.get(block, {})
        one = ir.RankedTensorType.get([1], ir.F32Type.get())
        placed = self._placed.get(block, [])
        with ir.InsertionPoint(terminator(block)), terminator(block).location:
            if scalars:
                zero = hlo.constant(ir.DenseElementsAttr.get_splat(
                    one, ir.FloatAttr.get_f32(0.0)))
                pieces = [hlo.reshape(one, scalars[c]) if c in scalars else zero
                          for c in range(self.columns)]
                parts.append(_finite(hlo.concatenate(pieces, ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(64), 0)), self.columns))
            if placed:
                # Each iteration writes its own columns (the running maximum of the other
                # iterations' comes in with parts), from one vector of f32[1] pieces as
                # the other columns' (passes/batch_amax.py reduces such pieces together).
                amaxes = hlo.concatenate([hlo.reshape(one, amax) for _, amax in placed],
                                         ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0))
                columns = _zeros(self.columns)
                for number, (index, _) in enumerate(placed):
                    columns = hlo.dynamic_update_slice(
                        columns, vector_element(amaxes, number), [index])
                parts.append(_finite(columns, self.columns))
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
            newest = hlo.reshape(ir.RankedTensorType.get([1, self.columns],
                                                         ir.F32Type.get()), amax)
            if self.length > 1:
                older = hlo.slice(history, ir.DenseI64ArrayAttr.get([0, 0]),
                                  ir.DenseI64ArrayAttr.get([self.length - 1, self.columns]),
                                  ir.DenseI64ArrayAttr.get([1, 1]))
                newest = hlo.concatenate([newest, older], ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(64), 0))
        for use in list(result.uses):
            if use.owner == end:
                end.operands[use.operand_number] = newest
            else:
                # On an Explicit mesh jax constrains the barrier's result before returning
                # it: the constraint moves behind the new history and reads it (it
                # returned the old history, and the history never advanced).
                chain = _constraints_to(use.owner, end)
                for op in chain:
                    op.move_before(end)
                chain[0].operands[use.operand_number] = newest


def _constraints_to(op: Any, end: Any) -> list[Any]:
    """The chain of one-use sharding constraints from ``op`` to the function's return
    ``end``; a PassError if the state barrier's result reaches anything else (the new
    history would be dropped silently)."""
    chain = []
    while True:
        # What jax puts between the state barrier's result and the return: sharding
        # constraints, which pass the value on unchanged.
        if op.name not in GIVEN_SHARDINGS or len(op.results) != 1:
            raise PassError("fp8 (delayed scaling)", op.name,
                            "the amax history reaches an op other than the return")
        chain.append(op)
        uses = list(op.results[0].uses)
        if len(uses) != 1:
            raise PassError("fp8 (delayed scaling)", op.name,
                            "the amax history is read more than once")
        if uses[0].owner == end:
            return chain
        op = uses[0].owner
