"""``hlo_amp.autopolicy(..., target=...)`` on the decoder's and the demo ViT's train steps
for H100 and TPU v5e (issue 36): the policy found, its error measured here, its modelled
step time against the baselines. Writes a markdown section to stdout.

    JAX_PLATFORMS=cpu python -m benchmarks.autopolicy_target [--full] [--budget 1e-2]
        [--depth 3] [--targets h100,tpu-v5e] [--workloads decoder,vit]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp

import hlo_amp
from benchmarks.cli_args import check_names, comma_names, positive_int, split_names
from benchmarks.workloads import variant_step, workloads
from hlo_amp.numerics.fastest import check_target


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    bf16 = "has avx512_bf16" if re.search(r"\bavx512_bf16\b", flags) else "no avx512_bf16"
    return f"{model} ({bf16}), {len(jax.devices('cpu'))} JAX CPU device(s)"


def forward(graphdef: object) -> object:
    """(params, x, y) -> (logits, mean cross-entropy): the model's forward pass."""
    import optax
    from flax import nnx

    def fn(params: object, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = nnx.merge(graphdef, params)(x).astype(jnp.float32)
        return logits, optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return fn


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.autopolicy_target",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="the benchmarks' full sizes")
    p.add_argument("--budget", type=float, default=1e-2)
    p.add_argument("--depth", type=positive_int, default=3)
    p.add_argument("--targets", type=comma_names, default="h100,tpu-v5e")
    p.add_argument("--workloads", type=comma_names, default="decoder,vit")
    p.add_argument("--fn", choices=("forward", "step"), default="forward",
                   help="forward: (logits, loss) of the model; step: the Adam train step "
                        "(new params, optimizer state, loss)")
    args = p.parse_args(argv)
    # A KeyError (a workload) or a traceback after the first searches (a target) before.
    chosen = {w.name: w for w in workloads(quick=not args.full)}
    check_names(p, "--workloads", split_names(args.workloads), chosen)
    for target in split_names(args.targets):
        try:
            check_target(target)
        except ValueError as error:
            p.error(f"--targets: {error}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    out = ["## autopolicy for a target (issue 36)", "",
           (f"- machine: {cpu_line()}; errors measured on it (XLA:CPU), step times the "
           "roofline of the step compiled for the target without a device"),
           (f"- jax {jax.__version__}, date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
           f"UTC, commit {commit}"),
           (f"- command: `JAX_PLATFORMS=cpu python -m benchmarks.autopolicy_target "
           f"{shlex.join(argv if argv is not None else sys.argv[1:])}`"),
           (f"- function: {args.fn} ("
            + ("the model's logits and loss" if args.fn == "forward" else
               "the Adam train step: new params, optimizer state, loss")
            + f"); budget {args.budget:g} (error = max over its outputs, against f32); "
           "scopes at depth "
           f"{args.depth}; search: {hlo_amp.numerics.fastest.SEARCH}"), ""]
    for name in split_names(args.workloads):
        workload = chosen[name]
        step, params, opt_state = variant_step(workload, "f32")
        x, y = workload.batch()
        if args.fn == "forward":
            graphdef, params = workload.model(jnp.float32)
            fn, fn_args = forward(graphdef), (params, x, y)
        else:
            fn, fn_args = step, (params, opt_state, x, y)
        # NNX pushes no scopes: module_scopes names each submodule call by its path
        fn = hlo_amp.module_scopes(workload.build(jnp.float32))(fn)
        out += [f"### {workload.name}: {workload.description}", ""]
        for target in split_names(args.targets):
            start = time.perf_counter()
            result = hlo_amp.autopolicy(fn, *fn_args, budget=args.budget,
                                        depth=args.depth, target=target)
            seconds = time.perf_counter() - start
            out += [f"#### {result.target}", "", "```", str(result), "```", "",
                    f"{seconds:.0f} s wall here.", ""]
            print("\n".join(out[-8:]), file=sys.stderr)
    print("\n".join(out))


if __name__ == "__main__":
    main()
