"""Loop-invariant converts (passes/cleanup.py): a scan RNN's weight convert runs once.

In ``jax.lax.scan`` the weights are a while carry the body returns unchanged, and the
step is a private function called from the body, so without hoisting the weights are
converted to 16 bit on every step. With it, the convert runs once before each loop and
the loops carry the 16-bit copy. The counts here are of ``stablehlo.convert`` ops in a
while body and in the functions it calls, and of ``convert`` instructions in a while
body computation of XLA's optimized HLO and in the computations it calls.

Measured on XLA:CPU (jax 0.10.2): XLA's own ``while-loop-invariant-code-motion`` pass
already hoists the weight convert when we do not (the optimized HLO has the same
per-step counts either way), so the XLA assertions are that hoisting never adds a
convert, and that with XLA's pass disabled the body computations run fewer.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib.mlir.dialects import hlo

import hlo_amp
import hlo_amp.passes as passes_module
from hlo_amp.ir.modules import (
    callee_name,
    function_name,
    functions,
    is_call,
    parse_module,
    walk_ops,
)
from hlo_amp.passes import default_pipeline, run_pipeline
from hlo_amp.passes.cleanup import CleanupConverts
from hlo_amp.policy import Policy

POLICIES = ("bf16", "mixed_bfloat16")


def rnn_loss(w: jax.Array, xs: jax.Array) -> jax.Array:
    def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        with jax.named_scope("cell"):
            h = jnp.tanh(h @ w + x)
        return h, None

    h, _ = jax.lax.scan(step, jnp.zeros((xs.shape[1], w.shape[0])), xs)
    return jnp.sum(h)


def nested_scan_loss(w: jax.Array, xs: jax.Array) -> jax.Array:
    def outer(h: jax.Array, seq: jax.Array) -> tuple[jax.Array, None]:
        def inner(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(h @ w + x), None

        return jax.lax.scan(inner, h, seq)[0], None

    h, _ = jax.lax.scan(outer, jnp.zeros((xs.shape[2], w.shape[0])), xs)
    return jnp.sum(h)


def _args(*xs_shape: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return (jax.random.normal(k1, (32, 32)) / 6,
            jax.random.normal(k2, (*xs_shape, 32)))


_DEFAULT_PIPELINE = default_pipeline  # the real one, while tests patch the module's


def _without_hoisting(policy: Policy, target: str | None = None) -> list:
    """The default pipeline with its CleanupConverts not hoisting."""
    return [dataclasses.replace(p, hoist_loop_invariants=False)
            if isinstance(p, CleanupConverts) else p
            for p in _DEFAULT_PIPELINE(policy, target)]


# ---- counting ---------------------------------------------------------------------


def stablehlo_body_converts(text: str) -> list[int]:
    """Per while op (program order): converts in its body and the functions it calls."""
    module = parse_module(text)
    by_name = {function_name(fn): fn for fn in functions(module)}

    def in_region(region) -> list:
        ops = []
        for block in region.blocks:
            for op in block.operations:
                ops.append(op)
                for inner in op.operation.regions:
                    ops.extend(in_region(inner))
        return ops

    def count(ops, seen: set[str]) -> int:
        total = 0
        for op in ops:
            total += isinstance(op, hlo.ConvertOp)
            if is_call(op) and callee_name(op) not in seen:
                seen.add(callee_name(op))
                total += count(walk_ops(by_name[callee_name(op)]), seen)
        return total

    return [count(in_region(loop.operation.regions[1]), set())
            for fn in functions(module) for loop in walk_ops(fn)
            if isinstance(loop, hlo.WhileOp)]


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CONVERT = re.compile(r"=\s*\S+\s+convert\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_WHILE_BODY = re.compile(r"\swhile\(.*?\bbody=%?([\w.\-]+)")


def xla_body_converts(hlo_text: str) -> list[int]:
    """Per while instruction: convert instructions in its body computation and in the
    computations that calls (fusions, nested loops)."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)

    def count(name: str, seen: set[str]) -> int:
        if name in seen or name not in computations:
            return 0
        seen.add(name)
        return sum(bool(_CONVERT.search(line))
                   + sum(count(called, seen) for called in _CALLED.findall(line))
                   for line in computations[name])

    bodies = _WHILE_BODY.findall(hlo_text)
    assert bodies, "no while loop in XLA's optimized HLO"
    return [count(body, set()) for body in bodies]


# ---- tests --------------------------------------------------------------------------


def _compile_both(fn, policy, args, monkeypatch):
    hoisted = hlo_amp.compile(fn, policy)
    hoisted_lowered = hoisted.lower(*args)
    with monkeypatch.context() as patch:
        patch.setattr(passes_module, "default_pipeline", _without_hoisting)
        plain = hlo_amp.compile(fn, policy)
        plain_lowered = plain.lower(*args)
        plain_out = plain(*args)
    return hoisted, hoisted_lowered, plain_lowered, plain_out


@pytest.mark.parametrize("policy", POLICIES)
def test_scan_rnn_results_bit_identical_and_fewer_converts_per_step(policy, monkeypatch):
    args = _args(8, 4)
    fn = jax.value_and_grad(rnn_loss)
    hoisted, lowered, plain_lowered, plain_out = _compile_both(fn, policy, args, monkeypatch)

    # (a) A hoisted convert computes the same value: loss and gradient bit for bit.
    got = hoisted(*args)
    for g, p in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(plain_out)):
        assert g.dtype == p.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(p))
    # ... and it is still the f32 program, within bf16 tolerance.
    want = jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        error, scale = float(np.max(np.abs(g - w))), float(np.max(np.abs(w)))
        assert error <= 1e-5 + 1.6e-2 * scale, (error, scale)

    # (b) StableHLO: the forward and the backward loop each convert the weights once
    # per step less; nothing else in the bodies changes.
    before = stablehlo_body_converts(plain_lowered.as_text())
    after = stablehlo_body_converts(lowered.as_text())
    assert len(before) == len(after) == 2
    assert after == [n - 1 for n in before], (before, after)
    text = lowered.as_text()
    assert re.search(r"= stablehlo\.convert %arg0 : \(tensor<32x32xf32>\) -> "
                     r"tensor<32x32xbf16>\n\s*%\S+ = stablehlo\.while", text), text
    assert any("hoisted 2 loop-invariant convert(s)" in note
               for note in lowered.report().notes), lowered.report().notes

    # (c) XLA's optimized HLO: XLA hoists the weight convert itself, so hoisting first
    # must never leave more converts per step than not hoisting.
    xla_after = xla_body_converts(lowered.compile().as_text())
    xla_before = xla_body_converts(plain_lowered.compile().as_text())
    assert len(xla_after) == len(xla_before) == 2
    assert all(a <= b for a, b in zip(xla_after, xla_before)), (xla_before, xla_after)


@pytest.mark.parametrize("policy", POLICIES)
def test_xla_without_its_own_hoisting_runs_fewer_converts_per_step(policy, monkeypatch):
    """With XLA's while-loop-invariant-code-motion disabled, our hoisting is what keeps
    the weight convert out of both loops' body computations."""
    args = _args(8, 4)
    fn = jax.value_and_grad(rnn_loss)
    _, lowered, plain_lowered, plain_out = _compile_both(fn, policy, args, monkeypatch)
    options = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
    compiled = lowered.jax_lowered.compile(compiler_options=options)
    plain = plain_lowered.jax_lowered.compile(compiler_options=options)
    after, before = xla_body_converts(compiled.as_text()), xla_body_converts(plain.as_text())
    assert len(after) == len(before) == 2
    assert all(a < b for a, b in zip(after, before)), (before, after)
    for g, p in zip(jax.tree_util.tree_leaves(compiled(*args)),
                    jax.tree_util.tree_leaves(plain_out)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(p))


def test_nested_scan_converts_the_weights_once(monkeypatch):
    """A scan in a scan: the convert leaves both loops (and both step functions)."""
    args = _args(2, 3, 4)
    hoisted, lowered, plain_lowered, plain_out = _compile_both(
        nested_scan_loss, "bf16", args, monkeypatch)
    np.testing.assert_array_equal(np.asarray(hoisted(*args)), np.asarray(plain_out))
    # Outer loop (its body calls the step that holds the inner loop), then inner loop.
    assert stablehlo_body_converts(plain_lowered.as_text()) == [2, 2]
    assert stablehlo_body_converts(lowered.as_text()) == [1, 1]


def test_flag_off_leaves_loops_alone():
    """``CleanupConverts(hoist_loop_invariants=False)`` is the pipeline without the step."""
    args = _args(8, 4)
    text = jax.jit(rnn_loss).lower(*args).as_text()
    policy = Policy.parse("bf16")
    counts = {}
    for hoist in (True, False):
        module = parse_module(text)
        passes = [dataclasses.replace(p, hoist_loop_invariants=hoist)
                  if isinstance(p, CleanupConverts) else p for p in default_pipeline(policy)]
        report = run_pipeline(module, policy, passes=passes)
        counts[hoist] = stablehlo_body_converts(str(module))
        assert any("hoisted" in note for note in report.notes) == hoist, report.notes
    assert counts == {True: [1], False: [2]}
