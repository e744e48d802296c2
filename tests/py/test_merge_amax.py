"""passes/merge_amax.py on a real fp8 step: the amaxes of SwiGLU's two gradients (both
computed from the gate, the up projection and the incoming gradient) are taken in one
reduction, the step computes the same bits as without the pass, and compiled for an H100
without the device XLA reduces them in one kernel (tests/lit/merge_amax.mlir has the IR)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hoist_amax import ALL, _assert_same_bits, _compiled_with_count, _three_steps

import hlo_amp
from hlo_amp.passes.merge_amax import MergeAmax


def _swiglu_step(p: dict, x: jax.Array):
    def loss(p: dict) -> jax.Array:
        h = jax.nn.silu(x @ p["gate"]) * (x @ p["up"])
        return jnp.mean((h @ p["down"] - 1.0) ** 2)

    value, grads = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda w, g: w - 0.5 * g, p, grads), value


def _args() -> tuple[dict, jax.Array]:
    rng = np.random.default_rng(5)
    p = {"gate": rng.standard_normal((128, 256)) / 11, "up": rng.standard_normal((128, 256)) / 11,
         "down": rng.standard_normal((256, 128)) / 16}
    return ({k: jnp.asarray(v, jnp.float32) for k, v in p.items()},
            jnp.asarray(rng.standard_normal((64, 128)), jnp.float32))


def _no_merge(monkeypatch) -> None:
    monkeypatch.setattr(MergeAmax, "run", lambda self, module, report=None: None)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_step_is_the_same_bits_with_the_gradients_amaxes_merged(scaling, monkeypatch):
    p, x = _args()
    merging, lowered, merged, note = _compiled_with_count(_swiglu_step, scaling, (p, x),
                                                          "merge-amax:")
    # Under delayed scaling too: batch_amax leaves amaxes of one row (16,384 elements
    # here) to XLA, and this pass takes the two gradients' recorded amaxes together.
    assert merged == 1, note
    assert re.search(r"\(tensor<64x256x\w+>, tensor<64x256x\w+>, tensor<\w+>, tensor<\w+>\)",
                     lowered.as_text())  # the two gradients' amaxes, in one reduction
    with_pass = _three_steps(merging, p, x)
    _no_merge(monkeypatch)
    separate = hlo_amp.compile(_swiglu_step, f"fp8,scaling={scaling},{ALL}")
    assert not any(n.startswith("merge-amax:") for n in separate.lower(p, x).report().notes)
    _assert_same_bits(with_pass, _three_steps(separate, p, x), merging, separate, scaling)
    assert not np.array_equal(with_pass[0][0], with_pass[-1][0])  # the steps trained


def _reduction_kernels(text: str) -> int:
    """The kernels of XLA's optimized HLO whose fused computation reduces."""
    bodies = dict(re.findall(r"^%(\S+) \([^\n]*\{\n(.*?)\n\}", text, re.MULTILINE | re.DOTALL))
    entry = text[text.index("\nENTRY"):]
    called = re.findall(r" fusion\(.*?calls=%([\w.\-]+)", entry)
    return sum(" reduce(" in bodies.get(name, "") for name in called)


def test_xla_reduces_the_merged_amaxes_in_one_kernel(monkeypatch):
    """Compiled for an H100 without the device: fewer kernels reduce an amax."""
    p, x = _args()
    policy = f"fp8,{ALL}"
    merged = hlo_amp.compile(_swiglu_step, policy).lower(p, x, target="h100").compile()
    _no_merge(monkeypatch)
    separate = hlo_amp.compile(_swiglu_step, policy).lower(p, x, target="h100").compile()
    assert _reduction_kernels(merged.as_text()) < _reduction_kernels(separate.as_text())


@pytest.mark.parametrize("policy", ["fp8", "fp8,scaling=delayed"])
def test_a_pair_whose_tensors_an_earlier_merge_reordered_merges_in_the_new_order(policy):
    """A block under jax.checkpoint(dots_saveable), differentiated: an earlier merge moved
    one amax's tensor after the other's, and the pair (ordered once, in block order) put
    its reduction before that tensor was defined: an invalid module ("operand #0 does not
    dominate this use"), an internal error for the user."""
    def block(w, h):
        return jnp.tanh(jnp.tanh(h @ w["a"]) @ w["b"]) + h

    def loss(p, x):
        h = jnp.tanh(x @ p["w0"])
        h = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)(p["b1"], h)
        return jnp.mean((h @ p["w3"]) ** 2)

    rng = np.random.default_rng(0)
    p = {k: jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32) for k in ("w0", "w3")}
    p["b1"] = {k: jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32) for k in "ab"}
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    step = hlo_amp.compile(jax.value_and_grad(loss), policy)
    assert any(n.startswith("merge-amax:") for n in step.lower(p, x).report().notes)
    value, grads = step(p, x)
    expected, expected_grads = jax.jit(jax.value_and_grad(loss))(p, x)
    assert float(value) == pytest.approx(float(expected), rel=0.02)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.15
