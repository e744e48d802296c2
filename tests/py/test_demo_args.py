"""The demo's command line (examples/vit_digits.py) refuses bad values in one line
(argparse's exit 2) before any training: they hung (a batch larger than the training
set), ended in a traceback after compiling, or failed every variant with exit 0."""

from __future__ import annotations

import pytest

from examples import vit_digits


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch", "5000"], "--batch 5000 is more than the 1437 training images"),  # hung
    (["--batch", "-3"], "argument --batch: -3 is below 1"),  # hung
    (["--batch", "0"], "argument --batch: 0 is below 1"),
    (["--steps", "0"], "argument --steps: 0 is below 1"),
    (["--log-every", "0"], "argument --log-every: 0 is below 1"),  # every variant failed
    (["--heads", "3"], "--heads 3 does not divide --dim 64"),
    (["--patch", "3"], "--patch 3 does not divide the image size 8"),
    (["--dim", "0"], "argument --dim: 0 is below 1"),
    (["--dropout", "1.5"], "--dropout 1.5 is not in [0, 1)"),
    (["--autopolicy", "-1"], "--autopolicy -1.0 is not a positive error budget"),
    (["--out", __file__], "exists and is not a directory"),  # after every training
    (["--out", __file__ + "/sub"], "exists and is not a directory"),  # after training
    (["--seed", str(2**32)], "--seed 4294967296 is not in [0, 2**32)"),  # sklearn's error
    (["--lr", "inf"], "--lr inf is not a positive finite number"),  # a NaN loss
])
def test_a_bad_value_is_one_line_before_training(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        vit_digits.parse_args(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and "Traceback" not in error


def test_the_training_set_has_the_size_the_batch_check_reads() -> None:
    x_train, x_test, _, _ = vit_digits.load_data(0)
    assert len(x_train) == vit_digits.TRAIN_IMAGES and len(x_test) == 1797 - 1437
    assert x_train.shape[1:3] == (vit_digits.IMAGE_SIZE, vit_digits.IMAGE_SIZE)


def test_a_failed_variant_makes_the_demo_exit_non_zero(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # It printed FAILED in the table and exited 0.
    def failing(name, args, data, order, measure=True):
        return vit_digits.Run(name, error="integer modulo by zero"), None

    monkeypatch.setattr(vit_digits, "train", failing)
    with pytest.raises(SystemExit, match=r"failed: f32 \(above\)"):
        vit_digits.main(["--variants", "f32", "--steps", "2", "--out", str(tmp_path)])
    assert "f32: FAILED: integer modulo by zero" in capsys.readouterr().out


def test_no_variant_named_is_refused() -> None:
    # It trained nothing and exited 0.
    with pytest.raises(SystemExit, match=r"--variants: none named; accepted: f32"):
        vit_digits.parse_variants(",")


@pytest.mark.parametrize(("options", "message"), [
    ({"batch": 2000}, "--batch 2000 is more than the 1437 training images"),  # looped
    ({"steps": 0}, "--steps 0 is below 1"),  # numpy's "need at least one array to stack"
])
def test_run_variant_checks_its_options_as_the_command_line(options, message) -> None:
    with pytest.raises(ValueError, match=f"^run_variant: {message}"):
        vit_digits.run_variant("f32", **options)


def test_step_times_leave_the_compiling_first_call_out_and_find_f32_anywhere() -> None:
    """An hlo_amp step compiles again on its first call: in a 2-step run it read 2.4 s a
    step, "0.04x" f32; with f32 listed second no ratio was given."""
    def run(name, seconds):
        return vit_digits.Run(name=name, step_seconds=seconds, losses=[1.0], accuracy=0.5)

    rows = vit_digits.table([run("bf16", [2.4, 0.05]), run("f32", [0.1, 0.1])])
    bf16 = next(line for line in rows.splitlines() if "hlo_amp bf16" in line)
    assert " 50.00 " in bf16 and " 2.00x " in bf16, rows


def test_a_one_step_run_gives_no_step_time_or_ratio() -> None:
    """A run of one step has only its compiling call: "step ms" read the compile and
    "vs f32" compared it with f32's step (0.02x)."""
    def run(name, seconds):
        return vit_digits.Run(name=name, step_seconds=seconds, losses=[1.0], accuracy=0.5)

    rows = vit_digits.table([run("f32", [0.05]), run("bf16", [2.4])]).splitlines()
    bf16 = next(line for line in rows if "hlo_amp bf16" in line)
    assert "2400" not in bf16 and "x " not in bf16, rows


def test_an_unwritable_out_is_refused_before_training(capsys) -> None:
    # It trained every variant, then mkdir raised an OSError with a traceback (/proc
    # takes no new file, as root too, as a read-only mount takes none).
    with pytest.raises(SystemExit) as exited:
        vit_digits.parse_args(["--out", "/proc/hlo_amp_demo/out"])
    assert exited.value.code == 2
    assert "--out /proc/hlo_amp_demo/out: /proc is not writable" in capsys.readouterr().err


def test_run_variant_writes_nothing_so_checks_no_out(tmp_path, monkeypatch) -> None:
    # A file named "out" in the working directory made run_variant exit through argparse.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").write_text("")
    args = vit_digits.parse_args([], check_out=False)
    assert args.out.name == "out"
    with pytest.raises(ValueError, match="^run_variant: --steps 0 is below 1"):
        vit_digits.run_variant("f32", steps=0)


def test_an_autopolicy_depth_beyond_the_step_is_one_line(monkeypatch) -> None:
    # hlo_amp.autopolicy's ValueError ended the demo in a 22-line traceback.
    def too_deep(args, data, order):
        raise ValueError("Unknown depth 5; accepted: an int from 1 to 4")

    monkeypatch.setattr(vit_digits, "choose_policy", too_deep)
    with pytest.raises(SystemExit, match=r"--autopolicy-depth 5: Unknown depth 5"):
        vit_digits.main(["--steps", "1", "--variants", "f32", "--autopolicy", "0.01",
                         "--autopolicy-depth", "5"])


@pytest.mark.parametrize("measure", [False, True])
def test_the_progress_line_times_steps_after_the_compiling_first(measure, capsys) -> None:
    """The progress line's ms/step took in the first call, which compiles: a run of one
    step printed its compile as a step time."""
    args = vit_digits.parse_args(["--steps", "2", "--log-every", "1", "--dim", "16",
                                  "--heads", "2", "--depth", "1", "--mlp-dim", "16",
                                  "--batch", "8"], check_out=False)
    data = vit_digits.load_data(args.seed)
    order = vit_digits.batches(len(data[0]), args.batch, args.steps, args.seed)
    run, _ = vit_digits.train("f32", args, data, order, measure=measure)
    assert not run.error, run.error
    lines = [line for line in capsys.readouterr().out.splitlines() if "] step" in line]
    assert len(lines) == 2, lines
    assert "first step (compiles)" in lines[0] and "ms/step" not in lines[0], lines
    assert "ms/step" in lines[1], lines
