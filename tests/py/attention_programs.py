"""Small programs with a softmax attention written every way the fused-attention pass
must find it, for tests/py/test_fused_attention.py: each a function and its arguments,
forward or a training step (gradients with respect to every float argument).

- ``jax.nn.dot_product_attention`` (implementation ``None`` or ``"xla"``): causal, a
  boolean (padding) mask, grouped-query heads, an explicit scale;
- einsum attention as ``benchmarks/llm.py`` writes it (GQA groups, ``jnp.where(causal,
  s, finfo.min)``, an f32 softmax), unrolled or scanned, with and without
  ``jax.checkpoint``;
- Flax NNX ``nnx.MultiHeadAttention`` with ``nnx.make_causal_mask``, Flax Linen
  ``nn.MultiHeadDotProductAttention``, Equinox ``eqx.nn.MultiheadAttention``, and
  ``jax.nn.dot_product_attention`` on projections: each forward, in a training step, under
  ``jax.checkpoint`` and in a ``jax.lax.scan`` of checkpointed layers (``WRAPS``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

B, T, N, K, H = 2, 16, 4, 2, 8  # batch, sequence, query heads, key/value heads, head dim


def _normal(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@functools.cache
def _qkv(kv_heads: int = K) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (_normal(0, (B, T, N, H)), _normal(1, (B, T, kv_heads, H)),
            _normal(2, (B, T, kv_heads, H)))


def _grad_of(attend: Callable[..., jax.Array], count: int = 3) -> Callable[..., Any]:
    """The gradient of a weighted sum of ``attend``'s output with respect to its first
    ``count`` arguments (a weighting, so no gradient is uniform)."""
    def loss(*args: Any) -> jax.Array:
        out = attend(*args)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * weights)

    return jax.grad(loss, argnums=tuple(range(count)))


def padding_mask(lengths: tuple[int, ...] = (T, T - 5)) -> jax.Array:
    """[B, 1, 1, T]: True up to each sequence's length (every query sees a key)."""
    keys = jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]
    return keys[:, None, None, :]


def dpa(**options: Any) -> Callable[..., jax.Array]:
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, *mask: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[0] if mask else None,
                                            **options)
    return attend


# ---- benchmarks/llm.py's attention ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Llm:
    layers: int = 2
    scan: bool = False
    remat: bool = False


def llm_step(form: Llm) -> tuple[Callable[..., Any], tuple]:
    """The gradient of a small llm.py decoder's loss (its own attention code)."""
    from benchmarks import llm

    config = dataclasses.replace(llm.SMALL, layers=form.layers, seq=32, batch=2,
                                 scan_layers=form.scan, remat=form.remat)
    params = llm.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (config.batch, config.seq + 1), 0,
                                config.vocab)

    def grads(params: Any, tokens: jax.Array) -> Any:
        return jax.grad(llm.loss_fn)(params, tokens, config)

    return grads, (params, tokens)


# ---- the frameworks' attention layers ---------------------------------------------------------


WRAPS = ("forward", "step", "checkpoint", "scan")


def _wrapped(apply: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
             wrap: str) -> tuple[Callable[..., Any], tuple]:
    """``apply(params, x)`` (a layer's output) as the program ``wrap`` says: its output
    (``forward``), the gradient of a loss of it (``step``), the same with the layer under
    ``jax.checkpoint``, or two residual layers as a ``jax.lax.scan`` over a checkpointed
    body (the parameters shared)."""
    if wrap == "forward":
        return jax.jit(apply), (params, x)
    layer = jax.checkpoint(apply) if wrap in ("checkpoint", "scan") else apply

    def loss(params: Any, x: jax.Array) -> jax.Array:
        if wrap == "scan":
            out, _ = jax.lax.scan(lambda h, _: (h + layer(params, h), None), x, None,
                                  length=2)
        else:
            out = layer(params, x)
        return jnp.sum(out * jnp.cos(out))

    return jax.grad(loss, argnums=(0, 1)), (params, x)


def nnx_program(wrap: str = "step", causal: bool = True) -> tuple[Callable[..., Any], tuple]:
    from flax import nnx

    layer = nnx.MultiHeadAttention(num_heads=N, in_features=N * H, qkv_features=N * H,
                                   decode=False, rngs=nnx.Rngs(0))
    graph, state = nnx.split(layer)

    def apply(state: Any, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones((B, T))) if causal else None
        return nnx.merge(graph, state)(x, mask=mask)

    return _wrapped(apply, state, _normal(3, (B, T, N * H)), wrap)


def linen_program(wrap: str = "step", causal: bool = True) -> tuple[Callable[..., Any], tuple]:
    import flax.linen as nn

    layer = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * H)
    x = _normal(3, (B, T, N * H))
    params = layer.init(jax.random.key(0), x, x)

    def apply(params: Any, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones((B, T))) if causal else None
        return layer.apply(params, x, x, mask=mask)

    return _wrapped(apply, params, x, wrap)


def equinox_program(wrap: str = "step", causal: bool = False
                    ) -> tuple[Callable[..., Any], tuple]:
    import equinox as eqx

    layer = eqx.nn.MultiheadAttention(num_heads=N, query_size=N * H, key=jax.random.key(0))
    params, static = eqx.partition(layer, eqx.is_array)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool)) if causal else None

    def apply(params: Any, x: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return jax.vmap(lambda row: model(row, row, row, mask=mask))(x)

    return _wrapped(apply, params, _normal(3, (B, T, N * H)), wrap)


def dpa_program(wrap: str) -> tuple[Callable[..., Any], tuple]:
    """``jax.nn.dot_product_attention`` (causal, GQA) on projections of x."""
    q_w, kv_w = _normal(4, (N * H, N * H)), _normal(5, (N * H, 2 * K * H))

    def apply(params: Any, x: jax.Array) -> jax.Array:
        q = (x @ params[0] / 8.0).reshape(B, T, N, H)
        k, v = jnp.split((x @ params[1] / 8.0).reshape(B, T, 2 * K, H), 2, axis=2)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, N * H)

    return _wrapped(apply, (q_w, kv_w), _normal(3, (B, T, N * H)), wrap)


def dpa_scan_padding(causal: bool) -> tuple[Callable[..., Any], tuple]:
    """``jax.nn.dot_product_attention`` (GQA) with a padding mask the step is given, in
    a ``jax.lax.scan`` of checkpointed layers: jax computes the mask (ANDed with causal)
    before the loop, broadcast to the scores' [B, K, G, T, S], and passes it through the
    loop unchanged; the forward loop's site read the group axis as a second query axis
    ('the mask varies along more than one query dimension')."""
    q_w, kv_w = _normal(4, (2, N * H, N * H)), _normal(5, (2, N * H, 2 * K * H))

    def layer(x: jax.Array, params: Any, pad: jax.Array) -> jax.Array:
        q = (x @ params[0] / 8.0).reshape(B, T, N, H)
        k, v = jnp.split((x @ params[1] / 8.0).reshape(B, T, 2 * K, H), 2, axis=2)
        out = jax.nn.dot_product_attention(q, k, v, mask=pad, is_causal=causal,
                                           implementation="xla")
        return x + out.reshape(B, T, N * H)

    def loss(params: Any, x: jax.Array, pad: jax.Array) -> jax.Array:
        remat = jax.checkpoint(layer)
        out, _ = jax.lax.scan(lambda h, p: (remat(h, p, pad), None), x, params)
        return jnp.sum(out * jnp.cos(out))

    return jax.grad(loss, argnums=(0, 1)), ((q_w, kv_w), _normal(3, (B, T, N * H)),
                                            padding_mask())


def dpa_scan_mask_closed_over(unroll: int = 1, window: int = 0
                              ) -> tuple[Callable[..., Any], tuple]:
    """A causal (or windowed) padding mask made before a ``lax.scan`` of
    ``jax.checkpoint``ed layers and closed over: the backward loop reads it through
    jax.checkpoint's optimization barrier, where the causal part was lost to the bias
    (review h101)."""
    q, k, _ = _qkv(kv_heads=N)
    positions = jnp.arange(T)
    causal = positions[:, None] >= positions
    if window:
        causal &= positions[:, None] - positions < window

    def loss(q, k, pad):
        mask = causal[None, None] & pad

        @jax.checkpoint
        def layer(h, scale):
            return h + jax.nn.dot_product_attention(q * scale, h, h, mask=mask), None

        h, _ = jax.lax.scan(layer, k, jnp.array([1.0, 0.5]), unroll=unroll)
        return jnp.sum(h * jnp.cos(h))

    return jax.grad(loss, argnums=(0, 1)), (q, k, padding_mask())


def flax_combined_masks(q: jax.Array, k: jax.Array, v: jax.Array, pad: jax.Array
                        ) -> jax.Array:
    """Flax's causal and padding masks, ``nnx.combine_masks(nnx.make_causal_mask(...),
    nnx.make_attention_mask(pad, pad))``: 0/1 floats ANDed through bool conversions; the
    causal part went into the bias (review h101)."""
    from flax import nnx

    tokens = jnp.zeros(pad.shape, jnp.int32)
    # (Padded keys only: a padded query's row masked whole is the documented difference.)
    mask = nnx.combine_masks(nnx.make_causal_mask(tokens),
                             nnx.make_attention_mask(jnp.ones_like(pad), pad))
    return nnx.dot_product_attention(q, k, v, mask=mask)


def einsum_scan_prefix_lm(x: jax.Array, params: jax.Array, pad: jax.Array) -> jax.Array:
    """A prefix-LM mask of per-sequence prefix lengths ANDed with padding, made before a
    scan of layers and passed through it: its constant part varies along the batch, no
    constant mask of the kernel's; it was refused ('a constant mask that varies along
    the batch or heads') once the mask before the loop was read (review h92)."""
    positions = jnp.arange(T)
    prefix = positions < jnp.array([3, 5])[:, None, None, None]  # [B, 1, 1, S]
    mask = ((positions[:, None] >= positions) | prefix) & pad

    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        q, k = (jnp.einsum("btd,de->bte", h, w[i]).reshape(B, T, N, H) for i in range(2))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), h.reshape(B, T, N, H))
        return h + out.reshape(B, T, N * H), None

    return jax.lax.scan(layer, x, params)[0]


def einsum_sharding_constraints(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``with_sharding_constraint`` on the scores and the probabilities (as jax writes a
    constraint after every op under an Explicit mesh, ``jax.make_mesh``'s default): the
    site was not found, and under fp8 its matmuls went fp8 (hunt h93)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
    scores = jax.lax.with_sharding_constraint(scores, replicated)
    probabilities = jax.lax.with_sharding_constraint(jax.nn.softmax(scores, -1), replicated)
    return jnp.einsum("bnts,bsnh->btnh", probabilities, v)


def einsum_integer_and_mask(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array,
                            b: jax.Array) -> jax.Array:
    """An integer mask's bitwise and, ``(a & b) != 0``: it was read as ``(a != 0) & (b !=
    0)``, 114% off (review h92)."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
    scores = jnp.where((a & b)[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)


def dpa_keys_as_given(x: jax.Array, w: jax.Array) -> jax.Array:
    """Queries and values projected, the keys x itself: under ``jax.checkpoint`` at batch 1
    the backward's v read its batch dimension as a unit one, and the backward was refused
    ('v as the program computes it lacks the kernel's batch dimension 0')."""
    return jax.nn.dot_product_attention(x @ w, x, x @ w, is_causal=True)


def einsum_sqrt_scale(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """benchmarks/workloads.py's decoder: the scale a runtime square root of a constant,
    a causal ``jnp.where`` on the f32 scores."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(H).astype(q.dtype)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def einsum_bnth_padding(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
                        ) -> jax.Array:
    """q, k, v as [B, N, T, H] (PyTorch ports): the kernel's batch merges B and N, and
    a key-padding mask [B, 1, 1, S] varies along one of them only (the pass wrote a
    bias that did not fill the merged dimension: an invalid module)."""
    scores = jnp.einsum("bnth,bnsh->bnts", q, k) * H ** -0.5
    scores = jnp.where(mask, scores, -1e9)
    return jnp.einsum("bnts,bnsh->bnth", jax.nn.softmax(scores, axis=-1), v)


def einsum_broadcast_causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A causal mask made with a heads axis it is the same along ([1, N, T, T], as
    nnx.make_causal_mask's batch axis): it was refused as 'a constant mask that varies
    along the batch or heads'."""
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (1, N, T, T))
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
    scores = jnp.where(causal, scores, -1e9)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def einsum_closed_causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A 0/1 float causal mask [1, 1, T, T] made outside the step, as Linen's
    ``make_causal_mask`` at batch 1: its batch axis is the scores' (both of size 1), and
    it was refused as 'a constant mask that varies along the batch or heads'."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
    scores = jnp.where(_CLOSED_CAUSAL, scores, -1e9)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


_CLOSED_CAUSAL = np.tril(np.ones((1, 1, T, T), np.float32))


def einsum_group_axis_mask(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
                           ) -> jax.Array:
    """A mask given with the scores' GQA group axis of size 1, [1, B, N, T, S] (as jax
    hoists a padding mask out of a remat'd scan): the size-1 axis counted as a second
    query dimension the mask varies along ('varies along more than one query
    dimension')."""
    b, t, n, h = q.shape
    scores = jnp.einsum("btngh,bsnh->gbnts", q.reshape(b, t, n, 1, h), k) * h ** -0.5
    scores = jnp.where(mask, scores, -1e9)
    out = jnp.einsum("gbnts,bsnh->btngh", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, t, n, h)


def einsum_float_padding(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
                         ) -> jax.Array:
    """A 0/1 float padding mask passed to ``jnp.where``, which reads it as ``mask != 0``
    inside its own function (it was refused as 'computed inside a called function')."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
    scores = jnp.where(mask, scores, -1e9)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def einsum_prefix_lm(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A prefix-LM mask: the first 5 positions see each other, the rest causal (a
    constant mask that is no band: written out in the kernel's bias)."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
    queries, keys = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    scores = jnp.where((keys <= queries) | (keys < 5), scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)


def programs() -> dict[str, Callable[[], tuple[Callable[..., Any], tuple]]]:
    """name -> a builder of (function, arguments): every way of writing attention the tests
    run. Built when called, not here: collecting the tests needs only the names, and the
    arrays and models cost each pytest worker 20 s of XLA compiles."""
    found: dict[str, Callable[[], tuple[Callable[..., Any], tuple]]] = {
        "dpa_causal_gqa": lambda: (_grad_of(dpa(is_causal=True)), _qkv()),
        "dpa_xla_scale": lambda: (_grad_of(dpa(scale=0.3, implementation="xla")), _qkv(N)),
        "dpa_padding_mask": lambda: (_grad_of(dpa()), (*_qkv(N), padding_mask())),
        "dpa_forward": lambda: (jax.jit(dpa(is_causal=True)), _qkv()),
        "llm_unrolled": lambda: llm_step(Llm()),
        "llm_unrolled_remat": lambda: llm_step(Llm(remat=True)),
        "llm_scan_remat": lambda: llm_step(Llm(scan=True, remat=True)),
        "equinox_no_mask": lambda: equinox_program(),
        "einsum_sqrt_scale": lambda: (_grad_of(einsum_sqrt_scale), _qkv(N)),
        "einsum_broadcast_causal": lambda: (_grad_of(einsum_broadcast_causal), _qkv(N)),
        "einsum_closed_causal_batch1": lambda: (_grad_of(einsum_closed_causal),
                                                tuple(a[:1] for a in _qkv(N))),
        "einsum_bnth_padding": lambda: (_grad_of(einsum_bnth_padding),
                                        (*(jnp.swapaxes(a, 1, 2) for a in _qkv(N)),
                                         padding_mask())),
        "einsum_float_padding": lambda: (_grad_of(einsum_float_padding),
                                         (*_qkv(N), padding_mask().astype(jnp.float32))),
        "dpa_one_kv_head_linear_loss": lambda: (
            jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v)),
                     argnums=(0, 1, 2)), (_qkv()[0], _qkv()[1][:, :, :1], _qkv()[2][:, :, :1])),
        "einsum_group_axis_mask": lambda: (
            _grad_of(einsum_group_axis_mask), (*_qkv(N), jax.random.bernoulli(
                jax.random.key(9), 0.7, (1, B, N, T, T)).at[..., 0].set(True))),
        "dpa_keys_as_given_batch1": lambda: (_grad_of(jax.checkpoint(dpa_keys_as_given), 2),
                                             (_normal(3, (1, T, N, H)),
                                              _normal(4, (H, H)) / 4)),
        # Constant masks cuDNN's causal type is not: the kernel's bias (a band from
        # positions, or written out).
        "dpa_sliding_window_gqa": lambda: (
            _grad_of(dpa(is_causal=True, local_window_size=(3, 0))), _qkv()),
        "dpa_two_sided_window_padding": lambda: (
            _grad_of(dpa(local_window_size=(4, 2), implementation="xla")),
            (*_qkv(N), padding_mask((T, T - 2)))),  # every query sees a key
        "einsum_prefix_lm": lambda: (_grad_of(einsum_prefix_lm), _qkv(N)),
        "dpa_causal_chunk_of_queries": lambda: (_grad_of(dpa(is_causal=True)),
                                                (_qkv()[0][:, :T // 2], *_qkv()[1:])),
        "dpa_gqa_decode_step": lambda: (jax.jit(dpa(is_causal=True)),
                                        (_qkv()[0][:, :1], *_qkv()[1:])),
        "dpa_constant_key_lengths": lambda: (
            _grad_of(dpa(key_value_seq_lengths=jnp.full((B,), T - 3), implementation="xla")),
            _qkv(N)),
        "dpa_constant_query_and_key_lengths": lambda: (
            jax.jit(dpa(query_seq_lengths=jnp.full((B,), T - 2),
                        key_value_seq_lengths=jnp.full((B,), T - 3), implementation="xla")),
            _qkv(N)),
        "dpa_sliding_window_constant_key_lengths": lambda: (
            _grad_of(dpa(is_causal=True, local_window_size=(4, 0),
                         key_value_seq_lengths=jnp.full((B,), T - 3), implementation="xla")),
            _qkv()),
        "dpa_causal_constant_key_lengths": lambda: (
            _grad_of(dpa(is_causal=True, key_value_seq_lengths=jnp.full((B,), T - 3),
                         implementation="xla")), _qkv()),
        "einsum_scan_prefix_lm": lambda: (jax.jit(einsum_scan_prefix_lm), (
            _normal(3, (B, T, N * H)), _normal(6, (2, 2, N * H, N * H)) / 8,
            padding_mask())),
        "einsum_integer_and_mask": lambda: (jax.jit(einsum_integer_and_mask), (
            *_qkv(N), jnp.array([[1, 2, 1, 2, 1, 2, 1, 3] * (T // 8)] * B, jnp.int32),
            jnp.array([[1, 1, 2, 2] * (T // 4)] * B, jnp.int32))),
        "einsum_sharding_constraints": lambda: (_grad_of(einsum_sharding_constraints), _qkv(N)),
        "dpa_scan_mask_closed_over": lambda: dpa_scan_mask_closed_over(),
        "dpa_scan_window_closed_over": lambda: dpa_scan_mask_closed_over(window=8),
        "dpa_scan_unrolled_twice": lambda: dpa_scan_mask_closed_over(unroll=2),
        "flax_combined_masks": lambda: (_grad_of(flax_combined_masks), (
            *_qkv(N), jnp.arange(T)[None] < jnp.array([[T], [T - 5]]))),
        "dpa_scan_causal_padding_gqa": lambda: dpa_scan_padding(causal=True),
        "dpa_scan_padding_gqa": lambda: dpa_scan_padding(causal=False),
    }
    for wrap in WRAPS:
        found[f"dpa_{wrap}"] = functools.partial(dpa_program, wrap)
        found[f"nnx_causal_{wrap}"] = functools.partial(nnx_program, wrap)
        found[f"linen_causal_{wrap}"] = functools.partial(linen_program, wrap)
        found[f"equinox_causal_{wrap}"] = functools.partial(equinox_program, wrap,
                                                            causal=True)
    return found


def max_relative_error(expected: Any, got: Any) -> float:
    """The largest |a - b| / max|a| over the leaves of two pytrees. A leaf that is zero
    in exact arithmetic (the gradient of a key bias: softmax ignores a shift along the
    keys) is measured against a tenth of the largest leaf's scale instead: what it
    holds is rounding noise of the terms that cancel."""
    pairs = [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in
             zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True)]
    largest = max(float(np.abs(a).max()) for a, _ in pairs)
    worst = 0.0
    for a, b in pairs:
        scale = max(float(np.abs(a).max()), 0.1 * largest) or 1.0
        worst = max(worst, float(np.abs(a - b).max()) / scale)
    return worst

