"""Where two variants' roofline estimates differ, kernel by kernel.

``python -m benchmarks.kernel_diff decoder`` compiles one workload's train step twice
for a device without it (``--device``, default ``h100-aot``; variants as
``benchmarks.run`` names them, default ``flax bf16`` against ``hlo_amp mixed_bfloat16``),
estimates both with ``hlo_amp/targets/roofline.py`` and prints the kernels one side has more
of than the other. Kernels are matched by what the model charges for them (op, matrix
kind, operand types, FLOPs, bytes), not by name: names differ between compiles.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

KernelKey = tuple[str, str, tuple[str, ...], int, int]


def kernel_key(kernel: Any) -> KernelKey:
    """What the model charges for a kernel (``hlo_amp.targets.roofline.Kernel``)."""
    return (kernel.op, kernel.matrix or "", kernel.operand_types, kernel.flops, kernel.bytes)


def surplus(kernels: list[Any], others: list[Any]) -> list[tuple[Any, int]]:
    """(kernel, how many more executions ``kernels`` has of it than ``others``)."""
    theirs = Counter()
    for kernel in others:
        theirs[kernel_key(kernel)] += kernel.count
    ours: Counter = Counter()
    first: dict[KernelKey, Any] = {}
    for kernel in kernels:
        ours[kernel_key(kernel)] += kernel.count
        first.setdefault(kernel_key(kernel), kernel)
    return [(first[key], n - theirs[key]) for key, n in ours.items() if n > theirs[key]]


def _lines(label: str, rows: list[tuple[Any, int]], estimate: Any) -> list[str]:
    seconds = sum(n * k.seconds(estimate.peak_flops, estimate.device,
                                estimate.hbm_bytes_per_second) for k, n in rows)
    total = sum(n * k.bytes for k, n in rows) / 1e6
    lines = [f"more in {label}: {total:.3f} MB, {seconds * 1e6:.2f} µs"]
    for kernel, n in sorted(rows, key=lambda row: -row[0].bytes * row[1]):
        types = "×".join(kernel.operand_types) or "-"
        lines.append(f"  {n}× {kernel.name[:48]:48s} {kernel.op:12s} {types:12s} "
                     f"{kernel.bytes:>12,d} B")
    return lines


def main(argv: list[str] | None = None) -> None:
    from benchmarks.run import AOT_DEVICES, aot_compile
    from benchmarks.workloads import workloads
    from hlo_amp.targets import device_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("--device", choices=tuple(AOT_DEVICES), default="h100-aot")
    parser.add_argument("--variants", default="flax bf16,hlo_amp mixed_bfloat16",
                        help="two variants, comma separated")
    args = parser.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",")]
    if len(names) != 2:
        parser.error(f"--variants: two variants were expected, got {args.variants!r}")
    chosen = [w for w in workloads(False) if w.name == args.workload]
    if not chosen:
        parser.error(f"unknown workload {args.workload!r}; accepted: "
                     f"{', '.join(w.name for w in workloads(False))}")
    target = device_target(AOT_DEVICES[args.device])
    x, y = chosen[0].batch()
    results = [aot_compile(chosen[0], name, target, x, y) for name in names]
    for result in results:
        if result.error:
            raise SystemExit(f"{result.variant}: {result.error}")
        e = result.estimate
        print(f"{result.variant}: roofline {e.roofline_seconds * 1e3:.4f} ms, "
              f"{e.hbm_bytes / 1e6:.1f} MB, temp {result.temp_bytes:,d} B")
    a, b = (r.estimate for r in results)
    print("\n".join(_lines(names[0], surplus(a.kernels, b.kernels), a)))
    print("\n".join(_lines(names[1], surplus(b.kernels, a.kernels), b)))


if __name__ == "__main__":
    main()
