"""Pass cost (issue 10 item 9): what keeps the passes cheap, and the debug option that
trades it back for a verify after every pass.

- ``run_pipeline`` verifies once, at the end; ``verify_each=True``,
  ``HLO_AMP_VERIFY_EACH=1`` or ``hlo-amp-opt --verify-each`` verify after every pass and
  name the one that broke the module.
- The passes make no reference cycles, so suspending the cyclic collector while they run
  (what ``run_pipeline`` does) leaves no garbage behind.
- The shortcuts (one C++ walk of plain operations, locations read from their tree, a
  module copied by cloning, uses looked up in the walk) give exactly what the slow ways
  give.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

import hlo_amp
from hlo_amp import cli
from hlo_amp import passes as passes_module
from hlo_amp.ir.modules import (
    DECISION_KEY,
    ModuleError,
    copy_module,
    functions,
    module_text,
    parse_module,
    walk_operations,
    walk_ops,
)
from hlo_amp.passes import VERIFY_EACH_ENV, default_pipeline, run_pipeline
from hlo_amp.passes.dot_layout import RELAID
from hlo_amp.passes.propagate.graph import Graph
from hlo_amp.policy import DTYPE_TO_ELEMENT, Policy, as_policy
from hlo_amp.report import Report

MODULE = """\
func.func @main(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/head/dot_general")
  %1 = stablehlo.tanh %0 : tensor<2x4xf32>
  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  return %2 : tensor<2x4xf32>
}
"""

# A reduce body that reads a value from outside it (%k): its uses are not all in the
# walk the propagation pass makes, which must then fall back to the use list.
CAPTURE = """\
func.func @main(%x: tensor<4x8xf32>, %w: tensor<8x8xf32>, %s: tensor<f32>) -> tensor<4xf32> {
  %d = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %t = stablehlo.tanh %d : tensor<4x8xf32>
  %k = stablehlo.multiply %s, %s : tensor<f32>
  %c = stablehlo.constant dense<0.0> : tensor<f32>
  %r = stablehlo.reduce(%t init: %c) across dimensions = [1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<4xf32>
   reducer(%a: tensor<f32>, %b: tensor<f32>) {
    %m = stablehlo.maximum %a, %b : tensor<f32>
    %n = stablehlo.maximum %m, %k : tensor<f32>
    stablehlo.return %n : tensor<f32>
  }
  %e = stablehlo.dot_general %t, %w, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %f = stablehlo.reduce(%e init: %c) applies stablehlo.add across dimensions = [1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<4xf32>
  %g = stablehlo.add %r, %f : tensor<4xf32>
  return %g : tensor<4xf32>
}
"""


@dataclass(frozen=True)
class BreakTypes:
    """A deliberately broken pass: retypes the first tanh's result to f16, which its
    (f32) readers do not accept."""

    name: str = "test-break-types"

    def run(self, module: ir.Module, report: Any = None) -> None:
        tanh = walk_operations(module, names=frozenset({"stablehlo.tanh"}))[0]
        result = tanh.results[0]
        with module.context, ir.Location.unknown():
            result.set_type(ir.RankedTensorType.get(
                ir.RankedTensorType(result.type).shape, ir.F16Type.get()))


def _lowered_text() -> str:
    """A small train step with a scan (while), a reduce and a private function."""

    @jax.jit
    def inner(h, w):
        return jnp.tanh(h @ w)

    def loss(w, x):
        def body(h, _):
            return inner(h, w), None

        h, _ = jax.lax.scan(body, x, None, length=3)
        return jnp.sum(jax.nn.softmax(h @ w, axis=-1))

    w = jnp.ones((8, 8), jnp.float32) / 8
    x = jnp.ones((4, 8), jnp.float32)
    return jax.jit(jax.grad(loss)).lower(w, x).as_text(debug_info=True)


@pytest.fixture(scope="module")
def lowered() -> str:
    return _lowered_text()


# ---- verify once, or after every pass ---------------------------------------------------


def _count_verifies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = passes_module._verify

    def counting(module: ir.Module, what: str, hint: str = "") -> None:
        calls.append(what)
        real(module, what, hint)

    monkeypatch.setattr(passes_module, "_verify", counting)
    return calls


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_verifies_once_by_default(monkeypatch, policy):
    monkeypatch.delenv(VERIFY_EACH_ENV, raising=False)
    calls = _count_verifies(monkeypatch)
    run_pipeline(parse_module(MODULE), Policy.parse(policy), target="cpu")
    assert len(calls) == 1 and calls[0].startswith("the pass pipeline ("), calls


@pytest.mark.parametrize("how", ["keyword", "env"])
def test_verify_each_verifies_after_every_pass(monkeypatch, how):
    calls = _count_verifies(monkeypatch)
    policy = Policy.parse("mixed_bfloat16")
    if how == "env":
        monkeypatch.setenv(VERIFY_EACH_ENV, "1")
        run_pipeline(parse_module(MODULE), policy, target="cpu")
    else:
        monkeypatch.setenv(VERIFY_EACH_ENV, "1")  # the keyword wins over the variable
        run_pipeline(parse_module(MODULE), policy, target="cpu", verify_each=False)
        assert len(calls) == 1
        calls.clear()
        monkeypatch.delenv(VERIFY_EACH_ENV)
        run_pipeline(parse_module(MODULE), policy, target="cpu", verify_each=True)
    names = [p.name for p in default_pipeline(policy, "cpu")]
    assert calls == [f"pass {name}" for name in names]


def _broken_pipeline(policy: Policy) -> list[Any]:
    first, *rest = default_pipeline(policy)
    return [first, BreakTypes(), *rest]


def test_verify_each_names_the_broken_pass():
    policy = Policy.parse("bf16")
    with pytest.raises(ModuleError, match="internal error: pass test-break-types produced "
                                          "an invalid module"):
        run_pipeline(parse_module(MODULE), policy, passes=_broken_pipeline(policy),
                     verify_each=True)


def test_default_names_the_pipeline_and_the_debug_option(monkeypatch):
    monkeypatch.delenv(VERIFY_EACH_ENV, raising=False)
    policy = Policy.parse("bf16")
    with pytest.raises(ModuleError) as caught:
        run_pipeline(parse_module(MODULE), policy, passes=_broken_pipeline(policy))
    message = str(caught.value)
    assert message.startswith(
        "internal error: the pass pipeline (hlo-amp-fused-attention, test-break-types, "
        "hlo-amp-insert-converts, hlo-amp-comm-precision, hlo-amp-cleanup, "
        "hlo-amp-keep-shardings) produced an invalid module"), message
    assert f"{VERIFY_EACH_ENV}=1" in message and "--verify-each" in message


def test_env_var_names_the_broken_pass(monkeypatch):
    monkeypatch.setenv(VERIFY_EACH_ENV, "1")
    policy = Policy.parse("bf16")
    with pytest.raises(ModuleError, match="pass test-break-types produced"):
        run_pipeline(parse_module(MODULE), policy, passes=_broken_pipeline(policy))


def test_cli_verify_each(tmp_path, monkeypatch, capsys):
    path = tmp_path / "in.mlir"
    path.write_text(MODULE)
    assert cli.main([str(path), "--verify-each"]) == 0
    with_flag = capsys.readouterr().out
    assert cli.main([str(path)]) == 0
    assert capsys.readouterr().out == with_flag
    # with a broken pass in the CLI's table: the flag names it, the default names the
    # pipeline
    real = cli.pass_names

    def with_broken(policy: Policy, target: str | None = None) -> dict[str, Any]:
        return {**real(policy, target), "test-break-types": BreakTypes()}

    monkeypatch.setattr(cli, "pass_names", with_broken)
    monkeypatch.delenv(VERIFY_EACH_ENV, raising=False)
    args = [str(path), "--pass", "hlo-amp-insert-converts", "--pass", "test-break-types",
            "--pass", "hlo-amp-cleanup"]
    assert cli.main([*args, "--verify-each"]) == 1
    assert "pass test-break-types produced an invalid module" in capsys.readouterr().err
    assert cli.main(args) == 1
    error = capsys.readouterr().err
    assert "the pass pipeline (hlo-amp-insert-converts, test-break-types, hlo-amp-cleanup)" \
        in error and "--verify-each" in error


# ---- no garbage for the cyclic collector -------------------------------------------------


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_passes_leave_no_cyclic_garbage(lowered, policy):
    module = parse_module(lowered)
    gc.collect()
    assert gc.isenabled()
    gc.disable()
    try:
        run_pipeline(module, Policy.parse(policy), target="cpu")
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0, f"{found} objects in reference cycles"


def test_run_pipeline_restores_the_collector():
    run_pipeline(parse_module(MODULE), Policy.parse("bf16"))
    assert gc.isenabled()
    gc.disable()
    try:
        run_pipeline(parse_module(MODULE), Policy.parse("bf16"))
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    policy = Policy.parse("bf16")
    with pytest.raises(ModuleError):
        run_pipeline(parse_module(MODULE), policy, passes=_broken_pipeline(policy))
    assert gc.isenabled()


def test_walk_ops_keeps_no_garbage(lowered):
    module = parse_module(lowered)
    gc.collect()
    gc.disable()
    try:
        ops = walk_ops(module.operation)
        assert ops
        del ops
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0


# ---- the shortcuts give what the slow ways give ----------------------------------------


def test_walk_operations_matches_walk_ops(lowered):
    module = parse_module(lowered)
    control_flow = (hlo.WhileOp, hlo.CaseOp, hlo.IfOp)
    names = frozenset({"stablehlo.while", "stablehlo.case", "stablehlo.if"})
    everything = walk_operations(module)
    assert [op.operation for op in walk_ops(module.operation)] == everything
    assert any(op.name == "stablehlo.while" for op in everything)
    for fn in functions(module):
        assert [op.operation for op in walk_ops(fn, into=control_flow)] == \
            walk_operations(fn, into=names)
        assert [op.operation for op in walk_ops(fn) if isinstance(op, hlo.ConvertOp)] == \
            walk_operations(fn, names=frozenset({"stablehlo.convert"}))
    assert all(not gc.is_tracked(op) for op in everything)  # plain operations


def test_copy_module_prints_the_same_and_is_independent(lowered):
    module = parse_module(lowered)
    copy = copy_module(module)
    assert module_text(copy, debug_info=True) == module_text(module, debug_info=True)
    assert copy.operation.attributes["sym_name"] == module.operation.attributes["sym_name"]
    run_pipeline(copy, Policy.parse("bf16"))
    assert module_text(module, debug_info=True) == lowered_module_text(lowered)
    assert module_text(copy) != module_text(module)


def lowered_module_text(text: str) -> str:
    return module_text(parse_module(text), debug_info=True)


@pytest.mark.parametrize("text", [MODULE, CAPTURE, "lowered"])
def test_consumers_match_the_use_lists(lowered, text):
    module = parse_module(lowered if text == "lowered" else text)
    policy = Policy.parse("mixed_bfloat16")
    passes = default_pipeline(policy)
    passes[0].run(module)
    low = ir.Type.parse(DTYPE_TO_ELEMENT[policy.compute_dtype], module.context)
    graph = Graph(policy, low, {})
    graph.build(module)
    checked = 0
    for node in graph.nodes:
        for key in node.outputs:
            fast = graph.consumers(key)
            slow = graph._consumers_of_uses(key)
            assert sorted(map(id, fast)) == sorted(map(id, slow)), key
            checked += 1
    assert checked >= 3
    if text == CAPTURE:  # %k is read inside the reduce body: found through its uses
        body = graph.instances[0].body
        assert any(value in body.inner_uses() for node in graph.nodes
                   for _, value in node.outputs)


@pytest.mark.parametrize("text", [CAPTURE, "lowered"])
def test_rewrite_same_with_use_lists_only(lowered, monkeypatch, text):
    # the whole pipeline, the walk's uses against the use lists alone: same module, same
    # report
    text = lowered if text == "lowered" else text
    fast = hlo_amp.rewrite(text, "mixed_bfloat16", debug_info=True, return_report=True)
    monkeypatch.setattr(Graph, "consumers", Graph._consumers_of_uses)
    slow = hlo_amp.rewrite(text, "mixed_bfloat16", debug_info=True, return_report=True)
    assert fast[0] == slow[0]
    assert fast[1].to_json() == slow[1].to_json()


# ---- the report ---------------------------------------------------------------------


def test_report_note_goes_to_its_decision_once_else_to_the_report(converted_decision):
    report = Report()
    assert [report.add(converted_decision(name)) for name in "aba"] == [0, 1, 2]
    report.note("one", 2, "a")
    report.note("one", 2, "a")  # a second copy of the op (propagate's clone): noted once
    report.note("two", 2, "a")
    report.note("three", None, "elsewhere/dot_general")  # a module another run rewrote
    report.note("four", 7, "")  # a mark from another report
    assert [d.notes for d in report.decisions] == [(), (), ("one", "two")]
    assert report.notes == ["elsewhere/dot_general: three", "four"]


_NT = (((1,), (1,)), ((), ()))  # already the form XLA:CPU runs in bf16: left alone
_TN = (((0,), (0,)), ((), ()))  # a weight gradient's form: relaid on CPU


def _relaid_notes(report: Report) -> list[tuple[str, ...]]:
    return [tuple(n for n in d.notes if n.startswith(RELAID)) for d in report.decisions]


def test_relaid_note_lands_on_its_own_op_among_ops_of_one_name():
    # Two dots with one name stack ("jit(f)/s/dot_general"): only the second is relaid,
    # and its note is its own, not the first one's (notes once went by name, in turn).
    def f(a, b, c):
        with jax.named_scope("s"):
            return lax.dot_general(a, b, _NT), lax.dot_general(a, c, _TN)

    a, b, c = jnp.ones((64, 48)), jnp.ones((40, 48)), jnp.ones((64, 40))
    module = parse_module(jax.jit(f).lower(a, b, c).as_text(debug_info=True))
    report = run_pipeline(module, as_policy("bf16"), target="cpu")
    assert len({d.location for d in report.decisions}) == 1
    assert [bool(n) for n in _relaid_notes(report)] == [False, True]
    assert not report.notes
    assert DECISION_KEY not in str(module)  # the marks end with the run


def test_relaid_note_of_a_private_function_shared_by_two_call_sites():
    # One private function, called under two scopes with the same decisions: an
    # instance per scope (each call's ops reported under its own), each named in its
    # body without its caller's prefix.
    inner = jax.jit(lambda a, c: lax.dot_general(a, c, _TN))

    def f(a, c):
        with jax.named_scope("first"):
            x = inner(a, c)
        with jax.named_scope("second"):
            return x, inner(a * 2, c)

    a, c = jnp.ones((64, 48)), jnp.ones((64, 40))
    text = jax.jit(f).lower(a, c).as_text(debug_info=True)
    assert text.count("func.func private") == 1
    module = parse_module(text)
    report = run_pipeline(module, as_policy("bf16"), target="cpu")
    assert [len(n) for n in _relaid_notes(report)] == [1] * len(report.decisions) != []
    assert [d.scope for d in report.decisions] == ["first", "second"]
    assert report.notes == ["specialised 1 private function(s) per call-site decision"]
    assert DECISION_KEY not in str(module)


def test_compile_report_unchanged_by_the_shortcuts():
    # hlo_amp.compile end to end: the report of a small step, every decision converted
    def step(w, x):
        with jax.named_scope("head"):
            return jnp.sum(jnp.tanh(x @ w) @ w)

    w = jnp.ones((16, 16), jnp.float32)
    x = jnp.ones((4, 16), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = hlo_amp.compile(jax.grad(step), "mixed_bfloat16").lower(w, x).report()
    assert report.decisions and all(d.changed for d in report.decisions)
    assert {d.scope for d in report.decisions} == {"head"}
