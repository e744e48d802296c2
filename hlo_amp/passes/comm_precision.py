"""Choose the precision of what crosses devices.

Two steps, one concern (the bytes collectives move):

* Converts move up through data movement. A narrowing float convert (f32 -> bf16) whose
  operand is the result of a sharding constraint (``sdy.sharding_constraint``,
  ``sdy.reshard``, ``custom_call @Sharding``, ``@SPMDFullToShardShape``,
  ``@SPMDShardToFullShape``), a reshape, a transpose, a broadcast or a data-moving
  collective (``all_gather``, ``all_to_all``, ``collective_permute``) goes before that op
  when every reader of the op's result is such a convert to the same type: the op then
  moves 16-bit data. Rounding commutes with moving elements, so the values are the same
  bit for bit; the all-gather that XLA's partitioner puts at a constraint to replicated
  (sequence-parallel K and V) gathers 16 bit (jax-ml/jax#23543). Sums (``all_reduce``,
  ``reduce_scatter``) are not data movement and are left alone here.

* ``reduce=`` (Policy.reduce) sets the result type of the matrix ops whose partial
  results XLA's SPMD partitioner sums across devices: dots whose contracting dimension
  is sharded (per the public functions' argument shardings and the sharding
  constraints, propagated forward into ``while`` bodies, ``case``/``if`` branches and
  through ``func.call``s: a scanned layer's dots, remat's checkpoint bodies). The all-reduce (or reduce-scatter) the partitioner inserts after
  such a dot has the dot's result type. ``reduce=bfloat16`` makes those dots (when their
  operands are already 16-bit, or they are f32 dots the target runs as one bf16 pass:
  their ``Decision.runs_as``) return 16 bit and converts back after: half the bytes,
  each device's partial sum rounded once and the sum done in 16 bit. ``reduce=float32``
  makes them return f32 where the fast mode gave them a 16-bit result. Not set: the
  mode's own result type (f32 in the accurate mode).

* The same precision applies to the add scatters whose partial results the partitioner
  sums across devices: an embedding's gradient, the gather's transpose, scatter-adds
  the batch's updates into the table (zeros) on each device, and XLA all-reduces the
  table right after the scatter, in the scatter's type (a convert after it is folded
  away). Where the reduce precision is 16-bit (``reduce=bfloat16``/``float16``, or not
  set in the fast mode, whose default is the compute dtype) and the updates are 16-bit
  values converted up (propagate's painting), the scatter is retyped: its operand
  converted down, the 16-bit updates read directly, the sum in 16 bit, a convert back
  to the old type after it. ``reduce=float32`` (and the accurate modes by default)
  leave it in f32. Only one-input scatters into a constant (the zeros) whose body is
  one add and whose updates can meet (not a one-position scatter, which sums nothing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.loops import WHILE
from hlo_amp.ir.modules import (
    callee_name,
    decision_of,
    discard,
    element_type,
    from_constant,
    function_name,
    functions,
    is_public,
    live_uses,
    terminator,
    walk_operations,
    with_element,
)
from hlo_amp.ir.op_classes import body_is_one_add, single_update_scatter
from hlo_amp.policy import DTYPE_TO_ELEMENT, KEEP, Policy
from hlo_amp.report import Report

# Ops that only move or replicate the elements of their first operand (the others, if
# any, are integer indices): one result of the first operand's element type, no smaller
# than it. A convert commutes with each of them. Ops that pick part of their operand
# (slice, dynamic_slice, gather) are left out: above them the convert would convert the
# whole operand (an embedding table, a scan's whole sequence) to use a part.
_MOVERS = frozenset({
    "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
    "stablehlo.reverse", "stablehlo.all_gather", "stablehlo.all_to_all", "stablehlo.collective_permute",
    "sdy.sharding_constraint", "sdy.reshard", "stablehlo.custom_call",
})
_MOVER_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
_CONVERT = "stablehlo.convert"
_SAME_RANK = frozenset({"stablehlo.slice", "stablehlo.reverse", "stablehlo.pad",
                        "stablehlo.concatenate", "stablehlo.dynamic_slice",
                        "stablehlo.dynamic_update_slice"})
_SHAPE_CHANGERS = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.transpose",
                             "stablehlo.reshape", "stablehlo.reduce"})
_DOT = "stablehlo.dot_general"
_DOTS = frozenset({_DOT})
_SCATTERS = frozenset({"stablehlo.scatter"})
# walk_operations' ``into`` that enters no op: a function body's own ops.
_TOP_LEVEL: frozenset[str] = frozenset()
_MANUALS = frozenset({"sdy.manual_computation"})
_CALL = "func.call"
_CALLS = frozenset({_CALL})
_BRANCHES = frozenset({"stablehlo.case", "stablehlo.if"})
_BARRIER = "stablehlo.optimization_barrier"
# The region ops whose ops the axes reach (a reduce's or sort's body holds scalars).
_ENTERED = frozenset({WHILE, *_BRANCHES})


@dataclass(frozen=True)
class CommPrecision:
    """Move 16-bit converts above data movement; apply the policy's ``reduce`` dtype to
    dots whose contracting dimension is sharded. See the module docstring."""

    policy: Policy
    name: str = "hlo-amp-comm-precision"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if not any(action not in (None, KEEP, "float32", "float64")
                   for action in self.policy.actions):
            return  # the f32 preset changes nothing, a program's own converts included
        moved = sum(_move_converts_up(fn) for fn in functions(module))
        retyped = summed = 0
        reduce = self.reduce_dtype
        # The axes analysis walks every function: only where a dot or a scatter may need it.
        sums_scatters = (reduce not in (None, "float32")
                         and bool(walk_operations(module, names=_SCATTERS)))
        if self.policy.reduce is not None or sums_scatters:
            with module.context:
                axes = _ModuleAxes(module)
                wanted = ir.Type.parse(DTYPE_TO_ELEMENT[reduce])
                scatters = _chosen_scatters(module, axes, wanted) if sums_scatters else []
                if self.policy.reduce is not None:
                    retyped = _retype_reduced_dots(module, axes, wanted, report)
                summed = _sum_in_16bit(scatters, wanted)
        if report is not None and (moved or retyped or summed):
            note = f"comm-precision: moved {moved} 16-bit convert(s) above data movement"
            if retyped:
                note += (f", {retyped} dot(s) with a sharded contracting dimension return "
                         f"{self.policy.reduce} (reduce={self.policy.reduce})")
            if summed:
                why = (f"reduce={self.policy.reduce}" if self.policy.reduce is not None
                       else "the fast mode's default reduce precision")
                note += (f", {summed} add scatter(s) summed across devices (an embedding's "
                         f"gradient) sum their 16-bit updates in {reduce} ({why})")
            report.notes.append(note)

    @property
    def reduce_dtype(self) -> str | None:
        """The precision of the sums across devices: ``reduce=``, else the fast mode's
        compute dtype (its matrix ops return 16 bit); None: the accurate modes' own."""
        if self.policy.reduce is not None:
            return self.policy.reduce
        return self.policy.compute_dtype if self.policy.propagate else None


# ---- converts above data movement ----------------------------------------------------


def _is_mover(op: ir.Operation) -> bool:
    if op.name not in _MOVERS or not op.operands or len(op.results) != 1:
        return False
    if op.regions and any(len(region.blocks) for region in op.regions):
        return False
    if any(isinstance(element_type(index), ir.FloatType) for index in op.operands[1:]):
        return False  # a second float operand (a padding value): not one value moved
    if op.name == "stablehlo.custom_call":
        target = op.attributes["call_target_name"]
        return ir.StringAttr(target).value in _MOVER_CALLS
    return True


def _narrowing_target(converts: list[ir.Operation], source: ir.Type) -> ir.Type | None:
    """The one float type all ``converts`` narrow ``source`` to, else None."""
    targets = {str(element_type(c.results[0])) for c in converts}
    if len(targets) != 1:
        return None
    target = element_type(converts[0].results[0])
    if not (isinstance(source, ir.FloatType) and isinstance(target, ir.FloatType)):
        return None
    return target if target.width < source.width else None


def _move_converts_up(fn: Any) -> int:
    """Move converts above movers in ``fn``, bottom up (a chain moves in one sweep)."""
    moved = 0
    for op in reversed(walk_operations(fn)):
        if not _is_mover(op):
            continue
        result, source = op.results[0], op.operands[0]
        source_element = element_type(source)
        if source_element is None or str(source_element) != str(element_type(result)):
            continue
        readers = [use.owner for use in live_uses(result)]
        if not readers or any(reader.name != _CONVERT for reader in readers):
            continue
        target = _narrowing_target(readers, source_element)
        if target is None:
            continue
        with op.location, ir.InsertionPoint(op):
            narrow = hlo.ConvertOp(with_element(source.type, target), source)
            result.set_type(with_element(result.type, target))
        op.operands[0] = narrow.result
        for reader in readers:
            reader.results[0].replace_all_uses_with(result)
            discard(reader)
        moved += 1
    return moved


# ---- dots whose partial results are summed across devices ---------------------------

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
        if any(_rank(value) != rank or list(ir.RankedTensorType(value.type).shape) != shape
               for value in op.operands):
            return None
    # The union per dimension.
    shaped = [axes for axes in operands if axes is not None and len(axes) == rank]
    if not shaped:
        return None
    return _one_dim_per_axis([frozenset().union(*(axes[d] for axes in shaped))
                              for d in range(rank)])


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


def _summed_across_devices(op: ir.Operation, known: dict[Any, Axes]) -> bool:
    """Whether the partitioner sums ``op``'s partial results across devices: a mesh axis
    shards a contracting dimension of both operands, or of one operand while the other
    does not use that axis at all (it is replicated there and gets sliced). An axis that
    shards one operand's contracting dimension and another dimension of the other
    operand (FSDP: a weight sharded over the data axis) makes XLA gather the weight."""
    lhs, rhs = known.get(op.operands[0]), known.get(op.operands[1])
    if lhs is None and rhs is None:
        return False
    numbers = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    pairs = zip(numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions)
    lhs_all = frozenset().union(*lhs) if lhs else frozenset()
    rhs_all = frozenset().union(*rhs) if rhs else frozenset()
    for lc, rc in pairs:
        left = lhs[lc] if lhs else frozenset()
        right = rhs[rc] if rhs else frozenset()
        if left & right or (left - rhs_all) or (right - lhs_all):
            return True
    return False


class _ModuleAxes:
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


def _summed_everywhere(module: ir.Module, axes: _ModuleAxes, names: frozenset[str],
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


def _retype_reduced_dots(module: ir.Module, axes: _ModuleAxes, wanted: ir.Type,
                         report: Report | None) -> int:
    """Give ``wanted`` as the result element of the 16-bit dots whose partial results are
    summed across devices in every context their function is called in, at any depth of
    loops and branches; a convert back keeps the readers' type."""
    # Decided before any is retyped: a retyped dot's readers read a convert.
    chosen = _summed_everywhere(module, axes, _DOTS, _summed_across_devices)
    retyped = 0
    for op in chosen:
        operand_elements = {str(element_type(value)) for value in op.operands}
        result = op.results[0]
        have = element_type(result)
        if str(have) == str(wanted) or len(operand_elements) != 1:
            continue
        operand_element = element_type(op.operands[0])
        # An f32 dot the target runs as one 16-bit pass (insert_converts' TPU rule) counts
        # as that type: f32 x f32 -> bf16 there is the converted dot's arithmetic.
        operand_element = _runs_as(op, report) or operand_element
        if not isinstance(operand_element, ir.FloatType) or operand_element.width != 16:
            continue  # a dot the policy kept in f32: its reduction stays as written
        if str(wanted) not in (str(operand_element), "f32"):
            continue
        old_type = result.type
        readers = list(live_uses(result))
        with op.location, ir.InsertionPoint.after(op):
            result.set_type(with_element(old_type, wanted))
            back = hlo.ConvertOp(old_type, result)
        for use in readers:
            use.owner.operands[use.operand_number] = back.result
        retyped += 1
    return retyped


def _runs_as(op: ir.Operation, report: Report | None) -> ir.Type | None:
    """The 16-bit type the target runs ``op`` as, from its decision (``Decision.runs_as``,
    found by the op's decision mark); None for every other op."""
    index = decision_of(op)
    if report is None or index is None:
        return None
    element = report.decisions[index].runs_as
    return ir.Type.parse(element) if element else None


# ---- add scatters whose partial results are summed across devices -----------------


def _low_updates(op: ir.Operation, wanted: ir.Type) -> ir.Value | None:
    """The 16-bit value behind an add scatter's updates when they are that value
    converted up to the scatter's wider float type (``wanted``: the 16-bit type), else
    None. Only one-input scatters whose body is one add and whose updates can meet, into
    a constant (the zeros of a gather's transpose): an accumulator the scatter added to
    would be rounded to 16 bit as well."""
    if len(op.operands) != 3 or not body_is_one_add(op) or single_update_scatter(op):
        return None
    if not from_constant(op.operands[0]):
        return None
    element = element_type(op.results[0])
    if not isinstance(element, ir.FloatType) or element.width <= ir.FloatType(wanted).width:
        return None
    updates = op.operands[2].owner
    if isinstance(updates, ir.Block) or updates.operation.name != _CONVERT:
        return None
    low = updates.operation.operands[0]
    return low if str(element_type(low)) == str(wanted) else None


def _scatter_summed_across_devices(op: ir.Operation, known: dict[Any, Axes]) -> bool:
    """Whether the partitioner sums ``op``'s partial results across devices: a mesh axis
    shards the updates' scatter dimensions (the batch of an embedding's gradient) or the
    indices, and the operand does not use it. Each device then scatters its share of
    the updates into its own copy of the operand, and XLA sums the copies."""
    operand, indices, updates = (known.get(value) for value in op.operands)
    numbers = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    windows = set(numbers.update_window_dims)
    spread = frozenset[str]()
    if updates is not None:
        spread |= frozenset().union(*(a for d, a in enumerate(updates) if d not in windows))
    if indices is not None:
        spread |= frozenset().union(*(a for d, a in enumerate(indices)
                                      if d != numbers.index_vector_dim))
    used = frozenset().union(*operand) if operand else frozenset()
    return bool(spread - used)


def _chosen_scatters(module: ir.Module, axes: _ModuleAxes, wanted: ir.Type
                     ) -> list[tuple[ir.Operation, ir.Value]]:
    """The add scatters with 16-bit updates summed across devices in every context, each
    with the 16-bit value behind its updates."""
    chosen = _summed_everywhere(module, axes, _SCATTERS, _scatter_summed_across_devices)
    return [(op, low) for op in chosen if (low := _low_updates(op, wanted)) is not None]


def _sum_in_16bit(chosen: list[tuple[ir.Operation, ir.Value]], wanted: ir.Type) -> int:
    """Retype each scatter to ``wanted``: its operand converted down, its updates read
    before their convert up (``low``), its body's add in ``wanted``, and a convert back to
    the old type after it, so its readers (and the program's outputs) keep their types."""
    for op, low in chosen:
        updates_convert = op.operands[2].owner
        operand, result = op.operands[0], op.results[0]
        old_type = result.type
        readers = list(live_uses(result))
        with op.location, ir.InsertionPoint(op):
            scalar = ir.RankedTensorType.get([], wanted)
            narrow = hlo.ConvertOp(with_element(operand.type, wanted), operand)
            result.set_type(with_element(old_type, wanted))
        op.operands[0] = narrow.result
        op.operands[2] = low
        body = op.regions[0].blocks[0]
        for argument in body.arguments:
            argument.set_type(scalar)
        for inner in body.operations:
            for inner_result in inner.results:
                inner_result.set_type(scalar)
        with op.location, ir.InsertionPoint.after(op):
            back = hlo.ConvertOp(old_type, result)
        for use in readers:
            use.owner.operands[use.operand_number] = back.result
        if not any(True for _ in live_uses(updates_convert.results[0])):
            discard(updates_convert)
    return len(chosen)


__all__ = ["CommPrecision"]
