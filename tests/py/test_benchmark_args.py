"""The benchmarks' command lines refuse bad values in one line (argparse's exit 2)
instead of a traceback, a silently changed run or an empty results section."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import (
    attention_numerics,
    autopolicy_fragile,
    autopolicy_target,
    compile_cost,
    dispatch,
    fp8_differential,
    hand_cast_memory,
    llm,
    run,
    stress,
)

HERE = Path(__file__)  # an existing regular file
UNDER = HERE / "sub"  # a path under it
# Where a regression runs little and writes nothing: not the committed RESULTS.md.
NO_RUN = ["--stress-layers", "0", "--out", str(UNDER)]
NO_WRITE = ["--no-write", "--layers", "1"]


@pytest.mark.parametrize(("main", "argv", "message"), [
    # A traceback from device_target / abstract_state before.
    (llm.main, ["--device", "v100-aot", "--small"], "--device v100-aot: target='v100-aot'"),
    (llm.main, ["--device", "h100x8-aot", "--small", "--batch", "3"],
     "batch=3 does not split over a mesh axis of 4"),
    # --layers -2 a traceback; --batch 0 silently the preset's; --batch -1 a bogus row.
    (llm.main, ["--small", "--layers", "-2"], "argument --layers: -2 is below 1"),
    (llm.main, ["--small", "--batch", "0"], "argument --batch: 0 is below 1"),
    # It benchmarked the CPU as the GPU.
    (llm.main, ["--device", "gpu", "--small"], "--device gpu asked, but jax runs on cpu"),
    # An unknown workload was dropped: an H100 section with no workloads.
    (run.main, ["--device", "h100-aot", "--workloads", "mlp,bogus"],
     "--workloads: unknown 'bogus'; accepted: mlp, vit, cnn, decoder"),
    (run.main, ["--steps", "-3"], "argument --steps: -3 is below 1"),
    (compile_cost.main, ["--variant", "bogus"], "--variant: unknown 'bogus'; accepted: f32"),
    (compile_cost.main, ["--attention", "bogus"], "--attention: unknown 'bogus'"),
    # "0 same bits, 0 differ": a check that tested nothing passed.
    (fp8_differential.main, ["--cases", "-2"], "argument --cases: -2 is below 1"),
    (fp8_differential.main, ["--start", "-5"], "argument --start: -5 is below 0"),
    # No names: nothing ran, exit 0, and RESULTS.md was rewritten without its tables.
    (run.main, ["--workloads", ",", *NO_RUN], "argument --workloads: ',' names nothing"),
    (run.main, ["--device", "h100-aot", "--workloads", ",", *NO_RUN],
     "argument --workloads: ',' names nothing"),
    (run.main, ["--variants", " , ", "--workloads", "mlp", "--steps", "1", *NO_RUN],
     "argument --variants: ' , ' names nothing"),
    # FileExistsError from the last mkdir, after every measurement.
    (run.main, ["--out", str(HERE)], f"--out {HERE} exists and is not a directory"),
    (run.main, ["--device", "h100-aot", "--out", str(UNDER)],
     f"--out {UNDER}: {HERE} exists and is not a directory"),
    # A traceback after every variant compiled or ran.
    (llm.main, ["--small", "--results", str(UNDER / "x.md")],
     f"--results {UNDER / 'x.md'}: {HERE} exists and is not a directory"),
    (llm.main, ["--device", "cpu", "--small", "--results", str(HERE.parent)],
     f"--results {HERE.parent} is a directory, not a file"),
    # The same after every compile or program (a bad --variant, no GPU: a regression
    # stops there, before any compile).
    (compile_cost.main, ["--variant", "bogus", "--results", str(UNDER / "x.md")],
     f"--results {UNDER / 'x.md'}: {HERE} exists and is not a directory"),
    (attention_numerics.main, ["--results", str(HERE.parent)],
     f"--results {HERE.parent} is a directory, not a file"),
    # Tracebacks (heads, policy), a division by zero (1) and nonsense (0) before.
    (stress.main, [*NO_WRITE, "--heads", "3"], "--heads 3 does not divide --d 64"),
    (stress.main, [*NO_WRITE, "--policy", "bogus"], "--policy bogus: Unknown preset 'bogus'"),
    (stress.main, [*NO_WRITE, "--signatures", "1"], "argument --signatures: 1 is below 2"),
    (stress.main, ["--no-write", "--layers", "0"], "argument --layers: 0 is below 1"),
    # Rows 'failed: no median for empty data', exit 0; a late FileExistsError.
    (dispatch.main, ["--rounds", "0"], "argument --rounds: 0 is below 1"),
    (dispatch.main, ["--calls", "0"], "argument --calls: 0 is below 1"),
    (dispatch.main, ["--warmup", "-1"], "argument --warmup: -1 is below 0"),
    (dispatch.main, ["--out", str(UNDER / "d.md")],
     f"--out {UNDER / 'd.md'}: {HERE} exists and is not a directory"),
    # Read from sys.argv by position: a ValueError, or a target refused after a search.
    (autopolicy_fragile.main, ["h100", "many"], "argument n: 'many' is not an integer"),
    (autopolicy_fragile.main, ["h100,bogus", "64"], "targets: target='bogus' is neither"),
    (hand_cast_memory.main, ["h100,bogus"],
     "targets: unknown 'bogus'; accepted: h100, tpu-v5e, h100+triton"),
    # A KeyError; an unknown target found by autopolicy, after the first searches.
    (autopolicy_target.main, ["--workloads", "vit,bogus"],
     "--workloads: unknown 'bogus'; accepted: mlp, vit, cnn, decoder"),
    (autopolicy_target.main, ["--workloads", "mlp", "--targets", "h100,bogus"],
     "--targets: target='bogus' is neither"),
])
def test_a_bad_value_is_one_line(main, argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and "Traceback" not in error


@pytest.mark.parametrize("main", [autopolicy_fragile.main, hand_cast_memory.main])
def test_help_is_the_usage(main, capsys: pytest.CaptureFixture[str]) -> None:
    # A ValueError (int('--help')) and 'unknown target(s) --help' before.
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.")


def test_llm_device_help_names_the_local_devices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        llm.main(["--help"])
    # Its help text (not the usage line), up to the next option's.
    device_help = capsys.readouterr().out.split("\n  --device DEVICE", 1)[1].split("\n  --")[0]
    assert "gpu" in device_help and "cpu" in device_help


def test_llm_records_the_command_shell_quoted() -> None:
    # " ".join wrote --variant hlo_amp bf16: two words where a shell reads three.
    assert llm.recorded_command(["--variant", "hlo_amp bf16", "--small"]) == (
        "python -m benchmarks.llm --variant 'hlo_amp bf16' --small")


def test_a_cpu_run_keeps_other_scripts_sections(tmp_path: Path, monkeypatch) -> None:
    # A RESULTS.md another script's --results wrote has no hand-written line: a CPU run
    # kept nothing of it, so benchmarks.llm's section was lost. Nothing is measured here.
    monkeypatch.setattr(run, "bench_workload", lambda *_, **__: [
        run.Result("f32", times=[0.01], compile_s=1.0)])
    monkeypatch.setattr(run, "machine", lambda device: "a test machine")
    monkeypatch.setattr(run, "chart", lambda *_: None)
    llm_section = ("<!-- benchmarks.llm --device h100x8: begin (replaced by each run) -->\n"
                   "llm rows\n<!-- benchmarks.llm --device h100x8: end -->")
    stress_section = "<!-- stress:begin -->\nstress rows\n<!-- stress:end -->"
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# an older CPU part\n\n{llm_section}\n\n{stress_section}\n")
    argv = ["--workloads", "mlp", "--variants", "f32", "--stress-layers", "0",
            "--out", str(tmp_path)]
    run.main(argv)
    run.main(argv)  # the second run finds the hand-written line the first one wrote
    text = results.read_text()
    assert text.count(llm_section) == 1 and text.count(stress_section) == 1
    assert text.count(run.HAND_WRITTEN) == 1 and "an older CPU part" not in text
    assert text.index("## mlp") < text.index(run.HAND_WRITTEN) < text.index(llm_section)


def test_attention_numerics_builds_each_program_it_measures() -> None:
    """attention_programs.programs() gives builders (since e2a6db3); the benchmark's loop
    unpacked them as (function, arguments) and stopped with a TypeError before its first
    row, on the GPU it runs on. On CPU the site is found and left unfused (cuDNN's is a
    GPU kernel), and the numbers are measured: f32 against the bf16 path, within bf16's
    rounding."""
    (row,) = attention_numerics.measure_all(["dpa_forward"])
    assert row["name"] == "dpa_forward" and row["sites"] == 1, row
    assert not any(reason.startswith("error") for reason in row["reasons"]), row
    assert 0 < row["unfused_vs_f32"] < attention_numerics.TOLERANCE, row
