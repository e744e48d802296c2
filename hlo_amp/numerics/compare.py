"""``compare``: a function's outputs under a policy against f32 (as written) or f64."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hlo_amp.numerics.measure import (
    ATOL,
    DELAYED_NOTE,
    LeafError,
    Session,
    check_reference,
    check_tolerance,
    leaf_errors,
    run_dtypes,
    tolerance,
    worst,
)
from hlo_amp.numerics.render import json_number, short
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import Report, text_table
from hlo_amp.rewrite import warn_unused_rules

# f32 and f64 runs further apart than this (scaled) get a note: the output is
# ill-conditioned, or fn computes something else in f64.
_F64_AGREES = 1e-3


@dataclass
class Comparison:
    """What ``compare`` measured: one ``LeafError`` per output leaf."""

    policy: str
    reference: str  # "f32" (fn as written) or "f64"
    dtypes: list[str]  # element types below f32 the policy computes in ([] = none)
    rtol: float
    atol: float
    leaves: list[LeafError]
    compiles: int  # XLA compiles this call made (cached executables are not recompiled)
    seconds: float
    notes: list[str] = field(default_factory=list)
    report: Report | None = None  # the pass's report for the policy

    @property
    def error(self) -> float:
        """The smallest rtol every float leaf passes with."""
        return worst(self.leaves)

    @property
    def ok(self) -> bool:
        return all(leaf.ok for leaf in self.leaves if leaf.ok is not None)

    def to_dict(self) -> dict[str, Any]:
        return json_number({
            "policy": self.policy, "reference": self.reference, "dtypes": self.dtypes,
            "rtol": self.rtol, "atol": self.atol, "error": self.error, "ok": self.ok,
            "compiles": self.compiles, "seconds": self.seconds, "notes": self.notes,
            "leaves": [asdict(leaf) for leaf in self.leaves],
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        f64 = any(leaf.f32_vs_f64 is not None for leaf in self.leaves)
        header = ["leaf", "shape", "dtype", "max abs", "max rel", "rms", "ok"]
        if f64:
            header += ["policy vs f64", "f32 vs f64"]
        rows = []
        for leaf in self.leaves:
            shape = "x".join(map(str, leaf.shape)) or "()"
            ok = "-" if leaf.ok is None else ("yes" if leaf.ok else "NO")
            row = [leaf.name, shape, leaf.dtype, short(leaf.max_abs), short(leaf.max_rel),
                   short(leaf.rms), ok if not leaf.note else leaf.note]
            if f64:
                row += [short(leaf.policy_vs_f64), short(leaf.f32_vs_f64)]
            rows.append(row)
        dtype = "/".join(self.dtypes) or "f32"
        lines = [f"policy {self.policy} against {self.reference} ({dtype}: "
                 + f"|a-e| <= {self.atol:g} + {self.rtol:g}*max|e|)", *text_table(header, rows)]
        verdict = "within" if self.ok else "OUTSIDE"
        # An rtol given to compare is no dtype's tolerance (it said "the bf16 tolerance").
        which = (f"the {dtype} tolerance" if self.rtol == tolerance(self.dtypes)
                 else f"the tolerance asked for (rtol {self.rtol:g})")
        lines.append(f"error {short(self.error)}: {verdict} {which}; "
                     f"{self.compiles} XLA compile(s), {self.seconds:.2f} s")
        lines += self.notes
        return "\n".join(lines)


def compare(fn: Callable[..., Any], policy: Policy | str | Mapping[str, Any], *args: Any,
            reference: str = "f32", f64: bool = True, rtol: float | None = None,
            atol: float = ATOL) -> Comparison:
    """Run ``fn(*args)`` as written (f32), under ``policy`` and (``f64=True``) in f64,
    and measure each output leaf's error against ``reference`` ("f32" or "f64").

    The verdict is ``max|a - e| <= atol + rtol * max|e|`` per float leaf, ``rtol`` by
    default the loosest of the dtypes the policy computes in (``RTOL``). ``fn`` takes
    positional arguments only (bind others with ``functools.partial``).
    """
    policy = as_policy(policy)
    reference = check_reference(reference)
    atol = check_tolerance(atol, "atol", zero_ok=True)
    if rtol is not None:
        rtol = check_tolerance(rtol, "rtol", zero_ok=False)
    session = Session(fn, args, "compare")
    got, report = session.run(policy)
    warn_unused_rules(report)
    dtypes = run_dtypes(report, policy)
    rtol = tolerance(dtypes) if rtol is None else rtol
    f32 = session.run(None)[0]
    notes = []
    f64_outputs = session.run_f64() if f64 or reference == "f64" else None
    leaves = leaf_errors(session, got, session.reference(reference), rtol, atol)
    if f64_outputs is not None:
        vs_policy = (leaves if reference == "f64"
                     else leaf_errors(session, got, f64_outputs, rtol, atol))
        vs_f32 = leaf_errors(session, f32, f64_outputs, rtol, atol)
        leaves = [replace(leaf, f32_vs_f64=floor.max_rel, policy_vs_f64=mine.max_rel)
                  for leaf, mine, floor in zip(leaves, vs_policy, vs_f32)]
        apart = max((leaf.max_rel or 0.0 for leaf in vs_f32), default=0.0)
        if apart > _F64_AGREES:
            notes.append(
                f"note: the f32 run is {apart:.2e} (max rel) from the f64 run: an "
                f"ill-conditioned output (values that cancel), or fn computes something "
                f"else in f64 (random bits drawn in the default float dtype, as dropout "
                f"does, or dtypes pinned to f32)")
    elif session.f64_note:
        notes.append(f"note: {session.f64_note}")
    notes += session.reference_notes("f64" if f64_outputs is not None else reference)
    if not report.decisions:
        notes.append("note: fn has no dot_general or convolution op: the policy rewrites "
                     "nothing, and the outputs are those of fn as written")
    elif not dtypes:
        notes.append("note: the policy converts none of fn's matrix ops to a narrower type")
    if policy.scaling == "delayed" and policy.uses_fp8:
        notes.append(DELAYED_NOTE)
    return Comparison(policy.to_string(), reference, dtypes, rtol, atol, leaves,
                      session.compiles, session.seconds, notes, report)
