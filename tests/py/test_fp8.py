"""fp8 (passes/fp8.py): numerics against f64 and against a NumPy model of the recipe, the
amax guard, the emitted form XLA:GPU turns into an fp8 GEMM, and training on digits.

Everything runs on CPU: XLA:CPU has no fp8 dot, so there the fp8 operands are dequantised
to f32 (the values a Hopper GEMM multiplies) and the dot runs in f32.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hlo_amp
from hlo_amp.passes import default_pipeline, pass_names
from hlo_amp.policy import Policy
from hlo_amp.runtime.scaler import all_finite

# Every dot in fp8: a single dot is the program's first and last matrix op.
FP8 = "fp8,first_matrix_op=none,last_matrix_op=none"
# The same in the accurate mode (f32 activations): the NumPy models below quantise the
# f32 values themselves; the preset's fast mode quantises their bf16 rounding.
FP8_ACCURATE = "fp8,propagate=false,first_matrix_op=none,last_matrix_op=none"


def _matmul(policy: str):
    return hlo_amp.compile(lambda x, w: x @ w, policy)


def _quantise(x: np.ndarray, fmt: type, fmax: float) -> np.ndarray:
    """The recipe in NumPy (f32 throughout, as on CPU): per-tensor current scaling."""
    x = np.asarray(x, np.float32)
    scale = np.float32(np.abs(x).max()) * np.float32(1.0 / fmax)
    if not (scale > 0 and np.isfinite(scale)):
        scale = np.float32(1.0)
    q = np.clip(x / scale, -fmax, fmax).astype(fmt)
    return q.astype(np.float32) * scale


# ---- numerics ----------------------------------------------------------------------------

# Why the bound below holds for every output element, for a K-long dot of x (m x K) and
# w (K x n), both quantised to e4m3fn with per-tensor scales s = amax / 448:
#
# * x / s lies in [-448, 448]. Where |x / s| >= 2**-6 (e4m3fn's smallest normal) the
#   format has 3 stored mantissa bits, so rounding to nearest errs by at most half an
#   ulp: |q - x/s| <= 2**-4 |x/s|. Below 2**-6 the spacing is 2**-9 (subnormals), so
#   |q - x/s| <= 2**-10. Times s: |x_hat - x| <= u |x| + t  with u = 2**-4, t = 2**-10 s.
#   (Dequantising to f32 is exact: 4 significant bits times the scale's 24.)
# * |x_hat w_hat - x w| <= |x_hat - x| |w_hat| + |x| |w_hat - w|
#                       <= (2u + u**2) |x||w| + (1 + u)(t_x |w| + t_w |x|) + t_x t_w.
# * Summed over K products, plus f32 accumulation (K * 2**-24 relative to sum |x_hat
#   w_hat|, taken twice to be safe):
#   |y_hat - y| <= (2u + u**2 + 2K 2**-24) sum_k |x||w| + (1+u)(t_x sum_k |w| + t_w
#   sum_k |x|) + K t_x t_w.
# The bound grows with K through the sums of |x||w|; it is a worst case. The typical
# error is smaller by about sqrt(K): each rounding is an independent error of relative
# variance E[d**2] = ulp**2 / 12 / v**2 averaged over a binade, 2**-6 / 12 * E[1/m**2]
# with the significand m in [1, 2) (E[1/m**2] = 0.54 for Benford-distributed m, 0.5 for
# uniform), so var(y_hat - y) = 2 E[d**2] sum_k (x w)**2. The test checks that too: it
# fails if the dot ran in bf16 (256 times less variance) or e5m2 (4 times more).
U = 2.0**-4
E_D2 = 2.0**-6 / 12 * 0.52


@pytest.mark.parametrize("k", [16, 256, 4096])
def test_single_dot_error_against_f64_is_e4m3s(k: int) -> None:
    rng = np.random.default_rng(k)
    x = rng.standard_normal((64, k)).astype(np.float32)
    w = rng.standard_normal((k, 48)).astype(np.float32)
    y = np.asarray(_matmul(FP8)(x, w), np.float64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    err = np.abs(y - x64 @ w64)

    t_x = 2.0**-10 * np.abs(x).max() / 448
    t_w = 2.0**-10 * np.abs(w).max() / 448
    ax, aw = np.abs(x64), np.abs(w64)
    bound = ((2 * U + U**2 + 2 * k * 2.0**-24) * (ax @ aw)
             + (1 + U) * (t_x * aw.sum(0)[None, :] + t_w * ax.sum(1)[:, None]) + k * t_x * t_w)
    assert (err <= bound).all(), float((err / bound).max())

    predicted = 2 * E_D2 * ((x64**2) @ (w64**2))
    ratio = float(np.mean(err**2) / np.mean(predicted))
    assert 0.6 < ratio < 1.6, ratio


def test_single_dot_matches_a_numpy_model_of_the_recipe() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 512)) * 3).astype(np.float32)
    w = (rng.standard_normal((512, 64)) / 20).astype(np.float32)
    y = np.asarray(_matmul(FP8_ACCURATE)(x, w), np.float64)
    model = (_quantise(x, ml_dtypes.float8_e4m3fn, 448.0).astype(np.float64)
             @ _quantise(w, ml_dtypes.float8_e4m3fn, 448.0).astype(np.float64))
    # Same quantised values; only the f32 summation order differs.
    tolerance = 512 * 2.0**-24 * (np.abs(x) @ np.abs(w))
    assert (np.abs(y - model) <= tolerance).all()
    assert not np.allclose(y, x.astype(np.float64) @ w, rtol=1e-3, atol=0)  # it is fp8


def test_backward_dot_quantises_the_gradient_to_e5m2() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w = rng.standard_normal((64, 64)).astype(np.float32) / 8
    g = rng.standard_normal((32, 64)).astype(np.float32)

    def loss(w: jax.Array, x: jax.Array, g: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ w) * g)

    grad = hlo_amp.compile(jax.grad(loss), FP8_ACCURATE)
    report = grad.lower(w, x, g).report()
    backward = [d for d in report.decisions if d.direction == "backward"]
    assert [d.operands_after for d in backward] == [("f8E5M2", "f8E4M3FN")]
    got = np.asarray(grad(w, x, g), np.float64)
    # The model: dW = x^T @ ct with x in e4m3fn and ct = g * tanh'(x @ w) in e5m2 (the
    # forward dot's output feeds tanh' in f32, from the e4m3fn forward product).
    h = _quantise(x, ml_dtypes.float8_e4m3fn, 448.0) @ _quantise(w, ml_dtypes.float8_e4m3fn,
                                                                 448.0)
    ct = (g * (1 - np.tanh(h) ** 2)).astype(np.float32)
    model = (_quantise(x, ml_dtypes.float8_e4m3fn, 448.0).astype(np.float64).T
             @ _quantise(ct, ml_dtypes.float8_e5m2, 57344.0).astype(np.float64))
    scale = np.abs(x).T @ np.abs(ct)
    assert np.abs(got - model).max() <= 1e-4 * scale.max()


@pytest.mark.parametrize("scan", [False, True])
def test_every_step_of_several_quantises_its_gradient_to_e5m2(scan: bool) -> None:
    """Several SGD steps in one function: the update p - lr * g made the next step's
    parameters 'gradient', so from step 2 on (every step in a scan) each backward dot
    had two gradient operands, and both went e4m3fn (small gradients flushed)."""
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32) for k in "ab"}
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)

    def loss(p):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]) ** 2)

    def step(p, _=None):
        return jax.tree.map(lambda w, d: w - 1e-3 * d, p, jax.grad(loss)(p)), None

    def steps(p):
        if scan:
            return jax.lax.scan(step, p, None, length=2)[0]
        for _ in range(2):
            p = step(p)[0]
        return p

    report = hlo_amp.compile(steps, FP8_ACCURATE).lower(params).report()
    backward = [d for d in report.decisions if d.direction == "backward" and d.fp8]
    assert backward and all("f8E5M2" in d.operands_after for d in backward), [
        (d.operands_after, d.reason) for d in backward]


@jax.jit  # a private function: its backward dots' residuals are its own arguments
def _layer(h: jax.Array, w: jax.Array) -> jax.Array:
    return h + jnp.tanh(h @ w)


@jax.custom_vjp
def _custom_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return a @ b


def _custom_matmul_forward(a, b):
    return a @ b, (a, b)


def _custom_matmul_backward(residuals, g):
    a, b = residuals
    return g @ b.T, a.T @ g  # b.T, a.T: backward ops of residuals (a constant's, too)


_custom_matmul.defvjp(_custom_matmul_forward, _custom_matmul_backward)


@pytest.mark.parametrize("inputs", ["argument", "closed_over", "positional_table"])
@pytest.mark.parametrize("unroll", [2, 3])
def test_an_unrolled_scans_backward_dots_quantise_the_gradient_to_e5m2(
        unroll: int, inputs: str) -> None:
    """A scan with unroll > 1 stacks its residuals in a loop whose returns the first
    round of the flow does not know yet: the stacks read as constants, the backward
    loop's reshape of one as the seed, and the carry that passes the stack through kept
    that guess, so the dW reading the stacked hidden state had two gradient operands
    and went e4m3fn x e4m3fn. Scanned inputs that are constants of the program (a
    closed-over batch, a table computed from an iota) reach the backward loop through a
    carry and a call: a slice of them read as the seed, and dU = x^T g went e4m3fn x
    e4m3fn (hunt h79)."""
    rng = np.random.default_rng(0)
    w, u = (jnp.asarray(rng.standard_normal((32, 32)) * 0.3, jnp.float32) for _ in "wu")
    batch = jnp.asarray(rng.standard_normal((6, 16, 32)), jnp.float32)

    def scanned(xs):
        return {"argument": xs, "closed_over": batch, "positional_table": jnp.sin(
            jnp.arange(xs.size, dtype=jnp.float32).reshape(xs.shape) * 0.37)}[inputs]

    def loss(w, u, xs):
        def cell(h, x):
            h = jnp.tanh(h @ w + x @ u)
            return h, h.sum()
        h, ys = jax.lax.scan(cell, jnp.zeros((16, 32)), scanned(xs), unroll=unroll)
        return (h ** 2).mean() + ys.mean() * 0.01

    report = hlo_amp.compile(jax.grad(loss, (0, 1)), "fp8").lower(w, u, batch).report()
    backward = [d.operands_after for d in report.decisions if d.direction == "backward"]
    assert len(backward) == 3 and all(
        formats == ("f8E5M2", "f8E4M3FN") for formats in backward), backward


@pytest.mark.parametrize("seed", ["loss_scaler", "loss_times_scale", "vjp_cotangent",
                                  "custom_vjp_constant_residual", "custom_vjp_scaled",
                                  "checkpoint_dots_scaled", "cotangent_statistic",
                                  "single_custom_scaled"])
def test_a_seed_that_is_not_a_constant_still_finds_every_gradient(seed: str) -> None:
    """The cotangent seed was found only as a constant (jax.grad's 1.0): the loss times a
    loss scale (hlo_amp's own dynamic_scale_grad, also under a saving remat policy, whose
    optimization barrier the residuals pass) or a vjp's cotangent argument made no value
    a gradient, and a custom_vjp's transpose of a constant residual read as a seed, so
    backward dots went e4m3fn x e4m3fn. A forward dot reading the cotangent (a K-FAC
    statistic) must not make it a residual. Each form quantises as the plain jax.grad
    of the same program does."""
    rng = np.random.default_rng(4)
    params = {k: jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32) for k in "abh"}
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    scale = jnp.float32(1024)

    def net(p, x):
        return _layer(_layer(x, p["a"]), p["b"]) @ p["h"]

    def custom(p, x):
        return jnp.tanh(_custom_matmul(jnp.tanh(_custom_matmul(x, p["a"])), p["b"]))

    def mlp(p, x):
        return jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"])

    def single_custom(p, x):  # one backward dot: nothing else finds its gradient
        return jnp.tanh(_custom_matmul(x, p["a"]))

    model = {"custom": custom, "single": single_custom, "checkpoint": jax.checkpoint(
        mlp, policy=jax.checkpoint_policies.checkpoint_dots)}.get(seed.split("_")[0], net)

    def loss(p, x):
        return jnp.sum(model(p, x) ** 2)

    def linear_loss(p, x, eps, target):  # the last forward dot is dead code in its grad
        return jnp.sum((mlp(p, x) @ p["h"] + eps) * target)

    # x an argument in the reference: the seed is jax.grad's constant, x a primal value
    reference, reference_args = jax.grad(loss), (params, x)
    if seed == "loss_scaler":
        step, args = (lambda p, st: hlo_amp.dynamic_scale_grad(functools.partial(
            loss, x=x))(p, dynamic_scaler_state=st)), (params, hlo_amp.DynamicScalerState())
    elif seed in ("loss_times_scale", "custom_vjp_scaled", "checkpoint_dots_scaled",
                  "single_custom_scaled"):
        step, args = (lambda p, s: jax.grad(lambda q: loss(q, x) * s)(p)), (params, scale)
    elif seed == "vjp_cotangent":  # the primal output kept: its last dot is a forward op
        def step(p, c):
            out, pullback = jax.vjp(lambda q: net(q, x), p)
            return out, pullback(c)[0]
        args = (params, cotangent)
        reference, reference_args = (jax.grad(lambda p, c: jnp.sum(net(p, x) * c)),
                                     (params, cotangent))
    elif seed == "cotangent_statistic":
        def step(p, target):
            g, d = jax.grad(linear_loss, (0, 2))(p, x, jnp.zeros((32, 32)), target)
            return g, d.T @ d
        args = (params, cotangent)
        reference, reference_args = (jax.grad(linear_loss, (0, 2)),
                                     (params, x, jnp.zeros((32, 32)), cotangent))
    else:  # x a constant of the program, its transpose a backward op of constants only
        step, args = (lambda p: jax.grad(loss)(p, x)), (params,)

    def backward(fn, args):
        report = hlo_amp.compile(fn, FP8_ACCURATE).lower(*args).report()
        return [d.operands_after for d in report.decisions
                if d.direction == "backward" and d.fp8]

    expected = backward(reference, reference_args)
    assert expected and all(sorted(d) == ["f8E4M3FN", "f8E5M2"] for d in expected)
    assert backward(step, args) == expected


def _backward_fp8(fn, *args):
    report = hlo_amp.compile(fn, FP8_ACCURATE).lower(*args).report()
    return [d.operands_after for d in report.decisions if d.direction == "backward" and d.fp8]


def test_a_scaled_cotangent_a_statistic_reads_puts_no_e5m2_on_a_forward_value() -> None:
    """A K-FAC statistic d.T @ d of a loss-scaled cotangent made d a 'residual', so the
    activation and the weight beside it went e5m2; the wrong seed then gave an unscaled
    gradient of the same step two 'gradients'. jax's transposes read the cotangent as
    their lhs: no backward dot here has its gradient on the rhs."""
    rng = np.random.default_rng(6)
    x, x2 = (jnp.asarray(rng.standard_normal((16, 32)), jnp.float32) for _ in range(2))
    target = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    params = {"a": jnp.asarray(rng.standard_normal((32, 48)) / 5, jnp.float32),
              "b": jnp.asarray(rng.standard_normal((48, 64)) / 5, jnp.float32)}

    def step(p, s):
        def loss(q, eps):
            return jnp.sum(((jnp.tanh(x @ q["a"]) @ q["b"]) + eps) * target) * s

        g, d = jax.grad(loss, (0, 1))(p, jnp.zeros((16, 64)))
        plain = jax.grad(lambda q: jnp.sum((jnp.tanh(x2 @ q["a"]) @ q["b"]) * target))(p)
        return g, d.T @ d, plain

    decided = _backward_fp8(step, params, jnp.float32(1024))
    assert ("f8E4M3FN", "f8E5M2") not in decided, decided
    assert decided[-3:] == [("f8E5M2", "f8E4M3FN")] * 3, decided  # the unscaled gradient


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.checkpoint_dots])
def test_the_seed_of_a_summed_linear_head_is_no_residual(policy) -> None:
    """value_and_grad of sum(checkpoint(block)(x) @ o): the seed's broadcast 1.0 @ o^T,
    a backward matrix op of a constant and a residual, was taken for a residual, so the
    weight-gradient dot beside the block's recomputed activation put e5m2 on that
    activation. jax's transposes read the cotangent as their lhs: all e5m2 x e4m3fn."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    params = {k: jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32) for k in "abo"}
    block = jax.checkpoint(lambda p, z: jnp.tanh(z @ p["a"]) @ p["b"], policy=policy)
    step = jax.value_and_grad(lambda q: jnp.sum(block(q, x) @ q["o"]))
    decided = _backward_fp8(step, params)
    assert decided and all(d == ("f8E5M2", "f8E4M3FN") for d in decided), decided


_SHARD_MAP_GRADIENT = """
import json, jax, jax.numpy as jnp, numpy as np, hlo_amp
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("d",))
rng = np.random.default_rng(9)
x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
weights = jnp.where(jnp.arange(32) < 16, 1.0, 1e-6)
local = lambda w, x: jnp.sum(jnp.tanh(x @ w) * weights)
loss = lambda w, x: jax.shard_map(lambda w, x: jax.lax.psum(local(w, x), "d"), mesh=mesh,
                                  in_specs=(P(), P("d")), out_specs=P())(w, x)
report = hlo_amp.compile(jax.grad(loss), "%s").lower(w, x).report()
print("RESULTS=" + json.dumps([d.operands_after for d in report.decisions
                               if d.direction == "backward" and d.fp8]))
"""


def test_a_shard_map_bodys_backward_dots_quantise_the_gradient_to_e5m2() -> None:
    """A shard_map body's arguments took no kind from the operands they stand for (an
    sdy.manual_computation region, on two devices), so its backward dots went e4m3fn x
    e4m3fn: gradient columns weighted 1e-6 were flushed (relative error 1.0; 0.07 under
    jax.jit)."""
    from host_devices import run_on_host_devices

    decided = run_on_host_devices(_SHARD_MAP_GRADIENT % FP8_ACCURATE, devices=2)
    assert decided and all(d == ["f8E5M2", "f8E4M3FN"] for d in decided), decided


@jax.custom_vjp
def _halved_matmul(a, w):
    return a @ w


_halved_matmul.defvjp(lambda a, w: (a @ w, (a, w)),  # the bwd scales its residuals
                      lambda res, g: (g @ (res[1] * 0.5).T, (res[0] * 0.5).T @ g))


def test_a_residual_a_custom_bwd_scales_is_no_gradient() -> None:
    """w * 0.5 in a custom_vjp's bwd: the splat 0.5, a backward op of a constant, was
    taken for the seed, so under a loss scale the scaled weight and activation went
    e5m2 and the cotangent e4m3fn."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    params = {"a": jnp.asarray(rng.standard_normal((32, 48)) / 5, jnp.float32),
              "b": jnp.asarray(rng.standard_normal((48, 16)) / 5, jnp.float32)}

    def step(p, s):
        net = lambda q: jnp.tanh(_halved_matmul(jnp.tanh(_halved_matmul(x, q["a"])), q["b"]))
        return jax.grad(lambda q: jnp.sum(net(q) ** 2) * s)(p)

    # dx = g @ (w/2)^T, then dW = (a/2)^T @ g for each layer: the gradient lhs, rhs, rhs
    assert _backward_fp8(step, params, jnp.float32(1)) == [
        ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2"), ("f8E4M3FN", "f8E5M2")]


def _recomputing_block(w1, w2, z):
    return jnp.tanh(jnp.tanh(z @ w1) @ w2)


@jax.custom_vjp
def _recomputed_block(w1, w2, z):
    return _recomputing_block(w1, w2, z)


_recomputed_block.defvjp(  # the bwd runs the forward again: jax.vjp of the block
    lambda w1, w2, z: (_recomputing_block(w1, w2, z), (w1, w2, z)),
    lambda residuals, g: jax.vjp(_recomputing_block, *residuals)[1](g))


def test_a_forward_recomputed_in_a_custom_bwd_is_no_gradient() -> None:
    """A custom_vjp whose bwd recomputes its forward: the recomputed activation was
    taken for the gradient of its dot with a weight (e5m2 on an activation), which then
    gave the weight-gradient dot beside it two 'gradients'. The recomputed dots are
    forward values (e4m3fn x e4m3fn); the bwd's own backward dots each have one
    gradient."""
    rng = np.random.default_rng(5)
    params = {k: jnp.asarray(rng.standard_normal((32, 32)) / 5, jnp.float32) for k in "ab"}
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)

    def grad(p):
        return jax.grad(lambda q: jnp.sum(_recomputed_block(q["a"], q["b"], x) ** 2))(p)

    report = hlo_amp.compile(grad, FP8_ACCURATE).lower(params).report()
    backward = [d for d in report.decisions if d.direction == "backward" and d.fp8]
    recomputed = [d.operands_after for d in backward if "transpose(jvp(jvp" in d.location]
    gradients = [d.operands_after for d in backward if "transpose(jvp(jvp" not in d.location]
    assert recomputed == [("f8E4M3FN", "f8E4M3FN")] * 2, recomputed
    assert gradients and all(sorted(d) == ["f8E4M3FN", "f8E5M2"] for d in gradients), gradients


# ---- the amax guard ------------------------------------------------------------------------


def test_all_zero_operand_gives_exact_zeros() -> None:
    w = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    y = np.asarray(_matmul(FP8)(np.zeros((16, 64), np.float32), w))
    assert (y == 0).all()


DELAYED = "fp8,scaling=delayed,amax_history=4,first_matrix_op=none,last_matrix_op=none"


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("policy", [FP8, FP8_ACCURATE, DELAYED])
def test_a_non_finite_operand_reaches_the_output_so_the_loss_scaler_skips(
        policy: str, bad: float) -> None:
    """Current scaling: the tensor's scale is NaN, so the whole result is. Delayed
    scaling (a scale from earlier steps): inf and NaN pass the clamp, so the row they
    touch is non-finite and the others are as before. An inf was clamped to 448 like a
    large finite value, and the dot came out finite: the loss scaler never saw it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    f, g = (hlo_amp.compile(lambda x, w: x @ w, policy) for _ in range(2))
    for h in (f, g):  # under delayed scaling: a history of finite amaxes
        assert np.isfinite(np.asarray(h(x, w))).all()
    clean = np.asarray(g(x, w))
    x[3, 5] = bad
    y = np.asarray(f(x, w))
    assert not bool(all_finite({"g": jnp.asarray(y)}))
    if policy == DELAYED:
        assert not np.isfinite(y[3]).any()
        np.testing.assert_array_equal(np.delete(y, 3, axis=0), np.delete(clean, 3, axis=0))
    else:
        assert np.isnan(y).all()


def test_an_overflowed_f16_gradient_makes_the_scaler_skip_under_fp8() -> None:
    """fp8 with f16 compute and the dynamic loss scaler: a loss scale too large overflows
    the f16 gradients. The e5m2 gradient operands clamped the inf to 57344: the weight
    gradients came out finite and about 2000 times too small, and the scaler went on."""
    rng = np.random.default_rng(0)
    p = {"w1": jnp.asarray(rng.standard_normal((32, 32)) * 0.2, jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((32, 32)) * 0.2, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    def step(p, state, x):
        state, (_, grads) = hlo_amp.dynamic_scale_value_and_grad(loss)(
            p, x, dynamic_scaler_state=state)
        return state, all_finite(grads)

    too_large = hlo_amp.DynamicScalerState(scaler=2.0**30)
    for policy in ("mixed_float16", f"fp8,compute=float16,{FP8.split(',', 1)[1]}"):
        state, finite = hlo_amp.compile(step, policy)(p, too_large, x)
        assert not bool(finite) and int(state.total_resets) == 1, policy


def test_tiny_and_huge_tensors_keep_their_relative_precision() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    reference = x.astype(np.float64) @ w
    for factor in (1e-30, 1e30):
        y = np.asarray(_matmul(FP8)(x * np.float32(factor), w), np.float64) / factor
        assert np.abs(y - reference).max() <= 0.15 * np.abs(reference).max(), factor



@pytest.mark.parametrize("factor", [1.0, 1e-3])
def test_an_f16_dot_keeps_its_range_and_small_scales(factor: float) -> None:
    """A program written in f16: the fp8 dot sums its unscaled products (up to 448**2
    each, past f16's 65504) and scales them in f32, then rounds to f16 (every element
    was inf or NaN before); at factor 1e-3 x's scale (2.2e-6) would be rounded to a
    few bits in f16 and the scale product (5e-9) to 0 in f16."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((32, 256)) * factor).astype(np.float16)
    w = rng.standard_normal((256, 64)).astype(np.float16)
    y = _matmul(FP8)(x, w)
    assert y.dtype == jnp.float16
    model = (_quantise(x, ml_dtypes.float8_e4m3fn, 448.0).astype(np.float64)
             @ _quantise(w, ml_dtypes.float8_e4m3fn, 448.0).astype(np.float64))
    # The same quantised values; f32 summation, then one rounding to f16 (2**-11).
    tolerance = 2.0**-11 * np.abs(model) + 256 * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-7
    assert (np.abs(np.asarray(y, np.float64) - model) <= tolerance).all()

# ---- what is emitted -----------------------------------------------------------------------


def _train_step_text() -> str:
    def loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        with jax.named_scope("stem"):
            h = jax.nn.gelu(x @ p["w0"])
        with jax.named_scope("block"):
            h = jax.nn.gelu(jnp.einsum("btd,de->bte", h, p["w1"]))
        with jax.named_scope("head"):
            return jnp.mean((h.mean(1) @ p["w2"] - y) ** 2)

    def step(p: dict, x: jax.Array, y: jax.Array):
        return jax.grad(loss)(p, x, y)

    p = {"w0": jnp.ones((32, 64)), "w1": jnp.ones((64, 64)), "w2": jnp.ones((64, 10))}
    return jax.jit(step).lower(p, jnp.ones((4, 16, 32)), jnp.ones((4, 10))).as_text(
        debug_info=True)


_DEF = re.compile(r"^\s*(%[\w#]+) = (\S+) (.*)$")


def _fp8_dot(defs: dict[str, tuple[str, str]], name: str) -> tuple[str | None, ...]:
    """The operand formats of dot ``name`` (None: not fp8) after checking the direct
    form when it has any: ``dot_general(f8, f8)`` whose one reader multiplies it by a
    broadcast scalar of the dot's result type (the product of the two scales: f32 in the
    accurate mode, bf16 in the fast mode, whose dots return bf16)."""
    _, rest = defs[name]
    operand_types = re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\) ->", rest).groups()
    result_element = re.search(r"-> tensor<(?:\d+x)*(\w+)>", rest).group(1)
    formats = tuple(next(iter(re.findall(r"x(f8E4M3FN|f8E5M2)>", t)), None)
                    for t in operand_types)
    if formats != (None, None):
        readers = [(o, r) for o, r in defs.values() if name in re.findall(r"%[\w#]+", r)]
        assert len(readers) == 1 and readers[0][0] == "stablehlo.multiply", readers
        (other,) = [v for v in re.findall(r"%[\w#]+", readers[0][1])[:2] if v != name]
        scale_op, scale_rest = defs[other]
        assert scale_op == "stablehlo.broadcast_in_dim"
        assert f"(tensor<{result_element}>)" in scale_rest, (result_element, scale_rest)
    return formats


@pytest.mark.parametrize("policy", ["fp8", "fp8,propagate=false"])
def test_every_fp8_dot_reads_fp8_tensors_directly(policy: str) -> None:
    """The direct form (issue 20): XLA:GPU keeps it as one fp8 GEMM in cuBLASLt and in
    Triton alike, folding the scale product into the call. Both modes have it."""
    text, report = hlo_amp.rewrite(_train_step_text(), policy, return_report=True)
    defs = {}
    for line in text.splitlines():
        match = _DEF.match(line)
        if match:
            defs[match.group(1)] = (match.group(2), match.group(3))
    pairs = [_fp8_dot(defs, name) for name, (op, _) in defs.items()
             if op == "stablehlo.dot_general"]
    quantised = [p for p in pairs if p != (None, None)]
    assert all(None not in p for p in quantised)  # both operands or neither
    assert all("f8E4M3FN" in p for p in quantised)  # cuBLASLt: never e5m2 x e5m2
    expected = [d.operands_after for d in report.decisions
                if any(t.startswith("f8") for t in d.operands_after)]
    assert sorted(quantised) == sorted(expected)
    assert ("f8E5M2", "f8E4M3FN") in quantised  # the block's backward dots
    assert len(quantised) == 3  # block forward + 2 backward; stem and head kept bf16
    assert "hlo_amp.fp8" not in text


def test_xla_cpu_keeps_the_fp8_rounding() -> None:
    x = jnp.ones((16, 64))
    compiled = _matmul(FP8).lower(x, jnp.ones((64, 32))).compile().as_text()
    assert "f8e4m3fn[" in compiled  # the quantising convert survives XLA:CPU's passes


def test_pipeline_runs_the_fp8_pass_only_for_fp8_policies() -> None:
    assert "hlo-amp-fp8" in [p.name for p in default_pipeline(Policy.parse("fp8"))]
    assert "hlo-amp-fp8" in [p.name for p in default_pipeline(
        Policy.parse("bf16,scope:mlp=float8_e4m3fn"))]
    assert "hlo-amp-fp8" not in [p.name for p in default_pipeline(Policy.parse("bf16"))]
    assert "hlo-amp-fp8" in pass_names(Policy.parse("bf16"))


# ---- training ------------------------------------------------------------------------------


def _digits() -> tuple[np.ndarray, ...]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x = (x - x.mean()) / x.std()
    return train_test_split(x, digits.target.astype(np.int32), test_size=0.2,
                            random_state=0, stratify=digits.target)


def _mlp_accuracy(policy: str | None, steps: int = 400) -> tuple[float, object]:
    x_train, x_test, y_train, y_test = _digits()
    sizes = [64, 128, 128, 128, 10]
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
    params = [jax.random.normal(k, (a, b)) / np.sqrt(a) for k, a, b in
              zip(keys, sizes, sizes[1:])]
    tx = optax.adam(2e-3)

    def loss_fn(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
        for i, w in enumerate(params[:-1]):
            with jax.named_scope(f"layer_{i}"):
                x = jax.nn.gelu(x @ w)
        with jax.named_scope("head"):
            logits = x @ params[-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params: list, opt_state: object, x: jax.Array, y: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    compiled = jax.jit(step) if policy is None else hlo_amp.compile(step, policy)
    report = None if policy is None else compiled.lower(
        params, opt_state, x_train[:128], y_train[:128]).report()
    order = np.random.default_rng(0)
    for _ in range(steps):
        idx = order.choice(len(x_train), 128, replace=False)
        params, opt_state, _ = compiled(params, opt_state, x_train[idx], y_train[idx])
    logits = jnp.asarray(x_test)
    for w in params[:-1]:
        logits = jax.nn.gelu(logits @ w)
    accuracy = float((jnp.argmax(logits @ params[-1], -1) == y_test).mean())
    return accuracy, report


def test_mlp_on_digits_trains_to_f32_accuracy_in_fp8() -> None:
    f32, _ = _mlp_accuracy(None)
    fp8, report = _mlp_accuracy("fp8")
    fp8_dots = [d for d in report.decisions if any(t.startswith("f8") for t in
                                                   d.operands_after)]
    assert len(fp8_dots) == 6  # layers 1 and 2, forward and both backward dots
    assert f32 > 0.9
    assert abs(fp8 - f32) <= 0.02, (fp8, f32)


def test_summary_counts_fp8_dots_before_compiling() -> None:
    """Issue 20 item 4: the pass's own summary says how many dots are fp8, not only
    "16-bit or narrower"; the count is the report's fp8 decisions."""
    def mlp(w1, w2, w3, x):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w3

    ws = [jnp.ones((64, 64)) / 8] * 3
    report = hlo_amp.compile(mlp, "fp8").lower(*ws, jnp.ones((32, 64))).report()
    fp8 = sum(d.fp8 for d in report.decisions if d.op_kind == "dot_general")
    assert fp8 == 1  # first and last matrix ops stay bf16 (the preset)
    assert f"3/3 dot_general ({fp8} fp8);" in report.summary()
    bf16 = hlo_amp.compile(mlp, "bf16").lower(*ws, jnp.ones((32, 64))).report()
    assert "fp8" not in bf16.summary()


def test_ends_inside_a_scan_are_no_stem_or_head() -> None:
    """The preset's first/last-matrix-op rules keep a stem and a head in bf16; a first
    matrix op inside a scanned layer body is every layer's, not a stem: it stays fp8."""
    import hlo_amp

    def model(stem, layers, head, x):
        h = x @ stem  # the stem: outside the scan, kept bf16

        def layer(h, w):
            return jax.nn.gelu(h @ w), None

        h, _ = jax.lax.scan(layer, h, layers)
        return jnp.sum((h @ head) ** 2)  # the head: kept bf16

    def gather_model(layers, head, x):  # no stem matrix op: the scan's dot comes first
        h, _ = jax.lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, layers)
        return jnp.sum((h @ head) ** 2)

    key = jax.random.split(jax.random.key(0), 4)
    stem, head = (jax.random.normal(key[0], (32, 64)), jax.random.normal(key[1], (64, 16)))
    layers = jax.random.normal(key[2], (3, 64, 64))
    x = jax.random.normal(key[3], (16, 32))
    for fn, args in ((model, (stem, layers, head, x)), (gather_model, (layers, head, x[:, :1]
                                                                      * jnp.ones((1, 64))))):
        report = hlo_amp.compile(jax.grad(fn, argnums=(0, 1)), "fp8").lower(
            *args, target="h100").report()
        looped = [d for d in report.decisions if d.runs and d.runs > 1]
        ends = [d for d in report.decisions if d.rule in ("first_matrix_op", "last_matrix_op")]
        assert looped and all(d.fp8 for d in looped), [(d.rule, d.reason) for d in looped]
        assert ends and all(not d.fp8 for d in ends)
        assert all(d.runs == 1 for d in ends)



def test_a_loop_around_the_whole_step_leaves_the_ends_their_rules() -> None:
    """A loop that runs the whole step (the loss scaler's redo_on_nan, a scan over
    microbatches accumulating gradients) makes no op a layer's: the stem and head stay
    bf16. An end was dropped inside any loop, and both went fp8 with their gradients.
    A scanned layer inside such a loop is still every layer's op: it stays fp8."""
    import optax

    key = jax.random.split(jax.random.key(0), 5)
    params = {"stem": jax.random.normal(key[0], (16, 64)) / 4,
              "mid": jax.random.normal(key[1], (64, 64)) / 8,
              "head": jax.random.normal(key[2], (64, 32)) / 8}
    x, y = jax.random.normal(key[3], (4, 128, 16)), jnp.arange(4 * 128).reshape(4, 128) % 32

    def loss(p, x, y):
        h = jax.nn.silu(jax.nn.silu(x @ p["stem"]) @ p["mid"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()

    def accumulate(p, x, y):
        zero = jax.tree.map(jnp.zeros_like, p)
        step = lambda g, b: (jax.tree.map(jnp.add, g, jax.grad(loss)(p, *b)), None)
        return jax.lax.scan(step, zero, (x, y))[0]

    scaled = hlo_amp.dynamic_scale_value_and_grad(loss, redo_on_nan=1)

    def redo(p, x, y):
        return scaled(p, x[0], y[0], dynamic_scaler_state=hlo_amp.DynamicScalerState())

    def plain(p, x, y):
        return jax.grad(loss)(p, x[0], y[0])

    def rules(fn, *args):
        report = hlo_amp.compile(fn, "fp8").lower(*args).report()
        return [(d.direction, d.rule, d.fp8) for d in report.decisions]

    want = rules(plain, params, x, y)
    assert [r for r in want if r[0] == "forward"] == [
        ("forward", "first_matrix_op", False), ("forward", "op:dot_general", True),
        ("forward", "last_matrix_op", False)]
    assert rules(accumulate, params, x, y) == want
    assert rules(redo, params, x, y) == want

    # Layers scanned inside the microbatch loop: their dot is each layer's, fp8.
    def layered(p, layers, x, y):
        def one(p, x, y):
            h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x @ p["stem"], layers)[0]
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()

        step = lambda g, b: (g + jax.grad(one)(p, *b)["head"], None)
        return jax.lax.scan(step, jnp.zeros_like(p["head"]), (x, y))[0]

    # An RNN's cell dots in training, every forward matrix op in its time scan and its
    # gradients in a scan of their own: each step's op, no stem or head. Without
    # gradients the time scan runs the whole forward, as a generation loop does: ends.
    def rnn(p, xs):
        cell = lambda h, x: (jnp.tanh(x @ p["stem"] + h @ p["mid"]), None)
        return jax.lax.scan(cell, jnp.zeros((128, 64)), xs)[0].sum()

    assert {rule for _, rule, _ in rules(jax.grad(rnn), params, x)} == {"op:dot_general"}
    assert rules(rnn, params, x) == [("forward", "first_matrix_op", False),
                                     ("forward", "last_matrix_op", False)]

    # A generation loop around the whole forward (a token per iteration): the stem and
    # head keep their rules, as in the forward alone. Both went fp8 (the head's logits
    # too: greedy tokens agreed 44-56% with f32's, 94-100% under bf16).
    def forward(p, x):
        return jax.nn.silu(jax.nn.silu(x @ p["stem"]) @ p["mid"]) @ p["head"]

    def generate(p, x):  # each iteration's input: the last one's first 16 logits
        return jax.lax.fori_loop(0, 3, lambda i, h: forward(p, h)[:, :16], x)

    # Teacher-forced, the step's tokens picked by the loop, the head's weight cut (a
    # padded vocabulary): the stem's input is an activation, the head's weight the
    # same at every iteration. Both ends went fp8.
    tokens = jnp.arange(4 * 128).reshape(4, 128) % 16
    embedding = jax.random.normal(key[4], (16, 16))

    def teacher_forced(p, tokens):
        def step(i, logits):
            h = jax.nn.silu(embedding[tokens[i]] @ p["stem"]) @ p["mid"]
            return logits.at[i].set(jax.nn.silu(h) @ p["head"][:, :24])
        return jax.lax.fori_loop(0, 4, step, jnp.zeros((4, 128, 24)))

    assert [r[1] for r in rules(teacher_forced, params, tokens)] == [
        "first_matrix_op", "op:dot_general", "last_matrix_op"]

    alone = rules(forward, params, x[0])
    assert [r[1] for r in alone] == ["first_matrix_op", "op:dot_general", "last_matrix_op"]
    assert rules(generate, params, x[0]) == alone

    layers = jax.random.normal(key[4], (3, 64, 64)) / 8
    found = rules(layered, params, layers, x, y)
    forward = sorted(r for r in found if r[0] == "forward")
    assert forward == [("forward", "first_matrix_op", False), ("forward", "last_matrix_op", False),
                       ("forward", "op:dot_general", True)], found

    # A scan over stacked layers alone, without gradients: every matrix op reads a
    # layer's slice of the stack, each iteration another, so none is a stem or a head.
    def stack_alone(layers, x):
        return jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, layers)[0]

    def stack_inner_loop(layers, x):  # the layer's weight passed on by an inner loop
        return jax.lax.scan(lambda h, w: (jax.lax.fori_loop(
            0, 2, lambda i, h: h + jnp.tanh(h @ w), h), None), x, layers)[0]

    def heads_over_one_input(layers, x):  # the activation the same at every iteration
        return jax.lax.scan(lambda c, w: (c, jnp.tanh(x @ w)), 0.0, layers)[1]

    for fn in (stack_alone, jax.grad(lambda l, x: stack_alone(l, x).sum()), stack_inner_loop,
               heads_over_one_input):
        assert {rule for _, rule, _ in rules(fn, layers, x[0, :, :16] @ params["stem"])} == {
            "op:dot_general"}


def test_a_block_called_at_each_layer_has_its_own_first_and_last_call() -> None:
    """A jax.jit block called at every layer (a private function, one call-site name
    for all four calls): its first call is the program's first matrix op and its last
    the last one, the two between are fp8, as when the block is written inline. The
    ends were keyed by call-site name alone, so every call was both ends and none was
    fp8 (and a second run of the pipeline split the function and changed the module)."""
    layer = jax.jit(lambda x, w: jnp.tanh(x @ w))

    def blocks(x, w):
        for _ in range(4):
            x = layer(x, w)
        return x

    report = hlo_amp.compile(blocks, "fp8").lower(jnp.ones((32, 64)),
                                                  jnp.ones((64, 64))).report()
    assert [(d.rule, d.runs, bool(d.fp8)) for d in report.decisions] == [
        ("first_matrix_op", 1, False), ("op:dot_general", 2, True),
        ("last_matrix_op", 1, False)]

def _layer_loop(ws, head, x, y):
    h = x
    for w in ws:  # every layer's dot on one source line: one stack for all
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ head - y) ** 2)


def _sequential(ws, head, x, y):  # nnx.Sequential's form: first and last look alike
    layers = [*ws, head]
    h = x
    for i, w in enumerate(layers):
        h = h @ w
        if i < len(layers) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


@pytest.mark.parametrize("loss", [_layer_loop, _sequential])
def test_an_ends_backward_dots_are_its_own_not_every_layers(loss) -> None:
    """The backward dots of the first and last matrix ops are those reading their
    operands: with every layer written on one line, first_matrix_op's rule hit all seven
    backward dots of a 4-layer MLP; in nnx.Sequential's form, where first and last look
    alike, it hit none (the stem's and head's backward ran fp8 under the preset)."""
    import hlo_amp

    keys = jax.random.split(jax.random.key(0), 6)
    ws = [jax.random.normal(keys[i], (16, 16)) for i in range(4)]
    head = jax.random.normal(keys[4], (16, 4))
    x, y = jnp.ones((8, 16)), jnp.ones((8, 4))
    grad = jax.grad(loss, argnums=(0, 1))
    report = hlo_amp.compile(grad, "bf16,first_matrix_op=float32,last_matrix_op=float32"
                             ).lower(ws, head, x, y).report()
    rules = collections.Counter((d.direction, d.rule) for d in report.decisions)
    # Forward: the stem and the head. Backward: the stem's weight gradient (x needs
    # none) and the head's two.
    assert rules[("forward", "first_matrix_op")] == 1
    assert rules[("forward", "last_matrix_op")] == 1
    assert rules[("backward", "first_matrix_op")] == 1
    assert rules[("backward", "last_matrix_op")] == 2


def _critic(params, x):  # a loss linear in the head: under jax.grad its forward is dead
    with jax.named_scope("body"):
        h = jax.nn.relu(x @ params["w0"])
        h = jax.nn.relu(h @ params["w1"])
    with jax.named_scope("head"):
        return jnp.mean(h @ params["w2"])


def test_the_head_of_a_loss_linear_in_it_is_the_last_end_under_grad() -> None:
    """jax.grad of a critic's mean score: jax drops the head's forward matmul, whose
    backward dots run first. They ran fp8 and the body's second layer took the
    last_matrix_op rule; with jax.value_and_grad (the head's forward kept) they are the
    head's, as they are now under jax.grad alone."""
    import hlo_amp

    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w0": jax.random.normal(keys[0], (64, 64)),
              "w1": jax.random.normal(keys[1], (64, 64)),
              "w2": jax.random.normal(keys[2], (64, 32))}
    x = jax.random.normal(keys[3], (64, 64))

    def ends(fn):
        report = hlo_amp.compile(fn, "fp8,propagate=false").lower(params, x).report()
        return sorted((d.scope, d.direction, d.rule) for d in report.decisions
                      if d.rule == "last_matrix_op")

    assert ends(jax.grad(_critic)) == [("head", "backward", "last_matrix_op")] * 2

    # Its weight scaled, or closed over as a constant: no bare argument (found none).
    def scaled(params, x):
        return _critic({**params, "w2": params["w2"] * 0.5}, x)

    frozen = np.asarray(params["w2"])

    def constant(params, x):
        return _critic({**params, "w2": frozen}, x)

    assert ends(jax.grad(scaled)) == [("head", "backward", "last_matrix_op")] * 2
    assert ends(jax.grad(constant)) == [("head", "backward", "last_matrix_op")]
    assert ends(jax.value_and_grad(_critic)) == (
        [("head", "backward", "last_matrix_op")] * 2 + [("head", "forward", "last_matrix_op")])

    # A live head whose first gradient dots are on other lines is no dead head: a
    # custom_vjp's own backward dots, a linalg solve's after the head (each took the
    # rule from the live head, whose forward then ran fp8).
    @jax.custom_vjp
    def dense(h, w):
        return h @ w

    dense.defvjp(lambda h, w: (h @ w, (h, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

    def custom(params, x):
        with jax.named_scope("body"):
            h = jax.nn.relu(x @ params["w0"])
        with jax.named_scope("head"):
            return jnp.mean(dense(h, params["w2"]) ** 2)

    def solved(params, x):
        with jax.named_scope("body"):
            h = x @ params["w0"]
        with jax.named_scope("head"):
            y = h @ params["w2"]
        return jnp.sum(jnp.linalg.solve(jnp.eye(32) * 4 + 0.1, y.T) ** 2)

    assert ("head", "forward", "last_matrix_op") in ends(jax.grad(custom))
    assert ends(jax.grad(solved)) == (
        [("head", "backward", "last_matrix_op")] * 2 + [("head", "forward", "last_matrix_op")])


def test_a_jit_layers_backward_dots_follow_its_first_and_last_call() -> None:
    """A jax.jit layer called per layer: the backward function its transpose calls is
    one function for every layer (its ops one stack). The ends' backward dots are those
    whose call passes the end's operands; they ran fp8 (the operands were compared as
    the callee's own arguments, and a dot on three call paths was one op)."""
    layer = jax.jit(lambda w, h: jax.nn.relu(h @ w))
    ws = [jax.random.normal(jax.random.key(i), (32, 32)) / 6 for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (16, 32))

    def loss(ws, x):
        for w in ws:
            x = layer(w, x)
        return jnp.sum(x ** 2)

    report = hlo_amp.compile(jax.grad(loss, argnums=(0, 1)), "fp8").lower(ws, x).report()
    found = collections.Counter((d.direction, d.rule, d.fp8) for d in report.decisions)
    assert found == {("forward", "first_matrix_op", False): 1,
                     ("forward", "op:dot_general", True): 1,
                     ("forward", "last_matrix_op", False): 1,
                     ("backward", "first_matrix_op", False): 2,
                     ("backward", "op:dot_general", True): 2,
                     ("backward", "last_matrix_op", False): 2}


def test_only_if_faster_keeps_the_gemms_whose_fp8_form_pays() -> None:
    """Under only_if_faster, a GEMM whose fp8 form saves less GEMM time than quantising its
    operands costs (Target.fp8_loses) computes in bf16 with the reason; a large one stays
    fp8. The verdicts follow the H100's published peaks and bandwidth."""
    import hlo_amp
    from hlo_amp.targets import device_target

    h100 = device_target("h100")
    big, small = 4096, 64

    def two_dots(a, b, x, y):
        return jnp.sum(a @ b) + jnp.sum(x @ y)

    args = [jnp.ones((big, big)), jnp.ones((big, big)), jnp.ones((small, small)),
            jnp.ones((small, small))]
    report = hlo_amp.compile(two_dots, "fp8,only_if_faster=true,first_matrix_op=none,"
                             "last_matrix_op=none").lower(*args, target="h100").report()
    by_size = {d.shape: d for d in report.decisions}
    assert by_size[f"{big}x{big}"].fp8
    assert not by_size[f"{small}x{small}"].fp8
    assert "does not pay" in by_size[f"{small}x{small}"].reason
    # The same verdicts from the model itself (two n x n bf16 operands).
    for n, pays in ((big, True), (small, False)):
        assert (h100.fp8_loses(2 * n**3, [(n * n, 16)] * 2) is None) == pays
    # Without the rule (the default), both are fp8; a target without peaks never refuses.
    plain = hlo_amp.compile(two_dots, "fp8,first_matrix_op=none,last_matrix_op=none").lower(
        *args, target="h100").report()
    assert all(d.fp8 for d in plain.decisions)
    from hlo_amp.targets.target import Target
    assert Target().fp8_loses(2 * small**3, [(small * small, 16)] * 2) is None


def test_an_fp8_policy_that_quantises_nothing_says_so() -> None:
    """A two-dot model under the fp8 preset: both dots are ends, kept bf16, so the step
    runs exactly as mixed_bfloat16; the report said nothing about fp8."""
    rng = np.random.default_rng(0)
    w1, w2 = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 128), (128, 32)))
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)

    def step(w1, w2):
        return jax.grad(lambda w1, w2: jnp.mean(jax.nn.relu(x @ w1) @ w2) ** 2,
                        argnums=(0, 1))(w1, w2)

    notes = [n for n in hlo_amp.compile(step, "fp8").lower(w1, w2).report().notes
             if n.startswith("fp8")]
    assert len(notes) == 1 and notes[0].startswith("fp8: no dot_general as fp8 GEMMs")
    assert "first_matrix_op 2" in notes[0] and "last_matrix_op 3" in notes[0]
    quantised = [n for n in hlo_amp.compile(step, f"fp8,{FP8.split(',', 1)[1]}").lower(
        w1, w2).report().notes if n.startswith("fp8")]
    assert quantised[0].startswith("fp8: 5 dot_general as fp8 GEMMs")
    assert "first_matrix_op=none,last_matrix_op=none puts them under the fp8 rule" in notes[0]

    # Three dots, the middle one too small for an fp8 GEMM: the line counted no
    # fallback and blamed the ends' rules, which are not what kept it bf16 (hunt h106).
    def three(w1, w2, w3, x):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w3

    small = hlo_amp.compile(three, "fp8").lower(
        jnp.ones((32, 8)), jnp.ones((8, 8)), jnp.ones((8, 32)), jnp.ones((32, 32))).report()
    line = next(n for n in small.notes if n.startswith("fp8"))
    assert line.startswith("fp8: no dot_general as fp8 GEMMs")
    assert "1 fp8 fallback(s) to the compute dtype" in line
    assert "first_matrix_op=none" not in line
    # Two convolutions (never fp8), and dots XLA:CPU leaves as written under
    # only_if_faster: the ends are not what keeps them 16-bit (review h107).
    def convs(x, w1, w2):
        conv = functools.partial(jax.lax.conv_general_dilated, window_strides=(1, 1),
                                 padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return conv(jnp.tanh(conv(x, w1)), w2)

    conv_line = next(n for n in hlo_amp.compile(convs, "fp8").lower(
        jnp.ones((2, 8, 8, 16)), jnp.ones((3, 3, 16, 16)), jnp.ones((3, 3, 16, 16)))
        .report().notes if n.startswith("fp8"))
    cpu_line = next(n for n in hlo_amp.compile(three, "fp8,only_if_faster=true").lower(
        *(jnp.ones((32, 32)),) * 4).report().notes if n.startswith("fp8"))
    # The user's own end rules, or another preset's, are not the fp8 preset's (h109).
    own_lines = [next(n for n in hlo_amp.compile(step, policy).lower(w1, w2).report().notes
                      if n.startswith("fp8"))
                 for policy in ("fp8,first_matrix_op=float32,last_matrix_op=float32",
                                ("bf16,op:dot_general=float8_e4m3fn,first_matrix_op=bfloat16,"
                                 "last_matrix_op=bfloat16"))]
    for text in (conv_line, cpu_line, *own_lines):
        assert text.startswith("fp8: no dot_general as fp8 GEMMs")
        assert "first_matrix_op=none" not in text
    # The user's end rules at the compute type under an fp8 op rule get the advice, in
    # words that name no preset the policy does not use (review h112).
    own_compute = next(n for n in hlo_amp.compile(step, (
        "bf16,op:dot_general=float8_e4m3fn,first_matrix_op=compute,last_matrix_op=compute"
    )).lower(w1, w2).report().notes if n.startswith("fp8"))
    assert "first_matrix_op=none,last_matrix_op=none puts them under" in own_compute
    assert "preset" not in own_compute


@pytest.mark.parametrize("policy", ["fp8", "bf16,first_matrix_op=float32,last_matrix_op=float32"])
def test_a_matrix_op_in_a_while_loops_condition_is_decided(policy):
    """A while loop whose condition computes a residual's norm (A @ x - b): the loop-end
    rules followed the condition's carry through the body's terminator as if it were
    the body's (an IndexError, an internal error in insert-converts)."""
    def solve(a, b, x0):
        def cond(carry):
            x, i = carry
            return (jnp.linalg.norm(a @ x - b) > 1e-3) & (i < 50)

        def body(carry):
            x, i = carry
            return x - 0.01 * (a @ x - b), i + 1

        return jax.lax.while_loop(cond, body, (x0, 0))[0]

    a, b, x0 = jnp.eye(8) * 2.0, jnp.ones((8, 8)), jnp.zeros((8, 8))
    got = hlo_amp.compile(solve, policy)(a, b, x0)
    np.testing.assert_allclose(got, jax.jit(solve)(a, b, x0), rtol=0.05, atol=0.02)
