"""Small train steps of six model kinds, for compiling for a GPU without one (tests).

``WORKLOADS[name]`` is ``(step, args)``: an SGD step ``(params, x, y) -> (params, loss)``
written as its framework writes the model, on arrays small enough to compile in seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen, nnx

from examples.models import CNN, MLP, ViT


def _sgd(loss_fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    def step(params: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss
    return step


def _cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _nnx_case(model: nnx.Module, x_shape: tuple[int, ...]) -> tuple:
    graphdef, params = nnx.split(model)

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return _cross_entropy(nnx.merge(graphdef, params)(x), y)

    x = jax.random.normal(jax.random.key(1), x_shape)
    return _sgd(loss_fn), (params, x, jnp.arange(x_shape[0]) % 10)


class LinenTransformer(linen.Module):
    """Two pre-LN encoder blocks (Flax Linen attention, layer norm, GELU MLP), mean-pooled."""

    dim: int = 64
    heads: int = 4

    @linen.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = linen.Dense(self.dim)(tokens)
        for _ in range(2):
            y = linen.MultiHeadDotProductAttention(num_heads=self.heads)(linen.LayerNorm()(x))
            x = x + y
            y = linen.Dense(self.dim)(jax.nn.gelu(linen.Dense(4 * self.dim)(linen.LayerNorm()(x))))
            x = x + y
        return linen.Dense(10)(x.mean(axis=1))


def _linen_case() -> tuple:
    model = LinenTransformer()
    x = jax.random.normal(jax.random.key(2), (8, 32, 48))
    params = model.init(jax.random.key(0), x)

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return _cross_entropy(model.apply(params, x), y)

    return _sgd(loss_fn), (params, x, jnp.arange(8) % 10)


def _scan_rnn_case() -> tuple:
    keys = jax.random.split(jax.random.key(3), 4)
    params = {"w_in": jax.random.normal(keys[0], (32, 128)) / 6,
              "w_h": jax.random.normal(keys[1], (128, 128)) / 12,
              "w_out": jax.random.normal(keys[2], (128, 10)) / 12}

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        def cell(h: jax.Array, x_t: jax.Array) -> tuple[jax.Array, None]:
            with jax.named_scope("cell"):
                return jnp.tanh(x_t @ params["w_in"] + h @ params["w_h"]), None
        h, _ = jax.lax.scan(cell, jnp.zeros((x.shape[1], 128)), x)
        return _cross_entropy(h @ params["w_out"], y)

    x = jax.random.normal(keys[3], (12, 16, 32))  # (time, batch, features)
    return _sgd(loss_fn), (params, x, jnp.arange(16) % 10)


def _remat_case() -> tuple:
    keys = jax.random.split(jax.random.key(4), 4)
    params = {"w1": jax.random.normal(keys[0], (128, 512)) / 11,
              "w2": jax.random.normal(keys[1], (512, 128)) / 22,
              "head": jax.random.normal(keys[2], (128, 10)) / 11}

    @jax.checkpoint
    def block(params: Any, x: jax.Array) -> jax.Array:
        with jax.named_scope("block"):
            return x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        x = block(params, block(params, x))
        with jax.named_scope("head"):
            return _cross_entropy(x @ params["head"], y)

    x = jax.random.normal(keys[3], (64, 128))
    return _sgd(loss_fn), (params, x, jnp.arange(64) % 10)


_BUILDERS: dict[str, Callable[[], tuple]] = {
    "mlp": lambda: _nnx_case(MLP(features=128, width=256, depth=3, classes=10,
                                 rngs=nnx.Rngs(0)), (32, 128)),
    "cnn": lambda: _nnx_case(CNN(channels=3, image_size=16, widths=(16, 32), classes=10,
                                 rngs=nnx.Rngs(0)), (8, 16, 16, 3)),
    "vit": lambda: _nnx_case(ViT(image_size=16, channels=3, patch=4, dim=64, depth=2,
                                 heads=4, mlp_dim=128, classes=10, rngs=nnx.Rngs(0)),
                             (8, 16, 16, 3)),
    "linen_transformer": _linen_case,
    "scan_rnn": _scan_rnn_case,
    "remat_block": _remat_case,
}


class _Workloads(Mapping):
    """name -> (step, args), each built on first use and kept: building all six takes
    about 10 s (eager initialisers), which a pytest-xdist worker that runs no GPU or TPU
    test should not pay at collection. ``abstract``: args are ``jax.ShapeDtypeStruct``s,
    the models initialised under ``jax.eval_shape`` (a fraction of the eager cost), which
    is all that lowering and compiling for a device one does not have reads."""

    def __init__(self, abstract: bool = False) -> None:
        self._abstract = abstract

    def __getitem__(self, name: str) -> tuple[Callable[..., Any], tuple]:
        return _built_abstract(name) if self._abstract else _built(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_BUILDERS)

    def __len__(self) -> int:
        return len(_BUILDERS)


@functools.cache
def _built(name: str) -> tuple[Callable[..., Any], tuple]:
    return _BUILDERS[name]()


@functools.cache
def _built_abstract(name: str) -> tuple[Callable[..., Any], tuple]:
    steps = []

    def arguments() -> tuple:
        step, args = _BUILDERS[name]()
        steps.append(step)
        return args

    args = jax.eval_shape(arguments)
    return steps[0], args


# MLP, CNN, ViT (NNX), a Linen transformer, a scan RNN and a remat'd block.
WORKLOADS: Mapping[str, tuple[Callable[..., Any], tuple]] = _Workloads()
# The same steps on abstract arguments, for lowering and compiling for a GPU or TPU.
ABSTRACT_WORKLOADS: Mapping[str, tuple[Callable[..., Any], tuple]] = _Workloads(abstract=True)
