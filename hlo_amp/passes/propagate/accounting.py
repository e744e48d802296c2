"""What the pass reports: ops painted per kind, and bytes of intermediates per function."""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import function_name, functions
from hlo_amp.ir.op_classes import ALLOW
from hlo_amp.passes.propagate.body import F32, FLOAT, NOT_VALUE_OPS, Body, type_kind, walk_once
from hlo_amp.passes.propagate.graph import LINK, Graph
from hlo_amp.passes.propagate.solve import NOT_BETWEEN


def op_counts(graph: Graph) -> dict[str, dict[str, Any]]:
    """Per op kind: painted, and why the rest stayed f32 (one count per instance)."""
    table: dict[str, dict[str, Any]] = {}
    for node in graph.nodes:
        if node.cls == LINK or not node.has_f32:
            continue
        row = table.setdefault(node.kind, {"painted": 0, "f32": {}})
        if node.painted:
            row["painted"] += 1
        else:
            reason = node.reason or ("matrix result read by f32 ops"
                                     if node.cls == ALLOW else NOT_BETWEEN)
            row["f32"][reason] = row["f32"].get(reason, 0) + 1
    return dict(sorted(table.items()))


def intermediate_bytes(module: ir.Module, walks: dict[int, Body] | None = None
                       ) -> dict[str, tuple[int, int]]:
    """Per function: (bytes, 16-bit-or-narrower bytes) of the float values its ops make.

    Converts, constants and control-flow results are left out: they hold no new
    activation. Dynamic shapes count as zero.
    """
    walks = {} if walks is None else walks
    sizes: dict[ir.Type, tuple[int, int]] = {}  # type -> (bytes, 16-bit bytes)
    table: dict[str, tuple[int, int]] = {}
    for fn in functions(module):
        total = low = 0
        body = walk_once(fn, walks)
        for name, results in zip(body.names, body.results()):
            if name in NOT_VALUE_OPS:
                continue
            for result in results:
                result_type = result.type  # read again: the rewrite retypes values
                size = sizes.get(result_type)
                if size is None:
                    size = sizes[result_type] = _float_bytes(result_type)
                total += size[0]
                low += size[1]
        table[function_name(fn)] = (total, low)
    return table


def _float_bytes(value_type: ir.Type) -> tuple[int, int]:
    """(bytes, bytes if 16-bit or narrower) of a static float tensor type, else zeros."""
    if type_kind(value_type) not in (F32, FLOAT):
        return 0, 0
    ranked = ir.RankedTensorType(value_type)
    if not ranked.has_static_shape:
        return 0, 0
    width = ir.FloatType(ranked.element_type).width
    size = 1
    for extent in ranked.shape:
        size *= extent
    nbytes = size * width // 8
    return nbytes, nbytes if width <= 16 else 0


def bytes_table(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
                ) -> list[dict[str, Any]]:
    """The report's rows: per function after the pass, its bytes before and after (a
    clone is compared with the function it was cloned from)."""
    rows = []
    for name, (total, low) in after.items():
        old_total, old_low = before.get(name, before.get(name.rsplit("_mixed", 1)[0], (0, 0)))
        rows.append({"function": name, "bytes_before": old_total, "low_bytes_before": old_low,
                     "bytes_after": total, "low_bytes_after": low})
    return rows
