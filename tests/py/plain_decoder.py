"""A Llama-style decoder train step written plainly, for sharded compiles (issue 48).

No ``with_sharding_constraint`` on activations: only the parameters (Megatron's split on
``tp``, the other dimension on ``fsdp``) and the token batch (on ``fsdp``) are sharded,
as most users write it. RMSNorm in f32 cast back, rotate-half RoPE, causal attention
with GQA by ``jnp.repeat`` of K and V or by a grouped einsum, SwiGLU, an untied head,
next-token cross-entropy, SGD. The blocks unrolled (a Python loop) or scanned
(``jax.lax.scan`` over stacked parameters). Two front ends: plain pytrees and Flax NNX
(``nnx.Linear``, ``nnx.Embed``, ``nnx.RMSNorm``, split into a state for the step).

``step(cfg, dtype)`` is the f32 step for ``dtype=float32``, and the hand cast for
``bfloat16``: parameters cast where they are used, activations bf16, norms, RoPE,
softmax and the loss in f32.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hlo_amp


@dataclass(frozen=True)
class Cfg:
    layers: int = 1
    dim: int = 256
    heads: int = 8
    kv_heads: int = 2
    hidden: int = 512
    vocab: int = 1024
    seq: int = 256
    batch: int = 16
    gqa: str = "repeat"  # or "einsum": K and V read per group by a grouped einsum
    scan: bool = False
    remat: bool = False  # jax.checkpoint on each block (MaxText's scanned form)
    front: str = "pytree"  # or "nnx"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SPECS = {"wq": P("fsdp", "tp"), "wk": P("fsdp", "tp"), "wv": P("fsdp", "tp"),
         "wo": P("tp", "fsdp"), "w_gate": P("fsdp", "tp"), "w_up": P("fsdp", "tp"),
         "w_down": P("tp", "fsdp"), "attn_norm": P(), "mlp_norm": P()}


def _shapes(cfg: Cfg) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.dim, cfg.head_dim
    return {"wq": (d, cfg.heads * hd), "wk": (d, cfg.kv_heads * hd),
            "wv": (d, cfg.kv_heads * hd), "wo": (cfg.heads * hd, d), "w_gate": (d, cfg.hidden),
            "w_up": (d, cfg.hidden), "w_down": (cfg.hidden, d), "attn_norm": (d,),
            "mlp_norm": (d,)}


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (normed * weight).astype(x.dtype)


def rope(x: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim], rotate-half, in f32."""
    _, s, _, hd = x.shape
    half = hd // 2
    inv = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cfg: Cfg) -> jax.Array:
    """Causal GQA; q [b, s, heads, hd], k and v [b, s, kv_heads, hd] -> [b, s, dim]."""
    b, s, _, hd = q.shape
    groups = cfg.heads // cfg.kv_heads
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scale = jnp.asarray(1 / math.sqrt(hd), q.dtype)
    if cfg.gqa == "repeat":
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bshd,bthd->bhst", q, k) * scale
        weights = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -1e30), -1)
        out = jnp.einsum("bhst,bthd->bshd", weights.astype(q.dtype), v)
    else:
        q = q.reshape(b, s, cfg.kv_heads, groups, hd)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k) * scale
        weights = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -1e30), -1)
        out = jnp.einsum("bkgst,btkd->bskgd", weights.astype(q.dtype), v)
    return out.reshape(b, s, cfg.dim)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


# ---- plain pytrees ---------------------------------------------------------------------


def block(x: jax.Array, p: dict, cfg: Cfg, dtype: Any) -> jax.Array:
    b, s, _ = x.shape
    h = rms_norm(x, p["attn_norm"])
    q = (h @ p["wq"].astype(dtype)).reshape(b, s, cfg.heads, cfg.head_dim)
    k = (h @ p["wk"].astype(dtype)).reshape(b, s, cfg.kv_heads, cfg.head_dim)
    v = (h @ p["wv"].astype(dtype)).reshape(b, s, cfg.kv_heads, cfg.head_dim)
    x = x + attend(rope(q), rope(k), v, cfg) @ p["wo"].astype(dtype)
    h = rms_norm(x, p["mlp_norm"])
    gate = jax.nn.silu(h @ p["w_gate"].astype(dtype))
    return x + (gate * (h @ p["w_up"].astype(dtype))) @ p["w_down"].astype(dtype)


def pytree_loss(params: dict, tokens: jax.Array, cfg: Cfg, dtype: Any) -> jax.Array:
    x = params["embed"].astype(dtype)[tokens[:, :-1]]
    layer = lambda h, p: block(h, p, cfg, dtype)
    if cfg.remat:
        layer = jax.checkpoint(layer)
    if cfg.scan:
        x, _ = jax.lax.scan(lambda h, p: (layer(h, p), None), x, params["blocks"])
    else:
        for p in params["blocks"]:
            x = layer(x, p)
    logits = rms_norm(x, params["final_norm"]) @ params["head"].astype(dtype)
    return cross_entropy(logits, tokens[:, 1:])


def pytree_step(cfg: Cfg, dtype: Any) -> Callable:
    def step(params: dict, tokens: jax.Array) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(pytree_loss)(params, tokens, cfg, dtype)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss
    return step


def pytree_params(cfg: Cfg, mesh: Any) -> dict:
    """The parameters as sharded ``jax.ShapeDtypeStruct``s on ``mesh``."""
    def sds(shape: tuple, spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    shapes = _shapes(cfg)
    if cfg.scan:
        blocks: Any = {n: sds((cfg.layers, *shapes[n]), P(None, *SPECS[n])) for n in shapes}
    else:
        blocks = [{n: sds(shapes[n], SPECS[n]) for n in shapes} for _ in range(cfg.layers)]
    return {"embed": sds((cfg.vocab, cfg.dim), P("tp", "fsdp")), "blocks": blocks,
            "final_norm": sds((cfg.dim,), P()), "head": sds((cfg.dim, cfg.vocab), P("fsdp", "tp"))}


# ---- Flax NNX ------------------------------------------------------------------------------


def nnx_model(cfg: Cfg, dtype: Any) -> Any:
    """The same decoder as NNX modules; ``dtype`` is the modules' compute dtype (Flax's
    own hand cast: f32 parameters, cast to ``dtype`` where they are used)."""
    from flax import nnx

    def linear(n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
        return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, rngs=rngs)

    def norm(rngs: nnx.Rngs) -> nnx.RMSNorm:
        return nnx.RMSNorm(cfg.dim, epsilon=1e-5, dtype=dtype, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            d, hd = cfg.dim, cfg.head_dim
            self.attn_norm, self.mlp_norm = norm(rngs), norm(rngs)
            self.wq = linear(d, cfg.heads * hd, rngs)
            self.wk = linear(d, cfg.kv_heads * hd, rngs)
            self.wv = linear(d, cfg.kv_heads * hd, rngs)
            self.wo = linear(cfg.heads * hd, d, rngs)
            self.w_gate = linear(d, cfg.hidden, rngs)
            self.w_up = linear(d, cfg.hidden, rngs)
            self.w_down = linear(cfg.hidden, d, rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, s, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).reshape(b, s, cfg.heads, cfg.head_dim)
            k = self.wk(h).reshape(b, s, cfg.kv_heads, cfg.head_dim)
            v = self.wv(h).reshape(b, s, cfg.kv_heads, cfg.head_dim)
            x = x + self.wo(attend(rope(q), rope(k), v, cfg))
            h = self.mlp_norm(x)
            return x + self.w_down(nnx.silu(self.w_gate(h)) * self.w_up(h))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.layers)])
            self.final_norm = norm(rngs)
            self.head = linear(cfg.dim, cfg.vocab, rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.final_norm(x))

    return nnx.eval_shape(lambda: Decoder(nnx.Rngs(0)))


def nnx_step(cfg: Cfg, dtype: Any) -> tuple[Callable, Any]:
    """(step, graphdef): the step takes and returns the model's state (nnx.split)."""
    from flax import nnx

    graphdef, _ = nnx.split(nnx_model(cfg, dtype))

    def loss_fn(model: Any, tokens: jax.Array) -> jax.Array:
        return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])

    def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads))
        return nnx.state(model), loss
    return step, graphdef


def nnx_params(cfg: Cfg, mesh: Any) -> Any:
    from flax import nnx

    _, state = nnx.split(nnx_model(cfg, jnp.float32))

    def spec(path: tuple, leaf: Any) -> P:  # by the module's name, as PARAM_SPECS
        names = [str(getattr(k, "key", k)) for k in path]
        if "embed" in names:
            return P("tp", "fsdp")
        if "head" in names:
            return P("fsdp", "tp")
        return next((SPECS[n] for n in reversed(names) if n in SPECS), P())

    return jax.tree.map_with_path(lambda path, a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, spec(path, a))), state)


# ---- compiling for a target ------------------------------------------------------------------


def axes_for(target: str) -> dict[str, int]:
    """FSDP over all but a TP pair: 4x2 on a node of 8, 8x2 on 16 devices."""
    devices = 16 if target in ("h100:2x8", "tpu-v5e:4x4") else 8
    return {"fsdp": devices // 2, "tp": 2}


def step_and_args(cfg: Cfg, dtype: Any, target: str) -> tuple[Callable, tuple]:
    mesh = hlo_amp.target_mesh(target, axes_for(target))
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P("fsdp", None)))
    if cfg.front == "nnx":
        step, _ = nnx_step(cfg, dtype)
        return step, (nnx_params(cfg, mesh), tokens)
    return pytree_step(cfg, dtype), (pytree_params(cfg, mesh), tokens)


def compile_step(cfg: Cfg, variant: str, target: str) -> Any:
    """``variant`` ("f32", "hand", or an hlo_amp policy) compiled for ``target`` without
    the device: JAX's ``Compiled`` for f32 and the hand cast, else hlo_amp's."""
    from hlo_amp.runtime.deviceless import lower_for_target
    from hlo_amp.targets import device_target

    device = device_target(target)
    if variant in ("f32", "hand"):
        step, args = step_and_args(cfg, jnp.bfloat16 if variant == "hand" else jnp.float32,
                                   target)
        return lower_for_target(jax.jit(step), args, {}, device).compile(
            device.compiler_options)
    step, args = step_and_args(cfg, jnp.float32, target)
    return hlo_amp.compile(step, variant).lower(*args, target=device).compile()


# ---- the partitioning plan, read back --------------------------------------------------------


def replica_groups(attrs: str) -> Any:
    """An instruction's ``replica_groups`` as a frozenset of device sets, from any of XLA's
    spellings (``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)``, ``mesh[...] {'axis'}``); a
    collective-permute's ``source_target_pairs`` text; None for none."""
    import numpy as np

    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?"
                     r"\s*\{([^}]*)\}", attrs)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        if mesh.group(2):
            ids = np.array([int(d) for d in mesh.group(2).split(",")]).reshape(sizes)
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(3))]
        rest = [i for i in range(len(names)) if i not in chosen]
        rows = ids.transpose(rest + chosen).reshape(-1, math.prod(sizes[i] for i in chosen))
        return frozenset(frozenset(map(int, row)) for row in rows)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if iota:
        dims = [int(x) for x in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(x) for x in iota.group(4).split(",")])
        rows = ids.reshape(int(iota.group(1)), int(iota.group(2)))
        return frozenset(frozenset(map(int, row)) for row in rows)
    listed = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if listed:
        return frozenset(frozenset(int(x) for x in group.split(",") if x)
                         for group in re.findall(r"\{([0-9,]*)\}", listed.group(1)))
    pairs = re.search(r"source_target_pairs=(\{[^=]*?\})(?:,|$)", attrs)
    return pairs.group(1) if pairs else None


def plan(hlo_text: str) -> Counter:
    """The partitioning plan as it shows in a compiled step's collectives, element types
    left out: per (kind, an array's shape without size-1 dimensions, replica groups) the
    executions per step of the collectives that move such an array. Arrays rather than
    collectives: XLA combines collectives up to a byte threshold, so bf16 arrays combine
    in other groups than f32 ones of the same plan."""
    from hlo_amp.targets.collectives import read_collectives
    from hlo_amp.targets.hlo_text import parse_module

    computations, _ = parse_module(hlo_text)
    instructions = {i.name: i for body in computations.values() for i in body}
    out: Counter = Counter()
    for collective in read_collectives(hlo_text):
        inst = instructions[collective.name]
        groups = replica_groups(inst.attrs)
        for array in inst.arrays:
            if array.dtype != "token":
                shape = tuple(d for d in array.shape if d != 1)
                out[(collective.kind, shape, groups)] += collective.count
    return out


def collective_bytes(hlo_text: str) -> int:
    """Bytes per device per step over every collective (``report().collectives``'s)."""
    from hlo_amp.targets.collectives import read_collectives

    return sum(c.bytes * c.count for c in read_collectives(hlo_text))
