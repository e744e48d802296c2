"""``hlo_amp.compile``: lower a JAX function, run the AMP passes, compile and run it.

Concrete calls go through ``jax.jit(fn).trace(...).lower()``: the lowered module is
copied, rewritten and handed back to JAX's own compile path, so shardings, donation,
effects (``jax.debug.print``) and the output pytree are JAX's own. Executables are
cached per input signature, like ``jax.jit``.

Calls with tracers (inside an outer ``jax.jit``, ``jax.grad``, ``vmap``) go through
``jax.export``: the exported module is rewritten and inlined with ``Exported.call``.
Under differentiation a ``custom_vjp`` uses two rewritten modules, the forward
(returning the residuals) and the backward, so the forward is never recomputed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax import export as jax_export
from jax._src import stages
from jax._src.export import _export as export_internals
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

from hlo_amp.modules import module_text, new_context
from hlo_amp.passes import run_pipeline
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import Report
from hlo_amp.rewrite import warn_unused_rules


def _copy_module(module: ir.Module) -> ir.Module:
    """A deep copy in the same context, so JAX's cached lowering stays untouched."""
    return ir.Module.parse(jax_mlir.module_to_bytecode(module), context=module.context)


def rewrite_module(module: ir.Module, policy: Policy, target: str | None = None
                   ) -> tuple[ir.Module, Report, float]:
    """Copy ``module``, run the pipeline on the copy; return it, the report, seconds."""
    start = time.perf_counter()
    rewritten = _copy_module(module)
    report = run_pipeline(rewritten, policy, target=target)
    return rewritten, report, time.perf_counter() - start


# ---- what XLA kept ----------------------------------------------------------------------

_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[")
_HLO_MATMUL = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[[^\]]*\][^ ]*\s+(dot|convolution)\(([^)]*)\)"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LOW_TYPES = ("bf16", "f16", "f8")


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
        for operand in match.group(2).split(","):
            operand = operand.strip()
            inline = re.match(r"^(\w+)\[", operand)  # "bf16[2,3]{1,0} %x" form
            name = operand.split()[-1].lstrip("%") if operand else ""
            operands.append(inline.group(1) if inline else types.get(name, "?"))
        op_name = _OP_NAME.search(line)
        low = bool(operands) and all(t.startswith(_LOW_TYPES) for t in operands)
        found.append((op_name.group(1) if op_name else "", low))
    return found


def mark_kept_by_xla(report: Report, hlo_text: str) -> None:
    """Fill ``kept_by_xla`` for each converted decision from XLA's optimized HLO.

    Decisions and HLO ops are matched by name-stack (``op_name`` metadata); when
    several share a name, the count of low-precision HLO ops is what is compared.
    """
    by_name: dict[str, list[bool]] = {}
    for op_name, low in xla_matmuls(hlo_text):
        by_name.setdefault(op_name, []).append(low)
    groups: dict[str, list[int]] = {}
    for index, decision in enumerate(report.decisions):
        if decision.low_precision and decision.changed:
            groups.setdefault(decision.location, []).append(index)
    for location, indices in groups.items():
        matches = by_name.get(location)
        if matches is None:  # ops from private functions carry only their inner name
            matches = [low for name, lows in by_name.items() if name and
                       location.endswith("/" + name) for low in lows]
        if not matches:
            continue  # folded away or renamed: unknown, left as None
        kept = sum(matches)
        for rank, index in enumerate(indices):
            report.decisions[index] = dataclasses.replace(
                report.decisions[index], kept_by_xla=rank < kept)
    report.xla_checked = True


# ---- AOT objects -----------------------------------------------------------------------


class AmpCompiled:
    """A compiled, rewritten function: call it, or read XLA's optimized HLO."""

    def __init__(self, compiled: stages.Compiled, report: Report, compile_seconds: float):
        self._compiled = compiled
        self._report = report
        self.compile_seconds = compile_seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def as_text(self) -> str:
        """XLA's optimized HLO."""
        return self._compiled.as_text()

    def memory_analysis(self) -> Any:
        return self._compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        return self._compiled.cost_analysis()

    def report(self) -> Report:
        """The pass's report, with ``kept_by_xla`` filled in from the optimized HLO."""
        return self._report

    @property
    def jax_compiled(self) -> stages.Compiled:
        return self._compiled


class AmpLowered:
    """A lowered and rewritten function, like ``jax.jit(f).lower(...)``'s result."""

    def __init__(self, original: stages.Lowered, rewritten: stages.Lowered, report: Report,
                 pass_seconds: float, lower_seconds: float):
        self._original = original
        self._rewritten = rewritten
        self._report = report
        self.pass_seconds = pass_seconds
        self.lower_seconds = lower_seconds

    def as_text(self, debug_info: bool = False) -> str:
        """The rewritten StableHLO module."""
        return module_text(self._rewritten.compiler_ir("stablehlo"), debug_info=debug_info)

    def original_text(self, debug_info: bool = False) -> str:
        """The module as JAX lowered it, before the pass."""
        return module_text(self._original.compiler_ir("stablehlo"), debug_info=debug_info)

    def report(self) -> Report:
        return self._report

    def compile(self) -> AmpCompiled:
        start = time.perf_counter()
        compiled = self._rewritten.compile()
        seconds = time.perf_counter() - start
        report = copy.deepcopy(self._report)
        try:
            mark_kept_by_xla(report, compiled.as_text())
        except Exception as error:  # noqa: BLE001  (advisory; never fail a compile on it)
            report.notes.append(f"could not read XLA's optimized HLO: {error}")
        return AmpCompiled(compiled, report, seconds)

    @property
    def jax_lowered(self) -> stages.Lowered:
        return self._rewritten


# ---- the compiled-function object -------------------------------------------------------


def _normalise_argnums(argnums: int | Sequence[int], count: int) -> tuple[int, ...]:
    if isinstance(argnums, int):
        argnums = (argnums,)
    return tuple(sorted({a + count if a < 0 else a for a in argnums}))


def _leaf_signature(leaf: Any) -> Any:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
                sharding)
    return (type(leaf).__name__, leaf if isinstance(leaf, (bool, int, float, complex)) else None)


class AmpFunction:
    """What ``hlo_amp.compile`` returns: callable like ``jax.jit(fn)``."""

    def __init__(self, fn: Callable[..., Any], policy: Policy | str | Mapping[str, Any],
                 *, static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Sequence[str] = (),
                 donate_argnums: int | Sequence[int] = ()):
        if not callable(fn):
            raise TypeError(f"hlo_amp.compile expects a callable, got {fn!r}")
        self.fn = fn
        self.policy = as_policy(policy)
        self.static_argnums = ((static_argnums,) if isinstance(static_argnums, int)
                               else tuple(static_argnums))
        self.static_argnames = ((static_argnames,) if isinstance(static_argnames, str)
                                else tuple(static_argnames))
        self.donate_argnums = ((donate_argnums,) if isinstance(donate_argnums, int)
                               else tuple(donate_argnums))
        self._jitted = jax.jit(fn, static_argnums=self.static_argnums,
                               static_argnames=self.static_argnames,
                               donate_argnums=self.donate_argnums)
        self._cache: dict[Any, AmpCompiled] = {}
        self._exports: dict[Any, Any] = {}
        self.lowerings = 0  # how many times fn was lowered (cache misses)
        functools.update_wrapper(self, fn)

    # -- signatures --

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        statics = _normalise_argnums(self.static_argnums, len(args))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        static_key = (tuple((i, args[i]) for i in statics if i < len(args)),
                      tuple(sorted((k, v) for k, v in kwargs.items()
                                   if k in self.static_argnames)))
        return dyn_args, dyn_kwargs, static_key

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list, Any, Any]:
        """Dynamic args and kwargs, their leaves and treedef, and the cache key."""
        dyn_args, dyn_kwargs, static_key = self._split(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        key = (treedef, tuple(_leaf_signature(x) for x in leaves), static_key)
        return dyn_args, dyn_kwargs, leaves, treedef, key

    # -- AOT --

    def lower(self, *args: Any, **kwargs: Any) -> AmpLowered:
        """Lower ``fn`` for these arguments and rewrite it (like ``jax.jit().lower``)."""
        start = time.perf_counter()
        original = self._jitted.trace(*args, **kwargs).lower()
        lower_seconds = time.perf_counter() - start
        self.lowerings += 1
        lowering = original._lowering
        platforms = tuple(getattr(lowering, "_platforms", ()) or (jax.default_backend(),))
        target = "cpu" if tuple(platforms) == ("cpu",) else None
        module, report, pass_seconds = rewrite_module(lowering.stablehlo(), self.policy,
                                                      target)
        warn_unused_rules(report, stacklevel=2)
        new_lowering = copy.copy(lowering)
        new_lowering._hlo = module
        new_lowering._executable = None
        rewritten = stages.Lowered(new_lowering, original.args_info, original.out_tree,
                                   no_kwargs=original._no_kwargs)
        return AmpLowered(original, rewritten, report, pass_seconds, lower_seconds)

    # -- calls --

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dyn_args, dyn_kwargs, leaves, treedef, key = self._flatten(args, kwargs)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return self._traced_call(args, kwargs, leaves, treedef, key)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.lower(*args, **kwargs).compile()
            self._cache[key] = compiled
        return compiled(*dyn_args, **dyn_kwargs)

    def _bound(self, args: tuple, kwargs: dict, treedef: Any) -> Callable[..., Any]:
        """``fn`` with static arguments bound, as a function of the flat dynamic leaves."""
        statics = _normalise_argnums(self.static_argnums, len(args))
        static_kwargs = {k: v for k, v in kwargs.items() if k in self.static_argnames}

        def flat_fn(*flat: Any) -> Any:
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, flat)
            call_args = list(call_args)
            for i in statics:
                call_args.insert(i, args[i])
            return self.fn(*call_args, **call_kwargs, **static_kwargs)

        return flat_fn

    def _export(self, key: Any, fun: Callable[..., Any], example: Any) -> Any:
        exported = self._exports.get(key)
        if exported is None:
            shapes = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
            exported = jax_export.export(jax.jit(fun))(*shapes)
            self.lowerings += 1
            module = ir.Module.parse(exported.mlir_module(), context=new_context())
            target = "cpu" if tuple(exported.platforms) == ("cpu",) else None
            warn_unused_rules(run_pipeline(module, self.policy, target=target), stacklevel=4)
            exported = dataclasses.replace(
                exported, mlir_module_serialized=export_internals._module_to_bytecode(module))
            self._exports[key] = exported
        return exported

    def _traced_call(self, args: tuple, kwargs: dict, leaves: list, treedef: Any,
                     key: Any) -> Any:
        flat_fn = self._bound(args, kwargs, treedef)
        try:
            return self._differentiable(flat_fn, key)(*leaves)
        except Exception as error:  # e.g. host callbacks, which jax.export refuses
            if not _export_refused(error):
                raise
            warnings.warn(
                f"hlo_amp: cannot rewrite {getattr(self.fn, '__name__', 'fn')} under an "
                f"outer transformation ({str(error).splitlines()[0]}); it runs unchanged",
                stacklevel=3)
            return flat_fn(*leaves)

    def _differentiable(self, flat_fn: Callable[..., Any], key: Any) -> Callable[..., Any]:
        def primal(*flat: Any) -> Any:
            return self._export(("primal", key), flat_fn, flat).call(*flat)

        def forward(*flat: Any) -> Any:
            def with_residuals(*inner: Any) -> Any:
                return jax.vjp(flat_fn, *inner)

            return self._export(("fwd", key), with_residuals, flat).call(*flat)

        def backward(residuals: Any, cotangent: Any) -> Any:
            def apply(res: Any, ct: Any) -> Any:
                return res(ct)

            bwd_key = ("bwd", key, jax.tree_util.tree_structure(cotangent))
            return tuple(self._export(bwd_key, apply, (residuals, cotangent))
                         .call(residuals, cotangent))

        wrapped = jax.custom_vjp(primal)
        wrapped.defvjp(forward, backward)
        return wrapped


def _export_refused(error: Exception) -> bool:
    text = str(error)
    return any(marker in text for marker in (
        "custom call", "callback", "effects", "Cannot serialize", "not supported",
    ))


def compile(fn: Callable[..., Any], policy: Policy | str | Mapping[str, Any] = "bf16", *,
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            donate_argnums: int | Sequence[int] = ()) -> AmpFunction:
    """Like ``jax.jit(fn)``, but dot/conv ops run in the policy's precision.

    ``policy`` is a Policy, a string (``"bf16"``, ``"bf16,scope:head=float32"``) or a
    dict. The result has ``.lower(*args)`` for the rewritten module and its report.
    """
    return AmpFunction(fn, policy, static_argnums=static_argnums,
                       static_argnames=static_argnames, donate_argnums=donate_argnums)
