"""A Llama-style decoder train step, sharded FSDP x TP, compiled for a mesh target.

The model is written the way such models are written in JAX: a pytree of f32 arrays and
pure functions. RMSNorm, rotary position embeddings (RoPE, the rotate-half form), grouped
query attention (GQA) with a causal mask, a SwiGLU MLP, pre-norm residual blocks, an
untied output head, softmax cross-entropy on the next token, and AdamW. The default size
is about 1B parameters (16 layers, d_model 2048, 32 heads over 8 KV heads, SwiGLU 8192,
vocab 32k, 2048 tokens; Llama 3.2 1B's shape with a 32k vocabulary); ``SMALL`` is for
quick runs. The blocks are scanned by default (``Config.scan_layers``: parameters stacked
on a leading layer axis, ``jax.lax.scan`` with ``jax.checkpoint`` on its body, as MaxText
and ``nnx.scan`` write large models), which keeps the compile time flat in depth;
``--no-scan`` unrolls them into a Python loop over a list of blocks.

Parameters (and the optimizer's moments) are ``NamedSharding``s on
``hlo_amp.target_mesh(target, {"fsdp": F, "tp": T})``: the Megatron split (column-parallel
q/k/v, gate and up projections, row-parallel output and down projections) on ``tp``, and
the other dimension on ``fsdp``; the batch is split on ``fsdp``.

Variants, each compiled for a target without the device by `compile_variant`:

* ``f32`` — the f32 step under ``jax.jit``;
* ``hand-cast bf16`` — the peer written by hand: parameters cast to bf16 where they are
  used, activations bf16, RMSNorm, RoPE, softmax and the loss in f32 (what a bf16 Llama
  port does);
* ``hlo_amp bf16``, ``hlo_amp mixed_bfloat16`` — the f32 step, unchanged, through
  ``hlo_amp.compile(step, policy)``.

    python -m benchmarks.llm --device h100x8-aot --small
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hlo_amp
from benchmarks.cli_args import check_out_file, positive_int
from hlo_amp.targets import device_target, refuse_policy_on_device


@dataclass(frozen=True)
class Config:
    """The model's shape and the batch."""

    vocab: int = 32000
    dim: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    hidden: int = 8192  # SwiGLU's inner width
    seq: int = 2048
    batch: int = 16  # global: split over the fsdp axis
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    remat: bool = True  # recompute each block in the backward pass, as large steps do
    # The blocks' parameters stacked on a leading layer axis and the blocks a
    # ``jax.lax.scan`` (MaxText's ``scan_layers``): one block in the HLO, so the compile
    # time does not grow with depth. False: a Python loop over a list of blocks (unrolled).
    scan_layers: bool = True
    # The residual stream constrained to the batch over fsdp (``with_sharding_constraint``
    # after each block). False (``--no-constraints``): only parameters and tokens sharded,
    # as most users write it, and XLA's partitioner places the activations (issue 48).
    constraints: bool = True
    learning_rate: float = 3e-4
    weight_decay: float = 0.1
    # How the model writes attention: "einsum" (softmax(QKᵀ)V by hand, GQA groups, an f32
    # softmax) or "dot_product_attention" (``jax.nn.dot_product_attention``, is_causal).
    attention: str = "einsum"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SMALL = Config(vocab=1024, dim=256, layers=2, heads=4, kv_heads=2, hidden=512, seq=128,
               batch=16)
HLO_AMP_POLICIES = {"hlo_amp bf16": "bf16", "hlo_amp mixed_bfloat16": "mixed_bfloat16",
                    "hlo_amp mixed reduce=bfloat16": "mixed_bfloat16,reduce=bfloat16",
                    # The other two settings of reduce= (docs/policies.md): the accurate
                    # mode's gradient sums in 16 bit, the fast mode's in f32.
                    "hlo_amp bf16 reduce=bfloat16": "bf16,reduce=bfloat16",
                    "hlo_amp mixed reduce=float32": "mixed_bfloat16,reduce=float32",
                    "hlo_amp fp8": "fp8",
                    # Delayed scaling: the amax history carried between calls.
                    "hlo_amp fp8 delayed": "fp8,scaling=delayed"}
# The peer a user writes for speed: bf16 by hand and jax.nn.dot_product_attention's cuDNN
# kernel (whatever --attention says).
CUDNN_PEER = "hand-cast bf16 cudnn"
VARIANTS = ("f32", "hand-cast bf16", CUDNN_PEER, *HLO_AMP_POLICIES)
# The benchmark's devices: one 8-GPU node, a 16-chip v5e slice (TPUs refuse fp8), one H100 (the
# fused-attention rows: one device, no partitioning).
DEVICES = {"h100x8-aot": "h100x8", "tpu-v5e-16-aot": "tpu-v5e:4x4", "h100-aot": "h100"}


# ---- parameters and their shardings ---------------------------------------------------------


def param_shapes(config: Config) -> dict[str, Any]:
    """The parameter tree's shapes: embedding, blocks, norm, head. The blocks are one dict
    of arrays with a leading layer axis when ``config.scan_layers``, else a list of dicts."""
    d, hd = config.dim, config.head_dim
    block = {"attn_norm": (d,), "wq": (d, config.heads * hd), "wk": (d, config.kv_heads * hd),
             "wv": (d, config.kv_heads * hd), "wo": (config.heads * hd, d), "mlp_norm": (d,),
             "w_gate": (d, config.hidden), "w_up": (d, config.hidden),
             "w_down": (config.hidden, d)}
    blocks: Any = ({name: (config.layers, *shape) for name, shape in block.items()}
                   if config.scan_layers else [dict(block) for _ in range(config.layers)])
    return {"embed": (config.vocab, d), "blocks": blocks, "final_norm": (d,),
            "head": (d, config.vocab)}


# Megatron's split on tp, the other dimension on fsdp; norms replicated.
PARAM_SPECS = {"embed": P("tp", "fsdp"), "head": P("fsdp", "tp"), "final_norm": P(),
               "attn_norm": P(), "mlp_norm": P(), "wq": P("fsdp", "tp"), "wk": P("fsdp", "tp"),
               "wv": P("fsdp", "tp"), "wo": P("tp", "fsdp"), "w_gate": P("fsdp", "tp"),
               "w_up": P("fsdp", "tp"), "w_down": P("tp", "fsdp")}


def param_count(config: Config) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)))


def block_spec(name: str, config: Config) -> P:
    """A block parameter's spec: PARAM_SPECS's, after ``None`` for the layer axis when
    the blocks are stacked (each device holds its shard of every layer)."""
    return P(None, *PARAM_SPECS[name]) if config.scan_layers else PARAM_SPECS[name]


def _specs(config: Config) -> dict[str, Any]:
    blocks = param_shapes(config)["blocks"]
    return {"embed": PARAM_SPECS["embed"], "final_norm": PARAM_SPECS["final_norm"],
            "head": PARAM_SPECS["head"],
            "blocks": ({name: block_spec(name, config) for name in blocks}
                       if config.scan_layers else
                       [{name: PARAM_SPECS[name] for name in block} for block in blocks])}


def init_params(config: Config, key: jax.Array) -> dict[str, Any]:
    """Random f32 parameters (normal, std 0.02; norms at 1). The unrolled and the scanned
    forms of one config get the same values (the scanned blocks are the list's stack)."""
    unrolled = param_shapes(dataclasses.replace(config, scan_layers=False))
    leaves, tree = jax.tree.flatten(unrolled, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    values = [jnp.ones(s, jnp.float32) if len(s) == 1
              else 0.02 * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, leaves)]
    params = jax.tree.unflatten(tree, values)
    if config.scan_layers:
        params["blocks"] = jax.tree.map(lambda *layers: jnp.stack(layers), *params["blocks"])
    return params


# ---- the model ---------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in f32, returned in x's dtype (Llama's reference does the same)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight).astype(x.dtype)


def rope_tables(config: Config) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position x frequency, [seq, head_dim], f32."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = jnp.arange(config.seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim]; the rotate-half form, in f32."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x32 * cos + rotated * sin).astype(x.dtype)


ATTENTION_FORMS = ("einsum", "dot_product_attention")


def attention(x: jax.Array, block: dict, config: Config, rope: tuple, dtype: Any,
              implementation: str | None = None) -> jax.Array:
    """Grouped-query causal self-attention, written as ``config.attention`` says;
    ``implementation`` ("cudnn", the hand-cast peer's) makes it
    ``jax.nn.dot_product_attention`` with that implementation whatever the config."""
    b, s, _ = x.shape
    hd, kv, groups = config.head_dim, config.kv_heads, config.heads // config.kv_heads
    q = (x @ block["wq"].astype(dtype)).reshape(b, s, config.heads, hd)
    k = (x @ block["wk"].astype(dtype)).reshape(b, s, kv, hd)
    v = (x @ block["wv"].astype(dtype)).reshape(b, s, kv, hd)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if implementation is not None or config.attention == "dot_product_attention":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=implementation)
        return out.reshape(b, s, config.heads * hd) @ block["wo"].astype(dtype)
    q = q.reshape(b, s, kv, groups, hd)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k) / jnp.asarray(math.sqrt(hd), dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", weights, v).reshape(b, s, config.heads * hd)
    return out @ block["wo"].astype(dtype)


def mlp(x: jax.Array, block: dict, dtype: Any) -> jax.Array:
    """SwiGLU."""
    gate = jax.nn.silu(x @ block["w_gate"].astype(dtype))
    return (gate * (x @ block["w_up"].astype(dtype))) @ block["w_down"].astype(dtype)


def forward(params: dict, tokens: jax.Array, config: Config, dtype: Any = jnp.float32,
            mesh: Any = None, implementation: str | None = None) -> jax.Array:
    """Logits [batch, seq, vocab] in f32; ``dtype`` is the activations' (and the cast
    parameters') type: f32 for the plain model, bf16 for the hand-cast peer."""
    rope = rope_tables(config)
    x = params["embed"].astype(dtype)[tokens]

    def residual(h: jax.Array) -> jax.Array:  # the residual stream: batch over fsdp
        if mesh is None:
            return h
        return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("fsdp", None, None)))

    def block_fn(h: jax.Array, block: dict) -> jax.Array:
        h = residual(h + attention(rms_norm(h, block["attn_norm"], config.norm_eps), block,
                                   config, rope, dtype, implementation))
        return residual(h + mlp(rms_norm(h, block["mlp_norm"], config.norm_eps), block, dtype))

    if config.remat:
        block_fn = jax.checkpoint(block_fn)
    x = residual(x)
    if config.scan_layers:  # one block's program, a while loop over the stacked layers
        x, _ = jax.lax.scan(lambda h, block: (block_fn(h, block), None), x, params["blocks"])
    else:
        for block in params["blocks"]:
            x = block_fn(x, block)
    x = rms_norm(x, params["final_norm"], config.norm_eps)
    return (x @ params["head"].astype(dtype)).astype(jnp.float32)


def loss_fn(params: dict, tokens: jax.Array, config: Config, dtype: Any = jnp.float32,
            mesh: Any = None, implementation: str | None = None) -> jax.Array:
    """Next-token cross-entropy, in f32; ``tokens`` is [batch, seq + 1]."""
    logits = forward(params, tokens[:, :-1], config, dtype, mesh, implementation)
    targets = tokens[:, 1:]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def make_train_step(config: Config, dtype: Any = jnp.float32, mesh: Any = None,
                    implementation: str | None = None) -> Callable:
    """(params, opt_state, tokens) -> (params, opt_state, loss), AdamW."""
    b1, b2, eps = 0.9, 0.95, 1e-8

    def train_step(params: dict, opt_state: dict, tokens: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config, dtype, mesh,
                                                  implementation)
        count = opt_state["count"] + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt_state["mu"], grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt_state["nu"], grads)
        scale_mu, scale_nu = 1 - b1 ** count, 1 - b2 ** count

        def update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
            step = (m / scale_mu) / (jnp.sqrt(v / scale_nu) + eps)
            return p - config.learning_rate * (step + config.weight_decay * p)

        params = jax.tree.map(update, params, mu, nu)
        return params, {"count": count, "mu": mu, "nu": nu}, loss

    return train_step


# ---- compiling for a target ------------------------------------------------------------------------


def default_axes(devices: int) -> dict[str, int]:
    """FSDP over most devices, TP 2 where the count is even."""
    tp = 2 if devices % 2 == 0 else 1
    return {"fsdp": devices // tp, "tp": tp}


def abstract_state(config: Config, mesh: Any) -> tuple[Any, Any, Any]:
    """(params, opt_state, tokens) as sharded ``jax.ShapeDtypeStruct``s on ``mesh``."""
    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    for name, size, axis in (("batch", config.batch, fsdp), ("heads", config.heads, tp),
                             ("kv_heads", config.kv_heads, tp), ("vocab", config.vocab, tp),
                             ("dim", config.dim, fsdp)):
        if size % axis:
            raise ValueError(f"{name}={size} does not split over a mesh axis of {axis} "
                             f"(mesh {dict(mesh.shape)}); choose sizes it divides")

    def sds(shape: tuple, spec: P, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)
    params = jax.tree.map(sds, param_shapes(config), _specs(config), is_leaf=is_shape)
    opt_state = {"count": sds((), P(), jnp.int32), "mu": params, "nu": params}
    tokens = sds((config.batch, config.seq + 1), P("fsdp", None), jnp.int32)
    return params, opt_state, tokens


def variant_step(variant: str, config: Config, mesh: Any = None) -> Callable:
    """The train step a variant runs: f32 (also what hlo_amp rewrites), bf16 by hand,
    bf16 by hand with cuDNN's attention."""
    if variant == "f32" or variant in HLO_AMP_POLICIES:
        return make_train_step(config, jnp.float32, mesh)
    if variant == "hand-cast bf16":
        return make_train_step(config, jnp.bfloat16, mesh)
    if variant == CUDNN_PEER:
        return make_train_step(config, jnp.bfloat16, mesh, implementation="cudnn")
    raise ValueError(f"variant={variant!r}; accepted: {', '.join(VARIANTS)}")


# The train step donates its parameters and optimizer state, as a training loop does and
# as --device gpu runs it: XLA then cannot keep temporaries in the not-yet-written output
# buffers, and its temp is the memory the step needs beyond its state.
DONATED = (0, 1)


def compile_variant(variant: str, target: str, config: Config = Config(),
                    axes: dict[str, int] | None = None,
                    seconds: dict[str, float] | None = None, donate: bool = True) -> Any:
    """``variant`` of the train step compiled for ``target`` (``"h100x8"``,
    ``"tpu-v5e:4x4"``) without the device: JAX's ``Compiled`` for the jax.jit variants,
    hlo_amp's ``AmpCompiled`` (with ``report()``) for the hlo_amp ones; parameters and
    optimizer state donated unless ``donate`` is False. ``seconds``, if given, receives
    ``lower``, ``pass`` (hlo_amp only: the fastest of ``PASS_RUNS`` runs of the pipeline)
    and ``compile``."""
    donated = DONATED if donate else ()
    device = device_target(target)
    mesh = hlo_amp.target_mesh(device, axes or default_axes(device.devices))
    args = abstract_state(config, mesh)
    constrained = mesh if config.constraints else None  # forward() constrains on a mesh
    step = variant_step(variant, config, constrained)
    timed = seconds is not None
    seconds = {} if seconds is None else seconds
    if variant in HLO_AMP_POLICIES:
        def lower() -> Any:
            return hlo_amp.compile(step, HLO_AMP_POLICIES[variant],
                                   donate_argnums=donated).lower(*args, target=device)

        lowered = lower()
        compiled = lowered.compile()
        seconds.update({"lower": lowered.lower_seconds,
                        "pass": (_pass_seconds(lowered.pass_seconds, lower) if timed
                                 else lowered.pass_seconds),
                        "compile": compiled.compile_seconds})
        return compiled
    from hlo_amp.runtime.deviceless import compile_lowered, lower_for_target

    start = time.perf_counter()
    # lower_for_target answers jax's cuDNN checks for the peer's cuDNN attention.
    lowered = lower_for_target(jax.jit(step, donate_argnums=donated), args, {}, device)
    middle = time.perf_counter()
    compiled = compile_lowered(lowered, device.compiler_options)
    seconds.update({"lower": middle - start, "compile": time.perf_counter() - middle})
    return compiled


# Runs of the pipeline per hlo_amp row. One run takes 0.02 to 0.15 s here, and the same
# run takes up to 1.8 times as long from one call to the next on a shared 2-core machine
# (so does a pure-Python loop; no garbage collection runs inside it): the fastest of
# five is the figure, the first call one of them, as benchmarks/stress.py's best of 3.
PASS_RUNS = 5


def _pass_seconds(first: float, again: Any) -> float:
    """The fastest of ``first`` (the run ``.lower()`` made) and ``PASS_RUNS - 1`` more
    runs of hlo_amp's pipeline, each from ``again()`` (a fresh ``.lower()``: JAX's
    lowering is cached, the pipeline runs again on a copy of the module)."""
    return min([first] + [again().pass_seconds for _ in range(PASS_RUNS - 1)])


def row(variant: str, target: str, config: Config, donate: bool = True) -> dict[str, Any]:
    """One benchmark row: per-device memory, collective bytes by element type, FLOP
    shares, the roofline step estimate (compute, HBM and link time) and the seconds."""
    from hlo_amp.targets.roofline import estimate

    seconds: dict[str, float] = {}
    compiled = compile_variant(variant, target, config, seconds=seconds, donate=donate)
    hlo = compiled.as_text()
    memory = compiled.memory_analysis()
    model = estimate(hlo, device_target(target))  # its collectives: the step's, read once
    by_type: dict[str, int] = {}
    for collective in model.collectives:
        kind = "+".join(sorted(set(collective.element_types))) or "?"
        by_type[kind] = by_type.get(kind, 0) + collective.bytes * collective.count
    return {"variant": variant, "temp": memory.temp_size_in_bytes,
            "arguments": memory.argument_size_in_bytes, "collectives": by_type,
            "share_16bit": model.share_16bit, "share_fp8": model.share_fp8,
            "gemm_share_fp8": model.gemm_share_fp8,
            "kernel_s": model.kernel_seconds, "link_s": model.collective_seconds,
            "step_s": model.roofline_seconds, **{f"{k}_s": v for k, v in seconds.items()}}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as a markdown table, ratios against the f32 row."""
    base = next((r for r in rows if r["variant"] == "f32"), None)
    out = [("| variant | temp MiB/device | vs f32 | args MiB/device | collective MiB/device "
            "by type | 16-bit / fp8 FLOPs (fp8 of GEMMs) | roofline ms (compute+HBM, link) | vs f32 | lower s "
            "| pass s (share of compile) | compile s |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{_mib(b)} {t}" for t, b in sorted(r["collectives"].items()))

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / base[key]:.2f}×" if base and base[key] else "-"
        shares = f"{100 * r['share_16bit']:.0f}% / {100 * r['share_fp8']:.0f}%" + (
            f" ({100 * r['gemm_share_fp8']:.1f}%)" if r.get("gemm_share_fp8") else "")
        pass_cell = (f"{r['pass_s']:.2f} ({100 * r['pass_s'] / r['compile_s']:.1f}%)"
                     if "pass_s" in r else "-")
        out.append(
            f"| {r['variant']} | {_mib(r['temp'])} | {ratio('temp')} | {_mib(r['arguments'])} "
            f"| {kinds or '-'} | {shares} "
            f"| {1e3 * r['step_s']:.4g} ({1e3 * r['kernel_s']:.4g}, {1e3 * r['link_s']:.3g}) "
            f"| {ratio('step_s')} | {r['lower_s']:.1f} | {pass_cell} | {r['compile_s']:.1f} |")
    return out


def _machine() -> str:
    """This machine's CPU and whether it has AVX512-BF16 (compile times depend on it)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = "with `avx512_bf16`" if "avx512_bf16" in info else "without `avx512_bf16`"
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs, {flags}"


def section_key(device: str, config: Config, donate: bool = True) -> str:
    """The name of ``device``'s RESULTS.md section: one more without constraints, one
    more per attention form other than the einsum, one more without donation."""
    key = device.removesuffix("-aot") + ("" if config.constraints else " --no-constraints")
    key = key if config.attention == "einsum" else f"{key} --attention {config.attention}"
    return key if donate else f"{key} --no-donate"


def section(device: str, config: Config, rows: list[dict[str, Any]],
            refused: dict[str, str], command: str, donate: bool = True) -> list[str]:
    """The RESULTS.md section for one device: header lines, the table, the refusals."""
    target = device_target(DEVICES.get(device, device))
    key = section_key(device, config, donate)
    layer_form = ("layers scanned (`jax.lax.scan` over stacked block parameters)"
                  if config.scan_layers else "layers unrolled (a Python loop)")
    if not config.constraints:
        layer_form += "; no activation constraints (the residual stream unconstrained)"
    return [f"<!-- benchmarks.llm --device {key}: begin (replaced by each run) -->",
            (f"## LLM-scale: Llama-style decoder on {target.description}, compiled without "
            "a device"),
            "",
            (f"- model: {param_count(config) / 1e9:.2f}B parameters ({config.layers} layers, "
            f"d {config.dim}, {config.heads} heads / {config.kv_heads} KV, SwiGLU "
            f"{config.hidden}, vocab {config.vocab}, seq {config.seq}, global batch "
            f"{config.batch}); {layer_form}; FSDP × TP {default_axes(target.devices)}; "
            f"AdamW; remat per block; "
            f"{'parameters and optimizer state donated' if donate else 'nothing donated'}; "
            f"attention written as {config.attention} "
            f"(`{CUDNN_PEER}`: `jax.nn.dot_product_attention(implementation=\"cudnn\")`)"),
            f"- command: `{command}`; jax {jax.__version__}; compiled on {_machine()}",
            ("- per device: XLA's temp and argument bytes (`memory_analysis()`); collective "
            "bytes from the optimized HLO (`hlo_amp/targets/collectives.py`, result bytes "
            "for all-gathers, operand bytes otherwise, loops × trip count); FLOP shares (of "
            "GEMMs, convolutions and fused attention; in brackets fp8's of GEMMs alone) and "
            "the roofline from `hlo_amp/targets/roofline.py` (compute and HBM per kernel, "
            "plus link time at the target's published bandwidth, no overlap); pass s: the "
            f"fastest of {PASS_RUNS} runs of hlo_amp's pipeline on the lowered module "
            "(copy, passes, verify; one run varies up to 1.8× here), compile s: one"),
            "", *table(rows), "",
            *[f"- {variant}: not compiled: {why}" for variant, why in refused.items()],
            f"<!-- benchmarks.llm --device {key}: end -->"]


def write_section(path: Path, lines: list[str], key: str,
                  marker: str = "benchmarks.llm --device") -> None:
    """Replace the section of ``path`` between ``<!-- {marker} {key}: begin`` and its end
    comment (or append it)."""
    text = path.read_text() if path.exists() else ""
    begin = f"<!-- {marker} {key}: begin"
    end = f"<!-- {marker} {key}: end -->"
    block = "\n".join(lines)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def recorded_command(argv: list[str] | None) -> str:
    """The command line a results section records, quoted as a shell reads it
    (``--variant "hlo_amp bf16"``)."""
    return "python -m benchmarks.llm " + shlex.join(argv if argv is not None else sys.argv[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100x8-aot",
                        help=f"{', '.join(DEVICES)}, or any target name (h100x8, "
                        "tpu-v5e:4x4): compiled without the device; "
                        f"{' or '.join(LOCAL_DEVICES)}: trained on this machine's device")
    parser.add_argument("--small", action="store_true", help="the SMALL preset")
    parser.add_argument("--layers", type=positive_int,
                        help="override the preset's layer count")
    parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                        help="the blocks as a jax.lax.scan over stacked parameters (the "
                        "default) or, with --no-scan, a Python loop (unrolled)")
    parser.add_argument("--no-constraints", action="store_true",
                        help="no with_sharding_constraint on the residual stream: only "
                        "parameters and tokens sharded (a section of its own in --results)")
    parser.add_argument("--no-donate", action="store_true",
                        help="compile the step without donating parameters and optimizer "
                        "state (XLA may then keep temporaries in the output buffers: a "
                        "smaller temp; a section of its own in --results); for compiles "
                        "without a device: --device gpu/cpu runs donate, as training does")
    parser.add_argument("--variant", action="append", choices=VARIANTS,
                        help="compile only these (default: all)")
    parser.add_argument("--attention", choices=ATTENTION_FORMS,
                        help="how the model writes attention (default: einsum)")
    parser.add_argument("--batch", type=positive_int,
                        help="override the preset's global batch")
    parser.add_argument("--seq", type=positive_int,
                        help="override the preset's sequence length")
    parser.add_argument("--steps", type=positive_int, default=10,
                        help="--device gpu/cpu: timed steps per variant (median)")
    parser.add_argument("--results", type=Path,
                        help="write the table into this markdown file (benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    if args.results is not None:  # not after every variant compiled or ran: a traceback
        check_out_file(parser, "--results", args.results)
    config = SMALL if args.small else Config()
    if args.layers is not None:
        config = dataclasses.replace(config, layers=args.layers)
    if args.scan is not None:
        config = dataclasses.replace(config, scan_layers=args.scan)
    if args.no_constraints:
        config = dataclasses.replace(config, constraints=False)
    for name in ("attention", "batch", "seq"):
        if getattr(args, name) is not None:
            config = dataclasses.replace(config, **{name: getattr(args, name)})
    if args.device in LOCAL_DEVICES:
        platform = jax.devices()[0].platform
        if (args.device == "gpu") != (platform == "gpu"):  # as benchmarks.run refuses it
            parser.error(f"--device {args.device} asked, but jax runs on {platform}")
        run_local(args, config, argv)
        return
    try:
        target = device_target(DEVICES.get(args.device, args.device))
        # The mesh each variant compiles on: a batch it cannot split is refused here.
        abstract_state(config, hlo_amp.target_mesh(target, default_axes(target.devices)))
    except ValueError as error:
        parser.error(f"--device {args.device}: {error}")
    print(f"{param_count(config) / 1e9:.3f}B parameters, {target.description}", flush=True)
    rows, refused = [], {}
    donate = not args.no_donate
    for variant in args.variant or VARIANTS:
        if variant == CUDNN_PEER and target.compute_capability is None:
            refused[variant] = (f"jax.nn.dot_product_attention(implementation=\"cudnn\") "
                                f"runs on an NVIDIA GPU only, not on {target.description}")
            print(f"{variant:32s} refused: {refused[variant]}", flush=True)
            continue
        if variant in HLO_AMP_POLICIES:
            try:
                refuse_policy_on_device(hlo_amp.Policy.parse(HLO_AMP_POLICIES[variant]), target)
            except ValueError as error:
                refused[variant] = str(error)
                print(f"{variant:32s} refused: {error}", flush=True)
                continue
        rows.append(row(variant, target.name, config, donate=donate))
        print("\n".join(table(rows)[-1:]), flush=True)
    if args.results:
        write_section(args.results,
                      section(args.device, config, rows, refused, recorded_command(argv),
                              donate),
                      section_key(args.device, config, donate))
        print(f"wrote {args.results}")


# ---- running on this machine's device ---------------------------------------------------------

LOCAL_DEVICES = ("gpu", "cpu")
# What --device gpu runs by default (the reduce= settings matter on a mesh only).
LOCAL_VARIANTS = ("f32", "hand-cast bf16", CUDNN_PEER, "hlo_amp bf16", "hlo_amp mixed_bfloat16",
                  "hlo_amp fp8", "hlo_amp fp8 delayed")


class CarryingHistory:
    """A compiled ``scaling=delayed`` step (the amax history in, ``(outputs, history)``
    out) called as the step itself: it keeps the history between calls, as the object
    ``hlo_amp.compile`` returns does; anything else is the compiled step's."""

    def __init__(self, compiled: Any, length: int):
        self.compiled = compiled
        self.history = jnp.zeros((length, compiled.report().fp8_state_columns),
                                 jnp.float32)

    def __call__(self, *args: Any) -> Any:
        out, self.history = self.compiled(self.history, *args)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def model_flops(config: Config) -> float:
    """PaLM's model FLOPs of one train step (appendix B): 6 per parameter outside the
    embedding table and token, plus 12 · layers · d · seq per token for attention."""
    weights = param_count(config) - config.vocab * config.dim
    tokens = config.batch * config.seq
    return (6 * weights + 12 * config.layers * config.dim * config.seq) * tokens


def local_step(variant: str, config: Config) -> Callable:
    """The variant's train step as a callable for this machine's device."""
    step = variant_step(variant, config)
    if variant in HLO_AMP_POLICIES:
        return hlo_amp.compile(step, HLO_AMP_POLICIES[variant], donate_argnums=DONATED)
    return jax.jit(step, donate_argnums=DONATED)


def local_row(variant: str, config: Config, steps: int, roofline_target: Any) -> dict:
    """One variant run ``steps`` times on this machine's first device: the median step
    (``block_until_ready``), XLA's temp bytes, the device's peak bytes in use, the first
    and last loss, and the roofline estimate of the same compiled step."""
    import numpy as np

    from hlo_amp.targets.roofline import estimate

    step = local_step(variant, config)
    params = init_params(config, jax.random.key(0))
    opt_state = {"count": jnp.zeros((), jnp.int32), "mu": jax.tree.map(jnp.zeros_like, params),
                 "nu": jax.tree.map(jnp.zeros_like, params)}
    tokens = jax.random.randint(jax.random.key(1), (config.batch, config.seq + 1), 0,
                                config.vocab)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, tokens).compile()
    compile_s = time.perf_counter() - start
    run = compiled
    if hasattr(step, "fp8_state"):  # scaling=delayed: the compiled step takes the history
        run = CarryingHistory(compiled, step.policy.amax_history)
    temp = compiled.memory_analysis().temp_size_in_bytes
    roofline = (estimate(compiled.as_text(), roofline_target).roofline_seconds
                if roofline_target is not None else None)
    report = compiled.report() if hasattr(compiled, "report") else None
    losses, times = [], []
    for _ in range(steps + 2):  # two warm-up steps
        begin = time.perf_counter()
        params, opt_state, loss = run(params, opt_state, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - begin)
        losses.append(float(loss))
    stats = jax.devices()[0].memory_stats() or {}
    median = float(np.median(times[2:]))
    peak_flops = (roofline_target.peak_flops.get("bf16") if roofline_target is not None
                  else None)
    return {"variant": variant, "step_s": median, "temp": temp,
            "peak": stats.get("peak_bytes_in_use"), "first_loss": losses[0],
            "last_loss": losses[-1], "roofline_s": roofline, "compile_s": compile_s,
            "mfu": model_flops(config) / median / peak_flops if peak_flops else None,
            "attention": report.attention_clause() if report is not None and
            report.attention else ""}


def local_table(rows: list[dict]) -> list[str]:
    base = next((r for r in rows if r["variant"] == "f32"), None)
    out = [("| variant | step ms | vs f32 | MFU | XLA temp MiB | peak MiB | loss first → last "
            "| roofline ms | measured / roofline | compile s | attention |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{base['step_s'] / r['step_s']:.2f}×" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        peak = _mib(r["peak"]) if r["peak"] else "-"
        roof = f"{1e3 * r['roofline_s']:.4g}" if r["roofline_s"] else "-"
        ratio = f"{r['step_s'] / r['roofline_s']:.2f}" if r["roofline_s"] else "-"
        out.append(f"| {r['variant']} | {1e3 * r['step_s']:.1f} | {speed} | {mfu} | "
                   f"{_mib(r['temp'])} | {peak} | {r['first_loss']:.4f} → "
                   f"{r['last_loss']:.4f} | {roof} | {ratio} | {r['compile_s']:.1f} | "
                   f"{r['attention'] or '-'} |")
    return out


def run_local(args: Any, config: Config, argv: list[str] | None) -> None:
    """``--device gpu`` (or ``cpu``, a smoke run): every variant trained ``--steps``
    steps on this machine's first device, one device (no sharding), a table."""
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    known = next((name for name in ("h200", "h100", "a100") if name in kind.lower()), None)
    roofline_target = device_target(known) if known else None
    print(f"{param_count(config) / 1e9:.3f}B parameters on {kind}; batch {config.batch} x "
          f"seq {config.seq}; attention {config.attention}", flush=True)
    rows = []
    for variant in args.variant or LOCAL_VARIANTS:
        if variant == CUDNN_PEER and device.platform != "gpu":
            print(f"{variant}: skipped (cuDNN runs on a GPU)", flush=True)
            continue
        rows.append(local_row(variant, config, args.steps, roofline_target))
        print("\n".join(local_table(rows)[-1:]), flush=True)
    if args.results:
        key = section_key(args.device, config)
        lines = [f"<!-- benchmarks.llm --device {key}: begin (replaced by each run) -->",
                 f"## LLM-scale: Llama-style decoder trained on one {kind}",
                 "",
                 (f"- model: {param_count(config) / 1e9:.2f}B parameters, batch "
                  f"{config.batch} x seq {config.seq}, attention written as "
                  f"{config.attention}; {args.steps} timed steps after 2 warm-up steps, "
                  "median; MFU: PaLM's model FLOPs over the bf16 dense peak"),
                 f"- command: `{recorded_command(argv)}`; jax {jax.__version__}",
                 "", *local_table(rows), "",
                 f"<!-- benchmarks.llm --device {key}: end -->"]
        write_section(args.results, lines, key)
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
