"""How many times an op inside ``stablehlo.while`` loops runs: trip counts read from the
loops' StableHLO.

``jax.lax.scan`` and ``fori_loop`` with static bounds lower to a while whose carry holds
a counter that starts at a constant, whose ``cond`` compares it with a constant (``LT``)
and whose body returns it plus a constant (``stablehlo.add %counter, 1``). A
``fori_loop`` with traced bounds compares with a carry that starts at a function
argument, and a ``while_loop``'s condition can be anything: their trip count is None.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    body_name,
    callee_name,
    constant_value,
    function_name,
    functions,
    is_call,
    is_public,
    op_key,
    terminator,
    walk_operations,
)
from hlo_amp.ir.shardings import GIVEN_SHARDINGS

WHILE = "stablehlo.while"
# The direction that reads the same with the operands swapped.
_SWAPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def int_constant(value: ir.Value) -> int | None:
    """The integer of a scalar (or splat) ``stablehlo.constant``; None for anything else."""
    attribute = constant_value(value)
    if not isinstance(attribute, ir.DenseIntElementsAttr) or not attribute.is_splat:
        return None
    splat = attribute.get_splat_value()
    return ir.IntegerAttr(splat).value if isinstance(splat, ir.IntegerAttr) else None


def argument_number(value: ir.Value, block: ir.Block) -> int | None:
    """The position of ``value`` among ``block``'s arguments, None if it is not one."""
    if isinstance(value, ir.BlockArgument) and value.owner == block:
        return ir.BlockArgument(value).arg_number
    return None


def trip_count(loop: ir.Operation) -> int | None:
    """The iterations of a ``stablehlo.while`` whose condition compares a counter carry
    (constant start, constant step added in the body) with a constant or a carry the body
    returns unchanged that starts at a constant; None when it cannot be read."""
    found = _counter(loop)
    return None if found is None else found[3]


def counter_values(loop: ir.Operation) -> tuple[int, list[int]] | None:
    """``(position, values)``: the carry ``trip_count`` reads as the counter and the value
    it holds in each iteration; None when the trip count cannot be read."""
    found = _counter(loop)
    if found is None:
        return None
    counter, start, step, count = found
    return counter, [start + k * step for k in range(count)]


def _counter(loop: ir.Operation) -> tuple[int, int, int, int] | None:
    """``(position, start, step, iterations)`` of the loop's counter carry (``trip_count``
    says which loops have one)."""
    cond = loop.regions[0].blocks[0]
    body = loop.regions[1].blocks[0]
    predicate = _unconstrained(terminator(cond).operands[0])
    if isinstance(predicate, ir.BlockArgument) or predicate.owner.name != "stablehlo.compare":
        return None
    compare = predicate.owner
    direction = hlo.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value
    lhs, rhs = (_unconstrained(v) for v in compare.operands)
    counter = argument_number(lhs, cond)
    bound = rhs
    if counter is None:
        counter, bound, direction = argument_number(rhs, cond), lhs, _SWAPPED[direction]
    if counter is None:
        return None
    limit = int_constant(bound)
    fixed = argument_number(bound, cond)
    # A carry the body hands back as it got it: the loop's operand is its value.
    if (limit is None and fixed is not None and argument_number(
            _unconstrained(terminator(body).operands[fixed]), body) == fixed):
        limit = int_constant(_unconstrained(loop.operands[fixed]))
    start = int_constant(_unconstrained(loop.operands[counter]))
    step = _step(_unconstrained(terminator(body).operands[counter]), body, counter)
    if limit is None or start is None or not step:
        return None
    count = _iterations(direction, start, limit, step)
    return None if count is None else (counter, start, step, count)


def _step(value: ir.Value, body: ir.Block, counter: int) -> int | None:
    """``c`` when the body returns its counter argument plus (or minus) a constant ``c``."""
    if isinstance(value, ir.BlockArgument) or value.owner.name not in (
            "stablehlo.add", "stablehlo.subtract"):
        return None
    lhs, rhs = (_unconstrained(v) for v in value.owner.operands)
    if value.owner.name == "stablehlo.subtract":
        constant = int_constant(rhs)
        ok = argument_number(lhs, body) == counter
        return -constant if ok and constant is not None else None
    for argument, other in ((lhs, rhs), (rhs, lhs)):
        if argument_number(argument, body) == counter:
            return int_constant(other)
    return None


def _unconstrained(value: ir.Value) -> ir.Value:
    """``value`` before the sharding constraints that hand it on (on an Explicit mesh
    jax wraps a scan's counter, its bound and its increment in them)."""
    while not isinstance(value, ir.BlockArgument) and value.owner.name in GIVEN_SHARDINGS:
        value = value.owner.operands[0]
    return value


def _iterations(direction: str, start: int, limit: int, step: int) -> int | None:
    """How often ``counter <direction> limit`` holds for counter = start, start+step, …"""
    if direction in ("LT", "LE") and step > 0:
        span = limit - start + (direction == "LE")
        return max(0, -(-span // step))
    if direction in ("GT", "GE") and step < 0:
        span = start - limit + (direction == "GE")
        return max(0, -(-span // -step))
    if direction == "NE" and (limit - start) % step == 0 and (limit - start) // step >= 0:
        return (limit - start) // step
    return None


@dataclass(frozen=True)
class Runs:
    """How many times an op runs per run of its function."""

    count: int  # the product of the enclosing loops' trip counts (1 for an unknown one)
    unknown: int = 0  # enclosing loops whose trip count could not be read


class LoopCounts:
    """Trip counts of while loops, each read once (keyed by ``op_key``)."""

    def __init__(self) -> None:
        self._trips: dict[int, int | None] = {}

    def trip(self, loop: ir.Operation) -> int | None:
        key = op_key(loop)
        if key not in self._trips:
            self._trips[key] = trip_count(loop)
        return self._trips[key]

    def runs(self, op: ir.Operation) -> Runs:
        """How often ``op`` runs per run of the function holding it: each enclosing
        while's trip count (its ``cond`` one more), an unknown one counted once."""
        count, unknown = 1, 0
        inner = op
        parent = op.parent
        while parent is not None and parent.name != "func.func":
            if parent.name == WHILE:
                trip = self.trip(parent)
                if trip is None:
                    unknown += 1
                else:
                    in_cond = inner.block == parent.regions[0].blocks[0]
                    count *= trip + 1 if in_cond else trip
            inner, parent = parent, parent.parent
        return Runs(count, unknown)


def function_runs(module: ir.Module, loops: LoopCounts) -> dict[str, Runs]:
    """How often each function of ``module`` runs per call of its public function: a
    public one once, a private one as often as its call sites together, each its
    caller's runs times the trip counts of the loops around the call (a scanned
    layer's body: the layer count)."""
    by_name = {function_name(fn): fn for fn in functions(module)}
    callers: dict[str, list[tuple[str, Any]]] = {}
    for name, fn in by_name.items():
        for op in walk_operations(fn):
            if (body := body_name(op)) is not None:  # a composite's decomposition too
                callers.setdefault(body, []).append((name, op))
    found: dict[str, Runs] = {}
    for name in by_name:  # a module-level helper: a recursive closure is a reference cycle
        _runs_of(name, (), by_name, callers, loops, found)
    return found


def _runs_of(name: str, stack: tuple[str, ...], by_name: dict[str, Any],
             callers: dict[str, list[tuple[str, Any]]], loops: LoopCounts,
             found: dict[str, Runs]) -> Runs:
    if name in found:
        return found[name]
    sites = [] if is_public(by_name[name]) else callers.get(name, [])
    if not sites or name in stack:  # public (or a cycle, which JAX never writes)
        return found.setdefault(name, Runs(1))
    count, unknown = 0, 0
    for caller, call in sites:
        outer = _runs_of(caller, stack + (name,), by_name, callers, loops, found)
        here = loops.runs(call)
        count += outer.count * here.count
        unknown += outer.unknown + here.unknown
    return found.setdefault(name, Runs(count, unknown))


def op_runs(runs: dict[str, Runs], loops: LoopCounts, fn_name: str, op: Any) -> Runs:
    """How often ``op`` runs per call of the program: its function's runs
    (``function_runs``) times the trip counts of the loops around it in that function."""
    outer = runs.get(fn_name, Runs(1))
    here = loops.runs(op)
    return Runs(outer.count * here.count, outer.unknown + here.unknown)


def loop_body(loop: object) -> ir.Block:
    """The body block of a ``stablehlo.while``."""
    return loop.operation.regions[1].blocks[0]


def _owner_op(value: ir.Value) -> ir.Operation:
    owner = value.owner
    if isinstance(owner, ir.Block):
        return owner.owner.operation
    return owner.operation if hasattr(owner, "operation") else owner


def inside(op: object, loop: object) -> bool:
    """Whether ``op`` sits in one of ``loop``'s regions, at any depth."""
    loop_op = loop.operation
    parent: ir.Operation | None = op.operation.parent
    while parent is not None:
        if parent == loop_op:
            return True
        parent = parent.parent
    return False


def defined_outside(value: ir.Value, loop: object) -> bool:
    """Whether ``value`` is defined outside ``loop`` (not in any of its regions)."""
    owner = _owner_op(value)
    return owner != loop.operation and not inside(owner, loop)


def is_invariant(value: ir.Value, loop: object) -> bool:
    """``value`` is the same on every iteration of ``loop``'s body: defined outside it,
    or a carry the body returns unchanged."""
    body = loop_body(loop)
    index = argument_number(value, body)
    if index is not None:
        return terminator(body).operands[index] == value
    return defined_outside(value, loop)


def outside_value(value: ir.Value, loop: object) -> ir.Value:
    """What an invariant ``value`` of ``loop``'s body is before the loop: the carry's
    initial operand, or ``value`` itself when it is defined outside."""
    index = argument_number(value, loop_body(loop))
    return value if index is None else loop.operation.operands[index]


def _whiles_around(op: object) -> Iterator[ir.Operation]:
    """The ``stablehlo.while`` ops around ``op`` in its function, innermost first."""
    parent = op.operation.parent
    while parent is not None and parent.name != "func.func":
        if parent.name == WHILE:
            yield parent
        parent = parent.parent


def in_while(op: object) -> bool:
    """Whether ``op`` sits in a ``stablehlo.while`` region of its function, at any depth."""
    return next(_whiles_around(op), None) is not None


def enclosing_loops(op: object) -> tuple[int, ...]:
    """The ``stablehlo.while`` ops around ``op`` in its function, outermost first, as op
    keys."""
    return tuple(reversed([op_key(loop) for loop in _whiles_around(op)]))


# A loop whose results carry sharding attributes keeps its carries in the hoisting passes:
# one more would need a sharding of its own.
_SHARDING_ATTRIBUTES = ("sdy.sharding", "mhlo.sharding")


def is_sharded(loop: object) -> bool:
    """Whether ``loop``'s results carry sharding attributes (Shardy's or GSPMD's)."""
    return any(name in loop.operation.attributes for name in _SHARDING_ATTRIBUTES)


def enclosing_while(op: object) -> object | None:
    """The while whose body block holds ``op`` directly, else None."""
    parent = op.operation.parent
    if parent is None or not isinstance(parent.opview, hlo.WhileOp):
        return None
    return parent.opview if op.operation.block == loop_body(parent) else None


@dataclass(frozen=True)
class StackSlice:
    """``root`` is slice ``index`` of ``stack`` along ``axis`` (that axis dropped)."""

    stack: ir.Value
    index: ir.Value
    axis: int


def _slice_in_block(op: ir.Operation) -> StackSlice | None:
    """``op`` as ``reshape(dynamic_slice(stack, starts))`` where the slice is one element
    along one axis and whole along the others and the reshape drops that axis."""
    if op.name != "stablehlo.reshape" or isinstance(op.operands[0], ir.BlockArgument):
        return None
    dynamic = op.operands[0].owner
    if dynamic.name != "stablehlo.dynamic_slice":
        return None
    stack = ir.RankedTensorType(dynamic.operands[0].type).shape
    sizes = list(ir.DenseI64ArrayAttr(dynamic.attributes["slice_sizes"]))
    axes = [axis for axis, (size, full) in enumerate(zip(sizes, stack)) if size != full]
    if len(axes) != 1 or sizes[axes[0]] != 1:
        return None
    axis = axes[0]
    if list(ir.RankedTensorType(op.results[0].type).shape) != stack[:axis] + stack[axis + 1:]:
        return None
    # The other starts do not matter: a whole-axis slice always starts at 0.
    return StackSlice(dynamic.operands[0], dynamic.operands[1 + axis], axis)


def stack_slice(root: ir.Value, by_name: dict[str, Any]) -> StackSlice | None:
    """``root`` as a slice of a stack (a scan's stacked weight): written in its block, or a
    call of a function that only slices its argument (jax's ``dynamic_index_in_dim``);
    ``by_name`` holds the module's functions by name."""
    if isinstance(root, ir.BlockArgument):
        return None
    op = root.owner.operation
    if not is_call(op):
        return _slice_in_block(op)
    callee = by_name.get(callee_name(op))
    if callee is None or len(op.results) != 1:
        return None
    entry = callee.regions[0].blocks[0]
    returned = terminator(entry).operands[0]
    inner = (None if isinstance(returned, ir.BlockArgument)
             else _slice_in_block(returned.owner.operation))
    if inner is None:
        return None
    stack, start = argument_number(inner.stack, entry), argument_number(inner.index, entry)
    if stack is None or start is None:
        return None
    return StackSlice(op.operands[stack], op.operands[start], inner.axis)
