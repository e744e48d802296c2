"""Real models that no one here wrote, as full train steps through hlo_amp.compile.

Flax Linen built-ins (attention, Conv+BatchNorm ResNet block, nn.scan over an LSTM
cell, nn.remat), Flax NNX built-ins and Equinox layers. Each runs a few optax steps:
the loss stays within bf16 tolerance of f32, every dot/conv is in bf16 under 'bf16',
and (Linen) a scope rule naming a submodule keeps exactly that submodule in f32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hlo_amp

STEPS = 2
TX = optax.adam(1e-2)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def make_step(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A train step over (params, extra, opt_state): loss_fn -> (loss, new_extra)."""

    def step(params, extra, opt_state, batch):
        (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, extra, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), extra, opt_state, loss

    return step


def run_steps(step: Callable[..., Any], params, extra, batch) -> tuple[list[float], Any]:
    opt_state = TX.init(params)
    losses = []
    for _ in range(STEPS):
        params, extra, opt_state, loss = step(params, extra, opt_state, batch)
        losses.append(float(loss))
    return losses, extra


# f32 losses per case, trained once for both modes (each case builds the same model,
# parameters and batch from fixed seeds).
_F32_LOSSES: dict[str, list[float]] = {}


def check_model(case: str, loss_fn, params, extra, batch, *, rtol: float = 5e-2,
                policy: str = "bf16") -> tuple[hlo_amp.Report, Any]:
    """Runs f32 (jax.jit, once per ``case``) and 16-bit (hlo_amp, ``policy``) train steps;
    returns the 16-bit report and the 16-bit run's final ``extra`` (e.g. batch_stats)."""
    step = make_step(loss_fn)
    if case not in _F32_LOSSES:
        _F32_LOSSES[case] = run_steps(jax.jit(step), params, extra, batch)[0]
    want = _F32_LOSSES[case]
    amp = hlo_amp.compile(step, policy)
    got, final_extra = run_steps(amp, params, extra, batch)
    assert amp.lowerings == 1  # one signature, compiled once
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-2)
    report = amp.lower(params, extra, TX.init(params), batch).report()
    assert report.decisions, "no dot/conv found"
    not_low = [d for d in report.decisions if not d.low_precision]
    assert not not_low, str(report)
    total = sum(d.flops or 0 for d in report.decisions)
    low = sum(d.flops or 0 for d in report.decisions if d.low_precision)
    assert total > 0 and low == total
    assert "100% of FLOPs" in report.summary()
    # jax.checkpoint's forward, recomputed in the backward pass, where a model has it.
    assert {d.direction for d in report.decisions} - {"recomputed"} == {"forward", "backward"}
    assert (report.propagation is not None) == policy.startswith("mixed_")
    return report, final_extra


# Every third-party case runs in the accurate and in the fast mode.
MODES = ["bf16", "mixed_bfloat16"]


def linen_loss(model: nn.Module, mutable: bool = False):
    def loss_fn(params, extra, batch):
        x, y = batch
        variables = {"params": params, **extra}
        if mutable:
            out, updates = model.apply(variables, x, mutable=["batch_stats"])
            extra = dict(updates)
        else:
            out = model.apply(variables, x)
        return jnp.mean((out - y) ** 2), extra

    return loss_fn


# ---- Flax Linen ---------------------------------------------------------------------------


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, name="attn")(x)
        h = nn.LayerNorm()(h + x)
        return nn.Dense(1, name="head")(h.mean(axis=1))


class ResNetBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Conv(4, (3, 3), name="conv1")(x)
        h = nn.BatchNorm(use_running_average=False, name="bn1")(h)
        h = nn.relu(h)
        h = nn.Conv(4, (3, 3), name="conv2")(h)
        h = nn.BatchNorm(use_running_average=False, name="bn2")(h)
        h = nn.relu(h + x)
        return nn.Dense(1, name="head")(h.mean(axis=(1, 2)))


class ScanLSTM(nn.Module):
    @nn.compact
    def __call__(self, xs):  # (batch, time, features)
        cell = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)(features=8)
        carry = (jnp.zeros((xs.shape[0], 8)), jnp.zeros((xs.shape[0], 8)))
        _, ys = cell(carry, xs)
        return nn.Dense(1, name="head")(ys[:, -1])


class MLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="fc2")(nn.gelu(nn.Dense(16, name="fc1")(x)))


class RematNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(MLPBlock)(name="block")(x)
        return nn.Dense(1, name="head")(x)


def _linen_case(name: str):
    r = _rng()
    if name == "attention":
        model, x = LinenAttention(), r.standard_normal((2, 5, 8))
    elif name == "resnet":
        model, x = ResNetBlock(), r.standard_normal((2, 6, 6, 4))
    elif name == "lstm":
        model, x = ScanLSTM(), r.standard_normal((2, 4, 3))
    else:
        model, x = RematNet(), r.standard_normal((4, 8))
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(r.standard_normal((x.shape[0], 1)), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    params = variables["params"]
    extra = {k: v for k, v in variables.items() if k != "params"}
    return model, params, extra, (x, y)


@pytest.mark.parametrize("policy", MODES)
@pytest.mark.parametrize("name", ["attention", "resnet", "lstm", "remat"])
def test_linen(name: str, policy: str) -> None:
    model, params, extra, batch = _linen_case(name)
    mutable = name == "resnet"
    report, final = check_model(f"linen {name}", linen_loss(model, mutable), params, extra,
                                batch, policy=policy)
    kinds = {d.op_kind for d in report.decisions}
    assert ("convolution" in kinds) == (name == "resnet")
    if mutable:  # batch_stats were updated through the rewritten step
        before = extra["batch_stats"]["bn1"]["mean"]
        after = final["batch_stats"]["bn1"]["mean"]
        assert after.shape == before.shape and not np.allclose(before, after)


@pytest.mark.parametrize("name, submodule", [
    ("attention", "attn"), ("resnet", "conv2"), ("lstm", "head"), ("remat", "fc1"),
])
def test_linen_scope_rule_keeps_exactly_that_submodule(name: str, submodule: str) -> None:
    model, params, extra, batch = _linen_case(name)
    step = make_step(linen_loss(model, name == "resnet"))
    amp = hlo_amp.compile(step, f"bf16,scope:{submodule}=float32")
    lowered = amp.lower(params, extra, TX.init(params), batch)
    report = lowered.report()
    inside = [d for d in report.decisions if submodule in d.scope.split("/")]
    outside = [d for d in report.decisions if submodule not in d.scope.split("/")]
    assert inside and outside, str(report)
    assert all(not d.low_precision and d.rule == f"scope:{submodule}" for d in inside)
    assert all(d.operands_after == ("f32", "f32") for d in inside)
    assert all(d.low_precision for d in outside), str(report)
    assert {d.direction for d in inside} == (
        {"forward", "backward", "recomputed"} if name == "remat" else {"forward", "backward"})
    assert report.unused_rules == []


# ---- Flax NNX -----------------------------------------------------------------------------


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, kernel_size=(3,), rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                           decode=False, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):  # (batch, length, 3)
        h = self.norm(nnx.relu(self.conv(x)))
        h = h + self.attn(h)
        return self.out(h.mean(axis=1))


@pytest.mark.parametrize("policy", MODES)
def test_nnx(policy: str) -> None:
    model = NNXNet(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    r = _rng(1)
    x = jnp.asarray(r.standard_normal((2, 6, 3)), jnp.float32)
    y = jnp.asarray(r.standard_normal((2, 1)), jnp.float32)

    def loss_fn(params, extra, batch):
        m = nnx.merge(graphdef, params)
        return jnp.mean((m(batch[0]) - batch[1]) ** 2), extra

    report, _ = check_model("nnx", loss_fn, params, {}, (x, y), policy=policy)
    assert {d.op_kind for d in report.decisions} == {"dot_general", "convolution"}


# ---- Equinox ------------------------------------------------------------------------------


class EqxNet(eqx.Module):
    conv: eqx.nn.Conv2d
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(2, 4, kernel_size=3, padding=1, key=k1)
        self.attn = eqx.nn.MultiheadAttention(num_heads=2, query_size=4, key=k2)
        self.mlp = eqx.nn.MLP(4, 1, width_size=8, depth=2, key=k3)

    def __call__(self, x):  # one example: (2, 4, 4)
        h = jax.nn.relu(self.conv(x))  # (4, 4, 4)
        tokens = h.reshape(4, -1).T  # (16, 4)
        if self.attn is not None:
            tokens = tokens + self.attn(tokens, tokens, tokens)
        return self.mlp(tokens.mean(axis=0))


def _equinox_case(use_attention: bool):
    model = EqxNet(jax.random.key(0))
    if not use_attention:
        model = eqx.tree_at(lambda m: m.attn, model, replace_fn=lambda a: None)
    params, static = eqx.partition(model, eqx.is_array)
    r = _rng(2)
    x = jnp.asarray(r.standard_normal((3, 2, 4, 4)), jnp.float32)
    y = jnp.asarray(r.standard_normal((3, 1)), jnp.float32)

    def loss_fn(params, extra, batch):
        m = eqx.combine(params, static)
        return jnp.mean((jax.vmap(m)(batch[0]) - batch[1]) ** 2), extra

    return loss_fn, params, (x, y)


@pytest.mark.parametrize("policy", MODES)
def test_equinox_conv_mlp(policy: str) -> None:
    loss_fn, params, batch = _equinox_case(use_attention=False)
    report, _ = check_model("equinox conv mlp", loss_fn, params, {}, batch, policy=policy)
    assert {d.op_kind for d in report.decisions} == {"dot_general", "convolution"}


@pytest.mark.parametrize("policy", MODES)
def test_equinox_with_attention(policy: str) -> None:
    # Regression: the attention backward dots once failed at run time on XLA:CPU with
    # "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32".
    loss_fn, params, batch = _equinox_case(use_attention=True)
    report, _ = check_model("equinox attention", loss_fn, params, {}, batch, policy=policy)
    assert {d.op_kind for d in report.decisions} == {"dot_general", "convolution"}
