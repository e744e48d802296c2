"""jaxamp's API on hlo_amp (hlo_amp/jaxamp_compat.py).

The code of jaxamp 0.0.4's README runs with ``from hlo_amp import jaxamp_compat as
jaxamp`` in place of ``import jaxamp``; op and scope rules give the decisions they name
(read from the report); a policy that keeps everything is bit-identical to jax.jit; and
every value hlo_amp cannot apply is one clear error.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import hlo_amp
from hlo_amp import jaxamp_compat as jaxamp
from hlo_amp.report import Decision

ELEMENT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}  # dtype -> report spelling


def _params(key: jax.Array, sizes: tuple[int, ...] = (8, 16, 16, 4)) -> dict[str, jax.Array]:
    keys = jax.random.split(key, len(sizes))
    return {f"w{i}": jax.random.normal(k, (a, b)) / np.sqrt(a)
            for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]), start=1)}


def _batch(n: int = 32) -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (n, 8))
    return x, jnp.argmax(x @ jax.random.normal(kw, (8, 4)), axis=-1)


def _forward_decisions(fn: Any, *args: Any) -> list[Decision]:
    return [d for d in fn.lower(*args).report().decisions if d.direction == "forward"]


# ------------------------------------------------------------------ jaxamp's README


def test_readme_tldr_runs() -> None:
    def loss(model, minibatch):
        x, y = minibatch
        logits = jnp.tanh(x @ model["w1"]) @ model["w2"] @ model["w3"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    model, minibatch = _params(jax.random.key(0)), _batch()
    # The README writes jaxamp.DynamicLossScaler(), a name jaxamp 0.0.4 does not have.
    scaler_state = jaxamp.DynamicScalerState()
    amp_loss = jaxamp.amp(loss)
    grad_fn = jaxamp.dynamic_scale_grad(amp_loss)
    scaler_state, grad = grad_fn(model, minibatch, dynamic_scaler_state=scaler_state)

    want = jax.grad(loss)(model, minibatch)
    for name in model:
        np.testing.assert_allclose(grad[name], want[name], rtol=2e-2,
                                   atol=2e-2 * float(jnp.abs(want[name]).max()))
    assert int(scaler_state.count) == 1 and int(scaler_state.total_resets) == 0
    decisions = _forward_decisions(amp_loss, model, minibatch)
    assert len(decisions) == 3  # the default policy: every dot in bfloat16, the default
    assert all(d.operands_after == ("bf16", "bf16") for d in decisions)


def test_readme_training_loop_runs() -> None:
    """The README's "More details" loop, with its slips fixed as noted."""

    def loss_fn(model_state, minibatch):
        x, y = minibatch
        logits = jnp.tanh(jnp.tanh(x @ model_state["w1"]) @ model_state["w2"]) @ \
            model_state["w3"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
        return loss, accuracy

    def train_step(
        model_state,
        opt_state,
        minibatch,
        dynamic_scaler_state,
        optimizer):
      amp_loss_fn = jaxamp.amp(loss_fn)

      value_and_grad_fn = jaxamp.dynamic_scale_value_and_grad(amp_loss_fn, has_aux=True)

      dynamic_scaler_state, ((loss, accuracy), grads) = value_and_grad_fn(
        model_state,
        minibatch,
        dynamic_scaler_state=dynamic_scaler_state)

      updates, opt_state = optimizer.update(grads, opt_state, model_state)
      model_state = optax.apply_updates(model_state, updates)
      return model_state, opt_state, dynamic_scaler_state, loss, accuracy

    logged: list[tuple[float, float]] = []

    def log_metrics(loss, accuracy):
        logged.append((float(loss), float(accuracy)))

    def train_loop(model_state, opt_state, optimizer, dataloader):
      # README: static_argnums=3, which is the scaler state; the optimizer is argument 4.
      train_step_jit = jax.jit(train_step, static_argnums=4)
      # README: amp.DynamicScalerState(); and it leaves the state out of the call below.
      dynamic_scaler_state = jaxamp.DynamicScalerState()
      for minibatch in dataloader:
        model_state, opt_state, dynamic_scaler_state, loss, accuracy = train_step_jit(
          model_state,
          opt_state,
          minibatch,
          dynamic_scaler_state,
          optimizer)
        log_metrics(loss, accuracy)
      return model_state, opt_state

    optimizer = optax.apply_if_finite(optax.adam(3e-2), max_consecutive_errors=5)
    model_state = _params(jax.random.key(1))
    dataloader = [_batch()] * 30
    model_state, opt_state = train_loop(model_state, optimizer.init(model_state), optimizer,
                                        dataloader)
    losses = [loss for loss, _ in logged]
    assert len(logged) == 30 and np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], "premise: the loop learns the batch"
    assert int(opt_state.total_notfinite) == 0


def test_readme_compute_dtype_and_amp_stop() -> None:
    from hlo_amp.jaxamp_compat import amp

    def loss_fn(W, x):
        return jnp.sum(jnp.dot(W, x) ** 2)

    W, x = jax.random.normal(jax.random.key(2), (2, 16, 16))
    for dtype in (jnp.float16, jnp.bfloat16):
        amp_loss_fn = amp(loss_fn, compute_dtype=dtype)
        (decision,) = _forward_decisions(amp_loss_fn, W, x)
        assert decision.operands_after == (ELEMENT[jnp.dtype(dtype).name],) * 2

    @jaxamp.amp_stop
    def high_precision_matmul(W, x):
        return jnp.dot(W, x)

    def high_precision_with_context(W, x):
        # will be low precision
        y = jnp.dot(W, x)

        with jaxamp.amp_stop():
            # in fp32 precision
            z = jnp.dot(W, y)
        return z

    (stopped,) = _forward_decisions(jaxamp.amp(high_precision_matmul), W, x)
    assert (stopped.rule, stopped.operands_after) == ("amp_stop", ("f32", "f32"))
    low, high = _forward_decisions(jaxamp.amp(high_precision_with_context), W, x)
    assert low.operands_after == ("bf16", "bf16") and low.rule == "op:dot_general"
    assert (high.rule, high.operands_after) == ("amp_stop", ("f32", "f32"))
    # The decorator keeps its function's result, and the parenthesised form works too.
    np.testing.assert_array_equal(high_precision_matmul(W, x), jnp.dot(W, x))
    assert _forward_decisions(jaxamp.amp(jaxamp.amp_stop()(loss_fn)), W, x)[0].rule == \
        "amp_stop"


def test_readme_custom_precision_function_is_a_clear_error() -> None:
    def precision_fn(compute_dtype, original_dtypes, *invars, **bind_params):
        return invars, bind_params

    with pytest.raises(ValueError) as error:
        jaxamp.amp(jnp.dot, amp_policy={lax.dot_general_p: precision_fn})
    message = str(error.value)
    assert "amp_policy[dot_general_p]" in message and "precision_fn" in message
    for accepted in ("use_compute_precision", "use_original_precision", "use_precision(dtype)",
                     "compute, keep"):
        assert accepted in message


# ------------------------------------------------------------------------- mapping


def _conv_net(params: dict[str, jax.Array], images: jax.Array) -> jax.Array:
    h = lax.conv_general_dilated(images, params["k"], (1, 1), "SAME")
    h = jnp.tanh(h).reshape(images.shape[0], -1)
    with jax.named_scope("body"):
        h = jnp.tanh(h @ params["w1"])
    with jax.named_scope("head"):
        return jnp.sum(h @ params["w2"])


def _conv_inputs() -> tuple[dict[str, jax.Array], jax.Array]:
    k1, k2, k3, k4 = jax.random.split(jax.random.key(4), 4)
    params = {"k": jax.random.normal(k1, (3, 2, 3, 3)) / 4,
              "w1": jax.random.normal(k2, (3 * 6 * 6, 16)) / 10,
              "w2": jax.random.normal(k3, (16, 4)) / 4}
    return params, jax.random.normal(k4, (2, 2, 6, 6))


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, np.dtype("float16"), "bfloat16"])
def test_op_and_scope_rules_decide_each_op(compute_dtype: Any) -> None:
    policy = {
        lax.dot_general_p: jaxamp.use_compute_precision,
        lax.conv_general_dilated_p: jaxamp.use_original_precision,
        "head": jaxamp.use_precision(jnp.float32),
        "body": "keep",
    }
    low = ELEMENT[jnp.dtype(compute_dtype).name]
    fn = jaxamp.amp(_conv_net, compute_dtype=compute_dtype, amp_policy=policy)
    decisions = fn.lower(*_conv_inputs()).report().decisions
    by = {(d.op_kind, d.scope, d.direction): d for d in decisions}
    assert by["convolution", "", "forward"].rule == "op:convolution"
    assert by["convolution", "", "forward"].operands_after == ("f32", "f32")
    assert by["dot_general", "body", "forward"].rule == "scope:body"
    assert by["dot_general", "body", "forward"].operands_after == ("f32", "f32")
    assert by["dot_general", "head", "forward"].action == "float32"
    # Backward dots follow their forward scope; the one dot under no rule computes.
    assert {d.rule for d in decisions if d.scope == "head"} == {"scope:head"}
    assert {d.rule for d in decisions if d.scope == "body"} == {"scope:body"}

    ops_only = {k: v for k, v in policy.items() if not isinstance(k, str)}
    plain = jaxamp.amp(lambda a, b: a @ b, compute_dtype=compute_dtype, amp_policy=ops_only)
    (dot,) = _forward_decisions(plain, *_params(jax.random.key(5), (8, 8, 8)).values())
    assert dot.rule == "op:dot_general" and dot.operands_after == (low, low)
    assert dot.result_after == "f32"  # unlike jaxamp, f32 accumulation and result


def test_a_key_left_out_is_left_alone() -> None:
    fn = jaxamp.amp(_conv_net, amp_policy={lax.conv_general_dilated_p:
                                           jaxamp.use_compute_precision})
    decisions = _forward_decisions(fn, *_conv_inputs())
    for d in decisions:
        assert d.low_precision == (d.op_kind == "convolution"), d


def test_elementwise_rules_and_amp_default() -> None:
    def residual(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h = x @ params["w1"]
        h = jnp.tanh(h) + h
        return jnp.sum(h @ params["w2"])

    args = (_params(jax.random.key(6), (8, 8, 8)), jax.random.normal(jax.random.key(8), (4, 8)))
    rules = {lax.dot_general_p: jaxamp.use_compute_precision,
             lax.add_p: jaxamp.use_compute_precision}

    def propagation(amp_policy: dict[Any, Any]) -> dict[str, Any]:
        report = jaxamp.amp(residual, amp_policy=amp_policy).lower(*args).report()
        assert report.propagation is not None  # elementwise rules run the propagation
        return report.propagation["ops"]

    # As in jaxamp, an op the policy does not name (tanh) runs as written.
    ops = propagation(rules)
    assert ops["tanh"]["painted"] == 0 and "rule op:tanh" in ops["tanh"]["f32"]
    # amp_default=use_compute_precision: the rest may join the 16-bit region too.
    ops = propagation({**rules, "amp_default": jaxamp.use_compute_precision})
    assert ops["tanh"]["painted"] >= 1 and ops["add"]["painted"] >= 1
    # use_precision(float32) on an elementwise op keeps it f32.
    ops = propagation({**rules, "amp_default": jaxamp.use_compute_precision,
                       lax.add_p: jaxamp.use_precision(jnp.float32)})
    assert ops["add"]["painted"] == 0


def test_default_policy_mirrors_jaxamps() -> None:
    policy = jaxamp.to_policy()
    assert policy == jaxamp.to_policy(jaxamp.default_amp_policy)
    assert policy.compute_dtype == "bfloat16" and policy.propagate
    for kind in ("dot_general", "dot", "convolution", "add", "subtract"):
        assert policy.ops[kind] == "compute", kind
    for kind in ("multiply", "divide", "exponential", "log"):
        assert policy.ops[kind] == "float32", kind
    assert policy.ops["tanh"] == "keep"  # not in jaxamp's table: as written
    assert "reshape" not in policy.ops  # data movement is exact in any dtype
    assert dict(policy.scopes) == {}  # amp_stop is built in


@pytest.mark.parametrize("amp_policy, compute_dtype", [
    ({}, jnp.float16),
    ({lax.dot_general_p: jaxamp.use_original_precision,
      lax.conv_general_dilated_p: jaxamp.use_original_precision,
      lax.add_p: jaxamp.use_original_precision}, jnp.bfloat16),
    (None, jnp.float32),
])
def test_keeping_everything_is_bit_identical_to_jit(amp_policy: Any, compute_dtype: Any) -> None:
    params, images = _conv_inputs()
    fn = jaxamp.amp(jax.value_and_grad(_conv_net), amp_policy=amp_policy,
                    compute_dtype=compute_dtype)
    for got, want in zip(jax.tree_util.tree_leaves(fn(params, images)),
                         jax.tree_util.tree_leaves(jax.jit(jax.value_and_grad(_conv_net))(
                             params, images)), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not any(d.low_precision for d in fn.lower(params, images).report().decisions)


# ---------------------------------------------------------------- how it composes


def test_composes_like_jaxamps_unjitted_function() -> None:
    params, images = _conv_inputs()
    fn = jaxamp.amp(_conv_net, compute_dtype=jnp.bfloat16)
    direct = fn(params, images)
    assert hlo_amp.amp is jaxamp.amp
    np.testing.assert_array_equal(jax.jit(fn)(params, images), direct)
    grads = jax.jit(jax.grad(fn))(params, images)
    want = jax.grad(_conv_net)(params, images)
    for name in params:
        np.testing.assert_allclose(grads[name], want[name], rtol=5e-2,
                                   atol=5e-2 * float(jnp.abs(want[name]).max()))

    @jaxamp.amp(compute_dtype=jnp.bfloat16)
    def decorated(params, images):
        return _conv_net(params, images)

    np.testing.assert_array_equal(decorated(params, images), direct)


def test_equinox_module_with_non_array_leaves() -> None:
    class Mlp(eqx.Module):
        linear: eqx.nn.Linear
        activation: Any
        power: int

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.activation(jax.vmap(self.linear)(x)) ** self.power

    model = Mlp(eqx.nn.Linear(8, 4, key=jax.random.key(9)), jax.nn.gelu, 2)
    x, _ = _batch(6)

    def loss(model: Mlp, x: jax.Array) -> jax.Array:
        return jnp.mean(model(x))

    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.bfloat16)
    state, (value, grads) = jaxamp.dynamic_scale_value_and_grad(amp_loss)(
        model, x, dynamic_scaler_state=jaxamp.DynamicScalerState())
    ref_value, ref_grads = eqx.filter_value_and_grad(loss)(model, x)
    np.testing.assert_allclose(value, ref_value, rtol=5e-2)
    assert grads.activation is None and grads.power is None
    np.testing.assert_allclose(grads.linear.weight, ref_grads.linear.weight, rtol=5e-2,
                               atol=5e-2 * float(jnp.abs(ref_grads.linear.weight).max()))
    assert int(state.count) == 1
    (dot,) = _forward_decisions(amp_loss, model, x)
    assert dot.operands_after == ("bf16", "bf16")


def test_scaler_defaults_are_jaxamps() -> None:
    import inspect

    for name in ("dynamic_scale_grad", "dynamic_scale_value_and_grad"):
        params = inspect.signature(getattr(jaxamp, name)).parameters
        assert params["filter"].default is True
    assert inspect.signature(jaxamp.dynamic_scale_grad).parameters["redo_on_nan"].default == 0
    assert inspect.signature(
        jaxamp.dynamic_scale_value_and_grad).parameters["redo_on_nan"].default == 10


# -------------------------------------------------------------------------- errors


def test_unknown_primitive_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as error:
        jaxamp.amp(jnp.sum, amp_policy={lax.reduce_sum_p: jaxamp.use_compute_precision})
    message = str(error.value)
    assert "reduce_sum_p" in message
    for accepted in ("dot_general_p", "conv_general_dilated_p", "add_p", "exp_p"):
        assert accepted in message


def test_a_primitive_lowered_to_several_ops_is_refused() -> None:
    """jax lowers logistic_p (sigmoid) to negate, exponential, add and divide: a rule on
    it was mapped to a 'logistic' op kind that never occurs, accepted, and did nothing."""
    with pytest.raises(ValueError) as error:
        jaxamp.amp(jax.nn.sigmoid, amp_policy={lax.logistic_p: jaxamp.use_compute_precision})
    assert "logistic_p" in str(error.value)
    text = jax.jit(jax.nn.sigmoid).lower(jnp.ones(3)).as_text()
    assert "logistic" not in text  # what the mapping assumed


@pytest.mark.parametrize("compute_dtype", [jnp.int32, "float64", "fp8", None])
def test_bad_compute_dtype(compute_dtype: Any) -> None:
    with pytest.raises(ValueError) as error:
        jaxamp.amp(jnp.dot, compute_dtype=compute_dtype)
    message = str(error.value)
    assert repr(compute_dtype) in message
    assert "jnp.bfloat16" in message and "jnp.float16" in message and "jnp.float32" in message


@pytest.mark.parametrize("amp_policy, error_type, words", [
    ({"head": "fastest"}, ValueError, ["'fastest'", "amp_policy['head']", "compute, keep"]),
    ({"head": None}, ValueError, ["amp_policy['head']", "None", "use_compute_precision"]),
    ({3: jaxamp.use_compute_precision}, TypeError, ["3", "scope names", "primitives"]),
    ({"amp_default": jaxamp.use_precision(jnp.float32)}, ValueError,
     ["amp_default", "use_original_precision or use_compute_precision"]),
    ([(lax.dot_general_p, jaxamp.use_compute_precision)], TypeError, ["dict", "list"]),
    ({lax.add_p: jaxamp.use_precision(jnp.float16)}, ValueError,
     ["amp_policy", "'float16'", "add"]),
])
def test_bad_policy_values(amp_policy: Any, error_type: type, words: list[str]) -> None:
    with pytest.raises(error_type) as error:
        jaxamp.to_policy(amp_policy)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_amp_needs_a_function() -> None:
    with pytest.raises(TypeError, match="amp expects a function, got int"):
        jaxamp.amp(3)


def test_precision_functions_keep_jaxamps_effect_when_called() -> None:
    x = jnp.ones((2, 2), jnp.float32)
    (cast, same), params = jaxamp.use_compute_precision(
        jnp.bfloat16, [jnp.float32] * 2, x, x, preferred_element_type=jnp.float32)
    assert cast.dtype == jnp.bfloat16 and same.dtype == jnp.bfloat16
    assert params["preferred_element_type"] == jnp.bfloat16
    (back,), _ = jaxamp.use_original_precision(jnp.bfloat16, [jnp.float32], cast)
    assert back.dtype == jnp.float32
    (wide,), _ = jaxamp.use_precision(jnp.float32)(jnp.bfloat16, [jnp.float32], cast)
    assert wide.dtype == jnp.float32


def test_docs_example_runs() -> None:
    """docs/jaxamp.md's first code block, with its names defined."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "jaxamp.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, flags=re.DOTALL).group(1)

    def loss_fn(model, batch):
        x, y = batch
        logits = jnp.tanh(x @ model["w1"]) @ model["w2"] @ model["w3"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    names: dict[str, Any] = {"loss_fn": loss_fn, "model": _params(jax.random.key(10)),
                             "batch": _batch()}
    exec(code, names)  # noqa: S102 - the docs' own example
    want = jax.grad(lambda m: loss_fn(m, names["batch"])[0])(names["model"])
    assert int(names["state"].count) == 1
    np.testing.assert_allclose(names["grads"]["w1"], want["w1"], rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(want["w1"]).max()))
