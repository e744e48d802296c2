"""Benchmark hlo_amp against f32, hand-written Flax bf16, jmp and Keras on three train steps.

    python -m benchmarks.run [--quick] [--device cpu|gpu] [--steps N] [--out benchmarks]
                             [--trace DIR]
    python -m benchmarks.run --device h100-aot|h200-aot [--workloads ...]

All variants of one workload live in one process and are timed interleaved (one step of
each in turn), so load on the machine hits them alike. Writes ``RESULTS.md`` and
``results.png`` under ``--out``. Targets are printed beside the figures, never asserted.
``--trace DIR`` adds, per workload, the GPU kernels of three more traced steps
(benchmarks/kernel_trace.py).

``--device h100-aot`` (``h200-aot``) runs nothing: it compiles every variant for that GPU
without the device (XLA:GPU, Triton GEMM off) and tabulates, per variant, what XLA's
optimized HLO and buffer assignment say: cuBLAS/cuDNN calls by operand type, XLA temp
memory, and `hlo_amp.targets.roofline`'s HBM-traffic and roofline estimates. Its section of
``RESULTS.md`` is replaced; the rest of the file is kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cli_args import (
    check_names,
    check_out_dir,
    comma_names,
    non_negative_int,
    positive_int,
    split_names,
)

TARGET_SPEEDUP = {"mlp": 1.5, "vit": 1.3}
# mixed_bfloat16's XLA temp memory: at most this share of f32's, on these workloads.
TARGET_MIXED_TEMP = {"vit": 0.7, "cnn": 0.7}
MIXED = "hlo_amp mixed_bfloat16"
AOT_DEVICES = {"h100-aot": "h100", "h200-aot": "h200", "tpu-v5e-aot": "tpu-v5e"}
# benchmarks/workloads.py's, by name (the decoder is compiled without a device only).
WORKLOAD_NAMES = ("mlp", "vit", "cnn", "decoder")
# Compiled without a device: mixed_bfloat16's XLA temp memory at most this share of f32's.
TARGET_AOT_MIXED_TEMP = {"vit": 0.65, "cnn": 0.65, "decoder": 0.65}
# fp8: at least this share of the dots the fp8 policy quantises run as cuBLAS fp8 GEMMs.
TARGET_FP8_GEMMS = 0.9
CONVERT = re.compile(r"\bstablehlo\.convert\b")



HAND_WRITTEN = "<!-- hand-written below this line; benchmarks/run.py keeps it -->"

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few steps (~2 min)")
    p.add_argument("--device", choices=("cpu", "gpu", *AOT_DEVICES), default="cpu",
                   help="cpu/gpu: run and time here; h100-aot/h200-aot/tpu-v5e-aot: compile for "
                        "that GPU or TPU without one and estimate (nothing runs)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per variant "
                   "(default 20, 10 with --quick)")
    p.add_argument("--warmup", type=non_negative_int, default=3,
                   help="untimed steps per variant")
    p.add_argument("--workloads", type=comma_names, default=None,
                   help="default mlp,vit,cnn (and decoder with --device h100-aot/h200-aot)")
    p.add_argument("--variants", type=comma_names, default=None,
                   help="comma-separated subset of the variants (default: all), e.g. "
                        "'f32,hlo_amp bf16,hlo_amp fp8'; f32 is always run first")
    p.add_argument("--stress-layers", type=non_negative_int, default=24,
                   help="0 skips the stress row")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="cpu/gpu: after timing, trace 3 more steps of each variant with "
                        "jax's profiler into DIR and add a table of its GPU kernels "
                        "(benchmarks/kernel_trace.py)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    # An unknown name was dropped: an H100 section with no workloads replaced the
    # committed one.
    if args.workloads is not None:
        check_names(p, "--workloads", split_names(args.workloads), WORKLOAD_NAMES)
    # Found by the last mkdir before: after every measurement, a traceback.
    check_out_dir(p, "--out", args.out)
    if args.trace is not None:
        check_out_dir(p, "--trace", args.trace)
    return args


@dataclass
class Result:
    variant: str
    error: str | None = None
    times: list[float] = field(default_factory=list)
    lower_s: float = float("nan")
    pass_s: float | None = None
    compile_s: float = float("nan")
    temp_bytes: int = 0
    arg_bytes: int = 0
    out_bytes: int = 0
    converts: int = 0
    low: int = 0
    matmuls: int = 0
    kernels: Any = None  # kernel_trace.KernelTimes of the traced steps (--trace)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def cpu_bf16_line(cpu_name: str) -> str:
    """One line for RESULTS.md: the CPU and its native bf16 support."""
    from hlo_amp.targets.cpu import native_bf16_flags

    found = native_bf16_flags()
    have = ", ".join(f"`{f}`" for f in found) if found else "neither `avx512_bf16` nor `amx_bf16`"
    return (f"- CPU bf16 capability: {cpu_name}; /proc/cpuinfo flags list {have}. XLA:CPU runs "
            "bf16 dots natively only with these, so figures from machines that differ here are "
            "not comparable")


def machine(device: str) -> str:
    import jax

    if device == "gpu":
        return jax.devices()[0].device_kind
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs visible)"
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs visible)"


def prepare(workload: Any, variant: str, x: Any, y: Any) -> tuple[Result, Any, list[Any]]:
    """Lower and compile one variant; returns its result record, executable and state."""
    from benchmarks.workloads import variant_step

    result = Result(variant)
    try:
        step, params, opt_state = variant_step(workload, variant)
    except ImportError as error:
        result.error = f"not installed ({error.name or error})" if isinstance(
            error, ModuleNotFoundError) else f"unavailable: {error}"
        return result, None, []
    try:
        return _lower_compile(result, step, variant, params, opt_state, x, y)
    except Exception as error:  # noqa: BLE001 - recorded in the table
        result.error = f"failed to compile: {str(error).splitlines()[0][:120]}"
        return result, None, []


def _lower_compile(result: Result, step: Any, variant: str, params: Any, opt_state: Any,
                   x: Any, y: Any) -> tuple[Result, Any, list[Any]]:
    import jax

    import hlo_amp
    from benchmarks.workloads import HLO_AMP_POLICIES, XLA_OPTIONS
    from hlo_amp.targets.kept_by_xla import xla_gemms

    if variant in HLO_AMP_POLICIES:
        lowered = hlo_amp.compile(step, HLO_AMP_POLICIES[variant]).lower(params, opt_state, x, y)
        compiled = lowered.compile()
        result.lower_s, result.pass_s = lowered.lower_seconds, lowered.pass_seconds
        result.compile_s = compiled.compile_seconds
        policy = hlo_amp.Policy.parse(HLO_AMP_POLICIES[variant])
        if policy.scaling == "delayed":
            from benchmarks.llm import CarryingHistory

            compiled = CarryingHistory(compiled, policy.amax_history)
    else:
        start = time.perf_counter()
        lowered = jax.jit(step).lower(params, opt_state, x, y)
        result.lower_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=XLA_OPTIONS.get(variant))
        result.compile_s = time.perf_counter() - start
    result.converts = len(CONVERT.findall(lowered.as_text()))  # the module XLA compiles
    memory = compiled.memory_analysis()
    result.temp_bytes = int(memory.temp_size_in_bytes)
    result.arg_bytes = int(memory.argument_size_in_bytes)
    result.out_bytes = int(memory.output_size_in_bytes)
    gemms = xla_gemms(compiled.as_text())
    result.matmuls, result.low = len(gemms), sum(gemm.low for gemm in gemms)
    return result, compiled, [params, opt_state]


def chosen_variants(device: str, wanted: str | None) -> tuple[str, ...]:
    """The variants to run: all of ``device``'s, or the ``--variants`` subset (f32 first)."""
    from benchmarks.workloads import variants

    available = variants(device)
    if wanted is None:
        return available
    names = split_names(wanted)
    unknown = [v for v in names if v not in available]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; accepted: {', '.join(available)}")
    return ("f32", *[v for v in names if v != "f32"])


def bench_workload(workload: Any, steps: int, warmup: int, device: str = "cpu",
                   wanted: str | None = None, trace: Path | None = None) -> list[Result]:
    import jax

    x, y = workload.batch()
    prepared = [prepare(workload, v, x, y) for v in chosen_variants(device, wanted)]
    live = [(r, c, s) for r, c, s in prepared if c is not None]
    for i in range(warmup + steps):  # interleaved: one step of each variant per round
        for result, compiled, state in live:
            if result.error:
                continue
            start = time.perf_counter()
            try:
                out = jax.block_until_ready(compiled(state[0], state[1], x, y))
            except Exception as error:  # noqa: BLE001 - reported in the table, not fatal
                result.error = f"failed at run time: {str(error).splitlines()[0][:120]}"
                result.times.clear()
                print(f"  {result.variant}: {result.error}", flush=True)
                continue
            if i >= warmup:
                result.times.append(time.perf_counter() - start)
            state[0], state[1] = out[0], out[1]
    if trace is not None:
        from benchmarks.kernel_trace import trace_steps

        for result, compiled, state in live:
            if not result.error:
                result.kernels = trace_steps(_one_step(compiled, state, x, y), TRACED_STEPS,
                                             trace / workload.name / _slug(result.variant))
    return [r for r, _, _ in prepared]


TRACED_STEPS = 3


def _slug(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", variant).strip("_")


def _one_step(compiled: Any, state: list[Any], x: Any, y: Any) -> Any:
    """A callable that runs one step of ``compiled`` on ``state`` and keeps its result."""
    import jax

    def run() -> None:
        out = jax.block_until_ready(compiled(state[0], state[1], x, y))
        state[0], state[1] = out[0], out[1]
    return run


def stress_row(layers: int, quick: bool) -> dict[str, Any]:
    """Run the deep-transformer stress in a fresh process so its peak RSS is its own."""
    cmd = [sys.executable, "-m", "benchmarks.workloads", "stress", "--layers", str(layers)]
    if quick:
        cmd += ["--dim", "128", "--batch", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- rendering ------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def workload_table(results: list[Result]) -> list[str]:
    base = results[0]
    head = ["variant", "step ms (median)", "vs f32", "XLA temp MiB", "args MiB",
            "arg+out+temp MiB", "converts", "lower s", "pass ms", "XLA compile s",
            "low-precision dots/convs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.error and r.compile_s != r.compile_s:  # never compiled (nan)
            lines.append(f"| {r.variant} | {r.error} |" + " |" * (len(head) - 2))
            continue
        ok = not r.error and not base.error
        lines.append("| " + " | ".join([
            r.variant, f"{1e3 * r.median:.2f}" if not r.error else f"**{r.error}**",
            f"{base.median / r.median:.2f}×" if ok else "-",
            _mib(r.temp_bytes), _mib(r.arg_bytes),
            _mib(r.arg_bytes + r.out_bytes + r.temp_bytes), str(r.converts), f"{r.lower_s:.2f}",
            "-" if r.pass_s is None else f"{1e3 * r.pass_s:.1f}", f"{r.compile_s:.2f}",
            f"{r.low}/{r.matmuls}"]) + " |")
    return lines


def _line(what: str, target: str, measured: str, ok: bool) -> str:
    return f"- {what}: target {target}, measured {measured} — {'met' if ok else 'MISSED'}"


def targets(name: str, results: list[Result]) -> list[str]:
    by = {r.variant: r for r in results if not r.error}
    f32, amp = by.get("f32"), by.get("hlo_amp bf16")
    if f32 is None or amp is None:
        return ["- hlo_amp bf16 or f32 did not run: no target check"] + mixed_targets(name, by)
    speed = f32.median / amp.median
    out = []

    def line(what: str, target: str, measured: str, ok: bool) -> None:
        out.append(_line(what, target, measured, ok))

    if name in TARGET_SPEEDUP:
        t = TARGET_SPEEDUP[name]
        line("hlo_amp bf16 speed-up over f32", f"≥ {t}×", f"{speed:.2f}×", speed >= t)
    others = [r for v, r in by.items() if not v.startswith(("f32", "hlo_amp"))]
    if others:
        best = min(others, key=lambda r: r.median)
        line("hlo_amp vs fastest other bf16 variant", f"≤ 1.00× its step time ({best.variant})",
             f"{amp.median / best.median:.2f}×", amp.median <= best.median)
    share = amp.pass_s / amp.compile_s
    line("pass time / XLA compile time", "≤ 2%", f"{100 * share:.1f}%", share <= 0.02)
    ratio = amp.compile_s / f32.compile_s
    line("XLA compile time, rewritten vs f32", "≤ 1.1×", f"{ratio:.2f}×", ratio <= 1.1)
    line("XLA temp memory vs f32", "≤ f32's", f"{_mib(amp.temp_bytes)} vs {_mib(f32.temp_bytes)} MiB",
         amp.temp_bytes <= f32.temp_bytes)
    return out + mixed_targets(name, by)


def mixed_targets(name: str, by: dict[str, Result]) -> list[str]:
    """The mixed_bfloat16 targets: temp memory (ViT, CNN) and speed against the bf16 peers.

    Speed is 1 / median step time, so "≥ 0.95× hlo_amp bf16's" means a step time at most
    1/0.95 of that mode's.
    """
    mixed = by.get(MIXED)
    if mixed is None:
        return [f"- {MIXED} did not run: no mixed_bfloat16 target check"]
    out = []
    f32, flax = by.get("f32"), by.get("flax bf16")
    if name in TARGET_MIXED_TEMP:
        share = TARGET_MIXED_TEMP[name]
        if f32 is not None:
            out.append(_line(f"{MIXED} XLA temp memory vs f32", f"≤ {share}× f32's",
                             f"{_mib(mixed.temp_bytes)} vs {_mib(f32.temp_bytes)} MiB "
                             f"({mixed.temp_bytes / max(1, f32.temp_bytes):.2f}×)",
                             mixed.temp_bytes <= share * f32.temp_bytes))
        if flax is not None:
            out.append(_line(f"{MIXED} XLA temp memory vs flax bf16", "≤ flax bf16's",
                             f"{_mib(mixed.temp_bytes)} vs {_mib(flax.temp_bytes)} MiB",
                             mixed.temp_bytes <= flax.temp_bytes))
    for peer, share in (("hlo_amp bf16", 0.95), ("flax bf16", 1.0), ("Keras mixed_bfloat16", 1.0)):
        other = by.get(peer)
        if other is None:
            out.append(f"- {MIXED} speed vs {peer}: {peer} did not run, no check")
            continue
        ratio = other.median / mixed.median  # speed of mixed over speed of the peer
        out.append(_line(f"{MIXED} speed vs {peer}", f"≥ {share:.2f}× its speed",
                         f"{ratio:.2f}× ({1e3 * mixed.median:.2f} vs {1e3 * other.median:.2f} ms)",
                         ratio >= share))
    return out


def chart(all_results: dict[str, list[Result]], path: Path, label: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(all_results)
    variants = [r.variant for r in next(iter(all_results.values()))
                if any(not x.error for rs in all_results.values() for x in rs
                       if x.variant == r.variant)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(variants))
    for j, v in enumerate(variants):
        speed = []
        for name in names:
            rs = {r.variant: r for r in all_results[name]}
            r = rs.get(v)
            ok = r and not r.error and not rs["f32"].error
            speed.append(rs["f32"].median / r.median if ok else 0.0)
        ax.bar(np.arange(len(names)) + (j - (len(variants) - 1) / 2) * width, speed, width,
               label=v)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylabel("speed-up over f32 (median step time)")
    ax.set_title(f"train-step speed-up, {label}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncol=min(4, len(variants)))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cuda" if args.device == "gpu" else "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.device in AOT_DEVICES:
        if args.trace is not None:
            raise SystemExit(f"--trace runs steps; --device {args.device} runs none "
                             "(accepted with --trace: cpu, gpu)")
        aot_main(args, argv)
        return
    args.workloads = args.workloads or "mlp,vit,cnn"
    import jax

    try:
        platform_name = jax.devices()[0].platform
    except RuntimeError as error:
        raise SystemExit(f"--device {args.device}: no such device here ({error})") from None
    if (args.device == "gpu") != (platform_name == "gpu"):
        raise SystemExit(f"--device {args.device} asked, but jax runs on {platform_name}")

    from benchmarks.workloads import workloads

    steps = args.steps if args.steps is not None else (10 if args.quick else 20)
    wanted = split_names(args.workloads)
    label = machine(args.device)
    command = recorded_command(argv if argv is not None else sys.argv[1:])
    print(f"{label}; jax {jax.__version__}; {steps} timed steps after {args.warmup} warm-up",
          flush=True)
    from hlo_amp.targets.cpu import native_bf16_flags

    cpu_name, cpu_flags = machine("cpu"), native_bf16_flags()
    print(f"CPU {cpu_name}: native bf16 flags {', '.join(cpu_flags) or 'none'} "
          "(avx512_bf16 / amx_bf16)", flush=True)

    all_results: dict[str, list[Result]] = {}
    md = [
        "# hlo_amp benchmark results",
        "",
        f"- machine: {label} ({args.device})",
        cpu_bf16_line(cpu_name) + (" (host CPU; the dots ran on the GPU)." if args.device == "gpu"
                           else "."),
        f"- jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else jax.__version__}, Python {platform.python_version()}",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- command: `{command.strip()}`" + (" (reduced sizes)" if args.quick else ""),
        (f"- timing: median of {steps} steps after {args.warmup} warm-up, all variants of a "
        "workload in one process, interleaved one step each"),
        ("- low-precision dots/convs: dot/convolution instructions in XLA's optimized HLO "
        "whose operands are all 16-bit, over all dot/convolution instructions"),
        ("- converts: `stablehlo.convert` ops in the module XLA compiles (for hlo_amp the "
         "rewritten module, otherwise `jax.jit(step).lower(...).as_text()`); XLA temp, args "
         "and arg+out+temp are from `compiled.memory_analysis()` (temp_size_in_bytes, "
         "argument_size_in_bytes, + output_size_in_bytes)"),
        "",
    ]
    for workload in workloads(args.quick):
        if workload.name not in wanted:
            continue
        print(f"== {workload.name}: {workload.description}", flush=True)
        results = bench_workload(workload, steps, args.warmup, args.device, args.variants,
                                 args.trace)
        all_results[workload.name] = results
        table = workload_table(results)
        if args.trace is not None:
            from benchmarks.kernel_trace import trace_table

            table += ["", (f"Kernels of {TRACED_STEPS} traced steps (traces in "
                           f"`{args.trace}`):"), "",
                      *trace_table([(r.variant, r.median, r.kernels) for r in results
                                    if r.kernels is not None])]
        checks = targets(workload.name, results)
        print("\n".join(table + [""] + checks + [""]), flush=True)
        md += [f"## {workload.name}: {workload.description}", "", *table, "", "Targets:", "",
               *checks, ""]

    if args.stress_layers:
        print(f"== stress: {args.stress_layers}-layer transformer, lower + pass", flush=True)
        row = stress_row(args.stress_layers, args.quick)
        print(row, flush=True)
        md += [f"## Stress: {args.stress_layers}-layer transformer train step through the pass",
               "", "Lowering and rewrite only (no XLA compile), in a fresh process.", ""]
        if "error" in row:
            md += [f"failed: {row['error']}", ""]
        else:
            md += [
                "| layers | embed | batch | ops in module | dots/convs | converted | lower s | pass s | max RSS before pass MiB | max RSS after MiB |",
                "|---|---|---|---|---|---|---|---|---|---|",
                (f"| {row['layers']} | {row['dim']} | {row['batch']} | {row['ops']} | "
                f"{row['dots_convs']} | {row['converted']} | {row['lower_seconds']:.2f} | "
                f"{row['pass_seconds']:.2f} | {row['max_rss_before_mib']:.0f} | "
                f"{row['max_rss_mib']:.0f} |"), ""]

    # Written on the 2-core AMD EPYC without native bf16 that produced the committed figures.
    no_bf16_notes = [
        ("- Why the speed targets are missed on this machine: its CPU (AMD EPYC Zen 3 "
         "guest) has no AVX512-BF16 or AMX; `/proc/cpuinfo` lists only avx2/fma/f16c. "
         "XLA:CPU's bf16 dot path (YNNPACK) emulates bf16 there and runs 0.5-0.8x of f32 "
         "in every layout (benchmarks/DOT_LAYOUT.md), so every bf16 variant is slower than "
         "f32. hlo_amp's bf16xbf16->f32 dots are still the fastest bf16 variant: Flax's "
         "and jmp's bf16->bf16 dots are upcast by XLA (0 low-precision dots)."),
        ("- The cost-aware answer is the `only_if_faster=true` policy option: compiled for "
         "CPU it leaves in f32 every dot XLA:CPU cannot run faster in bf16 (here: all of them, "
         "the report says why), so it runs at f32 speed; on GPU it converts everything."),
        ("- Weight-gradient dots (contracting [0]x[0], [0,1]x[0,1]) miss YNNPACK as "
         "written; the fast-dot-layout pass relays them onto it (and fixes an XLA:CPU "
         "run-time failure on transposed bf16 dots). On a CPU with native bf16 that should "
         "bring them the forward-layout gain; not measured (no such CPU was available)."),
        ("- ViT: hlo_amp bf16 (0.73×) is slower than Flax/jmp bf16 (0.89×) here because it keeps 111/113 dots in bf16 on this CPU's emulated bf16 path, including the weight-gradient and attention dK/dV dots the layout pass relays (0.33–0.49× of f32 each, DOT_LAYOUT.md); Flax's and jmp's dots are upcast to f32. Relaying only the dots XLA:CPU would fail on (`relay_slow=False`) was faster but let the full-size ViT step fail at run time, so it is not the default; `only_if_faster=true` is the fast choice on this CPU (0.99×)."),
    ]
    png = args.out / "results.png"
    args.out.mkdir(parents=True, exist_ok=True)
    if all_results:
        chart(all_results, png, f"{args.device}: {label}")
        md += ["![speed-up over f32](results.png)", ""]
    md += [
        "## Notes",
        "",
        ("- jaxamp 0.0.4 (PyPI, 2023-11) is not a dependency. Installed by hand into a "
         "scratch folder (`pip install --no-deps --target`), it imports, but "
         "`jaxamp.amp(loss)(w, x)` fails on jax 0.10.2 with `ValueError: too many values "
         "to unpack (expected 2)` (its jaxpr interpreter predates current jax), so its "
         "row is recorded, not measured."),
        *(no_bf16_notes if args.device == "cpu" and not cpu_flags else [
            ("- The notes on XLA:CPU's emulated bf16 (benchmarks/DOT_LAYOUT.md) were written "
             "on a CPU without `avx512_bf16`/`amx_bf16`; they are left out here because "
             + ("this CPU lists " + ", ".join(f"`{f}`" for f in cpu_flags) if cpu_flags
                else "the dots ran on the GPU") + ".")]),
        *([("- This file was made on CPU; measured GPU rows come from "
            "`python -m benchmarks.run --device gpu` on a GPU machine (variants f32 with "
            "XLA's default TF32, f32 with `xla_gpu_default_to_alg_dot_bf16_bf16_f32`, Flax "
            "bf16, Keras mixed_bfloat16, hlo_amp bf16 and mixed_bfloat16; the last such "
            "run, on an H100, is in its own section below). Rows compiled "
            "for an H100 without a device (`--device h100-aot`), nothing run, are in their "
            "own section below.")]
          if args.device == "cpu" else []),
        ("- `Keras mixed_bfloat16`: the same models written with Keras 3 layers (JAX "
         "backend), every layer at `dtype=\"mixed_bfloat16\"` (f32 variables cast to bf16 "
         "per layer, activations bf16 between layers), trained through "
         "`model.stateless_call` in a `jax.jit` step with the same optax adam."),
        ("- mixed_bfloat16 speed targets compare speed (1 / median step time): "
         "\"≥ 0.95× hlo_amp bf16's\" means a step at most 1/0.95 of that mode's."),
        ("- Compile time and temp memory of the bf16 module exceed f32's: the extra "
         "converts, the layout pass's transposes/barriers and the YNNPACK fusions give XLA "
         "more to compile and hold bf16 copies of activations. With `only_if_faster` the "
         "module is the f32 one; its compile time differs from f32's only by noise (this "
         "2-core machine was shared)."),
        ("- Pass time includes copying the module (bytecode round trip), three passes "
         "and a verify after each; it is 1-3% of XLA's compile time."),
        ("- `hlo_amp fp8` (the `fp8` preset: dot_general as per-tensor-scaled fp8, e4m3fn "
         "forward and e5m2 gradients; first and last matrix op and convolutions in bf16) "
         "is a Hopper feature: XLA:GPU turns its dots into `__cublas$lt$matmul$f8` GEMMs. "
         "XLA:CPU has no fp8 dot, so on CPU the quantised operands are dequantised to f32 "
         "and the dots run in f32: its CPU row is the cost of computing the scales and "
         "quantising in the program (a numerics preview), not an fp8 speed. Its "
         "low-precision dots/convs count is the bf16 dots that stay (first/last, "
         "fallbacks): XLA's HLO shows the fp8 dots as f32 dots on CPU."
         + ("" if args.device == "gpu" else " No GPU was available to the session that "
            "made this file: no fp8 GPU figures.")),
        *[f"- {name}: `{r.variant}` {r.error}" for name, rs in all_results.items() for r in rs
          if r.error and r.variant != "jaxamp"],
        "",
    ]
    results_md = args.out / "RESULTS.md"
    kept = kept_below(results_md.read_text()) if results_md.exists() else HAND_WRITTEN + "\n"
    results_md.write_text("\n".join(md) + "\n" + kept)
    print(f"wrote {args.out / 'RESULTS.md'} and {png}")


# Another script's section of RESULTS.md: "<!-- NAME: begin ... -->" to "<!-- NAME: end -->"
# (benchmarks.llm, compile_cost, stress, this file's --device h100-aot).
MARKED_SECTION = re.compile(r"<!-- (?P<name>[^>]*?): ?begin\b[^>]*-->.*?<!-- (?P=name): ?end -->",
                            re.DOTALL)


def kept_below(text: str) -> str:
    """What a CPU run keeps of the RESULTS.md it rewrites: the hand-written line and all
    below it (analysis, demo, dispatch, other scripts' sections); in a file without that
    line (written by another script's ``--results`` or ``--out``), the line and that
    file's marked sections: its unmarked text is an older CPU part, replaced."""
    if HAND_WRITTEN in text:
        return text[text.index(HAND_WRITTEN):]
    sections = [m.group(0) for m in MARKED_SECTION.finditer(text)]
    return "\n\n".join([HAND_WRITTEN, *sections]) + "\n"


# ---- a GPU compiled without the device (--device h100-aot / h200-aot) -----------------------


@dataclass
class AotResult:
    variant: str
    error: str | None = None
    compile_s: float = float("nan")
    temp_bytes: int = 0
    estimate: Any = None  # hlo_amp.targets.roofline.Estimate
    fp8_dots: tuple[int, int, int] | None = None  # (run as fp8 GEMMs, quantised, unknown)


def aot_compile(workload: Any, variant: str, target: Any, x: Any, y: Any) -> AotResult:
    """Compile one variant for ``target`` (a Target) without the device; estimate."""
    import jax

    import hlo_amp
    from benchmarks.workloads import HLO_AMP_POLICIES, XLA_OPTIONS, variant_step
    from hlo_amp import compile_for_target
    from hlo_amp.targets.roofline import estimate

    result = AotResult(variant)
    try:
        step, params, opt_state = variant_step(workload, variant)
    except ImportError as error:
        result.error = f"not installed ({error.name or error})" if isinstance(
            error, ModuleNotFoundError) else f"unavailable: {error}"
        return result
    start = time.perf_counter()
    try:
        if variant in HLO_AMP_POLICIES:
            compiled = hlo_amp.compile(step, HLO_AMP_POLICIES[variant]).lower(
                params, opt_state, x, y, target=target).compile()
        else:
            compiled = compile_for_target(jax.jit(step), params, opt_state, x, y,
                                          target=target,
                                          compiler_options=XLA_OPTIONS.get(variant))
    except Exception as error:  # noqa: BLE001 - recorded in the table
        result.error = f"failed to compile: {str(error).splitlines()[0][:160]}"
        return result
    result.compile_s = time.perf_counter() - start
    result.temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)
    result.estimate = estimate(compiled.as_text(), target)
    if variant == "hlo_amp fp8":
        quantised = [d for d in compiled.report().decisions
                     if d.fp8 and d.changed and d.op_kind != "convolution"]
        result.fp8_dots = (sum(d.kept_by_xla is True for d in quantised), len(quantised),
                           sum(d.kept_by_xla is None for d in quantised))
    return result


def _parameter_copies(workload: Any) -> int:
    """Bytes of a 16-bit copy of the workload's float parameters."""
    from benchmarks.hand_cast_workloads import param_bytes_16bit
    from benchmarks.workloads import variant_step

    return param_bytes_16bit((variant_step(workload, "f32")[1],))


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}×" if base else "-"


def _calls(estimate: Any) -> str:
    """``GEMM bf16 ×111, conv bf16 ×2``: library calls per step by operand types."""
    order = sorted(estimate.calls.items(), key=lambda kv: (kv[0][0].startswith("conv"), -kv[1]))
    return ", ".join(f"{kind.split()[0]} {dtype} ×{n}" for (kind, dtype), n in order) or "none"


def aot_table(results: list[AotResult], calls: str = "cuBLAS/cuDNN calls") -> list[str]:
    """One row per variant; ``calls`` names the matrix-op column (XLA:TPU has no library
    calls: its matrix ops are convolutions)."""
    base = next((r for r in results if r.variant == "f32" and not r.error), None)
    head = ["variant", "16-bit FLOP share", "fp8 FLOP share", f"{calls} by dtype",
            "XLA temp MiB", "vs f32", "HBM GB (est.)", "vs f32", "roofline ms", "vs f32"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"| {r.variant} | {r.error} |" + " |" * (len(head) - 2))
            continue
        e, b = r.estimate, base.estimate if base else None
        lines.append("| " + " | ".join([
            r.variant, f"{100 * e.share_16bit:.1f}%", f"{100 * e.share_fp8:.1f}%", _calls(e),
            _mib(r.temp_bytes), _ratio(r.temp_bytes, base.temp_bytes)
            if base and base.temp_bytes >= 2**20 else "-",
            f"{e.hbm_bytes / 1e9:.2f}", _ratio(e.hbm_bytes, b.hbm_bytes) if b else "-",
            f"{1e3 * e.roofline_seconds:.4g}",
            _ratio(e.roofline_seconds, b.roofline_seconds) if b else "-"]) + " |")
    return lines


def aot_targets(name: str, results: list[AotResult], fp8: bool = True,
                no_fp8: str = "this device has no fp8 matrix unit",
                parameter_copies: int | None = None) -> list[str]:
    """mixed_bfloat16's temp memory and roofline time against its peers; both modes' temp
    against f32's plus ``parameter_copies`` (the bytes of a 16-bit copy of the parameters:
    what casting them at use may add, issue 33); fp8's GEMMs (``fp8=False``: a device
    hlo_amp's fp8 is refused on, for the reason ``no_fp8``)."""
    by = {r.variant: r for r in results if not r.error}
    mixed, f32, flax, accurate = (by.get(v) for v in (MIXED, "f32", "flax bf16",
                                                      "hlo_amp bf16"))
    out = []
    if mixed is not None and flax is not None and name not in TARGET_AOT_MIXED_TEMP:
        out.append(_line(f"{MIXED} XLA temp memory", "≤ flax bf16's",
                         f"{mixed.temp_bytes:,} vs {flax.temp_bytes:,} B",
                         mixed.temp_bytes <= flax.temp_bytes))
    for mode in (accurate, mixed):
        if mode is not None and f32 is not None and parameter_copies is not None:
            limit = f32.temp_bytes + parameter_copies
            out.append(_line(f"{mode.variant} XLA temp memory",
                             "≤ f32's + a 16-bit copy of the parameters",
                             f"{mode.temp_bytes:,} vs {limit:,} B", mode.temp_bytes <= limit))
    if mixed is None:
        out.append(f"- {MIXED}: no row (not selected or not compiled), no mixed_bfloat16 "
                   "target check")
    else:
        if name in TARGET_AOT_MIXED_TEMP:
            share = TARGET_AOT_MIXED_TEMP[name]
            for peer, limit, label in ((flax, 1.0, "flax bf16's"), (f32, share, f"{share}× f32's"),
                                       (accurate, 1.0, "hlo_amp bf16's (the accurate mode)")):
                if peer is None:
                    out.append(f"- {MIXED} XLA temp memory vs {label}: no row for it, no check")
                    continue
                out.append(_line(f"{MIXED} XLA temp memory", f"≤ {label}",
                                 f"{_mib(mixed.temp_bytes)} vs {_mib(peer.temp_bytes)} MiB "
                                 f"({mixed.temp_bytes / max(1, peer.temp_bytes):.3f}×)",
                                 mixed.temp_bytes <= limit * peer.temp_bytes))
        if flax is None:
            out.append(f"- {MIXED} roofline step time vs flax bf16: no flax bf16 row, no check")
        else:
            m, f = mixed.estimate.roofline_seconds, flax.estimate.roofline_seconds
            out.append(_line(f"{MIXED} roofline step time", "≤ flax bf16's",
                             f"{1e3 * m:.4g} vs {1e3 * f:.4g} ms ({m / f:.3f}×)", m <= f))
    if not fp8:
        out.append(f"- hlo_amp fp8: not compiled, {no_fp8}")
        return out
    fp8 = by.get("hlo_amp fp8")
    if fp8 is None or fp8.fp8_dots is None:
        out.append("- hlo_amp fp8: no row (not selected or not compiled), no fp8 target check")
    elif not fp8.fp8_dots[1]:
        out.append("- hlo_amp fp8: no dot quantised to fp8 here (the preset keeps the first "
                   "and last matrix op and convolutions in bf16): no fp8 target check")
    else:
        kept, quantised, unknown = fp8.fp8_dots
        calls = sum(n for (kind, _), n in fp8.estimate.calls.items() if kind == "GEMM fp8")
        out.append(_line("hlo_amp fp8 dots run as `__cublas$lt$matmul$f8`",
                         f"≥ {TARGET_FP8_GEMMS:.0%} of the dots it quantises",
                         f"{kept}/{quantised} ({kept / quantised:.0%})"
                         + (f", {unknown} not matched (merged by XLA)" if unknown else "")
                         + f"; {calls} fp8 GEMM calls in the HLO",
                         kept >= TARGET_FP8_GEMMS * quantised))
    return out


AOT_BEGIN = "<!-- benchmarks.run --device {key}: begin (replaced by each run) -->"
AOT_END = "<!-- benchmarks.run --device {key}: end -->"


def write_aot_section(results_md: Path, key: str, lines: list[str]) -> None:
    """Put ``lines`` into RESULTS.md between this device's markers, below the hand-written
    line (so CPU runs keep it); replace only that section when it exists."""
    begin, end = AOT_BEGIN.format(key=key), AOT_END.format(key=key)
    section = "\n".join([begin, *lines, end])
    text = results_md.read_text() if results_md.exists() else "# hlo_amp benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        if HAND_WRITTEN not in text:
            text = text.rstrip("\n") + "\n\n" + HAND_WRITTEN + "\n"
        ends = [text.index(m) + len(m) for m in re.findall(
            r"<!-- benchmarks\.run --device [\w-]+: end -->", text)]
        at = max(ends) if ends else text.index(HAND_WRITTEN) + len(HAND_WRITTEN)
        text = text[:at] + "\n\n" + section + "\n\n" + text[at:].lstrip("\n")
    results_md.write_text(text)


def _source_state() -> str:
    """`` at commit abc1234`` (with uncommitted changes under hlo_amp/ said), or nothing."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hlo_amp"], cwd=root,
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f" at commit {head}" + (" with uncommitted changes under hlo_amp/" if dirty else "")


def aot_header(target: Any, command: str, jax_version: str) -> list[str]:
    if target.platform == "tpu":
        return _tpu_aot_header(target, command, jax_version)
    peaks = ", ".join(f"{'f32 (TF32)' if k == 'f32' else k} {v / 1e12:.1f}"
                      for k, v in target.peak_flops.items())
    return [
        f"## {target.device}, compiled without a device",
        "",
        (f"- compiled for {target.device} without a device (XLA:GPU, Triton GEMM off): "
         f"`{target.description}` as hlo_amp/targets/gpu.py describes it; nothing "
         "ran, every figure is XLA's compile output or a model of it"),
        (f"- jax {jax_version}, Python {platform.python_version()}, "
         f"date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}"),
        f"- command: `JAX_PLATFORMS=cpu {command.strip()}`{_source_state()}",
        (f"- peaks used (dense, datasheet): {peaks} TFLOP/s; HBM "
         f"{target.hbm_bytes_per_second / 1e12:.2f} TB/s"),
        ("- 16-bit / fp8 FLOP share: of all GEMM + convolution FLOPs (cuBLAS and cuDNN calls, "
         "shapes from the optimized HLO), those whose two matrix operands are bf16/f16, fp8; "
         "calls by dtype: per step, by the operand types (`f8e5m2×f8e4m3fn`: gradient × "
         "weight); XLA temp: `memory_analysis().temp_size_in_bytes`"),
        ("- HBM GB (est.): over the optimized HLO's top-level kernels (fusions, custom calls, "
         "copies; while bodies times their trip counts), operand + result bytes. Roofline: "
         "per kernel the larger of bytes ÷ HBM bandwidth and matrix FLOPs ÷ the peak of its "
         "operand type, summed (`hlo_amp/targets/roofline.py`)"),
        ("- blind spots: no L2/cache reuse (every kernel reads and writes HBM), traffic inside "
         "a fusion is free, elementwise FLOPs, launch latency and small-kernel inefficiency are "
         "ignored, peaks are datasheet numbers no kernel reaches, and without a device there "
         "is no autotuning (Triton GEMM off: every GEMM a cuBLAS call, where a real run may "
         "pick Triton). Ratios between variants are the point, not absolute times"),
        "",
    ]


def _tpu_aot_header(target: Any, command: str, jax_version: str) -> list[str]:
    return [
        f"## {target.device}, compiled without a device",
        "",
        (f"- compiled for {target.device} without a device (XLA:TPU through libtpu, slice "
         f"`{target.topology}`, one chip's program): nothing ran, every figure is XLA's "
         "compile output or a model of it"),
        (f"- jax {jax_version}, Python {platform.python_version()}, "
         f"date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}"),
        f"- command: `JAX_PLATFORMS=cpu {command.strip()}`{_source_state()}",
        (f"- peaks used (public, per chip): bf16 {target.peak_flops['bf16'] / 1e12:.0f} "
         "TFLOP/s, also for f32 dots (XLA:TPU runs them as one bf16 pass at DEFAULT "
         f"precision); HBM {target.hbm_bytes_per_second / 1e9:.0f} GB/s"),
        ("- 16-bit FLOP share: of all matrix FLOPs (XLA:TPU emits dots and convolutions as "
         "`convolution`, shapes from the optimized HLO; only the products computed: its "
         "batched dots are convolutions over a batch dilated into holes), those whose two "
         "operands are bf16; XLA temp: `memory_analysis().temp_size_in_bytes`. No fp8 row: "
         f"{_no_fp8(target)}"),
        ("- HBM GB (est.) and roofline: as for the GPU rows (`hlo_amp/targets/roofline.py`), over "
         "XLA:TPU's top-level fusions; blind spots: VMEM/CMEM reuse, the MXU's f32 passes "
         "(an f32 operand fed as bf16) and the vector units' time are not modelled. Ratios "
         "between variants are the point, not absolute times"),
        "",
    ]


def _no_fp8(target: Any) -> str:
    """Why hlo_amp's fp8 preset is not compiled for ``target`` (its refusal, in words)."""
    why = target.refusal({"float8_e5m2"})
    return why.split(", and ", 1)[-1] if why else "this device has no fp8 matrix unit"


def recorded_command(argv: list[str]) -> str:
    """The command line RESULTS.md records: where the file was written (``--out``) is
    left out, as it changes nothing measured and the committed file lives elsewhere."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif not word.startswith("--out="):
            kept.append(word)
    return "python -m benchmarks.run " + shlex.join(kept)


def aot_main(args: argparse.Namespace, argv: list[str] | None) -> None:
    import jax

    from benchmarks.workloads import workloads
    from hlo_amp.targets import device_target

    target = device_target(AOT_DEVICES[args.device])
    wanted = split_names(args.workloads or "mlp,vit,cnn,decoder")
    command = recorded_command(argv if argv is not None else sys.argv[1:])
    print(f"compiling for {target.device} without a device; jax {jax.__version__}", flush=True)
    md = aot_header(target, command, jax.__version__)
    start = time.perf_counter()
    for workload in workloads(args.quick):
        if workload.name not in wanted:
            continue
        print(f"== {workload.name}: {workload.description}", flush=True)
        x, y = workload.batch()
        results = []
        for variant in chosen_variants(args.device, args.variants):
            results.append(aot_compile(workload, variant, target, x, y))
            r = results[-1]
            print(f"  {variant}: " + (r.error or f"compiled in {r.compile_s:.1f} s"), flush=True)
        tpu = target.platform == "tpu"
        table = aot_table(results, "XLA:TPU matrix ops" if tpu else "cuBLAS/cuDNN calls")
        checks = aot_targets(workload.name, results, fp8=not tpu, no_fp8=_no_fp8(target),
                             parameter_copies=_parameter_copies(workload))
        f32 = next((r for r in results if r.variant == "f32" and not r.error), None)
        if f32 is not None and f32.temp_bytes < 2**20:
            table.append(f"\nf32's XLA temp is {f32.temp_bytes} bytes (XLA keeps this step's "
                         "intermediates in its output buffers): no temp ratios against it.")
        print("\n".join(table + [""] + checks + [""]), flush=True)
        md += [f"### {workload.name}: {workload.description}", "", *table, "", "Targets:", "",
               *checks, ""]
    elapsed = time.perf_counter() - start
    md.append(f"Compiling and estimating all rows took {elapsed:.0f} s on "
              f"{machine('cpu')}" + (" (reduced sizes)." if args.quick else "."))
    args.out.mkdir(parents=True, exist_ok=True)
    write_aot_section(args.out / "RESULTS.md", args.device, md)
    print(f"wrote the {target.device} section of {args.out / 'RESULTS.md'} "
          f"({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
