"""What XLA kept: match the report's converted ops to the dots in XLA's optimized HLO.

Both sides are named by JAX's name stack (the report by the op's location, XLA by the
``op_name`` metadata), but XLA's names differ in three ways that the matching undoes:

* segments for calls the StableHLO location does not carry: ``closed_call`` after a
  ``while/body`` (scan and fori bodies are private functions), ``jit(inner)`` for an
  inner ``jax.jit``, and the outer ``jit(f)`` that ``hlo-amp-opt`` inputs may lack;
* the last segment: a dot whose result XLA transposes takes the transpose's name
  (``…/dense/transpose``), so ops are matched by scope, not by op name;
* counts: XLA merges equal dots (the recomputed forward of a ``remat``) and drops dead
  ones, so a scope can hold fewer dots than the report. Those decisions stay unknown
  (``None``) rather than being guessed.
"""

from __future__ import annotations

import dataclasses
import re

from hlo_amp.report import Report

_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[")
_HLO_MATMUL = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[[^\]]*\][^ ]*\s+(dot|convolution)\(([^)]*)\)"
)
# One operand: "%x", or "bf16[2,3]{1,0} %x" (commas inside brackets are not separators).
_OPERAND = re.compile(r"(?:\w+\[[^\]]*\](?:\{[^}]*\})?\s+)?%?[\w.\-]+")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LOW_TYPES = ("bf16", "f16", "f8")
# Name-stack segments one side has and the other may not (see the module docstring).
_CALL_SEGMENT = re.compile(r"^(?:closed_call|core_call|p?jit\(.*\))$")

UNMATCHED = "no dot of its scope left in XLA's HLO (merged or removed)"
MERGED = "XLA merged or removed some dots of its scope"


def xla_matmuls(hlo_text: str) -> list[tuple[str, bool]]:
    """(op_name, computes in 16-bit or narrower) for each dot/conv in optimized HLO."""
    types: dict[str, str] = {}
    for line in hlo_text.splitlines():
        match = _HLO_DEF.match(line)
        if match:
            types[match.group(1)] = match.group(2)
    found = []
    for line in hlo_text.splitlines():
        match = _HLO_MATMUL.match(line)
        if not match:
            continue
        operands = []
        for operand in _OPERAND.findall(match.group(2)):
            inline = re.match(r"^(\w+)\[", operand)  # "bf16[2,3]{1,0} %x" form
            name = operand.split()[-1].lstrip("%")
            operands.append(inline.group(1) if inline else types.get(name, "?"))
        op_name = _OP_NAME.search(line)
        low = bool(operands) and all(t.startswith(_LOW_TYPES) for t in operands)
        found.append((op_name.group(1) if op_name else "", low))
    return found


def scope_key(name: str) -> str:
    """A name stack without call segments and without its last (op name) segment."""
    segments = [s for s in name.split("/") if s and not _CALL_SEGMENT.match(s)]
    return "/".join(segments[:-1])


def mark_kept_by_xla(report: Report, hlo_text: str) -> None:
    """Fill ``kept_by_xla`` for each converted decision from XLA's optimized HLO.

    Per scope, the report's converted 16-bit ops are compared with XLA's dots: as many as
    XLA runs in 16 bit are kept (True); when XLA has every op of the scope, the rest were
    upcast (False); when it has fewer (merged or dead), the rest stay unknown (None), and
    ``report.unknown_reasons`` counts why.
    """
    xla_by_scope: dict[str, list[bool]] = {}
    for op_name, low in xla_matmuls(hlo_text):
        xla_by_scope.setdefault(scope_key(op_name), []).append(low)
    converted: dict[str, list[int]] = {}
    total: dict[str, int] = {}
    for index, decision in enumerate(report.decisions):
        key = scope_key(decision.location)
        total[key] = total.get(key, 0) + 1
        if decision.low_precision and decision.changed:
            converted.setdefault(key, []).append(index)
    unknown: dict[str, int] = {}
    for key, indices in converted.items():
        matches = xla_by_scope.get(key)
        if matches is None:  # a location without its caller's prefix (hlo-amp-opt inputs)
            matches = [low for name, lows in xla_by_scope.items()
                       if key and name.endswith("/" + key) for low in lows]
        if not matches:
            unknown[UNMATCHED] = unknown.get(UNMATCHED, 0) + len(indices)
            continue
        kept = min(sum(matches), len(indices))
        complete = len(matches) >= total[key]
        for rank, index in enumerate(indices):
            verdict = True if rank < kept else (False if complete else None)
            report.decisions[index] = dataclasses.replace(
                report.decisions[index], kept_by_xla=verdict)
        if not complete and len(indices) > kept:
            unknown[MERGED] = unknown.get(MERGED, 0) + len(indices) - kept
    report.unknown_to_xla = unknown
    report.xla_checked = True
