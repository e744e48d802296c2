"""Stress: the pass on a 24-layer transformer train step, and RSS over 50 signatures.

    python -m benchmarks.stress [--layers 24] [--policy bf16] [--signatures 50] [--no-write]

Prints the pass time (per 1,000 ops of the module and as a share of XLA's compile time),
lowering/compile time and peak RSS for one train step of a 24-layer transformer (grad +
SGD update), then the RSS growth while one function is compiled for 50 input
signatures. The printed section replaces the part of
benchmarks/RESULTS.md between ``<!-- stress:begin -->`` and ``<!-- stress:end -->``
(the rest of that file is written by other scripts).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hlo_amp
from benchmarks.cli_args import int_at_least, positive_int
from hlo_amp.ir.modules import copy_module, parse_module, walk_operations
from hlo_amp.passes import run_pipeline
from hlo_amp.policy import as_policy

RESULTS = Path(__file__).with_name("RESULTS.md")
BEGIN = "<!-- stress:begin -->"
END = "<!-- stress:end -->"
MB = 1 << 20


# ---- memory ---------------------------------------------------------------------------


def rss_bytes() -> int:
    """Current resident set size, from /proc/self/statm."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size so far (VmHWM), from /proc/self/status."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- the model ------------------------------------------------------------------------


def init_params(layers: int, d: int, seed: int = 0) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

    return [{"qkv": weight(d, 3 * d), "proj": weight(d, d), "fc1": weight(d, 4 * d),
             "fc2": weight(4 * d, d)} for _ in range(layers)]


def layer_norm(x: jax.Array) -> jax.Array:
    """LayerNorm without gain or bias (eps 1e-5)."""
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def forward(params: list[dict[str, jax.Array]], x: jax.Array, heads: int) -> jax.Array:
    b, t, d = x.shape
    for i, p in enumerate(params):
        with jax.named_scope(f"Block_{i}"):
            with jax.named_scope("attn"):
                q, k, v = jnp.split(layer_norm(x) @ p["qkv"], 3, axis=-1)
                q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
                s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
                o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
                x = x + o.reshape(b, t, d) @ p["proj"]
            with jax.named_scope("mlp"):
                x = x + jax.nn.gelu(layer_norm(x) @ p["fc1"]) @ p["fc2"]
    return x


def make_train_step(heads: int):
    def loss_fn(params, x, y):
        return jnp.mean((forward(params, x, heads) - y) ** 2)

    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads)
        return params, loss

    return train_step


# ---- measurements ---------------------------------------------------------------------


def _per_kop(seconds: float, ops: int) -> str:
    return f"{seconds * 1e3:.0f} ms ({seconds * 1e6 / max(ops, 1):.1f} ms per 1,000 ops)"


def transformer_section(layers: int, d: int, heads: int, seq: int, batch: int,
                        policy: str = "bf16") -> list[str]:
    params = init_params(layers, d)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((batch, seq, d)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, seq, d)), jnp.float32)
    step = hlo_amp.compile(make_train_step(heads), policy)
    rss_before = rss_bytes()
    lowered = step.lower(params, x, y)
    report = lowered.report()
    text = lowered.original_text(debug_info=True)
    original = parse_module(text)
    ops = len(walk_operations(original))  # every operation, nested regions included
    # the passes alone as hlo_amp.compile runs them (copy + passes + one verify), best of 3
    target = "cpu" if jax.default_backend() == "cpu" else None
    amp_policy = as_policy(policy)
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        run_pipeline(copy_module(original), amp_policy, target=target)
        passes.append(time.perf_counter() - start)
    # rewrite() on text (parse + passes + print), best of 3
    times = []
    for _ in range(3):
        start = time.perf_counter()
        hlo_amp.rewrite(text, policy)
        times.append(time.perf_counter() - start)
    compiled = lowered.compile()
    ref_loss = float(jax.jit(make_train_step(heads))(params, x, y)[1])
    try:
        _, loss = compiled(params, x, y)
        run_line = f"- loss {policy} {float(loss):.5f} vs f32 {ref_loss:.5f}"
    except jax.errors.JaxRuntimeError as error:  # report it; the pass numbers still hold
        run_line = f"- running the step FAILED: {str(error).splitlines()[0]}"
    xla = compiled.compile_seconds
    return [
        (f"- model: {layers}-layer transformer train step (d={d}, heads={heads}, "
         f"seq={seq}, batch={batch}), value_and_grad + SGD; policy {policy}"),
        (f"- module: {ops} ops, {len(report.decisions)} dot/conv decisions; "
         f"{report.summary()}"),
        (f"- pass time: inside hlo_amp.compile (first call: copy + passes + verify) "
         f"{_per_kop(lowered.pass_seconds, ops)}, "
         f"{100 * lowered.pass_seconds / xla:.1f}% of XLA's compile time; the same, "
         f"best of 3: {_per_kop(min(passes), ops)}, {100 * min(passes) / xla:.1f}%"),
        (f"- lowering: {lowered.lower_seconds:.2f} s; rewrite() on text "
         f"(parse+passes+print), best of 3: {min(times):.3f} s"),
        f"- XLA compile of the rewritten module: {xla:.2f} s",
        run_line,
        (f"- RSS: {rss_before / MB:.0f} MB before lowering, {rss_bytes() / MB:.0f} MB after "
         f"compile; peak RSS of the process {peak_rss_bytes() / MB:.0f} MB"),
    ]


def signatures_section(count: int) -> list[str]:
    """``count`` (2 or more) signatures: the first is the untimed warm-up, the rest are
    timed and the figures are per timed signature."""
    def step(w, x):
        with jax.named_scope("layer"):
            return jnp.sum(jnp.tanh(x @ w) ** 2)

    fn = hlo_amp.compile(jax.value_and_grad(step), "bf16")
    w = jnp.ones((16, 16), jnp.float32) / 16
    fn(w, jnp.ones((1, 16), jnp.float32))  # warm-up: one-time costs not counted
    gc.collect()
    start_rss = rss_bytes()
    start = time.perf_counter()
    for rows in range(2, count + 1):  # with the warm-up: ``count`` signatures
        jax.block_until_ready(fn(w, jnp.ones((rows, 16), jnp.float32)))
    seconds = time.perf_counter() - start
    gc.collect()
    grown = rss_bytes() - start_rss
    return [
        (f"- {count} signatures of one function (value_and_grad of a 16x16 dot): cache "
         f"{fn.cache_size()} entries, {seconds / (count - 1) * 1e3:.0f} ms per signature "
         f"(lower + pass + compile)"),
        (f"- RSS growth: {grown / MB:.1f} MB in all, {grown / (count - 1) / 1024:.0f} KB per "
         f"executable"),
    ]


def append_results(text: str, path: Path = RESULTS) -> None:
    """Replace the stress section of RESULTS.md (between the markers) with ``text``.

    Creates the file or appends the markers when missing; the rest of the file is
    left byte-for-byte as it was.
    """
    section = f"{BEGIN}\n{text.rstrip()}\n{END}"
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if pattern.search(old):
        new = pattern.sub(lambda _: section, old, count=1)
    else:
        new = old + ("\n" if old and not old.endswith("\n") else "") + \
            ("\n" if old else "") + section + "\n"
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(new)
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stress")
    parser.add_argument("--layers", type=positive_int, default=24)
    parser.add_argument("--d", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=4, help="dividing --d")
    parser.add_argument("--seq", type=positive_int, default=16)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--policy", default="bf16")
    parser.add_argument("--signatures", type=int_at_least(2), default=50,
                        help="input signatures compiled; the first is an untimed warm-up")
    parser.add_argument("--no-write", action="store_true",
                        help="print only; do not update benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    # Refused here: they were tracebacks from the heads' reshape and from compiling.
    if args.d % args.heads:
        parser.error(f"--heads {args.heads} does not divide --d {args.d}")
    try:
        as_policy(args.policy)
    except ValueError as error:
        parser.error(f"--policy {args.policy}: {error}")
    lines = [
        "## Stress",
        "",
        (f"`python -m benchmarks.stress` on {platform.machine()}, "
         f"{jax.devices()[0].platform}, jax {jax.__version__}, {os.cpu_count()} CPUs."),
        "",
        *transformer_section(args.layers, args.d, args.heads, args.seq, args.batch,
                             args.policy),
        *signatures_section(args.signatures),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        append_results(text)
    return text


if __name__ == "__main__":
    main()
