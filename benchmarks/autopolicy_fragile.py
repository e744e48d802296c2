"""``autopolicy(..., target=...)`` on the numerics tests' fragile-scope program
(tests/py/test_policy_search.py) at GEMM sizes an H100 runs compute-bound: the answer is
known (``cancel``, a cancelling sum, stays f32; the rest goes bf16, or fp8 where the
budget allows it). At the tests' sizes (16x32 dots) every kernel is memory-bound on the
H100 and f32 is modelled fastest, so the tests use a compute-bound copy of the H100.

    JAX_PLATFORMS=cpu python -m benchmarks.autopolicy_fragile [h100,tpu-v5e] [4096]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import hlo_amp
from benchmarks.cli_args import comma_names, positive_int, split_names
from hlo_amp.numerics.fastest import check_target


def make_program():
    """The fragile-scope program: three benign scopes and ``cancel``, which bf16 ruins."""

    def program(x, w):
        with jax.named_scope("embed"):
            h = jnp.tanh(x @ w["embed"])
        with jax.named_scope("mix"):
            h = jnp.tanh(h @ w["mix"])
        with jax.named_scope("cancel"):
            c = w["u"] @ w["sign"]
        with jax.named_scope("head"):
            y = h @ w["head"]
        return {"y": y, "c": c}

    return program


def inputs(n: int, k: int = 1024) -> tuple[jax.Array, dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), 5)
    weights = {"embed": jax.random.normal(keys[0], (n, n)) / n ** 0.5,
               "mix": jax.random.normal(keys[1], (n, n)) / n ** 0.5,
               "head": jax.random.normal(keys[2], (n, n)) / n ** 0.5,
               "u": 1 + 1e-3 * jax.random.normal(keys[3], (8, k)),
               "sign": jnp.tile(jnp.array([1.0, -1.0]), k // 2)}
    return jax.random.normal(jax.random.key(1), (n, n)), weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.autopolicy_fragile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="?", type=comma_names, default="h100,tpu-v5e",
                   help="comma-separated devices to choose the policy for (default "
                        "h100,tpu-v5e)")
    p.add_argument("n", nargs="?", type=positive_int, default=4096,
                   help="the dots' size, n x n by n x n (default 4096)")
    args = p.parse_args(argv)
    for target in split_names(args.targets):  # not a traceback after the first target's search
        try:
            check_target(target)
        except ValueError as error:
            p.error(f"targets: {error}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n = args.n  # the dots' size, in each heading
    x, w = inputs(n)
    for target in split_names(args.targets):
        for budget in (1e-2, 1e-1):
            start = time.perf_counter()
            result = hlo_amp.autopolicy(make_program(), x, w, budget=budget, target=target,
                                        progress=False)
            print(f"### {target}, budget {budget:g}, n = {n} "
                  f"({time.perf_counter() - start:.0f} s)\n\n```\n{result}\n```\n", flush=True)


if __name__ == "__main__":
    main()
