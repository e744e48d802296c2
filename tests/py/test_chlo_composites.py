"""A jax.export artifact holds CHLO ops (ragged_dot, erf, top_k, sinh...) as
``stablehlo.composite "chlo.*"`` ops, which XLA turns back into its own ops from the
composite's types, never running the decomposition. run_pipeline reads them back as the
ops (ir/chlo_composites.py), so a GPU program (which hlo_amp.compile exports and rewrites
on the device) is rewritten as the direct lowering of ``lower(target=...)`` is.
test_ragged_dot.py has the ragged dot's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import hlo_amp
from hlo_amp.ir.modules import module_text, parse_module
from hlo_amp.passes import run_pipeline
from hlo_amp.policy import Policy
from hlo_amp.runtime.module_call import ModuleFunction

KEYS = jax.random.split(jax.random.key(0), 3)
W1 = jax.random.normal(KEYS[0], (64, 128)) / 8
W2 = jax.random.normal(KEYS[1], (128, 64)) / 11
X = jax.random.normal(KEYS[2], (32, 64))


def _gelu_mlp(w1, w2, x):
    """BERT's GELU, written with erf."""
    h = x @ w1
    return (0.5 * h * (1 + jax.lax.erf(h / np.sqrt(2.0)))) @ w2


def _activation_share(summary: str) -> str:
    return re.search(r"activations: (\d+)% of intermediate bytes in 16-bit", summary).group(1)


def test_an_erf_composite_is_computed_as_the_fast_mode_computes_erf() -> None:
    """The artifact's erf composite was opaque to the fast mode's op table: it stayed f32
    and kept the GELU's activations f32 (10% of intermediate bytes 16-bit against the
    direct lowering's 95%)."""
    artifact = jax.export.export(jax.jit(_gelu_mlp), platforms=["cuda"])(W1, W2, X)
    assert 'stablehlo.composite "chlo.erf"' in artifact.mlir_module()
    policy = Policy.parse("mixed_bfloat16")
    module = parse_module(artifact.mlir_module())
    from_artifact = run_pipeline(module, policy, target="h100")
    direct = hlo_amp.compile(_gelu_mlp, policy).lower(W1, W2, X, target="h100").report()
    assert _activation_share(from_artifact.summary()) == _activation_share(direct.summary())
    assert re.search(r"chlo\.erf.*-> tensor<32x128xbf16>", module_text(module))
    # and through hlo_amp.compile's own export for a GPU
    text = jax.export.export(jax.jit(hlo_amp.compile(_gelu_mlp, policy)),
                             platforms=["cuda"])(W1, W2, X).mlir_module()
    assert re.search(r'composite "chlo\.erf".*-> tensor<32x128xbf16>', text)


def _special(x):
    return (jax.lax.erf(x), jnp.sinh(x), jnp.cosh(x), jnp.arcsinh(x), jnp.arccos(x * 0.5),
            jax.lax.top_k(x, 3))


def test_every_composite_becomes_its_op_and_computes_the_same() -> None:
    x = jax.random.uniform(KEYS[0], (4, 8), minval=-1.5, maxval=1.5)
    artifact = jax.export.export(jax.jit(_special), platforms=["cuda"])(x)
    assert artifact.mlir_module().count("stablehlo.composite") == 6
    module = parse_module(artifact.mlir_module())
    run_pipeline(module, Policy.parse("f32"), target="h100")
    text = module_text(module)
    assert "stablehlo.composite" not in text and ".impl" not in text  # decompositions gone
    for name in ("erf", "sinh", "cosh", "asinh", "acos", "top_k"):
        assert f"chlo.{name}" in text, name
    got = ModuleFunction(text).for_platform("cpu")(x)
    want = jax.tree.leaves(jax.jit(_special)(x))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_a_users_composite_named_like_a_chlo_op_is_left_to_its_decomposition() -> None:
    """Only jax.export's own (decomposition NAME.impl) stand for the CHLO op: a
    jax.lax.composite a user named chlo.erf computing tanh came out as erf, even under
    the f32 preset (XLA runs a user composite's decomposition, on CPU too)."""
    act = jax.lax.composite(lambda x: jnp.tanh(x), name="chlo.erf")

    def f(x):
        return act(x), jax.lax.erf(x)

    x = jnp.linspace(-2.0, 2.0, 5)
    for want, got in zip(jax.jit(f)(x), hlo_amp.compile(f, "f32")(x), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
