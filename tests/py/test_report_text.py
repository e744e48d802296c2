"""Reports stay readable on real programs (issue 13 item 3).

A WMT-sized Flax encoder-decoder train step (135 matrix ops) must give a text report of
one row per op, with each op's scope and the user's ``file:line`` instead of raw MLIR
location chains, and later passes' per-op notes attached to their op and counted.
"""

from __future__ import annotations

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import hlo_amp
from hlo_amp.passes.dot_layout import RELAID
from hlo_amp.report import Report

THIS_FILE = os.path.basename(__file__)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="wo")(nn.relu(nn.Dense(64, name="wi")(x)))


class _EncoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(4, name="self_attn")(nn.LayerNorm()(x))
        return x + _Mlp(name="mlp")(nn.LayerNorm()(x))


class _DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, y, encoded):
        causal = nn.make_causal_mask(y[..., 0])
        y = y + nn.MultiHeadDotProductAttention(4, name="self_attn")(nn.LayerNorm()(y),
                                                                    mask=causal)
        y = y + nn.MultiHeadDotProductAttention(4, name="cross_attn")(nn.LayerNorm()(y),
                                                                     encoded)
        return y + _Mlp(name="mlp")(nn.LayerNorm()(y))


class _Transformer(nn.Module):
    """The Flax WMT example's shape: shared embedding, 2 encoder and 2 decoder blocks."""

    @nn.compact
    def __call__(self, src, tgt):
        embed = nn.Embed(100, 32, name="shared_embedding")
        x = embed(src)
        for i in range(2):
            x = _EncoderLayer(name=f"encoderblock_{i}")(x)
        y = embed(tgt)
        for i in range(2):
            y = _DecoderLayer(name=f"encoderdecoderblock_{i}")(y, x)
        return embed.attend(nn.LayerNorm()(y))


@pytest.fixture(scope="module", params=["bf16", "mixed_bfloat16"])
def wmt_report(request) -> Report:
    model, tx = _Transformer(), optax.adam(1e-3)
    src = jnp.ones((4, 12), jnp.int32)
    tgt = jnp.ones((4, 10), jnp.int32)
    # Initialised abstractly: the report reads the compiled module, not the values.
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), src, tgt)

    def step(params, opt_state, src, tgt):
        def loss(p):
            logits = model.apply(p, src, tgt)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    compiled = hlo_amp.compile(step, request.param).lower(
        params, jax.eval_shape(tx.init, params), src, tgt).compile()
    return compiled.report()


def test_wmt_report_is_one_row_per_op_without_location_chains(wmt_report):
    text = str(wmt_report)
    assert len(wmt_report.decisions) == 135
    assert "loc(" not in text and "callsite" not in text
    lines = text.splitlines()
    # A header, a rule, one row per op, then a few summary lines (the mixed_* mode adds
    # one line per op kind it propagated through): a few screens, not 100 KB.
    assert len(lines) <= 135 + 2 + 50, len(lines)
    assert max(len(line) for line in lines) <= 220
    assert len(text) < 40_000, len(text)


def test_rows_name_the_scope_and_the_users_line(wmt_report):
    text = str(wmt_report)
    for decision in wmt_report.decisions:
        # The first frame outside installed packages: this file, not Flax's Dense.
        assert decision.source and decision.source.rsplit("/", 1)[-1].startswith(
            THIS_FILE + ":"), decision.source
    rows = text.splitlines()[2:2 + len(wmt_report.decisions)]
    assert all(THIS_FILE + ":" in row for row in rows)
    assert sum("encoderdecoderblock_1/cross_attn/query" in row for row in rows) == 3


def test_per_op_notes_attach_to_their_op_and_are_counted(wmt_report):
    noted = [d for d in wmt_report.decisions if any(n.startswith(RELAID) for n in d.notes)]
    assert noted, "XLA:CPU relays some of this model's dots"
    # Attached to ops, never left over as report-level notes keyed by a location.
    assert not any(RELAID in note for note in wmt_report.notes)
    # Each relaid op is noted once, on its own decision (found by its mark, not its name).
    assert all(sum(n.startswith(RELAID) for n in d.notes) == 1 for d in noted)
    assert f"{len(noted)} op(s): {RELAID} (per op in to_json())" in str(wmt_report)
    # The JSON keeps every detail: each note with its permutation, each full location.
    data = json.loads(wmt_report.to_json())
    notes = [n for d in data["decisions"] for n in d["notes"] if n.startswith(RELAID)]
    assert len(notes) == len(noted) and all(" -> " in n for n in notes)
    assert all(d["location"].startswith("jit(step)/") for d in data["decisions"])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "fp8", "bf16"])
def test_each_decisions_types_are_the_rewritten_modules(policy):
    """The report's operand and result types are the module's after every pass: compiled
    for an H100 the fast mode stores matrix-op results in 16 bit, which the report gave
    as f32 ('bf16xbf16->f32', fp8 '... f32 result'); ``changed`` says whether they
    moved."""
    import re
    from collections import Counter

    def loss(ws, x):
        x = jnp.tanh(x.astype(jnp.bfloat16) @ ws[0].astype(jnp.bfloat16)).astype(jnp.float32)
        for w in ws[1:]:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    ws = [jnp.ones((32, 32)) * 0.1] * 3
    lowered = hlo_amp.compile(jax.grad(loss), policy).lower_for("h100", ws, jnp.ones((16, 32)))
    dots = re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\)"
                      r" -> tensor<[\dx]*x(\w+)>", lowered.as_text())
    decisions = lowered.report().decisions
    assert Counter(dots) == Counter((*d.operands_after, d.result_after) for d in decisions)
    for d in decisions:
        moved = d.operands_after != d.operands_before or d.result_after != d.result_before
        assert d.changed == moved, d
    if policy != "bf16":  # the fast mode: every result 16-bit
        assert {d.result_after for d in decisions} == {"bf16"}


def test_the_json_holds_every_field_of_the_report():
    """``to_json()`` is the report a tool reads: every field is in it (the rule lists
    only as ``unused_rules``). It lacked xla_target, xla_fp8_note, fp8_state_columns
    and xla_checked."""
    import dataclasses

    lowered = hlo_amp.compile(lambda x, w: x @ w, "fp8,first_matrix_op=none").lower(
        jnp.ones((32, 32)), jnp.ones((32, 32)))
    report = lowered.compile().report()
    data = json.loads(report.to_json())
    fields = {f.name for f in dataclasses.fields(Report)} - {"rules", "rules_used"}
    assert fields <= set(data), fields - set(data)
    assert data["xla_checked"] is True and data["xla_target"] == "cpu"
    assert data["xla_fp8_note"] == report.xla_fp8_note != ""
