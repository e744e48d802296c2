"""The cache key of one argument leaf and the split of a call's static arguments, shared
by the compiled-function objects."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

# The signature a wrapper of a callable without one shows jax: catch-alls under names
# no argument passed by keyword has (``*args, **kwargs`` met a keyword "args").
CATCH_ALL = inspect.Signature([
    inspect.Parameter("hlo_amp_positional", inspect.Parameter.VAR_POSITIONAL),
    inspect.Parameter("hlo_amp_keywords", inspect.Parameter.VAR_KEYWORD)])


def signature_of(fn: Callable[..., Any]) -> inspect.Signature | None:
    """``fn``'s signature, or None where Python cannot tell it (some builtins)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def leaf_signature(leaf: Any) -> Any:
    """Shape, dtype, weak type and sharding of an array leaf; the type of a Python
    scalar, which jax.jit traces as a weakly typed argument (what a new executable is
    compiled for: a new value, a NaN included, is not)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        shape = tuple(leaf.shape)
        return (shape, dtype_name(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
                _sharding_key(sharding, len(shape)))
    return (type(leaf).__name__,)


def dtype_name(dtype: Any) -> str:
    """``str(dtype)``, remembered: NumPy's takes microseconds, and a call whose key is
    made in Python (a delayed-scaling step's) asks it for every leaf."""
    try:
        return _remembered_str(dtype)
    except TypeError:  # a dtype that cannot be hashed
        return str(dtype)


@functools.cache
def _remembered_str(dtype: Any) -> str:
    return str(dtype)


def _sharding_key(sharding: Any, ndim: int) -> Any:
    """``sharding`` as a key in which equivalent specs are equal: ``P()`` and
    ``P(None, None)`` (a step fed its own output, which jax writes the long way on an
    Explicit mesh, compiled a second time). ``PartitionSpec`` equates ``("x",)`` with
    ``"x"`` itself; only the trailing ``None`` entries need filling in."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = sharding.spec
    if len(spec) >= ndim:
        return sharding
    return sharding.update(spec=spec.update(partitions=(*spec, *(None,) * (ndim - len(spec)))))


def normalise_argnums(argnums: int | Sequence[int], count: int) -> tuple[int, ...]:
    """``argnums`` as positions among ``count`` positional arguments; those beyond them
    (an argument given by keyword or left to its default) are dropped, as jax.jit does."""
    if isinstance(argnums, int):
        argnums = (argnums,)
    return tuple(sorted({a + count if a < 0 else a for a in argnums} & set(range(count))))


def split_static(args: tuple, kwargs: dict, static_argnums: Sequence[int],
                 static_argnames: Sequence[str]) -> tuple[tuple, dict, tuple, tuple]:
    """(the dynamic positional arguments, the dynamic keyword arguments, the static ones
    as (position, value) pairs, the static keyword ones as (name, value) pairs by name)."""
    statics = normalise_argnums(static_argnums, len(args))
    return (tuple(a for i, a in enumerate(args) if i not in statics),
            {k: v for k, v in kwargs.items() if k not in static_argnames},
            tuple((i, args[i]) for i in statics),
            tuple(sorted(((k, v) for k, v in kwargs.items() if k in static_argnames),
                         key=lambda item: item[0])))


def leaf_names(signature: inspect.Signature | None, args: tuple, kwargs: dict,
               static_argnums: Sequence[int], static_argnames: Sequence[str]) -> list[str]:
    """The names ``jax.jit`` gives the dynamic argument leaves of a call, in flattening
    order: the exported flat function a call runs has only ``args[i]``. As jax's
    ``api_util._non_static_arg_names`` makes them: ``params['w']``; ``data[0]`` for the
    first argument a ``*data`` takes and ``kw['x']`` for a keyword a ``**kw`` takes
    (review h129: ``args[1]`` and ``x`` made another pairing of arguments and results);
    ``args[i]`` and ``kwargs['x']`` where the call does not bind to the signature."""
    static = object()
    statics = normalise_argnums(static_argnums, len(args))
    marked_args = [static if i in statics else a for i, a in enumerate(args)]
    marked_kwargs = {k: static if k in static_argnames else v for k, v in kwargs.items()}
    ordered = None
    if signature is not None:
        try:
            bound = signature.bind(*marked_args, **marked_kwargs)
        except TypeError:
            pass
        else:
            var_keyword = next((p.name for p in signature.parameters.values()
                                if p.kind == p.VAR_KEYWORD), None)
            ordered = [(name, value) for name, value in bound.arguments.items()
                       if name not in marked_kwargs and name != var_keyword]
            ordered += [(name if name in bound.arguments else f"{var_keyword}['{name}']",
                         value) for name, value in sorted(marked_kwargs.items())]
    if ordered is None:
        ordered = [("args", marked_args), *((f"kwargs['{name}']", value)
                                           for name, value in sorted(marked_kwargs.items()))]
    return [name + keystr(path) for name, value in ordered
            for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]
            if leaf is not static]


def keystr(path: Sequence[Any]) -> str:
    """A pytree path as jax names an argument or result with it (``['w'][0]``; a node
    without keys' ``<flat index 1>`` as ``1``)."""
    return re.sub(r"<flat index ([^>]+)>", r"\1", jax.tree_util.keystr(tuple(path)))


def positional_parameters(signature: inspect.Signature | None) -> list[inspect.Parameter]:
    """The parameters ``signature`` takes by position, in order (none for no signature;
    a ``*args`` is not one)."""
    if signature is None:
        return []
    return [p for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def donated_names(signature: inspect.Signature | None, donate_argnums: Sequence[int]
                  ) -> frozenset[str]:
    """The names of the parameters ``donate_argnums`` donates by position: jax.jit donates
    them when passed by keyword too (a positional-only one cannot be)."""
    positional = positional_parameters(signature)
    donated = normalise_argnums(donate_argnums, len(positional))
    return frozenset(p.name for i, p in enumerate(positional)
                     if i in donated and p.kind == p.POSITIONAL_OR_KEYWORD)
