"""Three small public models, each as an f32 train step and a hand-cast bf16 peer
(tests/py/test_memory_vs_hand_cast.py at small shapes, benchmarks/hand_cast_memory.py at
their own).

Issue 33, part 4: hlo_amp's 16-bit modes must need no more XLA temp memory than the cast
a user writes by hand. The models, re-created from their public definitions:

* ``mobilenet``: Keras ``keras.applications.MobileNetV3Small`` (``weights=None``),
  trained through ``model.stateless_call`` (BatchNorm statistics are updated); the peer is
  the same model built under the Keras dtype policy ``"mixed_bfloat16"``.
* ``vae``: flax's ``examples/vae`` (Linen: encoder 784→500→2×latents, reparameterise,
  decoder latents→500→784, binary cross-entropy with logits plus KL); the peer passes
  ``dtype=jnp.bfloat16`` to every ``Dense``.
* ``mnist``: flax's ``examples/mnist`` NNX CNN (two 3×3 convolutions with ReLU and 2×2
  average pools, two linear layers); the peer passes ``dtype=jnp.bfloat16``.

``hand_cast_case(name, variant, small)`` returns ``(step, args)`` with ``variant`` "f32"
(also what hlo_amp compiles) or "peer"; every step is ``(params, opt_state, x, ...) ->
(params, opt_state, loss)`` with optax adam. ``param_bytes_16bit(args)`` is the bytes of a
16-bit copy of every float parameter: the allowance the issue gives a mode over f32.
``small=False`` gives the issue's shapes (64×64 batch 8, VAE batch 128, MNIST 28×28 batch
128), ``small=True`` shapes that compile in seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen, nnx

from benchmarks.workloads import _keras

NAMES = ("mobilenet", "vae", "mnist")


# ---- flax examples/vae ------------------------------------------------------------------


class _VaeEncoder(linen.Module):
    latents: int
    hidden: int
    dtype: Any = None

    @linen.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = linen.relu(linen.Dense(self.hidden, dtype=self.dtype, name="fc1")(x))
        mean = linen.Dense(self.latents, dtype=self.dtype, name="fc2_mean")(x)
        logvar = linen.Dense(self.latents, dtype=self.dtype, name="fc2_logvar")(x)
        return mean, logvar


class _VaeDecoder(linen.Module):
    hidden: int
    features: int
    dtype: Any = None

    @linen.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        z = linen.relu(linen.Dense(self.hidden, dtype=self.dtype, name="fc1")(z))
        return linen.Dense(self.features, dtype=self.dtype, name="fc2")(z)


class Vae(linen.Module):
    """flax examples/vae's model (its sizes: 784 features, 500 hidden, 20 latents)."""

    latents: int = 20
    hidden: int = 500
    features: int = 784
    dtype: Any = None

    def setup(self) -> None:
        self.encoder = _VaeEncoder(self.latents, self.hidden, self.dtype)
        self.decoder = _VaeDecoder(self.hidden, self.features, self.dtype)

    def __call__(self, x: jax.Array, z_rng: jax.Array) -> tuple[jax.Array, ...]:
        mean, logvar = self.encoder(x)
        eps = jax.random.normal(z_rng, logvar.shape)
        z = mean + eps * jnp.exp(0.5 * logvar)
        return self.decoder(z), mean, logvar


@jax.vmap
def _kl_divergence(mean: jax.Array, logvar: jax.Array) -> jax.Array:
    return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def _binary_cross_entropy_with_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = linen.log_sigmoid(logits)
    return -jnp.sum(labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits)))


def _vae_case(dtype: Any, small: bool) -> tuple[Callable[..., Any], tuple]:
    sizes = {"latents": 8, "hidden": 128, "features": 196} if small else {}
    batch = 16 if small else 128
    model = Vae(dtype=dtype, **sizes)
    features = model.features
    x = jax.random.uniform(jax.random.key(1), (batch, features))
    params = model.init(jax.random.key(0), x, jax.random.key(2))["params"]
    tx = optax.adam(1e-3)

    def loss_fn(params: Any, x: jax.Array, z_rng: jax.Array) -> jax.Array:
        recon, mean, logvar = model.apply({"params": params}, x, z_rng)
        recon, mean, logvar = (v.astype(jnp.float32) for v in (recon, mean, logvar))
        return (_binary_cross_entropy_with_logits(recon, x).mean()
                + _kl_divergence(mean, logvar).mean())

    def step(params: Any, opt_state: Any, x: jax.Array, z_rng: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, z_rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), x, jax.random.key(3))


# ---- flax examples/mnist (NNX) ------------------------------------------------------------


class MnistCnn(nnx.Module):
    """flax examples/mnist's NNX CNN (its sizes: 32 and 64 channels, 256 hidden)."""

    def __init__(self, *, image: int = 28, widths: tuple[int, int] = (32, 64),
                 hidden: int = 256, dtype: Any = None, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, widths[0], kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(widths[0], widths[1], kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        flat = (image // 4) ** 2 * widths[1]
        self.linear1 = nnx.Linear(flat, hidden, dtype=dtype, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.conv1(x)))
        x = pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def _mnist_case(dtype: Any, small: bool) -> tuple[Callable[..., Any], tuple]:
    image, batch = (16, 16) if small else (28, 128)
    sizes = {"widths": (8, 16), "hidden": 64} if small else {}
    graphdef, params = nnx.split(MnistCnn(image=image, dtype=dtype, rngs=nnx.Rngs(0), **sizes))
    tx = optax.adam(1e-3)

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.random.normal(jax.random.key(1), (batch, image, image, 1))
    return step, (params, tx.init(params), x, jnp.arange(batch) % 10)


# ---- Keras MobileNetV3Small -----------------------------------------------------------------


def _mini_mobilenet(image: int) -> Any:
    """MobileNetV3Small's stem, two of its inverted-residual blocks (Keras's own
    ``_inverted_res_block``: expand, BatchNorm, ReLU or hard-swish, depthwise,
    squeeze-excite, project, residual add) and its head, at the current dtype policy."""
    keras = _keras()
    from keras.src.applications import mobilenet_v3 as m

    inputs = keras.Input((image, image, 3))
    x = keras.layers.Conv2D(16, 3, strides=2, padding="same", use_bias=False,
                            name="conv")(inputs)
    x = keras.layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name="conv_bn")(x)
    x = m.hard_swish(x)
    x = m._inverted_res_block(x, 1, 16, 3, 2, 0.25, m.relu, 0)
    x = m._inverted_res_block(x, 4, 40, 5, 2, 0.25, m.hard_swish, 3)
    x = keras.layers.Conv2D(96, 1, use_bias=False, name="conv_1")(x)
    x = keras.layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name="conv_1_bn")(x)
    x = m.hard_swish(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="mini_mobilenetv3")


def _mobilenet_case(policy: str, small: bool) -> tuple[Callable[..., Any], tuple]:
    keras = _keras()
    image, batch = (32, 8) if small else (64, 8)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        if small:
            model = _mini_mobilenet(image)
        else:
            model = keras.applications.MobileNetV3Small(
                input_shape=(image, image, 3), weights=None, classes=10,
                include_preprocessing=False)
    finally:
        keras.config.set_dtype_policy(previous)
    tx = optax.adam(1e-3)

    def loss_fn(trainable: list, non_trainable: list, x: jax.Array, y: jax.Array
                ) -> tuple[jax.Array, list]:
        probs, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        # keras.applications ends in a softmax: the loss reads its log, in f32
        logp = jnp.log(probs.astype(jnp.float32) + 1e-7)
        return -jnp.take_along_axis(logp, y[:, None], axis=1).mean(), non_trainable

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
        trainable, non_trainable = params
        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, x, y)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return (optax.apply_updates(trainable, updates), non_trainable), opt_state, loss

    params = ([v.value for v in model.trainable_variables],
              [v.value for v in model.non_trainable_variables])
    x = jax.random.uniform(jax.random.key(1), (batch, image, image, 3))
    return step, (params, tx.init(params[0]), x, jnp.arange(batch) % 10)


@functools.cache
def hand_cast_case(name: str, variant: str, small: bool = True
                   ) -> tuple[Callable[..., Any], tuple]:
    """``(step, args)`` of model ``name`` as ``variant`` "f32" or "peer" (hand-cast bf16)."""
    if variant not in ("f32", "peer"):
        raise ValueError(f"variant {variant!r}: 'f32' or 'peer'")
    peer = variant == "peer"
    if name == "mobilenet":
        return _mobilenet_case("mixed_bfloat16" if peer else "float32", small)
    if name == "vae":
        return _vae_case(jnp.bfloat16 if peer else None, small)
    if name == "mnist":
        return _mnist_case(jnp.bfloat16 if peer else None, small)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")


def param_bytes_16bit(args: tuple) -> int:
    """Bytes of a 16-bit copy of every float parameter (the first argument's leaves)."""
    return sum(2 * leaf.size for leaf in jax.tree.leaves(args[0])
               if jnp.issubdtype(leaf.dtype, jnp.floating))
