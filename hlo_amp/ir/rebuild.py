"""Ops rebuilt with more operands: a ``stablehlo.while`` with more carries, a
``func.call`` with more operands and results, a terminator with more values, a
function's signature grown to match
(MLIR ops have a fixed operand and result list, so each is a new op in the old one's
place; the old one is discarded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import discard, set_function_type, terminator


def while_with_carries(loop: Any, initial: Sequence[ir.Value],
                       locations: Sequence[ir.Location] | None = None
                       ) -> tuple[Any, list[ir.Value]]:
    """``loop`` rebuilt with one more carry per value of ``initial`` (its value on entry):
    the condition and the body get a block argument each (at ``locations``, default the
    loop's), the old results' uses move to the new loop. The body's return is the
    caller's to extend. Returns the new loop and the body's new arguments."""
    old = loop.operation
    cond, body = old.regions[0].blocks[0], old.regions[1].blocks[0]
    added = []
    for index, value in enumerate(initial):
        location = locations[index] if locations is not None else old.location
        cond.add_argument(value.type, location)
        added.append(body.add_argument(value.type, location))
    new = hlo.WhileOp([*[r.type for r in old.results], *[v.type for v in initial]],
                      [*old.operands, *initial], loc=old.location,
                      ip=ir.InsertionPoint(old))
    for attribute in old.attributes:
        new.operation.attributes[attribute] = old.attributes[attribute]
    cond.append_to(new.operation.regions[0])
    body.append_to(new.operation.regions[1])
    for index, result in enumerate(old.results):
        result.replace_all_uses_with(new.operation.results[index])
    discard(old)
    return new, added


def while_with_invariants(loop: Any, initial: Sequence[ir.Value],
                          locations: Sequence[ir.Location] | None = None
                          ) -> tuple[Any, list[ir.Value]]:
    """``while_with_carries`` whose body returns each new carry unchanged: values the
    body reads on every iteration, computed once before the loop."""
    new, arguments = while_with_carries(loop, initial, locations)
    return_also(terminator(new.operation.regions[1].blocks[0]), arguments)
    return new, arguments


def return_also(old_return: ir.Operation, values: Sequence[ir.Value]) -> None:
    """A block's terminator (``stablehlo.return``, ``func.return``) rebuilt with
    ``values`` appended; the old one is discarded."""
    ir.Operation.create(old_return.name, operands=[*old_return.operands, *values],
                        loc=old_return.location, ip=ir.InsertionPoint(old_return))
    discard(old_return)


def _grown(attributes: Any, name: str, count: int) -> ir.ArrayAttr | None:
    """``attributes[name]`` (an array of dicts) with ``count`` empty dicts appended;
    None when it is absent or nothing is added."""
    if not count or name not in attributes:
        return None
    return ir.ArrayAttr.get(list(ir.ArrayAttr(attributes[name]))
                            + [ir.DictAttr.get({})] * count)


def call_with_extra(call: Any, operands: Sequence[ir.Value],
                    result_types: Sequence[ir.Type] = ()) -> Any:
    """``call`` rebuilt with ``operands`` appended (and results of ``result_types``);
    its attributes kept, ``arg_attrs`` / ``res_attrs`` grown to match."""
    old = call.operation
    new = func_dialect.CallOp([*[r.type for r in old.results], *result_types],
                              ir.FlatSymbolRefAttr(old.attributes["callee"]),
                              [*old.operands, *operands], loc=old.location,
                              ip=ir.InsertionPoint(old))
    for attribute in old.attributes:
        new.operation.attributes[attribute] = old.attributes[attribute]
    for name, count in (("arg_attrs", len(operands)), ("res_attrs", len(result_types))):
        grown = _grown(old.attributes, name, count)
        if grown is not None:
            new.operation.attributes[name] = grown
    for index, result in enumerate(old.results):
        result.replace_all_uses_with(new.operation.results[index])
    discard(old)
    return new


def grow_signature(fn: Any, arguments: int = 0,
                   results: Sequence[ir.Type] = ()) -> None:
    """Make ``fn``'s function_type match its entry block's arguments (``arguments`` of
    them appended) with ``results`` appended to its results; ``arg_attrs`` /
    ``res_attrs`` grown to match."""
    old = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    set_function_type(fn, [*old.results, *results])
    for name, count in (("arg_attrs", arguments), ("res_attrs", len(results))):
        grown = _grown(fn.attributes, name, count)
        if grown is not None:
            fn.attributes[name] = grown
