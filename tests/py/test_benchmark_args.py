"""The benchmarks' command lines refuse bad values in one line (argparse's exit 2)
instead of a traceback, a silently changed run or an empty results section."""

from __future__ import annotations

import pytest

from benchmarks import compile_cost, fp8_differential, llm, run


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
])
def test_a_bad_value_is_one_line(main, argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and "Traceback" not in error
