"""``autopolicy``: the policy with the fewest f32 scopes whose error meets a budget."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hlo_amp.numerics.attribute import Attribution, ScopeError, attribution_of, with_scopes
from hlo_amp.numerics.fastest import (
    DEFAULT_MAX_COMPILES,
    TargetAutoPolicy,
    check_fp8_scaling,
    resolve_fp8_scaling,
    target_autopolicy,
)
from hlo_amp.numerics.measure import (
    ATOL,
    DELAYED_NOTE,
    Session,
    check_reference,
    check_tolerance,
)
from hlo_amp.numerics.render import json_number, short
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import text_table
from hlo_amp.targets import Target


@dataclass(frozen=True)
class Trial:
    """One policy autopolicy compiled and compared."""

    policy: str
    f32_scopes: tuple[str, ...]
    error: float
    predicted: float | None  # what the attribution predicted for it
    met: bool


@dataclass
class AutoPolicy:
    """What ``autopolicy`` chose, and how."""

    policy: Policy  # paste str(policy) into a config
    budget: float
    error: float  # the chosen policy's error, confirmed by a compare
    met: bool
    f32_scopes: list[str]
    trail: list[Trial]
    attribution: Attribution
    compiles: int  # every XLA compile of the call, the attribution's included
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return json_number({
            "policy": self.policy.to_string(), "budget": self.budget, "error": self.error,
            "met": self.met, "f32_scopes": self.f32_scopes,
            "trail": [asdict(t) for t in self.trail], "compiles": self.compiles,
            "seconds": self.seconds, "notes": self.notes,
            "attribution": self.attribution.to_dict(),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        rows = [(i, ", ".join(t.f32_scopes) or "(none)", short(t.predicted), short(t.error),
                 "yes" if t.met else "no") for i, t in enumerate(self.trail)]
        lines = [f"autopolicy: budget {self.budget:g} (error = max over outputs, against "
                 + f"{self.attribution.reference})"]
        lines += text_table(("try", "f32 scopes", "predicted", "error", "within"), rows)
        state = "within" if self.met else "NOT within"
        lines.append(f"chosen ({len(self.f32_scopes)} f32 scope(s), error "
                     f"{short(self.error)}, {state} budget): {self.policy.to_string()}")
        lines.append(f"{self.compiles} XLA compile(s) in all ({self.attribution.compiles} "
                     f"for the attribution), {self.seconds:.1f} s")
        lines += self.notes
        return "\n".join(lines)


def _predictions(attribution: Attribution, named: list[ScopeError]) -> list[float]:
    """Predicted error with the first k ranked scopes f32, for k = 0..len(named).

    k = 0 and k = 1 were measured. Beyond, rounding errors of independent scopes add
    roughly in quadrature: the square root of the summed squares of the remaining
    contributions, scaled so that k = 0 gives the measured error of the policy as given.
    """
    rest = [row.contribution for row in attribution.scopes if row.pattern is None]
    low = [row.contribution for row in named]
    out = []
    for k in range(len(low) + 1):
        remaining = low[k:] + rest
        if any(math.isinf(v) for v in remaining):
            out.append(math.inf)
            continue
        out.append(math.sqrt(sum(v * v for v in remaining)))
    total, error = out[0], attribution.error
    if math.isfinite(total) and total > 0 and math.isfinite(error):
        out = [v * error / total for v in out]
    out[0] = error
    if named and named[0].only_f32 is not None:
        out[1] = named[0].only_f32
    return out


def autopolicy(fn: Callable[..., Any], *args: Any, budget: float, depth: int = 1,
               base: Policy | str | Mapping[str, Any] = "bf16", reference: str = "f32",
               atol: float = ATOL, target: str | Target | None = None,
               max_compiles: int = DEFAULT_MAX_COMPILES, progress: bool = True,
               fp8_scaling: str | None = None) -> AutoPolicy | TargetAutoPolicy:
    """The policy with the fewest f32 scopes at ``depth`` whose error stays within
    ``budget`` (then the most FLOPs at ``base``'s precision).

    With ``target`` (``"h100"``, ``"tpu-v5e"``, any device ``lower(target=...)``
    takes): the policy whose step, compiled for that device without it, the roofline
    models fastest, choosing per scope f32, ``base``'s compute dtype or fp8 (where the
    device runs fp8 GEMMs), with the error measured here within ``budget``: a
    ``TargetAutoPolicy`` (hlo_amp/numerics/fastest.py has the search). At most
    ``max_compiles`` XLA compiles, here and for the device together; ``progress``
    writes a progress line on stderr. ``fp8_scaling`` ("current" or "delayed", with
    ``target`` only; by default the base's) is the scaling of the fp8 policies the
    search prices: "delayed" compiles each with its amax history, as it runs (the error
    is measured with current scaling, which a filled history approaches).

    ``budget`` bounds ``Comparison.error``: every float output leaf within
    ``atol + budget * max|e|`` of ``reference``. One scope is enough when one of the
    attribution's "only it f32" runs is within budget: the one with the fewest FLOPs is
    chosen. Otherwise scopes are taken f32 in ``attribute``'s order; the attribution
    predicts how many are needed, and compiles confirm it, stepping one scope up or down
    until the fewest that pass are found.
    """
    budget = check_tolerance(budget, "budget", zero_ok=False)
    policy = as_policy(base)
    reference = check_reference(reference)
    atol = check_tolerance(atol, "atol", zero_ok=True)
    fp8_scaling = check_fp8_scaling(fp8_scaling)
    if target is not None:
        return target_autopolicy(fn, args, budget=budget, depth=depth, base=policy,
                                 reference=reference, atol=atol, target=target,
                                 max_compiles=max_compiles, progress=progress,
                                 fp8_scaling=fp8_scaling)
    base_scaling = policy.scaling if policy.uses_fp8 else "current"
    if fp8_scaling is not None and resolve_fp8_scaling(fp8_scaling, policy) != base_scaling:
        raise ValueError(f"fp8_scaling={fp8_scaling!r} prices fp8 on a device: give "
                         "target= too (without it autopolicy keeps base's precision, "
                         "no fp8 level)")
    session = Session(fn, args, "autopolicy")
    attribution = attribution_of(session, policy, depth, reference, atol)
    named = [row for row in attribution.scopes if row.pattern is not None]
    predicted = _predictions(attribution, named)
    trail = [Trial(policy.to_string(), (), attribution.error, predicted[0],
                   attribution.error <= budget)]
    # by how many scopes are f32: the policy, its error, those scopes
    tried: dict[int, tuple[Policy, float, list[ScopeError]]] = {
        0: (policy, attribution.error, [])}
    passed = {0: attribution.error <= budget}

    def attempt(rows: list[ScopeError], guess: float | None) -> bool:
        rules = {row.pattern: "float32" for row in rows}
        candidate = with_scopes(policy, rules)
        error = session.error(candidate, reference, atol)
        trail.append(Trial(candidate.to_string(), tuple(r.scope for r in rows), error,
                           guess, error <= budget))
        tried[len(rows)] = (candidate, error, rows)
        passed[len(rows)] = error <= budget
        return error <= budget

    singles = [row for row in named if row.only_f32 is not None and row.only_f32 <= budget]
    if not passed[0] and singles:  # measured already: the cheapest in FLOPs that passes
        pick = min(singles, key=lambda row: (row.flops, row.only_f32))
        attempt([pick], pick.only_f32)  # the attribution's executable, from the cache
    elif not passed[0] and named:
        # No single scope is enough (the attribution measured each): the first ranked
        # one alone, from the cache, starts the trail.
        attempt(named[:1], predicted[1])
        k = next((k for k, p in enumerate(predicted) if p <= budget and k > 1), len(named))
        while k not in passed:
            if attempt(named[:k], predicted[k]):
                k -= 1  # try one fewer, unless it failed already
            elif any(passed[j] for j in passed if j > k) or k == len(named):
                break
            else:
                k += 1
    notes = session.reference_notes(reference)
    within = [k for k in tried if passed[k]]
    candidate, error, rows = tried[min(within) if within else max(tried)]
    floor = session.f32_floor_note(budget, reference, atol) if error > budget else None
    if floor is not None:  # "name the remaining ops" cannot help there
        notes.append(floor)
    elif error > budget:
        notes.append(
            f"note: no policy with f32 scopes at depth {depth} meets budget {budget:g}: "
            f"with all {len(named)} f32 the error is {short(error)} (ops outside named "
            f"scopes, or the policy's activations, still run in low precision); raise the "
            f"budget, go deeper, or name the remaining ops")
    notes += [n for n in attribution.notes if "no dot_general" in n or n == DELAYED_NOTE]
    return AutoPolicy(candidate, budget, error, error <= budget, [r.scope for r in rows],
                      trail, attribution, session.compiles, session.seconds, notes)
