"""Regenerate the saved JAX lowerings that the lit tests tests/lit/jax_*.mlir and fp8_jax.mlir
read.

Run from the repository root (the tests never run this; they read the saved files):

    .venv/bin/python tests/lit/inputs/make_inputs.py

Each program is tiny (a few 2x4 / 4x4 matrices) so the saved text stays short. Every
module is saved with ``as_text(debug_info=True)``: the name-stack locations are what the
pass reads scopes from. Absolute paths in source locations are rewritten to the bare
file name so the files do not depend on where the repository lives. Regenerating with
another jax version may renumber SSA values and locations; the lit tests capture names
and should keep passing, but check the diff (``git diff tests/lit/inputs``) before
committing. Made with jax/jaxlib 0.10.2 and flax 0.12.8.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

HERE = Path(__file__).resolve().parent


def _ones(*shape: int) -> jax.Array:
    return jnp.linspace(-1.0, 1.0, num=int(jnp.prod(jnp.array(shape)))).reshape(shape)


# ---- mlp_grad: a train step with named scopes, amp_stop and value_and_grad -----------


def mlp_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    import hlo_amp

    with jax.named_scope("Block_0"):
        with jax.named_scope("attn"):
            h = jnp.tanh(x @ params["wq"])
        with jax.named_scope("mlp"):
            h = jnp.tanh(h @ params["w1"])
        with hlo_amp.amp_stop():
            h = h * jax.nn.sigmoid(h @ params["wg"])
    with jax.named_scope("head"):
        logits = h @ params["wo"]
    return jnp.mean((logits - y) ** 2)


def mlp_train_step(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> Any:
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return new_params, loss


def mlp_grad() -> str:
    params = {"wq": _ones(4, 4), "w1": _ones(4, 4), "wg": _ones(4, 4), "wo": _ones(4, 3)}
    return jax.jit(mlp_train_step).lower(params, _ones(2, 4), _ones(2, 3)).as_text(
        debug_info=True)


# ---- flax_linen: nn.Dense(name="fc1") inside a Linen module, under grad --------------


def flax_linen() -> str:
    import flax.linen as nn

    class LBlk(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Dense(4, name="fc1")(x)
            return nn.Dense(3, name="fc2")(jnp.tanh(x))

    model = LBlk()
    x = _ones(2, 4)
    params = model.init(jax.random.key(0), x)

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(model.apply(params, x))

    return jax.jit(jax.grad(loss)).lower(params, x).as_text(debug_info=True)


# ---- scan_rnn: ops in while bodies and closed_call private functions -----------------


def rnn_loss(w: jax.Array, xs: jax.Array) -> jax.Array:
    def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        with jax.named_scope("cell"):
            h = jnp.tanh(h @ w + x)
        return h, None

    h, _ = jax.lax.scan(step, jnp.zeros((2, 4)), xs)
    return jnp.sum(h)


def scan_rnn() -> str:
    return jax.jit(jax.grad(rnn_loss)).lower(_ones(4, 4), _ones(3, 2, 4)).as_text(
        debug_info=True)


# ---- nested_scan: a scan inside a scan, the weights closed over (carried unchanged) --


def nested_scan_loss(w: jax.Array, xs: jax.Array) -> jax.Array:
    def inner(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        with jax.named_scope("cell"):
            h = jnp.tanh(h @ w + x)
        return h, None

    def outer(h: jax.Array, seq: jax.Array) -> tuple[jax.Array, None]:
        h, _ = jax.lax.scan(inner, h, seq)
        return h, None

    h, _ = jax.lax.scan(outer, jnp.zeros((2, 4)), xs)
    return jnp.sum(h)


def nested_scan() -> str:
    return jax.jit(nested_scan_loss).lower(_ones(4, 4), _ones(2, 3, 2, 4)).as_text(
        debug_info=True)


# ---- cond: ops inside stablehlo.case branches ---------------------------------------


def cond_fn(p: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    def small(x: jax.Array) -> jax.Array:
        with jax.named_scope("head"):
            return x @ w

    def big(x: jax.Array) -> jax.Array:
        with jax.named_scope("body"):
            return jnp.tanh(x) @ w.T

    return jax.lax.cond(p, small, big, x)


def cond() -> str:
    return jax.jit(cond_fn).lower(True, _ones(2, 4), _ones(4, 4)).as_text(debug_info=True)


# ---- inner_jit: one private function called from two scopes -------------------------


@jax.jit
def inner(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w)


def outer(x: jax.Array, w: jax.Array) -> jax.Array:
    with jax.named_scope("enc"):
        a = inner(x, w)
    with jax.named_scope("head"):
        b = inner(a, w)
    return b


def inner_jit() -> str:
    return jax.jit(outer).lower(_ones(2, 4), _ones(4, 4)).as_text(debug_info=True)


# ---- remat: jax.checkpoint under grad -----------------------------------------------


def remat_loss(x: jax.Array, w: jax.Array) -> jax.Array:
    @jax.checkpoint
    def block(x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            return jnp.sin(x @ w)

    with jax.named_scope("Block_0"):
        y = block(x)
    with jax.named_scope("head"):
        return jnp.sum(y @ w)


def remat() -> str:
    return jax.jit(jax.grad(remat_loss, argnums=1)).lower(_ones(2, 4), _ones(4, 4)).as_text(
        debug_info=True)


# ---- conv_net: a convolution and a dense head, under grad ---------------------------


def conv_loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    with jax.named_scope("conv1"):
        h = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(h)
    with jax.named_scope("head"):
        logits = h.reshape(h.shape[0], -1) @ params["w"]
    return jnp.sum(logits)


def conv_net() -> str:
    params = {"k": _ones(3, 3, 2, 3), "w": _ones(4 * 4 * 3, 2)}
    return jax.jit(jax.grad(conv_loss)).lower(params, _ones(1, 4, 4, 2)).as_text(
        debug_info=True)


def block_loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A pre-LN transformer block's pieces as JAX lowers them: layer norm, a dense, GELU,
    softmax attention weights, a dense."""
    with jax.named_scope("ln"):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        h = (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["g"]
    with jax.named_scope("fc1"):
        h = jax.nn.gelu(h @ p["w1"])
    with jax.named_scope("softmax"):
        h = jax.nn.softmax(h @ p["w2"], axis=-1)
    with jax.named_scope("fc2"):
        return (h @ p["w3"]).sum()


def transformer_block() -> str:
    params = {"g": _ones(4), "w1": _ones(4, 4), "w2": _ones(4, 4), "w3": _ones(4, 4)}
    return jax.jit(block_loss).lower(params, _ones(2, 4)).as_text(debug_info=True)


# ---- fp8 inputs (tests/lit/fp8_jax.mlir): matrices 16 wide or more, as XLA's fp8 GEMM
# ---- needs every canonical dimension of a dot to be at least 16 (2x4 ones fall back) --


def _ramp(*shape: int) -> jax.Array:
    size = 1
    for n in shape:
        size *= n
    return jnp.linspace(-1.0, 1.0, num=size).reshape(shape)


# ---- fp8_mlp_grad: a train step whose first (stem) and last (head) dots are kept -----


def fp8_mlp_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    with jax.named_scope("stem"):
        h = jnp.tanh(x @ params["w0"])
    with jax.named_scope("attn"):
        h = jnp.tanh(h @ params["wa"])
    with jax.named_scope("mlp"):
        h = jnp.tanh(h @ params["wm"])
    with jax.named_scope("head"):
        out = h @ params["wo"]  # 4 outputs: under the fp8 GEMM's 16
    return jnp.mean((out - y) ** 2)


def fp8_mlp_step(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> Any:
    loss, grads = jax.value_and_grad(fp8_mlp_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def fp8_mlp_grad() -> str:
    params = {"w0": _ramp(32, 32), "wa": _ramp(32, 32), "wm": _ramp(32, 32),
              "wo": _ramp(32, 4)}
    return jax.jit(fp8_mlp_step).lower(params, _ramp(16, 32), _ramp(16, 4)).as_text(
        debug_info=True)


# ---- fp8_scan_grad: the layers in a scan, so the backward dots sit in a private ------
# ---- function called from a while body: the gradient operand comes in as an argument -


def fp8_scan_loss(ws: jax.Array, x: jax.Array) -> jax.Array:
    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        with jax.named_scope("layer"):
            return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.sum(h ** 2)


def fp8_scan_grad() -> str:
    return jax.jit(jax.grad(fp8_scan_loss)).lower(_ramp(2, 32, 32), _ramp(16, 32)).as_text(
        debug_info=True)


# ---- attention_grad: jax.nn.dot_product_attention, causal, GQA, and its gradient ------


def attention_loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    with jax.named_scope("attn"):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jnp.sum(out * jnp.cos(out))


def attention_grad() -> str:
    q, kv = _ramp(2, 8, 4, 8), _ramp(2, 8, 2, 8)
    return jax.jit(jax.grad(attention_loss, argnums=(0, 1, 2))).lower(q, kv, kv).as_text(
        debug_info=True)


LOWERINGS: dict[str, Callable[[], str]] = {
    "mlp_grad": mlp_grad,
    "flax_linen": flax_linen,
    "scan_rnn": scan_rnn,
    "nested_scan": nested_scan,
    "cond": cond,
    "inner_jit": inner_jit,
    "remat": remat,
    "conv_net": conv_net,
    "transformer_block": transformer_block,
    "fp8_mlp_grad": fp8_mlp_grad,
    "fp8_scan_grad": fp8_scan_grad,
    "attention_grad": attention_grad,
}


def portable(text: str) -> str:
    """Source paths as bare file names, so the saved text is the same on any machine."""
    return re.sub(r'loc\("(/[^"]*/)([^"/]+\.py)"', r'loc("\2"', text)


def main(argv: list[str]) -> int:
    names = argv or list(LOWERINGS)
    for name in names:
        path = HERE / f"{name}.mlir"
        path.write_text(portable(LOWERINGS[name]()))
        print(f"wrote {path.relative_to(HERE.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
