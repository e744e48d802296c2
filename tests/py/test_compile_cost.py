"""benchmarks/compile_cost.py: XLA's kernels for a GPU, read from its PTX dump and sorted
by kind, for benchmarks.llm's small decoder compiled for an H100 without the device."""

from __future__ import annotations

import pytest

from benchmarks.compile_cost import kind_of, measure, xla_timers
from hlo_amp.targets.hlo_text import parse_module


@pytest.fixture(scope="module")
def fp8() -> dict:
    return measure("hlo_amp fp8", ptxas=None, small=True)


def test_every_module_xla_compiled_is_counted_once(fp8: dict) -> None:
    compiled = fp8["timers"]["ptxas"][1]  # XLA's count of ptxas calls
    assert sum(row[0] for row in fp8["kinds"].values()) == compiled
    assert fp8["seconds"]["compile"] > 0


def test_an_fp8_step_has_each_kind_of_fp8_kernel(fp8: dict) -> None:
    for kind in ("transpose, fp8 result", "max reduction", "scalars", "fp8 result", "other"):
        count, ptx_bytes, ptxas_seconds = fp8["kinds"][kind]
        assert count > 0 and ptx_bytes > 0 and ptxas_seconds == 0  # no ptxas asked for


def _fused(text: str) -> list:
    """The instructions of a one-computation HLO text's entry."""
    computations, entry = parse_module("ENTRY " + text)
    return computations[entry]


def test_kinds_are_read_from_the_fused_computation() -> None:
    reducers = {"region_max"}
    quantise = ("%f (p: f32[], q: bf16[8,4]) -> f8e4m3fn[8,4] {\n"
                "  %d = f32[8,4]{1,0} divide(%c, %b)\n"
                "  ROOT %r = f8e4m3fn[8,4]{1,0} convert(%d)\n}")
    assert kind_of(_fused(quantise), reducers) == "fp8 result"
    assert kind_of(_fused(quantise.replace("convert(%d)", "transpose(%d), dimensions={1,0}")),
                   reducers) == "transpose, fp8 result"
    amax = ("%g (p: bf16[8,4]) -> bf16[8] {\n  ROOT %r = bf16[8]{0} reduce(%a, %z), "
            "dimensions={1}, to_apply=%region_max\n}")
    assert kind_of(_fused(amax), reducers) == "max reduction"
    assert kind_of(_fused(amax), {"region_add"}) == "other"
    scale = "%s (p: f32[]) -> (f32[], f32[]) {\n  ROOT %t = (f32[], f32[]) tuple(%a, %b)\n}"
    assert kind_of(_fused(scale), reducers) == "scalars"


def test_xla_timer_lines_give_the_last_cumulative_figure() -> None:
    log = ("gpu_compiler.cc:1] GpuCompiler::RunHloPasses for jit_f time: 500 ms (500027 us) "
           "(cumulative: 500 ms, max: 500 ms, #called: 1)\n"
           "nvptx_compiler.cc:2] NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_f "
           "time: 14 ms (14117 us) (cumulative: 2.5 s, max: 117 ms, #called: 130)\n"
           "nvptx_compiler.cc:2] NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_f "
           "time: 9 ms (9000 us) (cumulative: 3.09 s, max: 117 ms, #called: 131)\n")
    timers = xla_timers(log)
    assert timers["HLO passes"] == (0.5, 1)
    assert timers["ptxas"] == (3.09, 131)
    assert "backend" not in timers
