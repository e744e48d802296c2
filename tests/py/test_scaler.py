"""Tests for the dynamic loss scaler (hlo_amp/runtime/scaler.py).

Covers the state pytree (normalisation, jit, flatten/unflatten, save/load), gradient
underflow rescue, overflow handling (skipping updates, back-off, growth, floor),
`redo_on_nan`, `has_aux` / `argnums`, the tree helpers, and an f16 train step against
an f32 run. Tolerances follow torch.testing (bf16 rtol 1.6e-2, f16 rtol 1e-3, atol 1e-5).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from host_devices import run_on_host_devices

from hlo_amp.runtime.scaler import (
    DynamicScalerState,
    all_finite,
    dynamic_scale_grad,
    dynamic_scale_value_and_grad,
    select_tree,
)

TOL: dict[Any, dict[str, float]] = {
    jnp.float16: {"rtol": 1e-3, "atol": 1e-5},
    jnp.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
    jnp.float32: {"rtol": 1.3e-6, "atol": 1e-5},
}

FIELD_DTYPES = {
    "patience": jnp.int32,
    "adjust_factor": jnp.float32,
    "scaler": jnp.float32,
    "count": jnp.int32,
    "total_resets": jnp.int32,
    "min_scaler": jnp.float32,
}


def assert_state(state: DynamicScalerState, **expected: float) -> None:
    """Check every field's dtype, and the values given in `expected`."""
    for name, dtype in FIELD_DTYPES.items():
        value = getattr(state, name)
        assert isinstance(value, (jax.Array, np.ndarray)), (name, type(value))
        assert value.dtype == dtype, (name, value.dtype)
    for name, want in expected.items():
        assert float(getattr(state, name)) == want, (name, getattr(state, name), want)


# --------------------------------------------------------------------------- state


def test_state_defaults_match_jaxamp() -> None:
    state = DynamicScalerState()
    assert state._fields[:5] == ("patience", "adjust_factor", "scaler", "count", "total_resets")
    assert_state(
        state,
        patience=2000,
        adjust_factor=2.0,
        scaler=2.0**15,
        count=0,
        total_resets=0,
        min_scaler=1.0,
    )


def test_state_normalises_python_and_numpy_numbers() -> None:
    state = DynamicScalerState(scaler=1024, patience=3.0, adjust_factor=np.float64(4), count=True)
    assert_state(state, scaler=1024.0, patience=3, adjust_factor=4.0, count=1)
    replaced = state._replace(scaler=8, total_resets=np.int64(5))
    assert_state(replaced, scaler=8.0, total_resets=5, patience=3)
    made = DynamicScalerState._make([10, 3, 256, 0, 0, 2])
    assert_state(made, patience=10, adjust_factor=3.0, scaler=256.0, min_scaler=2.0)


def test_state_unflatten_passes_non_numbers_through() -> None:
    state = DynamicScalerState()
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert len(leaves) == 6
    sentinels = [object() for _ in leaves]
    rebuilt = jax.tree_util.tree_unflatten(treedef, sentinels)
    assert type(rebuilt) is DynamicScalerState
    assert all(a is b for a, b in zip(rebuilt, sentinels, strict=True))
    assert all(x is None for x in jax.tree_util.tree_map(lambda _: None, state))
    shapes = jax.eval_shape(lambda s: s._replace(scaler=s.scaler * 2), state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in shapes)
    assert [x.dtype for x in shapes] == list(FIELD_DTYPES.values())
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert all(a is b for a, b in zip(again, leaves, strict=True))


def test_state_jit_round_trip_and_no_retrace() -> None:
    state = DynamicScalerState(scaler=64, patience=3)
    out = jax.jit(lambda s: s)(state)
    assert type(out) is DynamicScalerState
    assert_state(out, scaler=64.0, patience=3)
    built = jax.jit(lambda s: DynamicScalerState(scaler=s * 2, patience=7))(jnp.float32(4.0))
    assert_state(built, scaler=8.0, patience=7, count=0)

    traces = []

    def loss(w: jax.Array) -> jax.Array:
        traces.append(1)
        return jnp.sum(w**2)

    step = jax.jit(dynamic_scale_value_and_grad(loss))
    state, _ = step(jnp.ones(3), dynamic_scaler_state=state)
    state, _ = step(jnp.ones(3), dynamic_scaler_state=state)
    assert_state(state, count=2, scaler=64.0)
    assert len(traces) == 1


def test_state_save_load_leaves(tmp_path: Path) -> None:
    state = DynamicScalerState(scaler=512, patience=9, count=4, total_resets=2, min_scaler=8)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    np.savez(tmp_path / "leaves.npz", *leaves)
    with np.load(tmp_path / "leaves.npz") as f:
        loaded = jax.tree_util.tree_unflatten(treedef, [f[f"arr_{i}"] for i in range(len(f))])
    np.savez(tmp_path / "named.npz", **state._asdict())
    with np.load(tmp_path / "named.npz") as f:
        named = DynamicScalerState(**f)
    for restored in (loaded, named):
        assert_state(restored, scaler=512.0, patience=9, count=4, total_resets=2, min_scaler=8.0)

    fn = jax.jit(dynamic_scale_grad(lambda w: jnp.sum(w**2)))
    s_orig, g_orig = fn(jnp.arange(3.0), dynamic_scaler_state=state)
    s_load, g_load = fn(jnp.arange(3.0), dynamic_scaler_state=loaded)
    np.testing.assert_array_equal(g_orig, g_load)
    for a, b in zip(s_orig, s_load, strict=True):
        np.testing.assert_array_equal(a, b)


def test_rejects_other_state_types_and_bad_losses() -> None:
    grad = dynamic_scale_grad(lambda w: jnp.sum(w))
    with pytest.raises(TypeError, match="DynamicScalerState"):
        grad(jnp.ones(2), dynamic_scaler_state=(2000, 2.0, 32768.0, 0))
    with pytest.raises(TypeError, match="real floating-point scalar"):
        dynamic_scale_grad(lambda w: w)(jnp.ones(2), dynamic_scaler_state=DynamicScalerState())
    with pytest.raises(ValueError, match="redo_on_nan"):
        dynamic_scale_grad(lambda w: jnp.sum(w), redo_on_nan=-1)
    with pytest.raises(ValueError, match="redo_on_nan must be a non-negative int, got True"):
        dynamic_scale_grad(lambda w: jnp.sum(w), redo_on_nan=True)  # it was taken as 1


def test_a_has_aux_mismatch_names_has_aux() -> None:
    # Without has_aux, a (loss, aux) pair failed in jax ("dtype object is not a valid JAX
    # array type"); with it, a bare loss was "got LinearizeTracer".
    state = DynamicScalerState()
    with pytest.raises(TypeError, match=r"tuple of 2; .* needs has_aux=True"):
        dynamic_scale_value_and_grad(lambda w: (jnp.sum(w), {"a": 1}))(
            jnp.ones(2), dynamic_scaler_state=state)
    with pytest.raises(TypeError, match=r"pair \(loss, aux\), got an array of shape \(\)"):
        dynamic_scale_value_and_grad(lambda w: jnp.sum(w), has_aux=True)(
            jnp.ones(2), dynamic_scaler_state=state)


# ------------------------------------------------------------------------ underflow


@pytest.mark.parametrize("param_dtype", [jnp.float16, jnp.float32])
def test_underflowing_f16_grads_are_rescued(param_dtype: Any) -> None:
    """Cotangents of 2**-28 flush to zero in f16; scaled by 2**15 they survive.

    Inputs are integers in [64, 128) over a batch of 256, so each true gradient
    2**-28 * t_j * sum_b x[b, i] is a normal f16 number and the only rounding is the
    f16 dot output. Grads are compared after multiplying back by 2**28, so the f16
    tolerance is measured relative to an ordinary-sized loss.
    """
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(64, 128, size=(256, 4)), jnp.float32)
    t = jnp.asarray([1.0, 2.0, 3.0], jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3)), param_dtype)

    def loss(w: jax.Array, x: jax.Array, compute: Any) -> jax.Array:
        y = x.astype(compute) @ w.astype(compute)
        return 2.0**-28 * jnp.sum(y.astype(jnp.float32) * t)

    plain = jax.jit(jax.grad(loss), static_argnums=2)(w, x, jnp.float16)
    assert plain.dtype == param_dtype
    assert not np.any(np.asarray(plain, np.float32)), "premise: unscaled f16 grads are zero"

    ref = jax.grad(loss)(w.astype(jnp.float32), x, jnp.float32)
    scaled = jax.jit(dynamic_scale_grad(loss), static_argnums=2)
    state, grads = scaled(w, x, jnp.float16, dynamic_scaler_state=DynamicScalerState())
    assert grads.dtype == param_dtype
    assert np.all(np.asarray(grads, np.float32) != 0)
    np.testing.assert_allclose(
        np.asarray(grads, np.float32) * 2.0**28,
        np.asarray(ref) * 2.0**28,
        **TOL[jnp.float16],
    )
    assert_state(state, scaler=2.0**15, count=1, total_resets=0)


# ------------------------------------------------------------------------- overflow


def _mse(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _regression_batch(poison: float | None = None) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    if poison is not None:
        x[3, 1] = poison
    return jnp.asarray(x), jnp.asarray(y)


def _params() -> dict[str, jax.Array]:
    return {"w": jnp.zeros((3, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}


def _leaves_equal(a: Any, b: Any) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


@pytest.mark.parametrize("poison", [np.inf, np.nan])
def test_nonfinite_step_skipped_with_select_tree(poison: float) -> None:
    opt = optax.sgd(0.1, momentum=0.9)
    grad_fn = dynamic_scale_value_and_grad(_mse)

    @jax.jit
    def step(params: Any, opt_state: Any, sstate: DynamicScalerState, batch: Any) -> Any:
        sstate, (loss, grads) = grad_fn(params, batch, dynamic_scaler_state=sstate)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = select_tree(
            all_finite(grads), (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, sstate, loss

    params = _params()
    opt_state = opt.init(params)
    sstate = DynamicScalerState()
    params, opt_state, sstate, _ = step(params, opt_state, sstate, _regression_batch())
    assert_state(sstate, scaler=2.0**15, count=1, total_resets=0)
    assert not _leaves_equal(params, _params()), "a finite step must move the params"

    new = step(params, opt_state, sstate, _regression_batch(poison))
    assert _leaves_equal(new[0], params)
    assert _leaves_equal(new[1], opt_state)
    assert_state(new[2], scaler=2.0**14, count=0, total_resets=1)


@pytest.mark.parametrize("poison", [np.inf, np.nan])
def test_nonfinite_step_skipped_with_apply_if_finite(poison: float) -> None:
    opt = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=10)
    grad_fn = dynamic_scale_value_and_grad(_mse)

    @jax.jit
    def step(params: Any, opt_state: Any, sstate: DynamicScalerState, batch: Any) -> Any:
        sstate, (_, grads) = grad_fn(params, batch, dynamic_scaler_state=sstate)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, sstate

    params = _params()
    opt_state = opt.init(params)
    params, opt_state, sstate = step(params, opt_state, DynamicScalerState(), _regression_batch())
    assert not _leaves_equal(params, _params())

    new_params, new_opt_state, new_sstate = step(
        params, opt_state, sstate, _regression_batch(poison)
    )
    assert _leaves_equal(new_params, params)
    assert int(new_opt_state.total_notfinite) == 1
    assert not bool(new_opt_state.last_finite)
    assert_state(new_sstate, scaler=2.0**14, count=0, total_resets=1)


def test_backoff_growth_and_floor() -> None:
    """Back off on bad steps (never below min_scaler), grow after `patience` good ones."""
    step = jax.jit(dynamic_scale_grad(_mse))
    params = _params()
    good, bad = _regression_batch(), _regression_batch(np.inf)
    state = DynamicScalerState(scaler=8.0, patience=3, min_scaler=2.0)

    expected = [
        (bad, 4.0, 0, 1),
        (bad, 2.0, 0, 2),
        (bad, 2.0, 0, 3),  # floored at min_scaler
        (good, 2.0, 1, 3),
        (good, 2.0, 2, 3),
        (good, 4.0, 0, 3),  # `patience` finite steps: doubled
        (good, 4.0, 1, 3),
        (bad, 2.0, 0, 4),  # a bad step resets the count
        (good, 2.0, 1, 4),
    ]
    for i, (batch, scaler, count, resets) in enumerate(expected):
        state, grads = step(params, batch, dynamic_scaler_state=state)
        assert bool(all_finite(grads)) == (batch is good), i
        assert_state(state, scaler=scaler, count=count, total_resets=resets)

    # A scaler set below min_scaler holds on a bad step: backing off raised it to the
    # floor (0.25 -> 2.0, a larger scale after an overflow).
    low, grads = step(params, bad, dynamic_scaler_state=DynamicScalerState(
        scaler=0.25, patience=3, min_scaler=2.0))
    assert not bool(all_finite(grads))
    assert_state(low, scaler=0.25, count=0, total_resets=1)

    # At or below 1 the scaler would never back off (it divides by adjust_factor); NumPy
    # numbers alike (np.float32(0.5) was taken, and the scaler moved the wrong way).
    for factor in (1.0, 0.5, np.float32(0.5), np.float16(1.0), np.int32(1), np.inf):
        with pytest.raises(ValueError, match="adjust_factor must be above 1 and finite"):
            DynamicScalerState(adjust_factor=factor)
    # A scaler or floor of inf (1e39 in f32) or 0 never backs off to a usable scale: every
    # later step was skipped. As numbers they are refused; as arrays the back-off leaves
    # inf for f32's largest value and stops at its smallest normal one, not at 0.
    for field in ("scaler", "min_scaler"):
        for value in (1e39, np.inf, 0.0, -1.0, np.float32(0)):
            with pytest.raises(ValueError, match=rf"^{field} must be positive and finite"):
                DynamicScalerState(**{field: value})
    # A checkpoint's arrays holding 0 or NaN (or a NaN or inf floor) are not refused: they
    # stayed at 0 or NaN, or held where every step overflowed (review h84).
    # An adjust_factor of NaN or at most 1 likewise (review h85).
    for scaler, floor, factor in ((jnp.inf, 1.0, 2.0), (1e-37, jnp.zeros(()), 2.0),
                                  (0.0, 1.0, 2.0), (np.nan, 1.0, 2.0), (3e38, np.nan, 2.0),
                                  (3e38, np.inf, 2.0), (8.0, 1.0, np.nan), (8.0, 1.0, 1.0)):
        state = DynamicScalerState(scaler=jnp.float32(scaler), min_scaler=jnp.float32(floor),
                                   adjust_factor=jnp.float32(factor))
        for _ in range(3):
            state, grads = step(params, bad, dynamic_scaler_state=state)
        assert 0 < float(state.scaler) < np.inf, (scaler, float(state.scaler))
        state, grads = step(params, good, dynamic_scaler_state=state)
        assert bool(all_finite(grads))

    # Growing 2**100 by 2**40 would overflow f32: the scaler is held, the count reset.
    huge = DynamicScalerState(scaler=2.0**100, adjust_factor=2.0**40, patience=1)
    huge, grads = step(params, good, dynamic_scaler_state=huge)
    assert bool(all_finite(grads))
    assert_state(huge, scaler=2.0**100, count=0, total_resets=0)


# ---------------------------------------------------------------------- redo_on_nan


def _f16_dot(w: jax.Array, x: jax.Array) -> jax.Array:
    """An f16 loss whose grad w.r.t. w is x, computed in f16 as x * scaler."""
    return jnp.sum(w * x)


def test_redo_on_nan_finds_a_scaler_that_fits() -> None:
    """x = 4: 4 * 2**15 and 4 * 2**14 overflow f16, 4 * 2**13 does not."""
    w = jnp.ones(3, jnp.float16)
    x = jnp.full(3, 4.0, jnp.float16)
    state = DynamicScalerState()

    s0, (v0, g0) = jax.jit(dynamic_scale_value_and_grad(_f16_dot))(w, x, dynamic_scaler_state=state)
    assert not bool(all_finite(g0))
    assert float(v0) == 12.0  # the value is the unscaled loss: finite even when grads are not
    assert_state(s0, scaler=2.0**14, total_resets=1, count=0)

    fn2 = jax.jit(dynamic_scale_value_and_grad(_f16_dot, redo_on_nan=2))
    s2, (v2, g2) = fn2(w, x, dynamic_scaler_state=state)
    assert g2.dtype == jnp.float16 and v2.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g2, np.float32), [4.0, 4.0, 4.0])
    assert float(v2) == 12.0
    assert_state(s2, scaler=2.0**13, total_resets=2, count=1)

    s1, (_, g1) = jax.jit(dynamic_scale_value_and_grad(_f16_dot, redo_on_nan=1))(
        w, x, dynamic_scaler_state=state
    )
    assert not bool(all_finite(g1))  # 1 redo is not enough: gives up after 2 tries
    assert_state(s1, scaler=2.0**13, total_resets=2, count=0)

    s_ok, (_, g_ok) = fn2(w, jnp.ones(3, jnp.float16), dynamic_scaler_state=state)
    np.testing.assert_array_equal(np.asarray(g_ok, np.float32), [1.0, 1.0, 1.0])
    assert_state(s_ok, scaler=2.0**15, total_resets=0, count=1)


_EXPLICIT_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from hlo_amp.runtime.scaler import DynamicScalerState, dynamic_scale_grad

def loss(w, x):
    return jnp.sum((x @ w) ** 2)

mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "d")))
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P()))
    want = jax.jit(jax.grad(loss))(w, x)
    grad = dynamic_scale_grad(loss, redo_on_nan=2)
    _, got = jax.jit(grad)(w, x, dynamic_scaler_state=DynamicScalerState())
print("RESULTS=" + json.dumps({"types": [str(jax.typeof(got)), str(jax.typeof(want))],
                               "error": float(np.abs(np.asarray(got - want)).max())}))
"""


def test_redo_on_nan_keeps_explicit_shardings() -> None:
    """On jax.make_mesh's Explicit axes a gradient's sharding is in its type; the redo
    loop's first carry had none ("carry input and carry output must have equal types")."""
    found = run_on_host_devices(_EXPLICIT_SCRIPT, devices=4)
    got, want = found["types"]
    assert got == want and "@d" in want
    assert found["error"] == 0.0


def test_redo_on_nan_gives_up_after_n_redos() -> None:
    """Always-NaN grads: redo_on_nan=N makes N + 1 tries, each one a back-off."""
    w = jnp.ones(3, jnp.float16)
    nan = jnp.full(3, jnp.nan, jnp.float16)
    fn = jax.jit(dynamic_scale_grad(_f16_dot, redo_on_nan=3))
    state, grads = fn(w, nan, dynamic_scaler_state=DynamicScalerState())
    assert not bool(all_finite(grads))
    assert_state(state, scaler=2.0**11, total_resets=4, count=0)

    # Once the scaler sits at min_scaler another try would compute the same thing: stop.
    fn5 = jax.jit(dynamic_scale_grad(_f16_dot, redo_on_nan=5))
    state, grads = fn5(w, nan, dynamic_scaler_state=DynamicScalerState(scaler=4.0))
    assert not bool(all_finite(grads))
    assert_state(state, scaler=1.0, total_resets=3, count=0)  # tries at 4, 2, 1


# ------------------------------------------------------------------ has_aux, argnums


def _loss_with_aux(w: jax.Array, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    pred = x @ w
    aux = {
        "n_positive": jnp.sum(pred > 0).astype(jnp.int32),
        "worst": jnp.max(jnp.abs(pred)) / 0.0,  # a legitimately infinite metric
        "step": jnp.array(7, jnp.int32),
    }
    return jnp.mean(pred**2), aux


def test_has_aux_with_integer_and_nonfinite_aux() -> None:
    x, _ = _regression_batch()
    w = jnp.asarray([1.0, -1.0, 2.0], jnp.float32)
    (ref_value, ref_aux), ref_grad = jax.value_and_grad(_loss_with_aux, has_aux=True)(w, x)

    vg = jax.jit(dynamic_scale_value_and_grad(_loss_with_aux, has_aux=True))
    state, ((value, aux), grad) = vg(w, x, dynamic_scaler_state=DynamicScalerState())
    np.testing.assert_allclose(value, ref_value, **TOL[jnp.float32])
    np.testing.assert_allclose(grad, ref_grad, **TOL[jnp.float32])
    assert aux["n_positive"].dtype == jnp.int32 and aux["step"].dtype == jnp.int32
    assert int(aux["n_positive"]) == int(ref_aux["n_positive"])
    assert int(aux["step"]) == 7
    assert np.isinf(aux["worst"])
    assert_state(state, count=1, total_resets=0)  # aux's inf does not count

    g = jax.jit(dynamic_scale_grad(_loss_with_aux, has_aux=True, redo_on_nan=2))
    state, (grad2, aux2) = g(w, x, dynamic_scaler_state=DynamicScalerState())
    np.testing.assert_allclose(grad2, ref_grad, **TOL[jnp.float32])
    assert int(aux2["n_positive"]) == int(ref_aux["n_positive"])
    assert_state(state, count=1, total_resets=0)


def test_a_python_number_primals_gradient_stays_weakly_typed() -> None:
    """As jax.grad's: a weak f32 gradient added to a bf16 array gives bf16 (a strong one
    gave f32)."""
    def loss(scale: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(scale * x)

    want = jax.grad(loss)(2.0, jnp.ones(3))
    _, got = dynamic_scale_grad(loss)(2.0, jnp.ones(3),
                                      dynamic_scaler_state=DynamicScalerState())
    assert jax.typeof(got) == jax.typeof(want) and jax.typeof(want).weak_type
    assert (got + jnp.bfloat16(1)).dtype == jnp.bfloat16
    _, strong = dynamic_scale_grad(loss)(jnp.float32(2.0), jnp.ones(3),
                                         dynamic_scaler_state=DynamicScalerState())
    assert not jax.typeof(strong).weak_type


def test_argnums_tuple_keeps_each_primal_dtype() -> None:
    def f(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
        h = jnp.tanh(a.astype(jnp.float32) * b) * c.astype(jnp.float32)
        return jnp.sum(h**2)

    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal(5), jnp.float16)
    b = jnp.asarray(rng.standard_normal(5), jnp.float32)
    c = jnp.asarray(rng.standard_normal(5), jnp.bfloat16)
    ref_value, (ref_a, ref_c) = jax.value_and_grad(f, argnums=(0, 2))(a, b, c)

    vg = jax.jit(dynamic_scale_value_and_grad(f, argnums=(0, 2)))
    state, (value, grads) = vg(a, b, c, dynamic_scaler_state=DynamicScalerState())
    assert isinstance(grads, tuple) and len(grads) == 2
    ga, gc = grads
    assert ga.dtype == jnp.float16 and gc.dtype == jnp.bfloat16
    np.testing.assert_allclose(value, ref_value, **TOL[jnp.float32])
    np.testing.assert_allclose(
        np.asarray(ga, np.float32), np.asarray(ref_a, np.float32), **TOL[jnp.float16]
    )
    np.testing.assert_allclose(
        np.asarray(gc, np.float32), np.asarray(ref_c, np.float32), **TOL[jnp.bfloat16]
    )
    assert_state(state, count=1)

    state, gb = dynamic_scale_grad(f, argnums=1)(a, b, c, dynamic_scaler_state=state)
    np.testing.assert_allclose(gb, jax.grad(f, argnums=1)(a, b, c), **TOL[jnp.float32])
    assert_state(state, count=2)


# --------------------------------------------------------------------- tree helpers


def test_all_finite_ignores_non_float_leaves() -> None:
    tree = {
        "ints": jnp.arange(3),
        "bools": jnp.array([True, False]),
        "float0": np.zeros((2,), jax.dtypes.float0),
        "key": jax.random.key(0),
        "f16": jnp.ones(2, jnp.float16),
        "py": 1.5,
    }
    assert bool(all_finite(tree))
    assert bool(all_finite({}))
    assert bool(all_finite({"n": jnp.arange(2)}))
    assert not bool(all_finite({**tree, "bad": jnp.array([1.0, jnp.nan], jnp.bfloat16)}))
    assert not bool(all_finite([jnp.ones(2), float("inf")]))
    assert not bool(jax.jit(all_finite)({"x": jnp.array([0.0, -jnp.inf])}))


def test_select_tree_picks_whole_trees() -> None:
    a = {"w": jnp.ones(2), "n": jnp.array(1, jnp.int32)}
    b = {"w": jnp.zeros(2), "n": jnp.array(2, jnp.int32)}
    assert _leaves_equal(select_tree(jnp.array(True), a, b), a)
    picked = jax.jit(select_tree)(jnp.array(False), a, b)
    assert _leaves_equal(picked, b)
    assert picked["n"].dtype == jnp.int32
    with pytest.raises(ValueError, match="scalar bool"):
        select_tree(jnp.array([True, False]), a, b)
    with pytest.raises(ValueError, match="scalar bool"):
        select_tree(jnp.array(1.0), a, b)
    # An Equinox model's non-array leaves (its activation functions), one object in both
    # trees, are kept (it was jax's "custom_jvp object is not a valid JAX array type");
    # two different non-arrays are named by their path.
    import equinox as eqx

    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    moved = jax.tree.map(lambda x: x + 1 if eqx.is_array(x) else x, model)
    kept = select_tree(jnp.array(False), model, moved)
    assert _leaves_equal(eqx.filter(kept, eqx.is_array), eqx.filter(moved, eqx.is_array))
    assert kept.activation is model.activation
    with pytest.raises(TypeError, match=r"at \['f'\] it got str and str"):
        select_tree(jnp.array(True), {"f": "relu"}, {"f": "gelu"})
    # One Python number on both sides is kept (eqx.nn.Dropout's p came back an array,
    # a traced argument of the next filter_jit step: TracerBoolConversionError there);
    # leaves of two dtypes are named by their path (jax's lax.select message named none).
    dropout = eqx.nn.Dropout(0.1)
    assert type(select_tree(jnp.array(True), dropout, eqx.nn.Dropout(0.1)).p) is float
    assert select_tree(jnp.array(False), {"lr": 3}, {"lr": 3}) == {"lr": 3}
    nan = select_tree(jnp.array(True), eqx.nn.Dropout(float("nan")), eqx.nn.Dropout(float("nan")))
    assert type(nan.p) is float
    # -0.0 and 0.0 compare equal but are two numbers: the one pred picks.
    assert not np.signbit(select_tree(jnp.array(False), {"a": -0.0}, {"a": 0.0})["a"])
    with pytest.raises(TypeError, match=r"at \['w'\] .*float16\[2\] and float32\[2\]"):
        select_tree(jnp.array(True), {"w": jnp.ones(2, jnp.float16)}, {"w": jnp.ones(2)})


# ------------------------------------------------------------------- train step f16


def _mlp_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (8, 32)) / np.sqrt(8),
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 32)) / np.sqrt(32),
        "b2": jnp.zeros(32),
        "w3": jax.random.normal(k3, (32, 1)) / np.sqrt(32),
        "b3": jnp.zeros(1),
    }


def _mlp_loss(params: dict[str, jax.Array], batch: Any, compute: Any = None) -> jax.Array:
    """MSE of a 3-layer MLP; `compute=jnp.float16` runs the layers in f16 (f32 params)."""
    x, y = batch
    p = params if compute is None else jax.tree_util.tree_map(lambda v: v.astype(compute), params)
    h = x if compute is None else x.astype(compute)
    h = jax.nn.gelu(h @ p["w1"] + p["b1"])
    h = jax.nn.gelu(h @ p["w2"] + p["b2"])
    pred = (h @ p["w3"] + p["b3"]).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def _regression_data() -> tuple[jax.Array, jax.Array]:
    kx, ka, kn = jax.random.split(jax.random.key(42), 3)
    x = jax.random.normal(kx, (128, 8))
    y = jnp.sin(x @ jax.random.normal(ka, (8, 1))) + 0.05 * jax.random.normal(kn, (128, 1))
    return x, y


STEPS = 50
TRAIN_RTOL = 0.01  # final f16 loss within 1% (relative) of the f32 run's (seen: 0.07%)


def _train_f32(params: Any, batch: Any) -> float:
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params: Any, opt_state: Any) -> Any:
        grads = jax.grad(_mlp_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    for _ in range(STEPS):
        params, opt_state = step(params, opt_state)
    return float(_mlp_loss(params, batch))


def _scaled_train_step(compute: Any) -> tuple[Callable[..., Any], optax.GradientTransformation]:
    """A train step with loss scaling; skips non-finite updates with apply_if_finite."""
    opt = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)
    grad_fn = dynamic_scale_value_and_grad(lambda p, b: _mlp_loss(p, b, compute), redo_on_nan=16)

    def step(params: Any, opt_state: Any, sstate: DynamicScalerState, batch: Any) -> Any:
        sstate, (loss, grads) = grad_fn(params, batch, dynamic_scaler_state=sstate)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, sstate, loss

    return step, opt


# Too large for f16 on purpose: the first step's cotangents overflow, and redo_on_nan
# must find a workable scaler inside that step, so that no update is skipped.
START_SCALER = 2.0**30


def _train_scaled(compiled_step: Callable[..., Any], opt: Any, params: Any, batch: Any) -> Any:
    opt_state = opt.init(params)
    sstate = DynamicScalerState(scaler=START_SCALER, patience=20)
    losses = []
    for _ in range(STEPS):
        params, opt_state, sstate, loss = compiled_step(params, opt_state, sstate, batch)
        losses.append(float(loss))
    return params, opt_state, sstate, losses


def _check_against_f32(
    params: Any, opt_state: Any, sstate: Any, losses: list[float], batch: Any
) -> None:
    init_loss = float(_mlp_loss(_mlp_params(jax.random.key(0)), batch))
    f32_loss = _train_f32(_mlp_params(jax.random.key(0)), batch)
    final = float(_mlp_loss(params, batch))  # evaluated in f32
    assert f32_loss < 0.5 * init_loss, "premise: the f32 run learns something"
    assert np.all(np.isfinite(losses))
    assert abs(final - f32_loss) <= TRAIN_RTOL * f32_loss, (final, f32_loss)
    assert_state(sstate)
    assert int(sstate.total_resets) >= 1, "premise: 2**30 overflows f16 cotangents"
    assert float(sstate.scaler) < START_SCALER
    assert int(opt_state.total_notfinite) == 0, "redo_on_nan should have avoided every skip"


def test_f16_train_step_matches_f32() -> None:
    """f32 master params, layers cast to f16 in the model, under jax.jit."""
    batch = _regression_data()
    step, opt = _scaled_train_step(jnp.float16)
    params = _mlp_params(jax.random.key(0))
    _check_against_f32(*_train_scaled(jax.jit(step), opt, params, batch), batch)


def test_f16_train_step_under_hlo_amp_compile() -> None:
    """The same f32 program, with the f16 rewrite done by hlo_amp.compile(step, "f16")."""
    from hlo_amp.runtime.compile import compile as amp_compile

    batch = _regression_data()
    step, opt = _scaled_train_step(None)
    compiled = amp_compile(step, "f16")
    params = _mlp_params(jax.random.key(0))
    text = compiled.lower(params, opt.init(params), DynamicScalerState(), batch).as_text()
    assert "xf16>" in text, "the f16 policy should put dots in f16"
    _check_against_f32(*_train_scaled(compiled, opt, params, batch), batch)


# --------------------------------------------------------------- filter= (jaxamp's)


def _eqx_model() -> Any:
    """An Equinox MLP holding non-array leaves: an activation function and an int."""
    import equinox as eqx

    class Mlp(eqx.Module):
        w1: jax.Array
        w2: jax.Array
        activation: Callable[[jax.Array], jax.Array]
        power: int

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.activation(x @ self.w1) @ self.w2

    k1, k2 = jax.random.split(jax.random.key(3))
    return Mlp(jax.random.normal(k1, (8, 16)) / np.sqrt(8),
               jax.random.normal(k2, (16, 1)) / 4, jax.nn.gelu, 2)


def _eqx_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.abs(model(x) - y) ** model.power)


def test_filter_true_matches_equinox_filter_value_and_grad() -> None:
    import equinox as eqx

    model = _eqx_model()
    x, y = _regression_data()
    ref_value, ref_grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y)

    vg = dynamic_scale_value_and_grad(_eqx_loss, filter=True)
    state, (value, grads) = vg(model, x, y, dynamic_scaler_state=DynamicScalerState())
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref_grads)
    assert grads.activation is None and grads.power is None  # equinox's None grads
    np.testing.assert_allclose(value, ref_value, **TOL[jnp.float32])
    for got, want in zip(jax.tree_util.tree_leaves(grads),
                         jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, **TOL[jnp.float32])
    assert_state(state, count=1, total_resets=0)

    state, g = dynamic_scale_grad(_eqx_loss, filter=True, redo_on_nan=2)(
        model, x, y, dynamic_scaler_state=state)
    np.testing.assert_allclose(g.w1, ref_grads.w1, **TOL[jnp.float32])
    assert_state(state, count=2, total_resets=0)


def test_filter_true_inside_hlo_amp_compile_and_filter_jit() -> None:
    import equinox as eqx

    from hlo_amp.runtime.compile import compile as amp_compile

    model = _eqx_model()
    x, y = _regression_data()
    vg = dynamic_scale_value_and_grad(_eqx_loss, filter=True, redo_on_nan=3)

    def step(model: Any, x: jax.Array, y: jax.Array, state: DynamicScalerState) -> Any:
        state, (loss, grads) = vg(model, x, y, dynamic_scaler_state=state)
        return state, loss, grads

    def reference(model: Any, x: jax.Array, y: jax.Array) -> Any:
        return eqx.filter_value_and_grad(_eqx_loss)(model, x, y)

    state = DynamicScalerState()
    assert "xf16>" in amp_compile(step, "f16").lower(model, x, y, state).as_text()
    # Each wrapper runs both steps, so the f16 one is compared with the same f16 program
    # differentiated by equinox without a scaler.
    for wrap, tol in ((lambda f: amp_compile(f, "f16"), TOL[jnp.float16]),
                      (eqx.filter_jit, TOL[jnp.float32])):
        new_state, loss, grads = wrap(step)(model, x, y, state)
        ref_loss, ref_grads = wrap(reference)(model, x, y)
        assert grads.activation is None and grads.power is None
        np.testing.assert_allclose(loss, ref_loss, **tol)
        np.testing.assert_allclose(grads.w1, ref_grads.w1, **tol)
        np.testing.assert_allclose(grads.w2, ref_grads.w2, **tol)
        assert_state(new_state, count=1, total_resets=0)


def test_the_scaled_functions_signature_takes_the_state_for_filter_jit() -> None:
    """eqx.filter_jit binds arguments by the signature, which read the loss function's
    alone through __wrapped__: "got an unexpected keyword argument
    'dynamic_scaler_state'" (jaxamp's wrapper has none)."""
    import equinox as eqx

    from hlo_amp import jaxamp_compat

    model = _eqx_model()
    x, y = _regression_data()
    state = DynamicScalerState()
    for make in (dynamic_scale_value_and_grad, jaxamp_compat.dynamic_scale_value_and_grad):
        vg = make(_eqx_loss, filter=True)
        assert "dynamic_scaler_state" in inspect.signature(vg).parameters
        _, (eager_loss, _) = vg(model, x, y, dynamic_scaler_state=state)
        _, (loss, _) = eqx.filter_jit(vg)(model, x, y, dynamic_scaler_state=state)
        np.testing.assert_allclose(loss, eager_loss, **TOL[jnp.float32])


def test_without_filter_the_error_is_jax_value_and_grads() -> None:
    model = _eqx_model()
    x, y = _regression_data()
    with pytest.raises(TypeError) as expected:
        jax.value_and_grad(_eqx_loss)(model, x, y)
    with pytest.raises(TypeError) as got:
        dynamic_scale_value_and_grad(_eqx_loss)(model, x, y,
                                                dynamic_scaler_state=DynamicScalerState())
    assert str(got.value) == str(expected.value)
    with pytest.raises(TypeError) as got_grad:
        dynamic_scale_grad(_eqx_loss)(model, x, y, dynamic_scaler_state=DynamicScalerState())
    assert str(got_grad.value) == str(expected.value)


def test_filter_true_refuses_argnums_as_equinox_does() -> None:
    import equinox as eqx

    with pytest.raises(ValueError) as expected:
        eqx.filter_value_and_grad(_eqx_loss, argnums=1)
    with pytest.raises(ValueError) as got:
        dynamic_scale_value_and_grad(_eqx_loss, filter=True, argnums=1)
    assert str(got.value) == str(expected.value)


def test_filter_true_without_equinox_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "equinox", None)  # import fails
    with pytest.raises(ImportError, match=r"equinox is not installed.*filter=False"):
        dynamic_scale_value_and_grad(_mlp_loss, filter=True)
    # The keyword's default needs no equinox.
    grad_fn = dynamic_scale_grad(_mlp_loss)
    _, grads = grad_fn(_mlp_params(jax.random.key(0)), _regression_data(),
                       dynamic_scaler_state=DynamicScalerState())
    assert set(grads) == {"w1", "b1", "w2", "b2", "w3", "b3"}


def test_a_vmap_axis_spec_built_as_the_docstring_says() -> None:
    state = DynamicScalerState()
    states = state._replace(scaler=jnp.array([1.0, 2.0, 4.0]))  # one scaler per member
    spec = jax.tree.unflatten(jax.tree.structure(state), [None, None, 0, None, None, None])
    grad = dynamic_scale_grad(lambda p: jnp.sum(p ** 2))
    new, grads = jax.vmap(lambda s, p: grad(p, dynamic_scaler_state=s),
                          in_axes=(spec, None))(states, jnp.ones(3))
    np.testing.assert_array_equal(new.scaler, [1.0, 2.0, 4.0])
    np.testing.assert_allclose(grads, np.full((3, 3), 2.0))
    # With redo_on_nan and members retrying different numbers of times, the settings
    # stay unbatched: an out_axes spec of the same form holds (they came back batched
    # when the loop selected the whole state per member: review h110).
    redo = dynamic_scale_grad(lambda w, x: jnp.sum(w * x), redo_on_nan=2)
    w = jnp.ones(3, jnp.float16)
    xs = jnp.stack([jnp.full(3, 0.5, jnp.float16), jnp.full(3, 4.0, jnp.float16)])
    out_spec = jax.tree.unflatten(jax.tree.structure(state), [None, None, 0, 0, 0, None])
    new, _ = jax.jit(jax.vmap(lambda x: redo(w, x, dynamic_scaler_state=state),
                              out_axes=(out_spec, 0)))(xs)
    assert new.patience.shape == () and int(new.patience) == 2000
    np.testing.assert_array_equal(new.total_resets, [0, 2])  # 4 * 2**15 overflows f16


def test_redo_on_nan_keeps_an_aux_that_is_no_array() -> None:
    """As jax.value_and_grad: a string or Python number in the aux comes back as it is
    (the redo loop's carry refused it: 'not a valid JAX type')."""
    def loss(w: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        return jnp.sum(w ** 2), {"tag": "done", "layers": 3, "norm": jnp.sum(w)}

    w = jnp.arange(3.0)
    (_, want), _ = jax.value_and_grad(loss, has_aux=True)(w)
    scaled = dynamic_scale_value_and_grad(loss, has_aux=True, redo_on_nan=2)
    _, ((_, got), grads) = scaled(w, dynamic_scaler_state=DynamicScalerState())
    assert got["tag"] == "done" and got["layers"] == 3
    np.testing.assert_allclose(got["norm"], want["norm"])
    np.testing.assert_allclose(grads, 2 * w)


def test_redo_on_nan_keeps_a_numpy_aux_as_it_is() -> None:
    """A NumPy array the loss returns in its aux went through the retry loop and came
    back a jax array of another dtype (float64 as float32, int64 as int32) where
    jax.value_and_grad and redo_on_nan=0 return it as it is (review h84)."""
    table = np.linspace(0.0, 1.0, 3)

    def loss(w: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        return jnp.sum(w ** 2), {"table": table, "ids": np.arange(3)}

    scaled = dynamic_scale_value_and_grad(loss, has_aux=True, redo_on_nan=2)
    _, ((_, got), _) = scaled(jnp.ones(3), dynamic_scaler_state=DynamicScalerState())
    assert got["table"] is table
    assert isinstance(got["ids"], np.ndarray) and got["ids"].dtype == np.arange(3).dtype
