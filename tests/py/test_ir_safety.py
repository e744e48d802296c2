"""How the passes hold IR (docs/design.md): no op is a dict key, nothing is erased while
a pass runs, and a pass that fails raises PassError naming the pass and the op."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from jax.extend.mlir import ir
from test_crash_net import MODULES

import hlo_amp
from hlo_amp import cli
from hlo_amp.ir.modules import PassError, discard, parse_module, walk_operations
from hlo_amp.passes import default_pipeline, run_pipeline
from hlo_amp.policy import Policy

PACKAGE = Path(hlo_amp.__file__).parent

MODULE = """
func.func public @main(%x: tensor<4x4xf32>, %w: tensor<4x4xf32>) -> tensor<4x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %1 = stablehlo.tanh %0 : tensor<4x4xf32>
  return %1 : tensor<4x4xf32>
}
"""


def test_only_erase_discarded_erases():
    """Every ``.erase()`` call in the package is in modules.erase_discarded."""
    callers = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "erase"):
                    callers.append(f"{path.relative_to(PACKAGE)}:{function.name}")
    assert callers == ["ir/modules.py:erase_discarded"]


@pytest.fixture
def ops_unhashable(monkeypatch):
    """Hashing an op raises: a pass that keys a dict or set by an op fails loudly."""

    def refuse(self):
        raise AssertionError(f"an op was hashed: {self.name}")

    monkeypatch.setattr(ir.Operation, "__hash__", refuse)
    monkeypatch.setattr(ir.OpView, "__hash__", refuse)


@pytest.mark.parametrize("name", ["decoder:2xtril", "tests:scan_rnn", "lit:nested_scan",
                                  "lit:fp8_scan_grad", "benchmarks:cnn"])
@pytest.mark.parametrize("target", [None, "cpu", "gpu"])
def test_no_pass_hashes_an_op(ops_unhashable, name, target):
    text = MODULES[name]()
    for mode in ("mixed_bfloat16", "fp8"):
        run_pipeline(parse_module(text), Policy.parse(mode), target=target)


def test_the_fixture_catches_an_op_key():
    module = parse_module(MODULE)
    op = walk_operations(module)[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ir.Operation, "__hash__", lambda self: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            _ = {op.operation: 0}


@dataclass(frozen=True)
class FailOnTanh:
    name: str = "test-fail-on-tanh"

    def run(self, module, report=None) -> None:
        for op in walk_operations(module):
            if op.name == "stablehlo.tanh":
                raise KeyError("no rule for this op")


@dataclass(frozen=True)
class DiscardStillRead:
    """Discards the dot, whose result the tanh still reads."""

    name: str = "test-discard-still-read"

    def run(self, module, report=None) -> None:
        for op in walk_operations(module):
            if op.name == "stablehlo.dot_general":
                discard(op)


def test_a_failing_pass_raises_pass_error_naming_pass_and_op():
    policy = Policy.parse("bf16")
    with pytest.raises(PassError) as caught:
        run_pipeline(parse_module(MODULE), policy,
                     passes=[*default_pipeline(policy), FailOnTanh()])
    error = caught.value
    assert error.pass_name == "test-fail-on-tanh"
    assert error.op.startswith("stablehlo.tanh")
    assert "KeyError" in str(error) and "no rule for this op" in str(error)
    assert isinstance(error, hlo_amp.PassError)


def test_discarding_an_op_still_read_is_a_pass_error_not_a_dangling_use():
    policy = Policy.parse("bf16")
    module = parse_module(MODULE)
    with pytest.raises(PassError, match="test-discard-still-read at stablehlo.dot_general"
                                        ".* stablehlo.tanh .*still reads it"):
        run_pipeline(module, policy, passes=[DiscardStillRead()])
    assert [op.name for op in walk_operations(module)][1:3] == [
        "stablehlo.dot_general", "stablehlo.tanh"]  # nothing erased
    module.operation.verify()


def test_discarded_ops_are_gone_after_the_pass():
    module = parse_module(MODULE.replace("%1 = stablehlo.tanh %0", "%1 = stablehlo.tanh %x"))
    run_pipeline(module, Policy.parse("bf16"), passes=[DiscardStillRead()])
    names = [op.name for op in walk_operations(module)]
    assert "stablehlo.dot_general" not in names and "stablehlo.tanh" in names
    assert "hlo_amp.discarded" not in str(module)


def test_cli_prints_one_line_for_a_pass_error(tmp_path, monkeypatch, capsys):
    path = tmp_path / "in.mlir"
    path.write_text(MODULE)
    real = cli.pass_names
    monkeypatch.setattr(cli, "pass_names", lambda policy, target=None: {
        **real(policy, target), "test-fail-on-tanh": FailOnTanh()})
    assert cli.main([str(path), "--pass", "test-fail-on-tanh"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "hlo-amp-opt: internal error in pass test-fail-on-tanh at stablehlo.tanh"), err


def test_signal_reading_names_what_ended_the_child():
    """parse_module reads bytecode and artifacts in a forked child first: a read that
    kills the process is named, one that returns or raises is not."""
    import ctypes
    import os

    from hlo_amp.ir.input_checks import signal_reading

    assert signal_reading(os.abort) == "SIGABRT"
    assert signal_reading(lambda: ctypes.string_at(0)) == "SIGSEGV"
    assert signal_reading(lambda: 1 / 0) is None
    assert signal_reading(lambda: None) is None


_READ_AFTER_THE_POOL_STARTED = """
import time, jax, jax.numpy as jnp, hlo_amp
def f(w, x):
    return jax.jit(lambda w, x: jnp.tanh(x @ w))(w, x), jax.jit(jax.grad(lambda w: (x @ w).sum()))(w)
args = (jnp.ones((4, 4)), jnp.ones((2, 4)))
portable = jax.export.export(jax.jit(f))(*args).mlir_module_serialized
hlo_amp.rewrite(jax.jit(f).lower(*args).as_text(), "bf16")  # starts MLIR's thread pool
start = time.monotonic()
hlo_amp.rewrite(portable, "bf16")  # read in a forked child first
print("SECONDS", time.monotonic() - start)
"""


def test_bytes_read_after_mlir_threads_started_do_not_wait_for_them():
    """The forked child that reads bytecode or an artifact first uses a context without
    a thread pool: its copy of the process's pool has no threads, and its verifier
    waited on them until the 300 s limit, on every such read after a text one."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _READ_AFTER_THE_POOL_STARTED],
                          capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SECONDS")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    assert float(lines[-1].split()[1]) < 30


_DISCARD_TWICE = """
from hlo_amp.ir.modules import discard, erase_discarded, new_context, parse_module, walk_operations
with new_context():
    module = parse_module('''func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
      %0 = stablehlo.convert %a : tensor<4xf32>
      return %a : tensor<4xf32>
    }''')
    (convert,) = walk_operations(module, names=frozenset({"stablehlo.convert"}))
    discard(convert)
    discard(walk_operations(module, names=frozenset({"stablehlo.convert"}))[0])
    print("erased", erase_discarded("test"), "convert" in str(module))
"""


def test_an_op_discarded_twice_is_erased_once() -> None:
    """Two passes' walks (propagation's drop of same-type converts, then its rewrite's
    walk of converts) discarding one op listed it twice: erased twice, a segfault."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _DISCARD_TWICE], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["erased", "1", "False"]
