"""Clean up converts: fold lossless round trips, merge duplicates, drop dead ones, and
hoist loop-invariant converts out of ``stablehlo.while`` bodies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.loops import enclosing_while, inside, is_invariant, loop_body
from hlo_amp.ir.modules import (
    call_sites,
    discard,
    element_type,
    erase_discarded,
    function_name,
    functions,
    is_program_convert,
    is_public,
    live_uses,
    mark_program_convert,
    named_outside_calls,
    walk_operations,
)
from hlo_amp.ir.rebuild import call_with_extra, grow_signature, while_with_invariants
from hlo_amp.report import Report

# (narrow, wide) float pairs where narrow -> wide -> narrow gives back every value.
_LOSSLESS_WIDENINGS = {
    ("bf16", "f32"), ("bf16", "f64"), ("f16", "f32"), ("f16", "f64"), ("f32", "f64"),
}


def _element(value: ir.Value) -> str:
    return str(element_type(value) or "")


_CONVERT = frozenset({"stablehlo.convert"})
_WHILE = frozenset({"stablehlo.while"})


def _converts(module: ir.Module) -> list[Any]:
    return [op.opview for fn in functions(module)
            for op in walk_operations(fn, names=_CONVERT)]


@dataclass(frozen=True)
class CleanupConverts:
    """Fold ``convert(convert(x: A) -> B) -> A`` when A -> B is lossless; share converts;
    with ``hoist_loop_invariants``, compute loop-invariant converts once, before the loop."""

    hoist_loop_invariants: bool = True
    name: str = "hlo-amp-cleanup"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        # Each step below is a function that returns before the ops it discarded are
        # erased (modules.erase_discarded): no object of a step outlives its erasures.
        folded, merged, removed = _fold_and_merge(module)
        hoisted = 0
        if self.hoist_loop_invariants:
            erase_discarded(self.name)
            with module.context:
                hoisted = _hoist_loop_invariants(module, self.name)
            if hoisted:
                # Converts hoisted from two loops may now convert the same value twice.
                more = _fold_and_merge(module)
                folded, merged, removed = folded + more[0], merged + more[1], removed + more[2]
        if report is not None and (folded or merged or hoisted):
            note = (f"cleanup: folded {folded} round-trip convert(s), merged {merged}, "
                    f"erased {removed} dead")
            if hoisted:
                note += f", hoisted {hoisted} loop-invariant convert(s) out of while loops"
            report.notes.append(note)


def _fold_and_merge(module: ir.Module) -> tuple[int, int, int]:
    folded = merged = 0
    seen: dict[tuple[Any, Any, str], Any] = {}
    converts = _converts(module)
    for convert in converts:
        source = convert.operand
        result = convert.result
        # Same type in and out: the convert does nothing.
        if source.type == result.type:
            result.replace_all_uses_with(source)
            folded += 1
            continue
        producer = source.owner
        if isinstance(producer, ir.Operation):
            producer = producer.opview
        if isinstance(producer, hlo.ConvertOp):
            original = producer.operand
            if (original.type == result.type
                    and (_element(original), _element(source)) in _LOSSLESS_WIDENINGS):
                result.replace_all_uses_with(original)
                folded += 1
                continue
        key = (convert.operation.block, source, str(result.type))
        first = seen.get(key)
        if first is not None and first.operation.is_before_in_block(convert.operation):
            result.replace_all_uses_with(first.result)
            if is_program_convert(convert):  # it serves the program's readers now
                mark_program_convert(first)
            merged += 1
        else:
            seen.setdefault(key, convert)
    return folded, merged, _discard_dead_converts(converts)


def _discard_dead_converts(converts: list[Any]) -> int:
    # Consumers follow their producers in program order, so one backward sweep also
    # catches a convert that only fed a convert discarded just before. Folding and
    # merging only replace uses, so the converts walked for them are still all there are.
    removed = 0
    for convert in reversed(converts):
        if next(live_uses(convert.result), None) is None:
            discard(convert)
            removed += 1
    return removed


# ---- loop-invariant converts --------------------------------------------------------
#
# A convert in a while body whose operand is the same on every iteration -- a carry the
# body returns unchanged at its own position, or a value defined outside the loop -- is
# moved before the loop: a carry's convert becomes a new carry of the converted type
# (returned unchanged), a captured value's convert is used from above. JAX's scan puts
# the step in a private function (`func.call @closed_call` in the body), so a convert of
# a callee argument is first lifted to the call sites when every call sits directly in a
# while body and passes a loop-invariant value there. Left alone, for simplicity:
# converts to non-float types, converts in nested regions of a body (a case/if inside
# it) or in a callee's nested regions, and converts whose operand is computed in the
# body from invariant values. Inner loops go first, so a convert hoisted out of an inner
# loop can leave an outer loop too; the lift/hoist steps repeat until nothing moves.


def _is_float_convert(convert: Any) -> bool:
    return isinstance(element_type(convert.result), ir.FloatType)


def _hoist_loop_invariants(module: ir.Module, pass_name: str) -> int:
    hoisted = 0
    while True:
        lifted, moved = _hoist_round(module)
        erase_discarded(pass_name)  # the round's objects are gone: its dead ops can go
        hoisted += moved
        if not lifted and not moved:
            return hoisted


def _hoist_round(module: ir.Module) -> tuple[int, int]:
    """One lift from callees and one hoist from every loop: (lifted, moved)."""
    ops = [op for fn in functions(module) for op in walk_operations(fn)]
    # Inner loops after their outer loop in program order: reversed, inner first.
    loops = [op.opview for op in ops if op.name in _WHILE][::-1]
    if not loops:
        return 0, 0
    lifted = _lift_from_callees(module, ops)
    return lifted, sum(_hoist_from_while(loop) for loop in loops)


def _hoist_from_while(loop: Any) -> int:
    """Move the invariant float converts of ``loop``'s body before it; the count moved."""
    body = loop_body(loop)
    carried: list[Any] = []  # converts of a carry: each becomes a new carry
    first_of: dict[tuple[Any, str], Any] = {}
    moved = 0
    for op in list(body.operations):
        if not isinstance(op, hlo.ConvertOp) or not _is_float_convert(op):
            continue
        source = op.operand
        if not is_invariant(source, loop):
            continue
        key = (source, str(op.result.type))
        if key in first_of:  # the same convert twice: one hoisted copy serves both
            op.result.replace_all_uses_with(first_of[key].result)
            discard(op)
            moved += 1
            continue
        first_of[key] = op
        moved += 1
        if isinstance(source.owner, ir.Block) and source.owner == body:
            index = ir.BlockArgument(source).arg_number
            op.operation.move_before(loop.operation)
            op.operation.operands[0] = loop.operation.operands[index]
            carried.append(op)
        else:  # captured from above: it dominates the loop, so the convert can sit there
            op.operation.move_before(loop.operation)
    if carried:
        _add_carries(loop, carried)
    return moved


def _add_carries(loop: Any, converts: Sequence[Any]) -> None:
    """Rebuild ``loop`` with one more carry per convert (now before the loop): the
    convert is the initial value, the body returns the carry unchanged and uses it
    in place of the convert."""
    values = [convert.result for convert in converts]
    new, arguments = while_with_invariants(loop, values,
                                           [convert.location for convert in converts])
    for value, argument in zip(values, arguments):
        # Only the body's reads: a convert of this convert hoisted in the same round sits
        # before the loop too and keeps reading it there.
        for use in list(value.uses):
            if inside(use.owner, new):
                use.owner.operands[use.operand_number] = argument


def _lift_from_callees(module: ir.Module, ops: list[Any]) -> int:
    """Move float converts of a private callee's arguments to its call sites when every
    call sits directly in a while body and passes a loop-invariant value; the count."""
    calls = call_sites(ops)
    plans = []
    for fn in functions(module):
        sites = calls.get(function_name(fn), [])
        if is_public(fn) or not sites:
            continue
        loops = [enclosing_while(site) for site in sites]
        if any(loop is None for loop in loops):
            continue
        groups = [converts for index, converts in _argument_converts(fn).items()
                  if all(is_invariant(site.operation.operands[index[0]], loop)
                         for site, loop in zip(sites, loops))]
        if groups:
            plans.append((fn, sites, groups))
    if not plans:
        return 0
    named = named_outside_calls(ops)  # these keep their signature
    return sum(_lift(fn, sites, groups) for fn, sites, groups in plans
               if function_name(fn) not in named)


def _argument_converts(fn: Any) -> dict[tuple[int, str], list[Any]]:
    """The float converts in ``fn``'s entry block of an argument, by (index, type)."""
    entry = fn.regions[0].blocks[0]
    groups: dict[tuple[int, str], list[Any]] = {}
    for op in entry.operations:
        if (isinstance(op, hlo.ConvertOp) and _is_float_convert(op)
                and isinstance(op.operand.owner, ir.Block) and op.operand.owner == entry):
            index = ir.BlockArgument(op.operand).arg_number
            groups.setdefault((index, str(op.result.type)), []).append(op)
    return groups


def _lift(fn: Any, sites: list[Any], groups: list[list[Any]]) -> int:
    """Replace each group of converts of one argument by a converted argument: the
    argument itself, retyped, when the converts are its only readers, else a new one
    appended; every call site converts its operand instead."""
    entry = fn.regions[0].blocks[0]
    appended: list[int] = []  # per new trailing argument, the argument it converts
    lifted = 0
    indices = [ir.BlockArgument(converts[0].operand).arg_number for converts in groups]
    for index, converts in zip(indices, groups):
        argument = entry.arguments[index]
        converted_type = converts[0].result.type
        readers = [convert.operation for convert in converts]
        # Retype in place only when one type is asked of the argument: with two (bf16 and
        # f16 converts of one weight), every call site must convert from the original.
        if (indices.count(index) == 1
                and all(use.owner in readers for use in live_uses(argument))):
            argument.set_type(converted_type)
            for site in sites:
                lift = hlo.ConvertOp(converted_type, site.operation.operands[index],
                                     loc=converts[0].location,
                                     ip=ir.InsertionPoint(site.operation))
                site.operation.operands[index] = lift.result
        else:
            argument = entry.add_argument(converted_type, converts[0].location)
            appended.append(index)
        for convert in converts:
            convert.result.replace_all_uses_with(argument)
            discard(convert)
        lifted += len(converts)
    if appended:
        new_arguments = list(entry.arguments)[-len(appended):]
        for site in sites:
            _call_with_extra(site, appended, new_arguments)
    grow_signature(fn, arguments=len(appended))
    return lifted


def _call_with_extra(site: Any, indices: list[int], new_arguments: list[Any]) -> Any:
    """``site`` rebuilt with converts of operands ``indices`` appended as operands."""
    point = ir.InsertionPoint(site.operation)
    extra = [hlo.ConvertOp(argument.type, site.operation.operands[index],
                           loc=argument.location, ip=point).result
             for index, argument in zip(indices, new_arguments)]
    return call_with_extra(site, extra)
