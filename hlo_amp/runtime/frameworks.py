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

A step already decorated with ``@nnx.jit``, ``@eqx.filter_jit`` or ``@jax.jit`` is
compiled as the function the decorator wraps, with the decorator's static and donated
arguments (``unwrap_jit``): the same program, report and contract as the undecorated step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from hlo_amp import jax_internals as internals
from hlo_amp.module_scopes import module_scopes
from hlo_amp.runtime.signature import donated_names, signature_of


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
    # A module or optimizer passed as an argument itself (how NNX steps are written)
    # decides it without flattening the model's graph, a few ms per call.
    if nnx is not None and any(_is_graph(nnx, x) for x in (*args, *kwargs.values())):
        return "nnx"
    if known is None:
        return _find_style(args, kwargs, filter_leaves, nnx, eqx)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    key = (treedef, tuple(map(type, leaves)))
    style = known.get(key)
    if style is None:
        style = known[key] = _find_style(args, kwargs, filter_leaves, nnx, eqx)
    return style


def _is_graph(nnx: Any, x: Any) -> bool:
    # Variables alone (an nnx.split State) stay pytrees, as under jax.jit: only modules,
    # optimizers, Rngs and other graph objects take nnx.jit's contract.
    return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


def _find_style(args: tuple, kwargs: dict, filter_leaves: bool | None, nnx: Any,
                eqx: Any) -> str:
    is_graph = (lambda x: _is_graph(nnx, x)) if nnx is not None else (lambda _: False)
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


def function_name_of(fn: Any) -> str:
    """``fn.__name__`` where it is a string, else its type's name: an Equinox module read
    through its filter_jit wrapper (``eqx.filter_jit(eqx.filter_vmap(model))``) has
    Equinox's Missing sentinel there, which a function's ``__name__`` refuses ("__name__
    must be set to a string object", raised by functools.wraps)."""
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def function_qualname_of(fn: Any) -> str:
    """``fn.__qualname__`` where it is a string, else `function_name_of`."""
    qualname = getattr(fn, "__qualname__", None)
    return qualname if isinstance(qualname, str) else function_name_of(fn)


def wraps_named(fn: Any, updated: tuple[str, ...] = functools.WRAPPER_UPDATES
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.wraps(fn)``, its names taken by `function_name_of`."""
    def decorate(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        functools.update_wrapper(wrapper, fn, updated=updated, assigned=tuple(
            a for a in functools.WRAPPER_ASSIGNMENTS if a not in ("__name__", "__qualname__")))
        wrapper.__name__ = function_name_of(fn)
        wrapper.__qualname__ = function_qualname_of(fn)
        return wrapper

    return decorate


def with_module_paths(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that traces with module-path scopes for the modules among its arguments.

    Applied inside the framework's wrapper, so the modules it finds are the ones the step
    really calls (NNX and Equinox rebuild them from the arguments' state).
    """

    @wraps_named(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for module in _outermost_modules((args, kwargs)):
                stack.enter_context(module_scopes(module))
            return fn(*args, **kwargs)

    return scoped


# ---- steps already decorated with a framework's jit ---------------------------------------


@dataclasses.dataclass(frozen=True)
class FilteredDonation:
    """``eqx.filter_jit(donate=...)``: whether the first argument's arrays and the other
    arguments' arrays (keyword arguments included) are donated."""

    first: bool
    rest: bool
    first_name: str | None  # the first parameter's name: it may come by keyword
    quiet: bool  # "all" / "all-except-first" hide JAX's "not usable" warning; "warn*" not
    # Positional arguments put before the step's own, which this leaves alone: the
    # delayed-scaling step's history (donated by position).
    offset: int = 0

    def __call__(self, key: tuple[str, Any]) -> bool:
        """Whether the arrays of argument ``key`` (``("arg", i)`` / ``("kw", name)``) are
        donated."""
        if key[0] == "arg" and key[1] < self.offset:
            return False
        is_first = key == ("arg", self.offset) or (self.first_name is not None
                                                    and key == ("kw", self.first_name))
        return self.first if is_first else self.rest


@dataclasses.dataclass(frozen=True)
class JitDecorator:
    """The function a framework's jit decorator wraps, and the options it was given that
    ``hlo_amp.compile`` carries over."""

    name: str  # "nnx.jit", "eqx.filter_jit", "jax.jit"
    fn: Callable[..., Any]
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    filter: bool | None = None  # True for eqx.filter_jit: non-array leaves are static
    donation: FilteredDonation | None = None  # eqx.filter_jit's donate=
    nnx_modes: tuple[tuple[str, bool], ...] = ()  # nnx.jit's graph / graph_updates
    # jax.jit's in_shardings, out_shardings, device and backend as given (``placement``)
    placement: tuple[tuple[str, Any], ...] = ()


def unwrap_jit(fn: Any, name: str) -> JitDecorator | None:
    """What ``fn`` wraps if it is an ``nnx.jit``, ``eqx.filter_jit`` or ``jax.jit``
    function, else None. ``name`` names the step in errors.

    Raises a TypeError naming the decorator's options that ``hlo_amp.compile`` cannot
    carry over (shardings, device, ...), rather than run the step without them.
    """
    nnx_jit = sys.modules.get("flax.nnx.transforms.compilation")
    eqx_jit = sys.modules.get("equinox._jit")
    wrappers = tuple(getattr(nnx_jit, c, None) for c in ("JitWrapped", "SimpleJitWrapped"))
    if nnx_jit is not None and isinstance(fn, tuple(c for c in wrappers if c is not None)):
        return _unwrap_nnx(fn, name)
    partial = getattr(nnx_jit, "SimpleJitPartialWrapped", None)
    if partial is not None and isinstance(fn, partial):
        raise TypeError(
            f"hlo_amp.compile({name}): it is an nnx.jit_partial function, whose partial "
            f"arguments hlo_amp.compile cannot carry over; compile the function itself: "
            f"hlo_amp.compile(fn) and pass those arguments in each call")
    wrapper = getattr(eqx_jit, "_JitWrapper", None)
    if wrapper is not None and isinstance(fn, wrapper):
        return _unwrap_eqx(fn, name)
    if jax_jit_info(fn) is not None:
        return _unwrap_jax(fn, name)
    return None


def jax_jit_info(fn: Any) -> Any:
    """``jit_info`` of a ``jax.jit`` function, by its type (functools.wraps copies a
    jitted function's attributes onto a user's wrapper, whose own code must run); None
    for anything else."""
    return jit_info(fn) if type(fn).__name__ == "PjitFunction" else None


def jit_info(jitted: Any) -> Any:
    """The options a ``jax.jit`` function was made with, or None.

    ``_jit_info`` is JAX's own record of them (``jax._src.pjit``), not public API: where a
    jax version lacks it, an nnx.jit / eqx.filter_jit step gets the "replace the
    decorator" error and a jax.jit one compiles nested, as before.
    """
    info = getattr(jitted, "_jit_info", None)
    return info if hasattr(info, "static_argnums") else None


def shardings_given(info: Any, unknown: bool = True) -> bool:
    """Whether a ``jax.jit`` function's options (``jit_info``) give ``in_shardings`` or
    ``out_shardings``; ``unknown`` where this jax does not record them."""
    return bool(getattr(info, "user_specified_in_shardings", unknown)) or _out_shardings_given(
        info, unknown)


def _out_shardings_given(info: Any, unknown: bool = True) -> bool:
    return any(type(s).__name__ != "UnspecifiedValue"
               for s in getattr(info, "out_shardings_leaves", (None,) if unknown else ()))


# The jax.jit options that place a call (``placement``), which hlo_amp.compile takes from
# a jax.jit step only.
PLACEMENT_OPTIONS = ("in_shardings", "out_shardings", "device", "backend")


def placement(info: Any) -> tuple[tuple[str, Any], ...]:
    """The ``in_shardings``, ``out_shardings``, ``device`` and ``backend`` a ``jax.jit``
    function was given, as ``jax.jit`` keywords: the top-level jit that runs the
    rewritten step takes them too, as a nested jit's are not its caller's (on an Explicit
    mesh its out_shardings typed no result, and a step pinned to one device ran on the
    default one)."""
    if info is None:
        return ()
    given = []
    if getattr(info, "user_specified_in_shardings", False):
        given.append(("in_shardings", info.in_shardings_treedef.unflatten(
            info.in_shardings_leaves)))
    if _out_shardings_given(info, unknown=False):
        given.append(("out_shardings", info.out_shardings_treedef.unflatten(
            info.out_shardings_leaves)))
    given += [(option, getattr(info, option)) for option in PLACEMENT_OPTIONS[2:]
              if getattr(info, option, None) is not None]
    return tuple(given)


def _replace_decorator(name: str, decorator: str, problem: str) -> TypeError:
    return TypeError(
        f"hlo_amp.compile({name}): {name} is decorated with @{decorator}, {problem}; "
        f"replace @{decorator} with @hlo_amp.compile(policy=...), which takes "
        f"static_argnums, static_argnames and donate_argnums (arrays keep the shardings "
        f"jax.device_put gave them)")


def _options_it_cannot_carry(info: Any) -> list[str]:
    """The ``jax.jit`` options in ``info`` other than their defaults that hlo_amp.compile
    has no equivalent of (``inline`` changes nothing for a top-level call)."""
    found = [f"{option}={getattr(info, option)!r}"
             for option, default in (("device", None), ("backend", None),
                                     ("keep_unused", False), ("compiler_options_kvs", ()))
             if getattr(info, option, default) not in (default, None)]
    if any(layout is not None for layout in (*getattr(info, "in_layouts_leaves", ()),
                                             *getattr(info, "out_layouts_leaves", ()))):
        found.append("in_layouts/out_layouts")
    return found


def _positional_donations(info: Any, decorator: str, name: str) -> tuple[int, ...]:
    """``info``'s donated arguments as positions; keyword-only ones cannot be carried."""
    signature = getattr(info, "fun_signature", None)
    if signature is not None:
        keyword_only = [p for p in getattr(info, "donate_argnames", ())
                        if p in signature.parameters
                        and signature.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY]
        if keyword_only:  # replacing the decorator would not help: donation is by position
            raise TypeError(
                f"hlo_amp.compile({name}): {name} is decorated with @{decorator}, which "
                f"donates keyword-only argument(s) {keyword_only}; hlo_amp.compile donates "
                f"by position (donate_argnums): make them positional-or-keyword parameters "
                f"(before any *) and donate them by position")
    return tuple(info.donate_argnums)


def _unwrap_nnx(wrapped: Any, name: str) -> JitDecorator:
    info = jit_info(getattr(wrapped, "jitted_fn", None))
    fn = getattr(wrapped, "fun", None)
    if info is None or not callable(fn):
        raise _replace_decorator(name, "nnx.jit",
                                 "whose options this jax/flax version does not expose")
    cannot = _options_it_cannot_carry(info)
    for option in ("in_shardings", "out_shardings"):  # NNX's own, before JAX's form
        if getattr(wrapped, option, None) is not None:
            cannot.insert(0, f"{option}={getattr(wrapped, option)!r}")
    if cannot:
        raise _replace_decorator(name, "nnx.jit", f"which was given {', '.join(cannot)}, "
                                 "options hlo_amp.compile cannot carry over")
    # JitWrapped is NNX's graph mode with graph updates; SimpleJitWrapped the others.
    graph = getattr(wrapped, "graph", True)
    updates = type(wrapped).__name__ == "JitWrapped"
    return JitDecorator("nnx.jit", fn, static_argnums=tuple(info.static_argnums),
                        static_argnames=tuple(info.static_argnames),
                        donate_argnums=_positional_donations(info, "nnx.jit", name),
                        nnx_modes=(("graph", graph), ("graph_updates", updates)))


def _unwrap_eqx(wrapped: Any, name: str) -> JitDecorator:
    info = jit_info(getattr(wrapped, "_cached", None))
    fn = getattr(wrapped, "__wrapped__", None)
    if info is None or not callable(fn) or not hasattr(wrapped, "donate_first"):
        raise _replace_decorator(name, "eqx.filter_jit",
                                 "whose options this jax/equinox version does not expose")
    cannot = _options_it_cannot_carry(info)
    if cannot:
        raise _replace_decorator(name, "eqx.filter_jit", f"which was given "
                                 f"{', '.join(cannot)}, options hlo_amp.compile cannot "
                                 "carry over")
    signature = getattr(wrapped, "_signature", None)
    first = next(iter(signature.parameters), None) if signature is not None else None
    donation = FilteredDonation(first=bool(wrapped.donate_first),
                                rest=bool(wrapped.donate_rest), first_name=first,
                                quiet=bool(getattr(wrapped, "filter_warning", False)))
    return JitDecorator("eqx.filter_jit", fn, filter=True,
                        donation=donation if donation.first or donation.rest else None)


def _unwrap_jax(jitted: Any, name: str) -> JitDecorator | None:
    info = jit_info(jitted)
    options = getattr(info, "compiler_options_kvs", ())
    if options:  # jax takes them on a top-level jit only: not nested, not carried
        raise _replace_decorator(name, "jax.jit", f"which was given compiler_options="
                                 f"{dict(options)!r}, which jax applies to a top-level "
                                 "jit only")
    # Shardings and the options hlo_amp.compile lacks apply where the jitted function
    # is called nested, as an inner jit; its static and donated arguments only at the
    # top: they are carried over either way (an inner jit would meet a tracer for a
    # static argument, and donates nothing inside another jit).
    nested = _options_it_cannot_carry(info) or shardings_given(info)
    fn = jitted if nested else getattr(jitted, "__wrapped__", None)
    if not callable(fn):
        return None
    return JitDecorator("jax.jit", fn,
                        static_argnums=tuple(info.static_argnums),
                        static_argnames=tuple(info.static_argnames),
                        donate_argnums=_positional_donations(info, "jax.jit", name),
                        placement=placement(info))


# ---- nnx.jit's contract -------------------------------------------------------------------


class NnxCall:
    """``nnx.jit(fn)`` whose inner ``jax.jit`` is the rewritten function ``make_inner`` builds.

    ``nnx.jit`` splits the graph objects into pure state, calls its inner jitted function
    and merges the results back into the caller's objects; the inner function is replaced,
    everything around it is NNX's.
    """

    def __init__(self, fn: Callable[..., Any], make_inner: Callable[[Callable], Any], *,
                 static_argnums: tuple, static_argnames: tuple, donate_argnums: tuple,
                 modes: dict | None = None):
        from flax import nnx

        # ``modes``: a decorated step's graph / graph_updates; else the context's, as nnx.jit
        self.wrapped = nnx.jit(with_module_paths(fn), static_argnums=static_argnums,
                               static_argnames=static_argnames, donate_argnums=donate_argnums,
                               **(modes or {}))
        # nnx.jit's inner jax.jit function wraps the pure function (NNX's JitFn): split
        # state in, split state and outputs out.
        pure_fn = self.wrapped.jitted_fn.__wrapped__
        self.inner = make_inner(_in_update_context(pure_fn, self.wrapped))
        # Weakly: the pure function holds nnx.jit's object (its context tag), and a
        # strong way from it back to the inner function, whose traces jax caches weakly
        # keyed on that function's dispatch, kept every compiled step alive.
        self.wrapped.jitted_fn = weakref.proxy(self.inner)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def lower(self, args: tuple, kwargs: dict, device: Any = None) -> Any:
        """The inner function lowered for the pure (state) arguments ``nnx.jit`` would hand
        it for these; the caller's objects are not changed. ``device``: a
        ``Target`` to lower for without having it."""
        from flax.nnx import graphlib

        args, kwargs = graphlib.clone((args, kwargs))  # as nnx.jit's own eval_shape does
        with graphlib.update_context(self.wrapped):
            if hasattr(self.wrapped, "_get_pure_args_kwargs"):  # graph mode with updates
                pure_args, pure_kwargs = self.wrapped._get_pure_args_kwargs(args, kwargs)
            else:
                pure_args, pure_kwargs = self.wrapped._maybe_to_tree(args, kwargs)
            lowered = self.inner.lower_for(device, *pure_args, **pure_kwargs)
        lowered.calling = self._calling
        return lowered

    def _calling(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` (of the pure state) called as nnx.jit's compiled step is: the
        caller's objects split in, and updated from its outputs."""
        def call(*args: Any, **kwargs: Any) -> Any:
            inner, self.wrapped.jitted_fn = self.wrapped.jitted_fn, compiled
            try:
                return self.wrapped(*args, **kwargs)
            finally:
                self.wrapped.jitted_fn = inner

        return call


def _in_update_context(pure_fn: Callable[..., Any], tag: Any) -> Callable[..., Any]:
    """``pure_fn`` (NNX's inner function, which reads nnx.jit's update context) traced
    in a context of its own when none is active: a program exported again while jax
    lowers its call (for another platform, or inside a jax.jit partitioned over devices)
    is traced outside nnx.jit's call ("No update context found")."""
    from flax.nnx import graphlib

    @functools.wraps(pure_fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        try:
            graphlib.current_update_context(tag)
        except ValueError:
            with graphlib.update_context(tag):
                return pure_fn(*args, **kwargs)
        return pure_fn(*args, **kwargs)

    return traced


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
    """The leaves ``eqx.filter_jit`` traces: JAX and NumPy arrays (typed keys included),
    and, for ``.lower()`` without the arrays, ``jax.ShapeDtypeStruct`` (an abstract model
    from ``eqx.filter_eval_shape``; the arrays' stand-in, never a static value)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return True
    eqx = _eqx()
    if eqx is not None:
        return eqx.is_array(x)
    import numpy as np

    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _pure_call(fn: Callable[..., Any], donated: dict, kept: dict, static: StaticArguments
               ) -> tuple:
    """``fn`` of the arguments ``FilterCall.split_arguments`` split: its array outputs,
    and the rest as a static pytree."""
    args, kwargs = static.tree
    arrays = {**donated, **kept}
    args = [_combine(arrays[("arg", i)], a) if ("arg", i) in arrays else a
            for i, a in enumerate(args)]
    kwargs = {k: _combine(arrays[("kw", k)], v) if ("kw", k) in arrays else v
              for k, v in kwargs.items()}
    arrays_out, rest_out = split_traced(fn(*args, **kwargs))
    return arrays_out, StaticOutput(rest_out)


class FilterCall:
    """``fn`` called the ``eqx.filter_jit`` way through a rewritten function of
    (donated arrays, other arrays, static rest)."""

    def __init__(self, fn: Callable[..., Any], make_inner: Callable[..., Any], *,
                 donate_argnums: tuple, donation: FilteredDonation | None = None,
                 static: tuple[tuple[int, ...], tuple[str, ...]] = ((), ()),
                 name: str = ""):
        self.fn = with_module_paths(fn)
        # static_argnums and static_argnames: static as every non-array leaf is, and
        # refused where they hold an array (as jax.jit refuses an unhashable one).
        self.static_argnums, self.static_argnames = frozenset(static[0]), frozenset(static[1])
        self.name = name
        self.donate_argnums = frozenset(donate_argnums)
        # As jax.jit: a parameter donated by position is donated when passed by keyword.
        self.donated_names = donated_names(signature_of(fn), donate_argnums)
        self.donation = donation  # eqx.filter_jit(donate=...) of a decorated step
        # A function of fn alone, not a method: its traces are cached by jax weakly keyed
        # on the inner function's dispatch, and a way back to it (self.inner) through
        # this object kept every compiled step alive.
        self.inner = make_inner(functools.partial(_pure_call, self.fn), static_argnums=(2,),
                                static_argnames=(),
                                donate_argnums=(0,) if donate_argnums or donation else ())

    def _donated(self, key: tuple[str, Any]) -> bool:
        return ((key[0] == "arg" and key[1] in self.donate_argnums)
                or (key[0] == "kw" and key[1] in self.donated_names)
                or (self.donation is not None and self.donation(key)))

    def split_arguments(self, args: tuple, kwargs: dict) -> tuple[dict, dict, StaticArguments]:
        donated: dict = {}
        kept: dict = {}
        static_args = []
        for i, arg in enumerate(args):
            arrays, rest = split_traced(arg)
            if i in self.static_argnums or i - len(args) in self.static_argnums:
                self._refuse_static_arrays(f"argument {i}", arrays)
            (donated if self._donated(("arg", i)) else kept)[("arg", i)] = arrays
            static_args.append(rest)
        static_kwargs = {}
        for name, value in kwargs.items():
            arrays, rest = split_traced(value)
            if name in self.static_argnames:
                self._refuse_static_arrays(f"argument {name!r}", arrays)
            (donated if self._donated(("kw", name)) else kept)[("kw", name)] = arrays
            static_kwargs[name] = rest
        return donated, kept, StaticArguments((tuple(static_args), static_kwargs))

    def _refuse_static_arrays(self, which: str, arrays: Any) -> None:
        if any(leaf is not None for leaf in
               jax.tree_util.tree_leaves(arrays, is_leaf=lambda x: x is None)):
            raise ValueError(
                f"hlo_amp.compile({self.name}): {which} is static (static_argnums/"
                f"static_argnames) but holds arrays; accepted: hashable non-array values, "
                f"as jax.jit takes them (an Equinox module's arrays are traced without it)")

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """As eqx.filter_jit(donate="all") does: no warning that a donated buffer was
        not usable (JAX warns while lowering: a call, or the delayed step's lower)."""
        if self.donation is None or not self.donation.quiet:
            yield
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            yield

    def lower(self, args: tuple, kwargs: dict, device: Any = None) -> Any:
        with self._quiet():
            lowered = self.inner.lower_for(device, *self.split_arguments(args, kwargs))
        lowered.calling = self._calling
        return lowered

    def _calling(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` (of the arrays) called as eqx.filter_jit's compiled function is."""
        def call(*args: Any, **kwargs: Any) -> Any:
            donated, kept, _static = self.split_arguments(args, kwargs)
            with self._quiet():  # the executable takes the arrays, not the static rest
                arrays, static_out = compiled(donated, kept)
            return _combine(arrays, static_out.value)

        return call

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        # eqx.error_if's stack, taken where the step is traced, ends at the frame holding
        # this name: as in eqx.filter_jit, its error reads as Equinox's own.
        __equinox_jit_id__ = os.urandom(16)  # read by Equinox from this frame
        try:
            with self._quiet(), _equinox_callback_quiet():
                arrays, static_out = self.inner(*self.split_arguments(args, kwargs))
                if "equinox" in sys.modules and not any(
                        isinstance(x, internals.Tracer) for x in jax.tree_util.tree_leaves(arrays)):
                    # As eqx.filter_jit: the call waits for the step, so an error_if
                    # that fires raises here (after the call returned it surfaced raw
                    # where an output was read).
                    jax.block_until_ready(arrays)
        except (jax.errors.JaxRuntimeError, ValueError) as error:
            equinox_error = _equinox_runtime_error(error, __equinox_jit_id__)
            if equinox_error is None:
                raise
            raise equinox_error from None
        return _combine(arrays, static_out.value)


@contextlib.contextmanager
def _equinox_callback_quiet() -> Iterator[None]:
    """As eqx.filter_jit: jax's log line for the failed callback of an eqx.error_if is
    left out (the error says it)."""
    if "equinox" not in sys.modules:
        yield
        return
    logger = logging.getLogger("jax._src.callback")
    quiet = _FailedCallbackFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _FailedCallbackFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "jax.pure_callback failed"


def _equinox_runtime_error(error: Exception, jit_id: bytes) -> Exception | None:
    """An ``eqx.error_if`` that fired, as ``eqx.filter_jit`` raises it: Equinox's
    ``EquinoxRuntimeError`` with the message and the stack inside the step (it was jax's
    raw callback error, the message buried in a traceback and Equinox's advice to use
    filter_jit); None for any other error."""
    equinox_jit = sys.modules.get("equinox._jit")
    info = getattr(equinox_jit, "last_error_info", None)
    if info is None or "_EquinoxRuntimeError: " not in str(error):
        return None
    message, stack = info
    pieces: list[str] = []
    for entry in stack:
        if type(entry) is str:
            pieces.append(entry)
        elif entry == jit_id:
            break
    template = getattr(equinox_jit, "_on_error_msg", "{stack}\n{msg}")
    return equinox_jit.EquinoxRuntimeError(
        template.format(msg=message, stack="".join(reversed(pieces))))


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
