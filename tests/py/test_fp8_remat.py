"""fp8 formats under ``jax.checkpoint``: the backward pass recomputes the forward (remat's
``rematted_computation``), and those recomputed dots are forward dots: e4m3fn for both
operands, as in the forward loop. The weight-gradient dots beside them read the
incoming gradient in e5m2. jax names the recomputed forward's constants after the remat
primitive (``remat2``, not ``rematted_computation``); taken for the backward's seed,
they made the recomputed activations look like gradients (hlo_amp/gradients.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir import ir
from test_hoist_amax import ALL

import hlo_amp
from hlo_amp.ir.modules import parse_module, walk_operations
from hlo_amp.ir.sites import location_name

_E4M3, _E5M2 = "f8E4M3FN", "f8E5M2"


def _normed_scan_step(p: dict, x: jax.Array):
    def loss(p: dict, x: jax.Array) -> jax.Array:
        @jax.checkpoint
        def layer(h, w):
            # The norm's constants (the mean's 1/32, the epsilon) sit before a dot.
            n = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
            return h + jnp.tanh(n @ w["a"]) @ w["b"], None

        h, _ = jax.lax.scan(layer, x @ p["w_in"], p["layers"])
        return jnp.mean((h @ p["w_out"] - 1.0) ** 2)

    value, grads = jax.value_and_grad(loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, grads), value


def _args(batch: int = 16) -> tuple[dict, jax.Array]:
    rng = np.random.default_rng(3)
    p = {"w_in": jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32),
         "layers": {"a": jnp.asarray(rng.standard_normal((3, 32, 32)) / 6, jnp.float32),
                    "b": jnp.asarray(rng.standard_normal((3, 32, 32)) / 6, jnp.float32)},
         "w_out": jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32)}
    return p, jnp.asarray(rng.standard_normal((batch, 32)), jnp.float32)


def _element(value: ir.Value) -> str:
    return str(ir.RankedTensorType(value.type).element_type)


@pytest.mark.parametrize("batch", [16, 32])
def test_recomputed_forward_dots_are_e4m3_and_weight_gradients_read_e5m2(batch: int) -> None:
    # A batch of 32, the layer's width: the residuals stacked in the forward and the
    # weight gradients stacked in the backward are both f32[3, 32, 32], and jax lowers one
    # private function for both (dynamic_update_index_in_dim). Its call sites' kinds were
    # joined: the forward's residuals came out gradients, and every backward dot read two
    # "gradients" and fell back to e4m3fn for both (delayed scaling then lost the first
    # step's gradients entirely, scale 1 being below e4m3fn's smallest value).
    lowered = hlo_amp.compile(_normed_scan_step, f"fp8,{ALL}").lower(*_args(batch))
    module = parse_module(lowered.as_text(debug_info=True))  # held: its ops live with it
    recomputed = []
    for op in walk_operations(module.operation, names=frozenset({"stablehlo.dot_general"})):
        if "rematted_computation" in location_name(op.location):
            recomputed.append([_element(v) for v in op.operands])
    assert recomputed and all(formats == [_E4M3, _E4M3] for formats in recomputed), recomputed
    decisions = [d for d in lowered.report().decisions if d.fp8]
    reported = [d for d in decisions if d.direction == "recomputed"]
    assert len(reported) == len(recomputed)
    assert all(d.operands_after == (_E4M3, _E4M3) for d in reported), reported
    # Every other backward dot (the gradients of the weights and of the activations)
    # reads one e5m2 operand.
    backward = [d for d in decisions if d.direction == "backward"]
    assert all(sorted(d.operands_after) == [_E4M3, _E5M2] for d in backward)
    assert len(backward) >= 5  # dW_in, dW_a, dW_b, dW_out and more


def test_a_call_computes_what_lower_reports() -> None:
    # A call runs the step through jax.export (runtime/compile.py), whose module leaves
    # some of the recomputed forward's constants unnamed; .lower() reads jax's own
    # lowering. Both rewrite to the same formats, so both compute the same bits.
    policy = f"fp8,{ALL}"
    args = _args()
    called = hlo_amp.compile(_normed_scan_step, policy)(*args)
    ahead = hlo_amp.compile(_normed_scan_step, policy).lower(*args).compile()(*args)
    for a, b in zip(jax.tree.leaves(called), jax.tree.leaves(ahead)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(called[0]["w_in"]), np.asarray(args[0]["w_in"]))


@pytest.mark.parametrize("transform", [jax.grad, jax.value_and_grad])
def test_the_ends_stay_16_bit_under_checkpoint_recomputed_and_backward(transform) -> None:
    """fp8's preset keeps the first and last matrix ops bf16, and their backward dots.
    Under jax.checkpoint the recomputed copies and the backward dots took op:dot_general
    (fp8: the gradient came from an fp8 recomputation the forward never ran); with
    jax.grad alone, whose forward's dots are all recomputed, no op had either rule."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (16, 32))
    w0, w1 = (jax.random.normal(k, (32, 32)) * 0.2 for k in keys[1:])

    def loss(x, w0, w1):
        def block(h):
            return jnp.tanh(jnp.tanh(h @ w0) @ w1)
        return jnp.sum(jax.checkpoint(block)(x))

    step = transform(loss, argnums=(1, 2))
    decisions = hlo_amp.compile(step, "fp8").lower(x, w0, w1, target="h100").report().decisions
    assert len(decisions) >= 5
    assert {d.direction for d in decisions} >= {"recomputed", "backward"}
    assert [d.rule for d in decisions if d.rule not in ("first_matrix_op", "last_matrix_op")
            ] == []
    assert all(d.operands_after == ("bf16", "bf16") for d in decisions)


def test_without_checkpoint_a_helpers_other_calls_are_not_the_ends() -> None:
    """The checkpoint rule above reads the end's call frames within the op's: a helper's
    matrix op called from other lines (k and v from the same x as q) is not the first
    end's backward (dWk and dWv were marked first_matrix_op, bf16, by its innermost
    frame alone)."""
    def dense(x, w):
        return x @ w

    def loss(p, x):
        q, k, v = dense(x, p["wq"]), dense(x, p["wk"]), dense(x, p["wv"])
        h = dense(jnp.tanh(q) * jnp.tanh(k) + v, p["w1"])
        return jnp.sum(dense(jnp.tanh(h), p["w2"]) ** 2)

    keys = jax.random.split(jax.random.key(0), 6)
    p = {n: jax.random.normal(key, (64, 64)) / 8
         for n, key in zip(["wq", "wk", "wv", "w1", "w2"], keys)}
    x = jax.random.normal(keys[5], (32, 64))
    decisions = hlo_amp.compile(jax.grad(loss), "fp8").lower(p, x).report().decisions
    ends = sorted((d.direction, d.rule) for d in decisions if d.rule.endswith("matrix_op"))
    assert ends == [("backward", "first_matrix_op"), ("backward", "last_matrix_op"),
                    ("backward", "last_matrix_op"), ("forward", "first_matrix_op"),
                    ("forward", "last_matrix_op")]
