"""Sites: scope paths, transforms and direction read from real JAX lowerings and names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

import hlo_amp
from hlo_amp.ir.modules import function_name, functions, is_public, parse_module, walk_operations
from hlo_amp.ir.sites import (
    Site,
    call_prefix,
    join_names,
    location_name,
    location_parts,
    location_source,
    parse_name,
    site_of,
)

X = jnp.ones((2, 4))
W = jnp.ones((4, 4))

_KINDS = {hlo.DotGeneralOp: "dot_general", hlo.DotOp: "dot",
          hlo.ConvolutionOp: "convolution"}


def _ops(op: Any) -> list[Any]:
    found: list[Any] = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                found.append(inner)
                found.extend(_ops(inner))
    return found


def dot_sites(fn: Callable[..., Any], *args: Any) -> list[tuple[str, Site]]:
    """(function, Site) of every dot/conv, following every call path from @main.

    A private function reached from two call sites is listed once per call site,
    each time under that call site's prefix.
    """
    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    module = parse_module(text)
    by_name = {function_name(f): f for f in functions(module)}
    found: list[tuple[str, Site]] = []

    def visit(fn_op: Any, prefix: str) -> None:
        for op in _ops(fn_op.operation):
            kind = next((k for cls, k in _KINDS.items() if isinstance(op, cls)), None)
            if kind is not None:
                found.append((function_name(fn_op), site_of(op.location, kind, prefix)))
            elif isinstance(op, func_dialect.CallOp):
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                name = join_names(prefix, location_name(op.location))
                visit(by_name[callee], call_prefix(name))

    for f in functions(module):
        if is_public(f):
            visit(f, "")
    return found


def summary(fn: Callable[..., Any], *args: Any) -> list[tuple[str, tuple[str, ...], str]]:
    """Sorted (scope path, transforms, direction) of every dot/conv in ``fn``."""
    return sorted((s.scope_path, s.transforms, s.direction) for _, s in dot_sites(fn, *args))


# ---- programs --------------------------------------------------------------------------


def plain(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def nested_scopes(x: jax.Array, w: jax.Array) -> jax.Array:
    with jax.named_scope("Block_0"), jax.named_scope("attn"), jax.named_scope("query"):
        return x @ w


def scoped_loss(x: jax.Array, w: jax.Array) -> jax.Array:
    with jax.named_scope("Block_0"), jax.named_scope("attn"):
        return jnp.sum(jnp.tanh(x @ w))


def vmapped(xs: jax.Array, w: jax.Array) -> jax.Array:
    def one(x: jax.Array) -> jax.Array:
        with jax.named_scope("proj"):
            return x @ w
    return jax.vmap(one)(xs)


def einsum_attention(q: jax.Array, k: jax.Array) -> jax.Array:
    with jax.named_scope("attn"):
        return jnp.einsum("bqd,bkd->bqk", q, k)


def linen_loss(params: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(_linen_model().apply(params, x)))


def _linen_model() -> Any:
    import flax.linen as nn

    class LBlk(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(3, name="fc1")(x)

    return LBlk()


def remat_loss(x: jax.Array, w: jax.Array) -> jax.Array:
    @jax.checkpoint
    def block(x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            return jnp.sin(x @ w)

    with jax.named_scope("Block_0"):
        return jnp.sum(block(x))


@jax.jit
def _inner(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def inner_jit(x: jax.Array, w: jax.Array) -> jax.Array:
    with jax.named_scope("enc"):
        a = _inner(x, w)
    with jax.named_scope("head"):
        return _inner(a, w)


def scan_loss(w: jax.Array, xs: jax.Array) -> jax.Array:
    def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        with jax.named_scope("cell"):
            return jnp.tanh(h @ w + x), None

    h, _ = jax.lax.scan(step, jnp.zeros((2, 4)), xs)
    return jnp.sum(h)


def cond_branches(p: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    def small(x: jax.Array) -> jax.Array:
        with jax.named_scope("head"):
            return x @ w

    def big(x: jax.Array) -> jax.Array:
        with jax.named_scope("body"):  # a user scope, not the while loop's "body"
            return x @ w.T

    return jax.lax.cond(p, small, big, x)


def while_loop(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]


def conv(x: jax.Array, k: jax.Array) -> jax.Array:
    with jax.named_scope("conv1"):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")


def _linen_args() -> tuple[Any, jax.Array]:
    return _linen_model().init(jax.random.key(0), X), X


FWD, BWD = "forward", "backward"
J, TJ = ("jvp",), ("transpose", "jvp")

CASES: list[tuple[str, Callable[[], list[tuple[str, tuple[str, ...], str]]],
                  list[tuple[str, tuple[str, ...], str]]]] = [
    ("plain", lambda: summary(plain, X, W), [("", (), FWD)]),
    ("nested_scopes", lambda: summary(nested_scopes, X, W),
     [("Block_0/attn/query", (), FWD)]),
    # grad: the forward dot under jvp(Block_0), the weight gradient under transpose(jvp()).
    ("jvp_transpose", lambda: summary(jax.grad(scoped_loss, argnums=1), X, W),
     [("Block_0/attn", J, FWD), ("Block_0/attn", TJ, BWD)]),
    ("vmap", lambda: summary(vmapped, jnp.ones((3, 2, 4)), W), [("proj", ("vmap",), FWD)]),
    # vmap of grad: both transforms seen, still backward.
    ("vmap_of_grad", lambda: summary(jax.vmap(jax.grad(scoped_loss, argnums=1),
                                              in_axes=(0, None)), jnp.ones((3, 2, 4)), W),
     [("Block_0/attn", ("vmap", "jvp"), FWD), ("Block_0/attn", ("vmap", "transpose", "jvp"),
                                                BWD)]),
    # The einsum spec segment is not a scope.
    ("einsum", lambda: summary(einsum_attention, jnp.ones((1, 2, 4)), jnp.ones((1, 3, 4))),
     [("attn", (), FWD)]),
    ("flax_linen", lambda: summary(jax.grad(linen_loss), *_linen_args()),
     [("LBlk/fc1", J, FWD), ("LBlk/fc1", TJ, BWD)]),
    # remat re-enters Block_0 inside transpose(jvp(Block_0)): still one Block_0.
    ("remat", lambda: summary(jax.grad(remat_loss, argnums=1), X, W),
     # (sum needs no forward value: only the recomputed dot and the gradient dot remain)
     [("Block_0/mlp", TJ + J, BWD), ("Block_0/mlp", TJ + J, "recomputed")]),
    ("inner_jit", lambda: summary(inner_jit, X, W), [("enc", (), FWD), ("head", (), FWD)]),
    ("scan", lambda: summary(jax.grad(scan_loss), W, jnp.ones((3, 2, 4))),
     [("cell", J, FWD), ("cell", TJ, BWD), ("cell", TJ, BWD)]),
    ("cond", lambda: summary(cond_branches, True, X, W),
     [("body", (), FWD), ("head", (), FWD)]),
    ("while", lambda: summary(while_loop, X, W), [("", (), FWD)]),
    ("conv", lambda: summary(conv, jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))),
     [("conv1", (), FWD)]),
]


@pytest.mark.parametrize(("name", "run", "expected"), CASES, ids=[c[0] for c in CASES])
def test_sites_of_real_lowerings(name: str, run: Callable[[], Any],
                                 expected: list[tuple[str, tuple[str, ...], str]]) -> None:
    assert run() == sorted(expected)


def test_site_fields_from_a_real_lowering() -> None:
    [(function, site)] = [s for s in dot_sites(jax.grad(scoped_loss, argnums=1), X, W)
                          if s[1].backward]
    assert function == "main"
    assert site.scope == ("Block_0", "attn")
    assert site.op_kind == "dot_general"
    assert site.name == "jit(scoped_loss)/transpose(jvp(Block_0))/attn/dot_general"
    assert site.source is not None and site.source.startswith(__file__ + ":")
    assert site.einsum is None


def test_einsum_spec_is_recorded() -> None:
    [(_, site)] = dot_sites(einsum_attention, jnp.ones((1, 2, 4)), jnp.ones((1, 3, 4)))
    assert site.einsum == "bqd,bkd->bqk"
    assert site.scope == ("attn",)


def test_private_functions_get_their_call_site_prefix() -> None:
    sites = dot_sites(inner_jit, X, W)
    assert [(f, s.name) for f, s in sites] == [
        ("_inner", "jit(inner_jit)/enc/dot_general"),
        ("_inner", "jit(inner_jit)/head/dot_general"),
    ]


def test_report_agrees_with_sites() -> None:
    """The pass reads the same scopes and directions, per specialised function. Where a
    scan's body lives depends on jax: 0.10 calls it (``closed_call``, its transpose
    ``closed_call_0``), 0.11 inlines it into the loop in ``main`` (``SCAN_GRAD_INLINED``)."""
    args = (W, jnp.ones((3, 2, 4)))
    text = jax.jit(jax.grad(scan_loss)).lower(*args).as_text(debug_info=True)
    _, report = hlo_amp.rewrite(text, "bf16", return_report=True)
    got = sorted((d.function, d.scope, d.direction) for d in report.decisions)
    assert got == sorted((f, s.scope_path, s.direction)
                         for f, s in dot_sites(jax.grad(scan_loss), *args))
    assert sorted(g[1:] for g in got) == [("cell", BWD), ("cell", BWD), ("cell", FWD)]
    assert all(d.runs == 3 for d in report.decisions)
    text = jax.jit(inner_jit).lower(X, W).as_text(debug_info=True)
    _, report = hlo_amp.rewrite(text, "bf16,scope:head=keep", return_report=True)
    assert [(d.function, d.scope, d.rule) for d in report.decisions] == [
        ("_inner", "enc", "op:dot_general"), ("_inner_amp0", "head", "scope:head")]


# jax.grad(scan_loss) as jax 0.11 lowers it: each scan body is an eval_jaxpr equation that
# mlir.core_call_lowering(inline_jax_late=True) inlines into its while loop in main
# (jax_mlir_ext.inlined_func_call names each op "<call site>/<op>": ".../eval_jaxpr/cell/...").
SCAN_GRAD_INLINED = """
func.func public @main(%w: tensor<4x4xf32>, %h0: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<4x4xf32>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %one = stablehlo.constant dense<1> : tensor<i32>
  %trips = stablehlo.constant dense<3> : tensor<i32>
  %fwd:2 = stablehlo.while(%i = %c0, %h = %h0) : tensor<i32>, tensor<2x4xf32>
  cond {
    %p = stablehlo.compare LT, %i, %trips, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %d = stablehlo.dot_general %h, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(scan_loss)/jvp()/while/body/eval_jaxpr/cell/dot_general")
    %t = stablehlo.tanh %d : tensor<2x4xf32> loc("jit(scan_loss)/jvp()/while/body/eval_jaxpr/cell/tanh")
    %j = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %j, %t : tensor<i32>, tensor<2x4xf32>
  }
  %zero = stablehlo.constant dense<0.0> : tensor<4x4xf32>
  %bwd:3 = stablehlo.while(%i = %c0, %g = %fwd#1, %dw = %zero) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %p = stablehlo.compare LT, %i, %trips, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %gw = stablehlo.dot_general %g, %g, contracting_dims = [0] x [0] : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<4x4xf32> loc("jit(scan_loss)/transpose(jvp())/while/body/eval_jaxpr/cell/dot_general")
    %acc = stablehlo.add %dw, %gw : tensor<4x4xf32> loc("jit(scan_loss)/transpose(jvp())/while/body/eval_jaxpr/cell/add_any")
    %gh = stablehlo.dot_general %g, %w, contracting_dims = [1] x [1] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(scan_loss)/transpose(jvp())/while/body/eval_jaxpr/cell/dot_general")
    %j = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %j, %gh, %acc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %bwd#1, %bwd#2 : tensor<2x4xf32>, tensor<4x4xf32>
}
"""


def test_report_of_scan_bodies_inlined_into_main() -> None:
    """jax 0.11's form of the scanned grad: the decisions are main's, with the scopes and
    directions the called bodies have under jax 0.10, each running the loop's 3 times."""
    _, report = hlo_amp.rewrite(SCAN_GRAD_INLINED, "bf16", return_report=True)
    got = sorted((d.function, d.scope, d.direction, d.runs) for d in report.decisions)
    assert got == [("main", "cell", BWD, 3), ("main", "cell", BWD, 3),
                   ("main", "cell", FWD, 3)]


# ---- names as strings ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "scope", "transforms", "backward", "einsum"),
    [
        ("jit(f)/dot_general", (), (), False, None),
        ("dot_general", (), (), False, None),
        ("", (), (), False, None),
        ("jit(f)/jvp(Block_0)/attn/dot_general", ("Block_0", "attn"), ("jvp",), False, None),
        ("jit(f)/transpose(jvp(Block_0))/attn/dot_general", ("Block_0", "attn"),
         ("transpose", "jvp"), True, None),
        # A wrapper may hold several segments.
        ("jit(step)/transpose(jvp(Block_0/attn))/query/dot_general",
         ("Block_0", "attn", "query"), ("transpose", "jvp"), True, None),
        ("jit(f)/transpose(jvp(LBlk))/fc2/dot_general", ("LBlk", "fc2"),
         ("transpose", "jvp"), True, None),
        ("jit(f)/vmap(ij,jk->ik)/dot_general", (), ("vmap",), False, "ij,jk->ik"),
        ("jit(f)/attn/...hqk,...khd->...qhd/dot_general", ("attn",), (), False,
         "...hqk,...khd->...qhd"),
        ("jit(f)/jvp()/while/body/cell/dot_general", ("cell",), ("jvp",), False, None),
        ("jit(f)/while/cond/lt", (), (), False, None),
        # jax 0.11's segment for a scan body's call.
        ("jit(f)/jvp()/while/body/eval_jaxpr/cell/dot_general", ("cell",), ("jvp",), False,
         None),
        ("jit(f)/cond/branch_1_fun/head/dot_general", ("head",), (), False, None),
        ("jit(f)/transpose(jvp())/cond/branch_0_fun/dot_general", (), ("transpose", "jvp"),
         True, None),
        # "body" and "cond" are user scopes outside while/cond structure.
        ("jit(f)/body/dot_general", ("body",), (), False, None),
        ("jit(f)/cond/x/dot_general", ("cond", "x"), (), False, None),
        ("jit(f)/pjit(inner)/x/dot_general", ("x",), (), False, None),
        ("jit(f)/enc/jit(inner)/dot_general", ("enc",), (), False, None),
        ("jit(f)/checkpoint/rematted_computation/mlp/dot_general", ("mlp",), (), False, None),
        ("jit(r)/transpose(jvp(Block_0))/jvp(Block_0)/checkpoint/mlp/dot_general",
         ("Block_0", "mlp"), ("transpose", "jvp", "jvp"), True, None),
        # ... also under nested scopes: jax.checkpoint in enc/l0 is one enc/l0 (it read
        # enc/l0/enc/l0, and a rule for the scope enc/l0 alone missed the backward).
        ("jit(r)/transpose(jvp(enc))/l0/jvp(enc)/l0/checkpoint/dot_general",
         ("enc", "l0"), ("transpose", "jvp", "jvp"), True, None),
        (("jit(r)/transpose(jvp(stack))/while/body/layer/jvp(stack)/while/body/layer/"
          "checkpoint/rematted_computation/dot_general"),
         ("stack", "layer"), ("transpose", "jvp", "jvp"), True, None),
        # Two genuine nested scopes of one name stay two.
        ("jit(f)/jvp(Block_0)/Block_0/dot_general", ("Block_0", "Block_0"), ("jvp",), False,
         None),
        ("jit(f)/amp_stop/lora/dot_general", ("amp_stop", "lora"), (), False, None),
        # User scopes named as jax's own parts are jax's only where jax writes them: a
        # Linen list attribute self.branch = [...] names branch_0, branch_1, a router
        # "switch", a loop module "while" (each was dropped, and a rule for it
        # matched nothing).
        ("jit(f)/Model/branch_1/dot_general", ("Model", "branch_1"), (), False, None),
        ("jit(f)/Model/switch/dot_general", ("Model", "switch"), (), False, None),
        ("jit(f)/Model/while/dot_general", ("Model", "while"), (), False, None),
        ("jit(f)/switch/branch_2/dot_general", (), (), False, None),
        ("jit(f)/while/body/while/body/dot_general", (), (), False, None),
        # remat re-entered under an outer vmap or jvp keeps the outer transform
        # (per-example gradients, a Hessian-vector product): one Model/enc, not two.
        ("jit(g)/vmap(transpose(jvp(Model)))/vmap(jvp(Model))/checkpoint/enc/dot_general",
         ("Model", "enc"), ("vmap", "transpose", "jvp", "vmap", "jvp"), True, None),
        ("jit(g)/jvp(transpose(jvp(Model)))/jvp(jvp(Model))/enc/dot_general",
         ("Model", "enc"), ("jvp", "transpose", "jvp", "jvp", "jvp"), True, None),
        # ... and under a Hessian (jacfwd of jacrev, whose vmap batches the transposed
        # pass) or jacrev of jacrev: the re-entry drops the transpose and that vmap.
        (("jit(h)/vmap(jvp(vmap(transpose(jvp(enc)))))/vmap(jvp(jvp(enc)))/checkpoint/blk/"
          "dot_general"), ("enc", "blk"),
         ("vmap", "jvp", "vmap", "transpose", "jvp", "vmap", "jvp", "jvp"), True, None),
        ("jit(h)/jvp(vmap(transpose(jvp(enc))))/jvp(jvp(enc))/checkpoint/blk/dot_general",
         ("enc", "blk"), ("jvp", "vmap", "transpose", "jvp", "jvp", "jvp"), True, None),
        # ... but an inner vmap in an outer scope of the same name is two scopes.
        ("jit(f)/vmap(jvp(X))/vmap(X)/dot_general", ("X", "X"), ("vmap", "jvp", "vmap"),
         False, None),
        # A batched while lowers its cond again in the body: "while/body_pred".
        ("jit(s)/vmap(solver)/while/body_pred/dot_general", ("solver",), ("vmap",), False,
         None),
    ],
)
def test_parse_name(name: str, scope: tuple[str, ...], transforms: tuple[str, ...],
                    backward: bool, einsum: str | None) -> None:
    site = parse_name(name)
    assert site.scope == scope
    assert site.transforms == transforms
    assert site.backward is backward
    recomputed = "rematted_computation" in name
    assert site.gradient_pass is (backward and not recomputed)
    assert site.direction == ("recomputed" if recomputed else
                              "backward" if backward else "forward")
    assert site.einsum == einsum
    assert site.name == name
    assert site.scope_path == "/".join(scope)


def test_parse_name_op_kind() -> None:
    assert parse_name("jit(f)/conv1/conv_general_dilated").op_kind == "conv_general_dilated"
    assert parse_name("jit(f)/conv1/conv_general_dilated", "convolution").op_kind == (
        "convolution")
    assert parse_name("").op_kind == ""


@pytest.mark.parametrize(
    ("location", "name", "source"),
    [
        ('loc("jit(f)/dot_general")', "jit(f)/dot_general", None),
        ('loc("a/b"("f.py":3:4))', "a/b", "f.py:3"),
        ('loc("a/b"(callsite("f"("/x/f.py":3:4 to :9) at "<module>"("/x/g.py":1:2))))',
         "a/b", "/x/f.py:3"),
        # A file location is no name.
        ('loc("-":79:3)', "", "-:79"),
        ("loc(unknown)", "", None),
        ('loc("say \\"hi\\""("f.py":1:1))', 'say "hi"', "f.py:1"),
        # MLIR prints a byte that is not printable ASCII as \XX: a UTF-8 name reads
        # back as written (it read "caf\C3\A9", which no scope rule "café" matched).
        ('loc("jit(f)/caf\\C3\\A9/dot_general"("f.py":1:1))', "jit(f)/café/dot_general",
         "f.py:1"),
        # The user's line, past the frames of installed packages (Flax's Dense) ...
        (('loc("a"(callsite("Dense"("/v/site-packages/flax/linear.py":3:4) at '
         '"Model"("/x/model.py":9:2))))'), "a", "/x/model.py:9"),
        # ... unless every frame is in one.
        (('loc("a"(callsite("Dense"("/v/site-packages/flax/linear.py":3:4) at '
         '"f"("/v/dist-packages/g.py":5:2))))'), "a", "/v/site-packages/flax/linear.py:3"),
    ],
)
def test_location_name_and_source(location: str, name: str, source: str | None) -> None:
    assert location_name(location) == name
    assert location_source(location) == source


def test_call_prefix_and_join_names() -> None:
    assert call_prefix("jit(f)/enc/jit(inner)") == "jit(f)/enc"
    assert call_prefix("jit(f)/jvp()/while/body/closed_call") == "jit(f)/jvp()/while/body"
    assert call_prefix("jit(f)/jvp(jit(inner))") == "jit(f)/jvp()"
    assert call_prefix("jit(inner)") == ""
    assert join_names("jit(f)/enc", "mm/dot_general") == "jit(f)/enc/mm/dot_general"
    assert join_names("", "dot_general") == "dot_general"
    assert join_names("jit(f)/enc", "") == "jit(f)/enc"


def test_site_of_joins_prefix_and_keeps_op_kind() -> None:
    with ir.Context() as context, ir.Location.unknown(context):
        location = ir.Location.name("cell/dot_general",
                                    childLoc=ir.Location.file("f.py", 7, 1))
        site = site_of(location, "dot_general", "jit(f)/transpose(jvp())/while/body")
    assert site == Site(scope=("cell",), transforms=("transpose", "jvp"), backward=True,
                        op_kind="dot_general", source="f.py:7",
                        name="jit(f)/transpose(jvp())/while/body/cell/dot_general")


# ---- locations read from their tree, not printed ------------------------------------


def _printed(location: Any) -> tuple[str, str | None]:
    """What ``location_name`` / ``location_source`` parse from the printed location."""
    text = str(location)
    return location_name(text), location_source(text)


def test_location_read_from_its_tree_matches_the_printed_form() -> None:
    def step(w, x):
        with jax.named_scope("Block_0"), jax.named_scope("attn"):
            h = jnp.tanh(x @ w)
        return jnp.sum(jax.lax.scan(lambda c, _: (jnp.sin(c @ w), None), h, None,
                                    length=2)[0])

    text = jax.jit(jax.grad(step)).lower(W, X).as_text(debug_info=True)
    module = parse_module(text)
    ops = walk_operations(module)
    assert len(ops) > 20
    for op in ops:
        assert location_parts(op.location) == _printed(op.location), str(op.location)
        assert location_name(op.location) == _printed(op.location)[0]
        for kind in ("dot_general", "tanh"):
            assert site_of(op.location, kind, "jit(f)/jvp()") == site_of(
                str(op.location), kind, "jit(f)/jvp()")


@pytest.mark.parametrize("make", [
    lambda f, u: u,
    lambda f, u: f,
    lambda f, u: ir.Location.name("a/b/dot_general", childLoc=u),
    lambda f, u: ir.Location.name("", childLoc=u),
    lambda f, u: ir.Location.name("a/b", childLoc=f),
    lambda f, u: ir.Location.name('say "hi"', childLoc=f),  # prints escaped
    lambda f, u: ir.Location.name("caf\u00e9/dot", childLoc=f),  # prints escaped
    lambda f, u: ir.Location.name("a\\b", childLoc=f),
    lambda f, u: ir.Location.name("a:1", childLoc=f),
    lambda f, u: ir.Location.name(":1x", childLoc=f),
    lambda f, u: ir.Location.callsite(ir.Location.name("g", childLoc=u),
                                      [ir.Location.file("c.py", 2, 2)]),
    lambda f, u: ir.Location.name("n", childLoc=ir.Location.callsite(
        ir.Location.name("fn", childLoc=ir.Location.file("x.py", 9, 1, 9, 5)),
        [ir.Location.file("y.py", 1, 1)])),
    lambda f, u: ir.Location.fused([f, ir.Location.file("b.py", 1, 1)]),
    lambda f, u: ir.Location.fused([ir.Location.name("n", childLoc=u),
                                    ir.Location.file("b.py", 1, 1)],
                                   metadata=ir.StringAttr.get("m")),
    lambda f, u: ir.Location.name("n", childLoc=ir.Location.file(":5", 1, 1)),
    lambda f, u: ir.Location.name("n", childLoc=ir.Location.file("", 1, 1)),
    lambda f, u: ir.Location.name("n", childLoc=ir.Location.file("caf\u00e9.py", 1, 1)),
    lambda f, u: ir.Location.name("n", childLoc=ir.Location.callsite(
        ir.Location.file("/v/site-packages/flax/linear.py", 3, 1), [f])),
    lambda f, u: ir.Location.name("n", childLoc=ir.Location.callsite(
        ir.Location.file("/v/site-packages/flax/linear.py", 3, 1),
        [ir.Location.file("/v/dist-packages/g.py", 5, 1)])),
])
def test_location_parts_of_unusual_locations(make) -> None:
    with ir.Context(), ir.Location.unknown():
        location = make(ir.Location.file("a.py", 3, 4), ir.Location.unknown())
        assert location_parts(location) == _printed(location), str(location)
        assert location_name(location) == _printed(location)[0]
