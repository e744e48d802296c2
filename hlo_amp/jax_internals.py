"""Every JAX API hlo_amp uses that JAX does not promise to keep, in one place.

Each entry and why we need it:

- ``stages.Lowered(lowering, args_info, out_tree, no_kwargs=)``, ``Lowered._lowering``,
  ``Lowering._hlo``, ``Lowering._executable``, ``Lowering._platforms``: ``.lower()``
  swaps the rewritten module into JAX's own lowering so that JAX's compile path keeps
  shardings, donation and effects (there is no public way to compile a modified module
  with a function's calling convention).
- ``export._export._module_to_bytecode``: serialises a rewritten module into an
  ``Exported`` the way ``jax.export`` does.
- ``lib._jax.mlir.deserialize_portable_artifact``: reads ``jax.export`` artifacts.
- ``_cache_size()`` of a ``jax.jit`` function: ``AmpFunction.cache_size()`` counts the
  executables behind calls, which live in ``jax.jit``'s own cache.
- ``core.ShapedArray``, ``core.Tracer`` and ``core.trace_state_clean``: abstract values
  of a program's outputs, and telling a traced call from a concrete one (a delayed
  step called inside ``jax.jit`` with closed-over arrays only has no tracer argument).
- The primitive machinery behind ``runtime/amp_call.py`` — ``interpreters.ad``
  (``primitive_jvps``, ``primitive_transposes``, ``Zero``, ``instantiate_zeros``),
  ``interpreters.batching.fancy_primitive_batchers`` and ``interpreters.mlir``
  (``register_lowering``, ``lower_fun``): how a rewritten program composes with
  ``vmap``, ``jvp``, ``linearize`` and ``grad``.
- ``lax._convert_element_type(operand, new_dtype, weak_type)``: the loss scaler gives
  back a weakly typed gradient as jax.grad does (runtime/scaler.py).
- ``core.eval_jaxpr``: a function that closes over an outer trace's values runs as
  its jaxpr with those values as arguments (runtime/compile.py).
- ``config.trace_context`` and ``trace_context_names``: ``program_context``, the
  configuration a trace reads (x64, default matmul precision), in the export and
  measurement cache keys as in jax.jit's.
- ``core.ManualAxisType`` (an aval's ``mat``, or ``vma`` where a jax has that instead):
  ``varying_axes`` and ``with_varying``, the manual (shard_map) axes a value varies
  along, which the amp_call primitive's outputs take from its inputs as a jax.jit's do.
- ``mesh.get_concrete_mesh``: ``mesh_context``, the mesh ``jax.set_mesh`` set (with its
  devices' order), in a call's key as in jax.jit's; ``jax.sharding.get_mesh`` refuses to
  answer inside a trace, where hlo_amp binds its call.
- ``api_util.infer_argnums_and_argnames``: static arguments by position and by name
  complete each other as under jax.jit (``AmpFunction``).
- ``source_info_util._source_info_context`` and ``new_source_info``: ``fresh_source_info``, so
  that a program exported inside a transformation's rule (``jax.grad`` of a compiled
  function) keeps its ops' own source lines (runtime/compile.py ``export_program``).
- ``_jit_info`` of a ``jax.jit`` function (``jax._src.pjit``): the static and donated
  arguments of a step decorated with ``jax.jit``, ``nnx.jit`` or ``eqx.filter_jit``
  (runtime/frameworks.py ``unwrap_jit``); where it is missing, a decorated NNX or
  Equinox step gets the error that says to replace the decorator.
- ``xla_bridge.backends_are_initialized`` and
  ``xla_bridge._discover_and_register_pjrt_plugins``: hlo_amp/quiet_stderr.py's
  ``start_jax`` loads the plugins early, behind a filter of the CUDA stub's lines, on a
  machine without a GPU or TPU; looked up there with ``getattr``, so a jax without them
  only brings the noise back.
- ``cudnn.fused_attention_stablehlo`` (``dot_product_attention``, ``MaskType``,
  ``check_cudnn_version``, ``check_compute_capability`` and, where this jax has it,
  ``is_cuda_compute_capability_equal``): targets/attention_kernels.py lowers jax's own
  cuDNN attention for the fused-attention pass; without a GPU the version and
  capability checks jax makes while tracing are answered for the target
  (``cudnn_checks_answered``), since the public ``jax.nn.dot_product_attention`` cannot
  be lowered for a GPU this machine lacks.
- ``checkify.error_checks``, ``checkify.jaxpr_to_checkify_jaxpr``, ``init_error``,
  ``update_error`` and ``next_code`` (optional: looked up with ``getattr``): ``checkify.checkify`` of a compiled function checks its program
  rewritten, as it checks a ``jax.jit``'s jaxpr (runtime/amp_call.py); without them it
  saw one opaque call and dropped every error inside.
- ``nn.functions.cudnn_dot_product_attention`` and ``_dot_product_attention_xla``: what
  ``jax.nn.dot_product_attention(implementation="cudnn")`` calls, and jax's XLA attention;
  ``xla_attention_for_f32`` routes the first to the second for f32 arrays while
  hlo_amp traces a program (runtime/compile.py), so that such a call reaches the
  fused-attention pass instead of jax's f32 refusal.
- ``config.persistent_cache_min_compile_time_secs`` as a context (optional: looked up
  with ``getattr``): ``no_persistent_cache_entry`` keeps a deviceless compile out of the
  persistent compilation cache, whose entry no later process can read back (jax's
  compile-only client cannot deserialise it: a UserWarning and a recompile at each hit).

The MLIR side (a context with JAX's dialects, an op's address, Shardy's propagation) is
imported without jax: hlo_amp/jaxlib_internals.py lists it.
``check()`` (run where hlo_amp is imported, and by ``hlo-amp-opt`` where it needs jax) turns
a missing entry of either list into one clear error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jax._src import api_util, core, source_info_util, stages
from jax._src import config as jax_config
from jax._src import mesh as mesh_lib
from jax._src.export import _export as export_internals
from jax._src.interpreters import ad, batching, partial_eval
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lax import lax as lax_internal
from jax._src.lib import _jax

from hlo_amp import jaxlib_internals

SUPPORTED_JAX = "0.10.2 to 0.12.x"

# name -> (the object or None when this jax lacks it, parameter names it must accept, or
# None for "exists"). Filled by ``_needs`` below, so the table and the names agree and a
# missing entry reaches ``check()`` instead of failing this import.
ENTRY_POINTS: dict[str, tuple[Any, tuple[str, ...] | None]] = {}


def _needs(module: Any, qualified: str, attribute: str,
           parameters: tuple[str, ...] | None = None) -> Any:
    found = getattr(module, attribute, None)
    ENTRY_POINTS[f"{qualified}.{attribute}"] = (found, parameters)
    return found


Primitive = _needs(jax.extend.core, "jax.extend.core", "Primitive")
ShapedArray = _needs(core, "jax._src.core", "ShapedArray", ("shape", "dtype"))
Tracer = _needs(core, "jax._src.core", "Tracer")
# Optional: a jax whose avals carry ``vma`` in place of ``mat`` has no need of it.
_ManualAxisType = getattr(core, "ManualAxisType", None)
trace_state_clean = _needs(core, "jax._src.core", "trace_state_clean", ())
eval_jaxpr = _needs(core, "jax._src.core", "eval_jaxpr", ("jaxpr", "consts"))
# The configuration a trace depends on (x64, default matmul precision, ...): part of
# jax.jit's cache keys, and of ours (program_context below).
_trace_context = _needs(jax_config, "jax._src.config", "trace_context")
_trace_context_names = _needs(jax_config, "jax._src.config", "trace_context_names")
_concrete_mesh = _needs(mesh_lib, "jax._src.mesh", "get_concrete_mesh", ())
# jax.jit's completion of static/donated argument numbers from names and back.
infer_argnums_and_argnames = _needs(api_util, "jax._src.api_util",
                                    "infer_argnums_and_argnames", ("sig", "argnums", "argnames"))
_source_info_context = _needs(source_info_util, "jax._src.source_info_util",
                              "_source_info_context")
_new_source_info = _needs(source_info_util, "jax._src.source_info_util", "new_source_info", ())
_needs(stages.Lowered, "jax._src.stages.Lowered", "__init__",
       ("lowering", "args_info", "out_tree", "no_kwargs"))
export_module_to_bytecode = _needs(export_internals, "jax._src.export._export",
                                   "_module_to_bytecode", ("module",))
# Abstract evaluations cached with their parameters as keys (4,096 kept each): an
# Exported.call's hold its Exported.
_call_exported_abstract_eval = _needs(export_internals, "jax._src.export._export",
                                      "_call_exported_abstract_eval")
_cached_abstract_eval = _needs(partial_eval, "jax._src.interpreters.partial_eval",
                               "_cached_abstract_eval")
register_lowering = _needs(jax_mlir, "jax._src.interpreters.mlir", "register_lowering",
                           ("prim", "rule"))
lower_fun = _needs(jax_mlir, "jax._src.interpreters.mlir", "lower_fun",
                   ("fun", "multiple_results"))
deserialize_portable_artifact = _needs(getattr(_jax, "mlir", None), "jax._src.lib._jax.mlir",
                                       "deserialize_portable_artifact")
Zero = _needs(ad, "jax._src.interpreters.ad", "Zero")
instantiate_zeros = _needs(ad, "jax._src.interpreters.ad", "instantiate_zeros", ("tangent",))
primitive_jvps = _needs(ad, "jax._src.interpreters.ad", "primitive_jvps")
primitive_transposes = _needs(ad, "jax._src.interpreters.ad", "primitive_transposes")
fancy_primitive_batchers = _needs(batching, "jax._src.interpreters.batching",
                                  "fancy_primitive_batchers")
# A cast that keeps a weak type (jax.grad's gradient of a Python-number primal): the
# public convert_element_type makes every result strongly typed.
convert_element_type = _needs(lax_internal, "jax._src.lax.lax", "_convert_element_type",
                              ("operand", "new_dtype", "weak_type"))

# checkify's rules per primitive and its checked form of a jaxpr: ``checkify.checkify``
# of a compiled function checks the rewritten program (runtime/amp_call.py). Optional:
# where this jax lacks them, checkify sees the call as one opaque primitive, as before.
try:
    from jax._src import checkify as _checkify
except ImportError:  # pragma: no cover - every supported jax has it
    _checkify = None
checkify_rules = getattr(_checkify, "error_checks", None)
jaxpr_to_checkify_jaxpr = getattr(_checkify, "jaxpr_to_checkify_jaxpr", None)
checkify_init_error = getattr(_checkify, "init_error", None)  # the empty error
checkify_update_error = getattr(_checkify, "update_error", None)  # first error wins
checkify_next_code = getattr(_checkify, "next_code", None)  # errors numbered as traced

from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention
from jax._src.nn import functions as _nn_functions

_needs(_cudnn_attention, "jax._src.cudnn.fused_attention_stablehlo", "dot_product_attention",
       ("query", "key", "value", "bias", "scale", "mask_type", "qkv_layout"))
_needs(_cudnn_attention, "jax._src.cudnn.fused_attention_stablehlo", "MaskType")
_needs(_cudnn_attention, "jax._src.cudnn.fused_attention_stablehlo", "check_cudnn_version", ())
_needs(_cudnn_attention, "jax._src.cudnn.fused_attention_stablehlo",
       "check_compute_capability", ("capability",))
_needs(_nn_functions, "jax._src.nn.functions", "cudnn_dot_product_attention",
       ("query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen", "scale",
        "mask_type", "sliding_window_length"))
_needs(_nn_functions, "jax._src.nn.functions", "_dot_product_attention_xla",
       ("query", "key", "value", "bias", "mask", "is_causal", "scale", "q_seqlen",
        "kv_seqlen", "local_window_size"))

# Optional: where this jax lacks it, a deviceless compile writes its cache entry as before.
_min_compile_seconds = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)


@contextlib.contextmanager
def no_persistent_cache_entry() -> Iterator[None]:
    """No persistent compilation cache entry written for compiles inside (where the cache
    is on): the threshold of compile seconds an entry needs is made infinite meanwhile,
    in this thread."""
    if _min_compile_seconds is None:
        yield
        return
    with _min_compile_seconds(float("inf")):
        yield


def swap_module(lowered: Any, module: Any) -> Any:
    """A ``stages.Lowered`` like ``lowered`` whose module is ``module``."""
    import copy

    lowering = copy.copy(lowered._lowering)
    lowering._hlo = module
    lowering._executable = None
    return stages.Lowered(lowering, lowered.args_info, lowered.out_tree,
                          no_kwargs=lowered._no_kwargs)


@contextlib.contextmanager
def fresh_source_info() -> Iterator[None]:
    """A context in which traced ops take the Python stack as it is and an empty name
    stack, as at the top level: a transformation's rule otherwise runs under its
    caller's traceback (``source_info_util.user_context``, which cannot clear it), and
    a program hlo_amp exports there would name every op after that one call site."""
    saved = _source_info_context.context
    _source_info_context.context = _new_source_info()
    try:
        yield
    finally:
        _source_info_context.context = saved


def program_context() -> tuple:
    """The configuration a program's trace reads, as jax.jit keys its cache on it, less
    the context managers' entries (mesh, compute_on, ...): jax's lowering sets an
    abstract mesh where the trace had none, and the avals carry the shardings. Where
    this jax cannot name the entries, the whole trace context."""
    values = _trace_context()
    try:
        names = _trace_context_names()
    except NotImplementedError:
        return values
    if len(names) != len(values):
        return values
    return tuple(values[i] for i in _program_positions(names))


def varying_axes(aval: Any) -> frozenset:
    """The manual (shard_map) axes ``aval`` varies along; empty outside shard_map."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_varying(aval: Any, axes: frozenset) -> Any:
    """``aval`` varying along ``axes`` (its unreduced and reduced axes kept), typed on
    the shard_map's mesh where it has no mesh of its own (a manual axis needs one)."""
    mat = getattr(aval, "mat", None)
    if mat is None:
        return aval.update(vma=axes)
    sharding = aval.sharding
    if getattr(sharding.mesh, "empty", False):
        sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(),
                                              jax.sharding.PartitionSpec(*[None] * aval.ndim))
    return aval.update(sharding=sharding, manual_axis_type=_ManualAxisType(
        varying=axes, unreduced=mat.unreduced, reduced=mat.reduced))


def mesh_context() -> tuple:
    """The mesh ``jax.set_mesh`` set where a function is called, abstract and concrete
    (its devices' order), which its trace reads (a bare ``PartitionSpec`` in
    ``with_sharding_constraint``, ``get_abstract_mesh()``): part of a call's key, as of
    jax.jit's; ``program_context`` leaves the mesh out."""
    return (jax.sharding.get_abstract_mesh(), _concrete_mesh())


@functools.lru_cache(maxsize=8)
def _program_positions(names: tuple[str, ...]) -> tuple[int, ...]:
    """The positions ``program_context`` keeps, read once per set of names (it runs on
    every call of a function hlo_amp dispatches from its own cache)."""
    return tuple(i for i, name in enumerate(names)
                 if not name.endswith("_context_manager") and name != "user_context")


_FORGET = threading.Event()


def forget_exported_calls_later() -> None:
    """Ask ``forget_exported_calls`` to drop jax's caches of abstract evaluations, which
    hold each ``Exported.call``'s Exported, and the traces and lowerings it reached,
    after the function that made them is gone (about 1.3 MiB a compiled function, up to
    4,096 of them). Later, not here: a finalizer runs wherever the collector does,
    inside one of those caches' own lookups too."""
    _FORGET.set()


def forget_exported_calls() -> None:
    """Drop the caches ``forget_exported_calls_later`` asked for, if it did."""
    if _FORGET.is_set():
        _FORGET.clear()
        _call_exported_abstract_eval.cache_clear()
        _cached_abstract_eval.cache_clear()


def jit_cache_size(jitted: Any) -> int:
    """How many executables a ``jax.jit`` function holds (``AmpFunction.cache_size``)."""
    return jitted._cache_size()


def lowering_platforms(lowered: Any) -> tuple[str, ...]:
    """The platforms a ``jax.jit(...).lower()`` result was lowered for."""
    return tuple(getattr(lowered._lowering, "_platforms", ()) or ())


def lowering_backend(lowered: Any) -> str | None:
    """The platform of the backend a ``jax.jit(...).lower()`` result compiles with (its
    device assignment's: a jit's own shardings name devices); None if not known."""
    backend = getattr(lowered._lowering, "compile_args", {}).get("backend")
    return getattr(backend, "platform", None)


def cudnn_attention_module() -> Any:
    """jax's cuDNN attention module (``jax._src.cudnn.fused_attention_stablehlo``)."""
    return _cudnn_attention


# Held while jax's module attributes are patched (two threads tracing at once must not
# restore each other's patches midway).
_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def cudnn_checks_answered(compute_capability: tuple[int, int] | None, cudnn_version: int,
                          active: bool = True) -> Iterator[None]:
    """While tracing jax's cuDNN attention for a GPU compiled for without it: its cuDNN
    version check returns ``cudnn_version`` and its compute-capability checks compare
    with ``compute_capability``. With ``compute_capability=None`` (the GPU of this
    machine) or ``active=False`` nothing is changed."""
    if not active or compute_capability is None:
        yield
        return
    module = _cudnn_attention
    names = ("check_cudnn_version", "check_compute_capability",
             "is_cuda_compute_capability_equal")
    saved = {name: getattr(module, name) for name in names if hasattr(module, name)}

    def parse(capability: str) -> tuple[int, ...]:
        return tuple(int(part) for part in capability.split("."))

    answers = {"check_cudnn_version": lambda: cudnn_version,
               "check_compute_capability": lambda c: compute_capability >= parse(c),
               "is_cuda_compute_capability_equal": lambda c: compute_capability == parse(c)}
    with _PATCH_LOCK:
        try:
            for name in saved:
                setattr(module, name, answers[name])
            yield
        finally:
            for name, original in saved.items():
                setattr(module, name, original)



@contextlib.contextmanager
def xla_attention_for_f32() -> Iterator[None]:
    """While hlo_amp traces a program: ``jax.nn.dot_product_attention(...,
    implementation="cudnn")`` on f32 arrays runs jax's XLA attention (same mask, scale,
    sequence lengths and window) instead of raising that cuDNN takes 16-bit arrays only;
    the fused-attention pass then puts cuDNN's kernel back in 16 bit where the policy
    and the target allow. Other dtypes reach cuDNN as written."""
    original = _nn_functions.cudnn_dot_product_attention

    def routed(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None,
               *args, scale=1.0, mask_type=None, sliding_window_length=None, **kwargs):
        if not all(jnp.dtype(x.dtype) == jnp.float32 for x in (query, key, value)):
            return original(query, key, value, bias, mask, q_seqlen, kv_seqlen, *args,
                            scale=scale, mask_type=mask_type,
                            sliding_window_length=sliding_window_length, **kwargs)
        name = getattr(mask_type, "name", "")
        causal = name in ("CAUSAL", "PADDING_CAUSAL")
        # cuDNN's window is the left one, exclusive (nn.functions's own conversion).
        window = None if sliding_window_length is None else (sliding_window_length - 1, 0)
        residual = bool(kwargs.get("return_residual", False))
        # Only a jax that has the residual option passes it (older ones have no name).
        extra = {"return_residual": True} if residual else {}
        out = _nn_functions._dot_product_attention_xla(
            query, key, value, bias, mask, is_causal=causal, scale=scale,
            q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, local_window_size=window, **extra)
        if residual:  # cuDNN's log-sum-exp is [B, N, T]; the caller transposes it back
            out, lse = out
            return out, jnp.transpose(lse, (0, 2, 1))
        return out

    with _PATCH_LOCK:
        _nn_functions.cudnn_dot_product_attention = routed
        try:
            yield
        finally:
            _nn_functions.cudnn_dot_product_attention = original
def missing_entry_points() -> list[str]:
    """Each entry point that is absent or no longer takes the parameters we pass."""
    missing = []
    for name, (obj, params) in ENTRY_POINTS.items():
        if obj is None:
            missing.append(f"{name} is gone")
            continue
        if params is None:
            continue
        try:
            accepted = inspect.signature(obj).parameters
        except (TypeError, ValueError):  # a builtin without a signature: existence only
            continue
        lacking = [p for p in params if p not in accepted]
        if lacking:
            missing.append(f"{name} takes no {', '.join(lacking)}")
    return missing


def check() -> None:
    """Raise one ImportError naming the jax version and what is missing, if anything."""
    missing = missing_entry_points() + jaxlib_internals.missing_entry_points()
    if missing:
        raise ImportError(
            f"hlo_amp needs jax {SUPPORTED_JAX}; found {jax.__version__}: "
            + "; ".join(missing))
