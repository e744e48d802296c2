"""Under fp8 an attention the fused-attention pass finds but does not fuse (here: compiled
for CPU) keeps its matmuls, forward and backward, in the 16-bit compute type, as the
fused kernel runs them, while the projections around it are fp8 GEMMs; a scope rule asks
for fp8 attention, and without the fused-attention pass (``fuse_attention=false``) the
attention's matmuls are plain dots under the op rules (tests/lit/fused_attention.mlir
has the IR)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp
from hlo_amp.passes.insert_converts.plan import ATTENTION_FALLBACK

B, T, D, HEADS = 2, 32, 64, 2  # every m, k, n of the step at least 16
ALL = "first_matrix_op=none,last_matrix_op=none"
ATTENTION_EINSUMS = ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")


def _step(p: dict, x: jax.Array):
    def loss(p: dict, x: jax.Array) -> jax.Array:
        q, k, v = ((x @ p[n]).reshape(B, T, HEADS, D // HEADS) for n in ("wq", "wk", "wv"))
        with jax.named_scope("attn"):
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
            out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return jnp.mean((out.reshape(B, T, D) @ p["wo"] - 1.0) ** 2)

    value, grads = jax.value_and_grad(loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, grads), value


def _args() -> tuple[dict, jax.Array]:
    rng = np.random.default_rng(3)
    p = {n: jnp.asarray(rng.standard_normal((D, D)) / 8, jnp.float32)
         for n in ("wq", "wk", "wv", "wo")}
    return p, jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)


def _dots(policy: str) -> tuple[list, list]:
    """The step's dot_general decisions under ``policy``: (attention's, the others)."""
    report = hlo_amp.compile(_step, policy).lower(*_args()).report()
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    attention = [d for d in dots if any(e in d.location for e in ATTENTION_EINSUMS)]
    return attention, [d for d in dots if d not in attention]


def _assert_attention_16_bit_projections_fp8(report) -> None:
    """Every matmul of the attention's einsums (six at least) 16-bit, some other dot fp8."""
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    attention = [d for d in dots if any(e in d.location for e in ATTENTION_EINSUMS)]
    assert len(attention) >= 6, [d.location for d in dots]
    assert all(not d.fp8 for d in attention), [
        (d.direction, d.location[-60:]) for d in attention if d.fp8]
    assert any(d.fp8 for d in dots if d not in attention)


def test_an_unfused_attention_stays_16_bit_between_fp8_projections():
    attention, projections = _dots(f"fp8,{ALL}")
    # Scores and output forward; dQ, dK, dV and dP backward.
    assert len(attention) == 6
    assert all(not d.fp8 and tuple(d.operands_after) == ("bf16", "bf16") for d in attention)
    assert all(ATTENTION_FALLBACK in d.reason for d in attention)
    # The four projections and their weight gradients, and the output projection's
    # input gradient (x takes none).
    assert len(projections) == 9 and all(d.fp8 for d in projections)


def _refused_step(form: str):
    """Attention the pass finds and refuses for a reason of its own, before the target's:
    the site's matmuls were never marked attention's and went fp8 (P·V with e4m3
    probabilities; hunt h93)."""
    def attend(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        if form == "softcap":  # Gemma-2's: 'the scores pass through tanh'
            scores = 30.0 * jnp.tanh(scores / 30.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)

    inner = jax.jit(attend) if form == "inner_jit" else attend

    def layer(x, w):
        q, k, v = ((x @ w[n]).reshape(B, T, HEADS, D // HEADS) for n in range(3))
        return x + inner(q, k, v).reshape(B, T, D) @ w[3], None

    def loss(w, x):
        if form == "scan_without_checkpoint":  # its backward in the backward loop's body
            return jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2)
        return jnp.mean(layer(x, w[0])[0] ** 2)

    return jax.grad(loss)


@pytest.mark.parametrize("form", ["softcap", "inner_jit", "scan_without_checkpoint"])
def test_a_refused_attention_stays_16_bit(form):
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 4, D, D)) / 8, jnp.float32)
    _, x = _args()
    report = hlo_amp.compile(_refused_step(form), f"fp8,{ALL}").lower(w, x).report()
    assert report.attention and not any(s.fused for s in report.attention)
    assert "CPU" not in report.attention[0].reason  # refused before the target says
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    attention = [d for d in dots if any(e in d.location for e in ATTENTION_EINSUMS)]
    assert len(attention) == 6, [d.location for d in dots]
    assert all(not d.fp8 and ATTENTION_FALLBACK in d.reason for d in attention)
    assert all(d.fp8 for d in dots if d not in attention)


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("saved", ["scores", "probabilities", "exponential"])
def test_an_attention_refused_as_saved_by_a_remat_policy_stays_16_bit(saved, scanned):
    """A jax.checkpoint policy that saves the scores (dots_saveable) or the probabilities
    (save_only_these_names): the site is refused as saved, and only the scores' matmul
    came with the refusal; P·V read e4m3 probabilities and the backward's matmuls went
    fp8 (with the probabilities saved the forward site was not even listed; hunt h108).
    everything_saveable saves the exponential and its sum; in a scan of checkpointed
    layers the backward loop's recomputed P·V is found by its name (review h111)."""
    from jax.ad_checkpoint import checkpoint_name

    def attend(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        probabilities = checkpoint_name(jax.nn.softmax(scores, axis=-1), "probs")
        return jnp.einsum("bhqk,bkhd->bqhd", probabilities, v)

    policy = {"scores": jax.checkpoint_policies.dots_saveable,
              "probabilities": jax.checkpoint_policies.save_only_these_names("probs"),
              "exponential": jax.checkpoint_policies.everything_saveable}[saved]

    def layer(x, w):
        q, k, v = ((x @ w[n]).reshape(B, T, HEADS, D // HEADS) for n in range(3))
        return x + attend(q, k, v).reshape(B, T, D) @ w[3]

    checkpointed = jax.checkpoint(layer, policy=policy)

    def loss(w, x):
        if scanned:
            return jnp.mean(jax.lax.scan(lambda h, w: (checkpointed(h, w), None), x, w)[0]
                            ** 2)
        return jnp.mean(checkpointed(x, w[0]) ** 2)

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 4, D, D)) / 8, jnp.float32)
    _, x = _args()
    report = hlo_amp.compile(jax.grad(loss), f"fp8,{ALL}").lower(w, x).report()
    assert report.attention and not any(s.fused for s in report.attention)
    said = "softmax's exponential and its sum" if saved == "exponential" else saved
    assert any(f"the {said} are saved for the backward pass" in s.reason
               for s in report.attention), [s.reason for s in report.attention]
    _assert_attention_16_bit_projections_fp8(report)


@pytest.mark.parametrize("scanned", [False, True])
def test_a_saved_attention_stays_16_bit_beside_a_fused_one(scanned):
    """The same attention code saved by a remat policy in one layer (refused) and plain
    in another (fused for an H100): the fused site's discarded matmuls, still in the
    module, counted as other forward matmuls of the saved site's names, and two to four
    of its backward matmuls went fp8 (review h112)."""
    def attend(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)

    def layer(x, w):
        q, k, v = ((x @ w[n]).reshape(B, T, HEADS, D // HEADS) for n in range(3))
        return x + attend(q, k, v).reshape(B, T, D) @ w[3]

    saved = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable if scanned
                           else jax.checkpoint_policies.everything_saveable)

    def loss(w, x):
        if scanned:
            x = jax.lax.scan(lambda h, w: (saved(h, w), None), x, w[:2])[0]
        else:
            x = saved(x, w[0])
        return jnp.mean(layer(x, w[-1]) ** 2)

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((3, 4, D, D)) / 8, jnp.float32)
    _, x = _args()
    report = hlo_amp.compile(jax.grad(loss), f"fp8,{ALL}").lower(
        w, x, target="h100").report()
    assert any(s.fused for s in report.attention)
    assert any("saved for the backward pass" in s.reason for s in report.attention)
    _assert_attention_16_bit_projections_fp8(report)


def test_an_attention_written_with_matmuls_in_a_scan_without_checkpoint_stays_16_bit():
    """nanoGPT's attention (``@``, no einsum names) in a scan body without
    jax.checkpoint: its backward, in the backward loop, is found by its matmuls' scope
    and source line, names no other forward matmul has (its four backward matmuls went
    fp8 when only einsum names were taken: review h97)."""
    heads = 2

    def layer(x, w):
        q, k, v = ((x @ w[n]).reshape(B, T, heads, D // heads).transpose(0, 2, 1, 3)
                   for n in range(3))
        with jax.named_scope("attn"):
            scores = (q @ jnp.swapaxes(k, -1, -2)) / np.sqrt(D // heads)
            out = jax.nn.softmax(scores, axis=-1) @ v
        return x + out.transpose(0, 2, 1, 3).reshape(B, T, D) @ w[3], None

    def loss(w, x):
        return jnp.mean(jax.lax.scan(layer, x, w)[0] ** 2)

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 4, D, D)) / 8, jnp.float32)
    _, x = _args()
    report = hlo_amp.compile(jax.grad(loss), f"fp8,{ALL}").lower(w, x).report()
    attention = [d for d in report.decisions if d.scope == "attn"]
    assert len(attention) == 6 and not any(d.fp8 for d in attention)
    assert all(d.fp8 for d in report.decisions if d.scope != "attn"
               and d.op_kind == "dot_general")


def test_projections_on_the_attentions_line_are_no_attention():
    """A backward matmul is taken for a refused attention's by its scope, einsum and
    source line only where the attention's backward is in another function and its
    matmuls name an einsum: the output projection's backward on the line of an
    attention written with ``@`` was kept 16-bit as "an attention's matmul" (review
    h95)."""
    def loss(w, x):
        q, k, v = x @ w[0], x @ w[1], x @ w[2]
        y = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, -1) @ v @ w[3]
        return jnp.mean(y ** 2)

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((4, D, D)) / 8, jnp.float32)
    _, x = _args()
    report = hlo_amp.compile(jax.grad(loss), f"fp8,{ALL}").lower(w, x).report()
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    sixteen = [d for d in dots if not d.fp8]
    assert len(dots) == 15 and len(sixteen) == 6  # the attention's scores, output, dQ,
    assert all(ATTENTION_FALLBACK in d.reason for d in sixteen)  # dK, dV, dP


def test_a_scope_rule_asks_for_fp8_attention():
    attention, _ = _dots(f"fp8,{ALL},scope:attn=float8_e5m2")
    assert len(attention) == 6 and all(d.fp8 for d in attention)


def test_without_the_fused_attention_pass_attention_follows_the_op_rules():
    attention, _ = _dots(f"fp8,{ALL},fuse_attention=false")
    assert len(attention) == 6 and all(d.fp8 for d in attention)


@pytest.mark.parametrize("policy", [f"fp8,{ALL}", f"fp8,{ALL},scope:attn=float8_e5m2"])
def test_the_step_trains(policy):
    step = hlo_amp.compile(_step, policy)
    p, x = _args()
    losses = []
    for _ in range(5):
        p, loss = step(p, x)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
