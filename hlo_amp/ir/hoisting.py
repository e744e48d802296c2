"""The rounds hoist_amax and hoist_quantize run: what a private function computes from
its arguments moves to its call sites, until it reaches a loop body, then out of the
loop. Each round matches the module afresh, since a lift rebuilds the call sites."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    erase_discarded,
    function_name,
    functions,
    walk_operations,
    with_element,
)

# (module, the module's ops, the matches, its functions by name) -> how many moved to
# call sites
Lift = Callable[[ir.Module, list[ir.Operation], list[Any], dict[str, Any]], int]
# (the matches, the module's functions by name) -> how many left their loops
Hoist = Callable[[list[Any], dict[str, Any]], int]


def hoist_rounds(module: ir.Module, pass_name: str, match: Callable[[ir.Operation], Any],
                 lift: Lift, hoist: Hoist) -> int:
    """Rounds of one lift to call sites, or else one hoist out of every loop, of what
    ``match`` finds (None: nothing), until a round does neither; what each round
    discarded is erased after it. Returns how many hoists."""
    hoisted = 0
    with module.context, ir.Location.unknown():
        while True:
            lifted, moved = _round(module, match, lift, hoist)
            erase_discarded(pass_name)
            hoisted += moved
            if not lifted and not moved:
                return hoisted


def _round(module: ir.Module, match: Callable[[ir.Operation], Any], lift: Lift,
           hoist: Hoist) -> tuple[int, int]:
    ops = [op for fn in functions(module) for op in walk_operations(fn)]
    found = [m for m in map(match, ops) if m is not None]
    if not found:
        return 0, 0
    by_name = {function_name(fn): fn for fn in functions(module)}
    lifted = lift(module, ops, found, by_name)
    if lifted:  # the call sites changed: match again next round
        return lifted, 0
    return 0, hoist(found, by_name)


def source_through_converts(value: ir.Value, block: ir.Block
                            ) -> tuple[ir.Value, list[ir.Operation]]:
    """``value`` followed back, within ``block``, through converts and jax's remat
    ``optimization_barrier`` (a weight is the same before it): the value they start from
    and the converts passed, the last one first."""
    converts: list[ir.Operation] = []
    while not isinstance(value, ir.BlockArgument) and value.owner.operation.block == block:
        op = value.owner.operation
        if op.name == "stablehlo.convert":
            converts.append(op)
            value = op.operands[0]
        elif op.name == "stablehlo.optimization_barrier":
            value = op.operands[ir.OpResult(value).result_number]
        else:
            break
    return value, converts


def converted(value: ir.Value, elements: Sequence[ir.Type]) -> ir.Value:
    """``value`` converted to each element type of ``elements`` in turn, at the current
    insertion point (what ``source_through_converts`` passed, rebuilt on another value)."""
    for element in elements:
        value = hlo.convert(with_element(value.type, element), value)
    return value
