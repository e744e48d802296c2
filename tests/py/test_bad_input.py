"""Bad input everywhere it can enter: the CLI, hlo_amp.rewrite, Policy, hlo_amp.compile.

Each bad input must give a clear message naming the input and what is accepted; the CLI
exits non-zero with exactly one line on stderr, no traceback, and no -o file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp
from hlo_amp.ir.modules import ModuleError

CLI = str(Path(sys.executable).parent / "hlo-amp-opt")


def _dot_module(inner_scope: str | None = None) -> str:
    def f(a, b):
        with jax.named_scope("head"):
            if inner_scope is None:
                return jnp.tanh(a @ b)
            with jax.named_scope(inner_scope):
                return jnp.tanh(a @ b)

    return jax.jit(f).lower(jnp.ones((2, 3)), jnp.ones((3, 4))).as_text(debug_info=True)


DOT = _dot_module()
DOT_IN_HEAD_X = _dot_module("x")
UNREGISTERED = (
    "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
    '  %0 = "foo.bar"(%a) : (tensor<2xf32>) -> tensor<2xf32>\n'
    "  return %0 : tensor<2xf32>\n"
    "}\n"
)
NO_PUBLIC = (
    "func.func private @f(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
    "  return %a : tensor<2xf32>\n"
    "}\n"
)

# name -> (file content, substrings the one-line message must contain)
BAD_FILES: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "empty": (b"", ("input is empty", "StableHLO module")),
    "whitespace": (b"  \n\n", ("input is empty",)),
    "binary": (b"\x00\xff\xfe\x01\x89PNG garbage", ("not MLIR text or bytecode", "accepted")),
    "fake_bytecode": (b"ML\xefR\x00\x01garbage", ("error: bytecode version",)),
    "truncated": (DOT[: len(DOT) // 2].encode(), (":", "error: ")),
    "unregistered_dialect": (UNREGISTERED.encode(), (":2:", "unregistered dialect")),
    "no_public_function": (NO_PUBLIC.encode(), ("no public func.func", "@main")),
    # MLIR's lexer skips NULs: these read as a module with no function, and a NUL in a
    # module dropped a character unseen.
    "nul_bytes": (b"\x00\x00\x00", ("not MLIR text (a NUL byte)", "accepted")),
    "nul_in_module": ("\n".join(line + "\x00" * (number == 1) for number, line in
                                enumerate(DOT.split("\n"))).encode(),
                      (":2: error: not MLIR text",)),
}


def _run_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([CLI, *args], check=False, input=stdin, capture_output=True, env=env,
                          timeout=60)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.decode()
    assert proc.returncode != 0, err
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert proc.stdout == b""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_cli_bad_file(case: str, tmp_path: Path) -> None:
    content, needles = BAD_FILES[case]
    src = tmp_path / f"{case}.mlir"
    src.write_bytes(content)
    out = tmp_path / "out.mlir"
    proc = _run_cli(str(src), "-o", str(out))
    line = _assert_one_line_error(proc, *needles)
    assert str(src) in line  # the message names the input
    assert ":0:0:" not in line  # no made-up position
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hlo-amp-opt-")]


@pytest.mark.parametrize("policy, needles", [
    ("bf16,op:matmul=compute", ("bad policy", "'matmul'", "dot_general")),
    ("bf16,scope:attn=fast", ("bad policy", "'fast'", "compute, keep")),
    ("bf16,scope:attn=float8", ("bad policy", "'float8'", "bfloat16")),
    ("bf16,scope:a//b=keep", ("bad policy", "'a//b'", "segments")),
    ("bf16,scope:=keep", ("bad policy", "''", "segments")),
    ("bf16,scope:/=f32", ("bad policy", "'/'", "leading '/'", "trailing '$'")),
    ("bf16,scope:/$=f32", ("bad policy", "'/$'", "trailing '$'")),
    ("bf16,compute=int8", ("bad policy", "'int8'", "bfloat16, float16")),
    ("bf16,wat=1", ("bad policy", "'wat'", "accepted")),
])
def test_cli_bad_policy(policy: str, needles: tuple[str, ...], tmp_path: Path) -> None:
    src = tmp_path / "ok.mlir"
    src.write_text(DOT)
    out = tmp_path / "out.mlir"
    out.write_text("previous output\n")  # an existing -o file is left as it was
    proc = _run_cli(str(src), "--policy", policy, "-o", str(out))
    _assert_one_line_error(proc, *needles)
    assert out.read_text() == "previous output\n"


def test_cli_missing_file_and_bad_flag(tmp_path: Path) -> None:
    proc = _run_cli(str(tmp_path / "nope.mlir"))
    _assert_one_line_error(proc, "cannot read", "nope.mlir")
    proc = _run_cli("--no-such-flag")
    _assert_one_line_error(proc, "--no-such-flag")


def test_cli_bad_stdin() -> None:
    proc = _run_cli("-", stdin=b"\x00\x01\x02\xff")
    _assert_one_line_error(proc, "<stdin>", "not MLIR")


def test_cli_good_input_still_works(tmp_path: Path) -> None:
    src = tmp_path / "ok.mlir"
    src.write_text(DOT)
    out = tmp_path / "out.mlir"
    proc = _run_cli(str(src), "--scope", "head=float32", "-o", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    assert "stablehlo.dot_general" in out.read_text()


# ---- hlo_amp.rewrite ---------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_rewrite_bad_module(case: str) -> None:
    content, needles = BAD_FILES[case]
    with pytest.raises(ModuleError) as info:
        hlo_amp.rewrite(content)
    message = str(info.value)
    assert message.startswith("<input>")
    assert "\n" not in message.strip()
    for needle in needles:
        assert needle in message
    # text input gives the same error as bytes
    if case not in ("binary", "fake_bytecode"):
        with pytest.raises(ModuleError, match="error"):
            hlo_amp.rewrite(content.decode())


def test_module_error_is_a_value_error() -> None:
    assert issubclass(ModuleError, ValueError)


# ---- Policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needles", [
    ({"ops": {"matmul": "compute"}}, ("Unknown op kind 'matmul'", "dot_general")),
    ({"ops": {jax.lax.add_p: "compute"}}, ("'add'", "dot_general_p")),
    ({"scopes": {"attn": "fast"}}, ("Unknown action 'fast'", "scope rule 'attn'", "keep")),
    ({"ops": {"dot_general": "fast"}}, ("Unknown action 'fast'", "op rule", "compute")),
    ({"scopes": {"attn": "float8"}}, ("'float8'", "bfloat16")),
    ({"scopes": {"a//b": "keep"}}, ("Malformed scope pattern 'a//b'", "segments")),
    ({"scopes": {"": "keep"}}, ("Malformed scope pattern ''",)),
    ({"scopes": {"//a": "keep"}}, ("Malformed scope pattern '//a'", "leading '/'")),
    ({"scopes": {"/": "keep"}}, ("Malformed scope pattern '/'", "trailing '$'")),
    ({"scopes": {"a/$": "keep"}}, ("Malformed scope pattern 'a/$'", "trailing '$'")),
    ({"scopes": {"Block_[0": "keep"}}, ("unbalanced", "accepted: a glob's character class")),
    # A '[' that no ']' closes, after a lone ']' (counting brackets took it).
    ({"scopes": {"a]b[": "keep"}}, ("Malformed scope pattern 'a]b['", "unbalanced")),
    # A ',' cannot come back through the string form, and no scope holds one.
    ({"scopes": {"attn,mlp": "keep"}}, ("Malformed scope pattern 'attn,mlp'", "no spaces or ','")),
    ({"compute_dtype": "int8"}, ("Unsupported compute_dtype 'int8'", "bfloat16, float16")),
    ({"compute_dtype": jnp.int8}, ("compute_dtype", "bfloat16, float16")),
    ({"compute_dtype": "float32"}, ("compute_dtype 'float32'", "bfloat16, float16")),
    ({"backward": "sideways"}, ("'sideways'", "backward")),
    # None and Python's int are no dtypes (jnp.dtype(None) is float64: the dot ran f64).
    ({"scopes": {"head": None}}, ("Unknown action None for scope rule 'head'", "float32")),
    ({"ops": {"dot_general": None}}, ("Unknown action None for op rule", "compute")),
    ({"scopes": {"head": int}}, ("Unknown action <class 'int'>", "float32")),
])
def test_policy_rejects(kwargs: dict, needles: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as info:
        hlo_amp.Policy(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("spec, needles", [
    ("", ("Empty policy",)),
    ("bf16,scope:attn", ("Malformed item 'scope:attn'", "KEY=VALUE")),
    ("bf16,f64=maybe", ("'maybe'", "true, false")),
    ("bf16,colour=red", ("Unknown key 'colour'", "scope:PATTERN")),
    ("fp16", ("Unknown preset 'fp16'", "bf16, f16, f32")),
    ("bf16,fp16", ("Unknown preset 'fp16'",)),
    ("bf16,f32", ("Preset 'f32'", "first item")),
    # '²' passed str.isdigit() and int() raised its own message.
    ("fp8,amax_history=²", ("Unknown value '²' for amax_history", "a positive integer")),
    # A key written twice: the last value won, unseen.
    ("bf16,scope:head=keep,scope:head=float16",
     ("scope:head is given twice", "('keep' and 'float16')", "one value per key")),
    ("bf16,compute=float16,compute=bfloat16", ("compute is given twice",)),
    # An op kind spelled two ways: the first one won, unseen.
    ("bf16,op:stablehlo.dot_general=keep,op:dot_general=compute",
     ("op kind dot_general is given twice", "(op:stablehlo.dot_general and op:dot_general)",
      "one action per op kind")),
    ("bf16,op:dot_general_p=keep,op:dot=compute", ("op kind dot is given twice",)),
])
def test_policy_string_rejects(spec: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as info:
        hlo_amp.Policy.parse(spec)
    for needle in needles:
        assert needle in str(info.value)


def test_pythons_float_means_float32_as_the_string_does() -> None:
    # It was jnp.dtype(float), float64: an f32 dot upcast to f64.
    assert hlo_amp.Policy(scopes={"head": float}).scopes == {"head": "float32"}


def test_policy_dict_and_type_rejects() -> None:
    with pytest.raises(ValueError, match=r"op kind dot_general is given twice in ops "
                                         r"\('dot_general' and 'stablehlo.dot_general'\)"):
        hlo_amp.Policy(ops={"dot_general": "compute", "stablehlo.dot_general": "keep"})
    # A preset's kind named again by a user's key in a string replaces it, as before.
    assert hlo_amp.Policy.parse("bf16,op:stablehlo.dot_general=keep").ops["dot_general"] \
        == "keep"
    with pytest.raises(ValueError, match="Unknown key 'scope' in policy dict"):
        hlo_amp.Policy.from_dict({"scope": {"a": "keep"}})
    with pytest.raises(ValueError, match="Unsupported policy 42"):
        hlo_amp.compile(lambda x: x, 42)


# ---- hlo_amp.compile and rewrite with bad policies ---------------------------------------


@pytest.mark.parametrize("policy", [
    "bf16,op:matmul=compute", {"compute_dtype": "int8"}, {"scopes": {"a//b": "keep"}},
])
def test_compile_and_rewrite_reject_bad_policy(policy) -> None:
    with pytest.raises(ValueError, match="accepted"):
        hlo_amp.compile(lambda a, b: a @ b, policy)
    with pytest.raises(ValueError, match="accepted"):
        hlo_amp.rewrite(DOT, policy)


def test_compile_rejects_non_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        hlo_amp.compile("not a function")


def test_a_decorators_bad_policy_is_named_as_such() -> None:
    # @hlo_amp.compile(policy="float16") was told it expected a callable, got None.
    with pytest.raises(ValueError, match="^Unknown preset 'float16'.*accepted") as raised:
        hlo_amp.compile(policy="float16")
    assert "callable" not in str(raised.value)


@pytest.mark.parametrize("option", ["in_shardings", "out_shardings", "device", "backend"])
def test_jax_jits_placement_options_point_at_a_jax_jit_step(option) -> None:
    # Python's "compile() got an unexpected keyword argument 'in_shardings'" said nothing
    # of where hlo_amp takes them.
    for call in (lambda: hlo_amp.compile(lambda a: a @ a, "bf16", **{option: None}),
                 lambda: hlo_amp.compile(policy="bf16", **{option: None})):
        with pytest.raises(TypeError, match=rf"takes no {option}=: compile a jax.jit step"):
            call()


def test_an_unknown_keyword_names_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument \(polcy=\).*static_argnums"):
        hlo_amp.compile(lambda a: a @ a, polcy="bf16")


# ---- rules that match nothing -------------------------------------------------------------


def test_rewrite_warns_about_unused_scope_rule() -> None:
    with pytest.warns(UserWarning, match=r"matched no op: scope:nothere"):
        _, report = hlo_amp.rewrite(DOT, "bf16,scope:nothere=keep,scope:head=float32",
                                    return_report=True)
    assert report.unused_rules == ["scope:nothere"]
    # a rule that matches only where another wins is told apart from one matching nothing
    with pytest.warns(UserWarning, match=r"lost on precedence on each: scope:x \(by scope:head\)"):
        _, report = hlo_amp.rewrite(DOT_IN_HEAD_X, "bf16,scope:head=keep,scope:x=float16",
                                    return_report=True)
    assert report.unused_rules == ["scope:x"]
    assert report.rules_outranked == {"scope:x": "scope:head", "op:dot_general": "scope:head"}
    # a rule that matches only outside an amp_stop loses to it (it said "matched no op")
    def shielded(x, w):
        with jax.named_scope("head"), jax.named_scope("amp_stop"):
            return x @ w

    text = jax.jit(shielded).lower(jnp.ones((4, 4)), jnp.ones((4, 4))).as_text(debug_info=True)
    with pytest.warns(UserWarning, match=r"lost on precedence on each: scope:head \(by amp_stop\)"):
        hlo_amp.rewrite(text, "bf16,scope:head=float16")
    # a rule that matches is not listed, and no warning when all rules match
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hlo_amp.rewrite(DOT, "bf16,scope:head=float32")


def test_compile_report_lists_unused_rule() -> None:
    fn = hlo_amp.compile(lambda a, b: a @ b, "bf16,scope:nothere=keep")
    with pytest.warns(UserWarning, match=r"matched no op.*scope:nothere"):
        report = fn.lower(jnp.ones((2, 3)), jnp.ones((3, 4))).report()
    assert report.unused_rules == ["scope:nothere"]
    assert "unused rules: matched no op: scope:nothere" in str(report)


def test_grad_of_a_compiled_function_warns_of_backward_only_where_no_gradient_op_is() -> None:
    """jax.grad of a compiled function exports a forward program (no gradient op) and a
    backward one; backward= applies in the backward program, yet the forward program
    warned "matched no op: backward" (twice, under vmap of the grad too)."""
    w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) @ w)

    amp = hlo_amp.compile(loss, "bf16,backward=keep")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jax.grad(amp)(w, x)
        jax.vmap(jax.grad(amp), in_axes=(None, 0))(w, x[None])
    want = hlo_amp.compile(jax.grad(loss), "bf16,backward=keep")(w, x)
    assert bool((got == want).all())  # the rule applied as it does to the whole step
    # A gradient with no matrix op of its own (d/da of a * sum(tanh(x @ w))) still warns.
    scaled = hlo_amp.compile(lambda a, x: a * jnp.sum(jnp.tanh(x @ w)), "bf16,backward=keep")
    with pytest.warns(UserWarning, match=r"matched no op: backward"):
        jax.grad(scaled)(2.0, x)


# ---- shape polymorphism, zero-size tensors, f64 ------------------------------------------


def test_shape_polymorphic_module_rewrites_and_runs() -> None:
    from jax import export
    from jax._src.export import _export as export_internals
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    def f(a, b):
        return jnp.tanh(a @ b).sum(0)

    b = export.symbolic_shape("b, 4")
    exp = export.export(jax.jit(f))(jax.ShapeDtypeStruct(b, jnp.float32),
                                    jax.ShapeDtypeStruct((4, 3), jnp.float32))
    text, report = hlo_amp.rewrite(exp.mlir_module(), "bf16", return_report=True)
    assert "tensor<?x4xf32>" in text
    assert "tensor<?x4xbf16>" in text
    assert [d.low_precision for d in report.decisions] == [True]
    assert report.decisions[0].flops is None  # dynamic shape: FLOPs unknown, not wrong
    module = ir.Module.parse(text, context=jax_mlir.make_ir_context())
    module.operation.verify()
    rewritten = exp.__class__(**{
        **{f.name: getattr(exp, f.name) for f in __import__("dataclasses").fields(exp)},
        "mlir_module_serialized": export_internals._module_to_bytecode(module),
    })
    rng = np.random.default_rng(0)
    for rows in (1, 5):
        a = rng.standard_normal((rows, 4)).astype(np.float32)
        w = rng.standard_normal((4, 3)).astype(np.float32)
        got = np.asarray(rewritten.call(a, w))
        want = np.asarray(f(a, w))
        assert got.shape == want.shape == (3,)
        np.testing.assert_allclose(got, want, rtol=1.6e-2 * 4, atol=2e-2)


def test_zero_size_tensors() -> None:
    fn = hlo_amp.compile(lambda a, b: jnp.tanh(a @ b), "bf16")
    a, b = jnp.ones((0, 4)), jnp.ones((4, 3))
    out = fn(a, b)
    assert out.shape == (0, 3) and out.dtype == jnp.float32
    report = fn.lower(a, b).report()
    assert report.decisions[0].low_precision and report.decisions[0].flops == 0
    out2 = fn(jnp.ones((2, 0)), jnp.ones((0, 3)))  # empty contraction: zeros
    assert out2.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(out2), np.zeros((2, 3), np.float32))


_F64_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np, hlo_amp
assert jax.config.jax_enable_x64
x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))
w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 2)))
assert x.dtype == jnp.float64
f = lambda a, b: a @ b
ref = np.asarray(f(x, w))
for spec in ("bf16", "bf16,f64=true"):
    fn = hlo_amp.compile(f, spec)
    out = fn(x, w)
    d = fn.lower(x, w).report().decisions[0]
    err = float(np.max(np.abs(np.asarray(out) - ref)))
    print(spec, out.dtype, d.operands_before, d.operands_after, d.changed, err)
"""


def test_f64_program_converted_only_when_asked() -> None:
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _F64_SCRIPT], check=False,
                          capture_output=True,
                          env=env, timeout=80)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    lines = [line for line in proc.stdout.decode().splitlines() if line.strip()]
    plain, converted = lines
    assert plain.startswith("bf16 float64 ('f64', 'f64') ('f64', 'f64') False")
    assert float(plain.split()[-1]) < 1e-12  # untouched: exact f64
    assert converted.startswith("bf16,f64=true float64 ('f64', 'f64') ('bf16', 'bf16') True")
    assert 1e-6 < float(converted.split()[-1]) < 0.1  # bf16 rounding, still close
