"""Dynamic loss scaling for low-precision (f16) training.

Holds `DynamicScalerState`, the `dynamic_scale_value_and_grad` / `dynamic_scale_grad`
transforms and the helpers `all_finite` / `select_tree`. The API follows jaxamp 0.0.4
(same names, same field names and defaults, same return layout, jaxamp's `filter=`)
so code written for jaxamp runs unchanged; it needs only jax, and equinox for
`filter=True`. jaxamp defaults to `filter=True` and, in `dynamic_scale_value_and_grad`,
`redo_on_nan=10`; here both default off, and `hlo_amp.jaxamp_compat` has jaxamp's.

How one scaled step works:

1. The loss is cast to f32 (or wider, if it already is) and multiplied by
   `state.scaler` there, so the scaled *value* never overflows f16. That product is
   what gets differentiated: the cotangent entering the program is `scaler`, and it
   reaches the low-precision ops multiplied by it, which keeps small gradients out of
   the f16 subnormal range.
2. Each floating gradient is unscaled in f32 (or wider) and cast back to the dtype of
   its primal input, as `jax.grad` would return it. The value comes back unscaled, in
   f32. Aux is returned untouched.
3. Only the gradients are checked for inf/NaN (aux may hold integers or non-finite
   metrics). A finite step counts towards growth; a non-finite one backs the scaler
   off. The state never holds Python numbers after a step: f32 and int32 arrays.

Skipping the update on a non-finite step is left to the caller: wrap the optimizer in
`optax.apply_if_finite`, or pick old/new values with `select_tree(all_finite(grads),
new, old)`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import numpy as np

from hlo_amp import jax_internals as internals
from hlo_amp.passes.fp8_state import RETRY_SCOPE

__all__ = [
    "DynamicScalerState",
    "all_finite",
    "dynamic_scale_grad",
    "dynamic_scale_value_and_grad",
    "select_tree",
]

PyTree = Any

_FLOAT_FIELDS = ("adjust_factor", "scaler", "min_scaler")
_INT_FIELDS = ("patience", "count", "total_resets")


class _ScalerFields(NamedTuple):
    """The fields of `DynamicScalerState`, in jaxamp's order (extras last)."""

    patience: Any = 2000
    adjust_factor: Any = 2.0
    scaler: Any = 2.0**15
    count: Any = 0
    total_resets: Any = 0
    min_scaler: Any = 1.0


def _field_dtype(name: str) -> np.dtype:
    return np.dtype(np.float32) if name in _FLOAT_FIELDS else np.dtype(np.int32)


# The Python and NumPy scalars the constructor turns into arrays.
_NUMBERS = (bool, int, float, np.bool_, np.integer, np.floating)


def _is_number(value: Any) -> bool:
    """A Python or NumPy real number (what ``_normalise_leaf`` converts), not a bool."""
    return isinstance(value, _NUMBERS) and not isinstance(value, (bool, np.bool_))


def _normalise_leaf(value: Any, dtype: np.dtype) -> Any:
    """Turn a Python or NumPy scalar into a jax array of `dtype`; pass anything else.

    Arrays, tracers, ShapeDtypeStructs, None and the sentinels that jax's tree
    utilities pass to constructors are returned as they are, so unflattening a
    `DynamicScalerState` with any leaves keeps working.
    """
    if isinstance(value, _NUMBERS):
        return jnp.asarray(value, dtype=dtype)
    return value


class DynamicScalerState(_ScalerFields):
    """State of a dynamic loss scaler; a NamedTuple, hence a pytree.

    Fields (jaxamp's names and defaults, plus `min_scaler`):
        patience: finite steps in a row before the scaler grows (int32, 2000).
        adjust_factor: growth / back-off factor (f32, 2.0).
        scaler: the current loss scale (f32, 2**15).
        count: finite steps since the last growth or back-off (int32, 0).
        total_resets: non-finite steps seen so far (int32, 0).
        min_scaler: the scaler never backs off below this (f32, 1.0).

    Python and NumPy scalars given to the constructor become jax arrays of the field's
    dtype; any other value (arrays, tracers, None, placeholders used by jax's tree
    utilities) is kept as given, so `jax.tree_util` unflattening, `jit`, `vmap` and
    `eval_shape` treat it like any NamedTuple. An axis spec for `vmap` is built by
    unflattening, as the constructor would make its 0 an array:
    `jax.tree.unflatten(jax.tree.structure(state), [None, None, 0, None, None, None])`.
    Arrays of another dtype are cast when the state is used by a scaled function.
    """

    __slots__ = ()

    def __new__(
        cls,
        patience: Any = 2000,
        adjust_factor: Any = 2.0,
        scaler: Any = 2.0**15,
        count: Any = 0,
        total_resets: Any = 0,
        min_scaler: Any = 1.0,
    ) -> Self:
        # Python and NumPy numbers (np.float32's 0.5 passed where 0.5 was refused).
        if _is_number(adjust_factor) and not 1 < float(adjust_factor) < math.inf:
            # Backing off divides by it: at or below 1 the scaler never backs off.
            raise ValueError(f"adjust_factor must be above 1 and finite (the scaler is "
                             f"multiplied by it to grow and divided by it to back off), "
                             f"got {adjust_factor!r}")
        for name, value in (("scaler", scaler), ("min_scaler", min_scaler)):
            # inf (1e39 is inf in f32) or 0 never backs off to a finite, nonzero scale:
            # every later step was non-finite and skipped.
            with np.errstate(over="ignore"):  # 1e39 is inf in f32: refused below
                in_f32 = float(np.float32(value)) if _is_number(value) else None
            if in_f32 is not None and not 0 < in_f32 < math.inf:
                raise ValueError(f"{name} must be positive and finite in f32 (at most "
                                 f"{float(np.finfo(np.float32).max):.4g}), got {value!r}")
        values = (patience, adjust_factor, scaler, count, total_resets, min_scaler)
        leaves = [
            _normalise_leaf(v, _field_dtype(name))
            for name, v in zip(_ScalerFields._fields, values, strict=True)
        ]
        return super().__new__(cls, *leaves)

    @classmethod
    def _make(cls, iterable: Sequence[Any]) -> Self:
        """Build from an iterable of field values, normalising like the constructor."""
        return cls(*iterable)

    def _replace(self, **changes: Any) -> Self:
        """Return a copy with `changes` applied, normalising like the constructor."""
        return type(self)(**{**self._asdict(), **changes})


def _state_children(state: DynamicScalerState) -> tuple[tuple, None]:
    return tuple(state), None


def _state_with_keys(state: DynamicScalerState) -> tuple[tuple, None]:
    return tuple((jax.tree_util.GetAttrKey(name), value)
                 for name, value in zip(_ScalerFields._fields, state, strict=True)), None


def _state_from_children(_: None, children: Any) -> DynamicScalerState:
    # Unflattening keeps the leaves as given, unlike the constructor: tree utilities
    # rebuild the state with any leaves, e.g. Equinox's bool filter masks in
    # eqx.partition / eqx.filter_jit, which must stay Python bools.
    return tuple.__new__(DynamicScalerState, tuple(children))


# Registered like a NamedTuple (same leaves, same key paths), minus the normalisation.
jax.tree_util.register_pytree_with_keys(DynamicScalerState, _state_with_keys,
                                        _state_from_children, _state_children)


def _canonical_state(state: DynamicScalerState) -> DynamicScalerState:
    """Cast every field to its dtype (f32 / int32), accepting arrays of any dtype."""
    if not isinstance(state, DynamicScalerState):
        raise TypeError(
            "dynamic_scaler_state must be a hlo_amp DynamicScalerState, got "
            f"{type(state).__name__}; build one with DynamicScalerState()"
        )
    return DynamicScalerState(
        *(
            jnp.asarray(value, dtype=_field_dtype(name))
            for name, value in zip(state._fields, state, strict=True)
        )
    )


# The fields one step changes (_next_state); the others are the scaler's settings.
_STEP_FIELDS = ("scaler", "count", "total_resets")


def _next_state(state: DynamicScalerState, finite: jax.Array) -> DynamicScalerState:
    """Advance the scaler after one step whose gradients were `finite` (or not)."""
    count = state.count + 1
    due = finite & (count >= state.patience)
    # An array adjust_factor of NaN, inf or at most 1 (a checkpoint's: the constructor
    # refuses those numbers) is 2, the default: NaN made the scaler NaN for good.
    factor = jnp.where(jnp.isfinite(state.adjust_factor) & (state.adjust_factor > 1),
                       state.adjust_factor, 2.0)
    grown = state.scaler * factor
    grow = due & jnp.isfinite(grown)  # never grow into inf: hold the scaler instead
    # Never below min_scaler, and never up: a scaler set below it holds on overflow. An
    # array state given inf or 0 (the constructor refuses those numbers) backs off from
    # f32's largest value and stops at its smallest normal one, not at inf or 0, where
    # every later step was non-finite.
    # A NaN scaler backs off as inf does; a NaN or infinite min_scaler is no floor (NaN
    # made the scaler NaN, inf held it where every step overflowed); a scaler of 0 (or
    # below) starts again from the floor (it held at 0, every step skipped).
    f32 = jnp.finfo(jnp.float32)
    current = jnp.where(jnp.isnan(state.scaler), f32.max, jnp.minimum(state.scaler, f32.max))
    floor = jnp.where(jnp.isfinite(state.min_scaler),
                      jnp.maximum(state.min_scaler, f32.tiny), f32.tiny)
    current = jnp.where(current > 0, current, floor)
    backed_off = jnp.minimum(current, jnp.maximum(current / factor, floor))
    scaler = jnp.where(finite, jnp.where(grow, grown, state.scaler), backed_off)
    return state._replace(
        scaler=scaler,
        count=jnp.where(finite & ~due, count, jnp.zeros_like(count)),
        total_resets=state.total_resets + jnp.where(finite, 0, 1).astype(jnp.int32),
    )


def _is_inexact(x: Any) -> bool:
    """True for float / complex arrays and Python floats (not ints, bools, float0, keys)."""
    if isinstance(x, (float, complex)):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every float leaf of `tree` is free of inf and NaN, as a scalar bool array.

    Non-float leaves (integers, bools, float0 gradients, PRNG keys) are ignored; a tree
    without float leaves is finite.
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_inexact(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: Any, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Pick `on_true` where scalar bool `pred` holds, else `on_false`, leaf by leaf.

    Both trees must have the same structure and leaf dtypes. Use it to skip the
    optimizer update on a non-finite step without optax::

        finite = all_finite(grads)
        params, opt_state = select_tree(finite, (new_params, new_opt_state),
                                        (params, opt_state))
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(
            f"select_tree needs a scalar bool predicate, got shape {pred.shape} dtype {pred.dtype}"
        )

    def pick(path: Any, a: Any, b: Any) -> Any:
        # One object on both sides (an Equinox model's activation function), or one
        # Python number (eqx.nn.Dropout's p): kept as it is. A number turned into an
        # array became a traced argument of the next filter_jit step.
        if a is b or _same_number(a, b):
            return a
        if _is_array_like(a) and _is_array_like(b):
            a, b = jnp.asarray(a), jnp.asarray(b)
            if a.dtype != b.dtype or a.shape != b.shape:
                raise TypeError(
                    f"select_tree picks leaves of one dtype and shape; at "
                    f"{jax.tree_util.keystr(path)} it got {a.dtype}{list(a.shape)} and "
                    f"{b.dtype}{list(b.shape)}")
            return jax.lax.select(pred, a, b)
        raise TypeError(
            f"select_tree picks arrays leaf by leaf; at {jax.tree_util.keystr(path)} it got "
            f"{type(a).__name__} and {type(b).__name__}, which are neither arrays nor one "
            f"object (filter them out first, e.g. eqx.filter(tree, eqx.is_array))")

    return jax.tree_util.tree_map_with_path(pick, on_true, on_false)


def _same_number(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one Python or NumPy number, bit for bit (-0.0 is not
    0.0; a NaN is itself)."""
    if type(a) is not type(b) or not isinstance(a, _NUMBERS):
        return False
    try:
        return np.asarray(a).tobytes() == np.asarray(b).tobytes()
    except OverflowError:  # a Python int past int64
        return a == b


def _is_array_like(value: Any) -> bool:
    """An array, a tracer or a Python or NumPy number: what ``lax.select`` can take."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _unscale(grads: PyTree, scaler: jax.Array) -> PyTree:
    """Divide float grads by `scaler` in f32 (or wider), then cast back to their dtype."""

    def one(g: Any) -> Any:
        if not _is_inexact(g):
            return g
        g = jnp.asarray(g)
        wide = jnp.promote_types(g.dtype, jnp.float32)
        # A weakly typed gradient (of a Python-number primal) stays weak, as jax.grad's.
        return internals.convert_element_type(g.astype(wide) / scaler.astype(wide), g.dtype,
                                              weak_type=jax.typeof(g).weak_type)

    return jax.tree_util.tree_map(one, grads)


def _filter_value_and_grad() -> Callable[..., Any]:
    """``equinox.filter_value_and_grad``, imported only when ``filter=True`` asks for it."""
    try:
        import equinox
    except ImportError:
        raise ImportError(
            "filter=True differentiates with equinox.filter_value_and_grad, and equinox is "
            "not installed: pip install equinox, or pass filter=False (jax.value_and_grad)"
        ) from None
    return equinox.filter_value_and_grad


def _scaled_value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool,
    redo_on_nan: int,
    argnums: int | Sequence[int] | None,
    filter: bool,
    grad_kwargs: dict[str, Any],
) -> Callable[..., tuple[DynamicScalerState, tuple[tuple[jax.Array, Any], PyTree]]]:
    """The shared core: returns f(*args, dynamic_scaler_state, **kw) -> (state, ((v, aux), g))."""
    if (isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, (int, np.integer))
            or redo_on_nan < 0):  # True was taken as 1
        raise ValueError(f"redo_on_nan must be a non-negative int, got {redo_on_nan!r}")

    def scaled_loss(*args: Any, _hlo_amp_scaler: jax.Array, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                # The value's shape, not its class (a tracer's, jax's internal name).
                got = (f"{type(out).__name__} of {len(out)}"
                       if isinstance(out, (tuple, list)) else
                       f"an array of shape {jnp.shape(out)}" if hasattr(out, "shape")
                       else type(out).__name__)
                raise TypeError(
                    f"with has_aux=True the function must return a pair (loss, aux), got "
                    f"{got}")
            loss, aux = out
        else:
            loss, aux = out, None
            if isinstance(out, (tuple, list)):
                raise TypeError(
                    f"the function returned a {type(out).__name__} of {len(out)}; a loss "
                    f"with auxiliary outputs needs has_aux=True (returning (loss, aux))")
        loss = jnp.asarray(loss)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(
                "the loss must be a real floating-point scalar, got shape "
                f"{loss.shape} dtype {loss.dtype}"
            )
        wide = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
        return wide * _hlo_amp_scaler.astype(wide.dtype), (wide, aux)

    if filter:
        # jaxamp hands argnums to equinox among the other keywords, and equinox refuses
        # it with its own message: the same here. Without it, the first argument.
        extra = {} if argnums is None else {"argnums": argnums}
        value_and_grad = _filter_value_and_grad()(
            scaled_loss, has_aux=True, **extra, **grad_kwargs)
    else:
        value_and_grad = jax.value_and_grad(
            scaled_loss, argnums=0 if argnums is None else argnums, has_aux=True,
            **grad_kwargs)

    def attempt(
        state: DynamicScalerState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[DynamicScalerState, Any, jax.Array]:
        (_, (value, aux)), grads = value_and_grad(*args, _hlo_amp_scaler=state.scaler, **kwargs)
        grads = _unscale(grads, state.scaler)
        finite = all_finite(grads)
        return _next_state(state, finite), ((value, aux), grads), finite

    @_with_state_parameter(fun)
    def wrapped(
        *args: Any, dynamic_scaler_state: DynamicScalerState, **kwargs: Any
    ) -> tuple[DynamicScalerState, tuple[tuple[jax.Array, Any], PyTree]]:
        state = _canonical_state(dynamic_scaler_state)
        if redo_on_nan == 0:
            new_state, results, _ = attempt(state, args, kwargs)
            return new_state, results

        # The loop carries arrays: the aux's other leaves (a string, a Python number) are
        # the same on every pass, and are put back after it as jax.value_and_grad gives
        # them.
        aux_layout: list[Any] = []

        def carried(state: DynamicScalerState) -> tuple[Any, ...]:
            new_state, ((value, aux), grads), finite = attempt(state, args, kwargs)
            arrays, aux_layout[:] = _split_aux(aux)
            return new_state, ((value, arrays), grads), finite

        # One traced copy of `fun`, inside the loop body; the first pass is forced.
        result_shapes = jax.eval_shape(lambda s: carried(s)[1], state)
        # zeros_like keeps each result's sharding (an Explicit mesh axis is in its type).
        placeholder = jax.tree_util.tree_map(jnp.zeros_like, result_shapes)

        def keep_going(carry: tuple[Any, ...]) -> jax.Array:
            _, _, _, finite, tries, shrank = carry
            # The name marks the loop as a retry for fp8's delayed scaling, which records
            # the last try's amaxes (passes/fp8_state.py); the body keeps the user's scopes.
            with jax.named_scope(RETRY_SCOPE):
                return (tries == 0) | (~finite & (tries <= redo_on_nan) & shrank)

        def moving(state: DynamicScalerState) -> tuple[jax.Array, ...]:
            return tuple(getattr(state, name) for name in _STEP_FIELDS)

        def moved(fields: tuple[jax.Array, ...]) -> DynamicScalerState:
            return state._replace(**dict(zip(_STEP_FIELDS, fields)))

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            tried, _, _, _, tries, _ = carry
            at = moved(tried)
            new_state, results, finite = carried(at)
            shrank = new_state.scaler < at.scaler
            # A finite try carries the state it ran at, so that running the body again
            # repeats it: under jax.vmap a member that is done runs on while another
            # retries (its carries kept by a select, its amaxes recorded: the history
            # took a try at its grown scale, review h109), and its state after the step
            # comes from the carry beside it. Only the fields a step changes are
            # carried: the others stay unbatched under vmap (review h110).
            tried = tuple(jnp.where(finite, a, b) for a, b in zip(tried, moving(new_state)))
            return tried, moving(new_state), results, finite, tries + 1, shrank

        init = (moving(state), moving(state), placeholder, jnp.array(False),
                jnp.array(0, jnp.int32), jnp.array(True))
        _, after, ((value, arrays), grads), _, _, _ = jax.lax.while_loop(
            keep_going, body, init)
        return moved(after), ((value, _join_aux(arrays, *aux_layout)), grads)

    return wrapped


def _split_aux(aux: Any) -> tuple[list[Any], list[Any]]:
    """(the aux's jax array leaves, [its tree, its other leaves with None for each
    array]). A NumPy array is a value the loss made while traced, kept aside as it is
    (through the retry loop it came back a jax array of another dtype: float64 as
    float32)."""
    leaves, tree = jax.tree_util.tree_flatten(aux)
    arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
    others = [None if isinstance(leaf, jax.Array) else leaf for leaf in leaves]
    return arrays, [tree, others]


def _join_aux(arrays: list[Any], tree: Any, others: list[Any]) -> Any:
    """The aux ``_split_aux`` split, its arrays now ``arrays``."""
    pending = iter(arrays)
    return jax.tree_util.tree_unflatten(
        tree, [next(pending) if leaf is None else leaf for leaf in others])


def _with_state_parameter(fun: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """``functools.wraps(fun)``, with ``fun``'s signature plus the keyword-only
    ``dynamic_scaler_state``: a wrapper that binds arguments by signature
    (``eqx.filter_jit``) read ``fun``'s alone through ``__wrapped__`` and refused the
    state ("got an unexpected keyword argument"), as jaxamp's does not."""
    def decorate(wrapped: Callable[..., Any]) -> Callable[..., Any]:
        functools.update_wrapper(wrapped, fun)
        try:
            signature = inspect.signature(fun)
        except (TypeError, ValueError):  # a callable without one: the wrapper's own
            del wrapped.__wrapped__
            return wrapped
        parameters = list(signature.parameters.values())
        if "dynamic_scaler_state" not in signature.parameters:
            at = next((i for i, p in enumerate(parameters)
                       if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
            parameters.insert(at, inspect.Parameter("dynamic_scaler_state",
                                                    inspect.Parameter.KEYWORD_ONLY))
        wrapped.__signature__ = signature.replace(parameters=parameters)
        return wrapped
    return decorate


def dynamic_scale_value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = False,
    argnums: int | Sequence[int] | None = None,
    **kwargs: Any,
) -> Callable[..., tuple[DynamicScalerState, Any]]:
    """Like `jax.value_and_grad(fun)`, with dynamic loss scaling.

    Args:
        fun: returns a real float scalar loss (or `(loss, aux)` with `has_aux`).
        has_aux: as in `jax.value_and_grad`.
        redo_on_nan: on non-finite grads, back off and recompute up to this many more
            times inside the same compiled step (a `lax.while_loop`), stopping early
            once the scaler is pinned at `min_scaler`. If every try fails the
            non-finite result is returned, and the state holds one back-off (and one
            `total_resets`) per failed try.
        filter: as in jaxamp: differentiate with `equinox.filter_value_and_grad`
            (every floating array leaf of the first argument; other leaves such as
            activation functions and ints get `None` grads) instead of
            `jax.value_and_grad`. Needs equinox; with it, `argnums` is refused, as
            equinox refuses it.
        argnums: as in `jax.value_and_grad` (default 0).
        **kwargs: passed on to `jax.value_and_grad` (e.g. `allow_int`).

    Returns:
        A function taking `fun`'s arguments plus the keyword-only
        `dynamic_scaler_state=` and returning `(new_state, (value, grads))`, or
        `(new_state, ((value, aux), grads))` with `has_aux`. `value` is the unscaled
        loss in f32 (or wider); each grad has its primal input's dtype and was
        unscaled in f32 before the cast. Skip the update on non-finite steps with
        `optax.apply_if_finite` or `select_tree(all_finite(grads), new, old)`.
    """
    core = _scaled_value_and_grad(
        fun, has_aux=has_aux, redo_on_nan=redo_on_nan, argnums=argnums, filter=filter,
        grad_kwargs=kwargs,
    )

    @_with_state_parameter(fun)
    def wrapped(*args: Any, dynamic_scaler_state: DynamicScalerState, **kw: Any) -> Any:
        state, ((value, aux), grads) = core(*args, dynamic_scaler_state=dynamic_scaler_state, **kw)
        return state, (((value, aux) if has_aux else value), grads)

    return wrapped


def dynamic_scale_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = False,
    argnums: int | Sequence[int] | None = None,
    **kwargs: Any,
) -> Callable[..., tuple[DynamicScalerState, Any]]:
    """Like `jax.grad(fun)`, with dynamic loss scaling.

    Same arguments and semantics as `dynamic_scale_value_and_grad`; the returned
    function gives `(new_state, grads)`, or `(new_state, (grads, aux))` with `has_aux`.
    """
    core = _scaled_value_and_grad(
        fun, has_aux=has_aux, redo_on_nan=redo_on_nan, argnums=argnums, filter=filter,
        grad_kwargs=kwargs,
    )

    @_with_state_parameter(fun)
    def wrapped(*args: Any, dynamic_scaler_state: DynamicScalerState, **kw: Any) -> Any:
        state, ((_, aux), grads) = core(*args, dynamic_scaler_state=dynamic_scaler_state, **kw)
        return state, ((grads, aux) if has_aux else grads)

    return wrapped
