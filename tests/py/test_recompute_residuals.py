"""RecomputeResiduals (passes/recompute_residuals.py): on GPU the mixed modes' backward
pass recomputes a batch norm's f32 ``2 * (x - mean)`` from the 16-bit ``x``: the same
values (to f32 rounding), and only there. The memory it saves is asserted by
test_memory_vs_hand_cast.py."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hlo_amp
from hlo_amp.ir.modules import copy_module, module_text
from hlo_amp.jax_internals import swap_module
from hlo_amp.passes import default_pipeline, run_pipeline
from hlo_amp.passes.recompute_residuals import RecomputeResiduals
from hlo_amp.policy import Policy
from hlo_amp.targets import as_target


def _batch_norm_step(w, x):
    """A dense layer, a batch norm whose variance is ``jnp.var`` (as Keras's moments),
    a loss; the value and the weight gradient."""

    def loss(w):
        h = x @ w
        mean = h.mean(0, keepdims=True)
        y = (h - mean) * jax.lax.rsqrt(jnp.var(h, 0, keepdims=True) + 1e-3)
        return jnp.mean(jnp.tanh(y) ** 2)

    return jax.value_and_grad(loss)(w)


def _gpu_form(lowered, policy: Policy, recompute: bool, target: str = "gpu"):
    """The module in the GPU form of ``policy``, with or without the pass; its report."""
    module = copy_module(lowered.compiler_ir("stablehlo"))
    passes = [p for p in default_pipeline(policy, target)
              if recompute or not isinstance(p, RecomputeResiduals)]
    report = run_pipeline(module, policy, passes=passes)
    return module, report


@pytest.mark.parametrize("mode", ["mixed_bfloat16", "mixed_float16"])
def test_recomputed_residual_gives_the_same_values(mode):
    policy = Policy.parse(mode)
    keys = jax.random.split(jax.random.key(0), 2)
    args = (jax.random.normal(keys[0], (32, 64)), jax.random.normal(keys[1], (64, 32)) + 3.0)
    lowered = jax.jit(_batch_norm_step).lower(*args)
    stored, _ = _gpu_form(lowered, policy, recompute=False)
    recomputed, report = _gpu_form(lowered, policy, recompute=True)
    assert any(note.startswith("recompute-residuals: ") for note in report.notes)
    text = module_text(recomputed)
    assert text.count("stablehlo.optimization_barrier") > module_text(stored).count(
        "stablehlo.optimization_barrier")
    # XLA:CPU computes a dot with a 16-bit result in f32 and, allowed excess precision,
    # folds the round trip through 16 bit away where the f32 value is stored, not where
    # the barrier reads the 16-bit value: compiled as written, both compute the same
    # values, up to the order XLA's fusions sum in (f32 rounding, far below 16 bit's).
    exact = {"xla_allow_excess_precision": False}
    want = swap_module(lowered, stored).compile(exact)(*args)
    got = swap_module(lowered, recomputed).compile(exact)(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(a)).max()))


def test_only_gpu_and_the_mixed_modes_recompute():
    args = (jnp.ones((32, 64)), jnp.ones((64, 32)))
    lowered = jax.jit(_batch_norm_step).lower(*args)
    for mode, target in [("bf16", "gpu"), ("mixed_bfloat16", "tpu"),
                         ("mixed_bfloat16", "cpu"), ("mixed_bfloat16", None)]:
        policy = Policy.parse(mode)
        assert not any(isinstance(p, RecomputeResiduals)
                       for p in default_pipeline(policy, target)), (mode, target)
        module = copy_module(lowered.compiler_ir("stablehlo"))
        RecomputeResiduals(policy, as_target(target)).run(module)
        assert "optimization_barrier" not in module_text(module), (mode, target)


def _scanned_swiglu_step(blocks, x):
    """A stack of pre-norm SwiGLU blocks, scanned without remat: the forward loop stacks
    each layer's residuals for the backward loop. The loss and its gradients."""

    def block(h, p):
        w_gate, w_up, w_down = p
        normed = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)
        return h + (jax.nn.silu(normed @ w_gate) * (normed @ w_up)) @ w_down, None

    def loss(blocks):
        out, _ = jax.lax.scan(block, x, blocks)
        return jnp.mean(out ** 2)

    return jax.value_and_grad(loss)(blocks)



def test_stacked_residuals_are_recomputed_in_the_backward_loop():
    """The SwiGLU's silu keeps its logistic in f32 from the 16-bit gate, and the scan's
    forward loop stacked three f32 values of it for the backward loop (issue 48: 1.054
    times the hand cast's temp on 8 H100s); the backward loop now makes them again from
    the gate's 16-bit stack. Same values; XLA then drops the unread stacks."""
    policy = Policy.parse("mixed_bfloat16")
    keys = jax.random.split(jax.random.key(1), 4)
    layers, dim, hidden = 3, 64, 128
    blocks = tuple(jax.random.normal(k, shape) * 0.1 for k, shape in zip(
        keys[:3], [(layers, dim, hidden), (layers, dim, hidden), (layers, hidden, dim)]))
    x = jax.random.normal(keys[3], (32, dim))
    lowered = jax.jit(_scanned_swiglu_step).lower(blocks, x)
    stored, _ = _gpu_form(lowered, policy, recompute=False)
    recomputed, report = _gpu_form(lowered, policy, recompute=True)
    notes = [note for note in report.notes if "stacks for its backward loop" in note]
    assert notes and int(notes[0].split(": ")[1].split()[0]) >= 3, report.notes
    exact = {"xla_allow_excess_precision": False}
    stored_step = swap_module(lowered, stored).compile(exact)
    recomputed_step = swap_module(lowered, recomputed).compile(exact)
    want, got = stored_step(blocks, x), recomputed_step(blocks, x)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(a)).max()))
    temp = lambda step: step.memory_analysis().temp_size_in_bytes
    assert temp(recomputed_step) < temp(stored_step), (temp(recomputed_step),
                                                       temp(stored_step))


STACKED_LIT = (Path(__file__).parents[1] / "lit" / "stacked_residuals.mlir").read_text()


def _gpu_pass_text(text: str) -> str:
    """``text`` parsed, RecomputeResiduals run on it for GPU in mixed_bfloat16, verified,
    printed."""
    from hlo_amp.ir.modules import new_context, parse_module

    with new_context():
        module = parse_module(text)
        RecomputeResiduals(Policy.parse("mixed_bfloat16"), as_target("gpu")).run(module)
        module.operation.verify()
        return module_text(module)


def test_a_stack_the_loop_does_not_fill_stays_stored():
    """tests/lit/stacked_residuals.mlir's loops, with the forward loop running 2 of the
    stacks' 3 positions: the third holds the stacks' initial values, which the residual's
    ops do not make from the 16-bit stack's, so the residual stays stored."""
    for limit, recomputed in [("3", True), ("2", False)]:
        text = STACKED_LIT.replace("%c3 = stablehlo.constant dense<3>",
                                   f"%c3 = stablehlo.constant dense<{limit}>")
        assert _gpu_pass_text(text).count("stablehlo.logistic") == 1 + recomputed, limit


_STATISTIC_MODULE = """
module @m{attributes} {{
  func.func public @main(%arg0: tensor<3x4xbf16>, %arg1: tensor<3x1xf32>) -> tensor<4xf32> {{
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %z = stablehlo.constant dense<0.0> : tensor<4xf32>
    %xz = stablehlo.constant dense<0.0> : tensor<3x4xbf16>
    %sz = stablehlo.constant dense<0.0> : tensor<3x1xf32>
    %rz = stablehlo.constant dense<0.0> : tensor<3x4xf32>
    %f:4 = stablehlo.while(%i = %c0, %xs = %xz, %ss = %sz, %rs = %rz) : tensor<i32>, tensor<3x4xbf16>, tensor<3x1xf32>, tensor<3x4xf32>
     cond {{
      %lt = stablehlo.compare LT, %i, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    }} do {{
      %x1 = stablehlo.dynamic_slice %arg0, %i, %c0, sizes = [1, 4] : (tensor<3x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<1x4xbf16>
      %x = stablehlo.reshape %x1 : (tensor<1x4xbf16>) -> tensor<4xbf16>
      %s1 = stablehlo.dynamic_slice %arg1, %i, %c0, sizes = [1, 1] : (tensor<3x1xf32>, tensor<i32>, tensor<i32>) -> tensor<1x1xf32>
      %s = stablehlo.reshape %s1 : (tensor<1x1xf32>) -> tensor<1xf32>
      %x32 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
      %sb = stablehlo.broadcast_in_dim %s, dims = [0] : (tensor<1xf32>) -> tensor<4xf32>
      %r = stablehlo.multiply %x32, %sb : tensor<4xf32>
      %xu = stablehlo.reshape %x : (tensor<4xbf16>) -> tensor<1x4xbf16>
      %xs2 = stablehlo.dynamic_update_slice %xs, %xu, %i, %c0 : (tensor<3x4xbf16>, tensor<1x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<3x4xbf16>
      %su = stablehlo.reshape %s : (tensor<1xf32>) -> tensor<1x1xf32>
      %ss2 = stablehlo.dynamic_update_slice %ss, %su, %i, %c0 : (tensor<3x1xf32>, tensor<1x1xf32>, tensor<i32>, tensor<i32>) -> tensor<3x1xf32>
      %ru = stablehlo.reshape %r : (tensor<4xf32>) -> tensor<1x4xf32>
      %rs2 = stablehlo.dynamic_update_slice %rs, %ru, %i, %c0 : (tensor<3x4xf32>, tensor<1x4xf32>, tensor<i32>, tensor<i32>) -> tensor<3x4xf32>
      %i2 = stablehlo.add %i, %c1 : tensor<i32>
      stablehlo.return %i2, %xs2, %ss2, %rs2 : tensor<i32>, tensor<3x4xbf16>, tensor<3x1xf32>, tensor<3x4xf32>
    }}
    %b:5 = stablehlo.while(%j = %c0, %g = %z, %xs = %f#1, %ss = %f#2, %rs = %f#3) : tensor<i32>, tensor<4xf32>, tensor<3x4xbf16>, tensor<3x1xf32>, tensor<3x4xf32>
     cond {{
      %lt = stablehlo.compare LT, %j, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    }} do {{
      %x1 = stablehlo.dynamic_slice %xs, %j, %c0, sizes = [1, 4] : (tensor<3x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<1x4xbf16>
      %x = stablehlo.reshape %x1 : (tensor<1x4xbf16>) -> tensor<4xbf16>
      %s1 = stablehlo.dynamic_slice %ss, %j, %c0, sizes = [1, 1] : (tensor<3x1xf32>, tensor<i32>, tensor<i32>) -> tensor<1x1xf32>
      %s = stablehlo.reshape %s1 : (tensor<1x1xf32>) -> tensor<1xf32>
      %r1 = stablehlo.dynamic_slice %rs, %j, %c0, sizes = [1, 4] : (tensor<3x4xf32>, tensor<i32>, tensor<i32>) -> tensor<1x4xf32>
      %r = stablehlo.reshape %r1 : (tensor<1x4xf32>) -> tensor<4xf32>
      %x32 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
      %sb = stablehlo.broadcast_in_dim %s, dims = [0] : (tensor<1xf32>) -> tensor<4xf32>
      %gx = stablehlo.multiply %r, %sb : tensor<4xf32>
      %gy = stablehlo.multiply %gx, %x32 : tensor<4xf32>
      %g2 = stablehlo.add %g, %gy : tensor<4xf32>
      %j2 = stablehlo.add %j, %c1 : tensor<i32>
      stablehlo.return %j2, %g2, %xs, %ss, %rs : tensor<i32>, tensor<4xf32>, tensor<3x4xbf16>, tensor<3x1xf32>, tensor<3x4xf32>
    }}
    return %b#1 : tensor<4xf32>
  }}
}}
"""


def test_a_stacked_statistic_is_a_leaf_only_where_nothing_partitions_the_module():
    """A residual made from a stacked 16-bit value and a stacked statistic (a norm's
    output and its per-row scale) is recomputed on one device; in a partitioned module it
    stays stored: there XLA's partitioner may make the copy at another layout and gather
    the statistic for it (issue 48's one KV head split over TP, two gathers over fsdp the
    hand cast does not have)."""
    for attributes, recomputed in [("", True),
                                   (" attributes {mhlo.num_partitions = 2 : i32}", False)]:
        text = _gpu_pass_text(_STATISTIC_MODULE.format(attributes=attributes))
        products = text.count("stablehlo.multiply")
        assert products == 3 + recomputed, (attributes, products)


def test_a_call_is_made_again_only_when_its_function_only_makes_constants():
    """The residual of tests/lit/stacked_residuals.mlir scaled by what a call without
    operands returns: made again in the backward loop when the function returns a
    constant (as jax's ``silu()`` does), stored when it has an effect (a custom call
    with side effects would run twice)."""
    source = STACKED_LIT.replace(
        "%r = stablehlo.logistic %x32 : tensor<4xf32>",
        "%e = func.call @scale() : () -> tensor<4xf32>\n"
        "    %r = stablehlo.multiply %x32, %e : tensor<4xf32>")
    bodies = {
        True: "%c = stablehlo.constant dense<2.0> : tensor<4xf32>",
        False: '%c = stablehlo.custom_call @effect() {has_side_effect = true} : () -> '
               'tensor<4xf32>'}
    for recomputed, body in bodies.items():
        text = source + ("func.func private @scale() -> tensor<4xf32> {\n"
                         f"  {body}\n  return %c : tensor<4xf32>\n}}\n")
        calls = _gpu_pass_text(text).count("call @scale()")
        assert calls == 1 + recomputed, (body, calls)


def test_a_read_through_a_helper_counts_only_when_the_helper_only_reads():
    """The backward loop of tests/lit/stacked_residuals.mlir reads the 16-bit stack
    through a private function, as jax's ``dynamic_index_in_dim``: a slice and its
    reshape, so the residual is made from it; a helper that also doubles the slice does
    not read the stack's value, and the residual stays stored (made from the doubled
    value, it would be wrong)."""
    source = STACKED_LIT
    read = ("%xsl = stablehlo.dynamic_slice %xs2, %j, %c0, sizes = [1, 4] : (tensor<3x4xbf16>, "
            "tensor<i32>, tensor<i32>) -> tensor<1x4xbf16>\n"
            "    %x = stablehlo.reshape %xsl : (tensor<1x4xbf16>) -> tensor<4xbf16>")
    assert read in source
    source = source.replace(read, "%x = func.call @read(%xs2, %j) : (tensor<3x4xbf16>, "
                                  "tensor<i32>) -> tensor<4xbf16>")
    helper = ("func.func private @read(%s: tensor<3x4xbf16>, %i: tensor<i32>) -> "
              "tensor<4xbf16> {{\n"
              "  %z = stablehlo.constant dense<0> : tensor<i32>\n"
              "  %d = stablehlo.dynamic_slice %s, %i, %z, sizes = [1, 4] : "
              "(tensor<3x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<1x4xbf16>\n"
              "  %r = stablehlo.reshape %d : (tensor<1x4xbf16>) -> tensor<4xbf16>\n"
              "  {extra}return {out} : tensor<4xbf16>\n}}\n")
    for recomputed, extra, out in [
            (True, "", "%r"),
            (False, "%t = stablehlo.add %r, %r : tensor<4xbf16>\n  ", "%t")]:
        text = _gpu_pass_text(source + helper.format(extra=extra, out=out))
        assert text.count("stablehlo.logistic") == 1 + recomputed, extra


def test_a_residual_made_from_a_jitted_blocks_output_is_recomputed():
    """A transformer block as a jitted function, layer norms in it and on its output:
    the block's call was rebuilt to return a statistic, and a recipe outside it read the
    old call's result (the pass failed: StopIteration, review h115)."""
    def norm(x, g):
        m = x.mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    @jax.jit
    def block(p, x):
        t, d = x.shape[1:]
        q, k, v = jnp.split(norm(x, p["g"]) @ p["qkv"], 3, -1)
        s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(d)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v) @ p["o"]
        return x + jax.nn.gelu(norm(x, p["g"]) @ p["f1"]) @ p["f2"]

    def loss(p, tokens, labels):
        logits = norm(block(p, p["emb"][tokens]), p["g"]) @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    shapes = {"emb": (64, 32), "qkv": (32, 96), "o": (32, 32), "f1": (32, 128),
              "f2": (128, 32), "head": (32, 64)}
    p = {n: jax.random.normal(jax.random.key(i), s) * 0.1
         for i, (n, s) in enumerate(shapes.items())}
    p["g"] = jnp.ones(32)
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 64)
    lowered = hlo_amp.compile(jax.grad(loss), "mixed_bfloat16").lower(
        p, tokens, tokens, target="h100")
    assert any(note.startswith("recompute-residuals: ") for note in lowered.report().notes)
