"""One actionable message for an argument a compiled function cannot take.

Run only after a call failed (a correct call pays nothing): it names the argument's
position or path and type and says what would work, instead of JAX's message about the
internal jitted function.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from hlo_amp.runtime.frameworks import argument_style
from hlo_amp.runtime.signature import normalise_argnums, positional_parameters

_CONTRACTS = ("a compiled function takes arrays and pytrees of them (as jax.jit does), "
              "Flax NNX graph objects (as nnx.jit does) and Equinox modules (as "
              "eqx.filter_jit does)")


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")


def _describe(value: Any) -> str:
    if isinstance(value, jax.Array):
        return f"a jax.Array of dtype {value.dtype}"
    if isinstance(value, np.ndarray):  # of a dtype jax has no type for (str, object)
        return f"a numpy.ndarray of dtype {value.dtype}"
    name = _type_name(value)
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _is_jax_value(leaf: Any) -> bool:
    try:
        jax.typeof(leaf)
    except (TypeError, ValueError):  # ValueError: an object with __jax_array__
        return False
    return True


def _array_like_problem(name: str, where: str, leaf: Any) -> str | None:
    """The message for an object jax converted through ``__jax_array__`` (a Keras
    Variable), which jax no longer does when it traces; None for another leaf."""
    if not hasattr(type(leaf), "__jax_array__"):
        return None
    return (f"hlo_amp.compile({name}): argument {where} is {_describe(leaf)}, which jax "
            f"does not trace as an array (it converts __jax_array__ objects no more); pass "
            f"its array: jnp.asarray(...), or a Keras Variable's .value "
            f"([v.value for v in model.trainable_variables]).")


def _unhashable(value: Any) -> str | None:
    try:
        hash(value)
    except TypeError as error:
        return str(error)
    return None


def _arrays_inside(value: Any) -> list[tuple[str, Any]]:
    found = jax.tree_util.tree_flatten_with_path(value)[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in found
            if isinstance(leaf, jax.Array)]


def _static_problem(name: str, where: str, root: str, fix: str, value: Any) -> str | None:
    error = _unhashable(value)
    if error is None:
        return None
    arrays = _arrays_inside(value)
    if arrays:
        path, leaf = arrays[0]
        return (f"hlo_amp.compile({name}): static argument {where} holds {_describe(leaf)} "
                f"at {root}{path}; arrays (PRNG keys included) cannot be static: they are "
                f"traced, not hashed. Pass it as a dynamic argument ({fix}).")
    return (f"hlo_amp.compile({name}): static argument {where} is {_describe(value)}, "
            f"which is not hashable ({error}); static arguments key the compile cache. "
            f"Pass a hashable value (a tuple instead of a list, a frozen dataclass), or make "
            f"it a dynamic argument ({fix}).")


def _holds_graph(value: Any) -> bool:
    """Whether ``value`` is or holds an NNX graph object (a module, an optimizer): what
    takes nnx.jit's contract (``argument_style``)."""
    return argument_style((value,), {}, None) == "nnx"


def _parameter_names(signature: inspect.Signature | None, count: int) -> list[str]:
    """For each of ``count`` positional arguments, ``" (parameter w)"`` where the
    signature names it, else ``""``: jax's errors name the parameter."""
    names = [parameter.name for parameter in positional_parameters(signature)]
    return [f" (parameter {names[i]})" if i < len(names) else "" for i in range(count)]


def argument_problem(name: str, args: tuple, kwargs: dict, *, static_argnums: Sequence[int],
                     static_argnames: Sequence[str], style: str,
                     signature: inspect.Signature | None = None) -> str | None:
    """The message for the first argument the call cannot take, or None if all are fine."""
    statics = set(static_argnums)  # normalised by the caller (non-negative positions)
    named = _parameter_names(signature, len(args))
    for i, arg in enumerate(args):
        if i in statics:
            problem = _static_problem(name, f"{i}{named[i]}", f"args[{i}]",
                                      f"drop {i} from static_argnums", arg)
            if problem:
                return problem
    for key, value in kwargs.items():
        if key in static_argnames:
            problem = _static_problem(name, f"{key!r}", f"kwargs[{key!r}]",
                                      f"drop {key!r} from static_argnames", value)
            if problem:
                return problem
    dynamic = ([(f"args[{i}]", a, named[i]) for i, a in enumerate(args) if i not in statics]
               + [(f"kwargs[{k!r}]", v, "") for k, v in kwargs.items()
                  if k not in static_argnames])
    for root, value, parameter in dynamic:
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            if _is_jax_value(leaf):
                continue
            where = root + jax.tree_util.keystr(path) + parameter
            error = _unhashable(leaf) if style == "filter" else None
            # (filter=True makes a hashable one static, as eqx.filter_jit does)
            array_like = (None if style == "filter" and not error
                          else _array_like_problem(name, where, leaf))
            if array_like:
                return array_like
            if style == "filter":
                if error:
                    return (f"hlo_amp.compile({name}): argument {where} is "
                            f"{_describe(leaf)}, which the eqx.filter_jit-style call makes "
                            f"static, but it is not hashable ({error}). Make it hashable, or "
                            f"an array (static leaves key the compile cache).")
            elif style == "statics only" and _holds_graph(value):
                # Inside an NNX graph object: nnx.jit traces every data attribute too.
                return (f"hlo_amp.compile({name}): argument {where} is {_describe(leaf)}, "
                        f"not an array, in an NNX object's data (nnx.data, a Variable), "
                        f"which nnx.jit traces as hlo_amp.compile does; store it as an "
                        f"attribute that is not data (nnx.static(...), or a plain "
                        f"attribute of a type NNX keeps static), or as an array.")
            else:
                position = root.removeprefix("args[").split("]")[0]
                static_hint = (f"static_argnums=({position},)" if root.startswith("args[")
                               else f"static_argnames=({root[8:-2]!r},)")
                what = ("an array of a dtype jax has no type for" if isinstance(leaf, np.ndarray)
                        else "not an array")
                return (f"hlo_amp.compile({name}): argument {where} is {_describe(leaf)}, "
                        f"{what}; {_CONTRACTS}. If it is configuration, pass it with "
                        f"{static_hint}; if it is a container, register it as a pytree; or "
                        f"compile with filter=True to make every non-array leaf static.")
    return None


def raise_argument_problem(name: str, args: tuple, kwargs: dict, *,
                           static_argnums: Sequence[int], static_argnames: Sequence[str],
                           style: str, signature: inspect.Signature | None = None) -> None:
    """After a failed call: raise one TypeError naming an argument it cannot take, if
    any (``style``: the call's ``argument_style``; ``signature``: the step's, whose
    parameters name its positions)."""
    problem = argument_problem(
        name, args, kwargs, static_argnums=normalise_argnums(static_argnums, len(args)),
        static_argnames=static_argnames, style=style if style != "nnx" else "statics only",
        signature=signature)
    if problem:
        raise TypeError(problem) from None

