"""jaxamp's API on hlo_amp: ``from hlo_amp import jaxamp_compat as jaxamp``.

jaxamp (0.0.4) re-evaluates a function's jaxpr op by op, calling a precision function
per op to cast its inputs. hlo_amp instead rewrites the compiled StableHLO by rule, so
``amp`` turns jaxamp's ``amp_policy`` into a ``hlo_amp.Policy`` and returns
``hlo_amp.compile(fn, policy)``:

- string keys are scope rules (a ``jax.named_scope`` segment; the outermost wins);
- JAX primitive keys are op rules on the StableHLO op they lower to
  (``jax.lax.dot_general_p`` -> ``dot_general``, ``jax.lax.add_p`` -> ``add``);
- values are ``use_compute_precision`` (action ``compute``), ``use_original_precision``
  (``keep``), ``use_precision(dtype)`` (that dtype) or an hlo_amp action name;
- ``"amp_default"`` is jaxamp's rule for every op not named: ``use_original_precision``
  (jaxamp's default) or ``use_compute_precision``.

Rules on ops other than dots and convolutions act through hlo_amp's propagation pass
(``propagate=true``): ``compute`` lets such an op run in 16 bit where it sits between
16-bit ops, rather than always, as jaxamp's cast does. See docs/jaxamp.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hlo_amp import policy as _policy
from hlo_amp.ir.op_classes import INFER, OP_CLASSES
from hlo_amp.runtime import scaler as _scaler
from hlo_amp.runtime.compile import compile as _compile
from hlo_amp.runtime.scaler import DynamicScalerState, all_finite, select_tree

__all__ = [
    "DynamicScalerState",
    "all_finite",
    "amp",
    "amp_stop",
    "default_amp_policy",
    "dynamic_scale_grad",
    "dynamic_scale_value_and_grad",
    "select_tree",
    "to_policy",
    "use_compute_precision",
    "use_original_precision",
    "use_precision",
]

# bfloat16 unless told otherwise, as hlo_amp.amp is specified (jaxamp 0.0.4's default is
# float16, which needs its loss scaler; bfloat16 trains without one).
DEFAULT_COMPUTE_DTYPE = jnp.bfloat16
AMP_DEFAULT = "amp_default"
_COMPUTE_DTYPES = ("bfloat16", "float16", "float32")

# JAX primitive name -> the StableHLO op kinds it lowers to, one to one. Primitives that
# share an op kind with others (the comparisons: ``compare``; the reductions: ``reduce``)
# are left out, since a rule on one would change them all; so are primitives jax lowers
# to several ops (``logistic``: negate, exponential, add and divide).
_PRIMITIVE_KINDS: dict[str, tuple[str, ...]] = {
    "dot_general": ("dot_general", "dot"),
    "conv_general_dilated": ("convolution",),
    **{name: (kind,) for name, kind in {
        "add": "add", "add_any": "add", "sub": "subtract", "mul": "multiply",
        "div": "divide", "neg": "negate", "abs": "abs", "sign": "sign", "max": "maximum",
        "min": "minimum", "exp": "exponential", "expm1": "exponential_minus_one",
        "log": "log", "log1p": "log_plus_one", "tanh": "tanh",
        "sqrt": "sqrt", "rsqrt": "rsqrt", "cbrt": "cbrt", "square": "square",
        "pow": "power", "sin": "sine", "cos": "cosine", "tan": "tan", "atan": "atan",
        "atan2": "atan2", "sinh": "sinh", "cosh": "cosh", "erf": "erf", "erfc": "erfc",
        "erf_inv": "erf_inv", "lgamma": "lgamma", "digamma": "digamma", "rem": "remainder",
        "floor": "floor", "ceil": "ceil", "is_finite": "is_finite", "select_n": "select",
        "clamp": "clamp", "reshape": "reshape", "transpose": "transpose",
        "broadcast_in_dim": "broadcast_in_dim", "concatenate": "concatenate", "pad": "pad",
        "slice": "slice", "dynamic_slice": "dynamic_slice",
        "dynamic_update_slice": "dynamic_update_slice", "gather": "gather",
        "rev": "reverse",
    }.items()},
}


def _precision_function(action: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a jaxamp-style precision function with the hlo_amp action it stands for."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn._hlo_amp_action = action  # type: ignore[attr-defined]
        return fn

    return mark


def _cast_floats(dtype: Any, tree: Any) -> Any:
    def cast(value: Any) -> Any:
        if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.inexact):
            return value.astype(dtype)
        return value

    return jax.tree_util.tree_map(cast, tree)


# The precision functions keep jaxamp's signature and effect when called directly; amp()
# reads only their mark, since hlo_amp never calls them per op.
@_precision_function(_policy.COMPUTE)
def use_compute_precision(compute_dtype: Any, original_dtypes: Any, *invars: Any,
                          **bind_params: Any) -> tuple[Any, dict[str, Any]]:
    """jaxamp's rule: run the op in the compute dtype (hlo_amp action ``compute``)."""
    bind_params = dict(_cast_floats(compute_dtype, bind_params))
    if "preferred_element_type" in bind_params:
        bind_params["preferred_element_type"] = compute_dtype
    return _cast_floats(compute_dtype, invars), bind_params


@_precision_function(_policy.KEEP)
def use_original_precision(compute_dtype: Any, original_dtypes: Any, *invars: Any,
                           **bind_params: Any) -> tuple[Any, dict[str, Any]]:
    """jaxamp's rule: run the op as written (hlo_amp action ``keep``)."""
    return [_cast_floats(dtype, value) for value, dtype in zip(invars, original_dtypes,
                                                               strict=True)], bind_params


def use_precision(dtype: Any) -> Callable[..., Any]:
    """jaxamp's rule: run the op in ``dtype`` whatever the compute dtype (that action)."""
    action = _policy.canonical_dtype(dtype)

    @_precision_function(action)
    def overridden_precision(compute_dtype: Any, *args: Any, **kwargs: Any) -> Any:
        return use_compute_precision(jnp.dtype(action), *args, **kwargs)

    return overridden_precision


# jaxamp 0.0.4's default: additions, subtractions and the matrix ops in the compute
# dtype; multiplications, divisions, exponentials and logs in f32; "amp_stop" and every
# other op as written.
default_amp_policy: dict[Any, Callable[..., Any]] = {
    **{p: use_compute_precision for p in (lax.add_p, lax.sub_p, lax.dot_general_p,
                                          lax.conv_general_dilated_p)},
    AMP_DEFAULT: use_original_precision,
    _policy.AMP_STOP: use_original_precision,
    **{p: use_precision(jnp.float32) for p in (lax.exp_p, lax.log_p, lax.mul_p, lax.div_p)},
}


def amp_stop(f: Callable[..., Any] | None = None) -> Any:
    """jaxamp's ``amp_stop``: ``with amp_stop():``, ``@amp_stop`` or ``@amp_stop()``."""
    return _policy.amp_stop(f)


def _key_name(key: Any) -> str:
    if _is_primitive(key):
        return f"{key.name}_p"
    return repr(key)


def _is_primitive(key: Any) -> bool:
    return hasattr(key, "bind") and isinstance(getattr(key, "name", None), str)


_ACCEPTED_VALUES = ("use_compute_precision, use_original_precision, use_precision(dtype), "
                    "or an action name (compute, keep, bfloat16, float16, float32)")


def _action(key: Any, value: Any) -> str:
    """The hlo_amp action for one ``amp_policy`` value."""
    marked = getattr(value, "_hlo_amp_action", None)
    if isinstance(marked, str):
        return marked
    where = f"amp_policy[{_key_name(key)}]"
    if isinstance(value, str):
        return _policy.canonical_action(value, where=where)
    if value is not None:  # jnp.dtype(None) is the default float: not a rule
        try:  # a dtype (jnp.float32 is callable, so dtypes are tried before callables)
            jnp.dtype(value)
        except TypeError:
            pass
        else:
            return _policy.canonical_action(value, where=where)
    raise ValueError(
        f"{where} is {value!r}, which hlo_amp cannot apply: it rewrites the compiled "
        f"program by rule and never calls a precision function per op; accepted: "
        f"{_ACCEPTED_VALUES}"
    )


def _op_kinds(key: Any) -> tuple[str, ...]:
    """The StableHLO op kinds a primitive key names."""
    kinds = _PRIMITIVE_KINDS.get(key.name)
    if kinds is None:
        raise ValueError(
            f"amp_policy key {key.name}_p: no rule for this primitive; accepted primitives "
            f"(each lowers to one StableHLO op kind): "
            f"{', '.join(name + '_p' for name in _PRIMITIVE_KINDS)}"
        )
    return kinds


def _compute_dtype(compute_dtype: Any) -> str:
    try:
        name = _policy.canonical_dtype(compute_dtype)
    except ValueError:
        name = None
    if name not in _COMPUTE_DTYPES:
        raise ValueError(
            f"Unsupported compute_dtype {compute_dtype!r}; accepted: jnp.bfloat16, "
            f"jnp.float16, jnp.float32 (or their names, e.g. 'bfloat16')"
        )
    return name


def to_policy(amp_policy: Mapping[Any, Any] | None = None, *,
              compute_dtype: Any = DEFAULT_COMPUTE_DTYPE) -> _policy.Policy:
    """The ``hlo_amp.Policy`` that ``amp`` compiles with for jaxamp's arguments."""
    dtype = _compute_dtype(compute_dtype)
    table = default_amp_policy if amp_policy is None else amp_policy
    if not isinstance(table, Mapping):
        raise TypeError(
            f"amp_policy must be a dict of scope name or JAX primitive -> precision "
            f"function, got {type(table).__name__}"
        )
    ops: dict[str, str] = {}
    scopes: dict[str, str] = {}
    fallback = _policy.KEEP
    for key, value in table.items():
        action = _action(key, value)
        if key == AMP_DEFAULT:
            if action not in (_policy.KEEP, _policy.COMPUTE):
                raise ValueError(
                    f"amp_policy['amp_default'] is {value!r}; accepted: "
                    f"use_original_precision or use_compute_precision"
                )
            fallback = action
        elif isinstance(key, str):
            if key != _policy.AMP_STOP or action != _policy.KEEP:  # built into hlo_amp
                scopes[key] = action
        elif _is_primitive(key):
            for kind in _op_kinds(key):
                ops[kind] = action
        else:
            raise TypeError(
                f"amp_policy key {key!r} ({type(key).__name__}): accepted keys are scope "
                f"names (str) and JAX primitives such as jax.lax.dot_general_p"
            )
    propagate = fallback == _policy.COMPUTE or any(k not in _policy.OP_KINDS for k in ops)
    for kind in _policy.OP_KINDS:
        if fallback == _policy.COMPUTE:
            ops.setdefault(kind, _policy.COMPUTE)
    if propagate and fallback == _policy.KEEP:
        # jaxamp runs every op it is not told about as written: so that propagation
        # does not paint the arithmetic ones, they are kept. Data movement (reshape,
        # transpose...) is exact in any dtype and may still join a 16-bit region.
        for kind, cls in OP_CLASSES.items():
            if cls == INFER:
                ops.setdefault(kind, _policy.KEEP)
    if dtype == "float32":  # jaxamp with compute_dtype=float32: "compute" means f32
        ops = {k: "float32" if a == _policy.COMPUTE else a for k, a in ops.items()}
        scopes = {k: "float32" if a == _policy.COMPUTE else a for k, a in scopes.items()}
        dtype = "bfloat16"  # a Policy needs a 16-bit compute dtype; no rule uses it now
    try:
        return _policy.Policy(compute_dtype=dtype, ops=ops, scopes=scopes,
                              propagate=propagate)
    except ValueError as error:
        raise ValueError(f"amp_policy cannot be expressed as an hlo_amp policy: {error}") \
            from None


def amp(fn: Callable[..., Any] | None = None, *, compute_dtype: Any = DEFAULT_COMPUTE_DTYPE,
        amp_policy: Mapping[Any, Any] | None = None) -> Any:
    """jaxamp's ``amp``: ``fn`` with the policy's ops in ``compute_dtype``.

    Returns ``hlo_amp.compile(fn, to_policy(amp_policy, compute_dtype=...), filter=True)``:
    called directly it compiles and caches like ``jax.jit``; under ``jax.jit``,
    ``jax.grad`` and the scaler it composes. Non-array leaves of the arguments are static,
    as jaxamp treats them. ``amp_policy=None`` is ``default_amp_policy``. Without ``fn``
    it is a decorator: ``@amp(compute_dtype=jnp.bfloat16)``.
    """
    policy = to_policy(amp_policy, compute_dtype=compute_dtype)
    if fn is None:
        return functools.partial(amp, compute_dtype=compute_dtype, amp_policy=amp_policy)
    if not callable(fn):
        raise TypeError(f"amp expects a function, got {type(fn).__name__}")
    return _compile(fn, policy, filter=True)


def dynamic_scale_grad(fun: Callable[..., Any], *, has_aux: bool = False,
                       redo_on_nan: int = 0, filter: bool = True,
                       **kwargs: Any) -> Callable[..., Any]:
    """``hlo_amp.dynamic_scale_grad`` with jaxamp's defaults (``filter=True``)."""
    return _scaler.dynamic_scale_grad(fun, has_aux=has_aux, redo_on_nan=redo_on_nan,
                                      filter=filter, **kwargs)


def dynamic_scale_value_and_grad(fun: Callable[..., Any], *, has_aux: bool = False,
                                 redo_on_nan: int = 10, filter: bool = True,
                                 **kwargs: Any) -> Callable[..., Any]:
    """``hlo_amp.dynamic_scale_value_and_grad`` with jaxamp's defaults (``filter=True``,
    ``redo_on_nan=10``)."""
    return _scaler.dynamic_scale_value_and_grad(fun, has_aux=has_aux,
                                                redo_on_nan=redo_on_nan, filter=filter,
                                                **kwargs)
