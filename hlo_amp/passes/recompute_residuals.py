"""Recompute, in the backward pass, an f32 residual that is an elementwise function of
one 16-bit value (the mixed_* modes, on targets that ask: ``Target.recomputes_residuals``).

A batch norm's variance, ``mean(square(x - mean))``, keeps ``2 * (x - mean)`` in f32 for
its backward pass (the derivative of the square), computed from the 16-bit convolution
result ``x``, which is also kept. XLA stores that f32 value from the forward to the
backward pass: four bytes per element where ``x`` holds two. This pass has the backward
readers compute it again from ``x`` and the small values (the mean, constants): the
same ops on the same values, so the same values, and XLA fuses them into the backward
kernels that read them. The forward pass no longer writes the f32 value. (Keras
MobileNetV3Small's first two blocks, 32x32, batch 8, on H100: 4,890,688 B of temp
before, 4,628,544 after, the hand cast's 4,890,432; at 64x64 7,652,680 before, 5,208,136
after, f32's 5,232,456.)

A value R is recomputed when:

- it is f32 and a backward op (``transpose(...)`` in its name stack) reads it;
- it is made, in its own block or in the private function whose call returns it, by
  elementwise ops, broadcasts and constants from exactly one full-size value of the
  policy's compute dtype (read through a convert up to f32) and values at most an eighth
  of R's size (statistics);
- at most ``MAX_OPS`` ops make it.

The backward readers read a copy made right before the first of them, from the 16-bit
value behind an ``optimization_barrier`` (without it XLA's CSE merges the copy with the
original). A statistic made inside the private function becomes one more result of it
(every call site gets the new results); a public signature never changes. Only the
backward readers move: a forward reader keeps R.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.loops import WHILE
from hlo_amp.ir.modules import (
    callee_name,
    discard,
    element_count,
    element_type,
    function_name,
    functions,
    is_public,
    live_uses,
    op_key,
    set_function_type,
    terminator,
    walk_operations,
)
from hlo_amp.ir.op_classes import INFER, OP_CLASSES, short_name
from hlo_amp.ir.sites import in_backward_pass
from hlo_amp.passes.propagate.body import is_f32
from hlo_amp.passes.stacked_residuals import first_in_block, recompute_stacked
from hlo_amp.policy import DTYPE_TO_ELEMENT, Policy
from hlo_amp.report import Report
from hlo_amp.targets import NO_TARGET, Target

MAX_OPS = 32
# A statistic is at most this fraction of the residual's elements.
STATISTIC_FRACTION = 8
_ELEMENTWISE = frozenset(name for name, cls in OP_CLASSES.items() if cls == INFER)
_MOVES = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.convert",
                    "stablehlo.constant"})


@dataclass
class _Recipe:
    """How to make one residual again: ``ops`` (in program order, in the caller's block
    or in ``callee``) from ``source`` (the 16-bit value) and ``statistics`` (values the
    copy reads as they are; in a callee, its block arguments or values it then returns)."""

    result: ir.Value  # the residual: a value of the caller
    definer: ir.Operation  # the op that returns it (a call, or the op making it)
    ops: list[ir.Operation]
    source: ir.Value
    statistics: list[ir.Value]
    callee: str | None = None  # the private function the ops are in, if not the caller's


@dataclass(frozen=True)
class RecomputeResiduals:
    """Backward readers recompute f32 residuals from a stored 16-bit value."""

    policy: Policy
    target: Target = NO_TARGET
    name: str = "hlo-amp-recompute-residuals"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if not (self.policy.propagate and self.target.recomputes_residuals):
            return
        by_name = {function_name(fn): fn for fn in functions(module)}
        low = DTYPE_TO_ELEMENT[self.policy.compute_dtype]
        ops = walk_operations(module)
        recipes = [recipe for op in ops for recipe in _recipes_of(op, by_name, low)]
        loops = [op for op in ops if op.name == WHILE]  # calls may be rebuilt, loops not
        with module.context:
            saved = 0
            if recipes:
                calls, returned = _return_statistics(module, by_name, recipes)
                saved = sum(_recompute(recipe, calls, returned) for recipe in recipes)
            stacked, stacked_bytes = recompute_stacked(module, loops, by_name)
        if report is not None and recipes:
            report.notes.append(
                f"recompute-residuals: {len(recipes)} f32 residual(s) of "
                f"{saved:,} B recomputed in the backward pass from a 16-bit value "
                f"instead of stored")
        if report is not None and stacked:
            report.notes.append(
                f"recompute-residuals: {stacked} residual(s) a loop stacks for its "
                f"backward loop ({stacked_bytes:,} B of stacks) recomputed there from "
                f"values it stacks anyway")


def _recipes_of(op: ir.Operation, by_name: dict, low: str) -> list[_Recipe]:
    """The recipes of ``op``'s results that backward ops read, from a value of element
    type ``low`` (the compute dtype's: "bf16", "f16")."""
    name = op.name
    if name != "func.call" and short_name(name) not in _ELEMENTWISE:
        return []
    found: list[_Recipe] = []
    forward = None
    for index, result in enumerate(op.results):
        count = element_count(result)
        if not count or not is_f32(result):
            continue
        if forward is None:
            forward = not in_backward_pass(op)
        if not forward or not any(in_backward_pass(use.owner) for use in live_uses(result)):
            continue
        traced, callee = result, None
        if name == "func.call":
            fn = by_name.get(callee_name(op))
            if fn is None or is_public(fn):
                continue
            traced = terminator(fn.regions[0].blocks[0]).operands[index]
            callee = function_name(fn)
        made = _trace(traced, count, low)
        if made is not None:
            found.append(_Recipe(result, op, *made, callee=callee))
    return found


def _trace(value: ir.Value, count: int, low: str
           ) -> tuple[list[ir.Operation], ir.Value, list[ir.Value]] | None:
    """``(ops, source, statistics)``: the ops that make ``value`` from one full-size value
    of element type ``low`` and statistics; None when it is not so made."""
    ops: list[ir.Operation] = []
    seen: set[int] = set()
    sources: list[ir.Value] = []
    statistics: list[ir.Value] = []

    def leaf(found: ir.Value, into: list[ir.Value]) -> None:
        if not any(found == known for known in into):
            into.append(found)

    def visit(current: ir.Value) -> bool:
        size = element_count(current)
        if size is None:
            return False
        if isinstance(current, ir.BlockArgument):
            if size * STATISTIC_FRACTION <= count:
                leaf(current, statistics)
                return True
            return False
        owner = current.owner.operation  # an OpView's .name can be an attribute's
        if op_key(owner) in seen:
            return True
        if owner.name == "stablehlo.constant":
            seen.add(op_key(owner))
            ops.append(owner)
            return True
        if size * STATISTIC_FRACTION <= count:
            leaf(current, statistics)
            return True
        if owner.name == "stablehlo.convert":
            read = owner.operands[0]
            if str(element_type(read)) == low and element_count(read) == count:
                seen.add(op_key(owner))
                leaf(read, sources)
                ops.append(owner)
                return True
        if ((short_name(owner.name) not in _ELEMENTWISE and owner.name not in _MOVES)
                or len(owner.regions) or len(owner.results) != 1 or len(seen) >= MAX_OPS):
            return False
        seen.add(op_key(owner))
        if not all(visit(operand) for operand in owner.operands):
            return False
        ops.append(owner)  # after its operands: program order
        return True

    if not visit(value) or len(sources) != 1 or not ops:
        return None
    return ops, sources[0], statistics


def _return_statistics(module: ir.Module, by_name: dict, recipes: list[_Recipe]
                       ) -> tuple[dict[int, ir.Operation], dict[str, list[ir.Value]]]:
    """Give each callee the values its recipes read that are made inside it, as new
    results (its return and every call of it rebuilt). Returns the new call op of each
    old one (by ``op_key`` of the old one) and each callee's results, new return's order."""
    extra: dict[str, list[ir.Value]] = {}
    for recipe in recipes:
        if recipe.callee is None:
            continue
        wanted = extra.setdefault(recipe.callee, [])
        for value in [recipe.source, *recipe.statistics]:
            if not isinstance(value, ir.BlockArgument) and not any(value == w for w in wanted):
                wanted.append(value)
    calls: dict[int, ir.Operation] = {}
    returned: dict[str, list[ir.Value]] = {}
    sites: dict[str, list[ir.Operation]] = {}
    if any(extra.values()):
        for call in walk_operations(module, names=frozenset({"func.call"})):
            sites.setdefault(callee_name(call), []).append(call)
    for callee, values in extra.items():
        fn = by_name[callee]
        old_return = terminator(fn.regions[0].blocks[0])
        operands = [*old_return.operands, *values]
        returned[callee] = operands
        if not values:
            continue
        func_dialect.ReturnOp(operands, loc=old_return.location,
                              ip=ir.InsertionPoint(old_return))
        discard(old_return)
        set_function_type(fn, [value.type for value in operands])
        if "res_attrs" in fn.attributes:  # one dictionary per result
            kept = list(ir.ArrayAttr(fn.attributes["res_attrs"]))
            fn.attributes["res_attrs"] = ir.ArrayAttr.get(
                kept + [ir.DictAttr.get({})] * (len(operands) - len(kept)))
        for call in sites.get(callee, ()):
            new = func_dialect.CallOp([value.type for value in operands],
                                      ir.FlatSymbolRefAttr.get(callee, call.context),
                                      list(call.operands), loc=call.location,
                                      ip=ir.InsertionPoint(call)).operation
            for name in call.attributes:
                if name not in new.attributes:
                    new.attributes[name] = call.attributes[name]
            for old_result, new_result in zip(call.results, new.results):
                old_result.replace_all_uses_with(new_result)
            discard(call)
            calls[op_key(call)] = new
    return calls, returned


def _recompute(recipe: _Recipe, calls: dict[int, ir.Operation],
               returned: dict[str, list[ir.Value]]) -> int:
    """Make the recipe's copy before its first backward reader and have the backward
    readers read it; the residual's bytes."""
    result, definer = recipe.result, recipe.definer
    outside: list[tuple[ir.Value, ir.Value]] = []  # (a recipe's leaf, the caller's value)
    if recipe.callee is not None:
        number = ir.OpResult(result).result_number
        definer = calls.get(op_key(definer), definer)
        result = definer.results[number]
        results = returned[recipe.callee]
        for value in [recipe.source, *recipe.statistics]:
            if isinstance(value, ir.BlockArgument):
                outside.append((value, definer.operands[ir.BlockArgument(value).arg_number]))
            else:
                position = next(i for i, r in enumerate(results) if r == value)
                outside.append((value, definer.results[position]))
    else:
        outside = [(value, _current(value, calls))
                   for value in [recipe.source, *recipe.statistics]]
    readers = [use.owner for use in live_uses(result) if in_backward_pass(use.owner)]
    first = first_in_block(definer.operation.block, readers)
    where = ir.InsertionPoint(first)
    with first.location:
        source = outside[0][1]
        barrier = hlo.OptimizationBarrierOp([source], ip=where)
        copies: list[tuple[ir.Value, ir.Value]] = [(recipe.source, barrier.results[0])]
        copies += outside[1:]
        if recipe.callee is None:
            # A call another recipe's statistics rebuilt returns the source now: the ops
            # read the new call's result (a jitted block's output: StopIteration, review
            # h115).
            copies += [(source, barrier.results[0])]
            copies += [(current, current) for _, current in outside[1:]]
        for op in recipe.ops:
            # A callee's op is made in the caller's backward pass named as its first
            # reader: with the callee's own name ("tanh", no transpose(...)) a second run
            # of the pass took it for a forward op and recomputed it again (review h117).
            clone = ir.Operation.create(
                op.name, results=[result.type for result in op.results],
                operands=[next(new for old, new in copies if old == operand)
                          for operand in op.operands],
                attributes={name: op.attributes[name] for name in op.attributes},
                loc=op.location if recipe.callee is None else first.location, ip=where)
            copies += list(zip(op.results, clone.results))
    copy = copies[-1][1]
    for reader in readers:
        for position, operand in enumerate(reader.operands):
            if operand == result:
                reader.operands[position] = copy
    return 4 * (element_count(result) or 0)


def _current(value: ir.Value, calls: dict[int, ir.Operation]) -> ir.Value:
    """``value``, or the result of the call that replaced the call returning it."""
    if isinstance(value, ir.OpResult):
        call = calls.get(op_key(value.owner))
        if call is not None:
            return call.results[value.result_number]
    return value
