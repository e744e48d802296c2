"""hlo_amp.rewrite: text and bytecode in, verified text out, and the Report it returns."""

from __future__ import annotations

import inspect
import io
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config
from jax._src.lib.mlir import ir

import hlo_amp
from hlo_amp.ir.modules import ModuleError, functions, module_text, parse_module
from hlo_amp.report import Decision, Report


def train_loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    with jax.named_scope("Block_0"), jax.named_scope("attn"):
        h = jnp.tanh(x @ params["wq"])
    with jax.named_scope("head"):
        return jnp.sum(h @ params["wo"])


PARAMS = {"wq": jnp.ones((4, 4)), "wo": jnp.ones((4, 3))}
X = jnp.ones((2, 4))
# Only this file's frames in the locations: MLIR's bytecode drops the end column of a
# location whose start column is 0, which a caller's top-level statement (pytest-xdist's
# execnet runs its worker loop from such a line) would put into the text otherwise.
with jax_config.traceback_in_locations_limit(4):
    TEXT = jax.jit(jax.grad(train_loss)).lower(PARAMS, X).as_text(debug_info=True)


def _bytecode(text: str) -> bytes:
    buffer = io.BytesIO()
    parse_module(text).operation.write_bytecode(buffer)
    return buffer.getvalue()


def _main_type(text: str) -> str:
    [main] = [f for f in functions(parse_module(text)) if "main" in str(f.sym_name)]
    return str(main.function_type)


def test_public_signature() -> None:
    signature = inspect.signature(hlo_amp.rewrite)
    assert list(signature.parameters) == ["module", "policy", "debug_info", "return_report"]
    params = signature.parameters
    assert params["policy"].default == "bf16"
    assert params["debug_info"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["debug_info"].default is False
    assert params["return_report"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["return_report"].default is False
    assert "rewrite" in hlo_amp.__all__


def test_text_and_bytecode_give_the_same_result() -> None:
    data = _bytecode(TEXT)
    assert data.startswith(b"ML\xefR")
    assert hlo_amp.rewrite(data, "bf16") == hlo_amp.rewrite(TEXT, "bf16")
    assert hlo_amp.rewrite(data, "bf16,scope:head=keep", debug_info=True) == hlo_amp.rewrite(
        TEXT, "bf16,scope:head=keep", debug_info=True)


def test_portable_artifact_input() -> None:
    exported = jax.export.export(jax.jit(lambda x, w: x @ w))(X, PARAMS["wq"])
    out = hlo_amp.rewrite(exported.mlir_module_serialized, "bf16")
    assert "tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>" in out


def test_a_bytearray_is_bytes_and_other_objects_get_one_line() -> None:
    """``Exported.serialize()`` gives a bytearray: taken as bytes. An ir.Module, a jax
    Lowered or Exported failed deep inside ("object has no attribute 'count'")."""
    data = bytearray(_bytecode(TEXT))
    assert hlo_amp.rewrite(data, "bf16") == hlo_amp.rewrite(bytes(data), "bf16")
    lowered = jax.jit(lambda x, w: x @ w).lower(X, PARAMS["wq"])
    for given in (lowered, lowered.compiler_ir("stablehlo"), None):
        with pytest.raises(TypeError, match=r"^hlo_amp.rewrite takes a StableHLO module as "
                           r"text \(str\) or .* got .*: pass a jax Lowered's .as_text\(\)"):
            hlo_amp.rewrite(given, "bf16")


def test_output_verifies_and_keeps_the_signature() -> None:
    out = hlo_amp.rewrite(TEXT, "bf16")
    parse_module(out)  # parses and verifies, or raises
    assert "xbf16>" in out
    assert _main_type(out) == _main_type(TEXT)


def test_debug_info_keeps_locations() -> None:
    assert 'loc("jit(train_loss)/jvp(Block_0)/attn/dot_general"' in hlo_amp.rewrite(
        TEXT, "bf16", debug_info=True)
    assert "loc(" not in hlo_amp.rewrite(TEXT, "bf16")


@pytest.mark.parametrize("policy", ["bf16", "f16", "bf16,scope:Block_0=float16,backward=keep",
                                    "bf16,op:dot_general=float16"])
def test_idempotent(policy: str) -> None:
    once = hlo_amp.rewrite(TEXT, policy, debug_info=True)
    assert hlo_amp.rewrite(once, policy, debug_info=True) == once
    assert hlo_amp.rewrite(once, policy) == hlo_amp.rewrite(TEXT, policy)


def test_f32_preset_changes_nothing() -> None:
    assert hlo_amp.rewrite(TEXT, "f32") == module_text(parse_module(TEXT))


def test_policy_forms_agree() -> None:
    policy = hlo_amp.Policy(compute_dtype="float16", scopes={"head": "float32"},
                            ops={"dot_general": "compute", "dot": "compute",
                                 "convolution": "compute"})
    expected = hlo_amp.rewrite(TEXT, policy)
    assert hlo_amp.rewrite(TEXT, "f16,scope:head=float32") == expected
    assert hlo_amp.rewrite(TEXT, policy.to_dict()) == expected
    assert "xf16>" in expected


def test_convert_sharing() -> None:
    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return (x @ w) + (jnp.tanh(x) @ w) + (jnp.sin(x) @ w)

    text = jax.jit(f).lower(X, PARAMS["wq"]).as_text()
    out, report = hlo_amp.rewrite(text, "bf16", return_report=True)
    assert len(re.findall(r"stablehlo\.convert %arg1 ", out)) == 1  # the weight, once
    assert len(re.findall(r"stablehlo\.convert %arg0 ", out)) == 1
    assert len(re.findall(r"stablehlo\.convert ", out)) == 4  # w, x, tanh(x), sin(x)
    assert sum(d.changed for d in report.decisions) == 3


def test_bad_inputs_raise_module_errors() -> None:
    with pytest.raises(ModuleError, match=r"^<input>:1:1: error: "):
        hlo_amp.rewrite("not mlir")
    with pytest.raises(ModuleError, match="the input is empty"):
        hlo_amp.rewrite("")
    with pytest.raises(ModuleError, match="binary data"):
        hlo_amp.rewrite(b"\x00\xff\xfe\x01" * 4)
    with pytest.raises(ModuleError, match="no public func.func"):
        hlo_amp.rewrite("func.func private @f() {\n  return\n}\n")
    with pytest.raises(ValueError, match="Unknown op kind 'conv'"):
        hlo_amp.rewrite(TEXT, "bf16,op:conv=keep")
    assert issubclass(ModuleError, ValueError)


# ---- the report ------------------------------------------------------------------------


def _report(policy: str) -> Report:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unused-rule warnings are not under test here
        _, report = hlo_amp.rewrite(TEXT, policy, return_report=True)
    return report


def test_report_decisions() -> None:
    report = _report("bf16,scope:head=float32")
    assert isinstance(report, Report)
    assert report.policy == "bf16,compute=bfloat16,scope:head=float32"
    by_where = {(d.scope, d.direction, d.shape): d for d in report.decisions}
    assert sorted(by_where) == [
        ("Block_0/attn", "backward", "4x4"),
        ("Block_0/attn", "forward", "2x4"),
        ("head", "backward", "2x4"),
        ("head", "backward", "3x4"),
    ]
    forward = by_where[("Block_0/attn", "forward", "2x4")]
    assert forward == Decision(
        function="main", op_kind="dot_general", scope="Block_0/attn", direction="forward",
        operands_before=("f32", "f32"), operands_after=("bf16", "bf16"),
        result_before="f32", result_after="f32", action="compute", rule="op:dot_general",
        changed=True, reason="bf16 operands, f32 accumulation", flops=2 * 2 * 4 * 4,
        shape="2x4", location="jit(train_loss)/jvp(Block_0)/attn/dot_general",
        source=forward.source,
    )
    assert forward.source is not None and forward.source.startswith(__file__ + ":")
    assert forward.low_precision
    head = by_where[("head", "backward", "3x4")]
    assert (head.action, head.rule, head.changed) == ("float32", "scope:head", False)
    assert head.operands_after == ("f32", "f32")
    assert not head.low_precision
    assert head.flops == 2 * 3 * 4 * 2


def test_report_forced_dtype_decision() -> None:
    report = _report("bf16,op:dot_general=float16")
    assert {(d.action, d.result_before, d.result_after, d.changed)
            for d in report.decisions} == {("float16", "f32", "f16", True)}
    assert all(d.reason == "forced to float16" for d in report.decisions)


def test_report_summary_line() -> None:
    assert _report("bf16,scope:head=float32").summary() == (
        "converted 2/4 ops; low precision: 2/4 dot_general; "
        f"{round(100 * (64 + 64) / (64 + 64 + 48 + 48))}% of FLOPs in 16-bit or narrower")
    assert _report("f32").summary().startswith("converted 0/4 ops; low precision: 0/4 ")
    assert Report().summary() == "no dot or convolution ops found"


def test_report_summary_without_decisions_says_why() -> None:
    """Passes run without insert_converts decide no matrix op (hlo-amp-opt --pass): the
    line said "no dot or convolution ops found" of a module full of them. A program whose
    every matmul went into fused attention is all 16-bit (it said the same, no share);
    ops of unknown FLOPs (a dynamic shape) are named as left out of the share."""
    from hlo_amp.passes import CleanupConverts, run_pipeline

    module = parse_module(TEXT)
    report = run_pipeline(module, hlo_amp.Policy.parse("bf16"), passes=[CleanupConverts()])
    assert report.summary() == ("no matrix-op decisions: the passes run leave out "
                                "hlo-amp-insert-converts")
    q = jnp.ones((2, 128, 4, 64))

    def attend(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)

    fused = hlo_amp.compile(attend, "bf16").lower(q, q, q, target="h100").report()
    assert fused.summary().startswith("no dot or convolution ops outside fused attention; "
                                      "100% of FLOPs in 16-bit or narrower; attention: 1 of 1")
    unknown = Report(decisions=[Decision(
        function="main", op_kind="dot_general", scope="", direction="forward",
        operands_before=("f32", "f32"), operands_after=("bf16", "bf16"),
        result_before="f32", result_after="f32", action="compute", rule="op:dot_general",
        changed=True, reason="", flops=None)])
    assert unknown.summary().endswith("of FLOPs in 16-bit or narrower (1 op of unknown FLOPs "
                                      "left out)")


def test_report_json_and_unused_rules() -> None:
    report = _report("bf16,scope:head=keep,scope:nowhere=keep,backward=compute")
    data = json.loads(report.to_json())
    assert set(data) == {"policy", "summary", "decisions", "unused_rules", "notes",
                         "unknown_to_xla", "xla_checked", "xla_target", "xla_device",
                         "xla_fp8_note", "fp8_state_columns", "propagation", "collectives",
                         "attention", "rules_outranked", "matrix_ops_decided"}
    assert data["propagation"] is None  # the accurate mode does not run the pass
    assert data["collectives"] == []  # read from XLA's HLO, after a compile
    assert data["summary"] == report.summary()
    assert len(data["decisions"]) == 4
    assert data["decisions"][0]["operands_before"] == ["f32", "f32"]
    # head's backward dots follow backward=compute; only its rule for forward ops is
    # left, and no forward op sits under head (grad drops the unused forward head dot).
    assert data["unused_rules"] == ["scope:head", "scope:nowhere"]
    # scope:head matched the head's backward dots and lost to backward= there.
    assert data["rules_outranked"]["scope:head"] == "backward"
    assert "scope:nowhere" not in data["rules_outranked"]
    text = str(report)
    assert "unused rules: matched no op: scope:nowhere" in text
    assert "unused rules: matched ops but lost on precedence on each: scope:head (by backward)" in text
    assert text.splitlines()[0].split() == [
        "function", "op", "scope", "line", "dir", "shape", "before", "after", "action", "rule", "why",
        "GFLOP"]


def test_report_notes_specialisation() -> None:
    @jax.jit
    def inner(x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        with jax.named_scope("enc"):
            a = inner(x, w)
        with jax.named_scope("head"):
            return inner(a, w)

    text = jax.jit(f).lower(X, PARAMS["wq"]).as_text(debug_info=True)
    out, report = hlo_amp.rewrite(text, "bf16,scope:head=keep", return_report=True)
    assert "func.func private @inner_amp0(" in out
    assert [d.function for d in report.decisions] == ["inner", "inner_amp0"]
    assert report.notes == ["specialised 1 private function(s) per call-site decision"]


def test_rewrite_needs_no_global_context() -> None:
    # The pass makes its own MLIR context; a caller's context is not disturbed.
    with ir.Context():
        assert "xbf16>" in hlo_amp.rewrite(TEXT, "bf16")


def test_policy_constructor_with_scopes_converts() -> None:
    # issue 10: Policy(compute_dtype=..., scopes=...) once converted nothing, silently
    def f(x, w):
        h = x @ w
        with jax.named_scope("head"):
            return h @ w

    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).as_text(debug_info=True)
    policy = hlo_amp.Policy(compute_dtype="bfloat16", scopes={"head": "float32"})
    _, report = hlo_amp.rewrite(text, policy, return_report=True)
    assert [(d.scope, d.low_precision) for d in report.decisions] == [("", True),
                                                                       ("head", False)]


def test_policy_that_converts_nothing_warns() -> None:
    text = jax.jit(lambda x, w: x @ w).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).as_text()
    # a policy whose rules name no op kind the program has: convolutions only
    policy = hlo_amp.Policy(compute_dtype="float16", ops={"convolution": "compute"})
    with pytest.warns(UserWarning, match=r"policy 'f32,compute=float16,op:convolution="
                                         r"compute' converts none of the program's 1 dot"):
        hlo_amp.rewrite(text, policy)
    with warnings.catch_warnings():  # converting nothing on purpose is silent
        warnings.simplefilter("error")
        for quiet in ("f32", "f32,propagate=true", "bf16,op:dot_general=keep",
                      "bf16,op:dot_general=float32"):
            hlo_amp.rewrite(text, quiet)


def _pinned_precision(x, w):
    exact = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    with jax.named_scope("fast"):
        fast = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    algo = jax.lax.dot(x, w, precision=jax.lax.DotAlgorithmPreset.F32_F32_F32)
    return exact + fast + algo + x @ w


def test_explicit_precision_is_kept_unless_a_scope_names_it() -> None:
    x, w = jax.random.normal(jax.random.key(0), (4, 8)), jax.random.normal(jax.random.key(1),
                                                                               (8, 8))
    text = jax.jit(_pinned_precision).lower(x, w).as_text(debug_info=True)
    _, report = hlo_amp.rewrite(text, "bf16", return_report=True)
    reasons = [(d.scope, d.changed, d.reason) for d in report.decisions]
    assert reasons[0] == ("", False, "kept: the program asked for HIGHEST precision")
    assert reasons[1][:2] == ("fast", False)
    assert reasons[2] == ("", False, "kept: the program asked for an explicit dot algorithm")
    assert reasons[3][1] is True  # the default-precision dot is converted as before
    _, report = hlo_amp.rewrite(text, "bf16,scope:fast=compute", return_report=True)
    assert [d.changed for d in report.decisions] == [False, True, False, True]
    _, report = hlo_amp.rewrite(text, "bf16,explicit_precision=ignore", return_report=True)
    assert all(d.changed for d in report.decisions)
    # a HIGHEST dot left alone computes exactly as under jax.jit; ignored, it does not
    def highest(x, w):
        return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)

    want = np.asarray(jax.jit(highest)(x, w))
    np.testing.assert_array_equal(np.asarray(hlo_amp.compile(highest, "bf16")(x, w)), want)
    ignored = np.asarray(hlo_amp.compile(highest, "bf16,explicit_precision=ignore")(x, w))
    assert not np.array_equal(ignored, want)


@pytest.mark.parametrize("target", ["h100", "tpu-v5e"])
def test_a_converted_dot_drops_the_algorithm_its_f32_operands_had(target) -> None:
    """An explicit algorithm (ALG_DOT_F32_F32_F32) names the operand types: kept on the
    16-bit operands of a converted dot, XLA:GPU and XLA:TPU refused to compile it."""
    def algo(x, w):
        with jax.named_scope("fast"):
            return jax.lax.dot(x, w, precision=jax.lax.DotAlgorithmPreset.F32_F32_F32)

    x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
    for policy in ("bf16,scope:fast=compute", "bf16,scope:fast=bfloat16",
                   "bf16,explicit_precision=ignore"):  # the last one compiled too
        lowered = hlo_amp.compile(algo, policy).lower(x, w, target=target)
        (dot,) = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
        assert "xbf16>" in dot and "algorithm" not in dot, (policy, dot)
    assert lowered.compile().memory_analysis() is not None


def test_highest_on_one_operand_keeps_the_op_as_xla_computes_it() -> None:
    """XLA computes a dot at its operands' highest precision, and jax writes (HIGHEST,
    DEFAULT) where the other operand is exact: toeplitz builds its matrix with
    conv_general_dilated_patches' one-hot filter so. One operand asking was not enough:
    toeplitz's copy of its input came out rounded to bf16 (relative error 1.25e-3, a
    Toeplitz solve 1.6e-2). (HIGH, DEFAULT) is converted, as HIGH is."""
    b = jax.random.normal(jax.random.key(1), (24,))
    for fn in (jax.scipy.linalg.toeplitz, jax.scipy.linalg.hankel):
        np.testing.assert_array_equal(np.asarray(hlo_amp.compile(fn, "bf16")(b)),
                                      np.asarray(jax.jit(fn)(b)))
    x, w = jax.random.normal(jax.random.key(2), (4, 8)), jax.random.normal(jax.random.key(3),
                                                                               (8, 8))
    pins = ((jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST),
            (jax.lax.Precision.HIGH, jax.lax.Precision.DEFAULT))
    changed = []
    for precision in pins:
        def dot(x, w, precision=precision):
            return jax.lax.dot(x, w, precision=precision)
        report = hlo_amp.compile(dot, "bf16").lower(x, w).report()
        changed.append([d.changed for d in report.decisions])
    assert changed == [[False], [True]]


def test_dots_inside_a_composite_are_decided_like_a_callees() -> None:
    """XLA runs a composite's decomposition in its place (jax.lax.composite): its dots
    are decided as a called function's, under the composite's scope, and reported. They
    were never reached: left f32 and missing from the report ("no dot or convolution
    ops found" for a program whose only dot was there)."""
    dense = jax.lax.composite(lambda x, w: jnp.tanh(x @ w), name="my.dense")

    def net(x, w):
        with jax.named_scope("head"):
            x = dense(x, w)
        return dense(x, w)

    x, w = jax.random.normal(jax.random.key(0), (8, 16)), jax.random.normal(
        jax.random.key(1), (16, 16)) / 4
    compiled = hlo_amp.compile(net, "bf16,scope:head=float32")
    lowered = compiled.lower(x, w)
    decisions = lowered.report().decisions
    assert [(d.scope, d.operands_after) for d in decisions] == [
        ("head", ("f32", "f32")), ("", ("bf16", "bf16"))]
    text = lowered.as_text()
    assert text.count("stablehlo.composite") == 2  # the composites stay, f32 in and out
    assert "tensor<8x16xbf16>" in text
    got, want = compiled(x, w), jax.jit(net)(x, w)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2)
    assert not np.array_equal(np.asarray(got), np.asarray(want))  # the second went bf16
