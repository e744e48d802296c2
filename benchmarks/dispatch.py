"""Per-call overhead: ``jax.jit`` vs ``hlo_amp.compile`` on cache hits, steps where dispatch dominates.

    python -m benchmarks.dispatch [--rounds 20] [--calls 200] [--out FILE]

Two cases: a no-op-sized function of a 300-leaf pytree (a trivial op per leaf and one
4×4 dot for the policy to convert) and a small Flax NNX MLP train step with optax SGD.
Both callables are warmed (executables cached) and then timed in interleaved rounds, the
order alternating from round to round: each round calls one of them ``--calls`` times,
feeding its outputs back in as a training loop does, and blocks on the result only at
the end of the round. Per-call time is a round's wall time over its calls; the table
gives the median over rounds. Goal: hlo_amp ≤ 1.1× jax.jit's per-call time (printed,
never asserted).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cli_args import check_out_file, non_negative_int, positive_int

GOAL_RATIO = 1.1
LEAVES = 300


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dispatch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=positive_int, default=20, help="timed rounds per callable")
    p.add_argument("--calls", type=positive_int, default=200, help="calls per round")
    p.add_argument("--warmup", type=non_negative_int, default=20,
                   help="untimed calls per callable")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    if args.out is not None:  # not after the timing, as a traceback
        check_out_file(p, "--out", args.out)
    return args


# ---- the cases ---------------------------------------------------------------------------


def pytree_case() -> tuple[str, Callable[..., Any], tuple[Any, ...]]:
    """A function of a 300-leaf dict: scale-and-shift each (4,) leaf, one 4×4 dot."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), LEAVES)
    tree = {f"v{i:03d}": jax.random.normal(keys[i], (4,), jnp.float32)
            for i in range(LEAVES - 1)}
    tree["m"] = jax.random.normal(keys[-1], (4, 4), jnp.float32) / 2

    def fn(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {k: v * 0.5 + 1.0 for k, v in tree.items() if k != "m"}
        out["m"] = jnp.tanh(tree["m"] @ tree["m"])
        return out

    return f"{LEAVES}-leaf pytree, 1 dot", fn, (tree,)


def flax_case() -> tuple[str, Callable[..., Any], tuple[Any, ...]]:
    """A small Flax NNX MLP train step (optax SGD) on a batch of 8."""
    import jax
    import optax
    from flax import nnx

    from benchmarks.workloads import make_step
    from examples.models import MLP

    model = MLP(features=16, width=32, depth=2, classes=10, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.01)
    step = make_step(graphdef, tx)
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (8, 16))
    y = jax.random.randint(ky, (8,), 0, 10)
    leaves = len(jax.tree.leaves((params, tx.init(params), x, y)))
    return (f"Flax NNX MLP 16→2×32→10 SGD step, batch 8 ({leaves} leaves)", step,
            (params, tx.init(params), x, y))


# ---- timing ------------------------------------------------------------------------------


def _loop(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[int], tuple[Any, ...]]:
    """A runner: ``calls`` calls of ``fn``, outputs fed back as the next inputs."""
    import jax

    n_state = len(args)

    def run(calls: int, state: tuple[Any, ...]) -> tuple[Any, ...]:
        for _ in range(calls):
            out = fn(*state)
            if n_state == 1:
                state = (out,)
            else:  # train step: (params, opt_state, loss) -> (params, opt_state, x, y)
                state = (out[0], out[1], *state[2:])
        jax.block_until_ready(state)
        return state

    return run


def time_case(fn: Callable[..., Any], args: tuple[Any, ...], rounds: int, calls: int,
              warmup: int) -> dict[str, Any]:
    import jax

    import hlo_amp

    amp = hlo_amp.compile(fn, "bf16")
    report = amp.lower(*args).report()
    runners = {"jax.jit": _loop(jax.jit(fn), args), "hlo_amp": _loop(amp, args)}
    states = {name: run(warmup, args) for name, run in runners.items()}  # fills the caches
    lowerings = amp.lowerings
    per_call: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            gc.collect()
            start = time.perf_counter()
            states[name] = runners[name](calls, states[name])
            per_call[name].append((time.perf_counter() - start) / calls)
    med = {name: statistics.median(times) * 1e6 for name, times in per_call.items()}
    return {
        "jit_us": med["jax.jit"], "amp_us": med["hlo_amp"],
        "jit_min_us": min(per_call["jax.jit"]) * 1e6,
        "amp_min_us": min(per_call["hlo_amp"]) * 1e6,
        "ratio": med["hlo_amp"] / med["jax.jit"],
        "converted": sum(d.low_precision and d.changed for d in report.decisions),
        "dots": len(report.decisions),
        "cache_hits_only": amp.lowerings == lowerings,
    }


def table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = [
        ("| case | dots converted | jax.jit µs/call | hlo_amp µs/call | hlo_amp / jax.jit | "
         f"goal ≤ {GOAL_RATIO}× | hlo_amp cache hits only |"),
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        if "error" in r:
            out.append(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        out.append(
            f"| {name} | {r['converted']}/{r['dots']} | {r['jit_us']:.1f} "
            f"(min {r['jit_min_us']:.1f}) | {r['amp_us']:.1f} (min {r['amp_min_us']:.1f}) | "
            f"{r['ratio']:.2f}× | {'met' if r['ratio'] <= GOAL_RATIO else 'missed'} | "
            f"{'yes' if r['cache_hits_only'] else 'NO (re-lowered while timed)'} |")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax

    from benchmarks.run import cpu_bf16_line, machine

    device = "gpu" if jax.devices()[0].platform == "gpu" else "cpu"
    label = machine(device)
    command = ("python -m benchmarks.dispatch " +
               shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    header = [
        "# hlo_amp dispatch overhead",
        "",
        f"- machine: {label} ({device})",
        cpu_bf16_line(machine("cpu")) + ".",
        f"- jax {jax.__version__}, Python {platform.python_version()}",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- command: `{command}`",
        (f"- timing: per-call time = a round's wall time / {args.calls} calls (outputs fed "
         "back, `jax.block_until_ready` once at the round's end), median (and min) over "
         f"{args.rounds} rounds per callable, `jax.jit(f)` and `hlo_amp.compile(f, \"bf16\")` "
         f"interleaved round by round, order alternating; {args.warmup} warm-up calls each "
         "so every timed call is a cache hit"),
        "",
    ]
    print("\n".join(header), flush=True)
    rows = []
    for build in (pytree_case, flax_case):
        name = build.__name__
        try:
            name, fn, fn_args = build()
            result = time_case(fn, fn_args, args.rounds, args.calls, args.warmup)
        except Exception as error:  # noqa: BLE001 - recorded in the table
            result = {"error": str(error).splitlines()[0][:120]}
        rows.append((name, result))
        print(table([(name, result)])[-1], file=sys.stderr, flush=True)  # progress
    lines = header + table(rows) + [""]
    print("\n".join(lines[len(header):]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
