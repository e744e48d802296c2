"""benchmarks/kernel_trace.py: a profile's GPU kernels counted per step and grouped by
family (from the GPU planes' stream lines only), the table built from them, and
``benchmarks.run --trace`` on CPU writing one trace per variant."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from benchmarks import run
from benchmarks.kernel_trace import family_of, kernel_times, trace_table


def _plane(name: str, lines: dict[str, list[tuple[str, float]]]) -> SimpleNamespace:
    return SimpleNamespace(name=name, lines=[
        SimpleNamespace(name=line, events=[SimpleNamespace(name=n, duration_ns=d)
                                           for n, d in events])
        for line, events in lines.items()])


def _profile() -> list[SimpleNamespace]:
    kernels = [("input_reduce_fusion_12", 2e6), ("input_reduce_fusion", 1e6),
               ("loop_add_fusion.3", 5e5), ("sm90_xmma_gemm_e4m3", 9e6)]
    return [
        _plane("/host:CPU", {"python": [("input_reduce_fusion_1", 1e9)]}),
        _plane("/device:GPU:0", {
            "Stream #13(Compute)": kernels,
            "XLA Ops": [("input_reduce_fusion_12", 2e6)],  # the same time again
        }),
    ]


def test_kernels_are_read_from_the_gpu_streams_and_grouped_by_family() -> None:
    times = kernel_times(_profile(), steps=2)
    assert times.launches == 4
    assert times.busy_ns == 12.5e6
    assert times.families["input_reduce_fusion"] == [2, 3e6]
    assert times.families["loop_add_fusion"] == [1, 5e5]
    assert family_of("fused_transpose.4_1") == "fused_transpose"
    assert family_of("sm90_xmma_gemm_e4m3") == "sm90_xmma_gemm_e4m3"


def test_a_plane_without_stream_lines_is_read_from_its_other_kernel_lines() -> None:
    planes = [_plane("/device:GPU:0", {"GPU kernels": [("loop_add_fusion_1", 4e5)],
                                       "XLA Ops": [("loop_add_fusion_1", 4e5)],
                                       "Steps": [("0", 4e5)]})]
    times = kernel_times(planes, steps=1)
    assert times.launches == 1 and times.busy_ns == 4e5


def test_the_table_gives_per_step_figures_and_the_time_between_kernels() -> None:
    times = kernel_times(_profile(), steps=2)
    _header, _rule, row, empty = trace_table(
        [("hlo_amp fp8", 0.010, times), ("f32", 0.020, kernel_times([], steps=2))], top=2)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:5] == ["hlo_amp fp8", "10.00", "2", "6.25", "3.75"]
    # The two largest families by time, per step: 4.5 ms of GEMM, then 1.5 of reductions.
    assert cells[5] == "sm90_xmma_gemm_e4m3 4.50 (0.5); input_reduce_fusion 1.50 (1)"
    assert "no GPU kernels" in empty


def test_run_traces_each_variant_into_its_own_directory(tmp_path) -> None:
    from benchmarks.workloads import workloads

    (mlp,) = [w for w in workloads(True) if w.name == "mlp"]
    (result,) = run.bench_workload(mlp, steps=1, warmup=0, wanted="f32", trace=tmp_path)
    assert list((tmp_path / "mlp" / "f32").glob("**/*.xplane.pb"))
    assert result.kernels is not None and result.kernels.steps == run.TRACED_STEPS
    # Kernels only where the step ran on a GPU (a CPU trace has no GPU plane).
    assert (result.kernels.launches > 0) == (jax.devices()[0].platform == "gpu")


def test_trace_needs_a_device_that_runs_steps(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--trace runs steps"):
        run.main(["--device", "h100-aot", "--trace", str(tmp_path)])
