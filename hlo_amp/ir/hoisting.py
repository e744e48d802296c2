"""The rounds hoist_amax and hoist_quantize run: what a private function computes from
its arguments moves to its call sites, until it reaches a loop body, then out of the
loop. Each round matches the module afresh, since a lift rebuilds the call sites."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import erase_discarded, function_name, functions, walk_operations

# (module, the module's ops, the matches) -> how many moved to call sites
Lift = Callable[[ir.Module, list[ir.Operation], list[Any]], int]
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
    lifted = lift(module, ops, found)
    if lifted:  # the call sites changed: match again next round
        return lifted, 0
    return 0, hoist(found, {function_name(fn): fn for fn in functions(module)})
