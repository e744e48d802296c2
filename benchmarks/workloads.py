"""Benchmark workloads: train steps on random data, built several ways from one definition.

A `Workload` builds a Flax NNX model at a given computation dtype (params always f32),
random inputs with a fixed seed, and an adam train step that is a pure function of
arrays. `variant_step` turns it into the step each benchmark variant runs:

* ``f32``          — the model at f32, ``jax.jit``;
* ``flax bf16``    — the model written with ``dtype=jnp.bfloat16, param_dtype=jnp.float32``;
* ``jmp bf16``     — the model at inferred dtype; params and inputs cast to bf16 at the
  boundary with ``jmp.get_policy('params=float32,compute=bfloat16,output=float32')``;
* ``hlo_amp bf16`` — the f32 step, unchanged, through ``hlo_amp.compile(step, "bf16")``
  (``only_if_faster``, ``mixed_bfloat16`` and ``fp8``: the same step with those policies;
  ``fp8`` is for Hopper GPUs: on CPU it shows the cost of the in-program quantisation,
  the dots running in f32 on dequantised values);
* ``Keras mixed_bfloat16`` — the same model written with Keras 3 layers on the JAX
  backend, every layer at ``dtype="mixed_bfloat16"``, trained through
  ``model.stateless_call`` in a ``jax.jit``-ed step with the same optax adam
  (keras is optional: ``pip install -e '.[bench]'``);
* ``f32 + XLA bf16 dot algorithm`` (GPU only) — the f32 step compiled with
  ``xla_gpu_default_to_alg_dot_bf16_bf16_f32``: XLA runs its f32 dots as bf16×bf16→f32.

The workloads are an MLP, a ViT, a CNN (``examples.models``) and a GPT-style decoder stack
(`Decoder` below: causal self-attention and a GELU MLP, pre-LayerNorm, 512 tokens), the
last for the GPU rows compiled without a device (``--device h100-aot``).

``python -m benchmarks.workloads stress --layers 24`` lowers and rewrites a deep
transformer train step in a fresh process and prints JSON (pass time, op count, peak RSS).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.models import CNN, MLP, ViT


@dataclass(frozen=True)
class Workload:
    """A model family, its size, and its random batch."""

    name: str
    build: Callable[[Any], nnx.Module]  # dtype -> model
    input_shape: tuple[int, ...]
    classes: int
    description: str
    keras_build: Callable[[str], Any] | None = None  # Keras dtype policy name -> keras.Model
    tokens: bool = False  # inputs are token ids and labels one per token (the decoder)

    def model(self, dtype: Any) -> tuple[Any, Any]:
        return nnx.split(self.build(dtype), nnx.Param)

    def batch(self, seed: int = 0) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(jax.random.PRNGKey(seed))
        if self.tokens:  # next-token labels: random ids, as the inputs
            x = jax.random.randint(kx, self.input_shape, 0, self.classes)
            return x, jax.random.randint(ky, self.input_shape, 0, self.classes)
        x = jax.random.normal(kx, self.input_shape, jnp.float32)
        y = jax.random.randint(ky, self.input_shape[:1], 0, self.classes)
        return x, y


def workloads(quick: bool) -> list[Workload]:
    """The MLP, ViT, CNN and decoder train steps; ``quick`` shrinks them to run in seconds."""
    if quick:
        mlp = {"features": 256, "width": 512, "depth": 4, "batch": 64}
        vit = {"dim": 128, "mlp_dim": 512, "depth": 2, "heads": 4, "batch": 16}
        cnn = {"widths": (16, 32, 64), "batch": 16}
        gpt = {"vocab": 1024, "seq": 128, "dim": 128, "depth": 2, "heads": 4, "batch": 4}
    else:
        mlp = {"features": 1024, "width": 2048, "depth": 4, "batch": 256}
        vit = {"dim": 384, "mlp_dim": 1536, "depth": 6, "heads": 8, "batch": 128}
        cnn = {"widths": (32, 64, 128), "batch": 128}
        gpt = {"vocab": 8192, "seq": 512, "dim": 512, "depth": 4, "heads": 8, "batch": 8}
    return [
        Workload(
            "mlp",
            lambda dt: MLP(features=mlp["features"], width=mlp["width"], depth=mlp["depth"],
                           classes=10, dtype=dt, rngs=nnx.Rngs(0)),
            (mlp["batch"], mlp["features"]), 10,
            f"MLP {mlp['features']}→{mlp['depth']}×{mlp['width']}→10, batch {mlp['batch']}",
            lambda pol: keras_mlp(features=mlp["features"], width=mlp["width"],
                                  depth=mlp["depth"], classes=10, policy=pol)),
        Workload(
            "vit",
            lambda dt: ViT(image_size=32, channels=3, patch=4, dim=vit["dim"], depth=vit["depth"],
                           heads=vit["heads"], mlp_dim=vit["mlp_dim"], classes=10, dtype=dt,
                           rngs=nnx.Rngs(0)),
            (vit["batch"], 32, 32, 3), 10,
            f"ViT embed {vit['dim']}, MLP {vit['mlp_dim']}, {vit['depth']} layers, "
            f"{vit['heads']} heads, patch 4, 32×32×3, batch {vit['batch']}",
            lambda pol: keras_vit(image_size=32, channels=3, patch=4, dim=vit["dim"],
                                  depth=vit["depth"], heads=vit["heads"],
                                  mlp_dim=vit["mlp_dim"], classes=10, policy=pol)),
        Workload(
            "cnn",
            lambda dt: CNN(channels=3, image_size=32, widths=cnn["widths"], classes=10,
                           dtype=dt, rngs=nnx.Rngs(0)),
            (cnn["batch"], 32, 32, 3), 10,
            f"CNN 3×conv3×3 {cnn['widths']} + avg-pool, 32×32×3, batch {cnn['batch']}",
            lambda pol: keras_cnn(channels=3, image_size=32, widths=cnn["widths"], classes=10,
                                  policy=pol)),
        Workload(
            "decoder",
            lambda dt: Decoder(vocab=gpt["vocab"], seq=gpt["seq"], dim=gpt["dim"],
                               depth=gpt["depth"], heads=gpt["heads"], mlp_dim=4 * gpt["dim"],
                               dtype=dt, rngs=nnx.Rngs(0)),
            (gpt["batch"], gpt["seq"]), gpt["vocab"],
            f"GPT-style decoder, {gpt['depth']} causal pre-LN blocks, embed {gpt['dim']}, "
            f"MLP {4 * gpt['dim']}, {gpt['heads']} heads, {gpt['seq']} tokens, vocab "
            f"{gpt['vocab']}, batch {gpt['batch']}",
            lambda pol: keras_decoder(vocab=gpt["vocab"], seq=gpt["seq"], dim=gpt["dim"],
                                      depth=gpt["depth"], heads=gpt["heads"],
                                      mlp_dim=4 * gpt["dim"], policy=pol),
            tokens=True),
    ]


# ---- a GPT-style decoder stack (Flax NNX), written as examples.models writes the ViT ------


class CausalAttention(nnx.Module):
    """Multi-head causal self-attention: fused qkv, scores masked and softmaxed in f32."""

    def __init__(self, dim: int, heads: int, *, dtype: Any, rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"embed dim {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(q.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))


class DecoderBlock(nnx.Module):
    """Pre-LayerNorm: x + attention(ln(x)), then x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, *, dtype: Any, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.attn = CausalAttention(dim, heads, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.fc1 = nnx.Linear(dim, mlp_dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_dim, dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Decoder(nnx.Module):
    """Token embedding + learned positions, ``depth`` decoder blocks, final LayerNorm, and
    a head over the vocabulary: next-token logits ``(batch, seq, vocab)``."""

    def __init__(self, *, vocab: int, seq: int, dim: int, depth: int, heads: int,
                 mlp_dim: int, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embed = nnx.Embed(vocab, dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, dim)))
        self.blocks = nnx.List([DecoderBlock(dim, heads, mlp_dim, dtype=dtype, rngs=rngs)
                                for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.dtype is None:  # infer from the table (nnx.Embed gives f32 for a bf16 one)
            x = x.astype(self.embed.embedding[...].dtype)
        x = x + self.pos[...][: tokens.shape[1]].astype(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_step(graphdef: Any, tx: optax.GradientTransformation,
              cast: Callable[[Any, Any], tuple[Any, Any]] | None = None,
              out_cast: Callable[[Any], Any] | None = None) -> Callable:
    """Adam train step (params, opt_state, x, y) -> (params, opt_state, loss)."""

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        if cast is not None:
            params, x = cast(params, x)
        logits = nnx.merge(graphdef, params)(x)
        if out_cast is not None:
            logits = out_cast(logits)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


VARIANTS = ("f32", "flax bf16", "jmp bf16", "hlo_amp bf16", "hlo_amp bf16 only_if_faster",
            "hlo_amp mixed_bfloat16", "hlo_amp fp8", "Keras mixed_bfloat16", "jaxamp")
# Only on GPU: the f32 step, XLA told to run f32 dots with the bf16×bf16→f32 algorithm;
# the fast mode with keep_f32_results (on CPU it is the fast mode itself).
GPU_VARIANTS = ("f32 + XLA bf16 dot algorithm", "hlo_amp mixed_bfloat16 keep_f32_results")
# Compiled (not run) for a GPU without the device: ``--device h100-aot`` / ``h200-aot``.
AOT_VARIANTS = ("f32", "f32 + XLA bf16 dot algorithm", "flax bf16", "jmp bf16",
                "Keras mixed_bfloat16", "hlo_amp bf16", "hlo_amp mixed_bfloat16",
                "hlo_amp mixed_bfloat16 keep_f32_results", "hlo_amp fp8")
# The policy each hlo_amp variant compiles with.
HLO_AMP_POLICIES = {"hlo_amp bf16": "bf16",
                    "hlo_amp bf16 only_if_faster": "bf16,only_if_faster=true",
                    "hlo_amp mixed_bfloat16": "mixed_bfloat16",
                    # the weight gradients' and logits' GEMMs keep f32 results (GPU, TPU)
                    "hlo_amp mixed_bfloat16 keep_f32_results": "mixed_bfloat16,keep_f32_results=true",
                    "hlo_amp fp8": "fp8"}
# XLA compile options of the variants that are the f32 step compiled differently.
XLA_OPTIONS = {"f32 + XLA bf16 dot algorithm": {"xla_gpu_default_to_alg_dot_bf16_bf16_f32": True}}
KERAS_POLICY = {"Keras mixed_bfloat16": "mixed_bfloat16"}
# hlo_amp on the Keras model's own step (Keras's float32 policy): the same program and
# pytree (lists of variables) as the Keras mixed row, so the two differ in how the
# precision is chosen alone, not in the host cost of passing an nnx.State (on the H100 the
# Flax rows paid that and the Keras rows did not: the CNN's two steps ran the same 24
# kernels).
KERAS_HLO_AMP = "hlo_amp mixed_bfloat16 (Keras step)"
HLO_AMP_POLICIES[KERAS_HLO_AMP] = "mixed_bfloat16"
KERAS_POLICY[KERAS_HLO_AMP] = "float32"
GPU_VARIANTS = (*GPU_VARIANTS, KERAS_HLO_AMP)
# fp8 with delayed scaling (the amax history carried between steps), on a GPU only.
FP8_DELAYED = "hlo_amp fp8 delayed"
HLO_AMP_POLICIES[FP8_DELAYED] = "fp8,scaling=delayed"
GPU_VARIANTS = (*GPU_VARIANTS, FP8_DELAYED)


def variants(device: str) -> tuple[str, ...]:
    """The variants benchmarked on ``device`` (``cpu``, ``gpu``, or ``h100-aot``-style)."""
    if device.startswith("tpu-") and device.endswith("-aot"):
        # No fp8 matrix unit and no XLA:GPU dot-algorithm flag on TPUs (hlo_amp/targets/tpu.py).
        return tuple(v for v in AOT_VARIANTS if v not in ("hlo_amp fp8", *XLA_OPTIONS))
    if device.endswith("-aot"):
        return AOT_VARIANTS
    return VARIANTS + GPU_VARIANTS if device == "gpu" else VARIANTS


def variant_step(workload: Workload, variant: str) -> tuple[Callable, Any, Any]:
    """(step, params, opt_state) for one variant; raises ImportError if it is unavailable."""
    tx = optax.adam(1e-4)
    if variant in KERAS_POLICY:
        if workload.keras_build is None:
            raise ImportError(f"no Keras definition of the {workload.name} workload")
        model = workload.keras_build(KERAS_POLICY[variant])
        step = make_keras_step(model, tx)
        params = ([v.value for v in model.trainable_variables],
                  [v.value for v in model.non_trainable_variables])
        return step, params, tx.init(params[0])
    if variant == "f32" or variant in HLO_AMP_POLICIES or variant in XLA_OPTIONS:
        graphdef, params = workload.model(jnp.float32)
        step = make_step(graphdef, tx)
    elif variant == "flax bf16":
        graphdef, params = workload.model(jnp.bfloat16)
        step = make_step(graphdef, tx)
    elif variant == "jmp bf16":
        import jmp

        policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
        graphdef, params = workload.model(None)
        step = make_step(graphdef, tx, cast=lambda p, x: policy.cast_to_compute((p, x)),
                         out_cast=policy.cast_to_output)
    elif variant == "jaxamp":
        import jaxamp  # noqa: F401  (not installed in this environment)

        raise ImportError("jaxamp variant not wired up")
    else:
        raise ValueError(f"unknown variant {variant!r}; accepted: "
                         f"{', '.join(VARIANTS + GPU_VARIANTS)}")
    return step, params, tx.init(params)


# ---- Keras 3 (JAX backend) definitions of the same models ------------------------------------


def make_keras_step(model: Any, tx: optax.GradientTransformation) -> Callable:
    """Adam train step ((trainable, non_trainable), opt_state, x, y) -> (params, opt_state, loss).

    The model runs through ``model.stateless_call``; adam sees the list of trainable values.
    """

    def loss_fn(trainable: list, non_trainable: list, x: jax.Array, y: jax.Array
                ) -> tuple[jax.Array, list]:
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        logits = logits.astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, non_trainable

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, Any]:
        trainable, non_trainable = params
        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, x, y)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return (optax.apply_updates(trainable, updates), non_trainable), opt_state, loss

    return step


@functools.cache
def _keras() -> Any:
    """Import Keras 3 on the JAX backend (ImportError if missing or on another backend)."""
    os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if keras.backend.backend() != "jax":
        raise ImportError(f"keras was imported with backend {keras.backend.backend()!r}, not jax")
    return keras


@functools.cache
def _keras_layers() -> tuple[type, type, type]:
    """The custom Keras layers the ViT needs: attention, cls token + positions, cls pick."""
    keras = _keras()
    ops = keras.ops

    class Attention(keras.layers.Layer):
        """Multi-head self-attention like `examples.models.Attention`: fused qkv, f32 softmax
        (``causal``: masked as `CausalAttention`)."""

        def __init__(self, dim: int, heads: int, causal: bool = False, **kwargs: Any):
            super().__init__(**kwargs)
            if dim % heads:
                raise ValueError(f"embed dim {dim} is not divisible by {heads} heads")
            self.dim, self.heads, self.causal = dim, heads, causal
            self.qkv = keras.layers.Dense(3 * dim, kernel_initializer="lecun_normal",
                                          dtype=self.dtype_policy, name="qkv")
            self.out = keras.layers.Dense(dim, kernel_initializer="lecun_normal",
                                          dtype=self.dtype_policy, name="out")

        def build(self, input_shape: tuple) -> None:
            self.qkv.build(input_shape)
            self.out.build(input_shape)

        def call(self, x: Any) -> Any:
            t, d, h = x.shape[1], self.dim, self.heads
            qkv = ops.reshape(self.qkv(x), (-1, t, 3, h, d // h))
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / ops.cast((d // h) ** 0.5, q.dtype)
            scores = ops.cast(scores, "float32")
            if self.causal:
                scores = ops.where(ops.tril(ops.ones((t, t), dtype="bool")), scores,
                                   float(jnp.finfo(jnp.float32).min))
            weights = ops.cast(ops.softmax(scores, axis=-1), v.dtype)
            y = ops.reshape(ops.einsum("bhqk,bkhd->bqhd", weights, v), (-1, t, d))
            return self.out(y)

    class ClsAndPositions(keras.layers.Layer):
        """Prepend a learned cls token and add learned positions (init normal(0.02))."""

        def build(self, input_shape: tuple) -> None:
            tokens, dim = input_shape[1] + 1, input_shape[2]
            init = keras.initializers.RandomNormal(stddev=0.02)
            self.cls = self.add_weight(shape=(1, 1, dim), initializer=init, name="cls")
            self.pos = self.add_weight(shape=(1, tokens, dim), initializer=init, name="pos")

        def call(self, x: Any) -> Any:
            cls = ops.broadcast_to(ops.cast(self.cls, x.dtype), (ops.shape(x)[0], 1, x.shape[2]))
            return ops.concatenate([cls, x], axis=1) + ops.cast(self.pos, x.dtype)

    class ClsToken(keras.layers.Layer):
        """The first token: what the classifier head reads."""

        def call(self, x: Any) -> Any:
            return x[:, 0]

    return Attention, ClsAndPositions, ClsToken


@functools.cache
def _keras_positions() -> type:
    """A Keras layer adding learned positions (init normal(0.02)), as `Decoder` does."""
    keras = _keras()

    class Positions(keras.layers.Layer):
        def build(self, input_shape: tuple) -> None:
            init = keras.initializers.RandomNormal(stddev=0.02)
            self.pos = self.add_weight(shape=tuple(input_shape[1:]), initializer=init,
                                       name="pos")

        def call(self, x: Any) -> Any:
            return x + keras.ops.cast(self.pos, x.dtype)

    return Positions


def _gelu(x: Any) -> Any:
    return _keras().ops.gelu(x, approximate=True)  # jax.nn.gelu's default, as in the Flax models


def keras_mlp(*, features: int, width: int, depth: int, classes: int, policy: str) -> Any:
    """`examples.models.MLP` in Keras: `depth` Dense(width) + GELU layers, Dense head."""
    keras = _keras()
    inputs = keras.Input((features,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation=_gelu, kernel_initializer="lecun_normal",
                               dtype=policy, name=f"layer_{i}")(x)
    out = keras.layers.Dense(classes, kernel_initializer="lecun_normal", dtype=policy,
                             name="head")(x)
    return keras.Model(inputs, out, name="mlp")


def keras_vit(*, image_size: int, channels: int, patch: int, dim: int, depth: int, heads: int,
              mlp_dim: int, classes: int, policy: str) -> Any:
    """`examples.models.ViT` (no dropout, as the benchmark runs it) in Keras."""
    keras = _keras()
    layers = keras.layers
    attention, cls_and_positions, cls_token = _keras_layers()
    if image_size % patch:
        raise ValueError(f"image size {image_size} is not a multiple of patch {patch}")
    inputs = keras.Input((image_size, image_size, channels))
    x = layers.Conv2D(dim, patch, strides=patch, padding="valid",
                      kernel_initializer="lecun_normal", dtype=policy, name="patch_embed")(inputs)
    x = layers.Reshape(((image_size // patch) ** 2, dim), dtype=policy)(x)
    x = cls_and_positions(dtype=policy, name="cls_pos")(x)
    for i in range(depth):
        y = layers.LayerNormalization(epsilon=1e-6, dtype=policy, name=f"block_{i}_ln1")(x)
        y = attention(dim, heads, dtype=policy, name=f"block_{i}_attn")(y)
        x = layers.Add(dtype=policy)([x, y])
        y = layers.LayerNormalization(epsilon=1e-6, dtype=policy, name=f"block_{i}_ln2")(x)
        y = layers.Dense(mlp_dim, activation=_gelu, kernel_initializer="lecun_normal",
                         dtype=policy, name=f"block_{i}_fc1")(y)
        y = layers.Dense(dim, kernel_initializer="lecun_normal", dtype=policy,
                         name=f"block_{i}_fc2")(y)
        x = layers.Add(dtype=policy)([x, y])
    x = layers.LayerNormalization(epsilon=1e-6, dtype=policy, name="norm")(x)
    x = cls_token(dtype=policy)(x)
    out = layers.Dense(classes, kernel_initializer="lecun_normal", dtype=policy, name="head")(x)
    return keras.Model(inputs, out, name="vit")


def keras_cnn(*, channels: int, image_size: int, widths: tuple[int, ...], classes: int,
              policy: str) -> Any:
    """`examples.models.CNN` in Keras: 3×3 conv + ReLU + 2×2 average-pool stages, Dense head."""
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((image_size, image_size, channels))
    x = inputs
    for i, width in enumerate(widths):
        x = layers.Conv2D(width, 3, padding="same", activation="relu",
                          kernel_initializer="lecun_normal", dtype=policy, name=f"conv_{i}")(x)
        x = layers.AveragePooling2D(2, strides=2, dtype=policy)(x)
    x = layers.Flatten(dtype=policy)(x)
    out = layers.Dense(classes, kernel_initializer="lecun_normal", dtype=policy, name="head")(x)
    return keras.Model(inputs, out, name="cnn")


def keras_decoder(*, vocab: int, seq: int, dim: int, depth: int, heads: int, mlp_dim: int,
                  policy: str) -> Any:
    """`Decoder` in Keras: embedding + positions, pre-LN causal blocks, LayerNorm, head."""
    keras = _keras()
    layers = keras.layers
    attention = _keras_layers()[0]
    inputs = keras.Input((seq,), dtype="int32")
    x = layers.Embedding(vocab, dim, dtype=policy, name="embed")(inputs)
    x = _keras_positions()(dtype=policy, name="pos")(x)
    for i in range(depth):
        y = layers.LayerNormalization(epsilon=1e-6, dtype=policy, name=f"block_{i}_ln1")(x)
        y = attention(dim, heads, causal=True, dtype=policy, name=f"block_{i}_attn")(y)
        x = layers.Add(dtype=policy)([x, y])
        y = layers.LayerNormalization(epsilon=1e-6, dtype=policy, name=f"block_{i}_ln2")(x)
        y = layers.Dense(mlp_dim, activation=_gelu, kernel_initializer="lecun_normal",
                         dtype=policy, name=f"block_{i}_fc1")(y)
        y = layers.Dense(dim, kernel_initializer="lecun_normal", dtype=policy,
                         name=f"block_{i}_fc2")(y)
        x = layers.Add(dtype=policy)([x, y])
    x = layers.LayerNormalization(epsilon=1e-6, dtype=policy, name="norm")(x)
    out = layers.Dense(vocab, kernel_initializer="lecun_normal", dtype=policy, name="head")(x)
    return keras.Model(inputs, out, name="decoder")


# ---- the deep-transformer stress: lower + rewrite only -------------------------------------


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def stress(layers: int, dim: int, batch: int, policy: str = "bf16") -> dict[str, Any]:
    """Lower a `layers`-deep ViT train step and run the passes of `policy`; no XLA compile."""
    import hlo_amp

    model = ViT(image_size=32, channels=3, patch=4, dim=dim, depth=layers, heads=8,
                mlp_dim=4 * dim, classes=10, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-4)
    opt_state = jax.eval_shape(tx.init, params)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    del model
    x = jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    rss_before = _max_rss_mib()
    lowered = hlo_amp.compile(make_step(graphdef, tx), policy).lower(params, opt_state, x, y)
    text = lowered.as_text()
    ops = len(re.findall(r"^\s*(?:%[\w#:, %]+ = )?\"?(?:stablehlo|func|chlo)\.", text, re.MULTILINE))
    decisions = lowered.report().decisions
    return {
        "layers": layers, "dim": dim, "batch": batch, "policy": policy,
        "ops": ops,
        "dots_convs": len(decisions),
        "converted": sum(1 for d in decisions if d.low_precision and d.changed),
        "lower_seconds": lowered.lower_seconds,
        "pass_seconds": lowered.pass_seconds,
        "max_rss_before_mib": rss_before,
        "max_rss_mib": _max_rss_mib(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workloads")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stress", help="lower + rewrite a deep transformer step, print JSON")
    s.add_argument("--layers", type=int, default=24)
    s.add_argument("--dim", type=int, default=384)
    s.add_argument("--batch", type=int, default=128)
    s.add_argument("--policy", default="bf16")
    args = p.parse_args(argv)
    print(json.dumps(stress(args.layers, args.dim, args.batch, args.policy)))


if __name__ == "__main__":
    main()
