"""Train steps written the way each framework writes them, with dropout and RNG state.

Each model carries a typed PRNG key (``jax.random.key``) or ``nnx.Rngs`` and trains a few
steps under bf16, mixed_bfloat16, f16 (with the dynamic loss scaler in every step) and
fp8; its losses are compared with the same step under f32 ``jax.jit`` (``nnx.jit``,
``eqx.filter_jit`` for those frameworks), and the report shows the dots in the mode's
precision. Under the f32 preset every model's losses and final state are bit-identical to
the framework's own jit. These are the tests that would have caught the typed-key
regression (issue 18).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from host_devices import host_devices_env

import hlo_amp

STEPS = 3
WIDTH, CLASSES, BATCH = 32, 10, 16
MODES = ("bf16", "mixed_bfloat16", "f16", "fp8")
# Loss after STEPS steps against f32 jax.jit, relative (dropout masks are identical: the
# RNG is integer arithmetic, which no policy touches).
LOSS_RTOL = {"bf16": 5e-2, "mixed_bfloat16": 5e-2, "f16": 1e-2, "fp8": 1.5e-1}
TX = optax.adamw(1e-2)


def _batch(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32)
    return x, jnp.arange(BATCH) % CLASSES


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _key_data(tree: Any) -> Any:
    """Typed keys as their raw bits, so trees compare with numpy."""
    return jax.tree.map(lambda a: jax.random.key_data(a)
                        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, tree)


def _assert_bit_equal(a: Any, b: Any) -> None:
    jax.tree.map(np.testing.assert_array_equal, _key_data(a), _key_data(b))


def _scaled_update(loss_fn: Callable, params: Any, opt_state: Any, scaler: Any,
                   *args: Any) -> tuple:
    """One optimizer step through the dynamic loss scaler; a step whose gradients are not
    finite leaves params and optimizer state as they were."""
    scaler, ((loss, aux), grads) = hlo_amp.dynamic_scale_value_and_grad(
        loss_fn, has_aux=True)(params, *args, dynamic_scaler_state=scaler)
    updates, new_opt_state = TX.update(grads, opt_state, params)
    finite = hlo_amp.all_finite(grads)
    params = hlo_amp.select_tree(finite, optax.apply_updates(params, updates), params)
    opt_state = hlo_amp.select_tree(finite, new_opt_state, opt_state)
    return params, opt_state, scaler, loss, aux


# ---- the models, as each framework's users write them -----------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(WIDTH, name="fc1")(x))
        x = nn.Dropout(0.1, deterministic=False)(x)
        x = nn.relu(nn.Dense(WIDTH, name="fc2")(x))
        return nn.Dense(CLASSES, name="head")(x)


def linen_case() -> tuple[Callable, Callable, Callable, tuple]:
    """Flax Linen, the dropout key in the batch (``rngs={"dropout": key}``)."""
    model = LinenMLP()
    x, y = _batch()
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, batch):
        logits = model.apply(params, batch["x"], rngs={"dropout": batch["key"]})
        return _cross_entropy(logits, batch["y"]), None

    def step(params, opt_state, scaler, batch):
        params, opt_state, scaler, loss, _ = _scaled_update(loss_fn, params, opt_state,
                                                           scaler, batch)
        return params, opt_state, scaler, loss

    def run(jit: Callable) -> tuple[list[float], Any]:
        state = (params, TX.init(params), hlo_amp.DynamicScalerState())
        key, losses = jax.random.key(7), []
        compiled = jit(step)
        for _ in range(STEPS):
            key, sub = jax.random.split(key)
            *state, loss = compiled(*state, {"x": x, "y": y, "key": sub})
            losses.append(float(loss))
        return losses, state[0]

    return run, jax.jit, step, (params, TX.init(params), hlo_amp.DynamicScalerState(),
                                {"x": x, "y": y, "key": jax.random.key(1)})


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.BatchNorm(WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.fc2 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(self.drop(nnx.relu(self.norm(self.fc1(x)))))


class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _nnx_model_and_optimizer() -> tuple[NnxModel, nnx.Optimizer]:
    model = NnxModel(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def nnx_step(model: NnxModel, optimizer: nnx.Optimizer, scaler: Any, x: jax.Array,
             y: jax.Array) -> tuple[jax.Array, Any]:
    """The NNX guide's stateful step, its gradient taken through the loss scaler."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest):
        inner = nnx.merge(graphdef, params, rest, copy=True)  # new Variables in this trace
        return _cross_entropy(inner(x), y), nnx.state(inner, nnx.Not(nnx.Param))

    scaler, ((loss, rest), grads) = hlo_amp.dynamic_scale_value_and_grad(
        loss_fn, has_aux=True)(params, rest, dynamic_scaler_state=scaler)
    nnx.update(model, rest)  # RNG counters and batch statistics
    finite = hlo_amp.all_finite(grads)
    optimizer.update(model, jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads))
    return loss, scaler


def nnx_case() -> tuple[Callable, Callable, Callable, tuple]:
    """Flax NNX, stateful: nnx.Rngs, nnx.Dropout, nnx.BatchNorm, nnx.Optimizer."""
    x, y = _batch()

    def run(jit: Callable) -> tuple[list[float], Any]:
        model, optimizer = _nnx_model_and_optimizer()
        compiled, scaler, losses = jit(nnx_step), hlo_amp.DynamicScalerState(), []
        for _ in range(STEPS):
            loss, scaler = compiled(model, optimizer, scaler, x, y)
            losses.append(float(loss))
        return losses, nnx.state((model, optimizer))

    model, optimizer = _nnx_model_and_optimizer()
    return run, nnx.jit, nnx_step, (model, optimizer, hlo_amp.DynamicScalerState(), x, y)


def nnx_functional_case() -> tuple[Callable, Callable, Callable, tuple]:
    """Flax NNX, functional: nnx.split the objects, a pure step over the state."""
    x, y = _batch()
    graphdef, state = nnx.split(_nnx_model_and_optimizer())

    def step(state, scaler, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, scaler = nnx_step(model, optimizer, scaler, x, y)
        return nnx.state((model, optimizer)), scaler, loss

    def run(jit: Callable) -> tuple[list[float], Any]:
        compiled, current, scaler, losses = jit(step), state, hlo_amp.DynamicScalerState(), []
        for _ in range(STEPS):
            current, scaler, loss = compiled(current, scaler, x, y)
            losses.append(float(loss))
        return losses, current

    return run, jax.jit, step, (state, hlo_amp.DynamicScalerState(), x, y)


class EqxMLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    head: eqx.nn.Linear
    drop: eqx.nn.Dropout
    activation: Callable = eqx.field(static=False)  # a function leaf: static under filtering
    depth: int = 3

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.fc1 = eqx.nn.Linear(WIDTH, WIDTH, key=k1)
        self.fc2 = eqx.nn.Linear(WIDTH, WIDTH, key=k2)
        self.head = eqx.nn.Linear(WIDTH, CLASSES, key=k3)
        self.drop = eqx.nn.Dropout(0.1, inference=False)
        self.activation = jax.nn.relu

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        x = self.drop(self.activation(self.fc1(x)), key=key)
        return self.head(self.activation(self.fc2(x)))


def eqx_case() -> tuple[Callable, Callable, Callable, tuple]:
    """Equinox: non-array leaves (a function, an int, Dropout's flag), a key argument."""
    x, y = _batch()
    model = EqxMLP(jax.random.key(0))

    def loss_fn(model, x, y, key):
        logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
        return _cross_entropy(logits, y), None

    def step(model, opt_state, scaler, x, y, key):
        params, static = eqx.partition(model, eqx.is_array)
        params, opt_state, scaler, loss, _ = _scaled_update(
            lambda p, *a: loss_fn(eqx.combine(p, static), *a), params, opt_state, scaler,
            x, y, key)
        return eqx.combine(params, static), opt_state, scaler, loss

    def run(jit: Callable) -> tuple[list[float], Any]:
        state = (model, TX.init(eqx.filter(model, eqx.is_array)), hlo_amp.DynamicScalerState())
        key, losses, compiled = jax.random.key(7), [], jit(step)
        for _ in range(STEPS):
            key, sub = jax.random.split(key)
            *state, loss = compiled(*state, x, y, sub)
            losses.append(float(loss))
        assert state[0].activation is jax.nn.relu and state[0].depth == 3
        return losses, eqx.filter(state[0], eqx.is_array)

    return run, eqx.filter_jit, step, (model, TX.init(eqx.filter(model, eqx.is_array)),
                                       hlo_amp.DynamicScalerState(), x, y, jax.random.key(1))


def _haiku_forward(x: jax.Array) -> jax.Array:
    x = jax.nn.relu(hk.Linear(WIDTH, name="fc1")(x))
    x = hk.dropout(hk.next_rng_key(), 0.1, x)
    x = jax.nn.relu(hk.Linear(WIDTH, name="fc2")(x))
    return hk.Linear(CLASSES, name="head")(x)


def haiku_case() -> tuple[Callable, Callable, Callable, tuple]:
    """Haiku: hk.next_rng_key() inside, the typed key given to apply."""
    forward = hk.transform(_haiku_forward)
    x, y = _batch()
    params = forward.init(jax.random.key(0), x)

    def loss_fn(params, key, x, y):
        return _cross_entropy(forward.apply(params, key, x), y), None

    def step(params, opt_state, scaler, key, x, y):
        params, opt_state, scaler, loss, _ = _scaled_update(loss_fn, params, opt_state,
                                                           scaler, key, x, y)
        return params, opt_state, scaler, loss

    def run(jit: Callable) -> tuple[list[float], Any]:
        state = (params, TX.init(params), hlo_amp.DynamicScalerState())
        sequence, losses, compiled = hk.PRNGSequence(jax.random.key(7)), [], jit(step)
        for _ in range(STEPS):
            *state, loss = compiled(*state, next(sequence), x, y)
            losses.append(float(loss))
        return losses, state[0]

    return run, jax.jit, step, (params, TX.init(params), hlo_amp.DynamicScalerState(),
                                jax.random.key(1), x, y)


CASES = {"linen": linen_case, "nnx": nnx_case, "nnx_functional": nnx_functional_case,
         "equinox": eqx_case, "haiku": haiku_case}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], Any]]:
    """Each model trained with its framework's own f32 jit."""
    found = {}
    for name, case in CASES.items():
        run, framework_jit, _, _ = case()
        found[name] = run(framework_jit)
    return found


@pytest.mark.parametrize("name", CASES)
def test_f32_preset_is_bit_identical_to_the_framework_jit(name, references):
    run, _, _, _ = CASES[name]()
    losses, state = run(lambda step: hlo_amp.compile(step, "f32"))
    want_losses, want_state = references[name]
    assert losses == want_losses
    _assert_bit_equal(state, want_state)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
def test_trains_in_every_mode_like_f32(name, mode, references):
    run, _, _, _ = CASES[name]()
    losses, _state = run(lambda step: hlo_amp.compile(step, mode))
    want_losses, _ = references[name]
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL[mode])
    assert losses[-1] < losses[0] * 1.05  # it trains, at least does not diverge
    _, _, step, args = CASES[name]()
    report = hlo_amp.compile(step, mode).lower(*args).report()
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    assert len(dots) >= 8  # 3 forward, 3 weight gradients, 2 input gradients (not of x)
    if mode == "fp8":
        assert sum(d.fp8 for d in dots) >= 3  # the middle layer, forward and backward
        assert all(d.low_precision for d in dots)  # first/last matrix op bf16 by the preset
    else:
        assert all(d.low_precision for d in dots), [d for d in dots if not d.low_precision]


def test_nnx_rng_counters_and_batch_stats_advance_as_under_nnx_jit():
    x, y = _batch()
    want_model, want_opt = _nnx_model_and_optimizer()
    got_model, got_opt = _nnx_model_and_optimizer()
    step, reference = hlo_amp.compile(nnx_step, "bf16"), nnx.jit(nnx_step)
    scaler = hlo_amp.DynamicScalerState()
    for _ in range(2):
        reference(want_model, want_opt, scaler, x, y)
        step(got_model, got_opt, scaler, x, y)
    _assert_bit_equal(nnx.state(got_model, nnx.RngState), nnx.state(want_model, nnx.RngState))
    counts = nnx.state(got_model, nnx.RngCount)
    assert all(int(c) == 2 for c in jax.tree.leaves(counts))  # one dropout draw per step
    assert int(got_opt.step[...]) == 2
    mean = got_model.blocks[0].norm.mean[...]
    assert not np.allclose(mean, 0.0)  # batch statistics were written back
    np.testing.assert_allclose(mean, want_model.blocks[0].norm.mean[...], rtol=5e-2, atol=1e-2)


@pytest.mark.parametrize("how", ["context", "decorated"])
def test_nnx_tree_mode_steps_run_as_under_nnx_jit(how):
    """``nnx.set_graph_mode(False)`` or ``nnx.jit(step, graph=False)``: nnx.jit hands its
    inner function the modules themselves, which made that function an NNX call of its
    own, without end (RecursionError under the context; decorated, it ran a second,
    graph-mode nnx.jit inside)."""
    import contextlib

    class Net(nnx.Module):
        def __init__(self) -> None:
            self.linear = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(8, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.norm(self.linear(x))

    def step(model: Net, x: jax.Array) -> jax.Array:
        return jnp.mean(model(x) ** 2)

    x = jax.random.normal(jax.random.key(0), (8, 8))
    mode = nnx.set_graph_mode(False) if how == "context" else contextlib.nullcontext()
    given = step if how == "context" else nnx.jit(step, graph=False)
    want_model, got_model = Net(), Net()
    with mode:
        want = (nnx.jit(step) if how == "context" else given)(want_model, x)
        compiled = hlo_amp.compile(given, "bf16")
        got = compiled(got_model, x)
    np.testing.assert_allclose(got, want, rtol=2e-2)
    mean = got_model.norm.mean[...]
    assert not np.allclose(mean, 0.0)  # the batch statistics were written back
    np.testing.assert_allclose(mean, want_model.norm.mean[...], rtol=2e-2, atol=1e-3)
    inner = compiled._framework_calls["nnx"].inner
    assert inner._framework_calls == {}  # no framework call inside the framework call


def test_compiled_ahead_of_time_takes_the_callers_objects_as_the_framework_jit_does():
    """``step.lower(model, ...).compile()(model, ...)``, as nnx.jit's and eqx.filter_jit's
    compiled steps are called; it asked for their inner pure state ("seen NodeStates")."""
    x, y = _batch()
    scaler = hlo_amp.DynamicScalerState()
    want_model, want_opt = _nnx_model_and_optimizer()
    got_model, got_opt = _nnx_model_and_optimizer()
    reference = nnx.jit(nnx_step).lower(want_model, want_opt, scaler, x, y).compile()
    compiled = hlo_amp.compile(nnx_step, "f32").lower(got_model, got_opt, scaler, x, y).compile()
    for _ in range(2):  # the objects are updated in place, as under nnx.jit
        want = reference(want_model, want_opt, scaler, x, y)
        got = compiled(got_model, got_opt, scaler, x, y)
    _assert_bit_equal(got, want)
    _assert_bit_equal(nnx.state((got_model, got_opt)), nnx.state((want_model, want_opt)))
    assert int(got_opt.step[...]) == 2
    assert (hlo_amp.compile(nnx_step, "bf16").eval_shape(got_model, got_opt, scaler, x, y)
            == nnx.jit(nnx_step).eval_shape(want_model, want_opt, scaler, x, y))
    assert int(got_opt.step[...]) == 2  # eval_shape changes nothing

    model = EqxMLP(jax.random.key(0))

    def apply(model: EqxMLP, x: jax.Array) -> tuple[jax.Array, str]:
        return jax.vmap(lambda row: model(row, jax.random.key(3)))(x), "static out"

    want = eqx.filter_jit(apply).lower(model, x).compile()(model, x)
    got = hlo_amp.compile(apply, "f32").lower(model, x).compile()(model, x)
    _assert_bit_equal(got[0], want[0])
    assert got[1] == want[1]
    assert hlo_amp.compile(apply, "bf16").eval_shape(model, x) == eqx.filter_eval_shape(
        apply, model, x)


def test_nnx_shared_references_stay_shared_and_outputs_come_back_as_nnx_jit_returns():
    shared = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
    pair = nnx.List([shared, shared])  # one module twice

    def step(pair, other):
        pair[0].kernel[...] = pair[0].kernel[...] * 2.0
        return pair[1], {"sum": other.kernel[...].sum()}

    want_pair = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))] * 2)
    want_out = nnx.jit(step)(want_pair, want_pair[0])
    got_out = hlo_amp.compile(step, "bf16")(pair, shared)
    assert pair[0] is pair[1] is shared  # the caller's objects, updated in place
    np.testing.assert_array_equal(shared.kernel[...], want_pair[0].kernel[...])
    assert isinstance(got_out[0], nnx.Linear) and type(got_out[0]) is type(want_out[0])
    np.testing.assert_array_equal(got_out[0].kernel[...], want_out[0].kernel[...])
    np.testing.assert_array_equal(got_out[1]["sum"], want_out[1]["sum"])


def test_nnx_scope_rules_name_instance_paths_without_a_wrapper():
    model, optimizer = _nnx_model_and_optimizer()
    x, y = _batch()
    step = hlo_amp.compile(nnx_step, "bf16,scope:blocks/1/fc1=float32")
    report = step.lower(model, optimizer, hlo_amp.DynamicScalerState(), x, y).report()
    scoped = {d.scope: d for d in report.decisions if d.op_kind == "dot_general"}
    assert {"blocks/0/fc1", "blocks/1/fc1", "blocks/1/fc2", "head"} <= set(scoped)
    for decision in report.decisions:
        if decision.op_kind == "dot_general":
            assert decision.low_precision == (decision.scope != "blocks/1/fc1"), decision
    # lowering did not touch the caller's objects
    assert all(int(c) == 0 for c in jax.tree.leaves(nnx.state(model, nnx.RngCount)))


def test_decorator_with_a_policy_static_and_donated_arguments():
    @hlo_amp.compile(policy="mixed_bfloat16", static_argnums=3, donate_argnums=1)
    def step(model, optimizer, x, scale):
        def loss_fn(model):
            return (model(x) * scale).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit(static_argnums=3, donate_argnums=1)
    def reference(model, optimizer, x, scale):
        return step.fn(model, optimizer, x, scale)

    x, _ = _batch()
    model, optimizer = _nnx_model_and_optimizer()
    want_model, want_optimizer = _nnx_model_and_optimizer()
    for scale in (1.0, 2.0, 2.0):
        got = step(model, optimizer, x, scale)
        want = reference(want_model, want_optimizer, x, scale)
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=1e-3)
    assert step.cache_size() == 2  # one executable per static value
    assert isinstance(hlo_amp.compile("bf16")(nnx_step), hlo_amp.AmpFunction)


def test_equinox_module_passes_straight_in_and_filter_is_automatic():
    model = EqxMLP(jax.random.key(0))
    x, _ = _batch()

    def forward(model, x, key):
        return jax.vmap(model)(x, jax.random.split(key, x.shape[0])), model

    out, same = hlo_amp.compile(forward, "f32")(model, x, jax.random.key(3))
    want, _ = eqx.filter_jit(forward)(model, x, jax.random.key(3))
    np.testing.assert_array_equal(out, want)
    assert same.activation is jax.nn.relu and same.depth == 3 and same.drop.inference is False
    # filter=True treats a Python int as static (a new value recompiles), as filter_jit does
    counted = hlo_amp.compile(lambda x, n: x * n, "f32", filter=True)
    assert float(counted(jnp.float32(2.0), 3)) == 6.0
    assert float(counted(jnp.float32(2.0), 4)) == 8.0
    assert counted.cache_size() == 2
    # without it, jax.jit's meaning: the int is traced, one executable
    traced = hlo_amp.compile(lambda x, n: x * n, "f32")
    traced(jnp.float32(2.0), 3)
    traced(jnp.float32(2.0), 4)
    assert traced.cache_size() == 1


def test_an_equinox_model_compiled_itself_lowers_and_traces():
    """hlo_amp.compile(model) of an Equinox module (or its bound method, a module too):
    called, it ran; .lower() and .trace() raised "unhashable type" from the module's
    hash, which jax.jit's caches ask for."""
    model = EqxMLP(jax.random.key(0))
    x, _ = _batch()
    forward = hlo_amp.compile(model.__call__, "bf16")
    for fn in (hlo_amp.compile(model, "bf16"), forward):
        key = jax.random.key(3)
        assert fn.lower(x[0], key).report().decisions
        assert fn.trace(x[0], key).out_info.shape == model(x[0], key).shape
        np.testing.assert_array_equal(fn.lower(x[0], key).compile()(x[0], key), fn(x[0], key))


def test_a_jax_jit_step_with_static_arguments_takes_an_equinox_model():
    """A @jax.jit step with static_argnums given an Equinox module runs as jax.jit runs
    it: it was refused ("static_argnums ... and filtered arguments do not mix"), with
    advice no decorated step could follow. A static argument holding arrays is refused,
    naming it."""
    model = eqx.nn.Linear(4, 4, key=jax.random.key(0))  # arrays and ints: jax.jit takes it
    x = jax.random.normal(jax.random.key(1), (2, 4))

    @functools.partial(jax.jit, static_argnums=2)
    def step(model, x, mode):
        y = jax.vmap(model)(x)
        return y.sum() if mode == "sum" else y.mean()

    for compiled in (hlo_amp.compile(step, "f32"),
                     hlo_amp.compile(step.__wrapped__, "f32", static_argnums=2)):
        for mode in ("sum", "mean", "sum"):
            np.testing.assert_allclose(compiled(model, x, mode), step(model, x, mode),
                                       rtol=1e-5)
        assert compiled.cache_size() == 2
        with pytest.raises(TypeError, match=r"static argument 2 \(parameter mode\) holds a jax.Array"):
            compiled(model, x, jnp.ones(2))


def test_an_eqx_error_if_raises_equinoxs_own_error(capfd):
    """eqx.error_if in a step taking an Equinox module: its message is Equinox's
    EquinoxRuntimeError, as under eqx.filter_jit (it was jax's raw callback error, the
    message inside a long traceback, and Equinox's advice to use filter_jit on stderr)."""
    class Model(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    def step(model, x):
        x = eqx.error_if(x, jnp.any(x < 0), "negative input!")
        for _ in range(20):  # work after the check: the call returned before it ended
            x = jnp.tanh(model(x))
        return x.sum()

    compiled, model = hlo_amp.compile(step, "bf16"), Model(jnp.ones((512, 512)) / 512)
    assert np.isfinite(float(compiled(model, jnp.ones((512, 512)))))
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative input!"):
        compiled(model, -jnp.ones((512, 512)))
    assert "do not appear to be using `equinox.filter_jit`" not in capfd.readouterr().err


# ---- steps already decorated with the framework's jit (issue 33) -------------------------


@nnx.jit(static_argnames="updates", donate_argnums=1)
def nnx_guide_step(model: NnxModel, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array,
                   updates: int = 1) -> jax.Array:
    """The NNX guide's step with its decorator kept; ``updates`` is static (a Python loop)."""
    def loss_fn(model):
        return _cross_entropy(model(x), y)

    for _ in range(updates):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
    return loss


def _eqx_loss(model: EqxMLP, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    return _cross_entropy(jax.vmap(model)(x, jax.random.split(key, x.shape[0])), y)


@eqx.filter_jit(donate="all-except-first")
def eqx_guide_step(batch: tuple, model: EqxMLP, opt_state: Any) -> tuple:
    """Equinox's idiom: the batch first, kept; the model and optimizer state donated."""
    x, y, key = batch
    loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y, key)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def _train_nnx(step: Callable) -> tuple[list[float], Any]:
    model, optimizer = _nnx_model_and_optimizer()
    x, y = _batch()
    kernel, count = model.head.kernel[...], optimizer.step[...]
    losses = [float(step(model, optimizer, x, y, updates=1)) for _ in range(2)]
    assert not np.allclose(model.head.kernel[...], kernel)  # the caller's model, in place
    assert int(optimizer.step[...]) == 2
    assert count.is_deleted()  # donate_argnums=1 of @nnx.jit: the optimizer's old state
    return losses, nnx.state((model, optimizer))


def _train_eqx(step: Callable) -> tuple[list[float], Any]:
    model = EqxMLP(jax.random.key(0))
    opt_state = TX.init(eqx.filter(model, eqx.is_array))
    x, y = _batch()
    losses = []
    for seed in range(2):
        first = model.fc1.weight
        model, opt_state, loss = step((x, y, jax.random.key(seed)), model, opt_state)
        losses.append(float(loss))
        assert first.is_deleted()  # donate="all-except-first": the model was donated
    assert not x.is_deleted()  # the batch was not
    assert model.activation is jax.nn.relu and model.depth == 3  # non-array leaves
    return losses, eqx.filter(model, eqx.is_array)


# Each decorated step, how it trains, and the decorator's options as hlo_amp.compile's
DECORATED = {"nnx.jit": (nnx_guide_step, _train_nnx,
                         {"static_argnames": "updates", "donate_argnums": 1}),
             "eqx.filter_jit": (eqx_guide_step, _train_eqx, {"donate_argnums": (1, 2)})}


def _decorated_args(name: str) -> tuple[tuple, dict]:
    if name == "nnx.jit":
        return (*_nnx_model_and_optimizer(), *_batch()), {"updates": 1}
    model = EqxMLP(jax.random.key(0))
    return ((*_batch(), jax.random.key(0)), model, TX.init(eqx.filter(model, eqx.is_array))), {}


@pytest.fixture(scope="module")
def undecorated_runs() -> dict[str, tuple[list[float], Any]]:
    """The decorated steps' wrapped functions compiled under bf16, and the NNX step under
    its own f32 ``nnx.jit``."""
    found = {name: train(hlo_amp.compile(decorated.__wrapped__, "bf16", **options))
             for name, (decorated, train, options) in DECORATED.items()}
    found["nnx.jit f32"] = _train_nnx(nnx_guide_step)
    return found


@pytest.mark.parametrize("name", DECORATED)
def test_a_decorated_step_compiles_as_the_step_it_wraps(name, undecorated_runs):
    """``hlo_amp.compile(decorated)`` (and ``@hlo_amp.compile`` stacked above the
    decorator, the same call) runs the wrapped step with the decorator's static and
    donated arguments: the undecorated step's program, losses, updates and report."""
    decorated, train, options = DECORATED[name]
    compiled = hlo_amp.compile(policy="bf16")(decorated)
    losses, state = train(compiled)
    want_losses, want_state = undecorated_runs[name]
    assert losses == want_losses
    _assert_bit_equal(state, want_state)
    args, kwargs = _decorated_args(name)
    report = compiled.lower(*args, **kwargs).report()
    undecorated = hlo_amp.compile(decorated.__wrapped__, "bf16", **options)
    assert report.decisions == undecorated.lower(*args, **kwargs).report().decisions
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    assert len(dots) >= 8 and all(d.low_precision for d in dots)
    assert {d.function for d in dots} == {"main"}  # no inner jit left around the step


def test_a_compiled_step_inside_the_framework_jit_still_runs_rewritten(undecorated_runs):
    """The reverse nesting, ``nnx.jit(hlo_amp.compile(step))``: the compiled step binds
    its rewritten program inside the outer jit."""
    step = hlo_amp.compile(nnx_guide_step.__wrapped__, "bf16", static_argnames="updates")
    losses, _ = _train_nnx(nnx.jit(step, static_argnames="updates", donate_argnums=1))
    np.testing.assert_allclose(losses, undecorated_runs["nnx.jit"][0], rtol=1e-6)
    f32_losses = undecorated_runs["nnx.jit f32"][0]
    np.testing.assert_allclose(losses, f32_losses, rtol=LOSS_RTOL["bf16"])
    assert not np.allclose(losses, f32_losses, rtol=1e-6, atol=0)  # bf16, not f32


def test_a_jax_jit_decorated_function_keeps_its_static_and_donated_arguments():
    @jax.jit(static_argnums=2, donate_argnums=0)
    def scaled(w, x, scale):
        return w * 0.5, jnp.tanh(x @ w) * scale

    w = W + 0.0
    new_w, out = hlo_amp.compile(scaled, "bf16")(w, X, 3)
    assert w.is_deleted()  # donated, as the decorator asked
    np.testing.assert_array_equal(new_w, W * 0.5)
    np.testing.assert_allclose(out, jnp.tanh(X @ W) * 3, rtol=5e-2, atol=5e-2)
    report = hlo_amp.compile(scaled, "bf16").lower(W, X, 3).report()
    assert [(d.function, d.low_precision) for d in report.decisions] == [("main", True)]


def test_a_filtered_argument_donated_by_position_is_donated_by_keyword_too():
    """As jax.jit: ``donate_argnums=0`` donates the first parameter however it is
    passed. An Equinox module (or ``filter=True``) passed by keyword was not donated."""
    def step(model: Any, x: jax.Array) -> tuple[Any, jax.Array]:
        scaled = jax.tree.map(lambda a: a * 0.9 if eqx.is_array(a) else a, model)
        return scaled, jnp.sum(jax.vmap(model)(x))

    compiled = hlo_amp.compile(step, "bf16", donate_argnums=0)
    x = jnp.ones((4, 8))
    for call in (lambda m: compiled(m, x), lambda m: compiled(model=m, x=x)):
        model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
        weight = model.weight
        call(model)
        assert weight.is_deleted()
    assert not x.is_deleted()


def test_a_donated_keyword_only_argument_gets_advice_that_works():
    """hlo_amp.compile donates by position: the error says to make the argument
    positional (it said to replace the decorator, which cannot donate it either)."""
    @jax.jit(donate_argnames="w")
    def scaled(x, *, w):
        return jnp.tanh(x @ w)

    with pytest.raises(TypeError, match=r"keyword-only argument\(s\) \['w'\].*donate them "
                                        r"by position") as error:
        hlo_amp.compile(scaled, "bf16")
    assert "replace @jax.jit" not in str(error.value)


def test_a_jax_jit_with_shardings_keeps_its_static_and_donated_arguments():
    # Compiled nested (its shardings apply there); its static and donated arguments
    # apply at the top, as for a jit without shardings.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def scaled(w, x, scale):
        return w * 0.5, jnp.tanh(x @ w) * scale

    jitted = jax.jit(scaled, static_argnums=2, donate_argnums=0,
                     in_shardings=(sharded, sharded), out_shardings=sharded)
    w = W + 0.0
    new_w, out = hlo_amp.compile(jitted, "bf16")(w, X, 3)
    assert w.is_deleted()  # donated, as the jit asked
    assert all(a.sharding.is_equivalent_to(sharded, a.ndim) for a in (new_w, out))
    np.testing.assert_array_equal(new_w, W * 0.5)
    np.testing.assert_allclose(out, jnp.tanh(X @ W) * 3, rtol=5e-2, atol=5e-2)


# ---- typed keys on every path -----------------------------------------------------------


def _dropout_layer(key: jax.Array, w: jax.Array, x: jax.Array) -> jax.Array:
    keep = jax.random.bernoulli(key, 0.9, (x.shape[0], w.shape[1]))
    return jnp.tanh(x @ w) * keep


W = jnp.asarray(np.random.default_rng(1).standard_normal((WIDTH, 24)) / 8, jnp.float32)
X = _batch()[0]


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_as_arguments_outputs_and_in_pytrees_bit_identical_under_f32(impl):
    key = jax.random.key(0, impl=impl)

    def step(state, x):
        key, sub = jax.random.split(state["key"])
        keys = jax.random.split(sub, 3)  # an array of keys, returned too
        y = sum(_dropout_layer(k, state["w"], x) for k in keys)
        return {"key": key, "w": state["w"] * 0.5, "keys": keys}, y

    state = {"key": key, "w": W}
    want = jax.jit(step)(state, X)
    got = hlo_amp.compile(step, "f32")(state, X)
    _assert_bit_equal(got, want)
    assert got[0]["key"].dtype == key.dtype and got[0]["keys"].shape == (3,)
    low = hlo_amp.compile(step, "bf16")(state, X)
    _assert_bit_equal(low[0]["keys"], want[0]["keys"])  # keys are never converted
    np.testing.assert_allclose(low[1], want[1], rtol=5e-2, atol=5e-2)


def test_typed_keys_under_vmap_grad_jvp_and_jit():
    keys = jax.random.split(jax.random.key(0), 4)
    amp = hlo_amp.compile(_dropout_layer, "f32")
    _assert_bit_equal(jax.vmap(amp, in_axes=(0, None, None))(keys, W, X),
                      jax.vmap(jax.jit(_dropout_layer), in_axes=(0, None, None))(keys, W, X))
    _assert_bit_equal(jax.jit(amp)(keys[0], W, X), jax.jit(_dropout_layer)(keys[0], W, X))

    def loss(f):
        return lambda key, w: f(key, w, X).sum()

    # reverse mode runs a forward and a backward program, as jax.grad of a jitted f does
    grads = jax.grad(loss(amp), argnums=(0, 1), allow_int=True)(keys[0], W)
    want = jax.grad(loss(jax.jit(_dropout_layer)), argnums=(0, 1), allow_int=True)(keys[0], W)
    assert grads[0].dtype == jax.dtypes.float0 == want[0].dtype  # the key's cotangent
    np.testing.assert_array_equal(grads[1], want[1])
    out, tangent = jax.jvp(lambda w: amp(keys[1], w, X), (W,), (W,))
    want_out, want_tangent = jax.jvp(lambda w: jax.jit(_dropout_layer)(keys[1], w, X), (W,),
                                     (W,))
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_allclose(tangent, want_tangent, rtol=1e-6)
    # a key as residual and output of a differentiated function
    pair = hlo_amp.compile(lambda w, k: (_dropout_layer(k, w, X).sum(), jax.random.split(k)),
                           "bf16")
    (_value, split), vjp = jax.vjp(pair, W, keys[2])
    dw, dk = vjp((jnp.float32(1.0), np.zeros(split.shape, jax.dtypes.float0)))
    assert dk.dtype == jax.dtypes.float0 and dw.shape == W.shape
    _assert_bit_equal(split, jax.random.split(keys[2]))


def test_typed_keys_with_donation_and_lower():
    def step(state, x):
        key, sub = jax.random.split(state["key"])
        return {"key": key, "w": state["w"] + 1.0}, _dropout_layer(sub, state["w"], x)

    amp = hlo_amp.compile(step, "bf16", donate_argnums=0)
    state = {"key": jax.random.key(0), "w": W + 0.0}
    want_state, want_out = jax.jit(step)({"key": jax.random.key(0), "w": W + 0.0}, X)
    new_state, out = amp(state, X)
    np.testing.assert_allclose(out, want_out, rtol=5e-2, atol=5e-2)
    assert state["w"].is_deleted()  # donated, as under jax.jit
    _assert_bit_equal(new_state["key"], want_state["key"])
    lowered = amp.lower(new_state, X)
    assert "bf16" in lowered.as_text()
    compiled = lowered.compile()
    again, _ = compiled(new_state, X)
    assert again["key"].dtype == want_state["key"].dtype


def test_typed_keys_through_compare_and_module_scopes():
    comparison = hlo_amp.compare(_dropout_layer, "bf16", jax.random.key(0), W, X)
    assert comparison.ok and comparison.error > 0  # bf16 differs, within its tolerance
    model = NnxModel(nnx.Rngs(0, dropout=jax.random.key(1)))
    graphdef, state = nnx.split(model)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    with hlo_amp.module_scopes(model):
        lowered = hlo_amp.compile(forward, "bf16,scope:head=float32").lower(state, X)
    head = [d for d in lowered.report().decisions if d.scope == "head"]
    assert head and not any(d.low_precision for d in head)


def _two_scopes(key: jax.Array, w: jax.Array, x: jax.Array) -> jax.Array:
    with jax.named_scope("a"):
        hidden = jnp.tanh(x @ w)
    with jax.named_scope("b"):
        hidden = hidden @ w.T
    return hidden * jax.random.bernoulli(key, 0.9, hidden.shape)


def test_typed_keys_through_attribute_and_autopolicy():
    attribution = hlo_amp.attribute(_two_scopes, "bf16", jax.random.key(0), W, X, depth=1)
    assert sorted(attribution.ranking) == ["a", "b"]
    found = hlo_amp.autopolicy(_two_scopes, jax.random.key(0), W, X, budget=1e-1, depth=1)
    assert found.policy.compute_dtype == "bfloat16"


def test_typed_keys_on_the_fallback_path_for_host_callbacks():
    """jax.export refuses host callbacks; such functions go through jax.jit's lowering."""
    seen = []

    def with_callback(key, w, x):
        jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
        return _two_scopes(key, w, x)

    key = jax.random.key(3)
    amp = hlo_amp.compile(with_callback, "f32")
    np.testing.assert_array_equal(amp(key, W, X), jax.jit(with_callback)(key, W, X))
    assert amp._through_lowering and len(seen) == 2
    low = hlo_amp.compile(with_callback, "bf16")
    np.testing.assert_allclose(low(key, W, X), jax.jit(with_callback)(key, W, X),
                               rtol=5e-2, atol=5e-2)
    with pytest.warns(UserWarning, match="runs unchanged"):  # as documented for callbacks
        grads = jax.grad(lambda w: low(key, w, X).sum())(W)
    np.testing.assert_allclose(grads, jax.grad(lambda w: _two_scopes(key, w, X).sum())(W),
                               rtol=5e-2, atol=5e-2)


# ---- errors a user can act on -----------------------------------------------------------


class _Config:
    pass


class _NnxWithFunctionData(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(W)
        self.act = nnx.data(jax.nn.relu)


class _ArrayLike:
    """As a Keras Variable: jax converts it through __jax_array__, but not when it traces
    (jax.typeof raises a ValueError, which the argument check let through: jax's error,
    chained to hlo_amp's)."""

    def __init__(self, value: jax.Array) -> None:
        self.value = value

    def __jax_array__(self) -> jax.Array:
        return self.value

    __hash__ = None  # as a Keras Variable's: filter=True cannot make it static either


@pytest.mark.parametrize(("call", "words"), [
    (lambda: hlo_amp.compile(lambda ws: X @ ws[0], "bf16")([_ArrayLike(W)]),
     ["args[0][0] (parameter ws)", "_ArrayLike", "__jax_array__", ".value"]),
    (lambda: hlo_amp.compile(lambda ws: X @ ws[0], "bf16", filter=True)([_ArrayLike(W)]),
     ["args[0][0]", "_ArrayLike", "__jax_array__"]),
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16")(W, _Config()),
     ["args[1]", "_Config", "static_argnums=(1,)", "filter=True"]),
    (lambda: hlo_amp.compile(lambda p: X @ p["w"], "bf16")({"w": W, "act": "relu"}),
     ["args[0]['act']", "str", "not an array"]),
    # A NumPy array of strings was "a numpy.ndarray, not an array"; "a object" read so.
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16")(W, np.array(["a", "b"])),
     ["args[1] (parameter c) is a numpy.ndarray of dtype <U1",
      "an array of a dtype jax has no type for"]),
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16")(W, object()),
     ["args[1] (parameter c) is an object, not an array"]),
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16", static_argnums=1)(W, [1, 2]),
     ["static argument 1 (parameter c)", "list", "not hashable", "tuple"]),
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16", static_argnums=1)(
        W, {"key": jax.random.key(0)}),
     ["static argument 1", "key<fry>", "args[1]['key']", "dynamic argument"]),
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16", filter=True)(W, {"a": bytearray()}),
     ["args[1]['a']", "bytearray", "not hashable"]),
    (lambda: hlo_amp.compile(lambda w, c: X @ w, "bf16").lower(W, _Config()),
     ["args[1]", "_Config"]),
    # A function in an NNX module's data: the advice was static_argnums (which then
    # refused the module's arrays) or filter=True (which NNX arguments do not take).
    (lambda: hlo_amp.compile(lambda m: X @ m.w, "bf16")(_NnxWithFunctionData()),
     ["args[0].act", "NNX object's data", "nnx.static"]),
    (lambda: hlo_amp.compile(nnx.jit(lambda w: X @ w, in_shardings=(None,)), "bf16"),
     ["@nnx.jit", "in_shardings=(None,)", "replace @nnx.jit with @hlo_amp.compile"]),
    (lambda: hlo_amp.compile(eqx.filter_jit(lambda w: X @ w, keep_unused=True), "bf16"),
     ["@eqx.filter_jit", "keep_unused=True", "replace @eqx.filter_jit with @hlo_amp"]),
    # jax takes compiler_options on a top-level jit only: compiled nested, it raised
    # jax's "compiler_options can only be passed to top-level jax.jit" from inside.
    (lambda: hlo_amp.compile(jax.jit(lambda w: X @ w, compiler_options={
        "xla_embed_ir_in_executable": True}), "bf16")(W),
     ["@jax.jit", "compiler_options={'xla_embed_ir_in_executable': True}",
      "replace @jax.jit with @hlo_amp"]),
])
def test_an_argument_it_cannot_take_gets_one_message_naming_it(call, words):
    with pytest.raises(TypeError) as error:
        call()
    message = str(error.value)
    assert message.startswith("hlo_amp.compile(")
    for word in words:
        assert word in message, (word, message)
    if "NNX object's data" in message:  # the advice jax-style arguments get is not given
        assert "static_argnums" not in message and "filter=True" not in message
    assert "NoneType" not in message and "dispatched" not in message


def test_a_hashable_array_like_leaf_is_static_under_filter():
    """filter=True makes a hashable __jax_array__ leaf static (as eqx.filter_jit does):
    a failure elsewhere in the call was blamed on it."""
    class Scale:
        def __init__(self, value: float) -> None:
            self.v = value

        def __jax_array__(self) -> jax.Array:
            return jnp.asarray(self.v)

    step = hlo_amp.compile(lambda cfg, w: (X @ w) * cfg.v, "bf16", filter=True)
    assert step(Scale(2.0), W).shape == (X.shape[0], W.shape[1])
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        step(Scale(2.0), jnp.ones((W.shape[0] + 1, 3)))


def test_an_nnx_function_exports_for_another_platform():
    """Exported again while jax lowers its call (jax.export for a GPU; an outer jax.jit
    partitioned over devices does the same), NNX's inner function was traced outside
    nnx.jit's update context: flax's "No update context found"."""
    layer = nnx.Linear(32, 64, rngs=nnx.Rngs(0))
    x = jnp.ones((8, 32))
    step = hlo_amp.compile(lambda m, x: m(x), "bf16")
    text = jax.export.export(jax.jit(step), platforms=["cuda"])(layer, x).mlir_module()
    assert re.search(r"dot_general.*tensor<8x32xbf16>", text)
    np.testing.assert_allclose(np.asarray(jax.jit(step)(layer, x)), np.asarray(layer(x)),
                               rtol=2e-2, atol=2e-2)


def test_a_filter_jitted_filter_vmapped_module_compiles():
    """eqx.filter_jit(eqx.filter_vmap(model)): read through its jit wrapper the module's
    __name__ is Equinox's Missing sentinel, and compiling raised "__name__ must be set to
    a string object" (functools.wraps)."""
    model = eqx.nn.Linear(16, 16, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    ensemble = eqx.filter_jit(eqx.filter_vmap(model))
    compiled = hlo_amp.compile(ensemble, "bf16")
    np.testing.assert_allclose(np.asarray(compiled(x)), np.asarray(ensemble(x)),
                               rtol=2e-2, atol=2e-2)
    assert isinstance(compiled.__qualname__, str)
    # and its siblings, which copied the name the same way (review h78)
    assert hlo_amp.compile(ensemble, "fp8,scaling=delayed")(x).shape == (4, 16)
    assert hlo_amp.compare(ensemble, "bf16", x).error < 2e-2


def test_errors_inside_the_step_are_not_rewritten():
    def broken(w, x):
        raise TypeError("the user's own error")

    with pytest.raises(TypeError, match="the user's own error"):
        hlo_amp.compile(broken, "bf16")(W, X)


# ---- the NNX guide's data/model-parallel step on 8 host devices -------------------------

MESH_SCRIPT = textwrap.dedent('''
import json
import re
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import hlo_amp

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
init = nnx.initializers.lecun_normal()

class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, (None, "model")),
                              bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.fc2 = nnx.Linear(64, 64, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)
        self.head = nnx.Linear(64, 10, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
    def __call__(self, x):
        return self.head(jax.nn.gelu(self.fc2(self.drop(jax.nn.relu(self.fc1(x))))))

def create(mesh):
    with jax.set_mesh(mesh):  # flax shards partitioned variables as it creates them
        model = MLP(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

def train_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

rng = np.random.default_rng(0)
x = jax.device_put(jnp.asarray(rng.standard_normal((32, 32)), jnp.float32), NamedSharding(mesh, P("data", None)))
y = jax.device_put(jnp.arange(32) % 10, NamedSharding(mesh, P("data")))
results = {"devices": jax.device_count()}
runs = {}
for name, jit in [("nnx.jit", nnx.jit), ("f32", lambda f: hlo_amp.compile(f, "f32")),
                  ("bf16", lambda f: hlo_amp.compile(f, "bf16,scope:head=float32"))]:
    model, optimizer = create(mesh)
    step = jit(train_step)
    losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    kernel = model.fc1.kernel[...]
    runs[name] = (losses, model, optimizer)
    results.setdefault("shardings", {})[name] = [
        str(a.sharding) for a in jax.tree.leaves(nnx.state((model, optimizer), nnx.Param))]
    results[name] = {"losses": losses, "fc1_sharding": str(kernel.sharding.spec),
                     "fc2_sharding": str(model.fc2.kernel[...].sharding.spec),
                     "count": int(model.drop.rngs.count[...]) if hasattr(model.drop.rngs, "count") else None}
def leaves(tree):
    return [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a) for a in jax.tree.leaves(tree)]
ref, f32 = runs["nnx.jit"], runs["f32"]
results["f32_bit_identical"] = all(np.array_equal(a, b) for a, b in zip(leaves(nnx.state((ref[1], ref[2]))), leaves(nnx.state((f32[1], f32[2])))))
step = hlo_amp.compile(train_step, "bf16,scope:head=float32")
model, optimizer = create(mesh)
report = step.lower(model, optimizer, x, y).report()
results["head_f32"] = all(not d.low_precision for d in report.decisions if d.scope == "head")
# (a dot XLA:CPU takes in bf16 only relaid is computed in f32 in a partitioned program:
# passes/dot_layout.py)
results["others_bf16"] = all(d.low_precision or any(n.startswith("dot computed from f32") for n in d.notes)
                             for d in report.decisions if d.op_kind == "dot_general" and d.scope != "head")
results["some_bf16"] = any(d.low_precision for d in report.decisions if d.scope != "head")
results["scopes"] = sorted({d.scope for d in report.decisions})
print(json.dumps(results))
''')


def test_nnx_guide_step_on_a_data_model_mesh_of_8_host_devices(tmp_path):
    """``--xla_force_host_platform_device_count`` must be set before jax is imported:
    the step runs in a subprocess that prints JSON (as tests/py/test_sharding.py does)."""
    script = tmp_path / "nnx_mesh.py"
    script.write_text(MESH_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=host_devices_env(8), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["devices"] == 8
    assert results["f32_bit_identical"]  # params, optimizer state and RNG state
    assert results["f32"]["losses"] == results["nnx.jit"]["losses"]
    for name in ("f32", "bf16"):  # the caller's parameters keep nnx.jit's shardings
        assert results["shardings"][name] == results["shardings"]["nnx.jit"]
        assert results[name]["fc1_sharding"] == "P(None, 'model')"
        assert results[name]["count"] == 3  # one dropout draw per step, written back
    np.testing.assert_allclose(results["bf16"]["losses"], results["nnx.jit"]["losses"],
                               rtol=5e-2)
    assert results["head_f32"] and results["others_bf16"] and results["some_bf16"]
    assert results["scopes"] == ["fc1", "fc2", "head"]  # module paths, no wrapper


def test_an_abstract_equinox_model_lowers_for_a_target():
    """An Equinox model from eqx.filter_eval_shape (jax.ShapeDtypeStruct leaves), lowered
    without its arrays, as jax.ShapeDtypeStruct arguments are: the leaves were taken as
    static and the trace failed deep inside ("ShapeDtypeStruct @ BatchTracer")."""
    def loss(model: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(model)(x) ** 2)

    def step(model: Any, x: jax.Array) -> Any:
        return eqx.filter_grad(loss)(model, x)

    concrete = eqx.nn.Linear(64, 128, key=jax.random.key(0))
    abstract = eqx.filter_eval_shape(eqx.nn.Linear, 64, 128, key=jax.random.key(0))
    x = jnp.ones((32, 64))
    compiled = hlo_amp.compile(step, "bf16")
    want = compiled.lower(concrete, x, target="h100").report()
    got = compiled.lower(abstract, jax.ShapeDtypeStruct(x.shape, x.dtype), target="h100").report()
    assert [(d.shape, d.operands_after) for d in got.decisions] == [
        (d.shape, d.operands_after) for d in want.decisions] != []


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_a_dropped_framework_step_is_freed(framework: str) -> None:
    """As a jax.jit step is: NNX's pure function holds nnx.jit's object, which held the
    inner compiled function; Equinox's inner function was a method of the object holding
    it. jax caches the inner function's traces weakly keyed on its dispatch, and those
    ways back kept every step alive with its executables (3 MiB a small step)."""
    import gc
    import weakref

    from hlo_amp import jax_internals

    x = jnp.ones((8, 16))
    alive = []

    def make_and_call(i: int) -> None:
        if framework == "nnx":
            model = nnx.Linear(16, 16, rngs=nnx.Rngs(i))
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

            def step(model, optimizer, x):
                loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2) * (i + 1))(
                    model)
                optimizer.update(model, grads)
                return loss

            compiled = hlo_amp.compile(step, "bf16")
            compiled(model, optimizer, x)
        else:
            model = eqx.nn.Linear(16, 16, key=jax.random.key(i))
            compiled = hlo_amp.compile(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2) * (i + 1),
                                       "bf16")
            compiled(model, x)
        alive.append(weakref.ref(compiled))

    def live() -> int:
        gc.collect()
        jax_internals.forget_exported_calls()  # what the next compiled call does
        return sum(type(o).__name__ in ("AmpFunction", "Exported", "Program")
                   for o in gc.get_objects())

    make_and_call(0)
    before = live()
    for i in range(1, 5):
        make_and_call(i)
    assert live() <= before
    assert [ref() is None for ref in alive] == [True] * 5
