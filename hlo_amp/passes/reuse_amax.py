"""An amax a later loop recomputes, read from the loop that took it first.

Under ``jax.checkpoint`` in a ``lax.scan`` the backward loop recomputes each layer's
forward, and fp8.py quantises the recomputed activations again, each after its own amax:
a reduction over a tensor the forward loop already reduced. Where the recomputation is
the same computation on the same values, the amax is the forward loop's:

    forward loop, iteration i:   a = amax(E(h, W[i]))   h a carry the body stores as R[i]
    backward loop, layer j:      b = amax(E(R[j], W[j]))

so the forward loop keeps ``a`` (one more carry, ``A`` of the trip count's length, row i
written at iteration i) and the backward loop reads ``b = A[j]`` instead of reducing.

The two sides are matched op by op (name, attributes, result types, regions, operands in
order), through private functions called once and calls of any function, down to leaves
that must agree: the forward loop's counter and the backward's one layer index ``j``; a
slice at the counter of a stack invariant in the forward loop and the slice at ``j`` of
the same stack in the backward; a forward carry the body stores whole at the counter into
a stack carry ``R``, and the slice at ``j`` of the forward loop's result ``R``; values
from before either loop, the same. The forward loop's counter must run over every row of
those stacks once (0, 1, …, n-1), so ``A[j]`` is the amax iteration ``j`` took; the
backward slices at ``j`` clamp as ``A`` does. Equal inputs through equal ops give equal
values, so the pass needs no name to tell a backward loop, and changes no bits: the
amax (a maximum, exact) is the one the backward would have computed. One equality is
assumed rather than read: cuDNN's fused attention writes the same output whether or not
the call also writes the softmax statistics (the recomputing call does). Should a GPU's
two kernels differ in a last bit, the backward quantises with the forward's scale, its
clamp keeping the values in range.

Only the amaxes fp8.py writes (hoist_amax.match_amax) are matched; a weight's amax (a
slice's alone) is hoist_amax's, which takes it for every layer before both loops. Loops
with shardings on their results are left alone (a new carry would need one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.loops import (
    argument_number,
    counter_values,
    enclosing_while,
    is_invariant,
    is_sharded,
    loop_body,
    outside_value,
    stack_slice,
)
from hlo_amp.ir.modules import (
    call_sites,
    call_target,
    callee_entry,
    callee_name,
    erase_discarded,
    function_name,
    functions,
    growable_functions,
    is_call,
    op_key,
    terminator,
    walk_operations,
)
from hlo_amp.ir.rebuild import call_with_extra, grow_signature, return_also, while_with_carries
from hlo_amp.passes.hoist_amax import Amax, match_amax
from hlo_amp.report import Report

# Attributes a pass of ours writes on ops (decision marks, ...): not the op's meaning.
_OWN_ATTRIBUTE = "hlo_amp."
# cuDNN's fused attention calls (jax's cudnn lowering) and the attributes that describe
# their results, which differ with the statistics output (_attention_output).
_ATTENTION_CALL = "__cudnn$fmha"
_ATTENTION_RESULT_ATTRIBUTES = frozenset({"result_layouts"})
# How many ops deep a value before both loops is matched against the backward's own.
_OUTSIDE_DEPTH = 8
# A match walks at most this many value pairs (a layer is a few hundred ops).
_MAX_PAIRS = 20000


@dataclass(frozen=True)
class ReuseAmax:
    """Read a recomputed activation's amax from the loop that took it first (module doc)."""

    name: str = "hlo-amp-reuse-amax"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        reused = 0
        with module.context, ir.Location.unknown():
            # One amax per round: each rebuilds two loops and the calls between.
            while _reuse_one(module):
                erase_discarded(self.name)
                reused += 1
        if report is not None and reused:
            report.notes.append(f"reuse-amax: {reused} amax(es) of a recomputed activation "
                                "read from the loop that computed it first")


@dataclass
class _Site:
    """Where an amax sits: its loop and the calls from the loop's body down to it."""

    amax: Amax
    loop: Any
    calls: list[Any]  # outermost first; each callee is private and called only there


@dataclass
class _Pair:
    """What a forward loop ``forward`` and a later loop ``backward`` agree on."""

    forward: Any
    backward: Any
    counter: int  # the forward loop's counter carry
    rows: int  # its trip count: the rows of every matched stack
    # A value of the forward body (a carry, or what a callee computes) -> the stack carry
    # and axis the body stores it into, whole, at the counter.
    stores: dict[ir.Value, tuple[int, int]]
    by_name: dict[str, Any]
    sites: dict[str, list[Any]]
    layer: ir.Value | None = None  # the backward loop's one layer index
    stored: bool = False  # whether the match met a stored carry (an activation)
    seen: dict[tuple[Any, ...], bool] = field(default_factory=dict)


def _reuse_one(module: ir.Module) -> bool:
    """Find one backward amax equal to a forward one and rewrite it; False when none."""
    ops = [op for fn in functions(module) for op in walk_operations(fn)]
    by_name = {function_name(fn): fn for fn in functions(module)}
    sites = call_sites(ops)
    single = {function_name(fn): calls[0] for fn, calls in growable_functions(module, ops, sites)
              if len(calls) == 1}
    found = [site for site in (_site(amax, single) for amax in
                               (match_amax(op) for op in ops if op.name == "stablehlo.reduce")
                               if amax is not None) if site is not None]
    by_loop: dict[int, list[_Site]] = {}
    for site in found:
        by_loop.setdefault(op_key(site.loop), []).append(site)
    for backward_sites in by_loop.values():
        backward = backward_sites[0].loop
        for forward in _earlier_loops(backward):
            pair = _pair(forward, backward, by_name, sites)
            if pair is None:
                continue
            candidates = by_loop.get(op_key(forward), [])
            for b in backward_sites:
                for a in candidates:
                    if a.amax.key != b.amax.key or a.amax.root.type != b.amax.root.type:
                        continue
                    pair.seen.clear()
                    pair.layer, pair.stored = None, False
                    # Without a stored carry it is a weight's amax: hoist_amax's.
                    if _same(pair, a.amax.root, (), b.amax.root, ()) and pair.stored:
                        _rewrite(pair, a, b)
                        return True
    return False


def _site(amax: Amax, single: dict[str, Any]) -> _Site | None:
    """The loop an amax runs in: its block is a loop body, or the entry of a private
    function called once from one (at any depth); None otherwise."""
    calls: list[Any] = []
    op = amax.reduce
    for _ in range(64):
        loop = enclosing_while(op)
        if loop is not None:
            return None if is_sharded(loop) else _Site(amax, loop, calls[::-1])
        parent = op.operation.parent
        if parent is None or parent.operation.name != "func.func" or op.operation.block != \
                parent.regions[0].blocks[0]:
            return None
        call = single.get(function_name(parent.opview))
        if call is None:
            return None
        calls.append(call)
        op = call
    return None


def _earlier_loops(backward: Any) -> list[Any]:
    """The unsharded loops before ``backward`` in its block whose results it reads."""
    block = backward.operation.block
    loops = []
    for operand in backward.operation.operands:
        if isinstance(operand, ir.BlockArgument):
            continue
        owner = operand.owner.operation
        if (owner.name == "stablehlo.while" and owner.block == block
                and not is_sharded(owner.opview)
                and all(op_key(loop) != op_key(owner) for loop in loops)):
            loops.append(owner.opview)
    return loops


def _pair(forward: Any, backward: Any, by_name: dict[str, Any],
          sites: dict[str, list[Any]]) -> _Pair | None:
    """What the two loops offer a match: the forward counter over 0..n-1 and the carries
    its body stores whole at the counter; None without such a counter."""
    counted = counter_values(forward.operation)
    if counted is None:
        return None
    counter, values = counted
    if values != list(range(len(values))) or not values:
        return None
    body = loop_body(forward)
    stores = {}
    returned = terminator(body).operands
    for position, value in enumerate(returned):
        stored = _stored_row(value, body, by_name)
        if stored is None:
            continue
        stack, row, index, axis = stored
        if (argument_number(stack, body) == position and argument_number(index, body) == counter
                and ir.RankedTensorType(stack.type).shape[axis] == len(values)
                and argument_number(row, body) != counter):
            stores[_origin(row, by_name, sites)] = (position, axis)
    return _Pair(forward, backward, counter, len(values), stores, by_name, sites)


def _origin(value: ir.Value, by_name: dict[str, Any], sites: dict[str, list[Any]]
            ) -> ir.Value:
    """Where ``value`` is computed: followed back through jax's remat
    ``optimization_barrier`` and into the return of a function called only here (out
    again where it returns an argument)."""
    for _ in range(64):
        value = _through_calls(value, by_name)
        if isinstance(value, ir.BlockArgument):
            return value
        op = value.owner.operation
        entry = callee_entry(op, by_name)
        if entry is None or len(sites.get(callee_name(op), [])) != 1:
            return value
        value = terminator(entry).operands[ir.OpResult(value).result_number]
    return value


def _through_calls(value: ir.Value, by_name: dict[str, Any]) -> ir.Value:
    """``value`` followed back through calls that return an argument as it is and jax's
    remat ``optimization_barrier``: the same value."""
    for _ in range(64):
        if isinstance(value, ir.BlockArgument):
            return value
        op = value.owner.operation
        number = ir.OpResult(value).result_number
        if op.name == "stablehlo.optimization_barrier":
            value = op.operands[number]
            continue
        entry = callee_entry(op, by_name)
        if entry is None:
            return value
        argument = argument_number(terminator(entry).operands[number], entry)
        if argument is None:
            return value
        value = op.operands[argument]
    return value


def _stored_row(value: ir.Value, body: ir.Block, by_name: dict[str, Any]
                ) -> tuple[ir.Value, ir.Value, ir.Value, int] | None:
    """``value`` as ``dynamic_update_slice(stack, row widened by a unit axis (reshape or
    broadcast_in_dim), index along that axis)``,
    written in ``body`` or by a call of a function that only does that (jax's
    ``dynamic_update_index_in_dim``): (stack, row, index, axis), the row followed back
    through calls returning an argument; None otherwise."""
    if isinstance(value, ir.BlockArgument):
        return None
    op = value.owner.operation
    if is_call(op):
        entry = callee_entry(op, by_name)
        if entry is None or len(op.results) != 1:
            return None
        inner = _stored_row(terminator(entry).operands[0], entry, by_name)
        if inner is None:
            return None
        numbers = [argument_number(v, entry) for v in inner[:3]]
        if None in numbers:
            return None
        stack, row, index = (op.operands[n] for n in numbers)
        return stack, _through_calls(row, by_name), index, inner[3]
    if op.name != "stablehlo.dynamic_update_slice" or op.block != body:
        return None
    stack, update = op.operands[0], op.operands[1]
    stack_shape = ir.RankedTensorType(stack.type).shape
    update_shape = ir.RankedTensorType(update.type).shape
    axes = [axis for axis, (size, full) in enumerate(zip(update_shape, stack_shape))
            if size != full]
    if len(axes) != 1 or update_shape[axes[0]] != 1 or isinstance(update, ir.BlockArgument):
        return None
    axis = axes[0]
    widen = update.owner.operation
    row = widen.operands[0] if widen.operands else None
    others = [d for d in range(len(stack_shape)) if d != axis]
    if (widen.name == "stablehlo.broadcast_in_dim"
            and list(ir.DenseI64ArrayAttr(widen.attributes["broadcast_dimensions"])) != others):
        return None
    if (widen.name not in ("stablehlo.reshape", "stablehlo.broadcast_in_dim")
            or list(ir.RankedTensorType(row.type).shape) != [stack_shape[d] for d in others]):
        return None
    return stack, _through_calls(row, by_name), op.operands[2 + axis], axis


# ---- the match -------------------------------------------------------------------------

def _resolve(value: ir.Value, calls: tuple[Any, ...], pair: _Pair
             ) -> tuple[ir.Value, tuple[Any, ...]]:
    """An argument of a function as the operand its call passes (the innermost call of
    ``calls``, the calls the walk went into, else the function's only call site), and a
    result of jax's remat ``optimization_barrier`` as its operand."""
    for _ in range(64):
        if not isinstance(value, ir.BlockArgument):
            op = value.owner.operation
            if op.name != "stablehlo.optimization_barrier":  # remat's: the same values
                return value, calls
            value = op.operands[ir.OpResult(value).result_number]
            continue
        block = value.owner
        parent = block.owner.operation
        # The loops' own function's arguments are values before both loops.
        if (parent.name != "func.func" or block != parent.regions[0].blocks[0]
                or block == pair.forward.operation.block):
            return value, calls
        number = ir.BlockArgument(value).arg_number
        if calls:
            value, calls = calls[-1].operation.operands[number], calls[:-1]
            continue
        callers = pair.sites.get(function_name(parent.opview), [])
        if len(callers) != 1:
            return value, calls
        value = callers[0].operation.operands[number]
    return value, calls


def _region_signature(region: ir.Region) -> tuple[Any, ...]:
    """The ops of a region (a reduction's body) with their operands by position."""
    signature: list[Any] = []
    for block in region.blocks:
        places = {argument: ("arg", n) for n, argument in enumerate(block.arguments)}
        signature.append(tuple(str(a.type) for a in block.arguments))
        for index, op in enumerate(block.operations):
            operation = op.operation
            signature.append((_op_signature(operation),
                              tuple(places.get(v, "outside") for v in operation.operands)))
            for number, result in enumerate(operation.results):
                places[result] = (index, number)
    return tuple(signature)


def _op_signature(op: ir.Operation, results: int | None = None,
                  skip: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """An op's meaning but its operands: name, attributes (but ours and ``skip``), the
    types of its results (the first ``results`` of them) and its regions."""
    held = op.attributes
    attributes = tuple(sorted((name, str(held[name])) for name in held
                              if not name.startswith(_OWN_ATTRIBUTE) and name not in skip))
    return (op.name, attributes, tuple(str(r.type) for r in list(op.results)[:results]),
            tuple(_region_signature(region) for region in op.regions))


def _attention_output(op: ir.Operation, number: int) -> bool:
    """Whether result ``number`` of ``op`` is the output of cuDNN's fused attention
    forward (``__cudnn$fmha...``, no dropout): the same whether the call also writes the
    softmax statistics for a backward kernel (the recomputed forward's does, the
    checkpointed forward's does not) or not."""
    if op.name != "stablehlo.custom_call" or number != 0:
        return False
    target = call_target(op)
    return (target.startswith(_ATTENTION_CALL) and "Backward" not in target
            and "Dropout" not in target)


def _same(pair: _Pair, f: ir.Value, f_calls: tuple[Any, ...], b: ir.Value,
          b_calls: tuple[Any, ...]) -> bool:
    """Whether forward value ``f`` at iteration j equals backward value ``b`` at layer j."""
    f, f_calls = _resolve(f, f_calls, pair)
    b, b_calls = _resolve(b, b_calls, pair)
    key = (f, tuple(map(op_key, f_calls)), b, tuple(map(op_key, b_calls)))
    if key in pair.seen:
        return pair.seen[key]
    if len(pair.seen) > _MAX_PAIRS:
        return False
    pair.seen[key] = False  # a cycle (none in SSA) or a failure below
    same = _same_values(pair, f, f_calls, b, b_calls)
    pair.seen[key] = same
    return same


def _same_values(pair: _Pair, f: ir.Value, f_calls: tuple[Any, ...], b: ir.Value,
                 b_calls: tuple[Any, ...]) -> bool:
    forward, backward = pair.forward, pair.backward
    body = loop_body(forward)
    if f.type != b.type:
        return False
    carry = argument_number(f, body)
    if carry == pair.counter:
        return _is_layer(pair, b)
    if carry is not None and is_invariant(f, forward):
        return _same_outside(pair, outside_value(f, forward), b, b_calls)
    if f in pair.stores:  # row i of a stack the loop returns: row j of it after
        stack, axis = pair.stores[f]
        pair.stored = True
        return _is_slice(pair, b, forward.operation.results[stack], axis)
    if carry is not None:
        return False
    if isinstance(f, ir.BlockArgument):
        return False  # an argument of a region other than the loop body's
    if _outside(f, forward):
        return _same_outside(pair, f, b, b_calls)
    if not f_calls:  # a slice of an invariant stack at the counter, read in the body
        sliced = stack_slice(f, pair.by_name)
        if sliced is not None and is_invariant(sliced.stack, forward):
            index, _ = _resolve(sliced.index, (), pair)
            if argument_number(index, body) == pair.counter:
                return _is_slice(pair, b, outside_value(sliced.stack, forward), sliced.axis)
    if isinstance(b, ir.BlockArgument) or _outside(b, backward):
        return False
    f_op, b_op = f.owner.operation, b.owner.operation
    number = ir.OpResult(f).result_number
    if is_call(f_op) and is_call(b_op):
        f_entry, b_entry = callee_entry(f_op, pair.by_name), callee_entry(b_op, pair.by_name)
        if f_entry is None or b_entry is None or ir.OpResult(b).result_number != number:
            return False
        return _same(pair, terminator(f_entry).operands[number], f_calls + (f_op.opview,),
                     terminator(b_entry).operands[number], b_calls + (b_op.opview,))
    return _same_op(f, b) and all(_same(pair, x, f_calls, y, b_calls)
                                  for x, y in zip(f_op.operands, b_op.operands))


def _same_op(f: ir.Value, b: ir.Value) -> bool:
    """Whether two op results are the same result of the same op (its operands aside):
    number, operand count and ``_op_signature``; cuDNN attention's output by
    ``_attention_output``'s rule."""
    f_op, b_op = f.owner.operation, b.owner.operation
    number = ir.OpResult(f).result_number
    if ir.OpResult(b).result_number != number or len(f_op.operands) != len(b_op.operands):
        return False
    if _attention_output(f_op, number) and _attention_output(b_op, number):
        return (_op_signature(f_op, 1, _ATTENTION_RESULT_ATTRIBUTES)
                == _op_signature(b_op, 1, _ATTENTION_RESULT_ATTRIBUTES))
    return _op_signature(f_op) == _op_signature(b_op)


def _outside(value: ir.Value, loop: Any) -> bool:
    """Whether ``value`` is defined in the loop's own block (before or after it), not
    in its body or a function it calls."""
    owner = value.owner
    block = owner if isinstance(value, ir.BlockArgument) else owner.operation.block
    return block == loop.operation.block


def _same_outside(pair: _Pair, value: ir.Value, b: ir.Value, b_calls: tuple[Any, ...] = (),
                  depth: int = 0) -> bool:
    """Whether ``b`` in the backward loop is ``value`` from before both loops: that value
    itself, or the same ops on such values (jax computes a rotary table's broadcast once
    before the forward loop, and in the backward's recomputation)."""
    backward = pair.backward
    b, b_calls = _resolve(b, b_calls, pair)
    if argument_number(b, loop_body(backward)) is not None:
        return is_invariant(b, backward) and outside_value(b, backward) == value
    if _outside(b, backward) or b == value:
        return b == value
    if (isinstance(b, ir.BlockArgument) or isinstance(value, ir.BlockArgument)
            or depth >= _OUTSIDE_DEPTH):
        return False
    if is_call(b.owner.operation) or not _same_op(value, b):
        return False
    return all(_same_outside(pair, x, y, b_calls, depth + 1)
               for x, y in zip(value.owner.operation.operands, b.owner.operation.operands))


def _is_layer(pair: _Pair, b: ir.Value) -> bool:
    """Whether ``b`` is the backward loop's layer index (the first one met fixes it)."""
    if pair.layer is None:
        body = loop_body(pair.backward)
        owner = b.owner
        block = owner if isinstance(b, ir.BlockArgument) else owner.operation.block
        if block != body or ir.RankedTensorType(b.type).rank != 0:
            return False
        pair.layer = b
        return True
    return b == pair.layer


def _is_slice(pair: _Pair, b: ir.Value, stack: ir.Value, axis: int) -> bool:
    """Whether ``b`` is the backward loop's slice at its layer index of ``stack`` (a value
    before both loops, whose rows along ``axis`` the forward counter covers)."""
    backward = pair.backward
    sliced = stack_slice(b, pair.by_name)
    if (sliced is None or sliced.axis != axis or not is_invariant(sliced.stack, backward)
            or outside_value(sliced.stack, backward) != stack
            or ir.RankedTensorType(stack.type).shape[axis] != pair.rows):
        return False
    index, _ = _resolve(sliced.index, (), pair)
    return _is_layer(pair, index)


# ---- the rewrite -----------------------------------------------------------------------

def _rewrite(pair: _Pair, forward: _Site, backward: _Site) -> None:
    """The forward loop keeps each iteration's amax as row i of a new carry; the backward
    reads row j in its place."""
    amax = forward.amax.reduce.results[0]
    scalar = ir.RankedTensorType(amax.type)
    rows_type = ir.RankedTensorType.get([pair.rows], scalar.element_type)
    location = forward.amax.reduce.location
    # Out of the callees to the forward body: one more result per function.
    value = amax
    for call in reversed(forward.calls):
        callee = pair.by_name[callee_name(call.operation)]
        entry_return = terminator(callee.regions[0].blocks[0])
        return_also(entry_return, [value])
        grow_signature(callee, results=[value.type])
        new_call = call_with_extra(call, [], [value.type])
        value = new_call.operation.results[len(new_call.operation.results) - 1]
    loop = pair.forward
    with location, ir.InsertionPoint(loop.operation):
        zero = hlo.constant(ir.DenseElementsAttr.get_splat(
            rows_type, ir.FloatAttr.get(scalar.element_type, 0.0)))
    new_loop, (rows_arg,) = while_with_carries(loop, [zero], [location])
    body = loop_body(new_loop)
    counter = body.arguments[pair.counter]
    old_return = terminator(body)
    with location, ir.InsertionPoint(old_return):
        row = hlo.reshape(ir.RankedTensorType.get([1], scalar.element_type), value)
        stored = hlo.dynamic_update_slice(rows_arg, row, [counter])
    return_also(old_return, [stored])
    taken = new_loop.operation.results[len(new_loop.operation.results) - 1]
    # Into the backward loop, and down its calls to the amax.
    new_backward, (rows_in,) = while_with_carries(pair.backward, [taken], [location])
    back_body = loop_body(new_backward)
    return_also(terminator(back_body), [rows_in])
    calls = backward.calls
    anchor = calls[0].operation if calls else backward.amax.reduce
    layer = pair.layer
    with location, ir.InsertionPoint(anchor):
        picked = hlo.dynamic_slice(rows_in, [layer], ir.DenseI64ArrayAttr.get([1]))
        element = hlo.reshape(scalar, picked)
    for call in calls:
        callee = pair.by_name[callee_name(call.operation)]
        entry = callee.regions[0].blocks[0]
        argument = entry.add_argument(scalar, location)
        call_with_extra(call, [element])
        grow_signature(callee, arguments=1)
        element = argument
    backward.amax.replace(element)
