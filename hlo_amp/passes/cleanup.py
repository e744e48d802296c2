"""Clean up converts: fold lossless round trips, merge duplicates, drop dead ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from hlo_amp.modules import element_type, functions, walk_ops
from hlo_amp.report import Report

# (narrow, wide) float pairs where narrow -> wide -> narrow gives back every value.
_LOSSLESS_WIDENINGS = {
    ("bf16", "f32"), ("bf16", "f64"), ("f16", "f32"), ("f16", "f64"), ("f32", "f64"),
}


def _element(value: ir.Value) -> str:
    return str(element_type(value) or "")


def _converts(module: ir.Module) -> list[Any]:
    return [op for fn in functions(module) for op in walk_ops(fn)
            if isinstance(op, hlo.ConvertOp)]


@dataclass(frozen=True)
class CleanupConverts:
    """Fold ``convert(convert(x: A) -> B) -> A`` when A -> B is lossless; share converts."""

    name: str = "hlo-amp-cleanup"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        folded = merged = 0
        seen: dict[tuple[Any, Any, str], Any] = {}
        for convert in _converts(module):
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
                merged += 1
            else:
                seen.setdefault(key, convert)
        removed = _erase_dead_converts(module)
        if report is not None and (folded or merged):
            report.notes.append(
                f"cleanup: folded {folded} round-trip convert(s), merged {merged}, "
                f"erased {removed} dead"
            )


def _erase_dead_converts(module: ir.Module) -> int:
    # Consumers follow their producers in program order, so one backward sweep also
    # catches a convert that only fed a convert erased just before.
    removed = 0
    for convert in reversed(_converts(module)):
        if not list(convert.result.uses):
            convert.operation.erase()
            removed += 1
    return removed
