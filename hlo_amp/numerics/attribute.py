"""``attribute``: the error each named scope contributes, measured per scope."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hlo_amp.numerics.measure import (
    ATOL,
    DELAYED_NOTE,
    Session,
    check_reference,
    check_tolerance,
    run_dtypes,
    tolerance,
)
from hlo_amp.numerics.render import json_number, short
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import Decision, Report, matplotlib_figure, text_table

TOP_LEVEL = "(top level)"


@dataclass(frozen=True)
class ScopeError:
    """The error one scope contributes: with only it in low precision, and with only it
    kept f32 (every other scope at the policy's precision)."""

    scope: str  # "block_0/attn"; "(top level)" for matrix ops outside any named scope
    ops: int  # dot/conv ops in the scope (forward and backward)
    flops: int
    only_low: float  # the error when only this scope runs at the policy's precision
    only_f32: float | None  # the error when only this scope is f32; None: no rule names it
    pattern: str | None  # the scope rule that names it; None for "(top level)"
    # What ranks it: max(only_low, error of the policy - only_f32). The error is a max
    # over elements, not a sum, so the two differ: a scope can do little alone and much
    # with the others (its f32 removes more than it adds alone), or much alone and little
    # when removed (another scope's error hides the gain); either way it counts.
    contribution: float = 0.0


@dataclass
class Attribution:
    """What ``attribute`` measured, scopes ranked by the error they contribute."""

    policy: str
    depth: int
    reference: str
    dtypes: list[str]
    rtol: float
    atol: float
    error: float  # the error of the policy as given (every scope low)
    scopes: list[ScopeError]  # worst first
    compiles: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def ranking(self) -> list[str]:
        return [row.scope for row in self.scopes]

    def to_dict(self) -> dict[str, Any]:
        return json_number({
            "policy": self.policy, "depth": self.depth, "reference": self.reference,
            "dtypes": self.dtypes, "rtol": self.rtol, "atol": self.atol,
            "error": self.error, "scopes": [asdict(row) for row in self.scopes],
            "compiles": self.compiles, "seconds": self.seconds, "notes": self.notes,
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        low = "/".join(self.dtypes) or "low"
        total = sum(row.flops for row in self.scopes) or 1
        rows = [(rank, row.scope, row.ops, f"{100 * row.flops / total:.0f}%",
                 short(row.only_low), short(row.only_f32), short(row.contribution))
                for rank, row in enumerate(self.scopes, 1)]
        title = (f"error per scope at depth {self.depth} under {self.policy} "
                 f"(against {self.reference}; error = max over outputs of "
                 f"(max|a-e| - {self.atol:g}) / max|e|; {low} tolerance {self.rtol:g})")
        lines = [title]
        lines += text_table(("rank", "scope", "ops", "FLOPs", f"only it {low}", "only it f32",
                         "contribution"), rows)
        lines.append(f"every scope {low}: error {short(self.error)}; "
                     f"{self.compiles} XLA compile(s), {self.seconds:.1f} s")
        lines += self.notes
        return "\n".join(lines)

    def plot(self, path: str | Path, budget: float | None = None) -> Path:
        """Write a PNG bar chart of the two errors per scope (needs matplotlib)."""
        return plot_attribution(self, path, budget)


def _segments(scope: str) -> tuple[str, ...]:
    return tuple(scope.split("/")) if scope else ()


# A scope's characters a glob reads as its own, each written as a class matching itself.
_GLOB_LITERALS = {"*": "[*]", "?": "[?]", "$": "[$]", "[": "[[]", "]": "[]]"}


def _pattern(group: str, depth: int) -> str | None:
    """The anchored pattern naming exactly ``group``'s ops, or None when no rule can
    (the top level, an empty segment, whitespace or ',', which a policy's scope
    pattern cannot hold).

    A leading '/' keeps it from matching further in (``head`` inside ``blocks/0/head``);
    a group shorter than ``depth`` holds only ops whose scope is exactly its segments,
    so a trailing '$' keeps it out of longer groups it prefixes (``head/dense``).
    """
    segments = group.split("/")
    if not group or any(ch.isspace() or ch == "," for ch in group) or "" in segments:
        return None
    # 'layer[1]' was refused (no rule), and autopolicy blamed "ops outside named scopes".
    globs = ["".join(_GLOB_LITERALS.get(ch, ch) for ch in seg) for seg in segments]
    return "/" + "/".join(globs) + ("$" if len(segments) < depth else "")


def _groups(report: Report, depth: Any) -> dict[str, list[Decision]]:
    """Decisions by the first ``depth`` segments of their scope ("" for top level)."""
    deepest = max((len(_segments(d.scope)) for d in report.decisions), default=0)
    # Without any named scope depth 1 is still a question: its one row is the top level.
    is_int = isinstance(depth, (int, np.integer)) and not isinstance(depth, bool)
    if not is_int or depth < 1 or (report.decisions and depth > max(deepest, 1)):
        example = max((d.scope for d in report.decisions), key=lambda s: len(_segments(s)),
                      default="")
        accepted = (f"an int from 1 to {deepest} (fn's deepest scope is {example!r})"
                    if deepest else "1 (fn's matrix ops have no named scope)"
                    if report.decisions else "an int >= 1")
        # depth="1" read "Unknown depth '1'; accepted: 1 to 1": name the type it has.
        given = repr(depth) if is_int else f"{depth!r} (a {type(depth).__name__})"
        raise ValueError(f"Unknown depth {given}; accepted: {accepted}")
    groups: dict[str, list[Decision]] = {}
    for d in report.decisions:
        groups.setdefault("/".join(_segments(d.scope)[:int(depth)]), []).append(d)
    return groups


def with_scopes(base: Policy, rules: Mapping[str, str]) -> Policy:
    """``base`` with ``rules`` written before its own scope rules, so that of two
    patterns matching at the same segment with as many parts, ``rules``' wins."""
    scopes = dict(rules)
    for pattern, action in base.scopes.items():
        scopes.setdefault(pattern, action)
    return Policy.from_dict({**base.to_dict(), "scopes": scopes})


def attribution_of(session: Session, base: Policy, depth: Any, reference: str, atol: float
                   ) -> Attribution:
    """``attribute`` within ``session``, whose executables ``autopolicy`` reuses."""
    report = session.report(base)
    groups = _groups(report, depth)  # a bad depth fails here, before any compile
    patterns = {g: p for g in groups if (p := _pattern(g, int(depth))) is not None}
    notes: list[str] = []
    base_error = session.error(base, reference, atol)
    rows = []
    for group, decisions in groups.items():
        others = {patterns[h]: "float32" for h in patterns if h != group}
        only_low = session.error(with_scopes(base, others), reference, atol)
        only_f32 = None
        pattern = patterns.get(group)
        if pattern is not None:
            only_f32 = session.error(with_scopes(base, {pattern: "float32"}), reference,
                                     atol)
        removed = 0.0 if only_f32 is None else base_error - only_f32
        rows.append(ScopeError(group or TOP_LEVEL, len(decisions),
                               sum(d.flops or 0 for d in decisions), only_low, only_f32,
                               pattern, max(only_low, removed)))
    # Worst first; of equal contributions the one whose f32 helps most, then the smaller.
    rows.sort(key=lambda r: (-r.contribution,
                             math.inf if r.only_f32 is None else r.only_f32, r.flops))
    if not report.decisions:
        notes.append("note: fn has no dot_general or convolution op: there is nothing to "
                     "attribute, and the policy's error is zero")
    unnamed = [row.scope for row in rows if row.pattern is None]
    if unnamed:
        notes.append(f"note: {', '.join(repr(s) for s in unnamed)}: no scope rule can name "
                     f"these ops (outside any jax.named_scope, or a scope name with "
                     f"whitespace or ','), so they stay at the policy's precision in every "
                     f"other row and autopolicy cannot keep them f32")
    if base.scaling == "delayed" and base.uses_fp8:
        notes.append(DELAYED_NOTE)
    notes += session.reference_notes(reference)
    dtypes = run_dtypes(report, base)
    attribution = Attribution(base.to_string(), int(depth), reference, dtypes,
                              tolerance(dtypes), atol, base_error, rows,
                              session.compiles, session.seconds, notes)
    return attribution


def attribute(fn: Callable[..., Any], policy: Policy | str | Mapping[str, Any], *args: Any,
              depth: int = 1, reference: str = "f32", atol: float = ATOL) -> Attribution:
    """For every scope at ``depth`` of the report's name stacks, the error of ``fn``'s
    outputs when only that scope runs under ``policy`` and when only it is kept f32;
    scopes ranked by the first (what they contribute). Costs ``2 * scopes + 2`` XLA
    compiles at most, one per distinct policy, each on a copy of one lowering."""
    policy = as_policy(policy)
    reference = check_reference(reference)
    atol = check_tolerance(atol, "atol", zero_ok=True)
    session = Session(fn, args, "attribute")
    return attribution_of(session, policy, depth, reference, atol)


def plot_attribution(attribution: Attribution, path: str | Path, budget: float | None = None
                     ) -> Path:
    """Write a PNG bar chart of the two errors per scope (needs matplotlib)."""
    figure_type = matplotlib_figure("Attribution.plot")
    import matplotlib.ticker

    if budget is not None:
        budget = check_tolerance(budget, "budget", zero_ok=False)
    rows = list(reversed(attribution.scopes))  # worst on top
    positive = [v for row in rows for v in (row.only_low, row.only_f32, attribution.error)
                if v and math.isfinite(v)] or [1e-7]
    # Bars start a decade below the smallest error (and the budget), so a zero error,
    # drawn as a stub labelled 0, stays shorter than every real one (at the smallest's
    # decade, its stub outgrew a real 1.36e-3).
    left = 10 ** (math.floor(math.log10(min(positive + ([budget] if budget else [])))) - 1)
    floor = 1.5 * left
    # An infinite (overflowed) or NaN error is drawn past every finite one and the budget.
    cap = 10 * max(positive + ([budget] if budget and math.isfinite(budget) else []))

    def bar(value: float | None) -> float:
        if value is None or value == 0:
            return floor
        return value if math.isfinite(value) else cap

    low = "/".join(attribution.dtypes) or "low"
    fig = figure_type(figsize=(7, 0.45 * len(rows) + 2.2))
    ax = fig.add_subplot()
    y = np.arange(len(rows))
    ax.barh(y + 0.2, [bar(r.only_low) for r in rows], 0.4, label=f"only this scope {low}")
    ax.barh(y - 0.2, [bar(r.only_f32) for r in rows], 0.4, label="only this scope f32")
    for offset, values in ((0.2, [r.only_low for r in rows]), (-0.2, [r.only_f32 for r in rows])):
        for row, value in zip(y, values):
            if value is not None and not math.isfinite(value):
                ax.text(cap, row + offset, f" {value}", va="center", fontsize=7)
            elif value == 0:
                ax.text(floor, row + offset, " 0", va="center", fontsize=7)
    error = attribution.error
    unbounded = error is not None and not math.isfinite(error)
    ax.axvline(bar(error), color="k", ls="--", lw=1,
               label=f"every scope {low}" + (f" ({error})" if unbounded else ""))
    if budget is not None:
        ax.axvline(budget, color="r", ls=":", lw=1, label="budget")
    ax.set_yticks(y, [r.scope for r in rows])
    ax.set_xscale("log")
    ax.set_xlim(left=left, right=cap * 10)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # they overlap
    ax.set_xlabel(f"error (max over outputs, scaled; against {attribution.reference})")
    ax.set_title(f"error per scope at depth {attribution.depth}, {attribution.policy}",
                 fontsize=9)
    # Below the axis label, in a band of its own (under the axes it covered the label).
    height = fig.get_figheight()
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.6 / height, 1, 1))
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out
