"""Train steps written the way Flax NNX and Equinox write them.

A compiled function takes its arguments by one of three contracts, chosen per call:

- ``"jax"``: arrays and pytrees of them, as ``jax.jit`` takes them;
- ``"nnx"``: Flax NNX graph objects (modules, ``nnx.Optimizer``, ``nnx.Rngs``, variables,
  and containers of them), as ``nnx.jit`` takes them: the caller's objects are updated in
  place after the call, shared references stay shared. The call goes through ``nnx.jit``'s
  own wrapper with its inner ``jax.jit`` replaced by the rewritten function, so the
  contract is NNX's own, not a copy of it;
- ``"filter"``: Equinox modules holding non-array leaves (activation functions, ints,
  ``eqx.nn.Dropout(inference=...)``), as ``eqx.filter_jit`` takes them: array leaves are
  traced, every other leaf is static (part of the cache key), and non-array outputs
  come back as they were returned.

The choice is automatic where it is unambiguous: graph objects in the arguments mean
``"nnx"`` (``jax.jit`` would flatten them and drop the updates); an Equinox module means
``"filter"`` (its non-array leaves cannot be traced). A plain pytree holding Python
scalars keeps ``jax.jit``'s meaning (traced, weakly typed) unless ``filter=True``.

NNX and Equinox modules found in the arguments also get module-path scopes while the step
traces (``blocks/1/attn``), as under ``hlo_amp.module_scopes``, so scope rules name
instances with no wrapper.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax

from hlo_amp.module_scopes import module_scopes


def _nnx() -> Any:
    """``flax.nnx`` if the user imported it; hlo_amp never imports a framework itself."""
    return sys.modules.get("flax.nnx")


def _eqx() -> Any:
    return sys.modules.get("equinox")


def argument_style(args: tuple, kwargs: dict, filter_leaves: bool | None,
                   known: dict | None = None) -> str:
    """``"nnx"``, ``"filter"`` or ``"jax"``: how this call's arguments are taken.

    ``known`` caches the answer per tree structure and leaf types (which decide it), so a
    repeated signature pays one flatten instead of a Python walk over every node.
    """
    nnx, eqx = _nnx(), _eqx()
    if nnx is None and eqx is None:
        return "filter" if filter_leaves else "jax"  # no framework object can exist
    if known is None:
        return _find_style(args, kwargs, filter_leaves, nnx, eqx)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    key = (treedef, tuple(map(type, leaves)))
    style = known.get(key)
    if style is None:
        style = known[key] = _find_style(args, kwargs, filter_leaves, nnx, eqx)
    return style


def _find_style(args: tuple, kwargs: dict, filter_leaves: bool | None, nnx: Any,
                eqx: Any) -> str:
    # Variables alone (an nnx.split State) stay pytrees, as under jax.jit: only modules,
    # optimizers, Rngs and other graph objects take nnx.jit's contract.
    is_graph = ((lambda x: nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable))
                if nnx is not None else (lambda _: False))
    is_module = (lambda x: isinstance(x, eqx.Module)) if eqx is not None else (lambda _: False)
    found = jax.tree_util.tree_leaves((args, kwargs),
                                      is_leaf=lambda x: is_graph(x) or is_module(x))
    if any(is_graph(x) for x in found):
        return "nnx"
    if filter_leaves or (filter_leaves is None and any(is_module(x) for x in found)):
        return "filter"
    return "jax"


def _outermost_modules(tree: Any) -> list[Any]:
    """The NNX and Equinox modules in ``tree`` that no other module there contains."""
    nnx, eqx = _nnx(), _eqx()
    kinds = tuple(c for c in (getattr(nnx, "Module", None), getattr(eqx, "Module", None))
                  if isinstance(c, type))
    if not kinds:
        return []
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
    modules: list[Any] = []
    for leaf in found:
        if isinstance(leaf, kinds) and not any(leaf is m for m in modules):
            modules.append(leaf)
    return modules


def with_module_paths(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that traces with module-path scopes for the modules among its arguments.

    Applied inside the framework's wrapper, so the modules it finds are the ones the step
    really calls (NNX and Equinox rebuild them from the arguments' state).
    """

    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for module in _outermost_modules((args, kwargs)):
                stack.enter_context(module_scopes(module))
            return fn(*args, **kwargs)

    return scoped


# ---- nnx.jit's contract -------------------------------------------------------------------


class NnxCall:
    """``nnx.jit(fn)`` whose inner ``jax.jit`` is the rewritten function ``make_inner`` builds.

    ``nnx.jit`` splits the graph objects into pure state, calls its inner jitted function
    and merges the results back into the caller's objects; the inner function is replaced,
    everything around it is NNX's.
    """

    def __init__(self, fn: Callable[..., Any], make_inner: Callable[[Callable], Any], *,
                 static_argnums: tuple, static_argnames: tuple, donate_argnums: tuple):
        from flax import nnx

        self.wrapped = nnx.jit(with_module_paths(fn), static_argnums=static_argnums,
                               static_argnames=static_argnames, donate_argnums=donate_argnums)
        # nnx.jit's inner jax.jit function wraps the pure function (NNX's JitFn): split
        # state in, split state and outputs out.
        pure_fn = self.wrapped.jitted_fn.__wrapped__
        self.inner = make_inner(pure_fn)
        self.wrapped.jitted_fn = self.inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def lower(self, args: tuple, kwargs: dict, device: Any = None) -> Any:
        """The inner function lowered for the pure (state) arguments ``nnx.jit`` would hand
        it for these; the caller's objects are not changed. ``device``: a
        ``DeviceTarget`` to lower for without having it."""
        from flax.nnx import graphlib

        args, kwargs = graphlib.clone((args, kwargs))  # as nnx.jit's own eval_shape does
        with graphlib.update_context(self.wrapped):
            if hasattr(self.wrapped, "_get_pure_args_kwargs"):  # graph mode with updates
                pure_args, pure_kwargs = self.wrapped._get_pure_args_kwargs(args, kwargs)
            else:
                pure_args, pure_kwargs = self.wrapped._maybe_to_tree(args, kwargs)
            return self.inner.lower(*pure_args, target=device, **pure_kwargs)


# ---- eqx.filter_jit's contract ------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class StaticOutput:
    """A pytree with no leaves carrying non-array outputs in its tree structure, so they
    come back from the rewritten call as they were returned (``eqx.filter_jit`` does the
    same)."""

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self) -> tuple[tuple, Any]:
        return (), _Identity(self.value)

    @classmethod
    def tree_unflatten(cls, aux: Any, children: tuple) -> StaticOutput:
        return cls(aux.value)


class _Identity:
    """Tree metadata compared by identity (functions, modules' static parts)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


class StaticArguments:
    """The non-array part of a call's arguments: a static argument of the inner function,
    hashed and compared by its tree structure and leaves."""

    __slots__ = ("leaves", "treedef")

    def __init__(self, tree: Any):
        self.leaves, self.treedef = jax.tree_util.tree_flatten(tree)

    @property
    def tree(self) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, StaticArguments) and self.treedef == other.treedef
                and all(a is b or _equal(a, b) for a, b in zip(self.leaves, other.leaves)))

    def __hash__(self) -> int:
        return hash((self.treedef, tuple(self.leaves)))


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001  (an __eq__ that does not give a bool: not equal)
        return False


def is_traced_leaf(x: Any) -> bool:
    """The leaves ``eqx.filter_jit`` traces: JAX and NumPy arrays (typed keys included)."""
    eqx = _eqx()
    if eqx is not None:
        return eqx.is_array(x)
    import numpy as np

    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class FilterCall:
    """``fn`` called the ``eqx.filter_jit`` way through a rewritten function of
    (donated arrays, other arrays, static rest)."""

    def __init__(self, fn: Callable[..., Any], make_inner: Callable[..., Any], *,
                 donate_argnums: tuple):
        self.fn = with_module_paths(fn)
        self.donate_argnums = frozenset(donate_argnums)
        self.inner = make_inner(self._pure, static_argnums=(2,),
                                donate_argnums=(0,) if donate_argnums else ())

    def _pure(self, donated: dict, kept: dict, static: StaticArguments) -> tuple:
        args, kwargs = static.tree
        arrays = {**donated, **kept}
        args = [_combine(arrays[("arg", i)], a) if ("arg", i) in arrays else a
                for i, a in enumerate(args)]
        kwargs = {k: _combine(arrays[("kw", k)], v) if ("kw", k) in arrays else v
                  for k, v in kwargs.items()}
        arrays_out, rest_out = split_traced(self.fn(*args, **kwargs))
        return arrays_out, StaticOutput(rest_out)

    def split_arguments(self, args: tuple, kwargs: dict) -> tuple[dict, dict, StaticArguments]:
        donated: dict = {}
        kept: dict = {}
        static_args = []
        for i, arg in enumerate(args):
            arrays, rest = split_traced(arg)
            (donated if i in self.donate_argnums else kept)[("arg", i)] = arrays
            static_args.append(rest)
        static_kwargs = {}
        for name, value in kwargs.items():
            arrays, rest = split_traced(value)
            kept[("kw", name)] = arrays
            static_kwargs[name] = rest
        return donated, kept, StaticArguments((tuple(static_args), static_kwargs))

    def lower(self, args: tuple, kwargs: dict, device: Any = None) -> Any:
        return self.inner.lower(*self.split_arguments(args, kwargs), target=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arrays, static_out = self.inner(*self.split_arguments(args, kwargs))
        return _combine(arrays, static_out.value)


def split_traced(tree: Any) -> tuple[Any, Any]:
    """(``tree`` with its traced leaves only, ``tree`` with its other leaves only): each
    has None where the other has a leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    traced = [x if is_traced_leaf(x) else None for x in leaves]
    rest = [None if is_traced_leaf(x) else x for x in leaves]
    return (jax.tree_util.tree_unflatten(treedef, traced),
            jax.tree_util.tree_unflatten(treedef, rest))


def _combine(arrays: Any, rest: Any) -> Any:
    """Put the traced leaves back into the static rest (inverse of ``split_traced``)."""
    array_leaves = jax.tree_util.tree_leaves(arrays, is_leaf=lambda x: x is None)
    rest_leaves, treedef = jax.tree_util.tree_flatten(rest, is_leaf=lambda x: x is None)
    merged = [a if r is None else r for a, r in zip(array_leaves, rest_leaves)]
    return jax.tree_util.tree_unflatten(treedef, merged)
