"""Step time and XLA temp memory of issue 33's three models on the device JAX runs on (a
GPU): f32, the hand cast, and hlo_amp's 16-bit modes, at the models' own sizes
(benchmarks/hand_cast_workloads.py). ``benchmarks.hand_cast_memory`` compiles the same
steps for devices this machine lacks; this one runs them.

    python -m benchmarks.hand_cast_speed [mobilenet,vae,mnist] [--variants f32,peer,...]
        [--label TEXT] [--steps N]

Each variant is jitted once, run ``--warmup`` steps, then ``--steps`` steps, each timed to
``block_until_ready``; the median is printed with the ratio to f32 when f32 is among the
variants. ``--label`` names the rows (to tell runs of two checkouts apart).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax

import hlo_amp
from benchmarks.autopolicy_target import cpu_line
from benchmarks.hand_cast_workloads import NAMES, hand_cast_case

VARIANTS = ("f32", "peer", "bf16", "mixed_bfloat16")


def compiled_step(name: str, variant: str) -> tuple[Any, tuple]:
    """(the compiled step, its arguments) of one variant at the model's own size."""
    step, args = hand_cast_case(name, "peer" if variant == "peer" else "f32", small=False)
    if variant in ("f32", "peer"):
        return jax.jit(step).lower(*args).compile(), args
    return hlo_amp.compile(step, variant).lower(*args).compile(), args


def median_step_ms(compiled: Any, args: tuple, warmup: int, steps: int) -> float:
    """Median wall time of one step, ms; the state (params, optimizer) carried along."""
    params, opt_state, *data = args
    times = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, *data)
        jax.block_until_ready((params, opt_state, loss))
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="?", default=",".join(NAMES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--label", default="")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    variants = args.variants.split(",")
    unknown = [m for m in models if m not in NAMES] + [v for v in variants
                                                        if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown model(s)/variant(s) {', '.join(unknown)}; known: "
                         f"{', '.join(NAMES)}; {', '.join(VARIANTS)}")
    device = jax.devices()[0]
    print(f"- device: {device.device_kind} ({device.platform}); host {cpu_line()}; "
          f"jax {jax.__version__}; hlo_amp from {hlo_amp.__file__}\n")
    print("| model | variant | step ms (median) | vs f32 | XLA temp B |")
    print("|---|---|---|---|---|")
    for name in models:
        f32_ms = None
        for variant in variants:
            compiled, step_args = compiled_step(name, variant)
            temp = int(compiled.memory_analysis().temp_size_in_bytes)
            ms = median_step_ms(compiled, step_args, args.warmup, args.steps)
            f32_ms = ms if variant == "f32" else f32_ms
            ratio = f"{f32_ms / ms:.2f}×" if f32_ms else "-"
            label = f"{variant} ({args.label})" if args.label else variant
            print(f"| {name} | {label} | {ms:.3f} | {ratio} | {temp:,} |", flush=True)


if __name__ == "__main__":
    main()
