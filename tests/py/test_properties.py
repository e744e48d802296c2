"""Property tests: random JAX programs under random scopes and random policies.

Programs are built from dot / einsum / conv, elementwise ops, reductions, a causal
mask and softmax, an iota, a constant array, lax.scan, lax.cond, inner jax.jit,
jax.checkpoint and layers (the same body applied two or three times, as a model's
blocks: its masks, iotas and constants lowered once per layer or shared), nested in
jax.named_scope names drawn from ['a', 'b', 'c', 'amp_stop']. For each program and
policy:

- the rewritten module re-parses and verifies;
- the pass is idempotent on its own output;
- 'f32' is bit-identical to jax.jit;
- 'bf16' stays within bf16 tolerance of f32 on well-scaled inputs;
- the report's decisions equal an independent oracle's (the precedence in hlo_amp/policy.py's docstring), as multisets.

Profiles: the default runs ~15 examples per test; ``HYPOTHESIS_PROFILE=slow`` runs
thousands.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hlo_amp
from hlo_amp.ir.modules import parse_module

settings.register_profile(
    "default", max_examples=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "slow", max_examples=2000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

pytestmark = pytest.mark.filterwarnings("ignore:hlo_amp. policy rule:UserWarning")

NAMES = ["a", "b", "c", "amp_stop"]
N = 4  # every tensor in a program is N x N (conv: 1x1xNxN)

# ---- random programs ------------------------------------------------------------------

LEAVES = st.sampled_from(["dot", "einsum", "conv", "ew", "reduce", "mask", "iota", "const"])


def _compound(children: st.SearchStrategy) -> st.SearchStrategy:
    body = st.lists(children, min_size=1, max_size=3)
    return st.one_of(
        st.tuples(st.just("scope"), st.sampled_from(NAMES), body),
        st.tuples(st.just("scan"), body),
        st.tuples(st.just("cond"), body, body),
        st.tuples(st.just("jit"), body),
        st.tuples(st.just("ckpt"), body),
        st.tuples(st.just("layers"), st.integers(2, 3), body),
    )


NODES = st.recursive(LEAVES, _compound, max_leaves=8)
PROGRAMS = st.lists(NODES, min_size=1, max_size=4)


# One array for every "const" leaf: a constant that several layers read.
CONST = (np.arange(N * N, dtype=np.float32).reshape(N, N) % 3 - 1) / 4 + 1


def _conv(x: jax.Array, k: jax.Array) -> jax.Array:
    out = jax.lax.conv_general_dilated(x[None, None], k, (1, 1), "SAME")
    return out[0, 0]


def _apply(nodes: list, x: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    for node in nodes:
        x = _apply_node(node, x, w, k)
    return x


def _apply_node(node: Any, x: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    if node == "dot":
        return jnp.tanh(x @ w)
    if node == "einsum":
        return jnp.tanh(jnp.einsum("ij,jk->ik", x, w))
    if node == "conv":
        return jnp.tanh(_conv(x, k))
    if node == "ew":
        return jnp.sin(x) * 0.9 + 0.1
    if node == "reduce":
        return x - jnp.mean(x, axis=0, keepdims=True)
    if node == "mask":  # a decoder's causal mask and softmax
        return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((N, N), bool)), x, -1e9), -1)
    if node == "iota":
        return x + 0.1 * jnp.arange(N, dtype=x.dtype)[None, :]
    if node == "const":
        return x * jnp.asarray(CONST)
    kind = node[0]
    if kind == "scope":
        with jax.named_scope(node[1]):
            return _apply(node[2], x, w, k)
    if kind == "scan":
        def body(carry, _):
            return _apply(node[1], carry, w, k), None
        return jax.lax.scan(body, x, None, length=2)[0]
    if kind == "cond":
        # The predicate reads an input, never a computed value: a sum that is 0 up to
        # rounding (after "reduce") would take different branches in f32 and bf16.
        return jax.lax.cond(w[0, 0] > 0,
                            lambda y: _apply(node[1], y, w, k),
                            lambda y: _apply(node[2], y, w, k), x)

    if kind == "layers":
        for _ in range(node[1]):
            x = _apply(node[2], x, w, k)
        return x

    def inner(y):
        return _apply(node[1], y, w, k)

    if kind == "jit":
        return jax.jit(inner)(x)
    return jax.checkpoint(inner)(x)


def make_fn(program: list):
    def fn(x, w, k):
        return _apply(program, x, w, k)
    return fn


def matmul_sites(nodes: list, scope: tuple[str, ...] = ()) -> list[tuple[str, tuple]]:
    """(op kind, scope path) of every dot/conv in the module, in program order.

    Each node is lowered once (a scan body once, both cond branches).
    """
    sites: list[tuple[str, tuple]] = []
    for node in nodes:
        if node in ("dot", "einsum"):
            sites.append(("dot_general", scope))
        elif node == "conv":
            sites.append(("convolution", scope))
        elif isinstance(node, tuple):
            if node[0] == "scope":
                sites += matmul_sites(node[2], scope + (node[1],))
            elif node[0] == "cond":
                sites += matmul_sites(node[1], scope) + matmul_sites(node[2], scope)
            elif node[0] == "layers":
                sites += node[1] * matmul_sites(node[2], scope)
            else:
                sites += matmul_sites(node[1], scope)
    return sites


def executed_matmuls(nodes: list) -> int:
    """How many dot/conv applications the program runs (for error budgets)."""
    count = 0
    for node in nodes:
        if node in ("dot", "einsum", "conv"):
            count += 1
        elif isinstance(node, tuple):
            if node[0] == "scope":
                count += executed_matmuls(node[2])
            elif node[0] == "scan":
                count += 2 * executed_matmuls(node[1])
            elif node[0] == "cond":
                count += max(executed_matmuls(node[1]), executed_matmuls(node[2]))
            elif node[0] == "layers":
                count += node[1] * executed_matmuls(node[2])
            else:
                count += executed_matmuls(node[1])
    return count


# ---- random policies and the oracle -------------------------------------------------------

ACTIONS = ["compute", "keep", "float32", "bfloat16"]


@st.composite
def policies(draw) -> dict:
    scopes = draw(st.dictionaries(st.sampled_from(["a", "b", "c"]),
                                  st.sampled_from(ACTIONS), max_size=3))
    if "b" not in scopes and draw(st.booleans()):
        scopes["b/c"] = draw(st.sampled_from(ACTIONS))  # a two-segment pattern
    ops = draw(st.dictionaries(st.sampled_from(["dot_general", "convolution"]),
                               st.sampled_from(["compute", "keep", "float32"]), max_size=2))
    return {"compute_dtype": "bfloat16", "ops": ops, "scopes": scopes}


@dataclass(frozen=True)
class Expected:
    scope: str
    kind: str
    action: str | None
    low: bool  # operands end up in bf16


def _matches_at(pattern: str, scope: tuple[str, ...], start: int) -> bool:
    parts = pattern.split("/")
    return scope[start:start + len(parts)] == tuple(parts)


def oracle(policy: dict, kind: str, scope: tuple[str, ...]) -> Expected:
    """The precedence rules of hlo_amp/policy.py's docstring, written independently of it.

    Walk the scopes from the outside in; the first scope whose rule applies decides.
    A rule applies only if it matches inside the innermost amp_stop (if any). If no
    scope rule applies: inside amp_stop -> keep; else the op rule; else left alone.
    """
    stops = [i for i, name in enumerate(scope) if name == "amp_stop"]
    first_allowed = stops[-1] + 1 if stops else 0
    action: str | None = None
    decided = False
    for start in range(first_allowed, len(scope)):
        hits = [p for p in policy["scopes"] if _matches_at(p, scope, start)]
        if hits:
            assert len(hits) == 1  # the generator never makes ties
            action, decided = policy["scopes"][hits[0]], True
            break
    if not decided:
        if stops:
            action = "keep"
        else:
            action = policy["ops"].get(kind)
    low = action in ("compute", "bfloat16")
    return Expected("/".join(scope), kind, action, low)


# ---- helpers ------------------------------------------------------------------------------


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(-1, 1, (N, N)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N, N)) / np.sqrt(N), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 3, 3)) / 3.0, jnp.float32)
    return x, w, k


# ---- properties ---------------------------------------------------------------------------


# Random policies often convert nothing on purpose; that warning is tested elsewhere.
@pytest.mark.filterwarnings("ignore:hlo_amp. policy .* converts none")
@given(program=PROGRAMS, policy=policies())
def test_rewrite_verifies_is_idempotent_and_matches_oracle(program, policy) -> None:
    fn = make_fn(program)
    args = _inputs()
    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    once, report = hlo_amp.rewrite(text, policy, debug_info=True, return_report=True)
    parse_module(once).operation.verify()  # re-parses and verifies
    twice = hlo_amp.rewrite(once, policy, debug_info=True)
    assert twice == once

    expected = Counter(oracle(policy, kind, scope) for kind, scope in matmul_sites(program))
    got = Counter(Expected(d.scope, d.op_kind, d.action, d.low_precision)
                  for d in report.decisions)
    assert got == expected, (program, policy, str(report))
    for d in report.decisions:
        assert d.direction == "forward"
        assert d.changed == (d.action in ("compute", "bfloat16"))


@given(program=PROGRAMS)
def test_f32_bit_identical_and_bf16_close(program) -> None:
    fn = make_fn(program)
    args = _inputs()
    want = np.asarray(jax.jit(fn)(*args))
    f32 = np.asarray(hlo_amp.compile(fn, "f32")(*args))
    np.testing.assert_array_equal(f32, want)
    amp = hlo_amp.compile(fn, "bf16")
    got = np.asarray(amp(*args))
    assert got.dtype == want.dtype and got.shape == want.shape
    report = amp.lower(*args).report()
    expected = Counter(("/".join(scope), "amp_stop" not in scope)
                       for _, scope in matmul_sites(program))
    assert Counter((d.scope, d.low_precision) for d in report.decisions) == expected
    budget = 1.6e-2 * max(1, executed_matmuls(program))
    np.testing.assert_allclose(got, want, rtol=budget, atol=budget)


def test_oracle_and_policy_agree_on_nested_amp_stop() -> None:
    """The case the oracle found: a rule between two amp_stops must not apply inside
    the inner one."""
    spec = {"compute_dtype": "bfloat16", "ops": {"dot_general": "compute"},
            "scopes": {"b": "compute"}}
    policy = hlo_amp.Policy(**spec)
    for scope in [("amp_stop", "b", "amp_stop"), ("amp_stop", "b"), ("b", "amp_stop"),
                  ("a", "amp_stop", "c", "b"), ()]:
        rule = policy.decide(scope, "dot_general", False)
        assert rule.action == oracle(spec, "dot_general", scope).action, scope
