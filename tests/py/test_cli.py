"""hlo-amp-opt as a user runs it: a subprocess, its exit status, stdout, stderr and files."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlo_amp import cli
from hlo_amp.targets import device_target

MODULE = """\
func.func @main(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/head/dot_general")
  return %0 : tensor<2x4xf32>
}
"""
CONVERTED = "(tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>"


def _portable_artifact() -> bytes:
    """A jax.export artifact of a small dot (StableHLO portable bytecode)."""
    exported = jax.export.export(jax.jit(lambda x, w: x @ w))(jnp.ones((2, 4)),
                                                             jnp.ones((4, 4)))
    return exported.mlir_module_serialized


def _callback_module() -> str:
    """A lowering with a host callback (jax.pure_callback), whose handle belongs to this
    process."""
    def fn(x, w):
        h = jax.pure_callback(lambda a: np.asarray(a) * 2,
                              jax.ShapeDtypeStruct((2, 4), jnp.float32), x @ w)
        return h @ w

    return jax.jit(fn).lower(jnp.ones((2, 4)), jnp.ones((4, 4))).as_text(debug_info=True)


def _corrupted_bytecode() -> bytes:
    """MODULE's bytecode with one byte of the stablehlo dialect's name changed (not
    UTF-8): reading it aborted the process (SIGABRT) inside jaxlib's bindings."""
    from hlo_amp.ir.modules import parse_module

    buffer = io.BytesIO()
    parse_module(MODULE).operation.write_bytecode(buffer)
    good = buffer.getvalue()
    assert b"stablehlo\x00" in good
    return good.replace(b"stablehlo\x00", b"st\xaablehlo\x00")


def _deep_nesting_modules(depth: int) -> dict[str, str]:
    """Modules with an attribute of ``depth`` nested arrays, an argument of that many
    nested tuple types, a result type in that many parentheses: MLIR's parser overflowed
    its stack on each (a segfault) past a few thousand."""
    private = "func.func private @g(%x: {arg}) -> {result} {{\n  return %x : tensor<f32>\n}}"
    return {
        "arrays": MODULE.replace("func.func @main", "module attributes {foo.x = "
                                 + "[" * depth + "1" + "]" * depth + "} {\nfunc.func @main")
        + "}\n",
        "tuples": MODULE + private.format(arg="tuple<" * depth + "tensor<f32>" + ">" * depth,
                                          result="tensor<f32>"),
        "parentheses": MODULE + private.format(arg="tensor<f32>", result="(" * depth
                                               + "tensor<f32>" + ")" * depth),
    }


def _nested(depth: int) -> str:
    """A valid module of ``depth`` nested stablehlo.case regions (MLIR's parser
    overflowed its stack past about 2400: a segfault)."""
    lines = ["func.func @main(%i: tensor<i32>, %a: tensor<2x2xf32>) -> tensor<2x2xf32> {"]
    lines += [f'%r{k} = "stablehlo.case"(%i) ({{' for k in range(depth)]
    lines += ["stablehlo.return %a : tensor<2x2xf32>"]
    for k in reversed(range(depth)):
        lines.append("}) : (tensor<i32>) -> tensor<2x2xf32>")
        if k:
            lines.append(f"stablehlo.return %r{k} : tensor<2x2xf32>")
    return "\n".join([*lines, "return %r0 : tensor<2x2xf32>", "}", ""])


def hlo_amp_opt(*args: str | Path, stdin: str | None = None
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hlo_amp.cli", *map(str, args)],
        input=stdin, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.fixture
def module_file(tmp_path: Path) -> Path:
    path = tmp_path / "in.mlir"
    path.write_text(MODULE)
    return path


def _write(tmp_path: Path, name: str, data: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


# ---- errors: status 1, one line on stderr, no traceback, no output file ---------------


# Run as a subprocess: the process's own exit status and stderr.
ERRORS = {
    # XLA aborted the process (a failed CHECK, no message) compiling for the target.
    "zero_partitions": (
        lambda d: [_write(d, "np0.mlir", "module attributes {mhlo.num_partitions = 0 : i32} {\n"
                          + MODULE + "}\n"), "--xla-target", "h100"],
        r"mhlo\.num_partitions is 0; accepted: a positive integer"),
    "zero_replicas_autopolicy": (
        lambda d: [_write(d, "nr0.mlir", "module attributes {mhlo.num_replicas = 0 : i32} {\n"
                          + MODULE + "}\n"), "--autopolicy", "--budget", "1e-2",
                   "--xla-target", "h100"],
        r"mhlo\.num_replicas is 0; accepted: a positive integer"),
    # XLA died of a SIGFPE (exit 136, no message) compiling with a config without it.
    "config_without_threads_per_warp": (
        lambda d: [d / "in.mlir", "--xla-target", _write(
            d, "my_gpu.txtpb", re.sub(r"\n\s*threads_per_warp: \d+", "",
                                      device_target("h100").target_config))],
        r"my_gpu\.txtpb' gives no positive threads_per_warp in its gpu_device_info"),
    # A recursive call graph was an "internal error" (RecursionError) in a pass.
    "recursion": (
        lambda d: [_write(d, "rec.mlir", MODULE.replace(
            "  return %0", "  %1 = func.call @main(%0, %w) : (tensor<2x4xf32>, tensor<4x4xf32>)"
            " -> tensor<2x4xf32>\n  return %1"))],
        r"@main calls itself \(@main -> @main\); accepted: a module without recursive"),
    "missing_file": (lambda d: [d / "nope.mlir"], r"cannot read '.*nope\.mlir': No such file"),
    "directory": (lambda d: [d], r"cannot read '.*': Is a directory"),
    "not_mlir": (lambda d: [_write(d, "bad.mlir", "func.func @f() {\n  %0 = foo bar\n}\n")],
                 r"bad\.mlir:2:8: error: custom op 'foo' is unknown"),
    "unknown_dialect": (
        lambda d: [_write(d, "unk.mlir",
                          'func.func @f() {\n  "mydialect.op"() : () -> ()\n  return\n}\n')],
        r"unk\.mlir:2:\d+: error: .*unregistered dialect"),
    "binary_garbage": (lambda d: [_write(d, "junk.bin", b"\x00\xff\xfe\x01\x80" * 40)],
                       r"junk\.bin: error: not MLIR text or bytecode"),
    "empty_file": (lambda d: [_write(d, "empty.mlir", "")], r"empty\.mlir: error: .*empty"),
    "bad_policy": (lambda d: [d / "in.mlir", "--policy", "bf16,op:conv=keep"],
                   r"bad policy: Unknown op kind 'conv'; accepted: dot_general"),
    "bad_scope_syntax": (lambda d: [d / "in.mlir", "--scope", "head"],
                         r"--scope 'head' is not PATTERN=ACTION"),
    "unknown_pass": (lambda d: [d / "in.mlir", "--pass", "hlo-amp-fold"],
                     (r"unknown pass 'hlo-amp-fold'; accepted: hlo-amp-fused-attention, "
                      r"hlo-amp-insert-converts")),
    # A byte that is not UTF-8 in a location name: jaxlib's bindings aborted the process
    # (SIGABRT, status 134) when a pass read the name.
    "location_not_utf8": (
        lambda d: [_write(d, "loc.mlir", MODULE.replace("head/dot", "he\\FFad/dot"))],
        r'loc\.mlir: error: a location name or file is not UTF-8 \("jit\(f\)/he\\FFad'),
    # A portable artifact cut short: one line (jaxlib printed two more, and the message
    # was wrapped twice).
    # --autopolicy runs the module: its host callback's handle crashed the process
    # (SIGSEGV, status 139).
    "autopolicy_host_callback": (
        lambda d: [_write(d, "cb.mlir", _callback_module()), "--autopolicy", "--budget",
                   "1e-2", "--xla-target", "h100"],
        (r"--autopolicy: the module calls back into the Python process that lowered it "
         r"\(custom_call @\w*python\w*callback")),
    "corrupted_bytecode": (lambda d: [_write(d, "bad.mlirbc", _corrupted_bytecode())],
                           (r"bad\.mlirbc: error: unreadable MLIR bytecode \(reading it ended "
                            r"a process with SIGABRT: a corrupted file\)")),
    # Refused before MLIR's parser or a pass reads them (each ended the process).
    "nested_too_deep": (lambda d: [_write(d, "deep.mlir", _nested(2500))],
                        (r"deep\.mlir: error: regions, attributes or types nested \d+ deep "
                         r"\(\{, \[, \( or <\); accepted: at most 1000")),
    # So are arrays, types and function types nested 10,000 deep (SIGSEGV, status 139).
    **{f"nested_too_deep_{name}": (
        lambda d, text=text: [_write(d, "deep.mlir", text)],
        r"deep\.mlir: error: regions, attributes or types nested 100\d\d deep")
       for name, text in _deep_nesting_modules(10000).items()},
    # Read from an attribute dictionary, a dense attribute of complex elements aborted
    # the process (reduce=, a backward program's hint, a partitioned scatter's copy).
    "complex_argument_attribute": (
        lambda d: [_write(d, "cx.mlir", MODULE.replace(
            "%x: tensor<2x4xf32>",
            "%x: tensor<2x4xf32> {mhlo.cx = dense<(1.0,2.0)> : tensor<2xcomplex<f32>>}"))],
        r"attribute mhlo\.cx of @main's argument 0 cannot be read by jaxlib's bindings"),
    "complex_argument_attribute_reduce": (
        lambda d: [_write(d, "cx.mlir", MODULE.replace(
            "%x: tensor<2x4xf32>",
            "%x: tensor<2x4xf32> {mhlo.cx = dense<(1.0,2.0)> : tensor<2xcomplex<f32>>}")),
            "--policy", "bf16,reduce=bf16"],
        r"attribute mhlo\.cx of @main's argument 0 cannot be read by jaxlib's bindings"),
    "truncated_portable": (
        lambda d: [_write(d, "cut.bin", _portable_artifact()[:-40])],
        r"cut\.bin: error: unreadable StableHLO portable artifact \([^(]*\)$"),
}
# The same contract through hlo_amp.cli.main in-process (no jax import per case).
MORE_ERRORS = {
    "verifier": (
        lambda d: [_write(d, "ver.mlir", "func.func @f(%a: tensor<2xf32>) -> tensor<3xf32> {\n"
                          "  return %a : tensor<2xf32>\n}\n")],
        r"ver\.mlir:2:3: error: type of return operand 0"),
    "no_public_function": (
        lambda d: [_write(d, "priv.mlir", "func.func private @f() {\n  return\n}\n")],
        r"priv\.mlir: error: the module has no public func\.func"),
    "bad_policy_preset": (lambda d: [d / "in.mlir", "--policy", "bogus"], r"'bogus'"),
    "bad_propagation_op": (
        lambda d: [d / "in.mlir", "--policy", "mixed_bfloat16", "--op", "exponentail=compute"],
        r"bad policy: Unknown op kind 'exponentail'; accepted: dot_general.*exponential"),
    "bad_scope_action": (lambda d: [d / "in.mlir", "--scope", "head=fast"],
                         r"Unknown action 'fast' for scope rule 'head'"),
    # --xla-target sets the platform; a --target naming another one was ignored.
    "target_and_xla_target_disagree": (
        lambda d: [d / "in.mlir", "--target", "gpu", "--xla-target", "tpu-v5e"],
        r"--target gpu and --xla-target tpu-v5e name different platforms"),
    # A cycle through composites' decompositions recursed in insert_converts (an
    # internal error, RecursionError), where one through calls was refused.
    "recursion_through_composites": (
        lambda d: [_write(d, "rec.mlir", MODULE.replace(
            "  return %0", "  %1 = stablehlo.composite \"my.f\" %0, %w {decomposition = @main}"
            " : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>\n  return %1"))],
        r"@main calls itself \(@main -> @main\); accepted: a module without recursive"),
    # XLA's own refusal of the input was put on the rewrite ("the rewritten module").
    "xla_refuses_the_input": (
        lambda d: [_write(d, "dyn.mlir", MODULE.replace("tensor<2x4xf32>", "tensor<?x4xf32>")),
                   "--xla-target", "h100"],
        (r"XLA could not compile the module as given \(before any rewrite\) for NVIDIA "
         r"H100.*Unbounded dynamism")),
    # A search option without the search was silently ignored.
    "budget_without_autopolicy": (lambda d: [d / "in.mlir", "--budget", "1e-2"],
                                  r"--budget applies to --autopolicy, which was not given"),
    "bad_op_syntax": (lambda d: [d / "in.mlir", "--op", "dot_general"],
                      r"--op 'dot_general' is not KIND=ACTION"),
    "unknown_flag": (lambda d: [d / "in.mlir", "--fast"], r"unrecognized arguments: --fast"),
    # A comma in a flag's value added other policy items unseen (propagate=true).
    "scope_with_comma": (lambda d: [d / "in.mlir", "--scope", "head=float32,propagate=true"],
                         r"--scope 'head=float32,propagate=true' holds ','; one rule per"),
    "op_with_comma": (lambda d: [d / "in.mlir", "--op", "dot_general=keep,f64=true"],
                      r"--op 'dot_general=keep,f64=true' holds ','"),
    # One file for both: the report replaced the module (exit 0), or the input.
    "report_is_the_output": (lambda d: [d / "in.mlir", "--report", d / "out" / "result.mlir"],
                             r"--report '.*result\.mlir' is the same file as -o"),
    "report_is_the_input": (lambda d: [d / "in.mlir", "--report", d / "in.mlir"],
                            r"--report '.*in\.mlir' is the same file as the input"),
    "declaration_without_body": (
        lambda d: [_write(d, "decl.mlir", MODULE + "func.func private @ext(tensor<2xf32>)\n")],
        r"@ext is declared without a body"),
    "symbol_not_utf8": (lambda d: [_write(d, "sym.mlir", MODULE.replace("@main", '@"ma\\FFin"'))],
                        r'a symbol name .* is not UTF-8 \("ma\\FFin"\)'),
    "partitions_not_an_integer": (
        lambda d: [_write(d, "np.mlir", 'module attributes {mhlo.num_partitions = "8"} {\n'
                          + MODULE + "}\n")],
        r'mhlo\.num_partitions is not an integer \("8"\)'),
    # hlo_amp's own marks in a module from outside: a malformed one made an internal error.
    "malformed_fp8_mark": (
        lambda d: [_write(d, "mark.mlir", MODULE.replace(
            "contracting_dims = [1] x [0] :", "contracting_dims = [1] x [0] {hlo_amp.fp8 = 1 : i64} :")),
            "--policy", "fp8", "--pass", "hlo-amp-fp8"],
        r"hlo_amp\.fp8 = 1 : i64 on a dot_general: expected \[lhs fp8 type"),
    "malformed_forward_ends": (
        lambda d: [_write(d, "ends.mlir", "module attributes {hlo_amp.forward_ends = 5 : i64} {\n"
                          + MODULE + "}\n"), "--policy", "fp8"],
        r"the module's hlo_amp\.forward_ends = 5 : i64: expected a list"),
    "empty_report_path": (lambda d: [d / "in.mlir", "--report", ""],
                          r"--report '' names no file \(- for stderr\)"),
    # Options of the other mode were silently ignored.
    "seed_without_autopolicy": (lambda d: [d / "in.mlir", "--seed", "0"],
                                r"--seed applies to --autopolicy, which was not given"),
    "pass_with_autopolicy": (
        lambda d: [d / "in.mlir", "--autopolicy", "--budget", "1e-2", "--xla-target", "h100",
                   "--split-input-file"],
        r"--split-input-file applies to rewriting; --autopolicy writes a policy"),
    "split_error_line": (
        lambda d: [_write(d, "split.mlir", MODULE + "// -----\nfunc.func @g() {\n  %0 = foo\n}\n"),
                   "--split-input-file"],
        r"split\.mlir:7:8: error: custom op 'foo'"),
    # A chunk that is not UTF-8 is refused as the whole file is (its byte became U+FFFD
    # in the output, exit 0).
    "split_not_utf8": (
        lambda d: [_write(d, "split.mlir", (MODULE + "// -----\n").encode()
                          + MODULE.replace("head", "caf\xe9").encode("latin-1")),
                   "--split-input-file"],
        r"split\.mlir: error: not MLIR text or bytecode"),
}


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Every subprocess error case, a few at a time (each run mostly imports jax)."""
    # Made before the threads start: concurrent first calls to mktemp race on creating
    # pytest's base temp directory.
    directories = {case: tmp_path_factory.mktemp(case) for case in ERRORS}

    def run(case: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        directory = directories[case]
        (directory / "in.mlir").write_text(MODULE)
        out = directory / "out" / "result.mlir"
        out.parent.mkdir()
        return hlo_amp_opt(*ERRORS[case][0](directory), "-o", out), out.parent

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(ERRORS, pool.map(run, ERRORS), strict=True))


def _check_error(code: int, stdout: str, stderr: str, pattern: str, out_dir: Path) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("hlo-amp-opt: ")
    assert re.search(pattern, lines[0]), lines[0]
    assert stdout == ""
    assert list(out_dir.iterdir()) == []  # no output, no leftover temporary file


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_one_line_and_status_1(
        case: str, error_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path]]
) -> None:
    result, out_dir = error_runs[case]
    _check_error(result.returncode, result.stdout, result.stderr, ERRORS[case][1], out_dir)


@pytest.mark.parametrize("case", sorted(MORE_ERRORS))
def test_more_errors_in_process(case: str, module_file: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    make_args, pattern = MORE_ERRORS[case]
    out = tmp_path / "out" / "result.mlir"
    out.parent.mkdir()
    code = cli.main([str(a) for a in make_args(tmp_path)] + ["-o", str(out)])
    captured = capsys.readouterr()
    _check_error(code, captured.out, captured.err, pattern, out.parent)


@pytest.mark.parametrize("report", [[], ["--report", "-"]])
def test_unwritable_output_is_an_error(module_file: Path, tmp_path: Path, report: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """One line, and no report on stderr either (``--report -`` wrote it all before the
    output failed)."""
    target = tmp_path / "missing_dir" / "out.mlir"
    assert cli.main([str(module_file), "-o", str(target), *report]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"hlo-amp-opt: error: cannot write '{target}': No such file or directory"]



def test_an_unwritable_report_leaves_no_output(module_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Both files or neither: the output was written before the report failed."""
    report = tmp_path / "missing_dir" / "report.json"
    assert cli.main([str(module_file), "-o", str(tmp_path / "out.mlir"),
                     "--report", str(report)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"hlo-amp-opt: error: cannot write '{report}': No such file or directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [module_file.name]


def test_output_files_take_the_umask_keep_a_mode_and_follow_a_link(
        module_file: Path, tmp_path: Path) -> None:
    """As a shell's ``>``: a new file gets 0666 less the umask (it got mkstemp's 0600),
    an existing file keeps its mode, a symbolic link is written through (it was
    replaced by a file)."""
    previous = os.umask(0o022)
    try:
        assert cli.main([str(module_file), "-o", str(tmp_path / "new.mlir")]) == 0
        kept = tmp_path / "kept.mlir"
        kept.write_text("")
        kept.chmod(0o664)
        link = tmp_path / "link.mlir"
        link.symlink_to(kept.name)
        assert cli.main([str(module_file), "-o", str(link)]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.mlir").stat().st_mode) == 0o644
    assert link.is_symlink() and CONVERTED in kept.read_text()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o664



def test_a_report_to_a_failing_device_leaves_no_output(module_file: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Both or neither with a device too: the output replaced its target before the
    report's device write failed."""
    if not os.path.exists("/dev/full"):
        pytest.fail("this test needs Linux's /dev/full")
    out = tmp_path / "out.mlir"
    assert cli.main([str(module_file), "-o", str(out), "--report", "/dev/full"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "hlo-amp-opt: error: cannot write '/dev/full': No space left on device"]
    assert not out.exists()


def test_a_link_to_a_pipe_and_a_closed_stdout(module_file: Path, tmp_path: Path) -> None:
    """-o /dev/stdout on a pipe is written to (it was refused: 'No such file or
    directory'); with stdout closed the error says so (it was an internal error)."""
    piped = hlo_amp_opt(module_file, "-o", "/dev/stdout")
    assert piped.returncode == 0 and CONVERTED in piped.stdout, piped.stderr
    closed = subprocess.run(f"{shlex.quote(sys.executable)} -m hlo_amp.cli "
                            f"{shlex.quote(str(module_file))} >&-", shell=True, text=True,
                            stderr=subprocess.PIPE, timeout=120, check=False)
    assert closed.returncode == 1
    assert closed.stderr.strip().splitlines() == [
        "hlo-amp-opt: error: cannot write the output: stdout is closed; give -o FILE"]


def test_an_in_process_caller_without_stderr_gets_it_back(module_file: Path,
                                                         tmp_path: Path,
                                                         monkeypatch) -> None:
    """cli.main with sys.stderr None in-process, fd 2 open: messages are dropped for that
    run alone; sys.stderr and fd 2 are the caller's after it, and a later --report -
    writes (the first fix pointed fd 2 at /dev/null for good and refused it)."""
    fd2 = os.readlink("/proc/self/fd/2") if Path("/proc/self/fd/2").exists() else None
    monkeypatch.setattr(sys, "stderr", None)
    assert cli.main([str(module_file), "-o", str(tmp_path / "a.mlir"), "--report", "-"]) == 1
    assert sys.stderr is None
    monkeypatch.undo()
    assert fd2 is None or os.readlink("/proc/self/fd/2") == fd2
    assert cli.main([str(module_file), "-o", str(tmp_path / "b.mlir"), "--report", "-"]) == 0


def test_comments_are_no_nesting(tmp_path: Path) -> None:
    """A lit file's CHECK lines hold cut-off signatures whose brackets close nothing:
    1,100 of them were refused as nested 1,103 deep."""
    checks = "// CHECK: func.func @main(%x: tensor<2x4xbf16>\n" * 1100
    module = _write(tmp_path, "lit.mlir", checks + MODULE)
    assert cli.main([str(module), "-o", str(tmp_path / "out.mlir")]) == 0
    assert CONVERTED in (tmp_path / "out.mlir").read_text()


def test_a_closed_stderr_leaves_the_output_as_it_is(module_file: Path) -> None:
    """With stderr closed (2>&-) Python's print(..., file=sys.stderr) wrote to stdout: a
    warning went into the module written there, which no longer parsed; --report - was
    an internal error. Messages are dropped; the report asks for a file."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        words = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "hlo_amp.cli",
                                                  str(module_file), *args))
        return subprocess.run(f"{words} 2>&-", shell=True, text=True,
                              stdout=subprocess.PIPE, timeout=120, check=False)

    warned = run("--scope", "nowhere=float32")  # a rule that matches no op: a warning
    assert warned.returncode == 0 and "warning" not in warned.stdout
    assert warned.stdout.rstrip().endswith("}") and CONVERTED in warned.stdout
    for refused in (run("--report", "-"), run("--policy", "bogus")):
        assert (refused.returncode, refused.stdout) == (1, "")


# ---- success -------------------------------------------------------------------------


def test_output_file(module_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.mlir"
    result = hlo_amp_opt(module_file, "-o", out)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    text = out.read_text()
    assert CONVERTED in text
    assert "loc(" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.mlir", "out.mlir"]


def test_stdin_to_stdout_with_scope_and_debug_info() -> None:
    result = hlo_amp_opt("-", "--scope", "head=keep", "--debug-info", stdin=MODULE)
    assert (result.returncode, result.stderr) == (0, "")
    assert "xbf16" not in result.stdout
    assert 'loc("jit(f)/head/dot_general")' in result.stdout


def test_a_rule_that_matches_nothing_is_warned_about(module_file: Path, tmp_path: Path
                                                      ) -> None:
    """A typo in a scope rule: hlo_amp.compile warns; the CLI said nothing (exit 0, only
    the --report JSON listed it)."""
    out = tmp_path / "out.mlir"
    result = hlo_amp_opt(module_file, "--scope", "haed=float32", "-o", out)
    assert result.returncode == 0
    assert result.stderr == "hlo-amp-opt: warning: policy rule(s) matched no op: scope:haed\n"
    assert CONVERTED in out.read_text()  # the other rules still apply


def test_report_file(module_file: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = hlo_amp_opt(module_file, "--scope", "nowhere=keep", "--report", report,
                         "-o", tmp_path / "out.mlir")
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["policy"] == "bf16,compute=bfloat16,scope:nowhere=keep"
    assert data["summary"].startswith("converted 1/1 ops; low precision: 1/1 dot_general;")
    [decision] = data["decisions"]
    assert (decision["scope"], decision["rule"], decision["changed"]) == (
        "head", "op:dot_general", True)
    assert data["unused_rules"] == ["scope:nowhere"]


def test_split_input_file(tmp_path: Path) -> None:
    second = MODULE.replace("@main", "@second").replace("head/", "")
    path = _write(tmp_path, "two.mlir", MODULE + "\n// -----\n" + second)
    result = hlo_amp_opt(path, "--split-input-file", "--scope", "head=keep", "--report", "-")
    assert result.returncode == 0, result.stderr
    chunks = result.stdout.split("// -----\n")
    assert len(chunks) == 2
    assert "@main" in chunks[0] and "xbf16" not in chunks[0]
    assert "@second" in chunks[1] and CONVERTED in chunks[1]
    report = json.loads(result.stderr)  # --report - writes the JSON to stderr
    assert [d["function"] for d in report["decisions"]] == ["main", "second"]


def test_split_input_file_reports_the_propagation_of_every_chunk(tmp_path: Path) -> None:
    """The mixed modes' activation figures cover every chunk, whatever their order: each
    chunk's replaced the ones before (0% with a chunk without dots last, 50% first)."""
    two_dots = (
        "func.func public @main(%w: tensor<16x16xf32>, %x: tensor<8x16xf32>) -> "
        "tensor<8x16xf32> {\n"
        "  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : "
        "(tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>\n"
        "  %1 = stablehlo.tanh %0 : tensor<8x16xf32>\n"
        "  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [0] : "
        "(tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>\n"
        "  return %2 : tensor<8x16xf32>\n}\n")
    dots = _write(tmp_path, "dots.mlir", two_dots)
    plain = ("func.func public @plain(%x: tensor<8x16xf32>) -> tensor<8x16xf32> {\n"
             "  %0 = stablehlo.tanh %x : tensor<8x16xf32>\n"
             "  return %0 : tensor<8x16xf32>\n}\n")
    summaries = []
    for first, second in ((two_dots, plain), (plain, two_dots)):
        path = _write(tmp_path, "two.mlir", first + "// -----\n" + second)
        result = hlo_amp_opt(path, "--split-input-file", "--policy", "mixed_bfloat16",
                             "--report", "-", "-o", tmp_path / "out.mlir")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stderr)
        assert {row["function"] for row in report["propagation"]["functions"]} >= {
            "main", "plain"}
        summaries.append(report["summary"])
    alone = json.loads(hlo_amp_opt(dots, "--policy", "mixed_bfloat16", "--report", "-", "-o",
                                   tmp_path / "out.mlir").stderr)["summary"]
    assert summaries[0] == summaries[1] != alone, summaries


def test_split_input_file_rows_name_their_file_and_line(tmp_path: Path) -> None:
    """An op without a location of its own was reported at ``-:2`` (the bindings' name
    for a parsed buffer): the chunks' rows could not be told apart, nor the file."""
    plain = re.sub(r' loc\("[^"]*"\)', "", MODULE)
    path = _write(tmp_path, "two.mlir", plain + "// -----\n" + plain)
    second_dot = plain.count("\n") + 1 + 2  # the marker's line, then the dot's
    for args, name in (([path], str(path)), (["-"], "<stdin>")):
        result = hlo_amp_opt(*args, "--split-input-file", "--report", "-",
                             stdin=path.read_text() if args == ["-"] else None)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stderr)
        assert [d["source"] for d in report["decisions"]] == [f"{name}:2",
                                                              f"{name}:{second_dot}"]


def test_a_marker_at_the_end_splits_off_nothing(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """As mlir-opt takes it: a trailing ``// -----`` was an "input is empty" error."""
    path = _write(tmp_path, "trailing.mlir", MODULE + "// -----\n\n// -----\n")
    assert cli.main([str(path), "--split-input-file"]) == 0
    out = capsys.readouterr().out
    assert CONVERTED in out and "// -----" not in out


def test_without_split_the_marker_is_a_comment(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    second = MODULE.replace("@main", "@second")
    path = _write(tmp_path, "two.mlir", MODULE + "\n// -----\n" + second)
    assert cli.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "// -----" not in out
    assert out.count("func.func @") == 2
    assert out.count(CONVERTED) == 2


def test_op_flag_and_policy_flag_combine(module_file: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(module_file), "--policy", "f32", "--op", "dot_general=float16"]) == 0
    out = capsys.readouterr().out
    assert "-> tensor<2x4xf16>" in out
    assert re.search(r"stablehlo\.convert %\d+ : \(tensor<2x4xf16>\) -> tensor<2x4xf32>", out)


def test_pass_flag_runs_only_that_pass(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "rt.mlir", """\
func.func @main(%x: tensor<4xbf16>) -> tensor<4xbf16> {
  %0 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
  %1 = stablehlo.convert %0 : (tensor<4xf32>) -> tensor<4xbf16>
  return %1 : tensor<4xbf16>
}
""")
    assert cli.main([str(path), "--pass", "hlo-amp-insert-converts"]) == 0
    assert capsys.readouterr().out.count("stablehlo.convert") == 2
    assert cli.main([str(path), "--pass", "hlo-amp-cleanup"]) == 0
    assert "stablehlo.convert" not in capsys.readouterr().out


_FP8_STATE_MODULE = """\
func.func @main(%h: tensor<1024x4xf32>, %a: tensor<16x32xf32>, %b: tensor<32x16xf32>
    ) -> (tensor<16x16xf32>, tensor<1024x4xf32>) {
  %s = stablehlo.optimization_barrier %h : tensor<1024x4xf32> loc("hlo_amp_fp8_state")
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0]
      : (tensor<16x32xf32>, tensor<32x16xf32>) -> tensor<16x16xf32>
  return %0, %s : tensor<16x16xf32>, tensor<1024x4xf32>
}
"""


_TWO_DOTS = """\
func.func @main(%a: tensor<2x3xf32>, %b: tensor<3x4xf32>, %c: tensor<4x5xf32>) -> tensor<2x5xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] MARK : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
  %1 = stablehlo.tanh %0 : tensor<2x4xf32>
  %2 = stablehlo.dot_general %1, %c, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x5xf32>) -> tensor<2x5xf32>
  return %2 : tensor<2x5xf32>
}
"""


@pytest.mark.parametrize("mark", ["{hlo_amp.fp8 = [f8E4M3FN, f8E4M3FN, f32]}",
                                  "{hlo_amp.discarded}", "{hlo_amp.attention}"])
def test_the_full_pipeline_ignores_hlo_amps_marks_in_its_input(
        mark: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run's own marks in a module from outside are stale: the output is the unmarked
    module's (a forged fp8 mark quantised a dot the report said was bf16; a discarded
    mark made an internal error in the cleanup pass)."""
    outputs = []
    for text in (_TWO_DOTS.replace("MARK", mark), _TWO_DOTS.replace("MARK ", "")):
        assert cli.main([str(_write(tmp_path, "m.mlir", text)), "--policy", "fp8"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert "hlo_amp." not in outputs[0]


def test_the_fp8_pass_alone_takes_the_policys_scaling(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """--pass hlo-amp-fp8 under scaling=delayed reads the module's amax history, as the
    full pipeline does (it scaled from this step's amax)."""
    path = _write(tmp_path, "state.mlir", _FP8_STATE_MODULE)
    policy = "fp8,scaling=delayed,first_matrix_op=none,last_matrix_op=none,propagate=false"
    notes = []
    for passes in ([], ["--pass", "hlo-amp-insert-converts", "--pass", "hlo-amp-fp8"]):
        report = tmp_path / "report.json"
        assert cli.main([str(path), "--policy", policy, *passes, "--report", str(report)]) == 0
        capsys.readouterr()
        notes.append([n for n in json.loads(report.read_text())["notes"] if "fp8" in n])
    assert notes[0] == notes[1] and "from an amax history" in notes[0][0]


# hlo-amp-opt as the console script (argv[0] decides: hlo_amp/quiet_stderr.py), then the
# jax modules the run imported, on stderr's last line.
_IMPORTS_PROBE = ("import sys; sys.argv[0] = 'hlo-amp-opt'; from hlo_amp import cli; "
                  "status = cli.main(sys.argv[1:]); "
                  "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax')[:3], "
                  "file=sys.stderr); sys.exit(status)")


@pytest.mark.parametrize(("args", "imports_jax"), [
    (["--target", "gpu", "--policy", "mixed_bfloat16"], False),
    (["--target", "cpu", "--policy", "bf16"], False),
    (["--xla-target", "h100", "--policy", "bf16"], True),
    (["--portable"], True),
])
def test_passes_on_a_file_run_without_jax(args: list[str], imports_jax: bool,
                                          module_file: Path, tmp_path: Path) -> None:
    """The passes need jaxlib's MLIR bindings only (hlo_amp/jaxlib_internals.py): jax, half
    a second of every run, is imported where the CLI compiles (``--xla-target``) or reads
    a ``jax.export`` artifact, quietly either way (stderr holds the probe's line alone)."""
    source = module_file
    if args == ["--portable"]:
        args, source = [], tmp_path / "in.bin"
        source.write_bytes(_portable_artifact())
    out = tmp_path / "out.mlir"
    result = subprocess.run([sys.executable, "-c", _IMPORTS_PROBE, str(source), "-o",
                             str(out), *args], capture_output=True, text=True, timeout=120,
                            check=False, env={k: v for k, v in os.environ.items()
                                              if k != "JAX_PLATFORMS"})
    assert result.returncode == 0, result.stderr
    assert CONVERTED in out.read_text()
    *noise, jax_modules = result.stderr.strip().splitlines()
    assert noise == []
    assert (jax_modules != "[]") == imports_jax, jax_modules


def test_console_script_is_installed(module_file: Path) -> None:
    script = Path(sys.executable).parent / "hlo-amp-opt"
    result = subprocess.run([str(script), str(module_file)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert CONVERTED in result.stdout


def test_an_unwritable_report_leaves_stdout_unwritten(module_file: Path, tmp_path: Path
                                                      ) -> None:
    """Both or neither with the output on stdout: a --report naming a directory or
    /dev/full failed after the module was printed."""
    for report in (tmp_path, Path("/dev/full")):
        for output in ("-", "/dev/stdout"):
            run = hlo_amp_opt(module_file, "-o", output, "--report", report)
            assert run.returncode == 1 and run.stdout == "", (report, output, run.stdout[:200])
            assert run.stderr.startswith(f"hlo-amp-opt: error: cannot write '{report}'"), (
                run.stderr)


def test_output_to_a_loop_of_links_is_refused(module_file: Path, tmp_path: Path) -> None:
    """-o naming a loop of symbolic links fails as a shell's > does; the link was
    replaced by a regular file."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    run = hlo_amp_opt(module_file, "-o", tmp_path / "a")
    assert run.returncode == 1, run.stderr
    assert run.stderr == (f"hlo-amp-opt: error: cannot write '{tmp_path / 'a'}': "
                          f"Too many levels of symbolic links\n"), run.stderr
    assert (tmp_path / "a").is_symlink()


@pytest.mark.parametrize(("first", "second"), [
    (["--policy", "bf16,scope:head=float32"], ["--policy", "f16"]),
    (["-o", "a.mlir"], ["-o", "b.mlir"]), (["--target", "cpu"], ["--target", "gpu"])])
def test_an_option_given_twice_is_refused(module_file: Path, tmp_path: Path, first, second
                                          ) -> None:
    """The second --policy (-o, --target, ...) was taken and the first dropped unseen, as
    the policy grammar refuses a repeated key; --scope and --op repeat by design."""
    # Output files in tmp_path: where the option is taken twice, it writes one.
    first, second = ([str(tmp_path / a) if a.endswith(".mlir") else a for a in args]
                     for args in (first, second))
    run = hlo_amp_opt(module_file, *first, *second)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith(f"hlo-amp-opt: error: {first[0]} is given twice"), run.stderr
    assert hlo_amp_opt(module_file, "--scope", "a=keep", "--scope", "b=keep", "-o",
                       tmp_path / "out.mlir").returncode == 0
