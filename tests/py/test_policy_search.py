"""hlo_amp.compare, attribute and autopolicy (issue 12) on tiny programs.

The synthetic program has three benign scopes and one, ``cancel``, built to be
bf16-fragile: a K=1024 dot of values 1 + 1e-3 * noise against alternating signs, whose
exact result is the sum of the noise and whose bf16 operands round the noise away.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hlo_amp
from benchmarks.autopolicy_fragile import make_program as fragile_program
from hlo_amp.numerics import RTOL, tolerance

K = 1024


def _weights() -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 5)
    return {"embed": jax.random.normal(k[0], (32, 32)) / 32 ** 0.5,
            "mix": jax.random.normal(k[1], (32, 32)) / 32 ** 0.5,
            "head": jax.random.normal(k[2], (32, 8)) / 32 ** 0.5,
            "u": 1 + 1e-3 * jax.random.normal(k[3], (8, K)),
            "sign": jnp.tile(jnp.array([1.0, -1.0]), K // 2)}


X = jax.random.normal(jax.random.key(1), (16, 32))
W = _weights()


def make_program():
    """A fresh function object each call, so compile counts start from an empty cache:
    the fragile-scope program, also benchmarked at 4096 (benchmarks/autopolicy_fragile.py)."""
    return fragile_program()


# ---- attribute and autopolicy ------------------------------------------------------------


def test_attribute_ranks_the_fragile_scope_first():
    result = hlo_amp.attribute(make_program(), "bf16", X, W)
    assert result.ranking[0] == "cancel"
    assert sorted(result.ranking) == ["cancel", "embed", "head", "mix"]
    rows = {row.scope: row for row in result.scopes}
    assert rows["cancel"].only_low > 0.5  # the cancelled sum loses its digits
    assert all(rows[s].only_low < 0.01 for s in ("embed", "mix", "head"))
    assert rows["cancel"].only_f32 < 0.01  # keeping it f32 alone fixes the program
    assert rows["embed"].only_f32 > 0.5  # keeping another f32 does not
    assert result.error == pytest.approx(rows["cancel"].only_low, rel=0.05)
    # one compile as written, one for bf16, two per scope; never one per combination
    assert result.compiles == 2 + 2 * 4
    assert result.dtypes == ["bf16"] and result.rtol == RTOL["bf16"]


def test_autopolicy_keeps_exactly_the_fragile_scope_f32_and_meets_the_budget():
    fn = make_program()
    result = hlo_amp.autopolicy(fn, X, W, budget=0.01)
    assert result.f32_scopes == ["cancel"]
    assert dict(result.policy.scopes) == {"/cancel": "float32"}  # anchored: cancel only
    assert result.policy.compute_dtype == "bfloat16" and result.met
    assert result.error <= 0.01
    assert hlo_amp.Policy.parse(str(result.policy)) == result.policy  # pasteable
    # the attribution's compiles, no search over combinations; the confirmation is the
    # attribution's "only cancel f32" executable, from the cache
    assert result.compiles == result.attribution.compiles == 2 + 2 * 4
    assert [t.f32_scopes for t in result.trail] == [(), ("cancel",)]
    assert [t.met for t in result.trail] == [False, True]
    # an independent compare of the chosen policy agrees (and, cached, compiles nothing)
    check = hlo_amp.compare(fn, str(result.policy), X, W, f64=False)
    assert check.error == pytest.approx(result.error) and check.compiles == 0


def test_autopolicy_steps_up_until_the_budget_is_met():
    fn = make_program()
    attribution = hlo_amp.attribute(fn, "bf16", X, W)
    benign = sorted(row.only_f32 for row in attribution.scopes if row.scope != "cancel")
    budget = attribution.scopes[0].only_f32 * 0.9  # just below: cancel alone is not enough
    result = hlo_amp.autopolicy(fn, X, W, budget=budget)
    assert result.f32_scopes[0] == "cancel" and len(result.f32_scopes) >= 2
    assert result.met and result.error <= budget
    assert benign[0] > budget  # (each benign scope alone, cancel low, is far over)
    tried = {t.f32_scopes: t.met for t in result.trail}
    assert tried[tuple(result.f32_scopes[:-1])] is False  # one fewer was tried and failed
    # the pair is the one new policy: "cancel" alone is the attribution's, cached
    assert [len(t.f32_scopes) for t in result.trail] == [0, 1, 2]
    assert result.compiles == 1


def test_of_single_scopes_within_budget_the_one_with_fewer_flops_is_kept_f32():
    """bf16 rounds 1 + 2^-9 (in ``small``, one row) and 1 + 3 * 2^-10 (in ``large``, 64
    rows) to 1; their errors add, and either alone is within the budget."""

    def fn(a, b, m):
        with jax.named_scope("small"):
            y = a @ jnp.array([1.0, -1.0])
        with jax.named_scope("large"):
            z = b @ jnp.array([1.0, -1.0])
        return jnp.concatenate([y + z, m])

    a = jnp.array([[1 + 2.0 ** -9, 1.0]])
    b = jnp.tile(jnp.array([[1 + 3 * 2.0 ** -10, 1.0]]), (64, 1))
    result = hlo_amp.autopolicy(fn, a, b, jnp.ones(1), budget=0.004)
    assert result.attribution.ranking == ["large", "small"]  # large contributes more
    rows = {row.scope: row for row in result.attribution.scopes}
    assert rows["large"].flops > rows["small"].flops
    assert rows["large"].only_f32 <= 0.004 and rows["small"].only_f32 <= 0.004
    assert result.f32_scopes == ["small"] and result.met
    assert result.error == pytest.approx(3 * 2.0 ** -10 - 1e-5)


def test_autopolicy_within_budget_returns_the_base_policy():
    result = hlo_amp.autopolicy(make_program(), X, W, budget=2.0, base="f16")
    assert result.policy == hlo_amp.Policy.preset("f16")
    assert result.f32_scopes == [] and result.met and len(result.trail) == 1


def test_autopolicy_says_when_no_scope_rule_can_meet_the_budget():
    def fn(x, w):  # the fragile dot outside any named scope
        with jax.named_scope("head"):
            y = x @ w["head"]
        return y, w["u"] @ w["sign"]

    result = hlo_amp.autopolicy(fn, X, {"head": W["embed"], "u": W["u"], "sign": W["sign"]},
                                budget=0.01)
    assert not result.met and result.error > 0.5
    assert result.f32_scopes == ["head"]
    assert any("no policy" in note for note in result.notes)
    rows = {row.scope: row for row in result.attribution.scopes}
    assert rows["(top level)"].only_f32 is None and rows["(top level)"].pattern is None
    assert "NOT within" in str(result)


def test_two_fragile_scopes_hiding_each_other_are_both_kept_f32():
    """Keeping either one f32 removes nothing (the other's error remains), so what they
    do alone is what ranks them."""

    def fn(x, w):
        with jax.named_scope("embed"):
            y = x @ w["embed"]
        with jax.named_scope("cancel_a"):
            a = w["u"] @ w["sign"]
        with jax.named_scope("cancel_b"):
            b = (w["u"] * 0.5) @ w["sign"]
        return y, a + b

    attribution = hlo_amp.attribute(fn, "bf16", X, W)
    assert sorted(attribution.ranking[:2]) == ["cancel_a", "cancel_b"]
    rows = {row.scope: row for row in attribution.scopes}
    assert rows["cancel_a"].only_f32 > 0.3 and rows["cancel_a"].contribution > 0.3
    result = hlo_amp.autopolicy(fn, X, W, budget=0.01)
    assert sorted(result.f32_scopes) == ["cancel_a", "cancel_b"] and result.met


def test_a_rule_names_exactly_its_scope():
    """``out`` also matches inside ``blocks/out``; the anchored ``/out`` does not."""

    def fn(x, w):
        with jax.named_scope("blocks"), jax.named_scope("out"):
            c = w["u"] @ w["sign"]  # the fragile one
        with jax.named_scope("out"):
            y = x @ w["head"]
        return y, c

    weights = {"head": W["embed"], "u": W["u"], "sign": W["sign"]}
    attribution = hlo_amp.attribute(fn, "bf16", X, weights)
    rows = {row.scope: row for row in attribution.scopes}
    assert attribution.ranking[0] == "blocks"
    assert rows["out"].only_f32 > 0.5  # had its rule reached blocks/out, that went f32 too
    assert rows["blocks"].only_f32 < 0.01
    # the rule keeps blocks/out at the policy's action (what a guard rule used to do)
    only_out = hlo_amp.Policy.parse(f"bf16,scope:{rows['out'].pattern}=float32")
    assert only_out.decide(("blocks", "out"), "dot_general", False).action == "compute"
    assert only_out.decide(("out",), "dot_general", False).action == "float32"
    assert not any("reaches" in note for note in attribution.notes)
    result = hlo_amp.autopolicy(fn, X, weights, budget=0.01)
    assert result.f32_scopes == ["blocks"] and result.met
    assert dict(result.policy.scopes) == {rows["blocks"].pattern: "float32"}


def test_a_scope_named_with_brackets_gets_its_rule():
    """'layer[1]' (a glob's character class) had no rule: attribute's row said no rule
    can name ops that are in a named scope, and autopolicy missed the budget."""

    def fn(x, w):
        with jax.named_scope("layer[0]"):
            y = x @ w["head"]
        with jax.named_scope("layer[1]"):
            c = w["u"] @ w["sign"]  # the fragile one
        return y, c

    weights = {"head": W["embed"], "u": W["u"], "sign": W["sign"]}
    attribution = hlo_amp.attribute(fn, "bf16", X, weights)
    rows = {row.scope: row for row in attribution.scopes}
    assert attribution.ranking[0] == "layer[1]"
    assert None not in (rows["layer[0]"].pattern, rows["layer[1]"].pattern)
    only = hlo_amp.Policy.parse(f"bf16,scope:{rows['layer[1]'].pattern}=float32")
    assert only.decide(("layer[1]",), "dot_general", False).action == "float32"
    assert only.decide(("layer[0]",), "dot_general", False).action == "compute"
    assert only.decide(("layer1",), "dot_general", False).action == "compute"
    result = hlo_amp.autopolicy(fn, X, weights, budget=0.01)
    assert result.f32_scopes == ["layer[1]"] and result.met


@pytest.mark.parametrize("fragile", [("blocks", "0", "head"), ("head", "dense")])
def test_at_depth_each_group_has_its_own_rule(fragile):
    """At depth 2, ``head`` (ops directly in it) prefixes ``head/dense`` and is nested as
    ``blocks/0/head``; each group's rule names its ops and no other group's."""

    def fn(x, w):
        with jax.named_scope("head"):
            y = x @ w["head"]
            with jax.named_scope("dense"):
                z = x @ w["embed"]
        with jax.named_scope("blocks"), jax.named_scope("0"), jax.named_scope("head"):
            b = x @ w["mix"]
        with contextlib.ExitStack() as stack:
            for name in fragile:
                stack.enter_context(jax.named_scope(name))
            c = w["u"] @ w["sign"]
        return y, z, b, c

    attribution = hlo_amp.attribute(fn, "bf16", X, W, depth=2)
    rows = {row.scope: row for row in attribution.scopes}
    assert sorted(rows) == ["blocks/0", "head", "head/dense"]
    group = "/".join(fragile[:2])
    assert attribution.ranking[0] == group
    assert rows[group].only_f32 < 0.01  # its own rule reaches the fragile dot
    for other in set(rows) - {group}:  # and no other group's rule does
        assert rows[other].only_f32 > 0.5, other
        assert rows[other].only_low < 0.01, other
    # each pattern decides its own group's scopes f32 and the others' as bf16 does
    scopes = {"head": ("head",), "head/dense": ("head", "dense"),
              "blocks/0": ("blocks", "0", "head")}
    for name, row in rows.items():
        policy = hlo_amp.Policy.parse(f"bf16,scope:{row.pattern}=float32")
        for other, scope in scopes.items():
            want = "float32" if other == name else "compute"
            assert policy.decide(scope, "dot_general", False).action == want, (name, other)
    assert not any("reaches" in note for note in attribution.notes)
    assert attribution.compiles == 2 + 2 * 3  # every rule is its own policy


def test_depth_groups_scopes_by_leading_segments():
    def fn(x, w):
        for i in range(2):
            with jax.named_scope(f"block_{i}"):
                with jax.named_scope("attn"):
                    x = jnp.tanh(x @ w["embed"])
                with jax.named_scope("mlp"):
                    x = jnp.tanh(x @ w["mix"])
        with jax.named_scope("head"):
            return x @ w["head"]

    one = hlo_amp.attribute(fn, "bf16", X, W, depth=1)
    two = hlo_amp.attribute(fn, "bf16", X, W, depth=2)
    assert sorted(one.ranking) == ["block_0", "block_1", "head"]
    assert sorted(two.ranking) == ["block_0/attn", "block_0/mlp", "block_1/attn",
                                   "block_1/mlp", "head"]
    # as written and bf16 are depth 1's executables, from the cache; "only head f32" is
    # not: at depth 2 head's rule is /head$ (ops directly in head), at depth 1 /head
    assert {row.scope: row.pattern for row in one.scopes}["head"] == "/head"
    assert {row.scope: row.pattern for row in two.scopes}["head"] == "/head$"
    assert {row.scope: row.pattern for row in two.scopes}["block_0/attn"] == "/block_0/attn"
    assert two.compiles == 2 * 5


def test_attribute_and_autopolicy_on_a_train_step():
    tx = optax.sgd(0.1)

    def loss_fn(w, x):
        with jax.named_scope("body"):
            h = jnp.tanh(x @ w["embed"])
        with jax.named_scope("cancel"):
            c = w["u"] @ w["sign"]
        with jax.named_scope("head"):
            return jnp.mean((h @ w["head"]) ** 2) + jnp.sum(c)

    def train_step(w, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(w, x)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(w, updates), opt_state, loss

    weights = {"embed": W["embed"], "head": W["head"], "u": W["u"], "sign": W["sign"]}
    args = (weights, tx.init(weights), X)
    result = hlo_amp.autopolicy(train_step, *args, budget=0.01)
    assert result.attribution.ranking[0] == "cancel"
    assert result.f32_scopes == ["cancel"] and result.met
    compared = hlo_amp.compare(train_step, result.policy, *args)
    assert {leaf.name for leaf in compared.leaves} >= {"0/u", "0/embed", "2"}
    assert compared.error <= 0.01


# ---- compare -----------------------------------------------------------------------------


def _cancelling(x, m):
    """[x0 - x1, m]: with x0 = 1 + d and x1 = 1, the first entry is d exactly in f32."""
    with jax.named_scope("dot"):
        d = x @ jnp.array([[1.0], [-1.0]])
    return jnp.concatenate([d.ravel(), m])


@pytest.mark.parametrize(("policy", "d", "m", "ok"), [
    ("bf16", 2.0 ** -9, 0.25, True),  # bf16 rounds 1 + 2^-9 to 1: error 2^-9
    ("bf16", 2.0 ** -9, 0.0625, False),  # 2^-9 > 1e-5 + 1.6e-2 * 0.0625
    ("f16", 2.0 ** -12, 0.5, True),  # f16 rounds 1 + 2^-12 to 1: error 2^-12
    ("f16", 2.0 ** -12, 0.125, False),  # 2^-12 > 1e-5 + 1e-3 * 0.125
    ("bf16", 2.0 ** -12, 0.125, True),  # the same error is inside bf16's tolerance
])
def test_compare_verdicts_flip_around_the_dtype_tolerance(policy, d, m, ok):
    x = jnp.array([[1.0 + d, 1.0]])
    result = hlo_amp.compare(_cancelling, policy, x, jnp.array([m]))
    (leaf,) = result.leaves
    assert leaf.max_abs == pytest.approx(d) and leaf.max_rel == pytest.approx(d / m)
    assert leaf.ok is ok and result.ok is ok
    assert result.rtol == RTOL[{"bf16": "bf16", "f16": "f16"}[policy]]
    assert result.error == pytest.approx((d - 1e-5) / m)
    assert (result.error <= result.rtol) is ok  # the error is the smallest passing rtol
    assert ("within" if ok else "OUTSIDE") in str(result)


def test_a_budget_below_the_f32_programs_own_error_says_so():
    """Against f64 the f32 program is itself some error away: under a budget below it,
    the note said ops outside named scopes ran in low precision and advised going deeper
    or naming them, where every op was f32 and named."""
    def f(w, x):
        with jax.named_scope("a"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("b"):
            return (y @ w) * 1e4

    w = jax.random.normal(jax.random.key(0), (64, 64))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    floor = hlo_amp.compare(f, "f32", w, x, reference="f64").error
    result = hlo_amp.autopolicy(f, w, x, budget=floor / 4, reference="f64")
    assert not result.met
    assert result.notes[0] == (
        f"note: the program in f32 is itself {floor:.3g} from f64, over budget "
        f"{floor / 4:g}: no policy can meet it; raise the budget to at least that")


def test_delayed_scaling_is_said_to_be_measured_with_current_scaling():
    """compare, attribute and autopolicy run jax.jit, which carries no amax history: a
    scaling=delayed policy is measured with current scaling, which they now say (only
    the pass report inside said the module carried no fp8 state)."""
    from hlo_amp.numerics.measure import DELAYED_NOTE

    fn, policy = make_program(), "fp8,scaling=delayed"
    assert DELAYED_NOTE in hlo_amp.compare(fn, policy, X, W, f64=False).notes
    assert DELAYED_NOTE in hlo_amp.autopolicy(fn, X, W, budget=0.5, base=policy).notes
    assert DELAYED_NOTE not in hlo_amp.compare(fn, "fp8", X, W, f64=False).notes


def test_compare_reports_f64_and_leaves_the_callers_x64_alone():
    fn = make_program()
    result = hlo_amp.compare(fn, "bf16", X, W, reference="f64")
    assert jax.config.jax_enable_x64 is False and jnp.ones(1).dtype == jnp.float32
    rows = {leaf.name: leaf for leaf in result.leaves}
    assert result.reference == "f64" and result.compiles == 3  # f32, bf16, f64
    assert 0 < rows["y"].f32_vs_f64 < 1e-6 and rows["y"].policy_vs_f64 > 1e-4
    assert rows["c"].f32_vs_f64 > 1e-4  # the cancelled sum is ill-conditioned in f32 too
    assert any("ill-conditioned" in note for note in result.notes)
    data = json.loads(result.to_json())
    assert data["reference"] == "f64" and {leaf["name"] for leaf in data["leaves"]} == {"c", "y"}
    assert "policy vs f64" in str(result)


def test_an_f64_reference_that_computed_in_f32_says_so():
    """A model closing over its weights and fed tokens has no float argument to widen:
    its "f64" run computed in f32, and compare showed f32 vs f64 of exactly 0 under the
    header "against f64" without a word (hunt h86); so did attribute and autopolicy."""
    keys = jax.random.split(jax.random.key(0), 2)
    embedding = jax.random.normal(keys[0], (50, 16))
    w = jax.random.normal(keys[1], (16, 8)) / 4

    def lm(tokens):
        with jax.named_scope("head"):
            return jnp.tanh(embedding[tokens] @ w)

    tokens = jnp.arange(8) * 3
    result = hlo_amp.compare(lm, "bf16", tokens, reference="f64")
    assert result.leaves[0].f32_vs_f64 == 0
    narrow = [note for note in result.notes if "computed in f32" in note]
    assert len(narrow) == 1 and narrow[0].startswith(
        "note: the f64 run computed in f32: its float outputs are float32 and equal")
    assert narrow[0] in hlo_amp.attribute(lm, "bf16", tokens, reference="f64").notes
    assert narrow[0] in hlo_amp.autopolicy(lm, tokens, budget=1.0, reference="f64").notes
    # Weights passed as arguments are widened, and an output cast to f32 at the end was
    # computed in f64 all the same (review h87): no note.
    widened = hlo_amp.compare(lambda e, w, t: jnp.tanh(e[t] @ w), "bf16", embedding, w,
                              tokens, reference="f64")
    pinned = hlo_amp.compare(lambda e, w, t: jnp.tanh(e[t] @ w).astype(jnp.float32),
                             "bf16", embedding, w, tokens, reference="f64")
    assert not any("computed in f32" in note for note in widened.notes + pinned.notes)


def test_a_program_without_dots_has_zero_error_and_says_why():
    def fn(x):
        return jnp.tanh(x) * 2.0, jnp.argmax(x, axis=-1)

    result = hlo_amp.compare(fn, "bf16", X)
    assert result.error == 0 and result.ok and result.leaves[0].max_abs == 0
    assert result.leaves[1].ok is None and "equal" in result.leaves[1].note
    assert any("no dot_general or convolution" in note for note in result.notes)
    attribution = hlo_amp.attribute(fn, "bf16", X)
    assert attribution.scopes == [] and attribution.error == 0
    assert any("nothing to attribute" in note for note in attribution.notes)
    chosen = hlo_amp.autopolicy(fn, X, budget=1e-3)
    assert chosen.policy == hlo_amp.Policy.preset("bf16") and chosen.met
    assert any("no dot_general" in note for note in chosen.notes)


def test_tolerance_takes_the_loosest_dtype():
    assert tolerance([]) == RTOL["f32"]
    assert tolerance(["bf16", "f16"]) == RTOL["bf16"]
    assert tolerance(["f8E4M3FN"]) == RTOL["f8E4M3"]
    assert tolerance(["f64"]) == RTOL["f32"]  # it took fp4's 0.5, the loosest of all


def test_an_f64_program_is_not_low_precision_and_compares_at_f32s_tolerance():
    """"f64" began like an fp6 type: its dot counted as 16-bit or narrower and compare
    passed errors up to 50% (fp4's rtol)."""
    jax.config.update("jax_enable_x64", True)
    try:
        x = np.ones((16, 32)) / 3
        w = np.ones((32, 8)) / 7
        result = hlo_amp.compare(lambda x, w: jnp.tanh(x @ w), "bf16", x, w)
        report = hlo_amp.compile(lambda x, w: x @ w, "bf16").lower(x, w).report()
    finally:
        jax.config.update("jax_enable_x64", False)
    [decision] = report.decisions
    assert decision.operands_after == ("f64", "f64") and not decision.low_precision
    assert result.rtol == RTOL["f32"] and "0% of FLOPs in 16-bit" in report.summary()


def test_a_function_without_named_scopes_is_one_top_level_row():
    """Depth 1 of a function whose matrix ops have no named scope (an NNX model passed
    without module_scopes) was refused: "Unknown depth 1; accepted: an int >= 1"."""
    def fn(x):
        return jnp.tanh(x @ W["embed"]) @ W["head"]

    attribution = hlo_amp.attribute(fn, "bf16", X)
    assert [row.scope for row in attribution.scopes] == ["(top level)"]
    # Depth 2 was refused naming "an int >= 1" as accepted.
    with pytest.raises(ValueError, match=r"^Unknown depth 2; accepted: 1 \(fn's matrix ops "
                                         r"have no named scope\)$"):
        hlo_amp.attribute(fn, "bf16", X, depth=2)
    chosen = hlo_amp.autopolicy(fn, X, budget=1.0, progress=False)
    assert chosen.met and chosen.policy == hlo_amp.Policy.preset("bf16")


def test_a_partial_of_a_compiled_function_is_measured_as_written():
    """functools.partial of an hlo_amp.compile function (how a keyword-only static
    argument is bound) is measured against its function as written: the reference was
    the compiled bf16 program itself, every error 0, and autopolicy returned plain bf16
    for a budget bf16 misses by 100x."""
    def fn(x, w, *, layers):
        for i in range(layers):
            with jax.named_scope(f"l{i}"):
                x = jnp.tanh(x @ w) * 3
        return x

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.key(1), (8, 32))
    step = hlo_amp.compile(fn, "bf16", static_argnames="layers")
    bound = functools.partial(step, w=w, layers=2)
    want = hlo_amp.compare(functools.partial(fn, w=w, layers=2), "bf16", x, f64=False).error
    assert want > 1e-3
    assert hlo_amp.compare(bound, "bf16", x, f64=False).error == want
    chosen = hlo_amp.autopolicy(bound, x, budget=1e-4, progress=False)
    assert chosen.policy != hlo_amp.Policy.preset("bf16") and chosen.error <= 1e-4
    # A partial of a jax.jit function with static arguments: the positions the partial
    # fills shift them (jax's 'Non-hashable static arguments' on a tracer), and a
    # delayed-scaling step (it was refused as if called under jax.jit).
    def positional(x, w, layers):
        return fn(x, w, layers=layers)

    jitted = jax.jit(positional, static_argnums=2)
    assert hlo_amp.compare(functools.partial(jitted, x), "bf16", w, 2, f64=False).error == want
    delayed = hlo_amp.compile(positional, "fp8,scaling=delayed", static_argnums=2)
    assert hlo_amp.compare(delayed, "bf16", x, w, 2, f64=False).error == want


# ---- bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(("depth", "match"), [
    (0, r"Unknown depth 0; accepted: an int from 1 to 1"),
    (3, r"Unknown depth 3; accepted: an int from 1 to 1"),
    # A string read "accepted: 1 to 1" as if '1' were out of range: the type is named.
    ("1", r"Unknown depth '1' \(a str\); accepted: an int"),
    (True, r"Unknown depth True \(a bool\)"), (1.0, r"Unknown depth 1.0 \(a float\)")])
def test_unknown_depth(depth, match):
    with pytest.raises(ValueError, match=match):
        hlo_amp.attribute(make_program(), "bf16", X, W, depth=depth)


@pytest.mark.parametrize("budget", [0, -0.1, float("nan"), float("inf"), "1e-2", None,
                                    jnp.float32(-1.0), jnp.ones(2)])
def test_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match=r"Invalid budget .*; accepted: a finite number > 0"):
        hlo_amp.autopolicy(make_program(), X, W, budget=budget)


def test_a_budget_given_as_a_jax_scalar_is_its_number():
    """jnp.float32(0.5) (a 0-d array) was refused as "Invalid budget Array(0.5...)"."""
    fn = make_program()
    assert hlo_amp.autopolicy(fn, X, W, budget=jnp.float32(0.5)).budget == 0.5
    # An integer one too, as 1 and np.int32(1) are (jnp.int32(1) was refused).
    assert hlo_amp.autopolicy(fn, X, W, budget=jnp.int32(1)).budget == 1.0


def test_non_float_output():
    def fn(x, w):
        return jnp.argmax(x @ w["embed"], axis=-1)

    for call in (lambda: hlo_amp.compare(fn, "bf16", X, W),
                 lambda: hlo_amp.attribute(fn, "bf16", X, W),
                 lambda: hlo_amp.autopolicy(fn, X, W, budget=0.1)):
        with pytest.raises(ValueError, match=r"fn returned none \(output: int32\[16\]\); "
                                             r"accepted: a function with at least one float"):
            call()


def test_a_given_rtol_is_named_as_such():
    """With rtol= the verdict said "the bf16 tolerance", which it was not."""
    fn = make_program()
    assert "within the tolerance asked for (rtol 2)" in str(
        hlo_amp.compare(fn, "bf16", X, W, f64=False, rtol=2.0))
    assert "the bf16 tolerance" in str(hlo_amp.compare(fn, "bf16", X, W, f64=False))


def test_other_bad_arguments():
    with pytest.raises(ValueError, match=r"Unknown reference 'f16'; accepted: 'f32', 'f64'"):
        hlo_amp.compare(make_program(), "bf16", X, W, reference="f16")
    with pytest.raises(ValueError, match=r"Invalid rtol -1; accepted"):
        hlo_amp.compare(make_program(), "bf16", X, W, rtol=-1)
    with pytest.raises(ValueError, match=r"Unknown preset 'bf8'"):
        hlo_amp.autopolicy(make_program(), X, W, budget=0.1, base="bf8")


# ---- output forms ------------------------------------------------------------------------


def test_table_json_and_png(tmp_path):
    attribution = hlo_amp.attribute(make_program(), "bf16", X, W)
    text = str(attribution)
    assert text.splitlines()[1].split() == ["rank", "scope", "ops", "FLOPs", "only", "it",
                                            "bf16", "only", "it", "f32", "contribution"]
    assert text.splitlines()[3].split()[:2] == ["1", "cancel"]
    data = json.loads(attribution.to_json())
    assert [row["scope"] for row in data["scopes"]] == attribution.ranking
    png = attribution.plot(tmp_path / "attribution.png", budget=0.01)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("errors", [(float("inf"), 7e-4), (float("inf"), float("inf"))],
                         ids=["one_overflows", "all_overflow"])
def test_an_infinite_error_is_drawn_past_every_finite_one(monkeypatch, tmp_path, errors):
    """A scope whose 16-bit run overflows (error inf) is the longest bar, past the
    budget, and so is the every-scope line: the bar and line were left out (the scope
    looked harmless), and with every error inf the plot raised OverflowError."""
    from matplotlib.axes import Axes

    from hlo_amp.numerics.attribute import Attribution, ScopeError

    drawn: dict[str, list[float]] = {"bars": [], "lines": []}
    barh, axvline = Axes.barh, Axes.axvline
    monkeypatch.setattr(Axes, "barh", lambda self, y, width, *a, **k: (
        drawn["bars"].extend(width), barh(self, y, width, *a, **k))[1])
    monkeypatch.setattr(Axes, "axvline", lambda self, x=0, *a, **k: (
        drawn["lines"].append(x), axvline(self, x, *a, **k))[1])
    overflow, other = errors
    scopes = [ScopeError("a", 1, 32, overflow, 7e-4, "a"), ScopeError("b", 1, 32, other, overflow, "b")]
    attribution = Attribution("bf16", 1, "f32", ["bf16"], 1e-2, 1e-6, overflow, scopes, 3, 0.1)
    png = attribution.plot(tmp_path / "inf.png", budget=1e-2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.isfinite(drawn["bars"] + drawn["lines"]).all()
    every_scope, budget = drawn["lines"]
    given = [v for row in scopes for v in (row.only_low, row.only_f32)]
    assert every_scope == max(drawn["bars"]) > max([budget] + [v for v in given if v < 1])
    assert drawn["bars"].count(every_scope) == given.count(float("inf"))


def test_a_zero_error_is_drawn_shorter_than_every_real_one(monkeypatch, tmp_path):
    """An error of 0 (bf16 exact on small integers) is a stub labelled 0 below every
    nonzero bar: it was drawn at 1.5 times the smallest error's decade, past a real
    1.36e-3. A budget that is no positive number is refused in one line."""
    from matplotlib.axes import Axes

    from hlo_amp.numerics.attribute import Attribution, ScopeError

    drawn: list[float] = []
    labels: list[str] = []
    barh, text = Axes.barh, Axes.text
    monkeypatch.setattr(Axes, "barh", lambda self, y, width, *a, **k: (
        drawn.extend(width), barh(self, y, width, *a, **k))[1])
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: (
        labels.append(s), text(self, x, y, s, *a, **k))[1])
    scopes = [ScopeError("rounded", 1, 32, 1.36e-3, 0.0, "rounded"),
              ScopeError("exact", 1, 32, 0.0, 1.36e-3, "exact")]
    attribution = Attribution("bf16", 1, "f32", ["bf16"], 1e-2, 1e-6, 1.36e-3, scopes, 3, 0.1)
    attribution.plot(tmp_path / "zero.png", budget=1e-2)
    zero, real = min(drawn), max(drawn)
    assert drawn.count(zero) == 2 and drawn.count(real) == 2 and 0 < zero < real == 1.36e-3
    assert labels.count(" 0") == 2
    for budget in ("1e-2", -1.0):
        with pytest.raises(ValueError, match=r"^Invalid budget .*; accepted: a finite number > 0"):
            attribution.plot(tmp_path / "bad.png", budget=budget)


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    attribution = hlo_amp.attribute(make_program(), "bf16", X, W)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="needs matplotlib: pip install matplotlib"):
        attribution.plot(tmp_path / "a.png")


def test_a_compiled_function_is_measured_as_written():
    fn = make_program()
    direct = hlo_amp.compare(fn, "bf16", X, W, f64=False)
    wrapped = hlo_amp.compare(hlo_amp.compile(fn, "f16"), "bf16", X, W, f64=False)
    assert wrapped.error == direct.error and wrapped.compiles == 0
    assert np.isfinite(direct.error)


def test_a_compiled_functions_static_arguments_stay_static():
    """``hlo_amp.compile(fn, static_argnums=...)`` and ``jax.jit(fn, static_argnums=...)``
    are measured with their static arguments bound, as ``functools.partial`` binds them
    (they were traced: the loop bound failed inside the user's function); so are an
    ``eqx.filter_jit`` step's Python ints and an ``nnx.jit`` one's static_argnums
    (traced too, compiled by hlo_amp or not)."""
    import functools

    import equinox as eqx
    from flax import nnx

    def layers(w, x, count):
        for i in range(count):
            with jax.named_scope(f"layer{i}"):
                x = jnp.tanh(x @ w)
        return x

    w, x = np.eye(8, dtype=np.float32) * 0.5 + 0.01, np.ones((4, 8), np.float32)
    bound = hlo_amp.compare(functools.partial(layers, count=3), "bf16", w, x, f64=False)
    for given in (hlo_amp.compile(layers, "f16", static_argnums=2),
                  jax.jit(layers, static_argnums=2), eqx.filter_jit(layers),
                  nnx.jit(layers, static_argnums=2),
                  hlo_amp.compile(eqx.filter_jit(layers), "f16")):
        measured = hlo_amp.compare(given, "bf16", w, x, 3, f64=False)
        assert measured.error == bound.error > 0
        ranked = hlo_amp.attribute(given, "bf16", w, x, 3)
        assert sorted(ranked.ranking) == ["layer0", "layer1", "layer2"]


def test_an_equinox_step_is_measured_as_filter_jit_takes_its_module():
    """An eqx.filter_jit step whose module holds functions among its leaves ran under
    hlo_amp.compile but failed in compare/attribute/autopolicy with jax's TypeError."""
    import equinox as eqx

    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))  # activation functions: leaves

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    params, static = eqx.partition(mlp, eqx.is_array)
    xs = np.asarray(jax.random.normal(jax.random.key(1), (16, 8))) * 8
    pure = hlo_amp.compare(lambda p, x: loss(eqx.combine(p, static), x), "bf16", params,
                           xs, f64=False)
    step = hlo_amp.compile(eqx.filter_jit(loss), "bf16")
    assert hlo_amp.compare(step, "bf16", mlp, xs, f64=False).error == pure.error > 0
    assert hlo_amp.autopolicy(step, mlp, xs, budget=1.0).met


def test_an_nnx_object_is_refused_in_one_message():
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="^hlo_amp.compare does not take Flax NNX objects"):
        hlo_amp.compare(lambda m, x: m(x), "bf16", model, np.ones((2, 8), np.float32))


def test_executables_are_cached_per_function_and_freed_with_it():
    import gc
    import weakref

    from hlo_amp.numerics import measure as numerics

    fn = make_program()
    first = hlo_amp.compare(fn, "bf16", X, W, f64=False)
    again = hlo_amp.compare(fn, "bf16", X, W, f64=False)
    other = hlo_amp.compare(fn, "bf16", X[:8], W, f64=False)  # a new input signature
    assert (first.compiles, again.compiles, other.compiles) == (2, 0, 2)
    alive = weakref.ref(fn)
    del fn
    gc.collect()
    assert alive() is None and all(ref() is not None for ref in numerics._LOWERINGS.keyrefs())
