"""Flax NNX models shared by the demo (`examples/vit_digits.py`) and `benchmarks/`.

Every model takes ``dtype`` (the computation dtype, ``None`` = infer from inputs and
params, ``jnp.float32`` = full precision, ``jnp.bfloat16`` = hand-written mixed precision)
and keeps its parameters in f32. The ViT is written as the Flax NNX guide writes a
model: its ``nnx.Dropout`` layers hold their RNG streams, ``model.train()`` /
``model.eval()`` switch them. It pushes no scope itself: passed to ``hlo_amp.compile``
(which takes NNX objects as ``nnx.jit`` does) or traced under
``hlo_amp.module_scopes(model)``, its parts are named by their path in the model, as a
policy names them: ``patch_embed``, ``blocks/{i}``, ``blocks/{i}/attn`` (``attn/qkv``,
``attn/out``), ``blocks/{i}/mlp`` (``mlp/fc1``, ``mlp/fc2``), ``norm``, ``head``. The MLP
and CNN keep hand-written scopes (``layer_{i}``, ``conv_{i}``, ``head``).
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Dtype = Any


def _cast(x: jax.Array, dtype: Dtype | None) -> jax.Array:
    return x if dtype is None else x.astype(dtype)


def _dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
    """``nnx.Dropout`` with its own RNG stream forked from ``rngs``; at rate 0 it holds no
    RNG state, so a dropout-free model is all ``nnx.Param`` (the benchmarks split it so)."""
    return nnx.Dropout(rate, rngs=rngs if rate else None)


class Attention(nnx.Module):
    """Multi-head self-attention: fused qkv projection, softmax in f32, output projection."""

    def __init__(self, dim: int, heads: int, dropout: float, *, dtype: Dtype | None,
                 rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"embed dim {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.drop = _dropout(dropout, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(q.dtype)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", self.drop(weights), v).reshape(b, t, d)
        return self.out(y)


class Mlp(nnx.Module):
    """Two linear layers with GELU and dropout."""

    def __init__(self, dim: int, hidden: int, dropout: float, *, dtype: Dtype | None,
                 rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(dim, hidden, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.drop = _dropout(dropout, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.drop(jax.nn.gelu(self.fc1(x))))


class Block(nnx.Module):
    """Pre-LayerNorm encoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float, *,
                 dtype: Dtype | None, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.attn = Attention(dim, heads, dropout, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.mlp = Mlp(dim, mlp_dim, dropout, dtype=dtype, rngs=rngs)
        self.drop_attn = _dropout(dropout, rngs)
        self.drop_mlp = _dropout(dropout, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.drop_attn(self.attn(self.ln1(x)))
        return x + self.drop_mlp(self.mlp(self.ln2(x)))


class ViT(nnx.Module):
    """Vision Transformer: conv patch embedding, cls token, learned positions, pre-LN blocks.

    Dropout layers draw from the ``rngs`` given here (its ``dropout`` stream if it has
    one); ``model.train()`` and ``model.eval()`` switch them on and off.
    """

    def __init__(self, *, image_size: int, channels: int, patch: int, dim: int, depth: int,
                 heads: int, mlp_dim: int, classes: int, dropout: float = 0.0,
                 dtype: Dtype | None = jnp.float32, rngs: nnx.Rngs):
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not a multiple of patch {patch}")
        tokens = (image_size // patch) ** 2 + 1
        self.dtype = dtype
        self.patch_embed = nnx.Conv(channels, dim, (patch, patch), strides=(patch, patch),
                                    padding="VALID", dtype=dtype, param_dtype=jnp.float32,
                                    rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.cls = nnx.Param(init(rngs.params(), (1, 1, dim), jnp.float32))
        self.pos = nnx.Param(init(rngs.params(), (1, tokens, dim), jnp.float32))
        self.drop = _dropout(dropout, rngs)
        self.blocks = nnx.List([Block(dim, heads, mlp_dim, dropout, dtype=dtype, rngs=rngs)
                                for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(dim, classes, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        """images: (batch, height, width, channels) → logits (batch, classes)."""
        x = self.patch_embed(images)
        b = x.shape[0]
        x = x.reshape(b, -1, x.shape[-1])
        cls = jnp.broadcast_to(_cast(self.cls[...], self.dtype), (b, 1, x.shape[-1]))
        x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        x = self.drop(x + _cast(self.pos[...], self.dtype).astype(x.dtype))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x[:, 0])


class MLP(nnx.Module):
    """Plain MLP classifier: `depth` hidden layers of `width` with GELU."""

    def __init__(self, *, features: int, width: int, depth: int, classes: int,
                 dtype: Dtype | None = jnp.float32, rngs: nnx.Rngs):
        sizes = [features] + [width] * depth
        self.layers = nnx.List([nnx.Linear(a, b, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
                                for a, b in itertools.pairwise(sizes)])
        self.head = nnx.Linear(width, classes, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array, *, train: bool = False,
                 key: jax.Array | None = None) -> jax.Array:
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x = jax.nn.gelu(layer(x))
        with jax.named_scope("head"):
            return self.head(x)


class CNN(nnx.Module):
    """Small conv net: three 3×3 conv + ReLU + 2×2 average-pool stages, then a linear head."""

    def __init__(self, *, channels: int, image_size: int, widths: tuple[int, ...] = (32, 64, 128),
                 classes: int, dtype: Dtype | None = jnp.float32, rngs: nnx.Rngs):
        ins = (channels,) + tuple(widths[:-1])
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), dtype=dtype, param_dtype=jnp.float32,
                                        rngs=rngs) for a, b in zip(ins, widths)])
        side = image_size // 2 ** len(widths)
        self.head = nnx.Linear(widths[-1] * side * side, classes, dtype=dtype,
                               param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array, *, train: bool = False,
                 key: jax.Array | None = None) -> jax.Array:
        for i, conv in enumerate(self.convs):
            with jax.named_scope(f"conv_{i}"):
                x = jax.nn.relu(conv(x))
                x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        with jax.named_scope("head"):
            return self.head(x.reshape(x.shape[0], -1))
