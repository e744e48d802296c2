"""The mesh axes each dimension of each value is sharded over, per calling context: read
from the public functions' argument shardings and the sharding constraints (Shardy's or
GSPMD's), propagated forward through ops, ``while`` bodies, ``case``/``if`` branches and
``func.call``s (`ModuleAxes`); and the ops a predicate on those axes holds for in every
context (`summed_everywhere`). Read by the reduce rule for dots and add scatters."""

from __future__ import annotations

import re
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.loops import WHILE
from hlo_amp.ir.modules import (
    callee_name,
    function_name,
    functions,
    is_public,
    terminator,
    walk_operations,
)

_SAME_RANK = frozenset({"stablehlo.slice", "stablehlo.reverse", "stablehlo.pad",
                        "stablehlo.concatenate", "stablehlo.dynamic_slice",
                        "stablehlo.dynamic_update_slice"})
_SHAPE_CHANGERS = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.transpose",
                             "stablehlo.reshape", "stablehlo.reduce"})
_DOT = "stablehlo.dot_general"
_SCALAR_OPERANDS = frozenset({"stablehlo.clamp", "stablehlo.select"})
# walk_operations' ``into`` that enters no op: a function body's own ops.
_TOP_LEVEL: frozenset[str] = frozenset()
_MANUALS = frozenset({"sdy.manual_computation"})
_CALL = "func.call"
_CALLS = frozenset({_CALL})
_BRANCHES = frozenset({"stablehlo.case", "stablehlo.if"})
_BARRIER = "stablehlo.optimization_barrier"
# The region ops whose ops the axes reach (a reduce's or sort's body holds scalars).
_ENTERED = frozenset({WHILE, *_BRANCHES})

# Per value, the mesh axes each dimension is sharded over (GSPMD's mhlo.sharding has
# no axis names: a tiled dimension gets the axis "?").
Axes = tuple[frozenset[str], ...]

_SDY_DIMS = re.compile(r"\[((?:\{[^{}]*\}\s*,?\s*)*)\]")
_QUOTED = re.compile(r'"([^"]+)"')
_GSPMD_TILES = re.compile(r"devices=\[([0-9,]+)\]")


def _sdy_axes(text: str, rank: int) -> Axes | None:
    """The per-dimension axes of a ``#sdy.sharding<@mesh, [{"a"}, {}]>`` text."""
    match = _SDY_DIMS.search(text)
    if match is None:
        return None
    dims = re.findall(r"\{([^{}]*)\}", match.group(1))
    if len(dims) != rank:
        return None
    return tuple(frozenset(name.split(":")[0] for name in _QUOTED.findall(d)) for d in dims)


def _gspmd_axes(text: str, rank: int) -> Axes | None:
    """The per-dimension axes of an ``mhlo.sharding`` text ("{devices=[8,1]<=[8]}")."""
    match = _GSPMD_TILES.search(text)
    if match is None:
        return tuple(frozenset() for _ in range(rank)) if "replicated" in text else None
    tiles = [int(t) for t in match.group(1).split(",")][:rank]
    return tuple(frozenset({"?"}) if t > 1 else frozenset() for t in tiles)


def _declared_axes(attributes: Any, rank: int) -> Axes | None:
    for name, parse in (("sdy.sharding", _sdy_axes), ("sharding", _sdy_axes),
                        ("mhlo.sharding", _gspmd_axes)):
        if name in attributes:
            return parse(str(attributes[name]), rank)
    return None


def _rank(value: ir.Value) -> int | None:
    value_type = value.type
    return ir.RankedTensorType(value_type).rank if isinstance(
        value_type, ir.RankedTensorType) else None


def _i64s(attribute: Any) -> list[int]:
    return [int(x) for x in ir.DenseI64ArrayAttr(attribute)]


def _reshape_axes(axes: Axes, source: list[int], result: list[int]) -> Axes:
    """A sharded source dimension goes to the result dimension that starts at the same
    row-major offset (the major dimension of a split or merged group)."""
    starts: dict[int, int] = {}
    size = 1
    for dim, extent in enumerate(result):
        starts.setdefault(size, dim)
        size *= extent
    out = [frozenset[str]() for _ in result]
    size = 1
    for dim, extent in enumerate(source):
        target = starts.get(size)
        if axes[dim] and target is not None:
            out[target] |= axes[dim]
        size *= extent
    return tuple(out)


def _result_axes(op: ir.Operation, known: dict[Any, Axes]) -> Axes | None:
    """The result's sharded axes, from the op's operands' (forward propagation)."""
    rank = _rank(op.results[0]) if op.results else None
    if rank is None:
        return None
    name = op.name
    if name in ("sdy.sharding_constraint", "sdy.reshard", "stablehlo.custom_call"):
        return _declared_axes(op.attributes, rank)
    operands = [known.get(value) for value in op.operands]
    if all(axes is None for axes in operands):
        return None  # nothing known flows in (most ops of an unsharded region)
    first = operands[0]
    if name == _DOT:
        numbers = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        lhs, rhs = operands[0], operands[1]
        lhs_rank, rhs_rank = _rank(op.operands[0]), _rank(op.operands[1])
        lhs = lhs or tuple(frozenset() for _ in range(lhs_rank))
        rhs = rhs or tuple(frozenset() for _ in range(rhs_rank))
        lb, rb = numbers.lhs_batching_dimensions, numbers.rhs_batching_dimensions
        lc, rc = numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions
        out = [lhs[a] | rhs[b] for a, b in zip(lb, rb)]
        out += [lhs[d] for d in range(lhs_rank) if d not in lb and d not in lc]
        out += [rhs[d] for d in range(rhs_rank) if d not in rb and d not in rc]
        return _one_dim_per_axis(out)
    if name == "stablehlo.gather":
        return _gather_axes(op, operands[0], operands[1], rank)
    if first is None and name in _SHAPE_CHANGERS:
        return None
    if name == "stablehlo.broadcast_in_dim":
        out = [frozenset[str]() for _ in range(rank)]
        for source, target in enumerate(_i64s(op.attributes["broadcast_dimensions"])):
            out[target] = first[source]
        return tuple(out)
    if name == "stablehlo.transpose":
        return tuple(first[d] for d in _i64s(op.attributes["permutation"]))
    if name == "stablehlo.reshape":
        return _reshape_axes(first, list(ir.RankedTensorType(op.operands[0].type).shape),
                             list(ir.RankedTensorType(op.results[0].type).shape))
    if name == "stablehlo.reduce":
        reduced = set(_i64s(op.attributes["dimensions"]))
        return tuple(a for d, a in enumerate(first) if d not in reduced)
    if name in _SAME_RANK:  # slicing, padding or joining keeps each dimension's axes
        if any(_rank(value) not in (rank, 0) for value in op.operands):
            return None
    else:  # elementwise ops (every operand has the result's shape)
        shape = list(ir.RankedTensorType(op.results[0].type).shape)
        # A clamp's bounds and a select's choice may be scalars (the fp8 pass's clamp to
        # the format's range): they move nothing.
        scalars_allowed = name in _SCALAR_OPERANDS
        if any(not (scalars_allowed and _rank(value) == 0)
               and (_rank(value) != rank or list(ir.RankedTensorType(value.type).shape) != shape)
               for value in op.operands):
            return None
    # The union per dimension.
    shaped = [axes for axes in operands if axes is not None and len(axes) == rank]
    if not shaped:
        return None
    return _one_dim_per_axis([frozenset().union(*(axes[d] for axes in shaped))
                              for d in range(rank)])


def _gather_axes(op: ir.Operation, operand: Axes | None, indices: Axes | None,
                 rank: int) -> Axes:
    """A gather's result: its batch dimensions take the indices' axes (an embedding
    lookup's batch-sharded token ids), its offset dimensions the operand's where a
    slice spans the whole operand dimension."""
    numbers = hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    offset_dims = list(numbers.offset_dims)
    out = [frozenset[str]() for _ in range(rank)]
    batch_positions = [d for d in range(rank) if d not in offset_dims]
    index_dims = [d for d in range(_rank(op.operands[1]) or 0) if d != numbers.index_vector_dim]
    position_of = dict(zip(index_dims, batch_positions, strict=False))
    if indices is not None:
        for index_dim, position in position_of.items():
            out[position] = indices[index_dim]
    if operand is not None:
        operand_shape = list(ir.RankedTensorType(op.operands[0].type).shape)
        sizes = _i64s(op.attributes["slice_sizes"])
        dropped = {*numbers.collapsed_slice_dims, *numbers.operand_batching_dims}
        kept = [d for d in range(len(operand_shape)) if d not in dropped]
        for position, dim in zip(offset_dims, kept, strict=False):
            if sizes[dim] == operand_shape[dim]:
                out[position] = out[position] | operand[dim]
        for operand_dim, index_dim in zip(numbers.operand_batching_dims,
                                          numbers.start_indices_batching_dims, strict=False):
            if index_dim in position_of:
                out[position_of[index_dim]] |= operand[operand_dim]
    return _one_dim_per_axis(out)


def _one_dim_per_axis(dims: list[frozenset[str]]) -> Axes:
    """A mesh axis shards one dimension of a value: where two operands put it on two
    (an FSDP weight's output dimension next to the batch), the partitioner gathers one;
    keep the first (batch and the lhs's dimensions come first in a dot's result)."""
    seen: set[str] = set()
    out = []
    for axes in dims:
        out.append(frozenset(axes - seen))
        seen |= axes
    return tuple(out)



class ModuleAxes:
    """The sharded axes of the values of every function, per calling context.

    A function is evaluated once per distinct tuple of argument axes its call sites pass
    (``func.call``: jax's ``closed_call``, remat's checkpoint bodies, nested ``jax.jit``,
    the scan's ``dynamic_index_in_dim`` of each stacked weight, shared by weights
    sharded differently); a call's results get the callee's returned axes in that
    context. Public functions (and private ones no call reaches) start from their
    argument attributes. The ops of ``stablehlo.while`` bodies and of ``case``/``if``
    branches get axes as at top level; ``sdy.manual_computation`` bodies are per device
    (the partitioner sums nothing there) and are not entered."""

    def __init__(self, module: ir.Module) -> None:
        self.functions = {function_name(fn): fn for fn in functions(module)}
        # (function name, argument axes) -> the axes of what it returns.
        self.returns: dict[tuple[str, tuple[Axes | None, ...]], list[Axes | None]] = {}
        # function name -> the axes of its values in each context it was evaluated in.
        self.contexts: dict[str, list[dict[Any, Axes]]] = {}
        for name, fn in self.functions.items():
            if is_public(fn):
                self.evaluate(name, _attribute_axes(fn))
        for name, fn in self.functions.items():
            if name not in self.contexts:  # no call reaches it: as declared
                self.evaluate(name, _attribute_axes(fn))

    def evaluate(self, name: str, arguments: tuple[Axes | None, ...]) -> list[Axes | None]:
        key = (name, arguments)
        if key in self.returns:
            return self.returns[key]
        fn = self.functions[name]
        entry = fn.regions[0].blocks[0]
        ret = terminator(entry)
        self.returns[key] = [None] * len(ret.operands)  # a recursive call learns nothing
        known: dict[Any, Axes] = {}
        for argument, axes in zip(entry.arguments, arguments):
            _set(known, argument, axes)
        self._ops(walk_operations(fn, into=_TOP_LEVEL), known)
        returned = [known.get(value) for value in ret.operands]
        self.returns[key] = returned
        self.contexts.setdefault(name, []).append(known)
        return returned

    def _ops(self, ops: list[ir.Operation], known: dict[Any, Axes]) -> None:
        for op in ops:
            name = op.name
            if name == _CALL:
                callee = callee_name(op)
                if callee not in self.functions:
                    continue
                returned = self.evaluate(callee, tuple(known.get(v) for v in op.operands))
                for result, axes in zip(op.results, returned):
                    _set(known, result, axes)
            elif name == WHILE:
                self._while(op, known)
            elif name in _BRANCHES:
                self._ops(walk_operations(op, into=_TOP_LEVEL), known)
                returns = [terminator(region.blocks[0]).operands for region in op.regions]
                for index, result in enumerate(op.results):
                    _set(known, result, _agreed([known.get(r[index]) for r in returns]))
            elif name == _BARRIER:
                for result, operand in zip(op.results, op.operands):
                    _set(known, result, known.get(operand))
            else:
                axes = _result_axes(op, known)
                if op.results:
                    _set(known, op.results[0], axes)

    def _while(self, op: ir.Operation, known: dict[Any, Axes]) -> None:
        """A carried value enters the loop with its operand's axes and keeps them if the
        body returns it with the same axes (or unknown ones); where they differ it is
        unknown. A carried value whose operand's axes are unknown (a buffer of zeros the
        body fills, as scan's stacked residuals) takes the axes the body returns, if the
        body then returns them again (the partitioner propagates them into the loop)."""
        cond, body = (region.blocks[0] for region in op.regions)
        carried = [known.get(value) for value in op.operands]
        decided: set[int] = set()  # slots whose axes were adopted or dropped once
        inner = walk_operations(op, into=_TOP_LEVEL)
        for _ in range(2 * len(carried) + 1):  # each round decides a slot, or settles
            for block in (cond, body):
                for argument, axes in zip(block.arguments, carried):
                    _set(known, argument, axes)
            self._ops(inner, known)
            returned = [known.get(value) for value in terminator(body).operands]
            settled = list(carried)
            for slot, (axes, back) in enumerate(zip(carried, returned)):
                if back is None or back == axes:
                    continue
                settled[slot] = back if axes is None and slot not in decided else None
                decided.add(slot)
            if settled == carried:
                break
            carried = settled
        for result, axes in zip(op.results, carried):
            _set(known, result, axes)

    def per_device(self, module: ir.Module) -> set[str]:
        """The functions called, directly or not, from ``sdy.manual_computation`` bodies."""
        pending = [callee_name(call) for manual in walk_operations(module, names=_MANUALS)
                   for call in walk_operations(manual, names=_CALLS)]
        found: set[str] = set()
        while pending:
            name = pending.pop()
            if name in found or name not in self.functions:
                continue
            found.add(name)
            pending += [callee_name(call)
                        for call in walk_operations(self.functions[name], names=_CALLS)]
        return found


def _set(known: dict[Any, Axes], value: ir.Value, axes: Axes | None) -> None:
    # A loop body is evaluated again with fewer facts: an unknown value forgets the
    # axes the earlier round gave it.
    if axes is None:
        known.pop(value, None)
    else:
        known[value] = axes


def _agreed(candidates: list[Axes | None]) -> Axes | None:
    """The axes every branch gives a result, None where they differ."""
    first = candidates[0] if candidates else None
    return first if all(axes == first for axes in candidates) else None


def _attribute_axes(fn: Any) -> tuple[Axes | None, ...]:
    """The axes ``fn``'s argument attributes declare, per argument."""
    entry = fn.regions[0].blocks[0]
    out = []
    for index, argument in enumerate(entry.arguments):
        rank = _rank(argument)
        out.append(None if rank is None
                   else _declared_axes(_argument_attributes(fn, index), rank))
    return tuple(out)


def _argument_attributes(fn: Any, index: int) -> dict[str, Any]:
    if "arg_attrs" not in fn.attributes:
        return {}
    dictionary = ir.DictAttr(ir.ArrayAttr(fn.attributes["arg_attrs"])[index])
    return {named.name: named.attr for named in (dictionary[i] for i in range(len(dictionary)))}


def summed_everywhere(module: ir.Module, axes: ModuleAxes, names: frozenset[str],
                       summed: Any) -> list[ir.Operation]:
    """The ops named ``names`` for which ``summed(op, known)`` holds in every context their
    function is called in, at any depth of loops and branches (not per-device bodies)."""
    per_device = axes.per_device(module)
    chosen = []
    for name, fn in axes.functions.items():
        contexts = axes.contexts.get(name)
        if name in per_device or not contexts:
            continue
        chosen += [op for op in walk_operations(fn, into=_ENTERED, names=names)
                   if all(summed(op, known) for known in contexts)]
    return chosen
