"""Regenerate the saved JAX lowerings that tests/lit/fp8*.mlir read.

Run from the repository root (the tests never run this; they read the saved files):

    .venv/bin/python tests/lit/inputs/make_fp8_inputs.py

Like make_inputs.py (whose ``portable`` this uses), but the matrices are 16 wide or
more: XLA's fp8 GEMM needs every canonical dimension of a dot to be at least 16, so the
2x4 matrices of the other inputs would all fall back. Made with jax/jaxlib 0.10.2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_inputs import portable


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


LOWERINGS: dict[str, Callable[[], str]] = {
    "fp8_mlp_grad": fp8_mlp_grad,
    "fp8_scan_grad": fp8_scan_grad,
}


def main(argv: list[str]) -> int:
    for name in argv or list(LOWERINGS):
        path = HERE / f"{name}.mlir"
        path.write_text(portable(LOWERINGS[name]()))
        print(f"wrote {path.relative_to(HERE.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
