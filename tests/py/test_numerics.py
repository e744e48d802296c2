"""Numerics of hlo_amp.compile against f32: 'f32' is bit-identical, 'bf16'/'f16' close.

Inputs are well conditioned (weights ~ 1/sqrt(fan_in)); tolerances are torch.testing's:
bf16 rtol 1.6e-2 (atol 1e-2 of the output's scale), f16 rtol 1e-3, atol 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlo_amp


def _rand(key: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _close_bf16(got, want) -> None:
    scale = float(np.max(np.abs(np.asarray(want, np.float32)))) or 1.0
    np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1e-2 * scale)


def _tree_close_bf16(got, want) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        _close_bf16(g, w)


# ---- models: (fn(params, x) -> array, params, x) ------------------------------------------


def _mlp():
    params = {"w1": _rand(1, (16, 32), 16 ** -0.5), "b1": jnp.zeros(32),
              "w2": _rand(2, (32, 8), 32 ** -0.5)}

    def fn(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    return fn, params, _rand(0, (4, 16))


def _cnn():
    params = {"k1": _rand(1, (3, 3, 3, 8), 27 ** -0.5),  # HWIO
              "k2": _rand(2, (3, 3, 8, 4), 72 ** -0.5)}

    def fn(p, x):
        dims = ("NHWC", "HWIO", "NHWC")
        h = lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME", dimension_numbers=dims)
        h = jnp.tanh(h)  # smooth: a relu mask flipped by rounding would dominate the grad
        return lax.conv_general_dilated(h, p["k2"], (2, 2), "SAME", dimension_numbers=dims)

    return fn, params, _rand(0, (2, 8, 8, 3))


def _attention():
    d, heads, hd = 16, 2, 8
    params = {name: _rand(i, (d, heads, hd), d ** -0.5)
              for i, name in enumerate(("wq", "wk", "wv"), 1)}
    params["wo"] = _rand(4, (heads, hd, d), d ** -0.5)

    def fn(p, x):
        q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
        k = jnp.einsum("btd,dhk->bthk", x, p["wk"])
        v = jnp.einsum("btd,dhk->bthk", x, p["wv"])
        logits = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(hd)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
        return jnp.einsum("bqhk,hkd->bqd", out, p["wo"])

    return fn, params, _rand(0, (2, 5, d))


def _scan_rnn():
    params = {"wx": _rand(1, (8, 16), 8 ** -0.5), "wh": _rand(2, (16, 16), 16 ** -0.5)}

    def fn(p, xs):
        def cell(h, x):
            h = jnp.tanh(x @ p["wx"] + h @ p["wh"])
            return h, h

        _, hs = lax.scan(cell, jnp.zeros((xs.shape[1], 16)), xs)
        return hs

    return fn, params, _rand(0, (6, 3, 8))  # time, batch, features


def _cond():
    params = {"a": _rand(1, (8, 8), 8 ** -0.5), "b": _rand(2, (8, 8), 8 ** -0.5)}

    def fn(p, x):
        return lax.cond(jnp.sum(x) > 0, lambda x: x @ p["a"], lambda x: jnp.sin(x @ p["b"]), x)

    return fn, params, _rand(0, (4, 8))


def _inner_jit():
    params = {"w1": _rand(1, (8, 8), 8 ** -0.5), "w2": _rand(2, (8, 4), 8 ** -0.5)}

    @jax.jit
    def layer(x, w):
        return jnp.tanh(x @ w)

    def fn(p, x):
        return layer(layer(x, p["w1"]), p["w2"])

    return fn, params, _rand(0, (4, 8))


def _remat():
    params = {"w1": _rand(1, (8, 16), 8 ** -0.5), "w2": _rand(2, (16, 8), 16 ** -0.5)}

    @jax.checkpoint
    def block(p, x):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"]

    def fn(p, x):
        return block(p, block(p, x))

    return fn, params, _rand(0, (4, 8))


MODELS: dict[str, Callable] = {
    "mlp": _mlp, "cnn": _cnn, "attention": _attention, "scan_rnn": _scan_rnn,
    "cond": _cond, "inner_jit": _inner_jit, "remat": _remat,
}
# matmul ops each model must show in its forward report (at least)
MIN_OPS = {"mlp": 2, "cnn": 2, "attention": 6, "scan_rnn": 2, "cond": 2, "inner_jit": 1,
           "remat": 2}


def _loss(fn: Callable) -> Callable:
    return lambda p, x: jnp.sum(jnp.sin(fn(p, x)))


@pytest.mark.parametrize("name", list(MODELS))
def test_f32_policy_is_bit_identical(name):
    fn, params, x = MODELS[name]()
    got = hlo_amp.compile(fn, "f32")(params, x)
    np.testing.assert_array_equal(got, jax.jit(fn)(params, x))
    if name not in ("mlp", "attention", "scan_rnn", "remat"):
        return  # the grad check is the slow half; these four cover the transforms
    grads = hlo_amp.compile(jax.grad(_loss(fn)), "f32")(params, x)
    want = jax.jit(jax.grad(_loss(fn)))(params, x)
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_forward_close_and_all_converted(name):
    fn, params, x = MODELS[name]()
    amp = hlo_amp.compile(fn, "bf16")
    report = amp.lower(params, x).report()
    assert len(report.decisions) >= MIN_OPS[name], str(report)
    assert all(d.low_precision and d.changed for d in report.decisions), str(report)
    if name == "cnn":
        assert {d.op_kind for d in report.decisions} == {"convolution"}
    got = amp(params, x)
    want = jax.jit(fn)(params, x)
    assert got.dtype == want.dtype == jnp.float32
    _close_bf16(got, want)
    assert not np.array_equal(got, want)  # low precision really ran


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_grad_close_and_all_converted(name):
    fn, params, x = MODELS[name]()
    loss = _loss(fn)
    report = hlo_amp.compile(jax.grad(loss), "bf16").lower(params, x).report()
    assert {d.direction for d in report.decisions} == (
        {"forward", "backward", "recomputed"} if name == "remat" else {"forward", "backward"}
    ), str(report)
    assert all(d.low_precision for d in report.decisions), str(report)
    want = jax.jit(jax.grad(loss))(params, x)
    # the grad as one rewritten program; for mlp and attention also jax.grad of a
    # compiled loss (the custom_vjp route)
    _tree_close_bf16(hlo_amp.compile(jax.grad(loss), "bf16")(params, x), want)
    if name in ("mlp", "attention"):
        _tree_close_bf16(jax.grad(hlo_amp.compile(loss, "bf16"))(params, x), want)


def test_attention_grad_report_all_converted():
    fn, params, x = _attention()
    report = hlo_amp.compile(jax.grad(_loss(fn)), "bf16").lower(params, x).report()
    backward = [d for d in report.decisions if d.direction == "backward"]
    assert len(backward) >= 6, str(report)
    assert all(d.low_precision and d.changed for d in report.decisions), str(report)
    assert any("hk,hkd" in d.location or "bshk" in d.location for d in report.decisions)


def test_cond_both_branches_converted():
    fn, params, x = _cond()
    report = hlo_amp.compile(fn, "bf16").lower(params, x).report()
    assert len(report.decisions) == 2 and all(d.low_precision for d in report.decisions)
    amp = hlo_amp.compile(fn, "bf16")
    for sign in (1.0, -1.0):
        xs = sign * jnp.abs(x)
        _close_bf16(amp(params, xs), fn(params, xs))


def test_f16_single_matmul_exact_products():
    # f16-representable operands: products are exact in f32, accumulation is f32
    x = _rand(0, (4, 32)).astype(jnp.float16).astype(jnp.float32)
    w = _rand(1, (32, 8), 32 ** -0.5).astype(jnp.float16).astype(jnp.float32)
    amp = hlo_amp.compile(lambda x, w: x @ w, "f16")
    report = amp.lower(x, w).report()
    assert report.decisions[0].operands_after == ("f16", "f16")
    got = amp(x, w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, x @ w, rtol=1e-3, atol=1e-5)


def test_f16_mlp_close():
    fn, params, x = _mlp()
    got = hlo_amp.compile(fn, "f16")(params, x)
    want = jax.jit(fn)(params, x)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * scale)


def test_bf16_weight_grad_of_dense_on_3d_input_runs():
    # Regression: the weight-gradient dot of a Dense layer on a [batch, tokens, features]
    # input contracts two dims ([0,1]x[0,1]); XLA:CPU once failed to run it in bf16.
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 128)) / 8
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 17, 64))

    def loss(w, x):
        return jnp.tanh(x @ w).sum()

    got = hlo_amp.compile(jax.grad(loss), "bf16")(w, x)
    want = jax.jit(jax.grad(loss))(w, x)
    _close_bf16(got, want)
