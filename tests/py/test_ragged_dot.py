"""jax.lax.ragged_dot, a mixture of experts' grouped matmul: jax lowers it for GPU and TPU
as ``chlo.ragged_dot`` (on CPU as dense dot_generals), which insert_converts computes in
16 bit like a dot_general (bf16 operands, f32 result, group sizes untouched) and the
report counts, with its FLOPs, in every mode: forward, dX (ragged non-contracting) and
dW (ragged contracting)."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp
from hlo_amp.targets.kept_by_xla import RAGGED_UNREAD, xla_gemms

M, K, N, GROUPS = 16, 8, 24, 2  # tokens, features in, features out, experts
X = jnp.linspace(-1.0, 1.0, M * K, dtype=jnp.float32).reshape(M, K)
W = jnp.linspace(-0.5, 0.5, GROUPS * K * N, dtype=jnp.float32).reshape(GROUPS, K, N)
SIZES = jnp.array([6, M - 6], jnp.int32)  # tokens per expert, sorted by expert
# Every mode's multiply-adds: each token meets its expert's K x N weights once.
FLOPS = 2 * M * K * N
# "(tensor<16x8xbf16>, tensor<2x8x24xbf16>, tensor<2xi32>) -> tensor<16x24xf32>"
_SIGNATURE = re.compile(r'"chlo\.ragged_dot".*: \((.*)\) -> (tensor<[^>]*>)')


def _moe(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes)


def _loss(x, w, sizes):
    return jnp.sum(_moe(x, w, sizes) ** 2)


_GRAD = jax.grad(_loss, argnums=(0, 1))


def _ragged_types(text: str) -> list[tuple[list[str], str]]:
    """Per chlo.ragged_dot of a module's text: its operand types' elements, its result's."""
    found = []
    for line in text.splitlines():
        match = _SIGNATURE.search(line)
        if match:
            operands = [t.rsplit("x", 1)[-1].rstrip(">") for t in match.group(1).split(", ")]
            found.append((operands, match.group(2).rsplit("x", 1)[-1].rstrip(">")))
    return found


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_h100_converts_forward_and_both_backward_modes(policy: str) -> None:
    lowered = hlo_amp.compile(_GRAD, policy).lower(X, W, SIZES, target="h100")
    types = _ragged_types(lowered.as_text())
    assert len(types) == 3, types  # forward, dX, dW
    for operands, result in types:
        assert operands == ["bf16", "bf16", "i32"], operands
        # The fast mode may hand a 16-bit result on, as a dot_general's (propagate).
        assert result == "f32" or (policy == "mixed_bfloat16" and result == "bf16")
    decisions = lowered.report().decisions
    assert [d.op_kind for d in decisions] == ["ragged_dot"] * 3
    assert all(d.changed and d.low_precision and d.flops == FLOPS for d in decisions), decisions
    assert {d.direction for d in decisions} == {"forward", "backward"}
    # The report gives each op's types as the rewritten module has them (the fast mode's
    # 16-bit result read f32: record_final_types looked for "stablehlo.ragged_dot").
    assert sorted((list(d.operands_after) + ["i32"], d.result_after) for d in decisions) == (
        sorted(types))


def test_report_counts_its_flops_beside_a_dense_dot() -> None:
    def layer(x, w, sizes, dense):
        return _moe(x, w, sizes) @ dense

    dense = jnp.ones((N, 4), jnp.float32)
    lowered = hlo_amp.compile(layer, "bf16,op:ragged_dot=keep").lower(
        X, W, SIZES, dense, target="h100")
    report = lowered.report()
    ragged = [d for d in report.decisions if d.op_kind == "ragged_dot"]
    assert len(ragged) == 1 and not ragged[0].changed and ragged[0].rule == "op:ragged_dot"
    assert ragged[0].flops == FLOPS
    dense_flops = 2 * M * N * 4
    share = round(100 * dense_flops / (dense_flops + FLOPS))
    assert f"{share}% of FLOPs in 16-bit" in report.summary(), report.summary()
    assert _ragged_types(lowered.as_text())[0][0] == ["f32", "f32", "i32"]


def test_fp8_falls_back_to_the_compute_type() -> None:
    lowered = hlo_amp.compile(_moe, "mixed_bfloat16,op:ragged_dot=float8_e4m3fn").lower(
        X, W, SIZES, target="h100")
    (decision,) = lowered.report().decisions
    assert decision.operands_after == ("bf16", "bf16")
    assert "ragged_dot: no fp8 form yet" in decision.reason
    assert _ragged_types(lowered.as_text()) == [(["bf16", "bf16", "i32"], "f32")]


def test_policy_that_converts_none_of_them_warns() -> None:
    policy = hlo_amp.Policy(compute_dtype="bfloat16", ops={"convolution": "compute"})
    with pytest.warns(UserWarning, match="converts none of the program's 1"):
        hlo_amp.compile(_moe, policy).lower(X, W, SIZES, target="h100")


def test_h100_runs_it_as_a_bf16_gemm() -> None:
    compiled = hlo_amp.compile(_moe, "bf16").lower(X, W, SIZES, target="h100").compile()
    gemms = [g for g in xla_gemms(compiled.as_text()) if g.ragged]
    assert [g.operand_types for g in gemms] == [("bf16", "bf16")], gemms
    assert gemms[0].runner == "cuBLAS"
    (decision,) = compiled.report().decisions
    assert decision.kept_by_xla is True and decision.xla_form == "cuBLAS bf16×bf16"


def _moe_layer(x, router, w_in, w_out):
    """Top-1 routing: tokens sorted by expert, two grouped matmuls, back in order."""
    expert = jnp.argmax(x @ router, axis=-1)
    order = jnp.argsort(expert)
    sizes = jnp.bincount(expert, length=w_in.shape[0]).astype(jnp.int32)
    hidden = jax.nn.gelu(jax.lax.ragged_dot(x[order], w_in, sizes))
    out = jax.lax.ragged_dot(hidden, w_out, sizes)
    return jnp.zeros_like(out).at[order].set(out)


def test_cpu_moe_layer_numerics() -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (M, K))
    router = jax.random.normal(keys[1], (K, GROUPS))
    w_in = jax.random.normal(keys[2], (GROUPS, K, N)) / np.sqrt(K)
    w_out = jax.random.normal(keys[3], (GROUPS, N, K)) / np.sqrt(N)
    want = jax.jit(_moe_layer)(x, router, w_in, w_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = hlo_amp.compile(_moe_layer, "mixed_bfloat16")(x, router, w_in, w_out)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=5e-2, atol=5e-2)


def test_tpu_v5e_converts_it_and_runs_bf16_operands() -> None:
    lowered = hlo_amp.compile(_moe, "bf16").lower(X, W, SIZES, target="tpu-v5e")
    # Not left f32 to XLA:TPU like a dense f32 dot: its Mosaic kernel runs f32 operands
    # in f32 passes.
    assert _ragged_types(lowered.as_text()) == [(["bf16", "bf16", "i32"], "f32")]
    compiled = lowered.compile()
    kernels = [line for line in compiled.as_text().splitlines()
               if 'custom_call_target="tpu_custom_call"' in line and "ragged-dot-none" in line]
    assert len(kernels) == 1
    assert f"bf16[{M},{K}]" in kernels[0], kernels[0][:400]
    assert f"f32[{M},{K}]" not in kernels[0]
    report = compiled.report()
    assert report.decisions[0].kept_by_xla is None  # no name to match it by: no claim
    assert report.unknown_to_xla == {RAGGED_UNREAD: 1}


# A composite's signature in a module's text: its operands' and result's types.
_COMPOSITE = re.compile(r'stablehlo\.composite "chlo\.ragged_dot".*: \((.*)\) -> (tensor<[^>]*>)')


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16", "fp8"])
def test_a_jax_export_for_gpu_runs_it_in_16_bit(policy: str) -> None:
    """On a device hlo_amp.compile rewrites jax.export's artifact, where the op is a
    ``stablehlo.composite`` whose decomposition is a dense dot per group, and XLA runs
    the composite as its own ragged dot from the composite's types. The passes converted
    the decomposition's dots (f32 GEMMs on the GPU under a report of bf16 ones), and the
    fast modes raised (recompute_residuals read the composite's name attribute as its op
    name); the composite is now read as the op, and the artifact holds it in bf16."""
    exported = jax.export.export(jax.jit(hlo_amp.compile(_GRAD, policy)),
                                 platforms=["cuda"])(X, W, SIZES)
    composites = [match.groups() for match in map(_COMPOSITE.search,
                                                   exported.mlir_module().splitlines())
                  if match]
    assert len(composites) == 3, composites  # forward, dX, dW
    for operands, _result in composites:
        assert [t.rsplit("x", 1)[-1] for t in operands.split(", ")] == [
            "bf16>", "bf16>", "i32>"], operands


def test_an_exported_modules_ragged_dot_is_decided_as_the_op() -> None:
    """hlo-amp-opt's view of an artifact: the decisions name the ragged dot (with its
    FLOPs), not a decomposition's per-group dots, and XLA runs bf16 GEMMs for it."""
    from hlo_amp.ir.modules import module_text, parse_module
    from hlo_amp.passes import run_pipeline
    from hlo_amp.policy import Policy
    from hlo_amp.runtime.deviceless import compile_module_for_target
    from hlo_amp.targets import as_target

    text = jax.export.export(jax.jit(_moe), platforms=["cuda"])(X, W, SIZES).mlir_module()
    assert 'stablehlo.composite "chlo.ragged_dot"' in text
    module = parse_module(text)
    report = run_pipeline(module, Policy.parse("bf16"), target="h100")
    assert [(d.op_kind, d.operands_after, d.flops) for d in report.decisions] == [
        ("ragged_dot", ("bf16", "bf16"), FLOPS)]
    compiled = compile_module_for_target(parse_module(module_text(module)), as_target("h100"))
    gemms = xla_gemms(compiled.hlo_modules()[0].to_string())  # the text has no op names
    assert gemms and all(g.operand_types == ("bf16", "bf16") for g in gemms), gemms


def test_fp8_on_cpu_quantises_dws_gradient_and_keeps_the_stems_backward_16_bit() -> None:
    """On CPU ragged_dot lowers to dense dots whose dW reads x masked per group,
    where(mask, x, 0) in the backward pass: the backward's zeros made that masked x a
    gradient too, so dW had two (e4m3fn x e4m3fn, 'no single incoming-gradient operand'),
    and the preset's first-matrix-op rule did not see dW read the stem's x (fp8 where the
    forward and dX stayed bf16)."""
    x = jax.random.normal(jax.random.key(0), (32, 16))  # every dim >= 16: no fp8 fallback
    w = jax.random.normal(jax.random.key(1), (GROUPS, 16, 32)) * 0.3
    sizes = jnp.array([12, 20], jnp.int32)

    def loss(x, w, sizes):
        return jnp.sum(jnp.tanh(_moe(x, w, sizes)) ** 2)

    step = jax.grad(loss, argnums=(0, 1))
    plain = hlo_amp.compile(step, "fp8,first_matrix_op=none,last_matrix_op=none").lower(
        x, w, sizes).report().decisions
    backward = [d for d in plain if d.direction == "backward"]
    assert len(backward) == 2 and all("is the incoming gradient" in d.reason
                                      for d in backward), backward
    assert all(sorted(d.operands_after) == ["f8E4M3FN", "f8E5M2"] for d in backward)
    preset = hlo_amp.compile(step, "fp8").lower(x, w, sizes).report().decisions
    assert [(d.rule, d.operands_after) for d in preset] == [
        ("first_matrix_op", ("bf16", "bf16"))] * 3, preset
