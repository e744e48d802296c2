"""The amax of a scanned weight taken once per step, before the loop, for every layer.

Under ``lax.scan`` each layer's weight is a slice of a stacked parameter, and fp8.py
takes its amax where a dot reads it: in the loop body, on every iteration, in the
forward loop and again in the backward loop. The amax of slice ``i`` of a loop-invariant
stack is element ``i`` of the stack's amax per slice, so this pass computes that
vector once before the loop (one more carry) and reads element ``i`` in the body:

    body:    amax = reduce_max(abs(convert*(reshape(dynamic_slice(P, i)))))   all dims
    before:  rows = reduce_max(abs(convert*(P)))          all dims but the slice's axis
    body:    amax = reshape(dynamic_slice(rows, i))

The values are the same (a maximum is exact and does not depend on order, NaN
included); the loop bodies lose two reduction kernels per weight, and XLA merges the
identical ``rows`` of the forward and backward loops (both read the parameter).

jax puts the slice and the dot in different functions (the scan body calls the layer
function, which calls its ``checkpoint``): an amax of a private function's argument is
first moved to every call site, as one more scalar argument, until it reaches the loop
body that slices. Only the amaxes fp8.py writes (``max_abs``: init 0, maximum over all
dimensions) are moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.hoisting import converted, hoist_rounds, source_through_converts
from hlo_amp.ir.loops import (
    StackSlice,
    argument_number,
    enclosing_while,
    is_invariant,
    is_sharded,
    outside_value,
    stack_slice,
)
from hlo_amp.ir.modules import (
    discard,
    growable_functions,
    is_zero_constant,
    live_uses,
    op_key,
)
from hlo_amp.ir.rebuild import call_with_extra, grow_signature, while_with_invariants
from hlo_amp.passes.fp8 import max_abs
from hlo_amp.report import Report


@dataclass(frozen=True)
class HoistAmax:
    """Take the amax of each scanned weight slice before its loop (see the module doc)."""

    name: str = "hlo-amp-hoist-amax"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        hoisted = hoist_rounds(module, self.name, match_amax, _lift_to_call_sites,
                               _hoist_out_of_loops)
        if report is not None and hoisted:
            report.notes.append(f"hoist-amax: {hoisted} amax(es) of a scanned tensor's slice "
                                "taken for every slice before the loop, not in its body")


@dataclass(frozen=True)
class Amax:
    """One ``reduce_max(abs(convert*(root)))`` over all of ``root``'s dimensions."""

    reduce: ir.Operation
    converts: tuple[ir.Type, ...]  # the result types of the converts from root, in order
    root: ir.Value

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(str(t) for t in self.converts) + (str(self.reduce.results[0].type),)

    def replace(self, value: ir.Value) -> None:
        """Use ``value`` for this amax and discard the ops left without a use."""
        self.reduce.results[0].replace_all_uses_with(value)
        dead: ir.Operation | None = self.reduce
        while dead is not None and not any(True for result in dead.results
                                           for _ in live_uses(result)):
            discard(dead)
            source = dead.operands[0]
            dead = None if isinstance(source, ir.BlockArgument) else source.owner.operation
            if dead is not None and (dead.name not in ("stablehlo.abs", "stablehlo.convert")
                                     or dead.block != self.reduce.block):
                dead = None


def _build(value: ir.Value, converts: Sequence[ir.Type], dimensions: list[int]) -> ir.Value:
    """The same amax of ``value`` at the current insertion point, over ``dimensions``."""
    return max_abs(converted(value, converts), dimensions)


def match_amax(reduce: ir.Operation) -> Amax | None:
    """``reduce`` as an amax of the form ``max_abs`` writes, else None."""
    if (reduce.name != "stablehlo.reduce" or len(reduce.operands) != 2
            or not is_zero_constant(reduce.operands[1])):
        return None
    source = reduce.operands[0]
    rank = ir.RankedTensorType(source.type).rank
    if sorted(ir.DenseI64ArrayAttr(reduce.attributes["dimensions"])) != list(range(rank)):
        return None
    body = reduce.regions[0].blocks[0]
    ops = list(body.operations)
    if (len(ops) != 2 or ops[0].operation.name != "stablehlo.maximum"
            or set(ops[0].operands) != set(body.arguments)
            or list(ops[1].operands) != [ops[0].result]):
        return None
    if isinstance(source, ir.BlockArgument) or source.owner.name != "stablehlo.abs":
        return None
    # Behind jax's remat barrier the weight's amax is the same (a scalar: nothing kept
    # alive).
    root, converts = source_through_converts(source.owner.operands[0], reduce.block)
    return Amax(reduce, tuple(ir.RankedTensorType(op.results[0].type).element_type
                               for op in reversed(converts)), root)


# ---- from a function's argument to its call sites ---------------------------------------

def _lift_to_call_sites(module: ir.Module, ops: list[ir.Operation], amaxes: list[Amax],
                        by_name: dict[str, Any]) -> int:
    lifted = 0
    for fn, calls in growable_functions(module, ops):
        entry = fn.regions[0].blocks[0]
        groups: dict[tuple[Any, ...], list[Amax]] = {}
        for amax in amaxes:
            # In the entry block only: an amax in a loop body of fn is the loop's to hoist.
            index = argument_number(amax.root, entry)
            if index is not None and amax.reduce.block == entry:
                groups.setdefault((index, *amax.key), []).append(amax)
        if groups:
            lifted += _lift(fn, calls, list(groups.values()))
    return lifted


def _lift(fn: Any, calls: list[Any], groups: list[list[Amax]]) -> int:
    """Each group (one argument, one amax form) becomes a new trailing scalar argument
    of ``fn``, computed at every call site."""
    entry = fn.regions[0].blocks[0]
    for group in groups:
        first = group[0]
        argument = entry.add_argument(first.reduce.results[0].type, first.reduce.location)
        for amax in group:
            amax.replace(argument)
    for call in calls:
        extra = []
        for group in groups:
            first = group[0]
            index = ir.BlockArgument(first.root).arg_number
            with first.reduce.location, ir.InsertionPoint(call.operation):
                operand = call.operation.operands[index]
                extra.append(_build(operand, first.converts,
                                    list(range(ir.RankedTensorType(operand.type).rank))))
        call_with_extra(call, extra)
    grow_signature(fn, arguments=len(groups))
    return sum(len(group) for group in groups)


# ---- out of a loop ------------------------------------------------------------------------

def _hoist_out_of_loops(amaxes: list[Amax], by_name: dict[str, Any]) -> int:
    plans: dict[int, tuple[Any, dict[tuple[Any, ...], list[tuple[Amax, StackSlice]]]]] = {}
    for amax in amaxes:
        sliced = stack_slice(amax.root, by_name)
        if sliced is None or amax.reduce.block != amax.root.owner.operation.block:
            continue
        loop = enclosing_while(amax.reduce)
        if loop is None or is_sharded(loop) or not is_invariant(sliced.stack, loop):
            continue
        # The stack as the body sees it: its value before the loop is read when the loop
        # is rebuilt (an earlier loop's rebuild may have replaced it).
        key = (sliced.stack, sliced.axis, *amax.key)
        plans.setdefault(op_key(loop), (loop, {}))[1].setdefault(key, []).append(
            (amax, sliced))
    return sum(_hoist(loop, groups) for loop, groups in plans.values())


def _hoist(loop: Any, groups: dict[tuple[Any, ...], list[tuple[Amax, StackSlice]]]) -> int:
    """One ``rows`` per group before ``loop``, carried unchanged; each amax of the group
    becomes element ``index`` of it."""
    rows = []
    for (stack, axis, *_), members in groups.items():
        first = members[0][0]
        rank = ir.RankedTensorType(stack.type).rank
        with first.reduce.location, ir.InsertionPoint(loop.operation):
            rows.append(_build(outside_value(stack, loop), first.converts,
                               [d for d in range(rank) if d != axis]))
    _, carried = while_with_invariants(loop, rows, [members[0][0].reduce.location
                                                    for members in groups.values()])
    for row, members in zip(carried, groups.values()):
        row_type = ir.RankedTensorType(row.type)
        for amax, sliced in members:
            with amax.reduce.location, ir.InsertionPoint(amax.reduce):
                picked = hlo.dynamic_slice(row, [sliced.index], ir.DenseI64ArrayAttr.get([1]))
                element = hlo.reshape(ir.RankedTensorType.get([], row_type.element_type),
                                      picked)
            amax.replace(element)
    return sum(len(members) for members in groups.values())
