"""Where XLA:GPU's compile time goes, by kind of kernel, for the 1.1B decoder's train step.

``python -m benchmarks.compile_cost`` compiles ``benchmarks/llm.py``'s step (batch 8,
donated, as ``--device h100-aot --batch 8`` does) for an H100 without the device, one
child process per variant (``--variant``, default ``hlo_amp mixed_bfloat16`` and
``hlo_amp fp8``), with XLA's phase timers logged and its PTX dumped. It prints XLA's own
figures (compile seconds; HLO passes; the backend; LLVM-to-PTX and ptxas CPU-seconds
summed over XLA's compile threads; PTX modules compiled) and then the kernels by kind: how
many distinct kernels (after XLA's deduplication), their PTX bytes, and the seconds
``ptxas -O3`` takes on each one's PTX here (one at a time; skipped without ``ptxas`` on
PATH). Kinds are read from each kernel's fused computation in the optimized HLO:

* transpose, fp8 result: a transpose in a kernel that writes fp8 (Hopper's fp8 GEMMs
  read both operands with the contracting dimension minor);
* max reduction: a reduction with ``maximum`` (fp8's amaxes; the loss's max too);
* scalars: every result rank 0 (fp8's scales; a step counter);
* fp8 result: any other kernel writing fp8 (quantisation);
* other;
* constants only: a PTX module with no kernel (XLA compiles it too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.cli_args import check_names, check_out_file
from hlo_amp.targets.hlo_text import Instruction, parse_module

VARIANTS = ("hlo_amp mixed_bfloat16", "hlo_amp fp8")
KINDS = ("transpose, fp8 result", "max reduction", "scalars", "fp8 result", "other",
         "constants only")
# XLA's phase timers (gpu_compiler.cc, nvptx_compiler.cc): the last line of each holds
# its cumulative seconds and call count.
TIMERS = {"HLO passes": r"GpuCompiler::RunHloPasses", "backend": r"GpuCompiler::RunBackend for",
          "LLVM to PTX": r"CompileToPtx", "ptxas": r"PtxToCubin"}
TIMER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0",
             "TF_CPP_VMODULE": "gpu_compiler=1,nvptx_compiler=2"}


def _seconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+) (s|ms|us)", text).groups()
    return float(number) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def xla_timers(log: str) -> dict[str, tuple[float, int]]:
    """{phase: (cumulative seconds, calls)} from XLA's timer lines in ``log``."""
    found = {}
    for phase, pattern in TIMERS.items():
        lines = re.findall(pattern + r".*?\(cumulative: ([\d.]+ (?:s|ms|us)),.*?#called: (\d+)\)",
                           log)
        if lines:
            cumulative, calls = lines[-1]
            found[phase] = (_seconds(cumulative), int(calls))
    return found


def kind_of(fused: list[Instruction], max_reducers: set[str]) -> str:
    """One of ``KINDS`` for a fused computation's instructions; ``max_reducers``: the
    names of the reducer computations whose root is a ``maximum``."""
    root = next((i for i in fused if i.root), None)
    results = root.arrays if root is not None else []
    fp8_result = any(a.dtype.startswith("f8") for a in results)
    if fp8_result and any(i.op == "transpose" for i in fused):
        return "transpose, fp8 result"
    if any(i.op == "reduce" and i.attr("to_apply") in max_reducers for i in fused):
        return "max reduction"
    if results and all(a.shape == () for a in results):
        return "scalars"
    return "fp8 result" if fp8_result else "other"


def by_kind(dump: Path, hlo: str, ptxas: str | None) -> dict[str, list[float]]:
    """{kind: [PTX modules, PTX bytes, ptxas seconds]} over the PTX files in ``dump``
    (one kernel each, or none: constants only)."""
    computations, _ = parse_module(hlo)
    max_reducers = {name for name, body in computations.items()
                    if any(i.root and i.op == "maximum" for i in body)
                    and not any(i.op == "reduce" for i in body)}
    # A kernel is named after its fusion instruction, "." and "-" written "_".
    fused = {re.sub(r"[.\-]", "_", i.name): computations.get(i.attr("calls") or "", [])
             for body in computations.values() for i in body if i.op == "fusion"}
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for ptx in sorted(dump.glob("*.ptx")):
        text = ptx.read_text()
        if not text:
            continue
        entries = re.findall(r"^\.visible \.entry (\w+)\(", text, re.MULTILINE)
        row = table[kind_of(fused.get(entries[0], []), max_reducers) if entries
                    else "constants only"]
        row[0] += 1
        row[1] += len(text)
        if ptxas:
            start = time.perf_counter()
            subprocess.run([ptxas, "-arch=sm_90a", "-O3", str(ptx), "-o", os.devnull],
                           check=True, capture_output=True)
            row[2] += time.perf_counter() - start
    return table


def config_of(attention: str | None, small: bool) -> Any:
    """The step's ``benchmarks.llm.Config``: the 1.1B at batch 8, or ``SMALL``."""
    import dataclasses

    from benchmarks import llm

    config = llm.SMALL if small else llm.Config(batch=8)
    return dataclasses.replace(config, attention=attention) if attention else config


def child(variant: str, config: Any, out: Path) -> None:
    """Compile one variant (XLA_FLAGS set by the parent) and write its seconds and HLO."""
    from benchmarks import llm

    seconds: dict[str, float] = {}
    compiled = llm.compile_variant(variant, "h100", config, seconds=seconds)
    (out / "optimized.hlo").write_text(compiled.as_text())
    (out / "seconds.json").write_text(json.dumps(seconds))


def _without_kernel_cache(flags: str) -> str:
    """``flags`` less ``--xla_gpu_kernel_cache_file`` (make test sets it): a kernel XLA
    reads back from that cache is neither compiled nor dumped, so it would go uncounted."""
    return re.sub(r"(^|\s)--xla_gpu_kernel_cache_file=\S*", " ", flags).strip()


def measure(variant: str, ptxas: str | None, attention: str | None = None,
            small: bool = False) -> dict:
    """One variant compiled in a child process: XLA's timers and the kernels by kind."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        dump = out / "dump"
        env = {**os.environ, **TIMER_ENV, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{_without_kernel_cache(os.environ.get('XLA_FLAGS', ''))} "
                            f"--xla_dump_to={dump}"}
        command = [sys.executable, "-m", "benchmarks.compile_cost", "--child", variant,
                   str(out)] + (["--attention", attention] if attention else []) + (
                       ["--small"] if small else [])
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
        if done.returncode:
            raise SystemExit(f"compiling {variant!r} failed:\n{done.stderr[-3000:]}")
        hlo = (out / "optimized.hlo").read_text()
        return {"seconds": json.loads((out / "seconds.json").read_text()),
                "timers": xla_timers(done.stderr), "kinds": by_kind(dump, hlo, ptxas)}


def report(results: dict[str, dict], ptxas: str | None) -> list[str]:
    """The two tables, variants as columns."""
    names = list(results)
    lines = ["| XLA (h100, no device) | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names),
             "| compile s | " + " | ".join(f"{r['seconds']['compile']:.2f}"
                                          for r in results.values()) + " |"]
    for phase in TIMERS:
        cells = []
        for r in results.values():
            seconds, calls = r["timers"].get(phase, (float("nan"), 0))
            cells.append(f"{seconds:.2f}" + (f" ({calls} modules)" if phase == "ptxas" else ""))
        lines.append(f"| {phase} s | " + " | ".join(cells) + " |")
    lines += ["", "| PTX modules by kind: count, KB" + (", ptxas s" if ptxas else "") + " | "
              + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind in (*KINDS, "all"):
        cells = []
        for r in results.values():
            rows = r["kinds"].values() if kind == "all" else [r["kinds"].get(kind, [0, 0, 0.0])]
            count, size, seconds = (sum(row[i] for row in rows) for i in range(3))
            cells.append(f"{count}, {size / 1024:.0f}" + (f", {seconds:.2f}" if ptxas else ""))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", help=f"default: {', '.join(VARIANTS)}")
    parser.add_argument("--attention", help="how the model writes attention (llm.py's forms)")
    parser.add_argument("--small", action="store_true", help="benchmarks.llm's SMALL preset")
    parser.add_argument("--results", type=Path,
                        help="write the tables into this markdown file (benchmarks/RESULTS.md)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.results is not None:  # found by the write after every compile before
        check_out_file(parser, "--results", args.results)
    if args.child:
        child(args.child[0], config_of(args.attention, args.small), Path(args.child[1]))
        return
    import jax

    from benchmarks.llm import ATTENTION_FORMS, _machine, write_section
    from benchmarks.llm import VARIANTS as LLM_VARIANTS

    check_names(parser, "--variant", args.variant or (), LLM_VARIANTS)
    check_names(parser, "--attention", [args.attention] if args.attention else [],
                ATTENTION_FORMS)

    ptxas = shutil.which("ptxas")
    machine = f"compiled on {_machine()}; ptxas: {ptxas or 'not on PATH, not timed'}"
    print(machine, flush=True)
    results = {variant: measure(variant, ptxas, args.attention, args.small)
               for variant in args.variant or VARIANTS}
    tables = report(results, ptxas)
    print("\n".join(tables))
    if args.results:
        key = "h100" + (" --small" if args.small else "") + (
            f" --attention {args.attention}" if args.attention else "")
        command = "python -m benchmarks.compile_cost " + shlex.join(
            argv if argv is not None else sys.argv[1:])
        write_section(args.results, [
            f"<!-- benchmarks.compile_cost {key}: begin (replaced by each run) -->",
            ("## Compile time by kind of kernel: benchmarks.llm's "
             f"{'SMALL' if args.small else '1.1B'} decoder's step for an H100 without the "
             "device"),
            "",
            (f"- command: `{command}`; jax {jax.__version__}; {machine}; "
             f"{time.strftime('%Y-%m-%d')}"),
            ("- XLA's timers: one compile each, with XLA's timer logging on (it runs a "
             "little slower than without); LLVM to PTX and ptxas: CPU-seconds summed over "
             "XLA's compile threads; by kind: PTX modules (one kernel each, after XLA's "
             "deduplication, or constants only), their PTX, and ptxas -O3 on each one "
             "here, one at a time (the module's docstring names the kinds)"),
            "", *tables, "",
            f"<!-- benchmarks.compile_cost {key}: end -->"], key, "benchmarks.compile_cost")
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
