"""Fused attention's numerics on this machine's GPU: every program of
tests/py/attention_programs.py (each way of writing attention, forward and train step,
under jax.checkpoint and lax.scan) run three ways on the same device:

- ``f32``: ``jax.jit`` of the program as written;
- ``unfused``: ``hlo_amp.compile(fn, "mixed_bfloat16,fuse_attention=false")``, XLA's
  attention in bf16 (the path before the fused-attention pass);
- ``fused``: ``hlo_amp.compile(fn, "mixed_bfloat16")``, cuDNN's fused attention.

A row passes when every site is fused and fused vs unfused is within bf16 rounding
(``max_relative_error`` < 2%, the CPU test's tolerance). Needs a GPU with cuDNN flash
attention (Ampere or later); on a CPU the pass leaves attention as written, so the run
says so and stops.

    python -m benchmarks.attention_numerics [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

import hlo_amp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))
import attention_programs as programs  # the tests' programs

from benchmarks.cli_args import check_out_file
from benchmarks.llm import write_section

TOLERANCE = 2e-2
POLICY = "mixed_bfloat16"


def measure(name: str, fn, args) -> dict:
    """One program: its three outputs and the fused step's attention report."""
    f32 = jax.jit(fn)(*args)
    unfused = hlo_amp.compile(fn, POLICY + ",fuse_attention=false")(*args)
    fused_fn = hlo_amp.compile(fn, POLICY)
    fused = fused_fn(*args)
    report = fused_fn.lower(*args).report()
    sites = report.attention
    return {"name": name, "sites": len(sites), "fused": sum(s.fused for s in sites),
            "reasons": sorted({s.reason for s in sites if not s.fused}),
            "fused_vs_unfused": programs.max_relative_error(unfused, fused),
            "fused_vs_f32": programs.max_relative_error(f32, fused),
            "unfused_vs_f32": programs.max_relative_error(f32, unfused)}


def measure_all(only: list[str] | None = None) -> list[dict]:
    """A row per program (``only``: these names), each printed as it is measured."""
    rows = []
    for name, build in sorted(programs.programs().items()):  # name -> builder
        if only and name not in only:
            continue
        try:
            rows.append(measure(name, *build()))
        except Exception as error:  # noqa: BLE001  one program's failure is a row, not the end of the run
            print(f"{name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            rows.append({"name": name, "sites": 0, "fused": 0,
                         "reasons": [f"error: {type(error).__name__}"],
                         "fused_vs_unfused": float("nan"), "fused_vs_f32": float("nan"),
                         "unfused_vs_f32": float("nan")})
        print(table(rows)[-1], flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    out = [("| program | sites fused | fused vs unfused bf16 | fused vs f32 | unfused vs f32 "
            "| within 2% |"), "|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["sites"] and r["fused"] == r["sites"] and r["fused_vs_unfused"] < TOLERANCE
        why = f" ({'; '.join(r['reasons'])})" if r["reasons"] else ""
        out.append(f"| {r['name']} | {r['fused']}/{r['sites']}{why} | "
                   f"{100 * r['fused_vs_unfused']:.2f}% | {100 * r['fused_vs_f32']:.2f}% | "
                   f"{100 * r['unfused_vs_f32']:.2f}% | {'yes' if ok else 'NO'} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="write the table into this file")
    parser.add_argument("--only", action="append", help="run these programs only")
    args = parser.parse_args(argv)
    if args.results is not None:  # found by the write after every program before
        check_out_file(parser, "--results", args.results)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    if device.platform != "gpu":
        print(f"no GPU here ({kind}): the pass fuses attention on a GPU target only")
        return 1
    rows = measure_all(args.only)
    lines = table(rows)
    passed = sum(line.endswith("| yes |") for line in lines)
    print(f"{passed} of {len(rows)} programs fused and within 2% of the unfused bf16 path "
          f"on {kind}")
    if args.results:
        marker = "benchmarks.attention_numerics on"
        section = [f"<!-- {marker} gpu: begin (replaced by each run) -->",
                   f"## Fused attention's numerics on one {kind}", "",
                   (f"- command: `python -m benchmarks.attention_numerics --results "
                   f"{args.results}`; jax {jax.__version__}; each program of "
                   "tests/py/attention_programs.py (batch 2, seq 16-32, head dim 8) run "
                   f"as f32 `jax.jit`, `{POLICY},fuse_attention=false` and `{POLICY}` "
                   "(cuDNN); max |a-b| / max|a| over every output leaf"), "",
                   *lines, "", f"{passed} of {len(rows)} within 2%.", "",
                   f"<!-- {marker} gpu: end -->"]
        write_section(args.results, section, "gpu", marker)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
