""""kept by XLA" matches ops inside loops, calls, remat and cond branches (issue 13 item 2).

XLA's op names add ``closed_call/`` in scan bodies and ``jit(inner)/`` for inner jits, and
name a dot after a transpose it absorbed; every converted op must still get a verdict,
and what cannot be matched is counted as unknown, never guessed as upcast.
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import hlo_amp
from hlo_amp.report import Decision, Report
from hlo_amp.targets.kept_by_xla import MERGED, UNMATCHED, mark_kept_by_xla, scope_key


class _Cell(nn.Module):
    @nn.compact
    def __call__(self, carry, x):
        h = nn.tanh(nn.Dense(32, name="wh")(carry) + nn.Dense(32, name="wx")(x))
        return h, h


class _Recurrent(nn.Module):
    """An ``nn.scan`` layer, then an ``nn.RNN`` of LSTM cells, then a head."""

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(_Cell, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=1, out_axes=1)
        _, ys = scan(name="scan")(jnp.zeros((xs.shape[0], 32)), xs)
        ys = nn.RNN(nn.LSTMCell(32), name="rnn")(ys)
        return nn.Dense(4, name="head")(ys).sum()


@pytest.fixture(scope="module")
def recurrent_grad():
    model = _Recurrent()
    xs = jax.random.normal(jax.random.PRNGKey(1), (8, 5, 16))
    # Initialised abstractly: the tests lower and compile, they never run it.
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), xs)
    return jax.grad(lambda p, xs: model.apply(p, xs)), params, xs


def _kept_counts(report: Report) -> tuple[int, int]:
    match = re.search(r"kept by XLA: (\d+)/(\d+)", report.summary())
    assert match, report.summary()
    return int(match.group(1)), int(match.group(2))


def test_every_op_in_scan_and_rnn_bodies_gets_a_verdict(recurrent_grad):
    fn, params, xs = recurrent_grad
    report = hlo_amp.compile(fn, "bf16").lower(params, xs).compile().report()
    converted = [d for d in report.decisions if d.changed]
    in_loops = [d for d in converted if "/while/body/" in d.location]
    assert len(in_loops) >= 24  # 2 scan + 8 LSTM dots forward, more backward
    assert all(d.kept_by_xla is not None for d in converted), report.summary()
    # XLA:CPU runs bf16 x bf16 -> f32 dots in bf16, in loop bodies as elsewhere.
    assert all(d.kept_by_xla for d in in_loops)
    assert _kept_counts(report) == (len(converted), len(converted))
    assert "unknown" not in report.summary()


def test_upcast_inside_loops_is_reported_as_upcast(recurrent_grad):
    fn, params, xs = recurrent_grad
    report = hlo_amp.compile(fn, "f16").lower(params, xs).compile().report()
    converted = [d for d in report.decisions if d.changed]
    # XLA:CPU computes every f16 dot in f32: each loop-body op is upcast, not unknown.
    assert converted and all(d.kept_by_xla is False for d in converted)
    assert _kept_counts(report) == (0, len(converted))


def _calls_and_branches(w, x):
    @jax.jit
    def inner(w, x):
        with jax.named_scope("inner_scope"):
            return jnp.tanh(x @ w)

    with jax.named_scope("a"):
        y = jax.checkpoint(lambda x: jnp.sin(x @ w))(x)
    with jax.named_scope("b"):
        y = jax.lax.cond(y.sum() > 0, lambda y: y @ w, lambda y: (y @ w) * 2, y)
    with jax.named_scope("c"):
        y = inner(w, inner(w, y) * 2)
    with jax.named_scope("d"):
        y = jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ w), y)
    return (y ** 2).sum()


def test_remat_cond_inner_jit_and_fori_are_matched():
    w = jax.random.normal(jax.random.PRNGKey(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 32))
    for fn in (_calls_and_branches, jax.grad(_calls_and_branches)):
        report = hlo_amp.compile(fn, "bf16").lower(w, x).compile().report()
        unknown = [d for d in report.decisions if d.changed and d.kept_by_xla is None]
        # Only the recomputed forward dot of the checkpoint may go: XLA merges it with
        # the forward dot it equals.
        assert all("rematted_computation" in d.location for d in unknown), unknown
        for scope in ("a", "b", "c", "d"):
            in_scope = [d for d in report.decisions if d.scope.split("/")[0] == scope]
            assert any(d.kept_by_xla for d in in_scope), (scope, report.summary())
        if unknown:
            assert f"({len(unknown)} unknown: {UNMATCHED})" in report.summary()


def test_scope_key_drops_call_segments_and_the_op_name():
    assert (scope_key("jit(loss)/jvp(M)/while/body/closed_call/scan/wx/dot_general")
            == scope_key("jit(loss)/jvp(M)/while/body/scan/wx/dot_general")
            == "jvp(M)/while/body/scan/wx")
    assert scope_key("jit(f)/c/jit(inner)/s/transpose") == scope_key("c/s/dot_general")
    assert scope_key("jit(f)/c/jit(inner)/s/transpose") != scope_key("c/t/dot_general")


_HLO = """
ENTRY %main {
  %a = f32[4,4]{1,0} parameter(0)
  %b = bf16[4,4]{1,0} parameter(1)
  %d1 = f32[4,4]{1,0} dot(bf16[4,4]{1,0} %b, bf16[4,4]{1,0} %b), metadata={op_name="jit(f)/s/dot_general"}
  %d2 = f32[4,4]{1,0} dot(f32[4,4]{1,0} %a, f32[4,4]{1,0} %a), metadata={op_name="jit(f)/t/dot_general"}
  ROOT %d3 = f32[4,4]{1,0} dot(f32[4,4]{1,0} %a, f32[4,4]{1,0} %a), metadata={op_name="jit(f)/t/dot_general"}
}
"""


def test_fewer_dots_in_xla_than_in_the_report_stay_unknown(converted_decision):
    # Scope s: three converted dots, XLA kept one (and merged two): True, None, None.
    # Scope t: two converted dots, XLA has both in f32: upcast, False, False.
    report = Report(decisions=[converted_decision("jit(f)/s/dot_general")] * 3
                    + [converted_decision("jit(f)/t/dot_general")] * 2)
    mark_kept_by_xla(report, _HLO)
    assert [d.kept_by_xla for d in report.decisions] == [True, None, None, False, False]
    assert report.unknown_to_xla == {MERGED: 2}
    assert f"kept by XLA: 1/3 (2 unknown: {MERGED})" in report.summary()


def test_matrix_ops_xla_names_no_scope_fill_a_scope_short_of_them() -> None:
    """XLA:CPU's weight-gradient convolution has no op_name: its scope held one XLA op
    for two decisions, so both read "merged or removed" (27 of a U-Net's 52 ops), though
    XLA kept every convolution, in f32."""
    def loss(w, x):
        with jax.named_scope("conv"):
            y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y) ** 2)

    w, x = jnp.ones((3, 3, 8, 8)) * 0.1, jax.random.normal(jax.random.key(0), (2, 8, 8, 8))
    compiled = hlo_amp.compile(jax.grad(loss, argnums=(0, 1)), "bf16").lower(w, x).compile()
    assert any(" convolution(" in line and "op_name" not in line
               for line in compiled.as_text().splitlines())  # what the test is about
    report = compiled.report()
    assert [d.kept_by_xla for d in report.decisions] == [False, False, False]
    assert report.unknown_to_xla == {}

    # XLA inlines a composite's decomposition naming its dot "dot_general" alone: the
    # bf16 GEMM it ran read "unknown: merged or removed".
    dense = jax.lax.composite(lambda x, w: jnp.tanh(x @ w), name="my.dense")

    def net(x, w):
        with jax.named_scope("blk"):
            return dense(x, w)

    x, w = jnp.ones((32, 64)), jnp.ones((64, 64)) / 8
    report = hlo_amp.compile(net, "bf16").lower(x, w, target="h100").compile().report()
    assert [d.kept_by_xla for d in report.decisions] == [True]


# Two unnamed XLA dots: a bf16 one of 64 elements (scope b's size) and an f32 one of 16
# (no scope's), and an unnamed ragged GEMM no dense scope may take.
_UNNAMED_HLO = """
ENTRY %main {
  %a = f32[4,4]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %big = f32[8,8]{1,0} dot(bf16[8,8]{1,0} %b, bf16[8,8]{1,0} %b)
  %small = f32[4,4]{1,0} dot(f32[4,4]{1,0} %a, f32[4,4]{1,0} %a)
  ROOT %r = f32[4,4]{1,0} custom-call(bf16[8,8]{1,0} %b, bf16[8,8]{1,0} %b), custom_call_target="__cublas$gemm", metadata={op_name="ragged_dot_general"}
}
"""


def test_unnamed_ops_go_to_the_scope_of_their_size_then_of_their_kind(converted_decision):
    """Filled scope by scope, the first scope short of an op took the first unnamed one
    of its kind, another scope's exact match (scope a's 32 took b's 64); a ragged GEMM
    could fill a dense scope."""
    make = converted_decision
    report = Report(decisions=[dataclasses.replace(make("jit(f)/a/dot_general"), shape="4x8"),
                               dataclasses.replace(make("jit(f)/b/dot_general"), shape="8x8")])
    mark_kept_by_xla(report, _UNNAMED_HLO)
    assert [d.kept_by_xla for d in report.decisions] == [False, True]


# One scope, two converted dots: XLA:CPU upcast the small one (f32 operands) and kept the
# large one, which comes first in the report.
_TWO_SIZES_HLO = """
ENTRY %main {
  %a = f32[2,3]{1,0} parameter(0)
  %b = f32[3,288]{1,0} parameter(1)
  %c = bf16[16,4]{1,0} parameter(2)
  %d = bf16[4,288]{1,0} parameter(3)
  %small = f32[2,288]{1,0} dot(f32[2,3]{1,0} %a, f32[3,288]{1,0} %b), metadata={op_name="jit(f)/s/dot_general"}
  ROOT %large = f32[16,288]{1,0} dot(bf16[16,4]{1,0} %c, bf16[4,288]{1,0} %d), metadata={op_name="jit(f)/s/dot_general"}
}
"""


def test_two_dots_of_one_scope_get_their_own_verdicts(converted_decision):
    """Matched by result size within a scope: the verdicts went in report order, so the
    small dot was 'kept' and the large one 'upcast', and flops_by_scope put 91% of the
    FLOPs under 'XLA upcast it'."""
    make = converted_decision
    small = dataclasses.replace(make("jit(f)/s/dot_general"), shape="2x288", flops=3456)
    large = dataclasses.replace(make("jit(f)/s/dot_general"), shape="16x288", flops=36864)
    report = Report(decisions=[small, large])
    mark_kept_by_xla(report, _TWO_SIZES_HLO)
    assert [(d.kept_by_xla, d.xla_form) for d in report.decisions] == [
        (False, "XLA f32×f32"), (True, "XLA bf16×bf16")]


# ---- fp8 (issue 11 item 3) ---------------------------------------------------------------

# XLA:GPU's optimized HLO on Hopper: cuBLASLt's fp8 call for scope q (the form of XLA's
# gemm_rewriter_fp8_test.cc), a bf16 cuBLAS call for scope k and for scope v.
_GPU_HLO = """
ENTRY %main {
  %x = f8e4m3fn[16,32]{1,0} parameter(0)
  %y = f8e4m3fn[16,32]{1,0} parameter(1)
  %b = bf16[16,32]{1,0} parameter(2)
  %sx = f32[] parameter(3)
  %q = (f32[16,16]{1,0}, s8[33554432]{0}) custom-call(%x, %y, %sx, %sx), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}, metadata={op_name="jit(f)/q/dot_general"}
  %k = (f32[16,16]{1,0}, s8[4194304]{0}) custom-call(%b, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/k/dot_general"}
  %v = (f32[16,16]{1,0}, s8[4194304]{0}) custom-call(%b, %b), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/v/dot_general"}
}
"""


def _fp8(decision: Decision, operands: tuple[str, str]) -> Decision:
    return dataclasses.replace(decision, operands_after=operands,
                               action="float8_e4m3fn")


def test_fp8_ops_count_as_kept_only_against_an_fp8_gemm(converted_decision):
    report = Report(decisions=[
        _fp8(converted_decision("jit(f)/q/dot_general"), ("f8E4M3FN", "f8E4M3FN")),
        _fp8(converted_decision("jit(f)/k/dot_general"), ("f8E5M2", "f8E4M3FN")),  # XLA ran it in bf16
        converted_decision("jit(f)/v/dot_general"),  # a bf16 op next to them, kept as bf16
    ])
    mark_kept_by_xla(report, _GPU_HLO, target=None)
    assert [d.kept_by_xla for d in report.decisions] == [True, False, True]
    summary = report.summary()
    assert "kept by XLA: 2/3" in summary
    assert "fp8 GEMMs kept by XLA: 1/2" in summary
    assert "numerics preview" not in summary  # only said for XLA:CPU


def _verdicts(fn, policy, *args):
    report = hlo_amp.compile(fn, policy).lower(*args, target="h100").compile().report()
    return [(d.changed, "x".join(d.operands_after), d.kept_by_xla, d.xla_form)
            for d in report.decisions]


def test_each_op_gets_the_verdict_of_a_gemm_of_its_own_type_and_call():
    """Against XLA's optimized HLO for an H100: (1) a batch of 24, which XLA pads for its
    fp8 GEMMs, let a bf16 op take an fp8 GEMM and the fp8 op be called upcast; (2) a
    converted dot XLA turned into a multiply took the GEMM of the program's own bf16 dot;
    (3) a jax.jit layer under grad (XLA names jvp(jit(layer)), the report jvp()) read
    "merged or removed" for all five dots XLA kept."""
    def mlp(w1, w2, w3, x):
        return jnp.mean((jax.nn.gelu(jax.nn.gelu(x @ w1) @ w2) @ w3) ** 2)

    padded = _verdicts(jax.grad(mlp), "fp8", jnp.ones((32, 64)), jnp.ones((64, 64)),
                       jnp.ones((64, 32)), jnp.ones((24, 32)))
    for _, types, kept, form in padded:
        assert kept and ("fp8 " + types.lower().replace("x", "×") if "f8" in types
                         else "bf16×bf16") in form, padded

    def outer_and_own(a, b, c, d):
        own = c.astype(jnp.bfloat16) @ d.astype(jnp.bfloat16)
        return jnp.sum(a @ b) + jnp.sum(own.astype(jnp.float32))

    both = _verdicts(outer_and_own, "bf16", jnp.ones((32, 1)), jnp.ones((1, 32)),
                     jnp.ones((32, 32)), jnp.ones((32, 32)))
    (outer,) = [v for v in both if v[0]]  # the converted one
    assert outer[2] is None, both  # merged away: unknown, not kept

    layer = jax.jit(lambda h, w: jax.nn.relu(h @ w))

    def loss(w1, w2, x):
        return jnp.mean(layer(layer(x, w1), w2) ** 2)

    nested = _verdicts(jax.grad(loss, argnums=(0, 1)), "bf16", jnp.ones((16, 32)),
                       jnp.ones((32, 32)), jnp.ones((32, 16)))
    assert len(nested) == 5 and all(kept for _, _, kept, _ in nested), nested


def test_gpu_gemm_calls_are_read_with_their_matrix_operands():
    from hlo_amp.targets.kept_by_xla import xla_gemms

    gemms = xla_gemms(_GPU_HLO)
    assert [(g.op_name.split("/")[1], g.operand_types, g.fp8, g.low) for g in gemms] == [
        ("q", ("f8e4m3fn", "f8e4m3fn"), True, True),
        ("k", ("bf16", "bf16"), False, True),
        ("v", ("bf16", "bf16"), False, True),
    ]


def test_non_fp8_reports_have_no_fp8_clause(converted_decision):
    report = Report(decisions=[converted_decision("jit(f)/k/dot_general")])
    mark_kept_by_xla(report, _GPU_HLO, target=None)
    assert "fp8" not in report.summary()


def test_fp8_on_cpu_is_a_numerics_preview():
    def loss(w, x):
        for name in ("first", "middle", "last"):
            with jax.named_scope(name):
                x = jnp.tanh(x @ w)
        return (x ** 2).sum()

    w = jax.random.normal(jax.random.PRNGKey(0), (64, 64)) / 8
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 64))
    report = hlo_amp.compile(jax.grad(loss), "fp8").lower(w, x).compile().report()
    fp8 = [d for d in report.decisions if d.fp8]
    assert fp8 and all(d.scope == "middle" for d in fp8)  # first and last stay bf16
    # XLA:CPU has no fp8 dot: it multiplies the dequantised operands in f32.
    assert all(d.kept_by_xla is False for d in fp8)
    assert (f"fp8 GEMMs kept by XLA: 0/{len(fp8)} (XLA:CPU computes fp8 dots in a wider "
            "type: a numerics preview, not a speed-up)") in report.summary()


def test_an_fp8_ops_xla_form_has_its_own_operand_formats() -> None:
    """Within one scope the GEMMs were handed out by kind alone: an e4m3fn x e4m3fn
    backward dot (an RNN scanned with unroll=2) was given an e5m2 x e4m3fn GEMM's form,
    contradicting its own types."""
    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (32, 32)) * 0.3
    u = jax.random.normal(keys[1], (32, 32)) * 0.3
    xs = jax.random.normal(keys[2], (6, 16, 32))

    def loss(w, u, xs):
        def cell(h, x):
            h = jnp.tanh(h @ w + x @ u)
            return h, h.sum()
        h, ys = jax.lax.scan(cell, jnp.zeros((16, 32)), xs, unroll=2)
        return (h ** 2).mean() + ys.mean() * 0.01

    report = hlo_amp.compile(jax.grad(loss, (0, 1)), "fp8").lower(
        w, u, xs, target="h100").compile().report()
    fp8 = [d for d in report.decisions if d.fp8 and d.kept_by_xla]
    assert fp8
    for decision in fp8:
        formats = sorted(t.lower() for t in decision.operands_after)
        assert sorted(decision.xla_form.split()[-1].split("×")) == formats, decision
