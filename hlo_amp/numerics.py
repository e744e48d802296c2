"""Numerics you can see: ``compare``, ``attribute`` and ``autopolicy``.

``compare`` runs a function as written (f32), under a policy and in f64, and measures the
error of every output leaf; ``attribute`` measures it per scope of the report;
``autopolicy`` finds the policy with the fewest f32 scopes whose error stays within a
budget. All three lower the function once and, per candidate policy, copy the module,
run the pass pipeline on the copy and compile it: an executable per policy string, cached
per function and input signature, so a later call reuses what an earlier one compiled.

Errors are measured in the scaled form: a leaf passes when
``max|a - e| <= atol + rtol * max|e|`` (element-wise tolerances fail every 16-bit dot
whose result cancels to ~0). A result's ``error`` is the smallest ``rtol`` every float
leaf passes with, ``max((max|a - e| - atol)+ / max|e|)``, which is what a budget bounds.
"""

from __future__ import annotations

import json
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hlo_amp.policy import DTYPE_TO_ELEMENT, Policy, as_policy, match_start
from hlo_amp.report import Decision, Report, matplotlib_figure, text_table
from hlo_amp.rewrite import warn_unused_rules
from hlo_amp.runtime.compile import (
    AmpFunction,
    leaf_signature,
    lowering_target,
    rewrite_lowered,
)

ATOL = 1e-5
# rtol per element type a run computes in: torch.testing's for f32, bf16 and f16; fp8 and
# fp4 twice their unit roundoff, as torch's f16 tolerance is. Matched by prefix, so
# "f8E4M3" covers f8E4M3FN and f8E4M3FNUZ.
RTOL = {"f32": 1.3e-6, "bf16": 1.6e-2, "f16": 1e-3, "f8E3M4": 6.25e-2, "f8E4M3": 1.25e-1,
        "f8E5M2": 2.5e-1, "f4E2M1": 5e-1}
REFERENCES = ("f32", "f64")
TOP_LEVEL = "(top level)"
# f32 and f64 runs further apart than this (scaled) get a note: the output is
# ill-conditioned, or fn computes something else in f64.
_F64_AGREES = 1e-3
_CACHE_PER_SIGNATURE = 64  # executables kept per function and input signature


# ---- one lowering, many rewrites --------------------------------------------------------


class _Lowering:
    """``fn`` lowered once for one input signature; executables cached per policy."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        # No reference to fn is kept: the cache is weakly keyed by it.
        self.lowered = jax.jit(fn).trace(*args).lower()
        self.target = lowering_target(self.lowered)
        # policy string ("" = as written, "f64") -> (executable, report or None)
        self.executables: OrderedDict[str, tuple[Any, Report | None]] = OrderedDict()
        self.rewrites: OrderedDict[str, tuple[Any, Report]] = OrderedDict()
        self.compiles = 0

    def report(self, policy: Policy) -> Report:
        """The pass's report for ``policy``, without compiling."""
        compiled = self.executables.get(policy.to_string())
        return compiled[1] if compiled is not None else self.rewrite(policy)[1]

    def rewrite(self, policy: Policy) -> tuple[Any, Report]:
        """A copy of the module rewritten under ``policy``, and its report (kept until
        it is compiled)."""
        key = policy.to_string()
        found = self.rewrites.get(key)
        if found is None:
            rewritten, report, _ = rewrite_lowered(self.lowered, policy, self.target)
            found = (rewritten, report)
            _keep(self.rewrites, key, found)
        return found

    def executable(self, policy: Policy | None) -> tuple[Any, Report | None]:
        key = "" if policy is None else policy.to_string()
        found = self.executables.get(key)
        if found is not None:
            self.executables.move_to_end(key)
            return found
        if policy is None:
            found = (self.lowered.compile(), None)
        else:
            rewritten, report = self.rewrite(policy)
            found = (rewritten.compile(), report)
            del self.rewrites[key]  # the executable has what the module was kept for
        self.compiles += 1
        _keep(self.executables, key, found)
        return found

    def f64_executable(self, fn: Callable[..., Any], args64: tuple) -> Any:
        """``fn`` lowered and compiled with f64 inputs; call it under enable_x64."""
        found = self.executables.get("f64")
        if found is None:
            found = (jax.jit(fn).trace(*args64).lower().compile(), None)
            self.compiles += 1
            _keep(self.executables, "f64", found)
        return found[0]


def _keep(cache: OrderedDict, key: str, value: Any) -> None:
    cache[key] = value
    while len(cache) > _CACHE_PER_SIGNATURE:
        cache.popitem(last=False)


# fn -> {input signature: _Lowering}; weak, so a dropped function frees its executables.
_LOWERINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lowering(fn: Callable[..., Any], args: tuple) -> _Lowering:
    """The cached lowering of ``fn`` for ``args``' signature."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    key = (treedef, tuple(leaf_signature(leaf) for leaf in leaves),
           bool(jax.config.jax_enable_x64))
    try:
        per_fn = _LOWERINGS.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: no cache across calls
        per_fn = {}
    found = per_fn.get(key)
    if found is None:
        found = per_fn[key] = _Lowering(fn, args)
    return found


class _Session:
    """One public call: its arguments, the runs it made, what it compiled."""

    def __init__(self, fn: Callable[..., Any], args: tuple, what: str) -> None:
        if isinstance(fn, AmpFunction):  # measure the function, not a rewritten rewrite
            fn = fn.fn
        if not callable(fn):
            raise ValueError(f"hlo_amp.{what} expects a callable, got {fn!r}")  # noqa: TRY004
        self.start = time.perf_counter()
        self.fn = fn
        self.args = args
        self.lowering = _lowering(fn, args)
        self.compiles_before = self.lowering.compiles
        self.names, self.kinds = _output_leaves(self.lowering.lowered.out_info, what)
        self.as_written: list[np.ndarray] | None = None
        # (policy string, reference, atol) -> error; outputs are not kept, as a large
        # model's would fill the host memory over a search
        self.errors: dict[tuple[str, str, float], float] = {}
        self.f64: list[np.ndarray] | None = None
        self.f64_note: str | None = None

    @property
    def compiles(self) -> int:
        return self.lowering.compiles - self.compiles_before

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def report(self, policy: Policy) -> Report:
        """The pass's report for ``policy``, without compiling."""
        return self.lowering.report(policy)

    def run(self, policy: Policy | None) -> tuple[list[np.ndarray], Report | None]:
        """Flat outputs of ``fn`` under ``policy`` (None: as written) and the report."""
        if policy is None and self.as_written is not None:
            return self.as_written, None
        executable, report = self.lowering.executable(policy)
        outputs = _host_leaves(executable(*self.args))
        if policy is None:
            self.as_written = outputs
        return outputs, report

    def error(self, policy: Policy, reference: str, atol: float) -> float:
        """The error of ``policy``'s outputs against ``reference``."""
        key = (policy.to_string(), reference, atol)
        if key not in self.errors:
            got, _ = self.run(policy)
            self.errors[key] = _worst(_errors(self, got, self.reference(reference), 1.0,
                                              atol))
        return self.errors[key]

    def run_f64(self) -> list[np.ndarray] | None:
        """Flat outputs of ``fn`` on f64 inputs under ``jax.enable_x64``; None (and a
        note) where that fails. The caller's own x64 setting is left as it was."""
        if self.f64 is None and self.f64_note is None:
            try:
                with jax.enable_x64(True):
                    args64 = jax.tree_util.tree_map(_to_f64, self.args)
                    executable = self.lowering.f64_executable(self.fn, args64)
                    self.f64 = _host_leaves(executable(*args64))
            except Exception as error:  # noqa: BLE001 - e.g. a backend without f64
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                self.f64_note = f"no f64 run: {first}"
        return self.f64

    def reference(self, reference: str) -> list[np.ndarray]:
        if reference == "f32":
            return self.run(None)[0]
        outputs = self.run_f64()
        if outputs is None:
            raise RuntimeError(f"reference='f64' asked for, but {self.f64_note}")
        return outputs


def _output_leaves(out_info: Any, what: str) -> tuple[list[str], list[str]]:
    """Names and kinds ("float", "other", "key") of the output leaves; ValueError when
    none is floating point (there is nothing to measure)."""
    names, kinds = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(out_info)[0]:
        names.append(jax.tree_util.keystr(path, simple=True, separator="/") or "output")
        dtype = leaf.dtype
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            kinds.append("key")
        elif jnp.issubdtype(dtype, jnp.inexact):
            kinds.append("float")
        else:
            kinds.append("other")
    if "float" not in kinds:
        shown = ", ".join(f"{n}: {leaf.dtype}{list(leaf.shape)}" for n, leaf in
                          zip(names, jax.tree_util.tree_leaves(out_info)))
        raise ValueError(
            f"hlo_amp.{what} measures floating-point outputs, and fn returned none "
            f"({shown or 'no output'}); accepted: a function with at least one float "
            f"output leaf (its integer leaves are compared for equality alongside)")
    return names, kinds


def _host_leaves(outputs: Any) -> list[np.ndarray]:
    leaves = []
    for leaf in jax.tree_util.tree_leaves(outputs):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        leaves.append(np.asarray(jax.device_get(leaf)))
    return leaves


def _to_f64(leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return leaf
    return jnp.asarray(leaf, jnp.float64)


# ---- errors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeafError:
    """The error of one output leaf against the reference."""

    name: str  # the leaf's pytree path, "/"-separated ("0/w1", "loss"); "output" alone
    shape: tuple[int, ...]
    dtype: str
    max_abs: float | None  # max |a - e|; None for a leaf that is not floating point
    max_rel: float | None  # max |a - e| / max |e|
    rms: float | None  # sqrt(mean((a - e)^2))
    error: float  # the smallest rtol this leaf passes with (0 for non-float leaves)
    ok: bool | None  # max|a - e| <= atol + rtol * max|e|; None for non-float leaves
    f32_vs_f64: float | None = None  # max_rel of the f32 run against the f64 run
    policy_vs_f64: float | None = None  # max_rel of the policy's run against the f64 run
    note: str = ""


def _measure(got: np.ndarray, want: np.ndarray, rtol: float, atol: float
             ) -> tuple[float, float, float, float, bool]:
    """max_abs, max_rel, rms, error (smallest passing rtol), ok."""
    a = got.astype(np.complex128 if np.iscomplexobj(got) else np.float64)
    e = want.astype(np.complex128 if np.iscomplexobj(want) else np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == e) | (np.isnan(a) & np.isnan(e))
        diff = np.where(same, 0.0, np.abs(a - e))
        diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN where the reference has none
    finite = np.abs(e[np.isfinite(e)])
    scale = float(finite.max()) if finite.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    rms = float(np.sqrt(np.mean(np.square(diff)))) if diff.size else 0.0
    max_rel = max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf)
    if max_abs <= atol:
        error = 0.0
    else:
        error = (max_abs - atol) / scale if scale else math.inf
    return max_abs, max_rel, rms, error, bool(max_abs <= atol + rtol * scale)


def _errors(session: _Session, got: list[np.ndarray], want: list[np.ndarray], rtol: float,
            atol: float) -> list[LeafError]:
    leaves = []
    for name, kind, a, e in zip(session.names, session.kinds, got, want):
        shape, dtype = tuple(a.shape), str(a.dtype)
        if kind != "float":
            equal = a.shape == e.shape and np.array_equal(a, e)
            note = "not floating point: " + ("equal" if equal else
                                             f"differs in {int(np.sum(a != e))} element(s)")
            leaves.append(LeafError(name, shape, dtype, None, None, None, 0.0, None,
                                    note=note))
            continue
        max_abs, max_rel, rms, error, ok = _measure(a, e, rtol, atol)
        leaves.append(LeafError(name, shape, dtype, max_abs, max_rel, rms, error, ok))
    return leaves


def _worst(leaves: Sequence[LeafError]) -> float:
    return max((leaf.error for leaf in leaves if leaf.ok is not None), default=0.0)


def run_dtypes(report: Report, policy: Policy) -> list[str]:
    """Element types narrower than f32 that the rewritten program computes in."""
    found = {t for d in report.decisions if d.low_precision for t in d.operands_after}
    if report.propagation and any(row["painted"] for row in
                                  report.propagation.get("ops", {}).values()):
        found.add(DTYPE_TO_ELEMENT[policy.compute_dtype])
    return sorted(found)


def tolerance(dtypes: Sequence[str]) -> float:
    """The rtol for a run in ``dtypes``: the loosest of theirs; f32's when empty."""
    def rtol(element: str) -> float:
        matches = [value for prefix, value in RTOL.items() if element.startswith(prefix)]
        return max(matches) if matches else max(RTOL.values())
    return max((rtol(t) for t in dtypes), default=RTOL["f32"])


def _check_reference(reference: Any) -> str:
    if reference not in REFERENCES:
        raise ValueError(f"Unknown reference {reference!r}; accepted: "
                         f"{', '.join(map(repr, REFERENCES))}")
    return reference


def _check_tolerance(value: Any, what: str, *, zero_ok: bool) -> float:
    ok = (isinstance(value, (int, float, np.floating, np.integer))
          and not isinstance(value, bool) and math.isfinite(float(value))
          and (float(value) >= 0 if zero_ok else float(value) > 0))
    if not ok:
        accepted = "a finite number >= 0" if zero_ok else "a finite number > 0"
        raise ValueError(f"Invalid {what} {value!r}; accepted: {accepted}")
    return float(value)


def _g(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def _json_number(value: Any) -> Any:
    """inf and NaN as strings, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_number(v) for v in value]
    return value


# ---- compare -----------------------------------------------------------------------------


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
        return _worst(self.leaves)

    @property
    def ok(self) -> bool:
        return all(leaf.ok for leaf in self.leaves if leaf.ok is not None)

    def to_dict(self) -> dict[str, Any]:
        return _json_number({
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
            row = [leaf.name, shape, leaf.dtype, _g(leaf.max_abs), _g(leaf.max_rel),
                   _g(leaf.rms), ok if not leaf.note else leaf.note]
            if f64:
                row += [_g(leaf.policy_vs_f64), _g(leaf.f32_vs_f64)]
            rows.append(row)
        dtype = "/".join(self.dtypes) or "f32"
        lines = [f"policy {self.policy} against {self.reference} ({dtype}: "
                 + f"|a-e| <= {self.atol:g} + {self.rtol:g}*max|e|)", *text_table(header, rows)]
        verdict = "within" if self.ok else "OUTSIDE"
        lines.append(f"error {_g(self.error)}: {verdict} the {dtype} tolerance; "
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
    reference = _check_reference(reference)
    atol = _check_tolerance(atol, "atol", zero_ok=True)
    if rtol is not None:
        rtol = _check_tolerance(rtol, "rtol", zero_ok=False)
    session = _Session(fn, args, "compare")
    got, report = session.run(policy)
    warn_unused_rules(report)
    dtypes = run_dtypes(report, policy)
    rtol = tolerance(dtypes) if rtol is None else rtol
    f32 = session.run(None)[0]
    notes = []
    f64_outputs = session.run_f64() if f64 or reference == "f64" else None
    leaves = _errors(session, got, session.reference(reference), rtol, atol)
    if f64_outputs is not None:
        vs_policy = (leaves if reference == "f64"
                     else _errors(session, got, f64_outputs, rtol, atol))
        vs_f32 = _errors(session, f32, f64_outputs, rtol, atol)
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
    if not report.decisions:
        notes.append("note: fn has no dot_general or convolution op: the policy rewrites "
                     "nothing, and the outputs are those of fn as written")
    elif not dtypes:
        notes.append("note: the policy converts none of fn's matrix ops to a narrower type")
    return Comparison(policy.to_string(), reference, dtypes, rtol, atol, leaves,
                      session.compiles, session.seconds, notes, report)


# ---- attribute ---------------------------------------------------------------------------


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
    guards: dict[str, str] = field(default_factory=dict)  # rules that keep others' rules out

    @property
    def ranking(self) -> list[str]:
        return [row.scope for row in self.scopes]

    def to_dict(self) -> dict[str, Any]:
        return _json_number({
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
                 _g(row.only_low), _g(row.only_f32), _g(row.contribution))
                for rank, row in enumerate(self.scopes, 1)]
        title = (f"error per scope at depth {self.depth} under {self.policy} "
                 f"(against {self.reference}; error = max over outputs of "
                 f"(max|a-e| - {self.atol:g}) / max|e|; {low} tolerance {self.rtol:g})")
        lines = [title]
        lines += text_table(("rank", "scope", "ops", "FLOPs", f"only it {low}", "only it f32",
                         "contribution"), rows)
        lines.append(f"every scope {low}: error {_g(self.error)}; "
                     f"{self.compiles} XLA compile(s), {self.seconds:.1f} s")
        lines += self.notes
        return "\n".join(lines)

    def plot(self, path: str | Path, budget: float | None = None) -> Path:
        """Write a PNG bar chart of the two errors per scope (needs matplotlib)."""
        figure_type = matplotlib_figure("Attribution.plot")
        import matplotlib.ticker

        rows = list(reversed(self.scopes))  # worst on top
        positive = [v for row in rows for v in (row.only_low, row.only_f32 or 0.0)
                    if v and math.isfinite(v)] + [self.error or 1e-7]
        left = 10 ** math.floor(math.log10(min(positive)))  # bars start at a decade
        floor = 1.5 * left  # a zero error is drawn as a stub, visible on the log axis

        def bar(value: float | None) -> float:
            if value is None or value == 0:
                return floor
            return value if math.isfinite(value) else max(positive) * 10

        low = "/".join(self.dtypes) or "low"
        fig = figure_type(figsize=(7, 0.45 * len(rows) + 2.2))
        ax = fig.add_subplot()
        y = np.arange(len(rows))
        ax.barh(y + 0.2, [bar(r.only_low) for r in rows], 0.4, label=f"only this scope {low}")
        ax.barh(y - 0.2, [bar(r.only_f32) for r in rows], 0.4, label="only this scope f32")
        ax.axvline(self.error, color="k", ls="--", lw=1, label=f"every scope {low}")
        if budget is not None:
            ax.axvline(budget, color="r", ls=":", lw=1, label="budget")
        ax.set_yticks(y, [r.scope for r in rows])
        ax.set_xscale("log")
        ax.set_xlim(left=left)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # they overlap
        ax.set_xlabel(f"error (max over outputs, scaled; against {self.reference})")
        ax.set_title(f"error per scope at depth {self.depth}, {self.policy}", fontsize=9)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
        return out


def _segments(scope: str) -> tuple[str, ...]:
    return tuple(scope.split("/")) if scope else ()


def _pattern(group: str) -> str | None:
    """The scope rule pattern naming exactly ``group``'s segments, or None when no rule
    can (whitespace, or '[' which a glob reads as a character class)."""
    if not group or any(ch.isspace() or ch == "[" for ch in group):
        return None
    return "/".join(seg.replace("*", "[*]").replace("?", "[?]") for seg in group.split("/"))


def _groups(report: Report, depth: Any) -> dict[str, list[Decision]]:
    """Decisions by the first ``depth`` segments of their scope ("" for top level)."""
    deepest = max((len(_segments(d.scope)) for d in report.decisions), default=0)
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1 or (
            report.decisions and depth > deepest):
        example = max((d.scope for d in report.decisions), key=lambda s: len(_segments(s)),
                      default="")
        accepted = (f"1 to {deepest} (fn's deepest scope is {example!r})" if deepest
                    else "an int >= 1 (fn's matrix ops have no named scope)")
        raise ValueError(f"Unknown depth {depth!r}; accepted: {accepted}")
    groups: dict[str, list[Decision]] = {}
    for d in report.decisions:
        groups.setdefault("/".join(_segments(d.scope)[:int(depth)]), []).append(d)
    return groups


def _guards(groups: dict[str, list[Decision]], patterns: dict[str, str], base: Policy
            ) -> tuple[dict[str, str], list[str]]:
    """Rules that keep each group's own rule from reaching into another group.

    A rule ``X`` matches ``X``'s segments anywhere in a scope (``head`` also inside
    ``blocks/0/head``) and a shorter group is a prefix of a longer one; where a group is
    reached that way it gets a rule of its own, with the policy's action for its ops, at
    its outermost segment, which wins over any rule matching further in.
    """
    guards, notes = {}, []
    for h, decisions in groups.items():
        if h not in patterns:
            continue
        reached = [g for g, pattern in patterns.items() if g != h and any(
            match_start(pattern, _segments(d.scope)) is not None for d in decisions)]
        if not reached:
            continue
        actions = {d.action or "keep" for d in decisions
                   if d.rule not in ("backward", "amp_stop")}
        if len(actions) == 1:
            guards[patterns[h]] = actions.pop()
        elif actions:
            notes.append(f"note: the rule for {reached[0]!r} also reaches {h!r}, whose ops "
                         f"{base.to_string()} treats differently ({', '.join(sorted(actions))})"
                         f"; its rows include {h!r}'s ops")
    return guards, notes


def with_scopes(base: Policy, rules: Mapping[str, str]) -> Policy:
    """``base`` with ``rules`` written before its own scope rules, so that of two
    patterns matching at the same segment with as many parts, ``rules``' wins."""
    scopes = dict(rules)
    for pattern, action in base.scopes.items():
        scopes.setdefault(pattern, action)
    return Policy.from_dict({**base.to_dict(), "scopes": scopes})


def _attribute(session: _Session, base: Policy, depth: Any, reference: str, atol: float
               ) -> Attribution:
    report = session.report(base)
    groups = _groups(report, depth)  # a bad depth fails here, before any compile
    patterns = {g: p for g in groups if (p := _pattern(g)) is not None}
    guards, notes = _guards(groups, patterns, base)
    base_error = session.error(base, reference, atol)
    rows = []
    for group, decisions in groups.items():
        others = {patterns[h]: "float32" for h in patterns if h != group}
        only_low = session.error(with_scopes(base, {**guards, **others}), reference, atol)
        only_f32 = None
        pattern = patterns.get(group)
        if pattern is not None:
            only_f32 = session.error(with_scopes(base, {**guards, pattern: "float32"}),
                                     reference, atol)
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
                     f"these ops (wrap them in jax.named_scope), so they stay at the "
                     f"policy's precision in every other row and autopolicy cannot keep "
                     f"them f32")
    dtypes = run_dtypes(report, base)
    attribution = Attribution(base.to_string(), int(depth), reference, dtypes,
                              tolerance(dtypes), atol, base_error, rows,
                              session.compiles, session.seconds, notes, guards)
    return attribution


def attribute(fn: Callable[..., Any], policy: Policy | str | Mapping[str, Any], *args: Any,
              depth: int = 1, reference: str = "f32", atol: float = ATOL) -> Attribution:
    """For every scope at ``depth`` of the report's name stacks, the error of ``fn``'s
    outputs when only that scope runs under ``policy`` and when only it is kept f32;
    scopes ranked by the first (what they contribute). Costs ``2 * scopes + 2`` XLA
    compiles at most, one per distinct policy, each on a copy of one lowering."""
    policy = as_policy(policy)
    reference = _check_reference(reference)
    atol = _check_tolerance(atol, "atol", zero_ok=True)
    session = _Session(fn, args, "attribute")
    return _attribute(session, policy, depth, reference, atol)


# ---- autopolicy --------------------------------------------------------------------------


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
        return _json_number({
            "policy": self.policy.to_string(), "budget": self.budget, "error": self.error,
            "met": self.met, "f32_scopes": self.f32_scopes,
            "trail": [asdict(t) for t in self.trail], "compiles": self.compiles,
            "seconds": self.seconds, "notes": self.notes,
            "attribution": self.attribution.to_dict(),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        rows = [(i, ", ".join(t.f32_scopes) or "(none)", _g(t.predicted), _g(t.error),
                 "yes" if t.met else "no") for i, t in enumerate(self.trail)]
        lines = [f"autopolicy: budget {self.budget:g} (error = max over outputs, against "
                 + f"{self.attribution.reference})"]
        lines += text_table(("try", "f32 scopes", "predicted", "error", "within"), rows)
        state = "within" if self.met else "NOT within"
        lines.append(f"chosen ({len(self.f32_scopes)} f32 scope(s), error "
                     f"{_g(self.error)}, {state} budget): {self.policy.to_string()}")
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
               atol: float = ATOL) -> AutoPolicy:
    """The policy with the fewest f32 scopes at ``depth`` whose error stays within
    ``budget`` (then the most FLOPs at ``base``'s precision).

    ``budget`` bounds ``Comparison.error``: every float output leaf within
    ``atol + budget * max|e|`` of ``reference``. One scope is enough when one of the
    attribution's "only it f32" runs is within budget: the one with the fewest FLOPs is
    chosen. Otherwise scopes are taken f32 in ``attribute``'s order; the attribution
    predicts how many are needed, and compiles confirm it, stepping one scope up or down
    until the fewest that pass are found.
    """
    budget = _check_tolerance(budget, "budget", zero_ok=False)
    policy = as_policy(base)
    reference = _check_reference(reference)
    atol = _check_tolerance(atol, "atol", zero_ok=True)
    session = _Session(fn, args, "autopolicy")
    attribution = _attribute(session, policy, depth, reference, atol)
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
        candidate = with_scopes(policy, {**attribution.guards, **rules})
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
    notes = []
    within = [k for k in tried if passed[k]]
    candidate, error, rows = tried[min(within) if within else max(tried)]
    if error > budget:
        notes.append(
            f"note: no policy with f32 scopes at depth {depth} meets budget {budget:g}: "
            f"with all {len(named)} f32 the error is {_g(error)} (ops outside named "
            f"scopes, or the policy's activations, still run in low precision); raise the "
            f"budget, go deeper, or name the remaining ops")
    notes += [n for n in attribution.notes if "no dot_general" in n]
    return AutoPolicy(candidate, budget, error, error <= budget, [r.scope for r in rows],
                      trail, attribution, session.compiles, session.seconds, notes)
