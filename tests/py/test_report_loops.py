"""A matrix op's FLOPs in the report count every time it runs per call of the program:
the trip counts of the while loops around it (scan, fori_loop) times its function's call
sites; a loop whose trip count cannot be read counts once, and the decision says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import hlo_amp
from hlo_amp.ir.loops import trip_count
from hlo_amp.ir.modules import new_context, parse_module, walk_operations
from hlo_amp.passes.insert_converts import UNKNOWN_TRIPS

LAYERS, BATCH, WIDTH, INNER = 4, 16, 64, 16


def _layer(h, w):
    return jnp.tanh(h @ w)


def _scanned(w_in, ws, w_out, x):
    h = x @ w_in
    h = jax.lax.scan(lambda c, w: (_layer(c, w), None), h, ws)[0]
    return jnp.sum(jnp.tanh(h @ w_out))


def _unrolled(w_in, ws, w_out, x):
    h = x @ w_in
    for i in range(LAYERS):
        h = _layer(h, ws[i])
    return jnp.sum(jnp.tanh(h @ w_out))


def _args():
    return (jnp.ones((INNER, WIDTH)), jnp.ones((LAYERS, WIDTH, WIDTH)),
            jnp.ones((WIDTH, INNER)), jnp.ones((BATCH, INNER)))


def _report(fn, policy, *args):
    return hlo_amp.compile(fn, policy).lower(*args).report()


def _shares(report):
    total = sum(d.flops for d in report.decisions)
    low = sum(d.flops for d in report.decisions if d.low_precision)
    fp8 = sum(d.flops for d in report.decisions if d.fp8)
    return total, low / total, fp8 / total


@pytest.mark.parametrize("policy", ["bf16", "fp8"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_scan_counts_like_the_unrolled_loop(policy, grad):
    wrap = (lambda f: jax.grad(f, argnums=(0, 1, 2))) if grad else (lambda f: f)
    scanned = _report(wrap(_scanned), policy, *_args())
    unrolled = _report(wrap(_unrolled), policy, *_args())
    # The scan's body dots run LAYERS times and say so; the unrolled ones once each.
    assert {d.runs for d in scanned.decisions} == {1, LAYERS}
    assert {d.runs for d in unrolled.decisions} == {1}
    assert len(unrolled.decisions) > len(scanned.decisions)
    total, low, fp8 = _shares(scanned)
    assert (total, low, fp8) == pytest.approx(_shares(unrolled), rel=1e-12)
    if policy == "fp8":
        # The first and last matrix ops (outside the loop) stay bf16, the layers are fp8.
        assert 0 < fp8 < 1 and low == 1
        first = next(d for d in scanned.decisions if d.rule == "first_matrix_op")
        assert first.runs == 1 and not first.fp8
    # The summary's share reads the same counts; the table marks the repeated ops.
    assert scanned.summary().split("; ")[2] == unrolled.summary().split("; ")[2]
    assert f"({LAYERS}x)" in str(scanned) and "x)" not in str(unrolled).split("GFLOP")[1]
    assert scanned.to_dict()["decisions"][0]["runs"] == scanned.decisions[0].runs


def test_fori_loop_with_static_bounds():
    def fn(x, w):
        return jax.lax.fori_loop(2, 7, lambda i, c: c @ w, x)

    report = _report(fn, "bf16", jnp.ones((BATCH, WIDTH)), jnp.ones((WIDTH, WIDTH)))
    (dot,) = report.decisions
    assert dot.runs == 5 and dot.flops == 5 * 2 * BATCH * WIDTH * WIDTH
    assert dot.notes == ()


def test_nested_scans_and_call_sites():
    """Nested scans multiply. A scan unrolled by 2 runs its body twice per iteration and
    once more for the odd layer after the loop: jax 0.10 calls one function from those
    three call sites (one decision), jax 0.11 inlines the body at each of them (three
    decisions, two in the loop); either way its dot runs 5 times."""
    def nested(x, ws):
        inner = lambda c, w: (c @ w, None)
        outer = lambda c, w3: (jax.lax.scan(inner, c, w3)[0], None)
        return jax.lax.scan(outer, x, ws)[0]

    report = _report(nested, "bf16", jnp.ones((BATCH, WIDTH)), jnp.ones((2, 3, WIDTH, WIDTH)))
    (dot,) = report.decisions
    assert dot.runs == 6 and dot.flops == 6 * 2 * BATCH * WIDTH * WIDTH

    def unrolled_by_two(x, ws):
        return jax.lax.scan(lambda c, w: (c @ w, None), x, ws, unroll=2)[0]

    report = _report(unrolled_by_two, "bf16", jnp.ones((BATCH, WIDTH)),
                     jnp.ones((5, WIDTH, WIDTH)))
    assert sorted(d.runs for d in report.decisions) in ([5], [1, 2, 2])
    assert all(d.flops == d.runs * 2 * BATCH * WIDTH * WIDTH for d in report.decisions)


def test_inner_jit_called_twice():
    """One private function, two call sites: its dot runs twice."""
    inner = jax.jit(lambda h, w: h @ w)
    report = _report(lambda x, w: inner(inner(x, w), w), "bf16", jnp.ones((WIDTH, WIDTH)),
                     jnp.ones((WIDTH, WIDTH)))
    assert sum(d.runs for d in report.decisions) == 2
    assert sum(d.flops for d in report.decisions) == 2 * 2 * WIDTH ** 3


def test_inner_jit_called_under_two_scopes_is_reported_under_each():
    """One private function called under two named scopes with the same decisions: each
    call site's ops are reported (and measured by attribute) under their own scope. The
    body was shared and reported once, under the first scope with both calls' FLOPs."""
    inner = jax.jit(lambda h, w: jnp.tanh(h @ w))

    def fn(x, w):
        with jax.named_scope("enc"):
            h = inner(x, w)
        with jax.named_scope("dec"):
            return inner(h, w)

    args = jnp.ones((BATCH, WIDTH)), jnp.ones((WIDTH, WIDTH))
    report = _report(fn, "bf16", *args)
    assert sorted((d.scope, d.runs, d.flops) for d in report.decisions) == [
        ("dec", 1, 2 * BATCH * WIDTH * WIDTH), ("enc", 1, 2 * BATCH * WIDTH * WIDTH)]
    assert sorted(hlo_amp.attribute(fn, "bf16", *args).ranking) == ["dec", "enc"]


@pytest.mark.parametrize("traced_bound", [False, True], ids=["while_loop", "fori_traced"])
def test_unknown_trip_count_counts_once_and_says_so(traced_bound):
    if traced_bound:
        def fn(x, w, n):
            return jax.lax.fori_loop(0, n, lambda i, c: c @ w, x)
        extra = (3,)
    else:
        def fn(x, w):
            return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c @ w, x)
        extra = ()
    report = _report(fn, "bf16", jnp.ones((BATCH, WIDTH)), jnp.ones((WIDTH, WIDTH)), *extra)
    (dot,) = report.decisions
    assert dot.runs == 1 and dot.flops == 2 * BATCH * WIDTH * WIDTH
    assert dot.notes == (UNKNOWN_TRIPS,)
    assert UNKNOWN_TRIPS.split(" (")[0] in str(report)


# A count-down loop: the counter starts at 10, the body subtracts 2, cond is GT 0.
_COUNT_DOWN = """
func.func public @main(%x: tensor<f32>) -> tensor<f32> {
  %c = stablehlo.constant dense<10> : tensor<i32>
  %0:2 = stablehlo.while(%i = %c, %a = %x) : tensor<i32>, tensor<f32>
  cond {
    %z = stablehlo.constant dense<0> : tensor<i32>
    %p = stablehlo.compare %DIR, %z, %i, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %two = stablehlo.constant dense<2> : tensor<i32>
    %n = stablehlo.subtract %i, %two : tensor<i32>
    stablehlo.return %n, %a : tensor<i32>, tensor<f32>
  }
  return %0#1 : tensor<f32>
}
"""


@pytest.mark.parametrize("direction,trips", [("LT", 5), ("LE", 6), ("GT", None)])
def test_trip_count_of_a_count_down(direction, trips):
    """``0 LT i`` is ``i GT 0``: 10, 8, 6, 4, 2; ``0 LE i`` adds 0; ``0 GT i`` (``i LT 0``)
    with a falling counter is not a counting loop: not read."""
    with new_context():
        module = parse_module(_COUNT_DOWN.replace("%DIR", direction))
        (loop,) = walk_operations(module, names=frozenset({"stablehlo.while"}))
        found = trip_count(loop)
    assert found == trips


_NHWC = ("NHWC", "HWIO", "NHWC")


@pytest.mark.parametrize("conv", [
    lambda a, b: jax.lax.conv_general_dilated(a, b, (1, 1), "VALID", dimension_numbers=_NHWC),
    lambda a, b: jax.lax.conv_general_dilated(a, b, (2, 1), "SAME", dimension_numbers=_NHWC,
                                              rhs_dilation=(1, 2)),
    lambda a, b: jax.lax.conv_transpose(a, b, (2, 2), "SAME", dimension_numbers=_NHWC),
    # its gradients: the input's is lhs-dilated, the kernel's a batch-grouped conv
    lambda a, b: jax.grad(lambda a, b: jnp.sum(jax.lax.conv_general_dilated(
        a, b, (2, 2), "SAME", dimension_numbers=_NHWC) ** 2), argnums=(0, 1))(a, b),
    lambda a, b: jax.lax.conv_general_dilated(a, b[..., :2, :], (1, 1), "SAME",
                                              dimension_numbers=_NHWC, feature_group_count=2),
], ids=["valid", "same_strided_dilated", "transposed", "gradients", "grouped"])
def test_convolution_flops_are_the_products_xla_computes(conv):
    """A convolution's FLOPs leave out the products with padding and with the holes of
    lhs_dilation, as XLA's cost analysis counts them: a transposed convolution was
    counted 4.4x, a SAME one 1.19x."""
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))
    report = _report(conv, "f32", x, w)
    want = jax.jit(conv).lower(x, w).compile().cost_analysis()["flops"]
    got = sum(d.flops for d in report.decisions)
    assert report.decisions and got <= want <= got * 1.02, (got, want)  # XLA counts the loss too
