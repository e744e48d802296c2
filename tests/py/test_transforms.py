"""Compiled functions under vmap, jvp, jacfwd, linearize, forward-over-reverse and grad.

Each result is compared with the same program under ``jax.jit`` in bf16's tolerance
(scaled: |a - e| <= 1e-5 + 1.6e-2 * max|e|), and shown to run rewritten: it differs
from f32, and the lowered program holds bf16 ops.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp

BF16_RTOL, ATOL = 1.6e-2, 1e-5


def f(w, x):
    return jnp.tanh(x @ w).sum()


def loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def _rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.fixture(scope="module")
def data():
    params = {"w1": _rand(0, (16, 32)) * 0.3, "b1": _rand(1, (32,)) * 0.1,
              "w2": _rand(2, (32, 4)) * 0.3}
    return params, _rand(3, (6, 5, 16)), _rand(4, (6, 5, 4))


def _assert_close_not_equal(actual, expected):
    """Within bf16's tolerance of the f32 result, and not equal to it: rewritten."""
    differs = False
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        scale = np.max(np.abs(e)) if e.size else 0.0
        assert np.max(np.abs(a - e), initial=0.0) <= ATOL + BF16_RTOL * scale
        differs |= not np.array_equal(a, e)
    assert differs, "the compiled function gave f32's exact result: it ran unrewritten"


def _lowered_has_bf16(fn, *args):
    return "bf16" in jax.jit(fn).lower(*args).as_text()


# ---- vmap --------------------------------------------------------------------------------


def test_vmap_in_axes_none_0_verbatim():
    w, xs = _rand(0, (8, 4)) * 0.3, _rand(1, (5, 3, 8))
    got = jax.vmap(hlo_amp.compile(f, "bf16"), in_axes=(None, 0))(w, xs)
    _assert_close_not_equal(got, jax.vmap(jax.jit(f), in_axes=(None, 0))(w, xs))
    assert _lowered_has_bf16(jax.vmap(hlo_amp.compile(f, "bf16"), in_axes=(None, 0)), w, xs)
    assert not _lowered_has_bf16(jax.vmap(jax.jit(f), in_axes=(None, 0)), w, xs)


def test_vmap_leaves_outputs_no_batched_argument_reaches_unbatched():
    # As under jax.jit: vmap(out_axes=None) accepts them, and they are not broadcast.
    def with_norm(w, x):
        return f(w, x), jnp.sum(w * w)

    w, xs = _rand(0, (8, 4)) * 0.3, _rand(1, (5, 3, 8))
    got, norm = jax.vmap(hlo_amp.compile(with_norm, "bf16"), in_axes=(None, 0),
                         out_axes=(0, None))(w, xs)
    want, want_norm = jax.vmap(jax.jit(with_norm), in_axes=(None, 0), out_axes=(0, None))(w, xs)
    assert norm.shape == want_norm.shape == ()
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    _assert_close_not_equal(got, want)
    # batched where a batched argument reaches it
    _, norms = jax.vmap(hlo_amp.compile(with_norm, "bf16"), in_axes=(0, None))(
        jnp.stack([w, 2 * w]), xs[0])
    np.testing.assert_allclose(norms, [jnp.sum(w * w), jnp.sum(4 * w * w)], rtol=1e-6)


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (None, 1), (0, None)])
def test_vmap_any_in_axes(in_axes):
    w, x = _rand(0, (8, 4)) * 0.3, _rand(1, (3, 8))
    batch = 5
    w = jnp.stack([w * (1 + 0.1 * i) for i in range(batch)], in_axes[0]) \
        if in_axes[0] is not None else w
    x = jnp.stack([x + 0.1 * i for i in range(batch)], in_axes[1]) \
        if in_axes[1] is not None else x
    got = jax.vmap(hlo_amp.compile(f, "bf16"), in_axes=in_axes)(w, x)
    _assert_close_not_equal(got, jax.vmap(f, in_axes=in_axes)(w, x))


def test_nested_vmap_and_kwargs_and_jit(data):
    params, x, y = data
    amp = hlo_amp.compile(loss, "bf16")
    per_pair = jax.jit(jax.vmap(jax.vmap(lambda p, a, b: amp(p, x=a, y=b),
                                         in_axes=(None, 0, 0)), in_axes=(None, 0, 0)))
    ref = jax.vmap(jax.vmap(loss, in_axes=(None, 0, 0)), in_axes=(None, 0, 0))
    _assert_close_not_equal(per_pair(params, x[:, :, None], y[:, :, None]),
                            ref(params, x[:, :, None], y[:, :, None]))


def test_per_example_gradients(data):
    params, x, y = data
    per_example = jax.vmap(jax.grad(hlo_amp.compile(loss, "bf16")), in_axes=(None, 0, 0))
    expected = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x, y)
    _assert_close_not_equal(per_example(params, x, y), expected)
    _assert_close_not_equal(jax.jit(per_example)(params, x, y), expected)


def test_grad_of_vmapped_compiled_loss(data):
    params, x, y = data
    amp = hlo_amp.compile(loss, "bf16")

    def batch_loss(fn, p):
        return jax.vmap(fn, in_axes=(None, 0, 0))(p, x, y).mean()

    got = jax.jit(jax.grad(lambda p: batch_loss(amp, p)))(params)
    _assert_close_not_equal(got, jax.grad(lambda p: batch_loss(loss, p))(params))


def test_vmap_with_named_axis_collective():
    xs = _rand(1, (5, 3, 8))
    w = _rand(0, (8, 4)) * 0.3

    def centred(x):
        y = x @ w
        return y - jax.lax.pmean(y, "batch")

    got = jax.vmap(hlo_amp.compile(centred, "bf16"), axis_name="batch")(xs)
    _assert_close_not_equal(got, jax.vmap(centred, axis_name="batch")(xs))


def test_vmap_of_a_collective_over_its_axis_may_return_it_unbatched():
    """A psum, pmean or all_gather over the vmap's axis is the same for every example:
    vmap(out_axes=None) takes it, as under jax.jit (it raised "vmap has mapped output
    (axis_name=b) but out_axes is None")."""
    xs = _rand(1, (2, 4, 16))
    w = _rand(0, (16, 8)) * 0.3

    def fn(x, w):
        y = jnp.tanh(x @ w)
        return jax.lax.pmean(jnp.sum(y), "b"), jax.lax.all_gather(y.sum(0), "b"), y

    vmap = functools.partial(jax.vmap, in_axes=(0, None), axis_name="b",
                             out_axes=(None, None, 0))
    got, want = vmap(hlo_amp.compile(fn, "bf16"))(xs, w), vmap(jax.jit(fn))(xs, w)
    assert [g.shape for g in got] == [g.shape for g in want]

    # A scatter of an unbatched value differs at each index: it was returned unbatched
    # ("vmap has mapped output ... but out_axes is None").
    def scattered(x, w):
        return jax.lax.psum_scatter(jnp.tanh(w.T @ w)[:2], "b", tiled=True), x @ w

    shapes = [[o.shape for o in jax.vmap(g, in_axes=(0, None), axis_name="b")(xs, w)]
              for g in (hlo_amp.compile(scattered, "bf16"), jax.jit(scattered))]
    assert shapes[0] == shapes[1]
    for g, v in zip(got, want, strict=True):  # a sum of 64 bf16 tanh: a few % off
        np.testing.assert_allclose(g, v, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("batched_x", [True, False], ids=["x_batched", "nothing_batched"])
def test_vmap_with_an_axis_index_output(batched_x):
    """An output made from ``lax.axis_index`` of the vmap's axis (per-example dropout
    keys: ``fold_in(key, axis_index)``) varies along the axis though no batched argument
    reaches it: vmap raised "mapped output (axis_name=b) but out_axes is None", or, with
    nothing batched, "unbound axis name"."""
    w = _rand(0, (8, 4))
    xs = _rand(1, (5, 3, 8))

    def fn(w, x):
        key = jax.random.fold_in(jax.random.key(0), jax.lax.axis_index("b"))
        keep = jax.random.bernoulli(key, 0.5, (3, 4))
        return jnp.where(keep, x @ w, 0.0), w.sum() * jax.lax.axis_index("b")

    in_axes = (None, 0) if batched_x else (None, None)
    x = xs if batched_x else xs[0]
    vmap = functools.partial(jax.vmap, in_axes=in_axes, axis_name="b", axis_size=5)
    got = vmap(hlo_amp.compile(fn, "bf16"))(w, x)
    want = vmap(fn)(w, x)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0] == 0, want[0] == 0)  # the same per-example masks
    np.testing.assert_allclose(got[0], want[0], rtol=2e-2, atol=2e-2)


# ---- forward mode ------------------------------------------------------------------------


def test_jvp_verbatim(data):
    params, x, y = data
    primals = (params, x[0], y[0])
    tangents = jax.tree_util.tree_map(jnp.ones_like, primals)
    got = jax.jvp(hlo_amp.compile(loss, "bf16"), primals, tangents)
    _assert_close_not_equal(got, jax.jvp(jax.jit(loss), primals, tangents))
    assert _lowered_has_bf16(
        lambda p, t: jax.jvp(hlo_amp.compile(loss, "bf16"), p, t), primals, tangents)


def test_jacfwd_and_linearize(data):
    params, x, y = data
    amp = hlo_amp.compile(loss, "bf16")
    _assert_close_not_equal(jax.jacfwd(amp)(params, x[0], y[0]),
                            jax.jacfwd(loss)(params, x[0], y[0]))
    value, linear = jax.linearize(lambda p: amp(p, x[0], y[0]), params)
    ref_value, ref_linear = jax.linearize(lambda p: loss(p, x[0], y[0]), params)
    direction = jax.tree_util.tree_map(jnp.ones_like, params)
    _assert_close_not_equal((value, linear(direction)), (ref_value, ref_linear(direction)))


def test_jacfwd_in_one_argument_of_several():
    """The arguments without a tangent were given zero arrays as tangents: the program
    computed x @ 0, which XLA:CPU miscompiled under jacfwd's vmap of 8 or more tangents
    (values of 1e10 or NaN against a largest true value of 3). They stay symbolic zeros."""
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w = jax.random.normal(jax.random.key(0), (32, 64)) / 6
    x = jax.random.normal(jax.random.key(2), (8, 32))
    want = jax.jacfwd(f, argnums=1)(w, x)
    got = jax.jacfwd(hlo_amp.compile(f, "f32"), argnums=1)(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_forward_over_reverse_hvp(data):
    params, x, y = data
    direction = jax.tree_util.tree_map(jnp.ones_like, params)

    def hvp(fn):
        return jax.jvp(jax.grad(lambda p: fn(p, x[0], y[0])), (params,), (direction,))

    _assert_close_not_equal(hvp(hlo_amp.compile(loss, "bf16")), hvp(loss))


def test_jvp_with_integer_input_and_output():
    w = _rand(0, (8, 4)) * 0.3

    def fn(x, index):
        y = x @ w
        return y[index], jnp.argmax(y)

    x = _rand(1, (3, 8))
    primal_out, tangent_out = jax.jvp(hlo_amp.compile(fn, "bf16"), (x, 1),
                                      (jnp.ones_like(x), np.zeros((), jax.dtypes.float0)))
    ref_out, ref_tangent = jax.jvp(fn, (x, 1), (jnp.ones_like(x),
                                                 np.zeros((), jax.dtypes.float0)))
    _assert_close_not_equal(primal_out[0], ref_out[0])
    assert primal_out[1] == ref_out[1]
    _assert_close_not_equal(tangent_out[0], ref_tangent[0])
    assert tangent_out[1].dtype == jax.dtypes.float0


# ---- other composition -------------------------------------------------------------------


def test_grad_through_scan_and_remat(data):
    params, x, y = data
    amp = hlo_amp.compile(loss, "bf16")

    def scanned(fn, p):
        total, _ = jax.lax.scan(lambda c, xy: (c + fn(p, *xy), None), 0.0, (x, y))
        return total

    _assert_close_not_equal(jax.grad(lambda p: scanned(amp, p))(params),
                            jax.grad(lambda p: scanned(loss, p))(params))
    _assert_close_not_equal(jax.grad(jax.checkpoint(amp))(params, x[0], y[0]),
                            jax.grad(loss)(params, x[0], y[0]))



def _fp8_recipe(text: str) -> dict[str, int]:
    """How a module's dots ran: bf16 and fp8 dots, and tensors quantised to e5m2."""
    return {"bf16 dots": len(re.findall(r"dot_general.*\(tensor<[\dx]+xbf16>, tensor<", text)),
            "fp8 dots": len(re.findall(r"dot_general.*\(tensor<[\dx]+xf8", text)),
            "e5m2": len(re.findall(r"-> tensor<[\dx]+xf8E5M2>", text))}


def test_grad_of_a_compiled_function_follows_the_fp8_recipe():
    """jax.grad of a compiled function runs a backward program split from its forward
    (runtime/amp_call.py); it is rewritten with its cotangents as the incoming gradient
    (e5m2) and the forward's ends' backward dots in bf16, as compile(jax.grad(f)) is.
    Alone it quantised every gradient to e4m3fn and ran the ends' backward dots in fp8
    (0 e5m2, 2 bf16 and 9 fp8 dots against 2, 5 and 6)."""
    def mlp(p, x):
        h = jnp.tanh(x @ p["stem"])
        h = jnp.tanh(h @ p["mid1"])
        h = jnp.tanh(h @ p["mid2"])
        return jnp.sum((h @ p["head"]) ** 2)

    keys = jax.random.split(jax.random.key(0), 5)
    params = {name: jax.random.normal(k, (64, 64)) / 8
              for name, k in zip(("stem", "mid1", "mid2", "head"), keys)}
    x = jax.random.normal(keys[4], (32, 64))
    outside = jax.jit(jax.grad(hlo_amp.compile(mlp, "fp8"))).lower(params, x).as_text()
    inside = hlo_amp.compile(jax.grad(mlp), "fp8").lower(params, x).as_text()
    # The preset: stem and head (the ends) and their backward dots in bf16: 2 forward,
    # head's dW and dx, stem's dW (x takes no gradient); the middle layers' forward,
    # dW and dx in fp8 (6); the gradient reaching each middle layer in e5m2 (2).
    assert _fp8_recipe(outside) == _fp8_recipe(inside) == {
        "bf16 dots": 5, "fp8 dots": 6, "e5m2": 2}


def test_grad_of_a_compiled_function_with_layers_in_a_loop_keeps_their_gradients_fp8():
    """Layers written in a Python loop share one stack, which the backward program marked
    the stem's by stack alone: every hidden layer's gradient dots ran bf16 (0 e5m2 against
    compile(jax.grad(f))'s 4). The shared stack is not handed on now: the hidden layers'
    backward dots are fp8 as inside; only the stem's dW, which no stack can tell from
    theirs, is fp8 too (inside it is bf16)."""
    def mlp(ws, x):
        h = x
        for w in ws[:-1]:
            h = jnp.tanh(h @ w)
        return jnp.sum((h @ ws[-1]) ** 2)

    keys = jax.random.split(jax.random.key(0), 5)
    ws = [jax.random.normal(k, (64, 64)) / 8 for k in keys[:4]]
    x = jax.random.normal(keys[4], (32, 64))
    outside = _fp8_recipe(jax.jit(jax.grad(hlo_amp.compile(mlp, "fp8"))).lower(ws, x).as_text())
    inside = _fp8_recipe(hlo_amp.compile(jax.grad(mlp), "fp8").lower(ws, x).as_text())
    assert inside["e5m2"] > 0 and outside["e5m2"] == inside["e5m2"] + 1  # the stem's too
    assert outside["fp8 dots"] == inside["fp8 dots"] + 1
    assert outside["bf16 dots"] == inside["bf16 dots"] - 1


def test_grad_of_a_compiled_function_with_checkpointed_loop_layers_follows_the_recipe():
    """Hidden layers in a Python loop, each under jax.checkpoint, between a plain stem and
    head: the backward program took its first and last recomputed ops (hidden layers) for
    the ends, 16-bit (11 bf16 / 6 fp8 dots against compile(jax.grad)'s 5 / 12)."""
    def mlp(ws, x):
        h = jnp.tanh(x @ ws[0])
        for w in ws[1:-1]:
            h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)
        return jnp.sum((h @ ws[-1]) ** 2)

    keys = jax.random.split(jax.random.key(0), 6)
    ws = [jax.random.normal(k, (32, 32)) / 6 for k in keys[:5]]
    x = jax.random.normal(keys[5], (16, 32))
    outside = jax.jit(jax.grad(hlo_amp.compile(mlp, "fp8"))).lower(ws, x).as_text()
    inside = hlo_amp.compile(jax.grad(mlp), "fp8").lower(ws, x).as_text()
    assert _fp8_recipe(outside) == _fp8_recipe(inside)


def test_grad_of_a_compiled_function_with_heads_on_one_line_keeps_their_backward_16_bit():
    """Two heads of one activation written on one line share a stack, as loop layers do,
    but they read one value: the head's stack is still handed to the backward program
    (not handing it on ran the heads' backward dots fp8: 3 bf16 dots against 7)."""
    def loss(ws, x):
        h = jnp.tanh(x @ ws[0])
        h = jnp.tanh(h @ ws[1])
        h = jnp.tanh(h @ ws[2])
        return sum(jnp.sum((h @ w) ** 2) for w in ws[3:5])

    keys = jax.random.split(jax.random.key(0), 6)
    ws = [jax.random.normal(k, (64, 64)) / 8 for k in keys[:5]]
    x = jax.random.normal(keys[5], (32, 64))
    outside = _fp8_recipe(jax.jit(jax.grad(hlo_amp.compile(loss, "fp8"))).lower(ws, x).as_text())
    inside = _fp8_recipe(hlo_amp.compile(jax.grad(loss), "fp8").lower(ws, x).as_text())
    assert outside["bf16 dots"] >= inside["bf16 dots"], (outside, inside)

def test_unsupported_transform_error_is_one_clear_line():
    w = _rand(0, (8, 4))

    def project(x):
        return x @ w

    with pytest.raises(TypeError) as info:
        jax.linear_transpose(hlo_amp.compile(project, "bf16"), _rand(1, (3, 8)))(
            jnp.ones((3, 4)))
    message = str(info.value).strip()
    assert "\n" not in message
    assert "linear_transpose" in message and "project" in message
    assert "compile the outer function" in message
    # project is linear: the message said "project is not linear"; it names the way
    # that works, the map jax.linearize returns
    assert "not linear" not in message and "jax.linearize" in message
    _, linear = jax.linearize(hlo_amp.compile(project, "bf16"), _rand(1, (3, 8)))
    (transposed,) = jax.linear_transpose(linear, _rand(1, (3, 8)))(jnp.ones((3, 4)))
    assert transposed.shape == (3, 8)


def test_host_callback_under_vmap_warns_and_runs_unchanged():
    w = _rand(0, (8, 4))
    seen = []

    def noisy(x):
        jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
        return x @ w

    xs = _rand(1, (2, 3, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.vmap(hlo_amp.compile(noisy, "bf16"))(xs)
    assert any("cannot rewrite noisy under an outer transformation" in str(w.message)
               for w in caught)
    np.testing.assert_array_equal(got, jax.vmap(noisy)(xs))
    assert len(seen) == 4  # two from the hlo_amp call, two from the reference


def test_cache_hits_do_not_relower(data):
    params, x, y = data
    amp = hlo_amp.compile(loss, "bf16")
    amp(params, x[0], y[0])
    per_example = jax.vmap(amp, in_axes=(None, 0, 0))
    per_example(params, x, y)
    lowerings = amp.lowerings
    for _ in range(3):
        amp(params, x[0], y[0])
        per_example(params, x, y)
    assert amp.lowerings == lowerings


def test_python_scalars_stay_weakly_typed_like_jax_jit():
    def scale(x, lr):
        return x @ x.T * lr

    x = _rand(0, (3, 4)).astype(jnp.bfloat16)
    amp = hlo_amp.compile(scale, "bf16")
    assert amp(x, 0.1).dtype == jax.jit(scale)(x, 0.1).dtype == jnp.bfloat16
    batched = jax.vmap(amp, in_axes=(0, None))(jnp.stack([x, x]), 0.1)
    assert batched.dtype == jnp.bfloat16
    assert jax.grad(lambda v: amp(v, 0.1).astype(jnp.float32).sum())(x).dtype == jnp.bfloat16


def test_cache_hits_are_served_by_jax_jit_without_hlo_amp_python(monkeypatch):
    """A hit runs no hlo_amp code: jax.jit's own dispatch finds the executable."""
    calls = []
    original = hlo_amp.AmpFunction._traced_call

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hlo_amp.AmpFunction, "_traced_call", counting)
    w, x = _rand(0, (8, 4)), _rand(1, (3, 8))
    amp = hlo_amp.compile(f, "bf16")
    first = amp(w, x)
    assert len(calls) == 1
    for _ in range(5):
        assert np.array_equal(amp(w, x), first)
    assert len(calls) == 1 and amp.cache_size() == 1
    amp(w, _rand(2, (5, 8)))  # a new signature traces again
    assert len(calls) == 2 and amp.cache_size() == 2


def test_checkify_checks_the_rewritten_program():
    """checkify.checkify of a compiled function finds the errors inside it, as it does
    inside a jax.jit, and its outputs are the compiled function's. It saw one opaque
    call: a NaN made inside was no error, and a checkify.check inside raised jax's
    "Cannot abstractly evaluate a checkify.check which was not functionalized"."""
    from jax.experimental import checkify

    w = _rand(0, (8, 8))

    def logs(x):
        return jnp.log(x @ w)

    def checked(x):
        y = x @ w
        checkify.check(jnp.all(y > -100.0), "small {m}", m=jnp.min(y))
        return y * 0.5

    negative, positive = -jnp.abs(_rand(1, (4, 8))) - 1.0, jnp.abs(_rand(2, (4, 8)))
    w = jnp.abs(w)
    for fn in (logs, checked):
        amp = hlo_amp.compile(fn, "bf16")
        for x in (negative * 100.0, positive):
            want_error, want = checkify.checkify(jax.jit(fn), errors=checkify.all_checks)(x)
            error, out = checkify.checkify(amp, errors=checkify.all_checks)(x)
            # bf16's outputs: near f32's (where finite), not f32's bits
            if bool(jnp.isfinite(want).any()):
                assert not bool(jnp.array_equal(out, want, equal_nan=True))
            np.testing.assert_allclose(jnp.nan_to_num(out), jnp.nan_to_num(want), rtol=2e-2,
                                       atol=2e-2)
            # the same error, its payload from the bf16 dot's value
            assert (re.sub(r"-?[\d.]+", "N", error.get() or "")
                    == re.sub(r"-?[\d.]+", "N", want_error.get() or "")), error.get()
            if fn is logs:  # (a checkify.check cannot run outside checkify)
                assert bool(jnp.array_equal(out, amp(x), equal_nan=True))
        # under jax.jit, called twice: one compile of the checked program
        jitted = jax.jit(checkify.checkify(amp, errors=checkify.all_checks))
        assert jitted(negative * 100.0)[0].get() is not None
        assert jitted(positive)[0].get() is None
    assert "nan generated by primitive: log" in checkify.checkify(
        hlo_amp.compile(logs, "bf16"), errors=checkify.all_checks)(negative)[0].get()

    # An error checkify found before the call comes first, as checkify keeps the first;
    # each eager call reuses one export (the incoming error is no part of its key).
    amp = hlo_amp.compile(logs, "bf16")

    def divided(x, d):
        return amp(x / d)

    checked = checkify.checkify(divided, errors=checkify.all_checks)
    for _ in range(3):
        assert "division by zero" in checked(negative, 0)[0].get()
        assert "nan generated by primitive: log" in checked(negative, 1)[0].get()
    assert checked(positive, 1)[0].get() is None
    assert amp._programs.lowerings == 2 and len(amp._programs.checked) == 1
