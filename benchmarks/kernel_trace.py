"""Where a step's device time goes: a jax profiler trace of a few steps, per kernel.

``benchmarks.run --trace DIR`` runs each variant's step a few more times under
``jax.profiler.trace`` (one trace directory per workload and variant, the ``.xplane.pb``
kept for TensorBoard/XProf) and adds a table to the results: kernels launched per step,
the time the GPU streams were busy per step, and the kernel families (the kernel's name
without its number) that took the most of it. Step time minus busy time is what the GPU
spent waiting between kernels (launch latency, host work): the cost of many small
kernels, which the roofline model of hlo_amp/targets/roofline.py does not see.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A GPU device plane of jax's profiler ("/device:GPU:0") and the lines that hold its
# kernels ("Stream #13(...)"); other lines ("XLA Ops", "XLA Modules", "Steps") repeat
# the same time at another granularity. A plane without stream lines (another profiler
# version's names) is read from every line but those.
_GPU_PLANE = re.compile(r"^/device:GPU:\d+")
_KERNEL_LINE = re.compile(r"^Stream\b")
_DERIVED_LINE = re.compile(r"^(XLA |Steps|TensorFlow |Framework |Source|Launch)")
_NUMBERED = re.compile(r"[._]\d+$")


@dataclass
class KernelTimes:
    """The device kernels of ``steps`` steps: launches and busy time, per family."""

    steps: int
    launches: int = 0
    busy_ns: float = 0.0
    families: dict[str, list[float]] = field(default_factory=dict)  # name -> [count, ns]

    def add(self, name: str, duration_ns: float) -> None:
        family = self.families.setdefault(family_of(name), [0, 0.0])
        family[0] += 1
        family[1] += duration_ns
        self.launches += 1
        self.busy_ns += duration_ns


def family_of(kernel: str) -> str:
    """A kernel's name without the numbers XLA appends (``loop_add_fusion_12``)."""
    name = kernel
    while _NUMBERED.search(name):
        name = _NUMBERED.sub("", name)
    return name


def kernel_times(planes: Iterable[Any], steps: int) -> KernelTimes:
    """The kernels on the GPU planes of a profile (``jax.profiler.ProfileData.planes``)."""
    times = KernelTimes(steps)
    for plane in planes:
        if not _GPU_PLANE.match(plane.name):
            continue
        lines = [line for line in plane.lines if _KERNEL_LINE.match(line.name)] or [
            line for line in plane.lines if not _DERIVED_LINE.match(line.name)]
        for line in lines:
            for event in line.events:
                times.add(event.name, float(event.duration_ns))
    return times


def trace_steps(run_step: Callable[[], None], steps: int, directory: Path) -> KernelTimes:
    """Run ``run_step`` ``steps`` times under the profiler, writing to ``directory``."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(directory)):
        for _ in range(steps):
            run_step()
    found = sorted(directory.glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        return KernelTimes(steps)
    data = jax.profiler.ProfileData.from_file(str(found[-1]))
    return kernel_times(data.planes, steps)


def trace_table(rows: list[tuple[str, float, KernelTimes]], top: int = 6) -> list[str]:
    """Markdown lines: per variant (name, median step seconds, its kernels) the launches
    and busy time per step, the rest of the step, and the ``top`` families by time."""
    lines = [("| variant | step ms | kernels per step | GPU busy ms per step | "
              "between kernels ms | largest kernel families (ms per step, count) |"),
             "|---|---|---|---|---|---|"]
    for variant, step_s, times in rows:
        if not times.launches:
            lines.append(f"| {variant} | {step_s * 1e3:.2f} | no GPU kernels in the trace "
                         "| | | |")
            continue
        per_step = times.steps or 1
        busy_ms = times.busy_ns / per_step / 1e6
        largest = sorted(times.families.items(), key=lambda kv: -kv[1][1])[:top]
        named = "; ".join(f"{name} {ns / per_step / 1e6:.2f} ({count / per_step:g})"
                          for name, (count, ns) in largest)
        lines.append(f"| {variant} | {step_s * 1e3:.2f} | {times.launches / per_step:g} | "
                     f"{busy_ms:.2f} | {max(step_s * 1e3 - busy_ms, 0.0):.2f} | {named} |")
    return lines
