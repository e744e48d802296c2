"""FastDotLayout: bf16 dots relaid to the NT form keep their values and reach YNNPACK.

Numerics: the relaid dot must give bit for bit what XLA:CPU gives for the same dot
written directly in NT form on transposed copies of the inputs (only the layout moved),
and agree with the unrewritten module up to summation order. Compiled HLO is checked
for the YNNPACK fusion that the rewrite exists to reach.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import compiler
from jax._src.interpreters import mlir as jmlir
from jax._src.lib import xla_client
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

import hlo_amp
from hlo_amp.passes import run_pass
from hlo_amp.passes.dot_layout import FastDotLayout
from hlo_amp.targets.cpu import (
    _maybe_permuted,
    _provenance,
    cpu_has_native_bf16,
    has_transposed_result,
    is_fast_on_cpu,
    layout_is_fast,
    needs_layout_rewrite,
)

BF16, F32 = jnp.bfloat16, jnp.float32


# ----------------------------------------------------------------------------- helpers


def _parse(text: str) -> ir.Module:
    return ir.Module.parse(text, context=jmlir.make_ir_context())


def _dots(module: ir.Module) -> list[hlo.DotGeneralOp]:
    found: list[hlo.DotGeneralOp] = []

    def visit(operation: ir.Operation) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    if isinstance(op, hlo.DotGeneralOp):
                        found.append(op)
                    visit(op.operation)

    visit(module.operation)
    return found


def _compile(text: str):
    backend = jax.devices("cpu")[0].client
    devices = xla_client.DeviceList(tuple(jax.devices("cpu")[:1]))
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    with jmlir.make_ir_context() as ctx:
        module = ir.Module.parse(text, context=ctx)
        return compiler.backend_compile_and_load(backend, module, devices, options, [])


def _run(text: str, *args: np.ndarray) -> tuple[np.ndarray, str]:
    executable = _compile(text)
    out = executable.execute([jax.device_put(a) for a in args])[0]
    return np.asarray(out), executable.hlo_modules()[0].to_string()


def _rewrite(text: str) -> tuple[str, list[tuple[str, str]]]:
    module = _parse(text)

    class Notes:
        def __init__(self) -> None:
            self.notes: list[tuple[str, str]] = []

        def note(self, text: str, decision: int | None = None, location: str = "") -> None:
            self.notes.append((location, text))

    report = Notes()
    run_pass(FastDotLayout(), module, report)
    module.operation.verify()
    return str(module), report.notes


def _bf16_dot(dims, post=lambda r: r):
    def f(a, b):
        out = lax.dot_general(a.astype(BF16), b.astype(BF16), dims, preferred_element_type=F32)
        return post(out)

    return f


def _nt_reference(lhs_nt: np.ndarray, rhs_nt: np.ndarray) -> np.ndarray:
    """The dot written directly as [batch, m, k] x [batch, n, k] on row-major copies."""
    nb = lhs_nt.ndim - 2
    dims = (((nb + 1,), (nb + 1,)), (tuple(range(nb)), tuple(range(nb))))
    return np.asarray(
        jax.jit(_bf16_dot(dims))(np.ascontiguousarray(lhs_nt), np.ascontiguousarray(rhs_nt))
    )


def _dots_outside_ynnpack(hlo_text: str) -> int:
    """Dots of the optimized HLO that YNNPACK does not run (Eigen's, always f32 here)."""
    ynn_bodies = {
        match.group(1)
        for line in hlo_text.splitlines()
        if '"kind":"__ynn_fusion"' in line and (match := re.search(r"calls=(%[\w.\-]+)", line))
    }
    count = 0
    for body in hlo_text.split("\n\n"):
        header = re.match(r"\s*(?:ENTRY\s+)?(%[\w.\-]+)", body)
        if header and header.group(1) in ynn_bodies:
            continue
        count += len(re.findall(r" dot\(", body))
    return count


RNG = np.random.default_rng(0)


def _randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------- numerics cases

X, DY, W = _randn(64, 96), _randn(64, 80), _randn(96, 80)
P, Q = _randn(2, 3, 17, 17), _randn(2, 3, 17, 16)
X3, DY3 = _randn(4, 9, 24), _randn(4, 9, 20)
XT = _randn(96, 64)

NUMERICS_CASES = {
    # name: (function, args, NT reference operands, original runs on XLA:CPU)
    "weight_grad [0]x[0]": (
        _bf16_dot((((0,), (0,)), ((), ()))),
        (X, DY),
        (X.T, DY.T),
        True,
    ),
    "weight_grad, result transposed": (
        _bf16_dot((((0,), (0,)), ((), ())), post=lambda r: r.T),
        (X, DY),
        (DY.T, X.T),
        True,
    ),
    "[0]x[1]": (
        _bf16_dot((((0,), (1,)), ((), ()))),
        (X, DY.T.copy()),
        (X.T, DY.T),
        True,
    ),
    "attention bhqk,bhqd->bhkd": (
        _bf16_dot((((2,), (2,)), ((0, 1), (0, 1)))),
        (P, Q),
        (np.swapaxes(P, 2, 3), np.swapaxes(Q, 2, 3)),
        True,
    ),
    "3-D dense weight grad, result transposed": (
        _bf16_dot((((0, 1), (0, 1)), ((), ())), post=lambda r: r.T),
        (X3, DY3),
        (DY3.reshape(-1, 20).T, X3.reshape(-1, 24).T),
        False,  # XLA:CPU 0.10.2 fails at run time on the unrewritten module
    ),
    "forward NN, result transposed": (
        _bf16_dot((((1,), (0,)), ((), ())), post=lambda r: r.T),
        (X, W),
        (W.T, X),
        False,  # likewise: "Unsupported element type for DotThunk::Execute"
    ),
}


@pytest.mark.parametrize("name", list(NUMERICS_CASES))
def test_relaid_dot_is_bit_identical_to_the_nt_dot(name: str) -> None:
    fn, args, (lhs_nt, rhs_nt), original_runs = NUMERICS_CASES[name]
    text = jax.jit(fn).lower(*args).as_text()
    rewritten, notes = _rewrite(text)
    assert len(notes) == 1
    out, compiled = _run(rewritten, *args)
    reference = _nt_reference(lhs_nt, rhs_nt)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, reference)
    assert "__ynn_fusion" in compiled
    assert _dots_outside_ynnpack(compiled) == 0
    if original_runs:
        before, before_compiled = _run(text, *args)
        assert _dots_outside_ynnpack(before_compiled) == 1  # XLA upcast it to an f32 dot
        # Same products, same f32 accumulation; only the summation order differs.
        np.testing.assert_allclose(out, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())


def test_transposed_layout_operand_gets_a_fresh_layout_only() -> None:
    """lhs = convert(transpose(x)) with [1] x [0]: no permutation, still off the fast path."""

    def fn(xt, w):
        return lax.dot_general(
            xt.T.astype(BF16), w.astype(BF16), (((1,), (0,)), ((), ())), preferred_element_type=F32
        )

    text = jax.jit(fn).lower(XT, W).as_text()
    _, before_compiled = _run(text, XT, W)
    assert "__ynn_fusion" not in before_compiled
    rewritten, _ = _rewrite(text)
    out, compiled = _run(rewritten, XT, W)
    np.testing.assert_array_equal(out, _nt_reference(XT.T, W.T))
    assert "__ynn_fusion" in compiled


def test_mlp_grad_end_to_end_matches_and_reaches_ynnpack() -> None:
    """A whole backward pass with every dot converted to bf16 operands."""

    def loss(params, x):
        w1, w2 = params
        return jnp.mean(jnp.tanh(x @ w1) @ w2)

    params = (_randn(48, 64) * 0.1, _randn(64, 40) * 0.1)
    x = _randn(32, 48)
    module = _parse(jax.jit(jax.grad(loss)).lower(params, x).as_text())
    with module.context:
        for op in _dots(module):
            with op.location, ir.InsertionPoint(op):
                for i in (0, 1):
                    ttype = ir.RankedTensorType(op.operands[i].type)
                    bf16 = ir.RankedTensorType.get(ttype.shape, ir.BF16Type.get())
                    op.operands[i] = hlo.convert(bf16, op.operands[i])
    original = str(module)
    rewritten, notes = _rewrite(original)
    assert len(notes) == 2  # the two weight gradients
    flat = [*params, x]
    executable = _compile(rewritten)
    outs = [np.asarray(o) for o in executable.execute([jax.device_put(a) for a in flat])]
    befores = [np.asarray(o) for o in _compile(original).execute([jax.device_put(a) for a in flat])]
    for out, before in zip(outs, befores):
        np.testing.assert_allclose(out, before, rtol=1e-5, atol=1e-6)
    compiled = executable.hlo_modules()[0].to_string()
    assert _dots_outside_ynnpack(_compile(original).hlo_modules()[0].to_string()) == 2
    assert _dots_outside_ynnpack(compiled) == 0


# ------------------------------------------------------------------ pass behaviour


_MODULE = """
func.func @main(%x: tensor<64x96xbf16>, %dy: tensor<64x80xbf16>, %w: tensor<96x80xbf16>,
                %xf: tensor<64x96xf32>, %dyf: tensor<64x80xf32>)
    -> (tensor<96x80xf32>, tensor<64x80xf32>, tensor<96x80xf32>, tensor<96x80xf32>) {
  %0 = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0], precision = [DEFAULT, HIGH] : (tensor<64x96xbf16>, tensor<64x80xbf16>) -> tensor<96x80xf32> loc("jit(f)/transpose(jvp(fc1))/dot_general"("f.py":3:4))
  %1 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<64x96xbf16>, tensor<96x80xbf16>) -> tensor<64x80xf32>
  %2 = stablehlo.dot_general %xf, %dyf, contracting_dims = [0] x [0] : (tensor<64x96xf32>, tensor<64x80xf32>) -> tensor<96x80xf32>
  %3 = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0] : (tensor<64x96xbf16>, tensor<64x80xbf16>) -> tensor<96x80xf32>
  return %0, %1, %2, %3 : tensor<96x80xf32>, tensor<64x80xf32>, tensor<96x80xf32>, tensor<96x80xf32>
}
"""


def test_pass_is_a_frozen_dataclass_named_for_the_cli() -> None:
    rule = FastDotLayout()
    assert rule.name == "hlo-amp-fast-dot-layout"
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.name = "other"  # type: ignore[misc]


def test_rewrite_keeps_location_precision_and_result_and_shares_operands() -> None:
    module = _parse(_MODULE)
    run_pass(FastDotLayout(), module, None)
    module.operation.verify()
    dots = _dots(module)
    assert len(dots) == 4
    first, forward, f32_dot, second = dots
    assert "fc1" in str(first.location) and "f.py" in str(first.location)
    assert "HIGH" in str(first.attributes["precision_config"])
    assert str(first.result.type) == "tensor<96x80xf32>"
    for op in (first, second):
        dims = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        assert list(dims.lhs_contracting_dimensions) == [1]
        assert list(dims.rhs_contracting_dimensions) == [1]
    # the two weight gradients read one relaid copy of each operand
    assert first.operands[0] == second.operands[0]
    assert first.operands[1] == second.operands[1]
    # the forward NN dot and the f32 dot are untouched
    assert forward.operands[0] == first.operation.block.arguments[0]
    assert f32_dot.operands[0] == first.operation.block.arguments[3]
    text = str(module)
    assert text.count("stablehlo.optimization_barrier") == 2
    assert text.count("stablehlo.transpose") == 2


def test_rewrite_is_idempotent_and_reports_each_dot() -> None:
    once, notes = _rewrite(_MODULE)
    assert len(notes) == 2
    assert all("fc1" in loc for loc, _ in notes[:1])
    assert all("NT form" in text for _, text in notes)
    twice, notes_again = _rewrite(once)
    assert twice == once
    assert notes_again == []


def test_report_may_be_none_or_lack_note() -> None:
    for report in (None, object()):
        module = _parse(_MODULE)
        run_pass(FastDotLayout(), module, report)
        module.operation.verify()


# --------------------------------------------------------------------- predicates


def _dot_op(
    lhs: str, rhs: str, dims: str, out: str, *, transposed_result: bool = False
) -> hlo.DotGeneralOp:
    """The one dot_general of a parsed function; with `transposed_result` (2-D results
    only) its result also feeds a stablehlo.transpose."""
    extra = ""
    if transposed_result:
        rows, cols, element = out.split("x")
        extra = f"  %t = stablehlo.transpose %0, dims = [1, 0] : (tensor<{out}>) -> tensor<{cols}x{rows}x{element}>\n"
    module = _parse(
        f"""func.func @f(%a: tensor<{lhs}>, %b: tensor<{rhs}>) -> tensor<{out}> {{
  %0 = stablehlo.dot_general %a, %b, {dims} : (tensor<{lhs}>, tensor<{rhs}>) -> tensor<{out}>
{extra}  return %0 : tensor<{out}>
}}"""
    )
    _PIN.append(module)
    return _dots(module)[0]


_PIN: list[ir.Module] = []  # keep parsed modules alive while their ops are in use

C = "contracting_dims"
# (lhs, rhs, dims, out, layout_is_fast, needs_layout_rewrite)
PREDICATE_TABLE = [
    ("64x96xbf16", "96x80xbf16", f"{C} = [1] x [0]", "64x80xf32", True, False),  # forward
    ("64x96xbf16", "80x96xbf16", f"{C} = [1] x [1]", "64x80xf32", True, False),  # input grad
    ("64x96xbf16", "64x80xbf16", f"{C} = [0] x [0]", "96x80xf32", False, True),  # weight grad
    ("96x64xbf16", "80x96xbf16", f"{C} = [0] x [1]", "64x80xf32", False, True),
    ("4x9x24xbf16", "4x9x20xbf16", f"{C} = [0, 1] x [0, 1]", "24x20xf32", True, False),  # 3-D wgrad
    ("4x9x24xbf16", "24x20xbf16", f"{C} = [2] x [0]", "4x9x20xf32", True, False),  # 3-D forward
    (
        "2x3x17x16xbf16",
        "2x3x17x16xbf16",
        f"batching_dims = [0, 1] x [0, 1], {C} = [3] x [3]",
        "2x3x17x17xf32",
        True,
        False,
    ),  # q k^T
    (
        "2x3x17x17xbf16",
        "2x3x17x16xbf16",
        f"batching_dims = [0, 1] x [0, 1], {C} = [3] x [2]",
        "2x3x17x16xf32",
        True,
        False,
    ),  # p v
    (
        "2x3x17x17xbf16",
        "2x3x17x16xbf16",
        f"batching_dims = [0, 1] x [0, 1], {C} = [2] x [2]",
        "2x3x17x16xf32",
        False,
        True,
    ),  # dK = p^T q
    (
        "2x17x3x16xbf16",
        "2x17x3x16xbf16",
        f"batching_dims = [0, 2] x [0, 2], {C} = [3] x [3]",
        "2x3x17x17xf32",
        True,
        False,
    ),  # bqhd,bkhd->bhqk: DotDecomposer relays it itself
    (
        "4x32x64xbf16",
        "4x32x48xbf16",
        f"batching_dims = [0] x [0], {C} = [1] x [1]",
        "4x64x48xf32",
        False,
        True,
    ),  # batched weight grad
    ("96x1xbf16", "96x80xbf16", f"{C} = [0] x [0]", "1x80xf32", False, False),  # m == 1
    ("4x4xbf16", "4x4xbf16", f"{C} = [0] x [0]", "4x4xf32", False, False),  # tiny
    ("64x96xf32", "64x80xf32", f"{C} = [0] x [0]", "96x80xf32", False, True),  # types ignored
]


@pytest.mark.parametrize("lhs,rhs,dims,out,fast,rewrite", PREDICATE_TABLE)
def test_predicate_table(
    lhs: str, rhs: str, dims: str, out: str, fast: bool, rewrite: bool
) -> None:
    op = _dot_op(lhs, rhs, dims, out)
    assert layout_is_fast(op) is fast
    assert needs_layout_rewrite(op) is rewrite
    of_ynn_size = fast or rewrite
    assert is_fast_on_cpu(op, native_bf16=True) is of_ynn_size
    assert is_fast_on_cpu(op, native_bf16=True, with_layout_pass=False) is fast
    # Without bf16 dot instructions YNNPACK's bf16 dots lose to f32 in every layout.
    assert is_fast_on_cpu(op, native_bf16=False) is False


def test_transposed_result_makes_an_nn_dot_need_the_rewrite() -> None:
    nn = _dot_op(
        "64x96xbf16", "96x80xbf16", f"{C} = [1] x [0]", "64x80xf32", transposed_result=True
    )
    nt = _dot_op(
        "64x96xbf16", "80x96xbf16", f"{C} = [1] x [1]", "64x80xf32", transposed_result=True
    )
    assert has_transposed_result(nn) and has_transposed_result(nt)
    assert layout_is_fast(nn) and needs_layout_rewrite(nn)
    assert layout_is_fast(nt) and not needs_layout_rewrite(nt)



@pytest.mark.parametrize("name", ["cumsum of a dot", "dot of a cumsum", "cummax between dots"])
@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_a_scan_along_a_major_dimension_counts_as_a_transpose(name: str, policy: str) -> None:
    """XLA:CPU scans a reduce_window that spans a major dimension (jnp.cumsum(x, 0))
    along the minor one between transposes, and folds them into the dot that produces
    or reads it: the bf16 dot then failed at run time ("Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32"). Such a dot is relaid like one whose result
    is transposed, and the program runs as jax.jit's does, to bf16's precision."""
    programs = {
        "cumsum of a dot": lambda x, w: jnp.cumsum(x @ w, 0),
        "dot of a cumsum": lambda x, w: jnp.cumsum(x, 0) @ w,
        "cummax between dots": lambda x, w: jax.lax.cummax(jnp.tanh(x @ w), 0) @ w,
    }
    fn = programs[name]
    x = jax.random.normal(jax.random.key(0), (64, 32))
    w = jax.random.normal(jax.random.key(1), (32, 32)) / 6
    got = np.asarray(hlo_amp.compile(fn, policy)(x, w))
    want = np.asarray(jax.jit(fn)(x, w))
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()

def test_operand_from_a_transpose_is_not_fast() -> None:
    module = _parse(
        """func.func @f(%a: tensor<96x64xf32>, %b: tensor<96x80xbf16>) -> tensor<64x80xf32> {
  %t = stablehlo.transpose %a, dims = [1, 0] : (tensor<96x64xf32>) -> tensor<64x96xf32>
  %c = stablehlo.convert %t : (tensor<64x96xf32>) -> tensor<64x96xbf16>
  %s = stablehlo.add %t, %t : tensor<64x96xf32>
  %d = stablehlo.convert %s : (tensor<64x96xf32>) -> tensor<64x96xbf16>
  %0 = stablehlo.dot_general %c, %b, contracting_dims = [1] x [0] : (tensor<64x96xbf16>, tensor<96x80xbf16>) -> tensor<64x80xf32>
  %1 = stablehlo.dot_general %d, %b, contracting_dims = [1] x [0] : (tensor<64x96xbf16>, tensor<96x80xbf16>) -> tensor<64x80xf32>
  %2 = stablehlo.add %0, %1 : tensor<64x80xf32>
  return %2 : tensor<64x80xf32>
}"""
    )
    through_convert, through_add = _dots(module)
    assert not layout_is_fast(through_convert)  # convert keeps the transpose's layout
    assert layout_is_fast(through_add)  # a binary op starts from row-major


def test_cpu_has_native_bf16_is_a_bool() -> None:
    assert isinstance(cpu_has_native_bf16(), bool)


@pytest.mark.parametrize("post, relaid", [
    (lambda r: r, False),  # [0]x[0] weight gradient: only slow, XLA upcasts it; left alone
    (lambda r: r.T, True),  # ...and an NN dot with a transposed result would fail: relaid
])
def test_relay_slow_false_relays_only_dots_that_would_fail(post, relaid) -> None:
    dims = (((0,), (0,)), ((), ())) if not relaid else (((1,), (0,)), ((), ()))
    shapes = ((64, 48), (64, 40)) if not relaid else ((48, 64), (64, 40))
    a, b = _randn(*shapes[0]), _randn(*shapes[1])
    text = jax.jit(_bf16_dot(dims, post)).lower(a, b).as_text()
    module = _parse(text)
    run_pass(FastDotLayout(relay_slow=False), module, None)
    module.operation.verify()
    # Relaid dots are in NT form; the untouched weight gradient keeps [0] x [0].
    assert ("contracting_dims = [1] x [1]" in str(module)) == relaid
    assert ("contracting_dims = [0] x [0]" in str(module)) == (not relaid)
    got, _ = _run(str(module), a, b)  # runs on XLA:CPU either way
    want = np.asarray(jax.jit(lambda x, y: post(jnp.dot(x.T if not relaid else x, y)))(a, b))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-1)


# ------------------------------------------- provenance memo (pass cost, issue 10 item 9)


def _chain_module(start: str, steps: int) -> ir.Module:
    """`start` ("transpose": a permuted layout; "add": row-major), then `steps`
    negates, feeding the lhs of an NN dot."""
    t = "tensor<64x96xbf16>"
    first = {
        "transpose": f"stablehlo.transpose %a, dims = [1, 0] : (tensor<96x64xbf16>) -> {t}",
        "add": f"stablehlo.add %c, %c : {t}",
    }[start]
    body = [f"  %v0 = {first}"]
    body += [f"  %v{i + 1} = stablehlo.negate %v{i} : {t}" for i in range(steps)]
    return _parse(
        f"""func.func @f(%a: tensor<96x64xbf16>, %b: tensor<96x80xbf16>, %c: {t}) -> tensor<64x80xf32> {{
{chr(10).join(body)}
  %0 = stablehlo.dot_general %v{steps}, %b, contracting_dims = [1] x [0] : ({t}, tensor<96x80xbf16>) -> tensor<64x80xf32>
  return %0 : tensor<64x80xf32>
}}"""
    )


@pytest.mark.parametrize("start", ["transpose", "add"])
@pytest.mark.parametrize("steps", [0, 1, 15, 16, 17, 30])
def test_memoised_provenance_agrees_with_the_plain_walk(start: str, steps: int) -> None:
    module = _chain_module(start, steps)
    block = module.body.operations[0].regions[0].blocks[0]
    values = [result for op in block.operations for result in op.results]
    values += list(block.arguments)
    plain = {
        (i, depth): _maybe_permuted(v, depth) for i, v in enumerate(values) for depth in (0, 5)
    }
    for order in (range(len(values)), reversed(range(len(values)))):  # memo filled either way
        memo: dict = {}
        for i in order:
            for depth in (0, 5):
                assert _maybe_permuted(values[i], depth, memo=memo) is plain[i, depth]
    # Past the depth limit a chain counts as permuted, whatever started it.
    assert plain[steps, 0] is (start == "transpose" or steps > 16)


@pytest.mark.parametrize("negates, barriers", [(13, 3), (14, 4), (15, 4)])
def test_operand_chain_lengthened_by_an_earlier_relaid_dot(negates: int, barriers: int) -> None:
    # The first dot is relaid with a new result (4x24x20 becomes reshape(96x20 dot)):
    # every producer chain through it grows by one step. The pass decides on all dots
    # first (memoised walk), so a chain of the second dot's lhs that ends right at the
    # depth limit (14 negates) must be asked again at rewrite time, when it is over the
    # limit and the lhs gets a fresh layout (a fourth barrier), as a walk per dot gives.
    negs = "\n".join(
        f"  %v{i + 1} = stablehlo.negate %v{i} : tensor<96x20xbf16>" for i in range(negates)
    )
    module = _parse(
        f"""func.func @f(%a0: tensor<24x4x9xbf16>, %b: tensor<9x20xbf16>, %c: tensor<20x32xbf16>) -> tensor<32x96xf32> {{
  %a = stablehlo.transpose %a0, dims = [2, 1, 0] : (tensor<24x4x9xbf16>) -> tensor<9x4x24xbf16>
  %r = stablehlo.dot_general %a, %b, contracting_dims = [0] x [0] : (tensor<9x4x24xbf16>, tensor<9x20xbf16>) -> tensor<4x24x20xf32>
  %f = stablehlo.reshape %r : (tensor<4x24x20xf32>) -> tensor<96x20xf32>
  %v0 = stablehlo.convert %f : (tensor<96x20xf32>) -> tensor<96x20xbf16>
{negs}
  %d = stablehlo.dot_general %v{negates}, %c, contracting_dims = [1] x [0] : (tensor<96x20xbf16>, tensor<20x32xbf16>) -> tensor<96x32xf32>
  %t = stablehlo.transpose %d, dims = [1, 0] : (tensor<96x32xf32>) -> tensor<32x96xf32>
  return %t : tensor<32x96xf32>
}}"""
    )
    second = _dots(module)[1]
    if negates == 14:
        assert _provenance(second.operands[0]) == (False, 16)  # at the limit, not past it
    run_pass(FastDotLayout(), module, None)
    module.operation.verify()
    assert str(module).count("stablehlo.optimization_barrier") == barriers


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_a_dot_reading_gathered_columns_runs(policy: str) -> None:
    """h[:, idx] is a gather whose sliced dimension is not the last: XLA writes it as a
    gather and a transpose, which folded into the bf16 dot (the call failed: "Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32"). Its operand is relaid."""
    import hlo_amp

    def f(x, w, idx):
        return jnp.tanh(x)[:, idx] @ w

    x = jax.random.normal(jax.random.key(0), (8, 32))
    w = jax.random.normal(jax.random.key(1), (8, 16))
    idx = jnp.arange(8) * 3
    compiled = hlo_amp.compile(f, policy)
    text = compiled.lower(x, w, idx).as_text()
    assert re.search(r"stablehlo\.optimization_barrier %\d+ : tensor<64xbf16>", text), text
    got = jax.block_until_ready(compiled(x, w, idx))  # XLA:CPU's default flags failed here
    np.testing.assert_allclose(got, jax.jit(f)(x, w, idx), atol=0.05, rtol=0.02)


def _mean_square_grad(w, x):
    return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)


def test_an_export_for_the_cpu_and_a_gpu_runs_on_the_cpu() -> None:
    """jax.export for several platforms puts each dot in a case over them: the pass ran
    with no target (its platforms are not one family), and then did not see the dW's
    transposed result through the case; the CPU call failed ('Unsupported element type
    for DotThunk::Execute: BF16 x BF16 = F32')."""
    w = jax.random.normal(jax.random.key(0), (32, 64)) / 6
    x = jax.random.normal(jax.random.key(1), (3, 8, 32))
    want = _mean_square_grad(w, x)
    for platforms in (["cpu", "cuda"], ["cpu", "tpu"]):
        exported = jax.export.export(jax.jit(hlo_amp.compile(_mean_square_grad, "bf16")),
                                     platforms=platforms)(w, x)
        got = exported.call(w, x)
        assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) < 2e-2


def test_a_shape_polymorphic_export_runs_on_the_cpu() -> None:
    """A dot with a dynamic dimension has no layout to read: it kept bf16 operands with
    an f32 result, which XLA:CPU cannot run for dynamic shapes; it is widened."""
    w = jax.random.normal(jax.random.key(0), (32, 64)) / 6
    x = jax.random.normal(jax.random.key(1), (3, 8, 32))
    (batch,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(hlo_amp.compile(_mean_square_grad, "bf16")),
                                 platforms=["cpu"])(
        w, jax.ShapeDtypeStruct((batch, 8, 32), jnp.float32))
    want = _mean_square_grad(w, x)
    assert float(jnp.abs(exported.call(w, x) - want).max() / jnp.abs(want).max()) < 2e-2
