"""``hlo_amp.compile(fn, "fp8,scaling=delayed")``: the amax history carried between calls.

The function compiled is ``stateful(history, *args) -> (fn(*args), history')``: the
history ``f32[L, S]`` (L steps of amax, newest first, for each of the S tensors the fp8
pass quantises) goes in through a barrier in the scope ``STATE_SCOPE``, which the pass
(passes/fp8_state.py) replaces by the new history. This object keeps one history per
program (the static arguments' values, the argument structure and dtypes, the shapes
beyond each argument's leading dimension, which dots are fp8, as jax's trace
configuration may change that: a new batch size shares it, the same tensors; a static
argument that picks other tensors does not),
passes it in, donates it and keeps what comes back, so the user's step keeps its
signature. S is read from a first lowering with an empty history (no XLA compile), once
per signature (a Python scalar argument is traced, as under ``jax.jit``: a new value
lowers nothing). The history starts at zero: the first step's scales are 1, as in
Transformer Engine; it is committed to devices only where the arguments are (as jax.jit's
outputs would be: a committed history beside uncommitted parameters would commit them
and compile the step a second time).

What it does not do: run under an outer transformation (``jax.jit``, ``vmap``, ``grad``
of the compiled function) — the state lives between calls, outside any trace — and
``jax.export``. ``.lower(*args)`` lowers the stateful function: its compiled form takes
the history first and returns ``(outputs, history)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hlo_amp import jax_internals as internals
from hlo_amp.passes.fp8_state import STATE_SCOPE
from hlo_amp.policy import Policy
from hlo_amp.runtime.arguments import raise_argument_problem
from hlo_amp.runtime.deviceless import split_device_target
from hlo_amp.runtime.frameworks import JitDecorator, argument_style, function_name_of
from hlo_amp.runtime.signature import (
    CATCH_ALL,
    donated_names,
    leaf_signature,
    signature_of,
    split_static,
)

# The history's name in the stateful step's signature (jax's messages name it).
_HISTORY = "hlo_amp_fp8_amax_history"
# jax.jit's message for arguments on different devices.
_INCOMPATIBLE_DEVICES = "incompatible devices"


def _shifted(argnums: Sequence[int]) -> tuple[int, ...]:
    return tuple(n + 1 if n >= 0 else n for n in argnums)


# XLA's messages for a deleted (donated) buffer ("Invalid buffer passed to Execute() as
# argument N") and for one donated and read in one call ("flattened argument N, ...,
# first use: M"), which count the executable's flat arguments: the history is the first.
_EXECUTE_ARGUMENT = re.compile(r"(passed to Execute\(\) as argument )(\d+)( to replica)")
_DONATED_TWICE = re.compile(r"(flattened argument )(\d+)(,[^)]*first use: )(\d+)")


def _argument_named_as_the_steps(error: Exception) -> Exception | None:
    """``error`` (one of XLA's messages above) with its argument numbers counted as the
    step's own arguments are, the history left out; None for others."""
    message = str(error)
    found = _EXECUTE_ARGUMENT.search(message)
    if isinstance(error, ValueError) and found is not None and found.group(2) != "0":
        index = int(found.group(2)) - 1
        return ValueError(_EXECUTE_ARGUMENT.sub(rf"\g<1>{index}\g<3>", message, count=1))
    found = _DONATED_TWICE.search(message)
    if (isinstance(error, jax.errors.JaxRuntimeError) and found is not None
            and found.group(2) != "0" and found.group(4) != "0"):
        renamed = (rf"\g<1>{int(found.group(2)) - 1}\g<3>{int(found.group(4)) - 1}")
        return jax.errors.JaxRuntimeError(_DONATED_TWICE.sub(renamed, message, count=1))
    return None


def _device_order(sharding: Any) -> tuple:
    """The devices of ``sharding`` in the order a jax.jit call assigns them: its mesh's
    (two meshes over the same devices in another order are different placements: jax
    refuses arguments on both), else by id."""
    devices = getattr(getattr(sharding, "mesh", None), "devices", None)
    if devices is not None and getattr(devices, "size", 0):
        return tuple(devices.flat)
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def _devices_differ(name: str, args: tuple, kwargs: dict) -> str | None:
    """The message for array arguments on different devices (jax.jit refuses them, and
    its message named the history, placed with the first of them), else None."""
    found: dict[tuple, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, jax.Array) and leaf.committed:
            where = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
            found.setdefault(_device_order(leaf.sharding), where)
            if len(found) > 1:
                (first, one), (second, other) = found.items()
                return (f"hlo_amp.compile({name}): its array arguments are on different "
                        f"devices: {one} on {[d.id for d in first]}, {other} on "
                        f"{[d.id for d in second]} (jax.jit refuses them too); put them on "
                        f"the same devices (jax.device_put)")
    return None


def _replicated_like(history: jax.Array, leaves: list[Any]) -> jax.Array:
    """``history`` replicated on the devices of the first committed array argument (as
    it is where it is there already: no copy); uncommitted where no argument is committed
    (jax.jit then commits no output either: a committed history, a checkpoint's, committed
    the parameters the step returned, and the next call compiled the step again)."""
    for leaf in leaves:
        if not isinstance(leaf, jax.Array) or not leaf.committed:
            continue
        sharding = leaf.sharding
        if (isinstance(history, jax.Array) and history.committed
                and _device_order(history.sharding) == _device_order(sharding)
                and history.sharding.is_fully_replicated):
            return history
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not getattr(mesh, "empty", False):
            placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        else:
            devices = sorted(sharding.device_set, key=lambda d: d.id)
            placed = (jax.sharding.SingleDeviceSharding(devices[0]) if len(devices) == 1
                      else jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("devices",)),
                                                      jax.sharding.PartitionSpec()))
        # Through the host (a few KiB, only when the devices change): a history typed for
        # an Explicit mesh cannot be put on other devices directly (jax: "Length of device
        # assignment 1 is not equal to the size of the mesh 8").
        return jax.device_put(np.asarray(history), placed)
    if isinstance(history, jax.Array) and history.committed:
        return jnp.asarray(np.asarray(history))
    return history


def _beyond_leading(shapes: tuple) -> tuple:
    """``leaf_signature``s (``_signature``'s: a traced Python number's as a scalar's) as
    the rank and the dimensions after the first of each array."""
    return tuple((len(s[0]), s[0][1:]) for s in shapes)


def _static_part(leaf: Any) -> Any:
    """A static leaf in a key: itself (jax.jit and eqx.filter_jit hash static arguments),
    or its identity where it cannot be hashed."""
    try:
        hash(leaf)
    except TypeError:
        return ("unhashable", type(leaf).__name__, id(leaf))
    return (type(leaf).__name__, leaf)


def _canonical(dtype: Any) -> Any:
    """``dtype`` as jax traces it (float64 is float32 without x64); a PRNG key type
    (``key<fry>``) as it is."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def _canonical_name(dtype: Any) -> str:
    """``str(_canonical(dtype))``, remembered per x64 setting (``_signature`` asks it
    for every leaf of every call: NumPy's answers took most of a call's time)."""
    try:
        return _canonical_name_under(dtype, bool(jax.config.jax_enable_x64))
    except TypeError:  # a dtype that cannot be hashed
        return str(_canonical(dtype))


@functools.cache
def _canonical_name_under(dtype: Any, x64: bool) -> str:
    """(``x64`` keys the cache: ``_canonical`` reads the setting itself.)"""
    return str(_canonical(dtype))


class Fp8StatefulFunction:
    """What ``hlo_amp.compile`` returns under ``scaling=delayed``: called like the
    function, it carries the fp8 amax history between calls (``fp8_state()``,
    ``load_fp8_state()`` read and restore it, for checkpoints)."""

    def __init__(self, fn: Callable[..., Any], policy: Policy, *, make: Callable[..., Any],
                 static_argnums: Sequence[int], static_argnames: Sequence[str],
                 donate_argnums: Sequence[int], filter: bool | None,
                 decorator: JitDecorator | None = None):
        self.policy = policy
        self.fn = fn
        self._fn_signature = signature_of(fn)  # read once: every call binds to it
        self.__name__ = function_name_of(fn)

        # The history is positional only, under a name no step's argument has: a step's
        # own argument named "history", passed by keyword, raised "got multiple values
        # for argument 'history'" (and jax's debug info takes names as unique).
        def stateful(hlo_amp_fp8_amax_history: jax.Array, /, *args: Any, **kwargs: Any) -> Any:
            with jax.named_scope(STATE_SCOPE):
                (marked,) = jax.lax.optimization_barrier((hlo_amp_fp8_amax_history,))
            return fn(*args, **kwargs), marked

        stateful.__name__ = self.__name__
        # The step's own parameters behind the history: jax names arguments by them (its
        # messages read "argument x", not "args[1]"), and a step's parameter named args
        # or kwargs, passed by keyword, no longer meets the wrapper's own names (jax's
        # debug info raised an AssertionError); the history under a name none of them
        # has. A step without a signature gets catch-alls no keyword is named.
        signature = self._fn_signature or CATCH_ALL
        history = _HISTORY
        while history in signature.parameters:
            history += "_"
        stateful.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
            inspect.Parameter(history, inspect.Parameter.POSITIONAL_ONLY),
            *signature.parameters.values()])
        # A jax.jit step's shardings place its arguments when it is lowered for a
        # target (AmpFunction._lower): the wrapper has none of its own.
        stateful.amp_inner = fn  # type: ignore[attr-defined]
        # What a decorator gave beyond static and donated positions (eqx.filter_jit's
        # donate=, nnx.jit's graph modes) reaches the step behind the history.
        carried = None
        if decorator is not None and (decorator.donation or decorator.nnx_modes):
            donation = decorator.donation and dataclasses.replace(decorator.donation, offset=1)
            carried = dataclasses.replace(decorator, fn=stateful, static_argnums=(),
                                          static_argnames=(), donate_argnums=(),
                                          donation=donation, placement=())
        self._inner = make(stateful, policy, static_argnums=_shifted(static_argnums),
                           static_argnames=tuple(static_argnames),
                           donate_argnums=(0, *_shifted(donate_argnums)), filter=filter,
                           decorator=carried)
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self._donated_names = donated_names(self._fn_signature, donate_argnums)
        self.filter = filter
        self._styles: dict[Any, str] = {}  # argument_style's cache
        self._histories: dict[Any, jax.Array] = {}  # (program, columns) -> the history
        self._loaded: jax.Array | None = None
        self._last_state: Any = None  # the key of the last call's history
        # A call takes a history, donates it and keeps the new one: calls from several
        # threads take turns (each read a history another had donated).
        self._state_lock = threading.RLock()
        # (program, shapes, target, jax's trace configuration) -> (columns, which dots
        # are fp8)
        self._columns_of: dict[Any, tuple[int, tuple]] = {}

    # -- the state --

    def _signature(self, args: tuple, kwargs: dict) -> tuple[Any, Any, list]:
        """(the program: the static arguments' values, the structure, dtypes and weak
        types of the others, a filtered call's non-array leaves; the shapes and
        shardings of the arrays and traced numbers; the dynamic leaves). A Python scalar
        that is not static is traced (as under jax.jit): its type counts, not its
        value."""
        # As jax traces them: an argument passed by keyword or by position, a default
        # given or left out, make one program (each had a history of its own).
        args, kwargs = _bound(self._fn_signature, args, kwargs)
        dyn_args, dyn_kwargs, static_args, static_kwargs = split_static(
            args, kwargs, self.static_argnums, self.static_argnames)
        static = (tuple(_static_part(v) for _, v in static_args),
                  tuple((k, _static_part(v)) for k, v in static_kwargs))
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        filtered = None  # asked only where a leaf is not an array
        kinds, shapes = [], []
        for leaf in leaves:
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                kinds.append((_canonical_name(leaf.dtype),
                              bool(getattr(leaf, "weak_type", False))))
                shapes.append(leaf_signature(leaf))
                continue
            if filtered is None:
                filtered = argument_style(args, kwargs, self.filter, self._styles) == "filter"
            if not filtered and isinstance(leaf, (bool, int, float, complex)):
                # Traced as jax.jit traces it: Flax's TrainState.step is 0 at first and
                # a weak int32 array after a step, one program (it made two histories).
                try:
                    aval = jax.typeof(leaf)
                except (OverflowError, TypeError):  # jax.jit's call names the argument
                    kinds.append(type(leaf).__name__)
                    continue
                kinds.append((str(aval.dtype), bool(aval.weak_type)))
                shapes.append(((), str(aval.dtype), bool(aval.weak_type), None))
                continue
            kinds.append(_static_part(leaf) if filtered else type(leaf).__name__)
        return (tree, tuple(kinds), static), tuple(shapes), leaves

    def _columns(self, args: tuple, kwargs: dict, program: Any, shapes: Any,
                 target: Any = None) -> tuple[int, tuple]:
        """How many history columns the fp8 pass takes for these arguments (one per
        quantised tensor, one per iteration for a tensor in a scan), and which dots
        are fp8 (a dot under 16 rows falls back to bf16: which tensors own the columns
        depends on the shapes); ``program`` and ``shapes``: their ``_signature``; a
        lowering with an empty history, once per signature."""
        # Per jax trace configuration too: under jax.default_matmul_precision("highest")
        # no dot is fp8, so its calls key a history of their own by these columns (they
        # shifted zeros into the step's history); a configuration that changes neither
        # (jax.default_device) keeps the step's history.
        key = (program, shapes, target, internals.program_context())
        found = self._columns_of.get(key)
        if found is None:
            # Arrays, not ShapeDtypeStructs: a filtered call (Equinox) would take a
            # non-array leaf for a static. Zero columns: nothing allocated.
            empty = jnp.zeros((self.policy.amax_history, 0), jnp.float32)
            report = self._inner.lower_for(target, empty, *args, **kwargs).report()
            fp8 = tuple(d.operands_after[0].startswith("f8") for d in report.decisions)
            found = self._columns_of[key] = (report.fp8_state_columns, fp8)
        return found

    def _state_of(self, args: tuple, kwargs: dict, program: Any, shapes: Any
                  ) -> tuple[Any, tuple[int, int]]:
        """(the key of the history a call with these arguments uses, its shape)."""
        columns, fp8 = self._columns(args, kwargs, program, shapes)
        # One history per program, set of fp8 dots and the arguments' shapes beyond their
        # leading (batch) dimension: a new batch size shares it (the same tensors), unless
        # it moves a dot to or from its bf16 fallback; arguments of other widths do not,
        # though the columns match (a step that picks its weights by its input's shape
        # gave one weight the other's scales: its outputs were all 0).
        return (program, columns, fp8, _beyond_leading(shapes)), (self.policy.amax_history,
                                                                 columns)

    def _refuse_shape(self, history: jax.Array, shape: tuple[int, int],
                      dropped: str = "the state was not taken; ") -> None:
        if tuple(history.shape) != shape:
            raise ValueError(
                f"{self.__name__}: the loaded fp8 state has shape {tuple(history.shape)}, "
                f"this step keeps an amax history of {self.policy.amax_history} step(s) "
                f"in {shape[1]} column(s): expected {shape} ({dropped}load one of that "
                f"shape, or, where the step has several programs (static arguments), "
                f"load_fp8_state(history, *args) with the arguments of the calls it is "
                f"for)")

    def _history(self, args: tuple, kwargs: dict, program: Any, shapes: Any, leaves: list
                 ) -> tuple[Any, jax.Array, bool]:
        """(the key of this program's history, the history this call starts from,
        whether it is the one ``load_fp8_state`` gave; ``program``, ``shapes``,
        ``leaves``: the call's ``_signature``)."""
        state, shape = self._state_of(args, kwargs, program, shapes)
        if self._loaded is not None and shape[1]:  # a step quantising nothing waits
            # load_fp8_state's own f32 copy, for this call: one that does not fit is
            # refused here, and dropped (it was kept where the program had a history of
            # its own, and fp8_state() went on returning it, a checkpoint no step could
            # load). One that fits stays loaded until the call succeeds: the call
            # donates a copy.
            if tuple(self._loaded.shape) != shape:
                history, self._loaded = self._loaded, None
                # Said so: "not taken" read as still waiting for a call that fits, and the
                # next call started from an empty history without a word (review h114).
                self._refuse_shape(history, shape, "the loaded state is dropped: no later "
                                   "call starts from it; ")
            return state, _replicated_like(jnp.copy(self._loaded), leaves), True
        history = self._histories.get(state)
        if history is not None and not history.size and history.is_deleted():
            history = None  # an empty one a failed call took (it is donated, not copied)
        if history is not None:  # moved where this call's arguments are (another mesh)
            placed = _replicated_like(history, leaves)
            # The call donates a copy: one that fails while it runs (a checkify or
            # eqx.error_if error) leaves the kept history as it was (it was deleted,
            # and every later call and fp8_state() failed).
            if placed is history and history.size:  # a copy placed as it is: committed
                # with its own sharding (jnp.copy's spec, P(None, None) on an Explicit
                # mesh, compiled the step again), uncommitted as it was (committed, it
                # committed the step's outputs). An empty history needs none (the copy's
                # dispatch, 15 to 20 us on a CPU, doubled a tiny step's call).
                placed = (jax.device_put(history, history.sharding, may_alias=False)
                          if history.committed else jnp.copy(history))
            return state, placed, False
        return state, _replicated_like(jnp.zeros(shape, jnp.float32), leaves), False

    def fp8_state(self, /, *args: Any, **kwargs: Any) -> jax.Array:
        """A copy of an amax history, for a checkpoint: ``f32[amax_history, S]``, newest
        step first, one column per quantised tensor (per layer for a tensor in a scan).

        Without arguments: the history the next call starts from (the last call's, or
        one ``load_fp8_state`` gave since); where the step keeps several (a static
        argument that picks other layers, a short last batch whose dots fell back to
        bf16), that is ambiguous and raises. With the step's arguments (arrays or
        ``jax.ShapeDtypeStruct``s, the static ones as values): the history calls with
        those arguments use."""
        with self._state_lock:
            if args or kwargs:
                state, shape = self._selected(args, kwargs)
                history = self._histories.get(state)
                if self._loaded is not None and tuple(self._loaded.shape) == shape and shape[1]:
                    history = self._loaded  # what the next such call starts from
                if history is None:
                    raise RuntimeError(f"{self.__name__}: no fp8 state for these arguments "
                                       "yet (it exists after the first call with them)")
                return jnp.copy(history)
            if self._loaded is not None:
                return jnp.copy(self._loaded)
            # A history of no column (a short last batch's dots all fell back to bf16)
            # holds nothing to save.
            held = [state for state in self._histories if state[1]]
            if not held and self._last_state is None:
                raise RuntimeError(f"{self.__name__}: no fp8 state yet (it exists after the "
                                   "first call)")
            held = held or [self._last_state]
            if len(held) > 1:
                widths = sorted(state[1] for state in held)
                raise ValueError(
                    f"{self.__name__}: the step keeps {len(held)} fp8 amax histories (of "
                    f"{', '.join(map(str, widths))} column(s)): one per static argument "
                    f"value, per set of dots in fp8 (a batch under 16 rows falls back "
                    f"to bf16) and per argument shape beyond the leading dimension; name one by the step's arguments, fp8_state(*args) and "
                    f"load_fp8_state(history, *args), for each")
            return jnp.copy(self._histories[self._last_state if self._last_state in held
                                            else held[0]])

    def load_fp8_state(self, history: Any, /, *args: Any, **kwargs: Any) -> None:
        """Restore an amax history ``fp8_state()`` returned. Without more arguments the
        next call that quantises starts from it (where its step quantises another number
        of tensors, that call raises and the state is dropped); with the step's
        arguments, the calls with those arguments do (a history of another shape raises
        here).
        ``history`` stays the caller's: the step donates a copy of it."""
        if isinstance(history, (list, tuple)):  # a checkpoint written as JSON
            history = np.asarray(history)
        if isinstance(history, jax.ShapeDtypeStruct):
            raise TypeError(f"{self.__name__}: an fp8 state is an array of amaxes "
                            f"(fp8_state()'s), got a ShapeDtypeStruct, which holds none")
        given = getattr(history, "dtype", None)
        if given is None or not jnp.issubdtype(given, jnp.floating):
            raise TypeError(f"{self.__name__}: an fp8 state is a float array (fp8_state()'s "
                            f"f32), got {type(history).__name__} of dtype {given}")
        # A copy: jnp.asarray returns an f32 jax.Array itself, which the next call would
        # donate, deleting the caller's array (a checkpoint loaded into two steps).
        history = jnp.array(history, jnp.float32, copy=True)
        if not bool(jnp.all(jnp.isfinite(history) & (history >= 0))):
            raise ValueError(f"{self.__name__}: an fp8 state holds amaxes: finite and not "
                             f"negative; this one has NaN, inf or negative entries")
        if history.ndim != 2 or history.shape[0] != self.policy.amax_history:
            raise ValueError(f"{self.__name__}: an fp8 state is f32[{self.policy.amax_history}"
                             f", S] (amax_history={self.policy.amax_history}), got shape "
                             f"{tuple(history.shape)}")
        with self._state_lock:
            if args or kwargs:
                state, shape = self._selected(args, kwargs)
                self._refuse_shape(history, shape)
                self._histories[state] = history
                if self._loaded is not None and tuple(self._loaded.shape) == shape:
                    self._loaded = None  # the later load, for these calls, wins
                return
            self._loaded = history

    def _selected(self, args: tuple, kwargs: dict) -> tuple[Any, tuple[int, int]]:
        """The history key and shape that a call with these arguments uses (a bad
        argument named as a call names it: review h114)."""
        with self._named_by_the_step(args, kwargs):
            program, shapes, _ = self._signature(args, kwargs)
            return self._state_of(args, kwargs, program, shapes)

    # -- calls --

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """A method decorated with it is bound to its instance, as under jax.jit."""
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if jax.config.jax_disable_jit:  # as jax.jit: op by op, the history untouched
            return self.fn(*args, **kwargs)
        program, shapes, leaves = self._signature(args, kwargs)
        # A transformation's trace is active although no argument is a tracer where the
        # caller closes over its arrays (jax.jit(lambda: step(w, x))): the traced history
        # kept would break every later call (UnexpectedTracerError).
        if not internals.trace_state_clean() or any(
                isinstance(x, internals.Tracer) for x in (*leaves, *args, *kwargs.values())):
            raise TypeError(
                f"hlo_amp.compile({self.__name__}) with scaling=delayed keeps its fp8 amax "
                "history between calls, so it cannot run under jax.jit, vmap, grad, "
                "jax.export or another transformation; call it at the top level (.lower() "
                "gives the stateful step, history in and out, for AOT), or use "
                "scaling=current there; step.eval_shape(*args) gives the outputs' shapes")
        if self._donated_names & kwargs.keys():
            # The inner function's signature is (history, *args, **kwargs): only positions
            # say what is donated, so a donated parameter passed by keyword goes by position.
            args, kwargs = _bound(self._fn_signature, args, kwargs)
        with self._state_lock:
            with self._named_by_the_step(args, kwargs):
                state, history, loaded = self._history(args, kwargs, program, shapes,
                                                       leaves)
                out, self._histories[state] = self._inner(history, *args, **kwargs)
            if loaded:
                self._loaded = None
            self._last_state = state
        return out

    @contextlib.contextmanager
    def _named_by_the_step(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """An error about an argument, named by the step's own positions and parameters
        (the inner step's are one further: the history is first)."""
        try:
            yield
        except (TypeError, ValueError) as error:
            raise_argument_problem(
                self.__name__, args, kwargs, static_argnums=self.static_argnums,
                static_argnames=self.static_argnames,
                style=argument_style(args, kwargs, self.filter, self._styles),
                signature=self._fn_signature)
            differ = (_devices_differ(self.__name__, args, kwargs)
                      if _INCOMPATIBLE_DEVICES in str(error) else None)
            if differ is not None:  # jax's message named the history against one of them
                raise ValueError(differ) from None
            renamed = _argument_named_as_the_steps(error)
            if renamed is not None:
                raise renamed from None
            raise
        except jax.errors.JaxRuntimeError as error:  # an argument donated and read
            renamed = _argument_named_as_the_steps(error)
            if renamed is not None:
                raise renamed from None
            raise

    def lower(self, /, *args: Any, **kwargs: Any) -> Any:
        """The stateful function lowered and rewritten: its compiled form takes the
        history (``f32[amax_history, S]``) first and returns ``(outputs, history)``.
        ``target=`` as for ``AmpFunction.lower``."""
        device, kwargs = split_device_target(self.fn, kwargs)
        return self.lower_for(device, *args, **kwargs)

    def lower_for(self, target: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``lower(*args, **kwargs)`` for the device ``target`` (None: this machine's)."""
        with self._named_by_the_step(args, kwargs):
            history = self._zero_history(args, kwargs, target)
            lowered = self._inner.lower_for(target, history, *args, **kwargs)
        lowered.history_shape = tuple(history.shape)
        return lowered

    def _zero_history(self, args: tuple, kwargs: dict, target: Any = None) -> jax.Array:
        """An all-zero history of the width calls with these arguments take."""
        program, shapes, _ = self._signature(args, kwargs)
        columns, _ = self._columns(args, kwargs, program, shapes, target)
        return jnp.zeros((self.policy.amax_history, columns), jnp.float32)

    def trace(self, /, *args: Any, **kwargs: Any) -> Any:
        """The stateful function traced for these arguments, as ``lower`` lowers it:
        its jaxpr takes the history first and returns ``(outputs, history)``."""
        with self._named_by_the_step(args, kwargs):
            history = self._zero_history(args, kwargs)
            traced = self._inner.trace(history, *args, **kwargs)
        traced.history_shape = tuple(history.shape)
        # For a device target the history is that target's width (this machine's took
        # the target's amaxes to current scaling).
        traced.lower_for_target = lambda target: self.lower_for(target, *args, **kwargs)
        traced.export_refusal = (
            f"hlo_amp.compile({self.__name__}) with scaling=delayed keeps its fp8 amax "
            f"history between calls, so jax.export cannot export it (nor jax.jit of it); "
            f"export a step compiled with scaling=current")
        return traced

    def eval_shape(self, /, *args: Any, **kwargs: Any) -> Any:
        """The step's outputs' shapes and dtypes (the history aside), nothing compiled."""
        empty = jnp.zeros((self.policy.amax_history, 0), jnp.float32)
        with self._named_by_the_step(args, kwargs):
            out, _history = self._inner.eval_shape(empty, *args, **kwargs)
        return out

    def clear_cache(self) -> None:
        """Drop every executable (the amax histories stay: they are the training state)."""
        self._inner.clear_cache()
        self._columns_of.clear()

    @property
    def lowerings(self) -> int:
        return self._inner.lowerings

    def cache_size(self) -> int:
        return self._inner.cache_size()


def _bound(signature: inspect.Signature | None, args: tuple, kwargs: dict
           ) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` bound to the step's parameters, defaults filled in: by
    position where a parameter can be (unchanged where the step has no signature or the
    call does not bind, which the call itself then reports)."""
    if signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    bound.apply_defaults()
    return bound.args, bound.kwargs
