"""fp8's optimisation passes against the pipeline without them, on random programs.

``python -m benchmarks.fp8_differential [--cases N] [--start SEED] [--family ...]`` trains
each random program three steps under an fp8 policy twice, with and without the five
passes that claim to change no bits (reuse_amax, hoist_amax, hoist_quantize, batch_amax,
merge_amax), and prints per program whether the losses, parameters and (delayed
scaling) amax histories are the same bits, and which passes acted. Families:

* ``decoder``: scanned or unrolled decoders, remat or not, GQA attention (causal or
  not) or none, SwiGLU/GELU/tanh MLPs, RMSNorm or LayerNorm, both scalings and several
  policies (the ends quantised, ``propagate=false``, ``compute=float16``, ...);
* ``control-flow``: a layer in nested scans, a ``fori_loop``, a ``cond`` in a scan body,
  a ``vmap`` of a scan, a ``custom_vjp``, with dots that have a batch dimension or read a
  transposed weight.

Runs on this machine's CPU. XLA:CPU computes some divisions by a broadcast scale as
products with the reciprocal and not others, so a quantisation hoist_quantize moves can
round a value at a tie of the fp8 grid the other way there (docs/fp8.md, which gives
the run's figures); XLA:GPU divides as written.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hlo_amp
from benchmarks.cli_args import non_negative_int, positive_int
from benchmarks.llm import rms_norm
from benchmarks.stress import layer_norm
from hlo_amp.passes.batch_amax import BatchAmax
from hlo_amp.passes.hoist_amax import HoistAmax
from hlo_amp.passes.hoist_quantize import HoistQuantize
from hlo_amp.passes.merge_amax import MergeAmax
from hlo_amp.passes.reuse_amax import ReuseAmax

SAME_BITS_PASSES = (ReuseAmax, HoistAmax, HoistQuantize, BatchAmax, MergeAmax)
POLICY_EXTRAS = ("", ",first_matrix_op=none,last_matrix_op=none", ",propagate=false",
                 ",compute=float16", ",op:dot_general=float8_e4m3fn")
STEPS = 3


@contextlib.contextmanager
def without(passes: tuple[type, ...]) -> Iterator[None]:
    """The pipeline with ``passes`` doing nothing (their ``run`` a no-op) inside."""
    saved = {cls: cls.run for cls in passes}
    try:
        for cls in passes:
            cls.run = lambda self, module, report=None: None
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


def _weights(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-2]))


def _layer_norm(h: jax.Array, g: jax.Array) -> jax.Array:
    return layer_norm(h) * g


def decoder(seed: int) -> tuple[Callable, tuple, str, str]:
    """(SGD step, its arguments, an fp8 policy, a description) of a random decoder."""
    r, rng = random.Random(seed), np.random.default_rng(seed)
    d, f, layers = r.choice([32, 64]), r.choice([64, 96, 128]), r.choice([2, 3])
    heads = r.choice([2, 4])
    kv = r.choice([k for k in (1, 2, heads) if heads % k == 0])
    attention, causal = r.random() < 0.7, r.random() < 0.5
    mlp, norm_name = r.choice(["swiglu", "gelu", "tanh"]), r.choice(["rms", "layer"])
    remat, scan, vocab = r.random() < 0.6, r.random() < 0.7, r.choice([64, 128])
    norm = functools.partial(rms_norm, eps=1e-5) if norm_name == "rms" else _layer_norm
    hd = d // heads
    block_params = {"g1": jnp.ones((d,)), "g2": jnp.ones((d,)), "wq": _weights(rng, d, d),
                    "wk": _weights(rng, d, kv * hd), "wv": _weights(rng, d, kv * hd),
                    "wo": _weights(rng, d, d), "w1": _weights(rng, d, f),
                    "w3": _weights(rng, d, f), "w2": _weights(rng, f, d)}
    params = {"emb": _weights(rng, vocab, d) * 3, "gf": jnp.ones((d,)),
              "head": _weights(rng, d, vocab),
              "layers": {k: jnp.stack([v * (1 + 0.3 * i) for i in range(layers)])
                         for k, v in block_params.items()}}

    def block(h: jax.Array, p: dict) -> jax.Array:
        if attention:
            x = norm(h, p["g1"])
            b, t, _ = x.shape
            q = (x @ p["wq"]).reshape(b, t, heads, hd)
            k = jnp.repeat((x @ p["wk"]).reshape(b, t, kv, hd), heads // kv, 2)
            v = jnp.repeat((x @ p["wv"]).reshape(b, t, kv, hd), heads // kv, 2)
            s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
            if causal:
                s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
            out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)
            h = h + out.reshape(b, t, d) @ p["wo"]
        x = norm(h, p["g2"])
        if mlp == "swiglu":
            return h + (jax.nn.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]
        act = jax.nn.gelu if mlp == "gelu" else jnp.tanh
        return h + act(x @ p["w1"]) @ p["w2"]

    block = jax.checkpoint(block) if remat else block

    def loss(p: dict, tokens: jax.Array) -> jax.Array:
        h = p["emb"][tokens]
        if scan:
            h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), h, p["layers"])
        else:
            for i in range(layers):
                h = block(h, jax.tree.map(lambda a: a[i], p["layers"]))  # noqa: B023
        logp = jax.nn.log_softmax(norm(h, p["gf"]) @ p["head"])
        return -jnp.mean(logp[..., 0] + logp.mean(-1))

    tokens = jnp.asarray(rng.integers(0, vocab, (r.choice([2, 4]), r.choice([16, 32]))))
    description = (f"decoder: {layers} layers {'scanned' if scan else 'unrolled'}"
                   f"{', remat' if remat else ''}, "
                   f"{f'attention {heads}/{kv} heads' if attention else 'no attention'}"
                   f"{' causal' if attention and causal else ''}, {mlp}, {norm_name} norm")
    return _sgd(loss), (params, tokens), _policy(r), description


def control_flow(seed: int) -> tuple[Callable, tuple, str, str]:
    """(SGD step, its arguments, an fp8 policy, a description) of a random layer in a
    random control-flow form."""
    r, rng = random.Random(seed), np.random.default_rng(seed)
    d, f, layers = r.choice([32, 64]), r.choice([64, 128]), r.choice([2, 4])
    kind = r.choice(["mlp", "swiglu", "batch dim", "transposed weight"])
    form = r.choice(["scan", "nested scans", "fori_loop", "cond in scan", "vmap of scan",
                     "custom_vjp", "unrolled"])
    remat = r.random() < 0.5
    params = {"w_in": _weights(rng, d, d), "w_out": _weights(rng, d, 8),
              "layers": {"a": _weights(rng, layers, d, f), "b": _weights(rng, layers, f, d),
                         "c": _weights(rng, layers, f, d)}}

    def layer(h: jax.Array, w: dict) -> jax.Array:
        if kind == "swiglu":
            y = jax.nn.silu(h @ w["a"]) * (h @ w["c"].T)
        elif kind == "batch dim":
            grouped = h.reshape(h.shape[0], 2, -1)
            a = w["a"].reshape(2, d // 2, f)
            y = jnp.tanh(jnp.einsum("tgi,gio->tgo", grouped, a)).sum(1)
        elif kind == "transposed weight":
            y = jnp.tanh(jnp.einsum("ti,oi->to", h, w["a"].T))
        else:
            y = jnp.tanh(h @ w["a"])
        return h + y @ w["b"] / 4

    step_layer = jax.checkpoint(layer) if remat else layer
    if form == "custom_vjp":
        inner = step_layer
        step_layer = jax.custom_vjp(inner)
        step_layer.defvjp(lambda h, w: (inner(h, w), (h, w)),
                          lambda res, g: jax.vjp(inner, *res)[1](g))

    def body(h: jax.Array, w: dict) -> tuple[jax.Array, None]:
        return step_layer(h, w), None

    def run(h: jax.Array, stack: dict) -> jax.Array:
        if form in ("scan", "custom_vjp"):
            return jax.lax.scan(body, h, stack)[0]
        if form == "nested scans":
            halves = {k: v.reshape(2, layers // 2, *v.shape[1:]) for k, v in stack.items()}
            return jax.lax.scan(lambda h, g: (jax.lax.scan(body, h, g)[0], None), h, halves)[0]
        if form == "fori_loop":
            return jax.lax.fori_loop(
                0, layers, lambda i, h: step_layer(h, jax.tree.map(lambda a: a[i], stack)), h)
        if form == "cond in scan":
            return jax.lax.scan(lambda h, w: (jax.lax.cond(
                jnp.sum(h) > 0, lambda h: step_layer(h, w), lambda h: step_layer(h, w) / 2,
                h), None), h, stack)[0]
        if form == "vmap of scan":
            halves = h.reshape(2, -1, d)
            return jax.vmap(lambda x: jax.lax.scan(body, x, stack)[0])(halves).reshape(h.shape)
        for i in range(layers):
            h = step_layer(h, jax.tree.map(lambda a: a[i], stack))  # noqa: B023
        return h

    def loss(p: dict, x: jax.Array) -> jax.Array:
        return jnp.mean((run(x @ p["w_in"], p["layers"]) @ p["w_out"] - 1.0) ** 2)

    x = jnp.asarray(rng.standard_normal((32, d)).astype(np.float32))
    description = f"control flow: {kind} layer, {form}{', remat' if remat else ''}"
    return _sgd(loss), (params, x), _policy(r), description


def _sgd(loss: Callable) -> Callable:
    def step(params: dict, batch: jax.Array) -> tuple[dict, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value
    return step


def _policy(r: random.Random) -> str:
    scaling = r.choice(["current", "delayed"])
    return (f"fp8,scaling={scaling}" + (",amax_history=4" if scaling == "delayed" else "")
            + r.choice(POLICY_EXTRAS))


def _trained(step: Callable, args: tuple, policy: str) -> tuple[list, Any, list[str]]:
    """Losses and parameters of STEPS steps, the amax history (delayed scaling) and the
    notes of the passes that acted."""
    compiled = hlo_amp.compile(step, policy)
    params, batch = args
    steps = []
    for _ in range(STEPS):
        params, value = compiled(params, batch)
        steps.append([np.asarray(value), *map(np.asarray, jax.tree.leaves(params))])
    history = np.asarray(compiled.fp8_state()) if hasattr(compiled, "fp8_state") else None
    acted = sorted({note.split(":")[0] for note in compiled.lower(*args).report().notes}
                   & {p.name.removeprefix("hlo-amp-") for p in SAME_BITS_PASSES})
    return steps, history, acted


def compare(step: Callable, args: tuple, policy: str) -> tuple[str | None, list[str]]:
    """(None if the same bits with and without SAME_BITS_PASSES, else what differs first;
    the passes that acted)."""
    with_passes, history, acted = _trained(step, args, policy)
    with without(SAME_BITS_PASSES):
        bare, bare_history, _ = _trained(step, args, policy)
    for number, (a, b) in enumerate(zip(with_passes, bare), 1):
        for index, (x, y) in enumerate(zip(a, b)):
            if not np.array_equal(x, y):
                what = "loss" if index == 0 else f"parameter leaf {index - 1}"
                return (f"step {number}: {what} (largest difference "
                        f"{float(np.max(np.abs(x - y))):.3g})"), acted
    if history is not None and not np.array_equal(history, bare_history):
        return "the amax history", acted
    return None, acted


FAMILIES = {"decoder": decoder, "control-flow": control_flow}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=positive_int, default=10, help="programs per family")
    parser.add_argument("--start", type=non_negative_int, default=0, help="the first seed")
    parser.add_argument("--family", choices=[*FAMILIES, "both"], default="both")
    args = parser.parse_args(argv)
    families = FAMILIES if args.family == "both" else {args.family: FAMILIES[args.family]}
    counts = {"same bits": 0, "differ": 0}
    for name, make in families.items():
        for seed in range(args.start, args.start + args.cases):
            step, step_args, policy, description = make(seed)
            differs, acted = compare(step, step_args, policy)
            counts["differ" if differs else "same bits"] += 1
            print(f"{name} {seed}: {'same bits' if differs is None else 'DIFFER at ' + differs}"
                  f" | {policy} | {description} | passes that acted: "
                  f"{', '.join(acted) or 'none'}", flush=True)
    print(", ".join(f"{n} {what}" for what, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
