"""Measuring: one lowering per function and input signature, an executable per policy,
and the scaled error of every output leaf."""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hlo_amp import jax_internals as internals
from hlo_amp.policy import DTYPE_TO_ELEMENT, Policy
from hlo_amp.report import Report, is_narrow
from hlo_amp.runtime.compile import (
    AmpFunction,
    lowering_target,
    rewrite_lowered,
)
from hlo_amp.runtime.fp8_state import Fp8StatefulFunction
from hlo_amp.runtime.frameworks import (
    argument_style,
    function_name_of,
    jax_jit_info,
    unwrap_jit,
)
from hlo_amp.runtime.signature import leaf_signature, normalise_argnums
from hlo_amp.targets import Target

ATOL = 1e-5
# rtol per element type a run computes in: torch.testing's for f32, bf16 and f16; fp8 and
# fp4 twice their unit roundoff, as torch's f16 tolerance is. Matched by prefix, so
# "f8E4M3" covers f8E4M3FN and f8E4M3FNUZ.
RTOL = {"f32": 1.3e-6, "bf16": 1.6e-2, "f16": 1e-3, "f8E3M4": 6.25e-2, "f8E4M3": 1.25e-1,
        "f8E5M2": 2.5e-1, "f4E2M1": 5e-1}
REFERENCES = ("f32", "f64")
_CACHE_PER_SIGNATURE = 64  # executables kept per function and input signature


# ---- one lowering, many rewrites --------------------------------------------------------


class _Lowering:
    """``fn`` lowered once for one input signature; executables cached per policy."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        # No reference to fn is kept: the cache is weakly keyed by it.
        self.lowered = jax.jit(fn).trace(*args).lower()
        self.target = lowering_target(self.lowered)
        # _key ("" = as written, "f64") -> (executable, report or None)
        self.executables: OrderedDict[Hashable, tuple[Any, Report | None]] = OrderedDict()
        self.rewrites: OrderedDict[Hashable, tuple[Any, Report]] = OrderedDict()
        self.compiles = 0

    def report(self, policy: Policy, fused_as: Target | None = None) -> Report:
        """The pass's report for ``policy``, without compiling."""
        compiled = self.executables.get(_key(policy, fused_as))
        return compiled[1] if compiled is not None else self.rewrite(policy, fused_as)[1]

    def rewrite(self, policy: Policy, fused_as: Target | None = None) -> tuple[Any, Report]:
        """A copy of the module rewritten under ``policy``, and its report (kept until
        it is compiled). ``fused_as``: attention fused as on that GPU, with the
        reference kernel (passes.default_pipeline)."""
        key = _key(policy, fused_as)
        found = self.rewrites.get(key)
        if found is None:
            rewritten, report, _ = rewrite_lowered(self.lowered, policy, self.target,
                                                   fused_as=fused_as)
            found = (rewritten, report)
            _keep(self.rewrites, key, found)
        return found

    def executable(self, policy: Policy | None, fused_as: Target | None = None
                   ) -> tuple[Any, Report | None]:
        key = "" if policy is None else _key(policy, fused_as)
        found = self.executables.get(key)
        if found is not None:
            self.executables.move_to_end(key)
            return found
        if policy is None:
            found = (self.lowered.compile(), None)
        else:
            rewritten, report = self.rewrite(policy, fused_as)
            # As hlo_amp.compile compiles the policy on this machine's device.
            options = self.target.live_compiler_options(policy.uses_fp8)
            found = (rewritten.compile(options or None), report)
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


def _key(policy: Policy, fused_as: Target | None) -> Hashable:
    """A rewrite's cache key: the policy's string, and the GPU attention is fused as."""
    return policy.to_string() if fused_as is None else (policy.to_string(), fused_as)


def _keep(cache: OrderedDict, key: Hashable, value: Any) -> None:
    cache[key] = value
    while len(cache) > _CACHE_PER_SIGNATURE:
        cache.popitem(last=False)


# fn -> {input signature: _Lowering}; weak, so a dropped function frees its executables.
_LOWERINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lowering(fn: Callable[..., Any], args: tuple) -> _Lowering:
    """The cached lowering of ``fn`` for ``args``' signature."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    # The trace context as hlo_amp.compile keys its exports (x64, matmul precision).
    key = (treedef, tuple(leaf_signature(leaf) for leaf in leaves),
           internals.program_context())
    try:
        per_fn = _LOWERINGS.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: no cache across calls
        per_fn = {}
    found = per_fn.get(key)
    if found is None:
        found = per_fn[key] = _Lowering(fn, args)
    return found


def _static_argnums(fn: Any) -> tuple[int, ...]:
    """The static argument positions of a ``jax.jit`` function (``_as_written`` takes
    an ``hlo_amp.compile`` function's, and an nnx.jit or eqx.filter_jit step's)."""
    info = jax_jit_info(fn)
    return tuple(info.static_argnums) if info is not None else ()


def _as_written(fn: Any) -> tuple[Any, tuple[int, ...], bool | None]:
    """``fn`` as written, its static argument positions and whether its arguments' non-
    array leaves are static (``eqx.filter_jit``'s; None: as Equinox modules decide): an
    ``hlo_amp.compile`` function's own function, also under ``functools.partial``
    (which binding a keyword-only static argument needs), so that the reference is not
    a rewrite."""
    if isinstance(fn, functools.partial):
        inner, statics, filtered = _as_written(fn.func)
        bound = len(fn.args)  # the positions the partial fills come first
        return (functools.partial(inner, *fn.args, **fn.keywords),
                tuple(i - bound for i in statics if i >= bound), filtered)
    if isinstance(fn, (AmpFunction, Fp8StatefulFunction)):  # not a rewritten rewrite
        return fn.fn, fn.static_argnums, getattr(fn, "filter", None)
    try:  # an nnx.jit / eqx.filter_jit step: its static arguments and filtering
        decorator = unwrap_jit(fn, function_name_of(fn))
    except TypeError:  # options hlo_amp.compile cannot carry: measured as it is
        decorator = None
    if decorator is not None and decorator.name != "jax.jit":
        return decorator.fn, decorator.static_argnums, decorator.filter
    return fn, _static_argnums(fn), None


def _with_arrays_only(fn: Callable[..., Any], args: tuple, filtered: bool | None,
                      what: str) -> tuple[Callable[..., Any], tuple]:
    """``fn`` as a function of its arguments' arrays where they are taken as
    ``eqx.filter_jit`` takes them (an Equinox module's functions and other non-array
    leaves static, outputs' non-array leaves dropped); a Flax NNX object is refused."""
    style = argument_style(args, {}, filtered)
    if style == "nnx":
        raise ValueError(f"hlo_amp.{what} does not take Flax NNX objects as arguments; "
                         f"accepted: arrays and pytrees of them (Equinox modules too): give "
                         f"an NNX step as a pure function of nnx.split's state "
                         f"(docs/numerics.md)")
    if style != "filter":
        return fn, args
    import equinox as eqx  # filtered arguments: Equinox is there

    arrays, static = eqx.partition(args, eqx.is_array)

    def with_arrays(*dynamic: Any) -> Any:
        return eqx.filter(fn(*eqx.combine(dynamic, static)), eqx.is_array)

    with_arrays.__name__ = function_name_of(fn)
    with_arrays.__wrapped__ = fn
    return with_arrays, tuple(arrays)


def _with_statics_bound(fn: Callable[..., Any], args: tuple, statics: tuple[int, ...]
                        ) -> tuple[Callable[..., Any], tuple]:
    """``fn`` as a function of the arguments not at ``statics``, those bound to their
    values (so they reach ``fn`` as Python values, not as traced arrays), and those
    arguments."""
    if not statics:
        return fn, args

    def bound(*dynamic: Any) -> Any:
        full = list(dynamic)
        for position in statics:
            full.insert(position, args[position])
        return fn(*full)

    bound.__name__ = function_name_of(fn)
    bound.__wrapped__ = fn
    return bound, tuple(a for i, a in enumerate(args) if i not in statics)


# The runs here are jax.jit's, which carry no state between calls.
DELAYED_NOTE = ("note: scaling=delayed is measured with current scaling (these runs carry "
                "no amax history; a filled history approaches current scaling, and a "
                "compiled step's first call, at scale 1, is further off)")


class Session:
    """One public call: its arguments, the runs it made, what it compiled."""

    def __init__(self, fn: Callable[..., Any], args: tuple, what: str) -> None:
        fn, statics, filtered = _as_written(fn)
        if not callable(fn):
            raise ValueError(f"hlo_amp.{what} expects a callable, got {fn!r}")  # noqa: TRY004
        fn, args = _with_statics_bound(fn, args, normalise_argnums(statics, len(args)))
        # An eqx.filter_jit step, as hlo_amp.compile runs it (jax's TypeError on the
        # module's activation function before).
        fn, args = _with_arrays_only(fn, args, filtered, what)
        self.start = time.perf_counter()
        self.fn = fn
        self.args = args
        # A GPU whose program the runs compute (attention fused as there, with the
        # reference kernel): the target autopolicy sets it once it knows the target's
        # program is not partitioned.
        self.fused_as: Target | None = None
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
        return self.lowering.report(policy, self.fused_as)

    def run(self, policy: Policy | None) -> tuple[list[np.ndarray], Report | None]:
        """Flat outputs of ``fn`` under ``policy`` (None: as written) and the report."""
        if policy is None and self.as_written is not None:
            return self.as_written, None
        executable, report = self.lowering.executable(policy, self.fused_as)
        outputs = _host_leaves(executable(*self.args))
        if policy is None:
            self.as_written = outputs
        return outputs, report

    def error(self, policy: Policy, reference: str, atol: float) -> float:
        """The error of ``policy``'s outputs against ``reference``."""
        key = (policy.to_string(), reference, atol)
        if key not in self.errors:
            got, _ = self.run(policy)
            self.errors[key] = worst(leaf_errors(self, got, self.reference(reference), 1.0,
                                              atol))
        return self.errors[key]

    def reference_notes(self, reference: str) -> list[str]:
        """The note that the "f64" reference computed in f32, where it did: its float
        outputs are not float64 and equal the f32 run's bit for bit (a model closing
        over its weights and fed tokens has no float argument to widen; one that casts
        its outputs to f32 computed in f64 all the same, and differs)."""
        if reference != "f64" or self.f64 is None:
            return []
        floats = [i for i, kind in enumerate(self.kinds) if kind == "float"]
        narrow = {str(self.f64[i].dtype) for i in floats}
        if not narrow or narrow & {"float64", "complex128"}:
            return []
        written = self.run(None)[0]
        if not all(np.array_equal(self.f64[i], written[i], equal_nan=True) for i in floats):
            return []
        return [(f"note: the f64 run computed in f32: its float outputs are "
                 f"{', '.join(sorted(narrow))} and equal the f32 run's bit for bit (under "
                 f"x64 fn still computes in f32 where its weights are closed over, with no "
                 f"float argument to widen, where its arguments are complex64, which the "
                 f"f64 run does not widen, or where it pins its dtypes), so 'f64' here is "
                 f"the f32 program")]

    def f32_floor_note(self, budget: float, reference: str, atol: float) -> str | None:
        """Against f64, the note that the program in f32 is itself over ``budget`` (no
        policy can be within it); None where it is not, or the reference is f32."""
        if reference != "f64":
            return None
        floor = self.error(Policy.preset("f32"), reference, atol)
        if floor <= budget:
            return None
        return (f"note: the program in f32 is itself {floor:.3g} from f64, over budget "
                f"{budget:g}: no policy can meet it; raise the budget to at least that")

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


def leaf_errors(session: Session, got: list[np.ndarray], want: list[np.ndarray], rtol: float,
                atol: float) -> list[LeafError]:
    """One ``LeafError`` per output leaf of ``session``'s function, ``got`` against
    ``want``."""
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


def worst(leaves: Sequence[LeafError]) -> float:
    """The largest error of the float leaves: what a budget bounds."""
    return max((leaf.error for leaf in leaves if leaf.ok is not None), default=0.0)


def run_dtypes(report: Report, policy: Policy) -> list[str]:
    """Element types narrower than f32 that the rewritten program computes in."""
    found = {t for d in report.decisions if d.low_precision for t in d.operands_after}
    if report.propagation and any(row["painted"] for row in
                                  report.propagation.get("ops", {}).values()):
        found.add(DTYPE_TO_ELEMENT[policy.compute_dtype])
    return sorted(found)


def tolerance(dtypes: Sequence[str]) -> float:
    """The rtol for a run in ``dtypes``: the loosest of theirs; f32's when empty or
    for a type not narrower than 16 bits (f64: it took fp4's 0.5, the loosest of all)."""
    def rtol(element: str) -> float:
        if not is_narrow(element):
            return RTOL["f32"]
        matches = [value for prefix, value in RTOL.items() if element.startswith(prefix)]
        return max(matches) if matches else max(RTOL.values())
    return max((rtol(t) for t in dtypes), default=RTOL["f32"])


def check_reference(reference: Any) -> str:
    if reference not in REFERENCES:
        raise ValueError(f"Unknown reference {reference!r}; accepted: "
                         f"{', '.join(map(repr, REFERENCES))}")
    return reference


def check_tolerance(value: Any, what: str, *, zero_ok: bool) -> float:
    if (isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
            and (jnp.issubdtype(value.dtype, jnp.floating)
                 or jnp.issubdtype(value.dtype, jnp.integer))):
        # jnp.float32(1e-2), jnp.int32(1), a 0-d array: its number (they were refused)
        value = float(value)
    ok = (isinstance(value, (int, float, np.floating, np.integer))
          and not isinstance(value, bool) and math.isfinite(float(value))
          and (float(value) >= 0 if zero_ok else float(value) > 0))
    if not ok:
        accepted = "a finite number >= 0" if zero_ok else "a finite number > 0"
        raise ValueError(f"Invalid {what} {value!r}; accepted: {accepted}")
    return float(value)

