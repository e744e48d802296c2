"""A scanned weight quantised to fp8 once per step, before the forward loop, for every layer.

After hoist_amax, the scale of a scanned weight's quantisation depends on the layer
only through element ``i`` of a vector computed before the loop, or through ``i`` itself
(delayed scaling's history column ``c + i`` of a loop-invariant vector: the slice
``[c, c + n)`` of it, or a gather where that runs past its end), or not at all. The
quantisation of slice ``i`` is then slice ``i`` of the whole stack's, each layer divided
by its own scale:

    body:    q = convert_f8(clamp(-m, convert*(reshape(dynamic_slice(P, i))) / s(rows[i]), m))
    before:  Q = convert_f8(clamp(-m, convert*(P) / broadcast(s(rows), axis), m))
    body:    q = reshape(dynamic_slice(Q, i))

The same bytes (the same division of the same element by the same scale), but the
loop reads one byte per weight instead of four and runs no quantisation kernel for it,
and XLA lays out the fp8 stack for the GEMMs instead of transposing the f32 one.

A quantisation of a private function's argument whose scale is computed from the
function's arguments is first moved to every call site, as one more argument, until it
reaches the loop body that slices (only where the call's operand is such a slice, or an
argument that may be one further up: an activation's quantisation stays where it is).
Backward loops (``transpose(...)`` in the loop's name) keep their quantisations in the
body: they run at a train step's memory peak, beside the gradients and the saved
residuals, where a stack held over the loop adds one byte per weight. A quantisation
there that a dot of remat's recomputed forward (``rematted_computation``) reads
contracting a dimension other than its last (a weight ``[K, N]``) is put behind a layout
fence (ir/layouts.py): Hopper's fp8 GEMMs take both operands K-major, and XLA:GPU
otherwise transposes it by carrying a transposed f32 copy of the whole stack into the
loop, four bytes per weight. Behind the fence it transposes the layer's fp8 slice. Any
backward-loop quantisation that read its weight slice through remat's
``optimization_barrier`` (jax 0.11 recomputes in the loop body) is rebuilt on the slice
itself, since XLA copies the f32 slice for the barrier. On benchmarks/llm.py's 1.1B
decoder (h100, deviceless): 6,794.5 MiB of temp, against 9,482.5 with neither and
7,466.5 with the forward loop's fp8 stacks held over the backward loop for it (hoisted
there too). A partitioned module gets no fence: a 1-D reshape would lose a weight's
sharding. Moving them from the remat'd callee to the body pays: the callee reads its
weights through jax's ``optimization_barrier``, so XLA copies each layer's f32 slice for
it (2.3 ms a step of the 1.1B's roofline); in the body the quantisation reads the slice
in place. Only quantisations of the form fp8.py writes are moved, with a scale of at
most ``_SCALE_OPS`` ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.hoisting import converted, hoist_rounds, source_through_converts
from hlo_amp.ir.layouts import fenced
from hlo_amp.ir.loops import (
    StackSlice,
    argument_number,
    enclosing_while,
    in_while,
    int_constant,
    is_invariant,
    is_sharded,
    outside_value,
    stack_slice,
)
from hlo_amp.ir.modules import (
    call_sites,
    callee_entry,
    defining_op,
    discard,
    erase_discarded,
    function_name,
    functions,
    growable_functions,
    is_public,
    live_uses,
    op_key,
    walk_operations,
    where_finite,
    with_element,
)
from hlo_amp.ir.rebuild import call_with_extra, grow_signature, while_with_invariants
from hlo_amp.ir.shardings import is_partitioned
from hlo_amp.ir.sites import RECOMPUTED, in_backward_pass, location_name
from hlo_amp.report import Report
from hlo_amp.targets.dot_dims import dot_layout

_FP8 = ("f8E4M3FN", "f8E5M2")
# The scalar ops a scale may be computed with (fp8.py's: from the amax or the history's
# maximum, to a power of two or a bf16-rounded scale, 1 where it is not finite).
_ELEMENTWISE = frozenset(f"stablehlo.{name}" for name in (
    "convert", "multiply", "divide", "add", "subtract", "maximum", "minimum", "abs",
    "negate", "compare", "is_finite", "and", "or", "not", "select", "exponential", "log",
    "power", "sqrt", "rsqrt", "floor", "ceil", "round_nearest_even", "exponential_minus_one",
    "log_plus_one", "sign"))
# (A dynamic_slice: a delayed scale's history column per iteration, at the iteration.)
_SCALE_OP_NAMES = _ELEMENTWISE | {"stablehlo.constant", "stablehlo.slice", "stablehlo.reshape",
                                  "stablehlo.dynamic_slice"}
_SCALE_OPS = 32
# How many calls (or barriers) deep a backward body's quantisation is followed to a dot
# of remat's recomputed forward.
_CALL_DEPTH = 4


@dataclass(frozen=True)
class _Scale:
    """A scalar computed by ``ops`` (in order) from ``leaves``: the values they read that
    none of them computes."""

    value: ir.Value
    ops: tuple[ir.Operation, ...]
    leaves: tuple[ir.Value, ...]


@dataclass(frozen=True)
class _Quantize:
    """``convert_f8(clamp(low, convert*(root) / broadcast(scale), high))``; under delayed
    scaling the clamp taken only where ``convert*(root)`` is finite (fp8.py's
    ``where_finite``)."""

    convert: ir.Operation  # the convert to fp8
    chain: tuple[ir.Operation, ...]  # from the convert back to root: what it alone reads
    converts: tuple[ir.Type, ...]  # the element types of the converts from root, in order
    root: ir.Value
    scale: _Scale
    low: ir.Value
    high: ir.Value
    # Whether the chain reads root through remat's optimization_barrier, not directly.
    through_barrier: bool
    keeps_non_finite: bool = False

    def replace(self, value: ir.Value) -> None:
        """Use ``value`` for this quantisation and discard the ops left without a use."""
        self.convert.results[0].replace_all_uses_with(value)
        for op in (*self.chain, *reversed(self.scale.ops)):  # readers before what they read
            if not any(True for result in op.results for _ in live_uses(result)):
                discard(op)


def _scalar(value: ir.Value) -> bool:
    return isinstance(value.type, ir.RankedTensorType) and value.type.rank == 0


def _single(value: ir.Value) -> bool:
    """A scalar, or a vector of one element (a history's column before its reshape)."""
    shape = value.type.shape if isinstance(value.type, ir.RankedTensorType) else None
    return shape is not None and len(shape) <= 1 and all(size == 1 for size in shape)


def _scale_of(value: ir.Value, block: ir.Block) -> _Scale | None:
    """``value`` as a scalar computed in ``block`` by constants, elementwise ops and
    one-element slices and reshapes (delayed scaling's history column)."""
    ops: list[ir.Operation] = []
    leaves: list[ir.Value] = []
    seen: set[int] = set()

    def visit(current: ir.Value) -> bool:
        op = defining_op(current)
        if op is None or op.block != block or op.name not in _SCALE_OP_NAMES:
            if current not in leaves:
                leaves.append(current)
            return True
        if op_key(op) in seen:
            return True
        seen.add(op_key(op))
        if not all(_single(result) for result in op.results):
            return False
        if not all(visit(operand) for operand in op.operands):
            return False
        ops.append(op)
        return len(ops) <= _SCALE_OPS

    if not _scalar(value) or not visit(value):
        return None
    return _Scale(value, tuple(ops), tuple(leaves))


def _match(convert: ir.Operation) -> _Quantize | None:
    """``convert`` as the end of a quantisation of the form fp8.py writes, else None."""
    if (convert.name != "stablehlo.convert"
            or str(ir.RankedTensorType(convert.results[0].type).element_type) not in _FP8):
        return None
    clamp = defining_op(convert.operands[0])
    kept = ()  # where_finite's select(|x| < inf, clamp(low, x / s, high), x / s)
    if clamp is not None and clamp.name == "stablehlo.select" and clamp.block == convert.block:
        select = clamp
        check, clamp = defining_op(select.operands[0]), defining_op(select.operands[1])
        if check is None or check.name != "stablehlo.compare":
            return None
        absolute, bound = (defining_op(v) for v in check.operands)
        if (absolute is None or absolute.name != "stablehlo.abs" or bound is None
                or bound.name != "stablehlo.broadcast_in_dim"):
            return None
        kept = (select, check, absolute, bound)
    if clamp is None or clamp.name != "stablehlo.clamp" or clamp.block != convert.block:
        return None
    low, divided, high = clamp.operands
    if not (_scalar(low) and _scalar(high)) or any(
            defining_op(bound) is None or defining_op(bound).name != "stablehlo.constant"
            for bound in (low, high)):
        return None
    divide = defining_op(divided)
    if divide is None or divide.name != "stablehlo.divide" or divide.block != convert.block:
        return None
    if kept and (kept[0].operands[2] != divided or kept[2].operands[0] != divide.operands[0]):
        return None
    broadcast = defining_op(divide.operands[1])
    if (broadcast is None or broadcast.name != "stablehlo.broadcast_in_dim"
            or list(ir.DenseI64ArrayAttr(broadcast.attributes["broadcast_dimensions"]))
            or not _scalar(broadcast.operands[0])):
        return None
    scale = _scale_of(broadcast.operands[0], convert.block)
    if scale is None:
        return None
    root, converts = source_through_converts(divide.operands[0], convert.block)
    first = converts[-1] if converts else divide  # the op of the chain that reads root
    return _Quantize(convert, (convert, *kept, clamp, divide, broadcast, *converts),
                     tuple(ir.RankedTensorType(op.results[0].type).element_type
                           for op in reversed(converts)), root, scale, low, high,
                     first.operands[0] != root, bool(kept))


# ---- building ------------------------------------------------------------------------------

def _constant_like(value: ir.Value) -> ir.Value:
    return hlo.constant(defining_op(value).attributes["value"])


def _rebuild_scale(scale: _Scale, leaves: Sequence[Any], length: int = 0
                   ) -> tuple[ir.Value, bool]:
    """``scale``'s ops again at the current insertion point, reading ``leaves`` for its
    leaves; where a leaf is ``_Positions`` (the layer's position: one scale per layer),
    what reads it is computed on vectors of ``length``, the scalars it meets broadcast.
    Returns the scale and whether it is a vector."""
    mapped: dict[Any, Any] = dict(zip(scale.leaves, leaves))
    vectorised: set[int] = set()
    for op in scale.ops:
        operands = [mapped[o] for o in op.operands]
        shifted = _shifted_positions(op, operands)
        if shifted is not None:
            mapped[op.results[0]] = shifted
            continue
        if op.name == "stablehlo.dynamic_slice" and isinstance(operands[1], _Positions):
            picked = _pick(operands[0], operands[1], length)  # each layer's element
            mapped[op.results[0]] = picked
            vectorised.add(id(picked))
            continue
        for index, operand in enumerate(operands):
            if isinstance(operand, _Positions):  # read otherwise: written out
                operands[index] = operand.written(length)
                vectorised.add(id(operands[index]))
        if not any(id(o) in vectorised for o in operands):
            results = [r.type for r in op.results]
        elif op.name == "stablehlo.reshape":  # an element's reshape to a scalar
            mapped[op.results[0]] = operands[0]
            continue
        else:
            operands = [o if id(o) in vectorised else hlo.broadcast_in_dim(
                ir.RankedTensorType.get([length], o.type.element_type), o,
                list(range(o.type.rank))) for o in operands]
            results = [ir.RankedTensorType.get([length], r.type.element_type)
                       for r in op.results]
        new = ir.Operation.create(op.name, results=results, operands=operands,
                                  attributes={name: op.attributes[name]
                                              for name in op.attributes})
        for old, made in zip(op.results, new.results):
            mapped[old] = made
            if results[0] != old.type:
                vectorised.add(id(made))
    result = mapped[scale.value]
    return result, id(result) in vectorised


@dataclass(frozen=True)
class _Positions:
    """The layers' positions plus ``offset`` (``offset, offset + 1, …``), integers of
    type ``element``, not yet written: a delayed scale's history columns are read as
    one slice of the history maximum."""

    offset: int
    element: ir.Type

    def written(self, length: int) -> ir.Value:
        iota = hlo.iota(ir.RankedTensorType.get([length], self.element), 0)
        if not self.offset:
            return iota
        offset = hlo.constant(ir.DenseElementsAttr.get_splat(
            ir.RankedTensorType.get([length], self.element),
            ir.IntegerAttr.get(self.element, self.offset)))
        return hlo.add(iota, offset)


def _shifted_positions(op: ir.Operation, operands: list[Any]) -> _Positions | None:
    """``op`` as positions plus a constant (the history's first column of a tensor)."""
    if op.name != "stablehlo.add" or len(operands) != 2:
        return None
    for positions, other in (operands, reversed(operands)):
        if isinstance(positions, _Positions) and not isinstance(other, _Positions):
            constant = int_constant(other)
            if constant is not None:
                return _Positions(positions.offset + constant, positions.element)
    return None


def _pick(vector: ir.Value, positions: _Positions, length: int) -> ir.Value:
    """``dynamic_slice(vector, position)`` of one element at each of ``length``
    positions: ``vector`` itself, a slice of it, or (positions past its end, which
    dynamic_slice clamps) a gather."""
    size = ir.RankedTensorType(vector.type).shape[0]
    if positions.offset == 0 and size == length:
        return vector
    if 0 <= positions.offset and positions.offset + length <= size:
        return hlo.slice(vector, ir.DenseI64ArrayAttr.get([positions.offset]),
                         ir.DenseI64ArrayAttr.get([positions.offset + length]),
                         ir.DenseI64ArrayAttr.get([1]))
    rows = hlo.reshape(ir.RankedTensorType.get([length, 1], positions.element),
                       positions.written(length))
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[], collapsed_slice_dims=[0], operand_batching_dims=[],
        start_indices_batching_dims=[], start_index_map=[0], index_vector_dim=1)
    return hlo.GatherOp(vector, rows, numbers, ir.DenseI64ArrayAttr.get([1])).result


def _build(quantize: _Quantize, value: ir.Value, scale: ir.Value, axis: int | None
           ) -> ir.Value:
    """``quantize`` of ``value`` at the current insertion point, divided by ``scale``: a
    scalar, or (``axis`` given) a vector along that axis of ``value``."""
    value = converted(value, quantize.converts)
    dims = [] if axis is None else [axis]
    divided = hlo.divide(value, hlo.broadcast_in_dim(value.type, scale, dims))
    clamped = hlo.clamp(_constant_like(quantize.low), divided, _constant_like(quantize.high))
    if quantize.keeps_non_finite:
        clamped = where_finite(value, clamped, divided)
    return hlo.convert(with_element(value.type, ir.RankedTensorType(
        quantize.convert.results[0].type).element_type), clamped)


# ---- the pass ------------------------------------------------------------------------------

@dataclass(frozen=True)
class HoistQuantize:
    """Quantise each scanned weight before its loop (see the module doc)."""

    name: str = "hlo-amp-hoist-quantize"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        hoisted = hoist_rounds(module, self.name, _match, _lift_to_call_sites,
                               _hoist_out_of_loops)
        # Not fenced in a partitioned module: a 1-D reshape would lose the sharding.
        fenced_count, rebuilt = _backward_weights(module, self.name,
                                                  fence=not is_partitioned(module))
        if report is not None and hoisted:
            report.notes.append(f"hoist-quantize: {hoisted} fp8 quantisation(s) of a scanned "
                                "tensor's slice done for every slice before the loop, not "
                                "in its body")
        if report is not None and fenced_count:
            report.notes.append(f"hoist-quantize fence: {fenced_count} fp8 weight slice(s) of a "
                                "backward loop that remat's recomputed forward reads put "
                                "behind a layout fence (XLA transposes the fp8 slice, not "
                                "the f32 stack)")
        if report is not None and rebuilt:
            report.notes.append(f"hoist-quantize barrier: {rebuilt} fp8 quantisation(s) of a "
                                "backward loop's weight slice read the slice itself, not "
                                "through remat's optimization_barrier")


# ---- from a function's arguments to its call sites ----------------------------------------

def _lift_to_call_sites(module: ir.Module, ops: list[ir.Operation], found: list[_Quantize],
                        by_name: dict[str, Any]) -> int:
    sites = call_sites(ops)
    lifted = 0
    for fn, calls in growable_functions(module, ops, sites):
        entry = fn.regions[0].blocks[0]
        movable = [q for q in found
                   if q.convert.block == entry and argument_number(q.root, entry) is not None
                   and all(argument_number(leaf, entry) is not None
                           for leaf in q.scale.leaves)
                   and all(_may_be_stacked(call.operation.operands[
                       ir.BlockArgument(q.root).arg_number], by_name, sites)
                       for call in calls)]
        if movable:
            lifted += _lift(fn, calls, movable)
    return lifted


def _may_be_stacked(operand: ir.Value, by_name: dict[str, Any],
                    sites: dict[str, list[Any]]) -> bool:
    """Whether a call's operand is a slice of a stack, or may be one further up: an
    argument of a private function called only in loop bodies. Only those
    quantisations move, toward a loop: an activation's, and a weight's outside any
    loop (where a remat'd function would then keep its fp8 copy alive for the backward
    pass instead of quantising it again), stay where the program computes them."""
    if stack_slice(operand, by_name) is not None:
        return True
    if not isinstance(operand, ir.BlockArgument):
        return False
    fn = operand.owner.owner
    if fn is None or fn.operation.name != "func.func" or is_public(fn):
        return False
    calls = sites.get(function_name(fn), [])
    return bool(calls) and all(in_while(call) for call in calls)


def _lift(fn: Any, calls: list[Any], movable: list[_Quantize]) -> int:
    """Each quantisation becomes a new trailing argument of ``fn``, computed at every
    call site from the call's operands."""
    entry = fn.regions[0].blocks[0]
    numbers = [(ir.BlockArgument(q.root).arg_number,
                [ir.BlockArgument(leaf).arg_number for leaf in q.scale.leaves])
               for q in movable]
    for call in calls:
        extra = []
        for q, (root, leaves) in zip(movable, numbers):
            operands = call.operation.operands
            with q.convert.location, ir.InsertionPoint(call.operation):
                scale, _ = _rebuild_scale(q.scale, [operands[n] for n in leaves])
                extra.append(_build(q, operands[root], scale, None))
        call_with_extra(call, extra)
    for q in movable:
        q.replace(entry.add_argument(q.convert.results[0].type, q.convert.location))
    grow_signature(fn, arguments=len(movable))
    return len(movable)


# ---- out of a loop ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """How a quantisation in a loop body leaves it: its slice of a stack (its scale's
    leaves are ``sliced.index``, the layer's position, or loop invariants)."""

    quantize: _Quantize
    sliced: StackSlice


def _vectorisable(scale: _Scale, position: ir.Value) -> bool:
    """Whether the scale's ops can read the layer's position as a vector of positions:
    only elementwise ops and reshapes read what depends on it, no slice, and a
    dynamic_slice only as its position in a 1-D vector that does not."""
    depends = {position}
    for op in scale.ops:
        if any(operand in depends for operand in op.operands):
            if op.name == "stablehlo.slice" or (
                    op.name == "stablehlo.dynamic_slice"
                    and (op.operands[0] in depends or op.operands[0].type.rank != 1)):
                return False
            depends.update(op.results)
    return True


def _plan(q: _Quantize, by_name: dict[str, Any]) -> tuple[Any, _Plan] | None:
    sliced = stack_slice(q.root, by_name)
    if sliced is None or defining_op(q.root).block != q.convert.block:
        return None
    loop = enclosing_while(q.convert)
    if (loop is None or is_sharded(loop) or not is_invariant(sliced.stack, loop)
            or in_backward_pass(loop)):
        return None
    # Each leaf is the slice's own position (hoist_amax's rows[i], a delayed scale's
    # history column c + i: the scale's dynamic_slice reads it), else a loop invariant.
    if (not all(leaf == sliced.index or is_invariant(leaf, loop) for leaf in q.scale.leaves)
            or not _vectorisable(q.scale, sliced.index)):
        return None
    return loop, _Plan(q, sliced)


def _read_transposed_by_recomputation(value: ir.Value, by_name: dict[str, Any],
                                      depth: int = 0) -> bool:
    """Whether a dot of remat's recomputed forward (``rematted_computation`` in its name)
    reads ``value`` contracting a dimension other than its last: an operand Hopper's fp8
    GEMM needs K-major, so XLA transposes it (a weight ``[K, N]`` of ``x @ w``). Followed
    from the backward loop's body through calls and remat's ``optimization_barrier``."""
    return any(_reads_transposed(use, by_name, depth) for use in live_uses(value))


def _reads_transposed(use: Any, by_name: dict[str, Any], depth: int) -> bool:
    """:func:`_read_transposed_by_recomputation` for one use of the value."""
    user = use.owner
    name = user.operation.name
    if name == "stablehlo.dot_general":
        return (RECOMPUTED in location_name(user.location)
                and _contracts_inner(user, use.operand_number))
    if depth >= _CALL_DEPTH:
        return False
    if name == "stablehlo.optimization_barrier":
        return _read_transposed_by_recomputation(user.results[use.operand_number], by_name,
                                                 depth + 1)
    entry = callee_entry(user, by_name)
    return entry is not None and _read_transposed_by_recomputation(
        entry.arguments[use.operand_number], by_name, depth + 1)


def _contracts_inner(dot: Any, operand: int) -> bool:
    """Whether ``dot``'s operand ``operand`` contracts a dimension other than its last."""
    layout = dot_layout(dot)
    if layout is None:
        return False
    shape, contracting = ((layout.lhs_shape, layout.lhs_contracting) if operand == 0
                          else (layout.rhs_shape, layout.rhs_contracting))
    return contracting != (len(shape) - 1,)


def _hoist_out_of_loops(found: list[_Quantize], by_name: dict[str, Any]) -> int:
    plans: dict[int, tuple[Any, list[_Plan]]] = {}
    for q in found:
        planned = _plan(q, by_name)
        if planned is not None:
            loop, plan = planned
            plans.setdefault(op_key(loop), (loop, []))[1].append(plan)
    return sum(_hoist(loop, members) for loop, members in plans.values())


def _hoist(loop: Any, members: list[_Plan]) -> int:
    """One fp8 stack per quantisation before ``loop``, carried unchanged; each becomes
    slice ``index`` of its stack."""
    stacks = []
    for plan in members:
        q, sliced = plan.quantize, plan.sliced
        length = ir.RankedTensorType(sliced.stack.type).shape[sliced.axis]
        with q.convert.location, ir.InsertionPoint(loop.operation):
            leaves = [_Positions(0, leaf.type.element_type) if leaf == sliced.index else
                      outside_value(leaf, loop) for leaf in q.scale.leaves]
            scales, per_layer = _rebuild_scale(q.scale, leaves, length)
            stacks.append(_build(q, outside_value(sliced.stack, loop), scales,
                                 sliced.axis if per_layer else None))
    _, carried = while_with_invariants(loop, stacks, [p.quantize.convert.location
                                                      for p in members])
    for stack, plan in zip(carried, members):
        q, sliced = plan.quantize, plan.sliced
        shape = ir.RankedTensorType(stack.type).shape
        sizes = [1 if axis == sliced.axis else size for axis, size in enumerate(shape)]
        with q.convert.location, ir.InsertionPoint(q.convert):
            zero = hlo.constant(ir.DenseElementsAttr.get_splat(
                ir.RankedTensorType(sliced.index.type),
                ir.IntegerAttr.get(ir.RankedTensorType(sliced.index.type).element_type, 0)))
            starts = [sliced.index if axis == sliced.axis else zero
                      for axis in range(len(shape))]
            picked = hlo.dynamic_slice(stack, starts, ir.DenseI64ArrayAttr.get(sizes))
            q.replace(hlo.reshape(q.convert.results[0].type, picked))
    return len(members)


# ---- a backward loop's weights for remat's recomputed forward ------------------------------

def _backward_weights(module: ir.Module, pass_name: str, fence: bool) -> tuple[int, int]:
    """Each backward-loop quantisation of a weight slice: rebuilt on the slice itself if
    it read it through remat's ``optimization_barrier``, for which XLA copies the f32
    slice (jax 0.11 puts the recomputation in the loop body; the lift to a call site
    does the same); then, with ``fence``, where remat's recomputed forward reads it
    transposed, put behind a layout fence (ir/layouts.py) for those reads. Returns
    (fenced, rebuilt)."""
    fenced_count = rebuilt = 0
    with module.context, ir.Location.unknown():
        by_name = {function_name(fn): fn for fn in functions(module)}
        for fn in functions(module):
            for op in walk_operations(fn):
                q = _match(op)
                if q is None or stack_slice(q.root, by_name) is None:
                    continue
                loop = enclosing_while(q.convert)
                if loop is None or not in_backward_pass(loop):
                    continue
                quantised = q.convert.results[0]
                if q.through_barrier:
                    with q.convert.location, ir.InsertionPoint(q.convert):
                        quantised = _build(q, q.root, q.scale.value, None)
                    q.replace(quantised)
                    rebuilt += 1
                # Only the uses that lead to a transposed read: another reader (the
                # backward's dx dot) keeps the quantisation's own layout, and XLA makes
                # one transposed copy. Once fenced, a reshape reads it, which is not
                # followed: a second run leaves it alone.
                uses = [use for use in live_uses(quantised)
                        if _reads_transposed(use, by_name, 0)] if fence else []
                if not uses or not ir.RankedTensorType(quantised.type).has_static_shape:
                    continue  # (no 1-D reshape of a dynamic shape to write)
                with q.convert.location, ir.InsertionPoint.after(quantised.owner.operation):
                    behind = fenced(quantised)
                for use in uses:
                    use.owner.operands[use.operand_number] = behind
                fenced_count += 1
    erase_discarded(pass_name)
    return fenced_count, rebuilt
