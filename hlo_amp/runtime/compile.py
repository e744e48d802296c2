"""``hlo_amp.compile``: lower a JAX function, run the AMP passes, compile and run it.

A call goes through ``jax.jit``'s own dispatch (its C++ cache): the jitted function binds
the ``hlo_amp_call`` primitive (runtime/amp_call.py), whose program is ``fn`` exported
with ``jax.export`` and rewritten, cached per input signature. Under ``jax.jit``,
``vmap``, ``jvp`` and ``grad`` the primitive's rules export and rewrite the transformed
program (reverse mode: a forward with residuals and a backward, so the forward is never
recomputed). Shardings, donation and the output pytree are JAX's own.

``.lower()``, functions ``jax.export`` refuses (host callbacks, a mesh of their own) and
calls with arrays sharded over several devices outside an Explicit mesh go through
``jax.jit(fn).trace(...).lower()``: the lowered module is copied, rewritten and handed
back to JAX's compile path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import export as jax_export
from jaxlib.mlir import ir

from hlo_amp import jax_internals as internals
from hlo_amp.ir.modules import copy_module, function_name, functions, module_text, new_context
from hlo_amp.ir.program_hints import (
    EndStacks,
    mark_backward_program,
    mark_caller_devices,
    name_leaves,
    unname_arguments,
)
from hlo_amp.passes import default_pipeline, run_pipeline
from hlo_amp.passes.insert_converts.call_graph import end_stacks
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import Report
from hlo_amp.rewrite import warn_at_user_code, warn_unused_rules
from hlo_amp.runtime.amp_call import (
    AvalsKey,
    BackwardOf,
    Program,
    amp_call_p,
    avals_key,
    collective_axes,
    explicit_sharding,
    is_forward_program,
    shape_structs,
    vary_alike,
)
from hlo_amp.runtime.arguments import raise_argument_problem
from hlo_amp.runtime.deviceless import (
    compile_lowered,
    lower_for_target,
    not_runnable,
    split_device_target,
)
from hlo_amp.runtime.fp8_state import Fp8StatefulFunction
from hlo_amp.runtime.frameworks import (
    PLACEMENT_OPTIONS,
    FilterCall,
    JitDecorator,
    NnxCall,
    argument_style,
    function_name_of,
    function_qualname_of,
    unwrap_jit,
    wraps_named,
)
from hlo_amp.runtime.signature import (
    CATCH_ALL,
    keystr,
    leaf_names,
    leaf_signature,
    normalise_argnums,
    positional_parameters,
    signature_of,
    split_static,
)
from hlo_amp.targets import (
    NO_TARGET,
    Target,
    device_target,
    platforms_target,
    refuse_policy_on_device,
)
from hlo_amp.targets.collectives import read_collectives
from hlo_amp.targets.kept_by_xla import mark_kept_by_xla


def rewrite_module(module: ir.Module, policy: Policy, target: str | Target | None = None,
                   *, fused_as: Target | None = None) -> tuple[ir.Module, Report, float]:
    """Copy ``module``, run the pipeline on the copy; return it, the report, seconds.
    ``fused_as``: attention fused as on that GPU (``default_pipeline``)."""
    start = time.perf_counter()
    rewritten = copy_module(module)  # JAX's cached lowering stays untouched
    report = run_pipeline(rewritten, policy, target=target, passes=None if fused_as is None
                          else default_pipeline(policy, target, fused_as=fused_as))
    return rewritten, report, time.perf_counter() - start


def rewrite_lowered(lowered: Any, policy: Policy, target: str | Target | None, *,
                    fused_as: Target | None = None) -> tuple[Any, Report, float]:
    """A JAX ``Lowered`` whose module is ``lowered``'s rewritten under ``policy``; the
    report and the pass seconds. ``lowered`` itself is untouched."""
    module, report, seconds = rewrite_module(lowered.compiler_ir("stablehlo"), policy, target,
                                             fused_as=fused_as)
    return internals.swap_module(lowered, module), report, seconds


def lowering_target(lowered: Any) -> Target:
    """The pipeline's target for a JAX ``Lowered`` (``targets.platforms_target``)."""
    return platforms_target(internals.lowering_platforms(lowered) or (jax.default_backend(),))


# ---- AOT objects -----------------------------------------------------------------------


class AmpCompiled:
    """A compiled, rewritten function: call it, or read XLA's optimized HLO."""

    def __init__(self, compiled: Any, report: Report, compile_seconds: float,
                 target: Target = NO_TARGET, device: Target | None = None,
                 calling: Callable[[Callable], Callable] | None = None,
                 chosen_options: dict[str, Any] | None = None):
        """``calling``: makes the executable, which takes a framework's inner arguments,
        a function of the caller's (``AmpLowered.calling``); ``chosen_options``: the XLA
        flags hlo_amp chose for this machine's device (``Target.live_compiler_options``)."""
        self._compiled = compiled
        self._call = compiled if calling is None else calling(compiled)
        self._pass_report = report
        self._report: Report | None = None  # with XLA's verdicts, made when first asked
        self._target = target
        self.device = device  # set when compiled for a device this machine lacks
        self.compile_seconds = compile_seconds
        self.history_shape: tuple[int, ...] | None = None  # AmpLowered.history_shape
        self.chosen_options = dict(chosen_options or {})

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if self.device is not None:
            raise RuntimeError(not_runnable(self.device, "report()", "Call the compiled "
                                            "function itself, or .lower() without target="))
        if self.history_shape is not None:
            _check_history_first(args, self.history_shape)
        return self._call(*args, **kwargs)

    def as_text(self) -> str:
        """XLA's optimized HLO."""
        return self._compiled.as_text()

    def memory_analysis(self) -> Any:
        return self._compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        return self._compiled.cost_analysis()

    def report(self) -> Report:
        """The pass's report, with ``kept_by_xla`` and ``collectives`` filled in from the
        optimized HLO."""
        if self._report is None:
            report = copy.deepcopy(self._pass_report)
            try:
                hlo_text = self._compiled.as_text()
                mark_kept_by_xla(report, hlo_text, self._target,
                                 device=self.device.device if self.device else None)
                report.collectives = read_collectives(hlo_text)
            except Exception as error:  # noqa: BLE001  (advisory; never fail on it)
                report.notes.append(f"could not read XLA's optimized HLO: {error}")
            if self.chosen_options:
                flags = ", ".join(f"{k}={str(v).lower()}" for k, v in self.chosen_options.items())
                report.notes.append(
                    f"compiled with {flags}: hlo_amp's default for fp8 GEMMs on a GPU "
                    "(docs/fp8.md); .compile({...}) or XLA_FLAGS setting it overrides it")
            self._report = report
        return self._report

    @property
    def jax_compiled(self) -> Any:
        return self._compiled

    def __getattr__(self, name: str) -> Any:
        # The rest of jax's Compiled (input_shardings, out_info, ...), as jax has it.
        if name == "_executable":  # jax.experimental.serialize_executable.serialize reads it
            raise AttributeError(
                "_executable: an hlo_amp compiled object wraps jax's; serialize its "
                "jax_compiled (serialize_executable.serialize(compiled.jax_compiled)), which "
                "runs the rewritten program as jax's Compiled does, without hlo_amp's call "
                "(NNX and Equinox arguments, a delayed step's history check)")
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._compiled, name)


def _hashable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, or a function calling it where it cannot be hashed, as jax.jit's caches
    need (an Equinox module or bound method with array fields: .lower() and .trace()
    raised "unhashable type", where calls went through a closure of their own)."""
    try:
        hash(fn)
    except TypeError:
        @wraps_named(fn, updated=())
        def calling(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return calling
    return fn


def _check_history_first(args: tuple, shape: tuple[int, ...]) -> None:
    """A scaling=delayed step's compiled form takes its amax history first: a call
    without it says so (jax said its input pytree did not match)."""
    first = args[0] if args else None
    dtype = getattr(first, "dtype", None)
    # As jax takes it: NumPy's float64 zeros are f32 without x64.
    if (getattr(first, "shape", None) == shape and dtype is not None
            and str(jax.dtypes.canonicalize_dtype(dtype)) == "float32"):
        if (isinstance(first, jax.Array) and not isinstance(first, internals.Tracer)
                and first.is_deleted()):
            raise ValueError(
                "the amax history given first was donated to an earlier call (a step "
                "compiled with scaling=delayed donates its history): pass the history that "
                "call returned, or a copy kept before it")
        return
    given = (f"{first.dtype}{list(first.shape)}"
             if hasattr(first, "shape") and hasattr(first, "dtype")
             else "nothing" if not args else f"a {type(first).__name__}")
    history = f"f32{list(shape)}"
    raise TypeError(
        f"a step compiled with scaling=delayed takes its amax history first: "
        f"compiled(history, *args) returns (outputs, history), the history a {history} "
        f"(jnp.zeros({tuple(shape)}) to start, or the step's fp8_state()), and was given "
        f"{given} first. Calling the step hlo_amp.compile returned carries the "
        f"history itself")


class AmpLowered:
    """A lowered and rewritten function, like ``jax.jit(f).lower(...)``'s result."""

    def __init__(self, original: Any, rewritten: Any, report: Report,
                 pass_seconds: float, lower_seconds: float, target: Target = NO_TARGET,
                 device: Target | None = None, *, fp8: bool = False):
        self._target = target
        self._fp8 = fp8  # the policy has fp8 actions (Target.live_compiler_options)
        self.device = device  # set when lowered for a device this machine lacks
        self._original = original
        self._rewritten = rewritten
        self._report = report
        self.pass_seconds = pass_seconds
        self.lower_seconds = lower_seconds
        # An NNX or Equinox step's lowering is its inner function's, of pure state; this
        # makes the compiled form take the caller's objects, as nnx.jit's and
        # eqx.filter_jit's do (runtime/frameworks.py sets it).
        self.calling: Callable[[Callable], Callable] | None = None
        # A scaling=delayed step's (runtime/fp8_state.py sets it): the shape of the amax
        # history its compiled form takes first.
        self.history_shape: tuple[int, ...] | None = None

    def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        """The rewritten module: StableHLO, or ``dialect="hlo"`` (as jax's ``as_text``)."""
        return _lowered_text(self._rewritten, dialect, debug_info)

    def original_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        """The module as JAX lowered it, before the pass."""
        return _lowered_text(self._original, dialect, debug_info)

    def __getattr__(self, name: str) -> Any:
        # The rest of jax's Lowered (compiler_ir, cost_analysis, out_info, args_info, ...)
        # of the rewritten module.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._rewritten, name)

    def report(self) -> Report:
        return self._report

    def compile(self, compiler_options: dict[str, Any] | None = None) -> AmpCompiled:
        """XLA's compile of the rewritten module; ``compiler_options`` (XLA flags, as for
        ``jax.jit(...).lower(...).compile``) override a device target's defaults, e.g.
        ``{"xla_gpu_enable_triton_gemm": True}``."""
        start = time.perf_counter()
        if self.device:
            defaults = self.device.compiler_options
        else:
            defaults = self._target.live_compiler_options(self._fp8)
        options = {**defaults, **(compiler_options or {})}
        if self.device:
            compiled = compile_lowered(self._rewritten, options or None)
        else:
            compiled = self._rewritten.compile(options or None)
        seconds = time.perf_counter() - start
        # The defaults hlo_amp chose for this machine's device, as the report says.
        chosen = {k: v for k, v in defaults.items() if options[k] == v} if not self.device else {}
        compiled = AmpCompiled(compiled, self._report, seconds, self._target, self.device,
                               self.calling, chosen_options=chosen)
        compiled.history_shape = self.history_shape
        return compiled

    @property
    def jax_lowered(self) -> Any:
        return self._rewritten


class AmpTraced:
    """``AmpFunction.trace``'s result, like ``jax.jit(f).trace(...)``'s."""

    def __init__(self, function: AmpFunction, args: tuple, kwargs: dict, traced: Any):
        self._function, self._args, self._kwargs, self._traced = function, args, kwargs, traced
        # The configuration it was traced under (x64, matmul precision, the mesh): a
        # lowering for a device traces again, which it must do under the same.
        self._context = (internals.program_context(), internals.mesh_context())
        # Why jax's lowering options (jax.export) are refused, where not the default's.
        self.export_refusal: str | None = None
        self.history_shape: tuple[int, ...] | None = None  # AmpLowered.history_shape
        # A stateful (scaling=delayed) step's lowering for a device target: its history
        # has that target's width, not this machine's.
        self.lower_for_target: Callable[[Any], AmpLowered] | None = None

    def __getattr__(self, name: str) -> Any:
        """The rest of jax's ``Traced`` (``args_info``, ``in_tree``, ``out_tree``, ...)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._traced, name)

    @property
    def jaxpr(self) -> Any:
        """The program before the pass (the pass rewrites the lowered module)."""
        return self._traced.jaxpr

    @property
    def out_info(self) -> Any:
        return self._traced.out_info

    def lower(self, *, target: str | Target | None = None, **jax_options: Any) -> AmpLowered:
        """Lower and rewrite, as ``AmpFunction.lower_for(target, *args, **kwargs)``.
        jax's lowering options (``lowering_platforms``, which ``jax.export.export``
        passes) are refused in one line: they are a ``jax.jit`` of the step's."""
        if jax_options and self.export_refusal is not None:
            raise TypeError(self.export_refusal)
        if jax_options:
            name = self._function.__name__
            public = sorted(k for k in jax_options if not k.startswith("_")) or ["_private"]
            raise TypeError(
                f"jax.export.export takes a jax.jit function: export jax.jit({name}), "
                f"which exports the rewritten program ({name}.trace(...).lower() takes "
                f"target= only, not jax's lowering options: {', '.join(public)}; "
                f"jax.jit({name}).trace(...).lower(lowering_platforms=...) takes them)")
        if target is None:  # the program traced, as jax's Traced.lower lowers it
            lowered = self._function.lower_traced(self._traced)
        elif (internals.program_context(), internals.mesh_context()) != self._context:
            name = self._function.__name__
            raise ValueError(
                f"{name}.trace(...) was traced under another jax configuration (x64, "
                f"default_matmul_precision, the mesh, ...) than this .lower(target=...), "
                f"which traces again for the target: lower it where it was traced, or call "
                f"{name}.lower(..., target=...) there")
        elif self.lower_for_target is not None:
            return self.lower_for_target(target)
        else:
            lowered = self._function.lower_for(target, *self._args, **self._kwargs)
        lowered.history_shape = self.history_shape
        return lowered


def _lowered_text(lowered: Any, dialect: str | None, debug_info: bool) -> str:
    if dialect in (None, "stablehlo"):
        return module_text(lowered.compiler_ir("stablehlo"), debug_info=debug_info)
    if dialect == "hlo":
        return lowered.as_text(dialect="hlo", debug_info=debug_info)
    raise ValueError(f"dialect={dialect!r}; accepted: 'stablehlo' (the default), 'hlo'")


# ---- the compiled-function object -------------------------------------------------------


def _as_tuple(value: Any, scalar: type) -> tuple:
    return (value,) if isinstance(value, scalar) else tuple(value)


def _positions_of(signature: Any, names: tuple[str, ...], fn_name: str) -> tuple[int, ...]:
    """The positions of the parameters ``names`` (``donate_argnames``): the call donates
    by position, and an argument passed by keyword with it."""
    positional = {p.name: i for i, p in enumerate(positional_parameters(signature))}
    for name in names:
        if name not in positional:
            accepted = ", ".join(positional) or "none"
            raise ValueError(
                f"hlo_amp.compile({fn_name}): donate_argnames names {name!r}, which is no "
                f"positional parameter of {fn_name} (accepted: {accepted}; a keyword-only "
                f"or **kwargs parameter cannot be donated by name)")
    return tuple(positional[name] for name in names)


def _union(ours: Any, theirs: tuple, scalar: type) -> tuple:
    """``hlo_amp.compile``'s option and a decorator's: both apply, in order, once each."""
    return tuple(dict.fromkeys((*_as_tuple(ours, scalar), *theirs)))


class ProgramStore:
    """What the programs of one compiled function share (runtime/amp_call.py's
    ProgramOwner): its policy, and the exports and trees they are rewritten into.

    A program holds its store, never the compiled function: jax caches the function's
    traces weakly keyed on its dispatch function, a trace holds its programs, and a way
    from a program back to that dispatch would keep the function, its executables and
    its traces alive for good.
    """

    def __init__(self, policy: Policy):
        self.policy = policy
        self.exports: dict[Any, Any] = {}
        self.out_trees: dict[Any, Any] = {}
        # jax.jit's names of a call's results (``result[1]['w']``), as it traced them
        self.result_names: dict[Any, list[str]] = {}
        self.residual_trees: dict[Any, Any] = {}
        # per forward program's export (jax.grad's): its first and last matrix ops
        self.end_stacks: dict[Any, EndStacks] = {}
        # checkify's checked jaxpr of a program and its output tree (amp_call.py)
        self.checked: dict[Any, tuple[Any, Any]] = {}
        self.lowerings = 0

    def clear(self) -> None:
        for cache in (self.exports, self.out_trees, self.result_names, self.residual_trees,
                      self.end_stacks, self.checked):
            cache.clear()

    def tracing(self) -> Any:
        """While ``fn`` is traced: under a policy that may fuse attention,
        ``jax.nn.dot_product_attention(implementation="cudnn")`` on f32 arrays traces as
        jax's XLA attention, which the fused-attention pass turns into cuDNN's kernel in
        16 bit where the target has it (jax itself refuses f32 arrays there)."""
        if self.policy.fuse_attention and self.policy.may_fuse_attention:
            return internals.xla_attention_for_f32()
        return contextlib.nullcontext()

    @staticmethod
    def _program_key(program: Program, avals: AvalsKey) -> tuple:
        """A program's cache key for ``avals`` in this trace context: as for jax.jit, a
        changed configuration (x64, jax.default_matmul_precision) traces anew."""
        return (program.key, avals, internals.program_context())

    def export_program(self, program: Program, avals: AvalsKey,
                       platforms: tuple[str, ...] | None = None, devices: int = 1) -> Any:
        """``program`` exported for ``avals`` and rewritten, for ``platforms`` (None, or
        jax's default backend alone: the default export) and a caller partitioned over
        ``devices`` (an outer jax.jit with shardings); cached."""
        key = self._program_key(program, avals)
        if platforms == (jax_export.default_export_platform(),):  # "cuda", not "gpu"
            platforms = None
        cache_key = (key if platforms is None and devices == 1
                     else (key, platforms) if devices == 1 else (key, platforms, devices))
        exported = self.exports.get(cache_key)
        if exported is None:
            shapes = shape_structs(avals)
            try:
                # A fresh source context: a transformation's rule runs under the
                # caller's traceback, which would name every op of the program after
                # the call site (no user line: the ends of a backward program could
                # not be told apart, ir/program_hints.py).
                with self.tracing(), internals.fresh_source_info():
                    exported = jax_export.export(jax.jit(program.fn),
                                                 platforms=platforms)(*shapes)
            except Exception as error:
                if _export_refused(error):
                    raise ExportRefused(str(error).splitlines()[0]) from error
                raise
            self.lowerings += 1
            # The serialised portable artifact reads back 3x faster than the text.
            module = internals.deserialize_portable_artifact(
                exported.mlir_module_serialized, new_context())
            if program.argument_names is not None:
                self._name_leaves(module, program, avals, exported)
            else:  # jax's positional names (``primals[0]``) say nothing of a result's
                unname_arguments(next(fn for fn in functions(module)
                                      if function_name(fn) == "main"))
            if is_forward_program(program):  # what a backward program split from it needs
                self.end_stacks[key] = end_stacks(module, self.policy)
            if program.backward_of is not None:
                self._mark_backward(module, program.backward_of, exported)
            if devices > 1:
                mark_caller_devices(module, devices)
                if self.policy.reduce is not None:
                    warnings.warn(
                        f"hlo_amp.compile({program.name}) is lowered inside a jax.jit "
                        f"partitioned over {devices} devices, whose partitioner adds the "
                        f"all-reduces after the rewrite: reduce={self.policy.reduce} does "
                        f"not reach them. Compile the outer function, or call the compiled "
                        f"function on sharded arrays, for reduce=", stacklevel=2)
            target = platforms_target(exported.platforms)
            # As lower(target=...) refuses it: an export for a TPU is compiled there,
            # among other platforms too (their target is the CPU's, or none).
            for platform in exported.platforms:
                refuse_policy_on_device(self.policy, platforms_target((platform,)))
            report = run_pipeline(module, self.policy, target=target)
            if program.backward_of is None and not any(
                    d.direction == "backward" for d in report.decisions):
                # A program without a gradient op (a jax.grad's forward, a jvp) leaves
                # backward= to the backward program exported beside it ("matched no op"
                # was warned where the rule applied); a backward program, or one that
                # holds gradient ops (vmap of a compiled jax.grad), is told as ever.
                report.rules_used.add("backward")
            warn_unused_rules(report)
            exported = dataclasses.replace(
                exported, mlir_module_serialized=internals.export_module_to_bytecode(module))
            self.exports[cache_key] = exported
        return exported

    def _name_leaves(self, module: ir.Module, program: Program, avals: AvalsKey,
                     exported: Any) -> None:
        """Give the export of a call's whole function the names jax.jit gives its
        arguments and results (``params['w']``, ``result[1]['w']``): the passes read a
        parameter's by them (passes/propagate/graph.py ``_find_parameters``), and the
        same call lowered (``.lower``) has them."""
        results = self.result_names.get((program.key, avals))
        if results is None:
            return
        main = next(fn for fn in functions(module) if function_name(fn) == "main")
        arguments = main.regions[0].blocks[0].arguments
        kept = list(exported.module_kept_var_idx)
        # jax.export puts its own arguments (platform index, tokens) before the kept ones
        first = len(arguments) - len(kept)
        name_leaves(main, {first + position: program.argument_names[index]
                           for position, index in enumerate(kept)}, results)

    def _mark_backward(self, module: ir.Module, backward_of: BackwardOf,
                       exported: Any) -> None:
        """Tell the passes which arguments of a backward program are cotangents and
        where its forward's ends are (ir/program_hints.py)."""
        forward_key = self._program_key(backward_of.forward, backward_of.avals)
        if forward_key not in self.end_stacks:  # the forward was exported by another run
            self.export_program(backward_of.forward, backward_of.avals)
        kept = list(exported.module_kept_var_idx)
        main = next(fn for fn in functions(module) if function_name(fn) == "main")
        # jax.export puts its own arguments (platform index, tokens) before the kept ones.
        first = len(main.regions[0].blocks[0].arguments) - len(kept)
        cotangents = [first + position for position, index in enumerate(kept)
                      if index >= backward_of.residuals]
        mark_backward_program(main, cotangents, self.end_stacks.get(forward_key, {}))

    def out_avals(self, program: Program, avals: AvalsKey) -> list:
        """Output avals of ``program``: from its export if there is one, else traced.

        Tracing in the caller's context matters: under an outer ``vmap`` with a named
        axis, ``fn`` alone can be traced but not exported.
        """
        exported = self.exports.get(self._program_key(program, avals))
        if exported is not None:
            return list(exported.out_avals)
        # jax.jit caches this trace, and export_program's export of the same function
        # reuses it: the same fresh source context as there.
        with internals.fresh_source_info():
            shapes = jax.eval_shape(program.fn, *shape_structs(avals))
        return [internals.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type,
                                      sharding=explicit_sharding(x)) for x in shapes]

    def _residuals(self, program: Program, avals: AvalsKey) -> tuple[Any, tuple]:
        """The tree of ``program``'s vjp residuals for ``avals`` and their types."""
        key = self._program_key(program, avals)
        if key not in self.residual_trees:  # traced through a cached export: trace again
            forward = functools.partial(jax.vjp, program.fn)
            with internals.fresh_source_info():  # as export_program traces it
                closed, shapes = jax.make_jaxpr(lambda *xs: forward(*xs)[1], return_shape=True)(
                    *shape_structs(avals))
            self.residual_trees[key] = (jax.tree_util.tree_structure(shapes),
                                        tuple(closed.out_avals))
        return self.residual_trees[key]

    def residual_tree(self, program: Program, avals: AvalsKey) -> Any:
        return self._residuals(program, avals)[0]

    def residual_avals(self, program: Program, avals: AvalsKey) -> tuple:
        return self._residuals(program, avals)[1]

    def record_residuals(self, program: Program, avals: AvalsKey, tree: Any,
                         residual_avals: tuple) -> None:
        self.residual_trees[self._program_key(program, avals)] = (tree, residual_avals)

    def checked_program(self, key: Any, avals: AvalsKey,
                        make: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        """checkify's checked form of the program ``key`` for ``avals``, made once."""
        key = (key, avals, internals.program_context())
        if key not in self.checked:
            self.checked[key] = make()
        return self.checked[key]


class AmpFunction:
    """What ``hlo_amp.compile`` returns: callable like ``jax.jit(fn)``."""

    def __init__(self, fn: Callable[..., Any], policy: Policy | str | Mapping[str, Any],
                 *, static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Sequence[str] = (),
                 donate_argnums: int | Sequence[int] = (),
                 donate_argnames: str | Sequence[str] = (),
                 filter: bool | None = None, decorator: JitDecorator | None = None):
        """``decorator``: the options of a framework's jit decorator that wrapped the
        function ``fn`` wraps in turn (the delayed-scaling step's, runtime/fp8_state.py),
        where ``fn`` itself is not decorated."""
        if not callable(fn):
            raise TypeError(f"hlo_amp.compile expects a callable, got {fn!r}")
        # A step decorated with @nnx.jit / @eqx.filter_jit / @jax.jit: compile what the
        # decorator wraps, with its static and donated arguments, so it runs as the
        # undecorated step would (the decorator's own jit would hide the step from the
        # framework contracts below, and its static arguments would meet tracers).
        self.decorator: JitDecorator | None = decorator or unwrap_jit(
            fn, function_name_of(fn))
        if self.decorator is not None:
            fn = self.decorator.fn
            static_argnums = _union(static_argnums, self.decorator.static_argnums, int)
            static_argnames = _union(static_argnames, self.decorator.static_argnames, str)
            donate_argnums = _union(donate_argnums, self.decorator.donate_argnums, int)
            filter = self.decorator.filter if filter is None else filter
        self.fn = fn
        self.policy = as_policy(policy)
        self.filter = filter
        self._framework_calls: dict[str, Any] = {}  # "nnx" / "filter" -> its call
        self._pure = False  # True for the function a framework's wrapper calls (_inner)
        self._styles: dict[Any, str] = {}  # argument structure -> "jax" / "nnx" / "filter"
        self.static_argnums = ((static_argnums,) if isinstance(static_argnums, int)
                               else tuple(static_argnums))
        self.static_argnames = ((static_argnames,) if isinstance(static_argnames, str)
                                else tuple(static_argnames))
        self.donate_argnums = ((donate_argnums,) if isinstance(donate_argnums, int)
                               else tuple(donate_argnums))
        signature = self._signature = signature_of(fn)
        if signature is not None:
            # As jax.jit: an argument static by position is static by name too, and the
            # other way round, unless both were given.
            self.static_argnums, self.static_argnames = (
                internals.infer_argnums_and_argnames(
                    signature, self.static_argnums or None, self.static_argnames or None))
        if donate_argnames:
            self.donate_argnums = _union(self.donate_argnums, _positions_of(
                signature, _as_tuple(donate_argnames, str),
                function_name_of(fn)), int)
        # A jax.jit step's shardings and device apply to the call itself, as jax.jit's.
        placement = _placement(self.decorator, self.static_argnums, signature)
        self._jitted = _jit(_hashable(fn), placement, static_argnums=self.static_argnums,
                            static_argnames=self.static_argnames,
                            donate_argnums=self.donate_argnums)
        self._cache: dict[Any, AmpCompiled] = {}
        self._programs = ProgramStore(self.policy)
        # jax's caches of abstract evaluations hold programs and exports (ProgramStore):
        # they go with the function, at the next compiled function's creation or call.
        weakref.finalize(self, internals.forget_exported_calls_later).atexit = False
        internals.forget_exported_calls()
        # Not the function's __dict__: a callable object's attributes (nnx.jit's
        # static_argnums, filter_jit's fn) would overwrite this object's own.
        functools.update_wrapper(self, fn, updated=())
        self.__name__, self.__qualname__ = function_name_of(fn), function_qualname_of(fn)

        def dispatched(*args: Any, **kwargs: Any) -> Any:
            return self._traced_call(args, kwargs, own_dispatch=True)

        # jax.jit's errors name the function ("argument w of f"), not this closure.
        dispatched.__name__, dispatched.__qualname__ = self.__name__, self.__qualname__
        # jax.jit donates an argument passed by keyword through the names it reads from
        # the signature (``*args, **kwargs`` has none); a callable without one gets
        # catch-alls no argument is named (a keyword "args" met dispatched's own
        # ``*args``: jax's debug info raised an AssertionError).
        dispatched.__signature__ = signature if signature is not None else CATCH_ALL

        self._dispatched, self._placement = dispatched, placement
        # The jax.jit dispatches (_dispatch), made at the first call: with this machine's
        # XLA flags (True) or, for a call under another trace, none (False).
        self._dispatch_jits: dict[bool, Any] = {}
        self._live_options: dict[str, Any] | None = None
        # jax.export refuses host callbacks; such functions are rewritten from
        # jax.jit's lowering instead and dispatched from our own cache.
        self._through_lowering = False
        # The meshes (internals.mesh_context) under which the export is a program for
        # several devices: calls under them take that path too, others the dispatch.
        self._lowering_meshes: set[tuple] = set()
        # So are calls with arrays sharded over several devices (_sharded); once one
        # was seen, each call checks its arguments before the dispatch.
        self._sharded_calls = False
        self._refused_traces = 0

    # -- NNX's and Equinox's contracts (runtime/frameworks.py) --

    @property
    def lowerings(self) -> int:
        """How many times fn was lowered (cache misses), framework-style calls included."""
        return self._programs.lowerings + sum(call.inner.lowerings
                                         for call in self._framework_calls.values())

    def _framework_call(self, style: str) -> NnxCall | FilterCall:
        call = self._framework_calls.get(style)
        if call is None:
            if style == "nnx":
                modes = dict(self.decorator.nnx_modes) if self.decorator else None
                call = NnxCall(self.fn, self._inner, static_argnums=self.static_argnums,
                               static_argnames=self.static_argnames,
                               donate_argnums=self.donate_argnums, modes=modes)
            else:
                # Static arguments hold no arrays, and every non-array leaf of a filtered
                # call is static already: they mix (a @jax.jit step with static_argnums
                # taking an Equinox module was refused).
                call = FilterCall(self.fn, self._inner, donate_argnums=self.donate_argnums,
                                  donation=self.decorator.donation if self.decorator else None,
                                  static=(self.static_argnums, self.static_argnames),
                                  name=self.__name__)
            self._framework_calls[style] = call
        return call

    def _inner(self, fn: Callable[..., Any], **jit_options: Any) -> AmpFunction:
        """The rewritten function a framework's wrapper calls with pure arguments."""
        options = {"static_argnums": self.static_argnums,
                   "static_argnames": self.static_argnames,
                   "donate_argnums": self.donate_argnums, **jit_options}
        inner = AmpFunction(fn, self.policy, filter=False, **options)
        inner.__name__ = self.__name__
        # Pure arguments, taken as jax.jit takes them: in NNX's tree mode they are the
        # modules themselves (pytrees), which would make the inner function an NnxCall
        # of its own, and so on without end.
        inner._pure = True
        return inner

    def _style(self, args: tuple, kwargs: dict) -> str:
        """How this call's arguments are taken (``argument_style``); "jax" for the
        function a framework's wrapper calls."""
        if self._pure:
            return "jax"
        return argument_style(args, kwargs, self.filter, self._styles)

    # -- signatures --

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """The dynamic arguments and the static ones' key: each value with its type, as
        jax.jit keys them (1, 1.0 and True are equal, and trace different programs)."""
        dyn_args, dyn_kwargs, static_args, static_kwargs = split_static(
            args, kwargs, self.static_argnums, self.static_argnames)
        return dyn_args, dyn_kwargs, (tuple((i, type(v), v) for i, v in static_args),
                                      tuple((k, type(v), v) for k, v in static_kwargs))

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list, Any, Any]:
        """Dynamic args and kwargs, their leaves and treedef, and the cache key."""
        dyn_args, dyn_kwargs, static_key = self._split(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        # Committed or not, as jax.jit keys it: the outputs of a call with uncommitted
        # arrays are uncommitted.
        key = (treedef, tuple((leaf_signature(x), isinstance(x, jax.Array)
                               and not isinstance(x, internals.Tracer) and x.committed)
                              for x in leaves), static_key,
               internals.program_context(), internals.mesh_context())
        return dyn_args, dyn_kwargs, leaves, treedef, key

    @property
    def _dispatch(self) -> Any:
        """Calls go through jax.jit's own dispatch (its C++ cache of executables); a
        cache miss traces ``dispatched``, which binds the rewritten program. Made at the
        first call, when this machine's backend is known: its XLA flags are the
        target's for the policy (``Target.live_compiler_options``, as
        ``AmpLowered.compile``'s). A call under another trace (jax.jit, grad, scan) is
        staged into that trace's compile, and jax refuses flags on a nested jit: such
        calls take a jit without them."""
        if self._live_options is None:
            target = platforms_target((jax.default_backend(),))
            self._live_options = target.live_compiler_options(self.policy.uses_fp8)
        flagged = bool(self._live_options) and internals.trace_state_clean()
        jitted = self._dispatch_jits.get(flagged)
        if jitted is None:
            jitted = self._dispatch_jits[flagged] = _jit(
                self._dispatched, self._placement, static_argnums=self.static_argnums,
                static_argnames=self.static_argnames, donate_argnums=self.donate_argnums,
                **({"compiler_options": self._live_options} if flagged else {}))
        return jitted

    def cache_size(self) -> int:
        """How many executables are cached, one per input signature (like jax.jit's)."""
        # jax.jit counts the traces the dispatch refused (sharded arguments, an export
        # jax refuses), which hold no executable.
        made = sum(internals.jit_cache_size(jitted) for jitted in self._dispatch_jits.values())
        dispatched = max(made - self._refused_traces, 0)
        return (dispatched + len(self._cache)
                + sum(call.inner.cache_size() for call in self._framework_calls.values()))

    def clear_cache(self) -> None:
        """Drop every executable and rewritten program (as jax.jit's ``clear_cache``)."""
        self._cache.clear()
        self._programs.clear()
        self._jitted.clear_cache()
        for jitted in self._dispatch_jits.values():
            jitted.clear_cache()
        self._refused_traces = 0
        for call in self._framework_calls.values():
            call.inner.clear_cache()

    def trace(self, /, *args: Any, **kwargs: Any) -> AmpTraced:
        """``fn`` traced for these arguments, as ``jax.jit(fn).trace``: its jaxpr and
        output shapes (the pass keeps them), and ``.lower()`` to rewrite it."""
        if self._style(args, kwargs) != "jax":
            raise TypeError(f"{self.__name__}.trace takes arrays and pytrees of them; for "
                            f"NNX or Equinox arguments use .lower(...) or .eval_shape(...)")
        # as _lower traces it (f32 cuDNN attention)
        with self._arguments_named(args, kwargs, "jax"), self._programs.tracing():
            traced = self._jitted.trace(*args, **kwargs)
        return AmpTraced(self, args, kwargs, traced)

    def eval_shape(self, /, *args: Any, **kwargs: Any) -> Any:
        """The outputs' shapes and dtypes, as the framework's jit gives them (the pass
        keeps them): ``jax.ShapeDtypeStruct`` leaves, nothing compiled."""
        style = self._style(args, kwargs)
        with self._arguments_named(args, kwargs, style):
            if style == "nnx":
                return self._framework_call(style).wrapped.eval_shape(*args, **kwargs)
            if style != "jax":
                import equinox as eqx  # filtered arguments: Equinox is there

                return eqx.filter_eval_shape(self.fn, *args, **kwargs)
            return self._jitted.eval_shape(*args, **kwargs)

    # -- AOT --

    def lower(self, /, *args: Any, **kwargs: Any) -> AmpLowered:
        """Lower ``fn`` for these arguments and rewrite it (like ``jax.jit().lower``).

        ``target="h100"`` (``"h200"``, ``"a100"``, a ``GpuTargetConfig`` file's path, or a
        TPU: ``"tpu-v4"``, ``"tpu-v5e"``, ``"tpu-v5p"``, ``"tpu-v6e"``) lowers and compiles
        for that device without one: arrays or ``jax.ShapeDtypeStruct`` arguments,
        replicated on one device of it; the result can be read, not run. A node, nodes or
        a slice (``"h100x8"``, ``"h100:2x8"``, ``"tpu-v5e:4x4"``) compiles for all its
        devices, arguments sharded on ``hlo_amp.target_mesh(target, axes)`` keeping their
        shardings. A ``target`` parameter of ``fn`` takes ``target=`` instead; then
        ``lower_for(device, *args)`` names the device.
        """
        device, kwargs = split_device_target(self.fn, kwargs)
        return self.lower_for(device, *args, **kwargs)

    def lower_for(self, target: str | Target | None, /, *args: Any, **kwargs: Any
                  ) -> AmpLowered:
        """``lower(*args, **kwargs)`` for the device ``target`` (None: this machine's),
        every keyword argument ``fn``'s."""
        device = device_target(target) if target is not None else None
        style = self._style(args, kwargs)
        with self._arguments_named(args, kwargs, style):
            if style != "jax":
                return self._framework_call(style).lower(args, kwargs, device)
            return self._lower(args, kwargs, device)

    def lower_traced(self, traced: Any) -> AmpLowered:
        """A program ``trace`` traced, lowered for this machine and rewritten."""
        return self._lower((), {}, traced=traced)

    def _lower(self, args: tuple, kwargs: dict, device: Target | None = None,
               traced: Any = None) -> AmpLowered:
        start = time.perf_counter()
        with self._programs.tracing():
            if device is None:
                traced = traced if traced is not None else self._jitted.trace(*args, **kwargs)
                original = traced.lower()
                target = lowering_target(original)
            else:
                refuse_policy_on_device(self.policy, device)
                original = lower_for_target(self._jitted, args, kwargs, device,
                                            inner=getattr(self.fn, "amp_inner", self.fn))
                target = device
        lower_seconds = time.perf_counter() - start
        self._programs.lowerings += 1
        rewritten, report, pass_seconds = rewrite_lowered(original, self.policy, target)
        warn_unused_rules(report)
        return AmpLowered(original, rewritten, report, pass_seconds, lower_seconds, target,
                          device, fp8=self.policy.uses_fp8)

    # -- calls --

    def __deepcopy__(self, memo: dict) -> AmpFunction:
        """A compiled function of the same function and options, its caches empty (as
        ``copy.deepcopy`` of a ``jax.jit`` function gives one that compiles anew); the
        caches hold executables and jax objects that do not copy."""
        copied = AmpFunction(self.fn, self.policy, static_argnums=self.static_argnums,
                             static_argnames=self.static_argnames,
                             donate_argnums=self.donate_argnums, filter=self.filter,
                             decorator=self.decorator)
        copied._pure, copied.__name__ = self._pure, self.__name__
        return copied

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """A method decorated with it is bound to its instance, as under jax.jit."""
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if jax.config.jax_disable_jit:  # as jax.jit: the Python function runs op by op
            return self.fn(*args, **kwargs)
        internals.forget_exported_calls()
        style = self._style(args, kwargs)
        with self._arguments_named(args, kwargs, style):
            if style != "jax":
                return self._framework_call(style)(*args, **kwargs)
            return self._call(args, kwargs)

    @contextlib.contextmanager
    def _arguments_named(self, args: tuple, kwargs: dict, style: str) -> Iterator[None]:
        """A call, lowering or trace that fails on its arguments: one message naming an
        argument it cannot take, if any (jax's generic one otherwise)."""
        try:
            yield
        except (TypeError, ValueError):
            raise_argument_problem(self.__name__, args, kwargs,
                                   static_argnums=self.static_argnums,
                                   static_argnames=self.static_argnames, style=style,
                                   signature=self._signature)
            raise

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if not self._through_lowering and not (
                self._lowering_meshes and internals.mesh_context() in self._lowering_meshes
        ) and not (self._sharded_calls and _any_sharded((args, kwargs))):
            _DISPATCHING.call = (self, args, kwargs)  # what a cache miss's trace checks
            try:
                return self._dispatch(*args, **kwargs)
            except ShardedArguments:
                self._sharded_calls = True  # from now on checked before the dispatch
                self._refused_traces += 1
            except MeshExportRefused:
                self._lowering_meshes.add(internals.mesh_context())
                self._refused_traces += 1
            except ExportRefused:
                self._through_lowering = True
                self._refused_traces += 1
            finally:
                _DISPATCHING.call = None
        dyn_args, dyn_kwargs, leaves, _, key = self._flatten(args, kwargs)
        if any(isinstance(leaf, internals.Tracer) for leaf in leaves):
            return self._traced_call(args, kwargs)  # warns, and runs fn unchanged
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.lower_for(None, *args, **kwargs).compile()
            self._cache[key] = compiled
        return compiled(*dyn_args, **dyn_kwargs)

    def _bound(self, args: tuple, kwargs: dict, treedef: Any, key: Any
               ) -> Callable[..., list]:
        """``fn`` with static arguments bound, as a function of the flat dynamic leaves.

        It returns the flat output leaves and records their tree for ``key``.
        """
        statics = normalise_argnums(self.static_argnums, len(args))
        static_kwargs = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        # Not self: a program's function must not reach this object (ProgramStore).
        fn, out_trees = self.fn, self._programs.out_trees
        result_names = self._programs.result_names

        def flat_fn(*flat: Any) -> list:
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, flat)
            call_args = list(call_args)
            for i in statics:
                call_args.insert(i, args[i])
            named_leaves, out_tree = jax.tree_util.tree_flatten_with_path(
                fn(*call_args, **call_kwargs, **static_kwargs))
            out_trees[(key, avals_key(flat))] = out_tree
            # jax.jit's names of them, for the export (ProgramStore._name_leaves)
            result_names[(key, avals_key(flat))] = [
                "result" + keystr(path) for path, _ in named_leaves]
            return [leaf for _, leaf in named_leaves]

        flat_fn.__name__ = self.__name__
        # jax names a function by where its unwrapped code is: its errors (an output
        # that is no array) then point at the user's function, not at this wrapper.
        flat_fn.__wrapped__ = self.fn
        return flat_fn

    # -- calls with tracers --

    def _traced_call(self, args: tuple, kwargs: dict, *, own_dispatch: bool = False) -> Any:
        """Bind the amp_call primitive, so vmap/jvp/grad around it stay rewritten."""
        dyn_args, dyn_kwargs, static_key = self._split(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        key = ("call", treedef, static_key, internals.mesh_context())
        program = Program(self._programs, self._bound(args, kwargs, treedef, key),
                          self.__name__, key, argument_names=leaf_names(
                              self._signature, args, kwargs, self.static_argnums,
                              self.static_argnames))
        avals = avals_key(leaves)
        dispatching = getattr(_DISPATCHING, "call", None)
        if own_dispatch and dispatching and dispatching[0] is self and _any_sharded(
                dispatching[1:]):
            raise ShardedArguments  # before the export: the call lowers them itself
        try:
            exported = program.exported(avals)
            if own_dispatch and exported.nr_devices != 1:
                # A program with its own mesh (shard_map) must be lowered where JAX sees
                # that mesh: jax.jit's lowering, not a call inside our dispatch jit.
                raise MeshExportRefused(f"it was exported for {exported.nr_devices} devices")
        except ExportRefused as refused:  # e.g. host callbacks, which jax.export refuses
            if own_dispatch:
                raise
            warn_at_user_code(
                f"hlo_amp: cannot rewrite {self.__name__} under an outer transformation "
                f"({refused}); it runs unchanged")
            return self.fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            # fn may close over an outer trace's values (a step defined inside jax.jit
            # or jax.grad): those become arguments of the program, as jax.jit's closure
            # conversion makes them.
            # Traced here once, for both questions below.
            try:
                closed = jax.make_jaxpr(program.fn)(*leaves)
            except Exception:  # noqa: BLE001
                closed = None  # not these problems: the bind below raises its own error
            converted = None if closed is None else _with_closed_tracers_as_arguments(
                program.fn, closed)
            if converted is not None:
                fn, hoisted = converted
                program = Program(self._programs, fn, self.__name__, ("closure", key))
                outs = amp_call_p.bind(*vary_alike([*leaves, *hoisted]), program=program)
                return jax.tree_util.tree_unflatten(self._programs.out_trees[(key, avals)], outs)
            manual = (set() if closed is None else collective_axes(closed.jaxpr)) & set(
                jax.sharding.get_abstract_mesh().manual_axes)
            if manual:
                # Inside jax.shard_map or jax.pmap: a collective over their axes cannot
                # be exported alone (jax asserted in axis_groups when lowering it). One
                # over an inner vmap's axis is the vmap rule's to export.
                warn_at_user_code(
                    f"hlo_amp: cannot rewrite {self.__name__} inside jax.shard_map or "
                    f"jax.pmap (axes {', '.join(sorted(map(str, manual)))}: a collective "
                    f"over them is not exported alone); it runs unchanged. Compile the "
                    f"function that calls shard_map or pmap instead")
                return self.fn(*args, **kwargs)
            # Exported alone, fn may not trace (a collective over an outer vmap's named
            # axis); the transformation's own rule exports what is needed, and raises.
        outs = amp_call_p.bind(*vary_alike(leaves), program=program)
        return jax.tree_util.tree_unflatten(self._programs.out_trees[(key, avals)], outs)


def _with_closed_tracers_as_arguments(flat_fn: Callable[..., list], closed: Any
                                      ) -> tuple[Callable[..., list], list] | None:
    """``flat_fn`` (traced as ``closed``) as a function of its leaves and then of the
    outer trace's values it closes over (with those values), or None where it closes
    over none."""
    positions = [i for i, c in enumerate(closed.consts) if isinstance(c, internals.Tracer)]
    if not positions:
        return None
    consts = list(closed.consts)

    def converted(*flat: Any) -> list:
        given = list(consts)
        for position, value in zip(positions, flat[len(flat) - len(positions):]):
            given[position] = value
        return internals.eval_jaxpr(closed.jaxpr, given, *flat[:len(flat) - len(positions)])

    converted.__name__ = getattr(flat_fn, "__name__", "converted")
    return converted, [consts[i] for i in positions]


# Per thread, the compiled function being dispatched and its arguments (a module-level
# record, not the function's: a threading.local attribute would not deep-copy).
_DISPATCHING = threading.local()


def _any_sharded(tree: Any) -> bool:
    """Whether any array of ``tree`` is ``_sharded``."""
    return tree is not None and jax.device_count() > 1 and any(
        map(_sharded, jax.tree_util.tree_leaves(tree)))


def _sharded(leaf: Any) -> bool:
    """An array sharded over several devices outside an Explicit mesh: its sharding is
    not in its type, so only jax.jit's lowering of the concrete arguments writes it into
    the module, where the passes that read shardings (keep_shardings, scatter_select,
    reduce=) see it. (An export of its type alone is a one-device program.)"""
    if not isinstance(leaf, jax.Array) or isinstance(leaf, internals.Tracer):
        return False
    sharding = leaf.sharding
    return len(sharding.device_set) > 1 and explicit_sharding(jax.typeof(leaf)) is None


class ExportRefused(Exception):
    """jax.export cannot serialise the function (host callbacks, some effects), or the
    export cannot be called from our dispatch jit (a program with its own mesh)."""


class MeshExportRefused(ExportRefused):
    """The export is a program for several devices: one with its own mesh (shard_map),
    or one traced under a ``jax.set_mesh`` mesh, whose calls there take jax.jit's
    lowering (calls outside that mesh keep the dispatch)."""


class ShardedArguments(Exception):
    """A call's arrays are sharded over several devices outside an Explicit mesh: the
    call goes through jax.jit's lowering of them, not an export of their types."""


def _export_refused(error: Exception) -> bool:
    text = str(error)
    return any(marker in text for marker in (
        "custom call", "callback", "effects", "Cannot serialize", "not supported",
    ))


def _placement(decorator: JitDecorator | None, static_argnums: tuple[int, ...],
               signature: inspect.Signature | None) -> dict:
    """A jax.jit step's placement options for hlo_amp's own jits, whose static arguments
    may be more than the step's: its ``in_shardings``, one per dynamic argument of the
    step, lose those the extra static ones take (jax refused the tuple's length)."""
    if decorator is None:
        return {}
    placement = dict(decorator.placement)
    shardings = placement.get("in_shardings")
    count = len(positional_parameters(signature))
    if not isinstance(shardings, tuple) or not count or any(
            p.kind == p.VAR_POSITIONAL for p in signature.parameters.values()):
        return placement  # a negative position would stay unresolved: as given
    ours = set(normalise_argnums(static_argnums, count))
    steps = set(normalise_argnums(decorator.static_argnums, count))
    dynamic = [position for position in range(count) if position not in steps]
    if ours == steps or len(dynamic) != len(shardings):
        return placement
    placement["in_shardings"] = tuple(sharding for position, sharding in zip(
        dynamic, shardings, strict=True) if position not in ours)
    return placement


def _jit(fn: Callable[..., Any], placement: dict, **options: Any) -> Any:
    """``jax.jit(fn, **options)`` with a jax.jit step's ``placement`` (its device= was
    deprecated where the user wrote it: not warned about again here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(fn, **placement, **options)


def _jit_options_refused(given: dict) -> TypeError:
    """The error for keywords ``compile`` does not take: jax.jit's placement options
    are a jax.jit step's, whose shardings and device the call keeps."""
    names = ", ".join(f"{name}=" for name in given)
    if not set(given) <= set(PLACEMENT_OPTIONS):
        return TypeError(
            f"hlo_amp.compile got an unexpected keyword argument ({names}); it takes "
            "policy, static_argnums, static_argnames, donate_argnums, donate_argnames "
            "and filter")
    return TypeError(
        f"hlo_amp.compile takes no {names}: compile a jax.jit step given them "
        f"(hlo_amp.compile(jax.jit(step, {names}...), policy)), whose shardings and "
        "device place the call as under jax.jit, or place the arguments with "
        "jax.device_put")


def compile(fn: Callable[..., Any] | Policy | str | Mapping[str, Any] | None = None,
            policy: Policy | str | Mapping[str, Any] = "bf16", *,
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            donate_argnums: int | Sequence[int] = (),
            donate_argnames: str | Sequence[str] = (),
            filter: bool | None = None, **jit_options: Any) -> Any:
    """Like ``jax.jit(fn)``, but dot/conv ops run in the policy's precision.

    ``policy`` is a Policy, a string (``"bf16"``, ``"bf16,scope:head=float32"``) or a
    dict. The result has ``.lower(*args)`` for the rewritten module and its report.

    Arguments are taken as ``jax.jit`` takes them, Flax NNX graph objects as ``nnx.jit``
    does (updated in place), Equinox modules as ``eqx.filter_jit`` does (non-array leaves
    static); ``filter=True`` asks for the last for any pytree (runtime/frameworks.py).
    As a decorator: ``@hlo_amp.compile(policy="mixed_bfloat16")`` (or ``("bf16")``).
    An ``nnx.jit`` / ``eqx.filter_jit`` / ``jax.jit`` function is compiled as the function
    it wraps, with its decorator's static and donated arguments (``unwrap_jit``).
    """
    if jit_options:
        raise _jit_options_refused(jit_options)
    options = {"static_argnums": static_argnums, "static_argnames": static_argnames,
               "donate_argnums": donate_argnums, "donate_argnames": donate_argnames,
               "filter": filter}
    if fn is None or isinstance(fn, (Policy, str, Mapping)):
        chosen = policy if fn is None else fn  # @hlo_amp.compile("bf16")
        if fn is None:  # @hlo_amp.compile(policy=...): a bad policy is just that
            as_policy(chosen)
            return functools.partial(compile, policy=chosen, **options)
        try:
            as_policy(chosen)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"hlo_amp.compile expects a callable, got {fn!r}; as a decorator it takes "
                f"a policy: @hlo_amp.compile(policy='bf16') ({error})") from None
        return functools.partial(compile, policy=chosen, **options)
    chosen = as_policy(policy)
    if chosen.scaling == "delayed":  # the amax history travels between calls
        probe = AmpFunction(fn, chosen, **options)  # a decorator's statics and donations
        return Fp8StatefulFunction(probe.fn, chosen, make=AmpFunction,
                                   static_argnums=probe.static_argnums,
                                   static_argnames=probe.static_argnames,
                                   donate_argnums=probe.donate_argnums, filter=probe.filter,
                                   decorator=probe.decorator)
    return AmpFunction(fn, chosen, **options)
