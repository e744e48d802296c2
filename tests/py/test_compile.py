"""hlo_amp.compile: behaves like jax.jit, AOT objects, kept-by-XLA, training, effects."""

from __future__ import annotations

import copy
import functools
import inspect
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hlo_amp

HLO_AMP_OPT = str(Path(sys.executable).parent / "hlo-amp-opt")


def _close_bf16(got, want) -> None:
    """bf16 tolerance: rtol 1.6e-2, atol 1e-2 relative to the output's scale."""
    scale = float(np.max(np.abs(np.asarray(want, np.float32)))) or 1.0
    np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1e-2 * scale)


def _rand(key: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _params() -> dict[str, jax.Array]:
    return {"w1": _rand(1, (8, 16), 8 ** -0.5), "b1": jnp.zeros(16),
            "w2": _rand(2, (16, 4), 16 ** -0.5)}


def _mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    with jax.named_scope("head"):
        return hidden @ params["w2"]


def _loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((_mlp(params, x) - y) ** 2)


# ---- 1. behaves like jax.jit -----------------------------------------------------------


def test_pytrees_and_kwargs_in_same_pytree_out():
    def fn(tree, *, scale):
        a, b = tree["pair"]
        return {"out": (a @ b * scale, jnp.sum(a).astype(jnp.int32)), "b": b}

    tree = {"pair": (_rand(0, (4, 8)), _rand(1, (8, 3)))}
    got = hlo_amp.compile(fn, "bf16")(tree, scale=2.0)
    want = jax.jit(fn)(tree, scale=2.0)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
    _close_bf16(got["out"][0], want["out"][0])
    np.testing.assert_array_equal(got["b"], want["b"])


def test_static_argnums_and_argnames():
    def fn(x, w, power, *, reduce):
        y = x @ w
        return (y.sum(0) if reduce else y) ** power

    amp = hlo_amp.compile(fn, "bf16", static_argnums=2, static_argnames="reduce")
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    out = amp(x, w, 2, reduce=True)
    assert out.shape == (3,)
    _close_bf16(out, fn(x, w, 2, reduce=True))
    assert amp.lowerings == 1
    amp(x, w, 2, reduce=True)
    assert amp.lowerings == 1
    assert amp(x, w, 2, reduce=False).shape == (4, 3)
    assert amp.lowerings == 2
    _close_bf16(amp(x, w, 3, reduce=False), fn(x, w, 3, reduce=False))
    assert amp.lowerings == 3


def test_equal_static_values_of_other_types_trace_anew():
    """1, 1.0 and True are equal static values that trace different programs (the
    fill's dtype follows its Python type), as jax.jit keys them; the first call's program
    served all three, on the dispatch path and on the host-callback path."""
    def fill(x, w, value):
        return x @ w, jnp.full((2,), value)

    def fill_with_callback(x, w, value):
        jax.debug.callback(lambda v: None, x.sum())
        return x @ w, jnp.full((2,), value)

    x, w = _rand(0, (4, 8)), _rand(1, (8, 8))
    for fn in (fill, fill_with_callback):
        want = [jax.jit(fn, static_argnums=2)(x, w, v)[1].dtype for v in (1, 1.0, True)]
        amp = hlo_amp.compile(fn, "bf16", static_argnums=2)
        assert [amp(x, w, v)[1].dtype for v in (1, 1.0, True)] == want, fn.__name__
        assert want == [jnp.int32, jnp.float32, jnp.bool_]


# XLA:CPU alone fails this (DotThunk rejects a bf16 dot whose result it transposes);
# the fast-dot-layout pass relays the dot so it runs.
def _live(type_names: tuple[str, ...]) -> int:
    import gc

    from hlo_amp import jax_internals

    gc.collect()
    jax_internals.forget_exported_calls()  # what the next compiled function's call does
    return sum(type(o).__name__ in type_names for o in gc.get_objects())


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16", "fp8,scaling=delayed"])
def test_a_dropped_compiled_function_is_freed_with_its_modules(policy):
    """A compiled function no longer referenced is freed, as a jax.jit function is, with
    its programs, exports and the MLIR contexts its rewrites used. Each stayed alive for
    good: jax's traces (weakly keyed on its dispatch function) held its programs, which
    held it; jax's abstract-evaluation caches held each program and Exported; the fast
    mode's cache of value types held every rewritten module's context (1.3 to 3.8 MiB a
    small function)."""
    import weakref

    w, x = jnp.ones((16, 16)), jnp.ones((16, 16))
    alive = []

    def make_and_call(i):
        def fn(w, x):
            return jnp.tanh(x @ w) @ w * (i + 1)

        step = hlo_amp.compile(fn, policy)
        step(w, x).block_until_ready()
        alive.append(weakref.ref(step))

    kept = ("Exported", "_Context", "JaxIrContext", "Program", "ProgramStore")
    make_and_call(0)
    before = _live(kept)
    for i in range(1, 6):
        make_and_call(i)
    assert _live(kept) <= before
    assert [ref() is None for ref in alive] == [True] * 6


def test_transposed_matmul_output_runs_on_cpu():
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    _close_bf16(hlo_amp.compile(lambda x, w: (x @ w).T, "bf16")(x, w), (x @ w).T)


def test_cache_per_shape_and_dtype():
    amp = hlo_amp.compile(_matmul, "bf16")
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    amp(x, w)
    amp(x, w)
    amp(_rand(2, (4, 8)), _rand(3, (8, 3)))  # new values, same signature
    assert amp.lowerings == 1
    amp(_rand(0, (5, 8)), w)  # new shape
    assert amp.lowerings == 2
    out = amp(x.astype(jnp.float16), w.astype(jnp.float16))  # new dtype
    assert amp.lowerings == 3
    assert out.dtype == jnp.float16


def test_donate_argnums_like_jax_jit():
    def fn(x):
        return x * 2.0

    x = jnp.ones(16)
    jax.jit(fn, donate_argnums=0)(x)
    jit_deletes = x.is_deleted()
    y = jnp.ones(16)
    out = hlo_amp.compile(fn, "bf16", donate_argnums=0)(y)
    assert y.is_deleted() == jit_deletes
    assert y.is_deleted()  # XLA:CPU supports donation with jax 0.10
    np.testing.assert_array_equal(out, 2.0 * np.ones(16))


@pytest.mark.parametrize("policy", ["bf16", "fp8,scaling=delayed"])
def test_donate_argnames_like_jax_jit(policy):
    """jax.jit's donate_argnames: compile() had no such argument (TypeError)."""
    def fn(p, x):
        return p * 2.0 + x

    step = hlo_amp.compile(fn, policy, donate_argnames="p")
    for call in (lambda p, x: step(p, x), lambda p, x: step(x=x, p=p)):
        p, x = jnp.ones(16), jnp.ones(16)
        out = call(p, x)
        assert p.is_deleted() and not x.is_deleted()
        np.testing.assert_array_equal(out, 3.0 * np.ones(16))
    with pytest.raises(ValueError, match=r"donate_argnames names 'q', which is no positional "
                                         r"parameter of fn \(accepted: p, x"):
        hlo_amp.compile(fn, "bf16", donate_argnames="q")


def test_static_and_donated_arguments_by_keyword_like_jax_jit():
    # jax.jit reads the signature: an argument static or donated by position is so when
    # passed by keyword too, and static_argnames covers the argument passed positionally.
    def repeat(x, n):
        return jnp.tile(x @ x.T, (n, 1))

    def pick(x, mode):
        return x @ x.T if mode == "a" else -(x @ x.T)

    x = _rand(0, (3, 3))
    got = hlo_amp.compile(repeat, "bf16", static_argnums=1)(x, n=4)
    assert got.shape == jax.jit(repeat, static_argnums=1)(x, n=4).shape == (12, 3)
    picked = hlo_amp.compile(pick, "bf16", static_argnames="mode")(x, "b")
    _close_bf16(picked, jax.jit(pick, static_argnames="mode")(x, "b"))

    def scale(w, x):
        return w * 2.0 + x

    w = jnp.ones(16)
    out = hlo_amp.compile(scale, "bf16", donate_argnums=0)(w=w, x=jnp.ones(16))
    assert w.is_deleted()
    np.testing.assert_array_equal(out, 3.0 * np.ones(16))


@pytest.mark.parametrize("policy", ["bf16", "fp8,scaling=delayed"])
def test_a_decorated_method_is_bound_like_jax_jit(policy):
    class Scaled:
        def __init__(self, n):
            self.n = n

        def __hash__(self):
            return hash(self.n)

        def __eq__(self, other):
            return isinstance(other, Scaled) and other.n == self.n

        @functools.partial(hlo_amp.compile, policy=policy, static_argnums=0)
        def apply(self, x, w):
            return (x @ w) * self.n

    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    got = Scaled(3).apply(x, w)
    np.testing.assert_allclose(got, (x @ w) * 3, rtol=0.1, atol=0.1)
    assert Scaled.apply.__get__(None, Scaled) is Scaled.__dict__["apply"]


@pytest.mark.parametrize("policy", ["bf16", "fp8,scaling=delayed"])
def test_under_disable_jit_the_function_runs_op_by_op_like_jax_jit(policy):
    seen = []

    def debugged(x, w):
        seen.append(float(x.sum()))  # a concrete value, as under jax.jit
        return x @ w

    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    with jax.disable_jit():
        out = hlo_amp.compile(debugged, policy)(x, w)
    np.testing.assert_array_equal(out, x @ w)  # f32, op by op
    assert seen == [float(x.sum())]


def test_trace_then_lower_lowers_what_was_traced():
    """As jax's Traced.lower: the program traced under x64 or HIGHEST precision is the
    one lowered (.lower() traced again where it was called: f32 in and out, the HIGHEST
    dot rewritten to bf16); a device target, which traces again, refuses another
    configuration in one line; the rest of jax's Traced is there (args_info, in_tree)."""
    def fn(x, w):
        return x @ w

    x = np.ones((8, 8))
    amp = hlo_amp.compile(fn, "bf16")
    with jax.enable_x64(True):
        traced = amp.trace(x, x)
    assert traced.lower().out_info.dtype == jnp.float64
    with pytest.raises(ValueError, match=r"traced under another jax configuration"):
        traced.lower(target="h100")
    with jax.default_matmul_precision("highest"):
        traced = amp.trace(jnp.ones((8, 8)), jnp.ones((8, 8)))
    text = traced.lower().as_text()
    assert "HIGHEST" in text and "bf16" not in text
    want = jax.jit(fn).trace(jnp.ones((8, 8)), jnp.ones((8, 8)))
    assert traced.in_tree == want.in_tree and traced.out_tree == want.out_tree
    assert len(traced.args_info[0]) == 2


def test_serializing_a_compiled_object_names_its_jax_form():
    """jax.experimental.serialize_executable.serialize of hlo_amp's compiled object was
    a bare AttributeError '_executable'; its jax_compiled serializes."""
    from jax.experimental import serialize_executable

    x = jnp.ones((4, 8))
    compiled = hlo_amp.compile(_matmul, "bf16").lower(x, jnp.ones((8, 8))).compile()
    with pytest.raises(AttributeError, match=r"serialize its jax_compiled"):
        serialize_executable.serialize(compiled)
    loaded = serialize_executable.deserialize_and_load(
        *serialize_executable.serialize(compiled.jax_compiled))
    np.testing.assert_array_equal(loaded(x, jnp.ones((8, 8))), compiled(x, jnp.ones((8, 8))))


def test_a_changed_trace_context_traces_anew_like_jax_jit():
    # jax.jit keys its cache on the configuration a trace reads; a program exported
    # before it changed must not answer after.
    x, w = _rand(0, (64, 64)), _rand(1, (64, 64))
    amp = hlo_amp.compile(_matmul, "bf16")
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.abs(amp(x, w) - exact).max() > 1e-2  # bf16 operands
    with jax.default_matmul_precision("highest"):  # a pinned precision is kept (policies.md)
        want = jax.jit(_matmul)(x, w)
        np.testing.assert_allclose(amp(x, w), want, rtol=1e-5, atol=1e-5)
    assert np.abs(amp(x, w) - exact).max() > 1e-2  # and back

    def counted(x):
        return x @ x.T, jnp.arange(3), jnp.ones(2) * 0.5

    amp = hlo_amp.compile(counted, "bf16")
    assert [o.dtype for o in amp(x)] == [jnp.float32, jnp.int32, jnp.float32]
    with jax.enable_x64(True):
        assert ([o.dtype for o in amp(x)] == [o.dtype for o in jax.jit(counted)(x)]
                == [jnp.float32, jnp.int64, jnp.float64])


# ---- 2. AOT ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lowered_matmul():
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    return hlo_amp.compile(_matmul, "bf16").lower(x, w), (x, w)


def test_lowered_text_has_bf16_dot(lowered_matmul):
    lowered, _ = lowered_matmul
    text = lowered.as_text()
    assert re.search(r"stablehlo\.convert %\S+ : \(tensor<4x8xf32>\) -> tensor<4x8xbf16>",
                     text)
    assert re.search(r"stablehlo\.dot_general .*\(tensor<4x8xbf16>, tensor<8x3xbf16>\) "
                     r"-> tensor<4x3xf32>", text)
    # the signature is unchanged
    assert "@main(%arg0: tensor<4x8xf32>, %arg1: tensor<8x3xf32>)" in text
    original = lowered.original_text()
    assert "bf16" not in original
    assert "stablehlo.convert" not in original
    assert "stablehlo.dot_general" in original
    assert "loc(" in lowered.as_text(debug_info=True)


def test_lowered_report(lowered_matmul):
    lowered, _ = lowered_matmul
    report = lowered.report()
    assert isinstance(report, hlo_amp.Report)
    (decision,) = report.decisions
    assert decision.op_kind == "dot_general"
    assert decision.changed and decision.low_precision
    assert decision.operands_before == ("f32", "f32")
    assert decision.operands_after == ("bf16", "bf16")
    assert decision.result_after == "f32"
    assert decision.kept_by_xla is None  # not compiled yet
    assert "kept by XLA" not in report.summary()


def test_compiled_hlo_analyses_and_call(lowered_matmul):
    lowered, (x, w) = lowered_matmul
    compiled = lowered.compile()
    hlo = compiled.as_text()
    assert hlo.startswith("HloModule")
    assert re.search(r"= f32\[4,3\]\{1,0\} dot\(", hlo)
    assert "bf16[4,8]" in hlo
    assert compiled.memory_analysis() is not None
    assert compiled.cost_analysis() is not None
    direct = hlo_amp.compile(_matmul, "bf16")(x, w)
    np.testing.assert_array_equal(compiled(x, w), direct)


def test_as_text_through_hlo_amp_opt(lowered_matmul, tmp_path):
    lowered, _ = lowered_matmul
    first = tmp_path / "amp.mlir"
    first.write_text(lowered.as_text())
    second = tmp_path / "amp2.mlir"
    proc = subprocess.run([HLO_AMP_OPT, str(first), "--policy", "bf16", "-o", str(second)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    again = second.read_text()
    assert again.count("stablehlo.convert") == first.read_text().count("stablehlo.convert")
    assert "tensor<4x8xbf16>, tensor<8x3xbf16>) -> tensor<4x3xf32>" in again


# ---- 3. kept by XLA ------------------------------------------------------------------------


def test_kept_by_xla_forward_matmul(lowered_matmul):
    lowered, _ = lowered_matmul
    report = lowered.compile().report()
    assert "kept by XLA: 1/1" in report.summary()
    (decision,) = report.decisions
    assert decision.kept_by_xla is True
    assert lowered.report().decisions[0].kept_by_xla is None  # the lowered copy is untouched


def test_kept_by_xla_counts_every_converted_op():
    x = _rand(0, (4, 8))
    y = jnp.zeros((4, 4))
    report = hlo_amp.compile(jax.grad(_loss), "bf16").lower(_params(), x, y).compile().report()
    match = re.search(r"kept by XLA: (\d+)/(\d+)", report.summary())
    assert match, report.summary()
    checked = [d for d in report.decisions if d.kept_by_xla is not None]
    assert int(match.group(2)) == len(checked) > 0
    assert int(match.group(1)) == sum(d.kept_by_xla for d in checked)


# ---- 4. training composes -------------------------------------------------------------------


def _train_step(optimizer):
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def _checkpointed_mlp_loss(ws, x):
    def layer(w, x):
        with jax.named_scope("mlp"):
            return jnp.tanh(x @ w)
    for w in ws:
        x = jax.checkpoint(layer)(w, x)
    return jnp.sum(x)


@pytest.mark.parametrize("policy", ["mixed_bfloat16,backward=keep",
                                    "bf16,scope:mlp=float16,backward=keep"])
def test_backward_keep_leaves_remats_recomputed_forward_to_the_forward_rules(policy):
    # The recomputed forward recomputes the forward's values: kept in f32 under
    # backward=keep, the backward would read activations of another precision.
    ws = [_rand(i, (16, 16), 0.3) for i in range(2)]
    report = hlo_amp.compile(jax.grad(_checkpointed_mlp_loss), policy).lower(
        ws, _rand(5, (8, 16))).report()
    by_direction = {}
    for d in report.decisions:
        by_direction.setdefault(d.direction, []).append(d)
    assert set(by_direction) == {"forward", "recomputed", "backward"}, str(report)
    forward_dtypes = {d.operands_after for d in by_direction["forward"]}
    assert len(forward_dtypes) == 1 and "f32" not in next(iter(forward_dtypes))
    assert {d.operands_after for d in by_direction["recomputed"]} == forward_dtypes
    assert {d.rule for d in by_direction["recomputed"]} == {d.rule for d in by_direction["forward"]}
    assert all(d.rule == "backward" and d.operands_after == ("f32", "f32")
               for d in by_direction["backward"]), str(report)


@pytest.mark.parametrize(("optimizer", "lr_sign"),
                         [(optax.sgd(0.1), False), (optax.adam(1e-2), True)],
                         ids=["sgd", "adam"])
def test_train_step_converts_backward_dots(optimizer, lr_sign):
    params, x = _params(), _rand(3, (4, 8))
    y = _rand(4, (4, 4))
    opt_state = optimizer.init(params)
    step = _train_step(optimizer)
    amp = hlo_amp.compile(step, "bf16")
    report = amp.lower(params, opt_state, x, y).report()
    backward = [d for d in report.decisions if d.direction == "backward"]
    forward = [d for d in report.decisions if d.direction == "forward"]
    assert len(forward) == 2 and len(backward) >= 3
    assert all(d.low_precision for d in report.decisions), str(report)

    new_params, _, loss = amp(params, opt_state, x, y)
    want_params, _, want_loss = jax.jit(step)(params, opt_state, x, y)
    _close_bf16(loss, want_loss)
    for got, want, old in zip(jax.tree_util.tree_leaves(new_params),
                              jax.tree_util.tree_leaves(want_params),
                              jax.tree_util.tree_leaves(params)):
        assert got.dtype == want.dtype == jnp.float32
        # compare the updates: Adam's first step is lr * sign(g), so a near-zero
        # gradient whose sign bf16 flips moves by 2 * lr; SGD's update is lr * g.
        bound = 2 * 1e-2 + 1e-6 if lr_sign else None
        if bound is None:
            _close_bf16(got - old, want - old)
        else:
            assert float(jnp.max(jnp.abs(got - want))) <= bound
            assert float(jnp.mean(jnp.abs(got - want) > 1e-4)) < 0.1


def test_train_step_scope_rule_covers_backward():
    optimizer = optax.sgd(0.1)
    params, x, y = _params(), _rand(3, (4, 8)), _rand(4, (4, 4))
    amp = hlo_amp.compile(_train_step(optimizer), "bf16,scope:head=float32")
    report = amp.lower(params, optimizer.init(params), x, y).report()
    head = [d for d in report.decisions if d.scope.split("/")[0] == "head"]
    rest = [d for d in report.decisions if d.scope.split("/")[0] != "head"]
    assert {d.direction for d in head} == {"forward", "backward"}, str(report)
    assert not any(d.low_precision for d in head), str(report)
    assert all(d.operands_after == ("f32", "f32") for d in head)
    assert {d.direction for d in rest} == {"forward", "backward"}
    assert all(d.low_precision for d in rest), str(report)


def test_grad_of_compiled_loss_matches_f32():
    params, x, y = _params(), _rand(3, (4, 8)), _rand(4, (4, 4))
    amp_loss = hlo_amp.compile(_loss, "bf16")
    grads = jax.grad(amp_loss)(params, x, y)
    want = jax.grad(_loss)(params, x, y)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(want)
    for name in want:
        _close_bf16(grads[name], want[name])
    # bf16 really happened: not bit-identical to f32
    assert not all(np.array_equal(grads[k], want[k]) for k in ("w1", "w2"))


def _dot_count(hlo: str) -> int:
    return len(re.findall(r" dot\(", hlo))


def test_grad_does_not_recompute_forward():
    params, x, y = _params(), _rand(3, (4, 8)), _rand(4, (4, 4))
    amp_hlo = jax.jit(jax.grad(hlo_amp.compile(_loss, "bf16"))).lower(
        params, x, y).compile().as_text()
    ref_hlo = jax.jit(jax.grad(jax.jit(_loss))).lower(params, x, y).compile().as_text()
    assert _dot_count(ref_hlo) > 0
    assert _dot_count(amp_hlo) <= _dot_count(ref_hlo)
    assert "bf16" in amp_hlo and "bf16" not in ref_hlo


def test_compiled_inside_outer_jit():
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    amp = hlo_amp.compile(_matmul, "bf16")

    @jax.jit
    def outer(x, w):
        return jnp.sin(amp(x, w)) + 1.0

    np.testing.assert_array_equal(outer(x, w), jnp.sin(amp(x, w)) + 1.0)
    _close_bf16(outer(x, w), jnp.sin(x @ w) + 1.0)
    assert "bf16" in outer.lower(x, w).as_text()


def _head_of(w):
    def head(x):
        with jax.named_scope("head"):
            return x @ w
    return head


def test_a_function_closing_over_an_outer_trace_runs_like_jax_jit():
    # A step built inside jax.jit / jax.grad / jax.vmap closes over that trace's values:
    # they become the program's arguments, as jax.jit's closure conversion makes them.
    x, w = _rand(0, (16, 32)), _rand(1, (32, 32))
    want = jax.jit(lambda x, w: _head_of(w)(x))(x, w)
    got = jax.jit(lambda x, w: hlo_amp.compile(_head_of(w), "bf16")(x))(x, w)
    _close_bf16(got, want)
    assert not np.array_equal(got, want)  # bf16 really ran
    kept = jax.jit(lambda x, w: hlo_amp.compile(_head_of(w), "bf16,scope:head=keep")(x))(x, w)
    np.testing.assert_array_equal(kept, want)  # the scopes are the function's own
    grad = jax.grad(lambda w: hlo_amp.compile(_head_of(w), "bf16")(x).sum())(w)
    _close_bf16(grad, jax.grad(lambda w: _head_of(w)(x).sum())(w))
    stacked = jnp.stack([w, 2 * w])
    mapped = jax.vmap(lambda w: hlo_amp.compile(_head_of(w), "bf16")(x))(stacked)
    _close_bf16(mapped, jax.vmap(lambda w: _head_of(w)(x))(stacked))


# ---- 6. effects and errors -------------------------------------------------------------------


def test_debug_callback_fires():
    seen = []

    def fn(x, w):
        y = x @ w
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        return y

    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    out = hlo_amp.compile(fn, "bf16")(x, w)
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], out)


def test_a_python_number_is_traced_on_the_own_cache_path_too():
    # A host callback sends the function through hlo_amp's own cache; a Python number
    # there is traced as jax.jit traces it: a new value (NaN included) compiles nothing
    # new, and cache_size counts the executables as jax.jit's does.
    seen = []

    def scaled(x, w, lr):
        jax.debug.callback(lambda v: seen.append(float(v)), lr)
        return (x @ w) * lr

    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    amp = hlo_amp.compile(scaled, "bf16")
    for lr in (0.5, 0.25, float("nan"), float("nan")):
        out = amp(x, w, lr)
    assert amp.lowerings == 1 and amp.cache_size() == 1
    assert seen[:2] == [0.5, 0.25] and np.isnan(seen[2:]).all()
    assert np.isnan(out).all()
    _close_bf16(amp(x, w, 2.0), (x @ w) * 2.0)
    amp(x, w, 2)  # an int is another type: traced as int32, as by jax.jit
    assert amp.lowerings == 2 and amp.cache_size() == 2


def test_debug_print_fires(capfd):
    def fn(x):
        jax.debug.print("hlo-amp-says {}", jnp.sum(x))
        return x @ x.T

    hlo_amp.compile(fn, "bf16")(jnp.ones((2, 3)))
    jax.effects_barrier()
    assert "hlo-amp-says 6.0" in capfd.readouterr().out


def test_user_exception_reaches_caller():
    def fn(x):
        raise ValueError("boom")

    amp = hlo_amp.compile(fn, "bf16")
    with pytest.raises(ValueError, match="boom"):
        amp(jnp.ones(3))
    with pytest.raises(ValueError, match="boom"):
        amp.lower(jnp.ones(3))
    with pytest.raises(ValueError, match="boom"):
        jax.grad(lambda x: jnp.sum(amp(x)))(jnp.ones(3))


def _loss_with_target(w, x, target, debug=False):
    if debug:  # a host callback: jax.export refuses it, the call goes through .lower
        jax.debug.print("{}", x.sum())
    return jnp.mean((x @ w - target) ** 2)


@pytest.mark.parametrize("policy", ["bf16", "fp8,scaling=delayed"])
@pytest.mark.parametrize("debug", [False, True])
def test_an_argument_named_target_is_the_functions(policy, debug):
    """``loss(w, x, target)`` takes ``target=`` as under jax.jit, in a call, in .lower()
    and its compiled form; it was read as the device to compile for (or given twice)."""
    w, x, y = _rand(0, (8, 4)), _rand(1, (16, 8)), _rand(2, (16, 4))
    fn = functools.partial(_loss_with_target, debug=debug)
    functools.update_wrapper(fn, _loss_with_target)
    amp = hlo_amp.compile(fn, policy)
    want = jax.jit(fn)(w, x, target=y)
    np.testing.assert_allclose(amp(w, x, target=y), want, rtol=0.1)
    if policy == "bf16":
        lowered = amp.lower(w, x, target=y)
        assert lowered.device is None
        np.testing.assert_allclose(lowered.compile()(w, x, target=y), want, rtol=0.1)


def test_lower_for_names_the_device_when_the_function_takes_target():
    w, x, y = _rand(0, (8, 4)), _rand(1, (16, 8)), _rand(2, (16, 4))
    amp = hlo_amp.compile(_loss_with_target, "bf16")
    assert amp.lower_for("h100", w, x, target=y).device.device == "H100"
    # Without a target parameter, target= still names the device.
    assert hlo_amp.compile(_matmul, "bf16").lower(x, w, target="h100").device.device == "H100"


def test_aot_objects_answer_as_jax_jits_do():
    """as_text's dialect, the rest of jax's Lowered and Compiled, eval_shape, clear_cache
    (as_text("hlo") was taken for debug_info and crashed inside MLIR)."""
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    amp = hlo_amp.compile(_matmul, "bf16")
    reference = jax.jit(_matmul)
    lowered = amp.lower(x, w)
    assert "bf16[" in lowered.as_text("hlo") and "bf16[" in lowered.as_text(dialect="hlo")
    assert "bf16[" not in lowered.original_text("hlo")
    with pytest.raises(ValueError, match="dialect='mhlo'; accepted: 'stablehlo'"):
        lowered.as_text("mhlo")
    assert "bf16" in str(lowered.compiler_ir("stablehlo"))
    assert lowered.out_info == reference.lower(x, w).out_info
    assert lowered.cost_analysis()["flops"] > 0
    compiled = lowered.compile()
    assert compiled.output_shardings == reference.lower(x, w).compile().output_shardings
    assert amp.eval_shape(x, w) == reference.eval_shape(x, w)
    traced = amp.trace(x, w)
    assert str(traced.jaxpr) == str(reference.trace(x, w).jaxpr)
    assert traced.out_info == reference.trace(x, w).out_info
    assert traced.lower().as_text() == lowered.as_text()
    assert traced.lower(target="h100").device.device == "H100"
    exported = jax.export.export(jax.jit(amp))(x, w)  # as docs/compile.md says
    assert "bf16" in exported.mlir_module()
    amp(x, w)
    assert amp.cache_size() == 1
    amp.clear_cache()
    assert amp.cache_size() == 0
    np.testing.assert_array_equal(amp(x, w), compiled(x, w))
    delayed = hlo_amp.compile(_matmul, "fp8,scaling=delayed")
    assert delayed.eval_shape(x, w) == reference.eval_shape(x, w)
    delayed(x, w)
    delayed.clear_cache()
    assert delayed.cache_size() == 0
    assert delayed(x, w).shape == (4, 3)


@pytest.mark.parametrize("platforms", [("cpu", "cuda"), ("cuda",)])
def test_a_compiled_function_exports_for_other_platforms(platforms):
    """``jax.export`` with ``platforms=`` (and a lowering for a GPU of a step that takes
    the gradient of a compiled function) exports the rewritten program for those
    platforms; it failed: "exported for platforms ('cpu',) but it is used on ..."."""
    x, w = _rand(0, (4, 8)), _rand(1, (8, 3))
    amp = hlo_amp.compile(_matmul, "bf16")
    exported = jax.export.export(jax.jit(amp), platforms=platforms)(x, w)
    assert exported.platforms == platforms
    assert "tensor<4x8xbf16>, tensor<8x3xbf16>) -> tensor<4x3xf32>" in exported.mlir_module()
    if "cpu" in platforms:
        np.testing.assert_array_equal(exported.call(x, w), amp(x, w))
    step = jax.jit(jax.grad(lambda w: jnp.sum(amp(x, w) ** 2)))
    text = step.trace(w).lower(lowering_platforms=platforms).as_text()
    assert text.count("bf16>) -> tensor<") >= 2  # the forward and the gradient's dot
    # Without the jax.jit it is one line saying so (it was "unexpected keyword argument").
    with pytest.raises(TypeError, match=r"^jax.export.export takes a jax.jit function: "
                                        r"export jax.jit\(_matmul\).*lowering_platforms;"):
        jax.export.export(amp, platforms=platforms)(x, w)
    # Under delayed scaling no jax.jit helps: it says so (it was jax's "must be the
    # result of jit", then, with .trace, the advice above, which does not hold there).
    delayed = hlo_amp.compile(_matmul, "fp8,scaling=delayed")
    with pytest.raises(TypeError, match=r"scaling=delayed .* jax.export cannot export it"):
        jax.export.export(delayed, platforms=platforms)(x, w)
    # A compiled function deep-copies, as a jax.jit one does.
    np.testing.assert_array_equal(copy.deepcopy(amp)(x, w), amp(x, w))


@pytest.mark.parametrize("policy", ["bf16", "fp8,first_matrix_op=none,last_matrix_op=none"])
def test_an_export_of_a_compiled_function_serializes_and_runs_read_back(policy):
    """``Exported.serialize`` of ``jax.jit(compiled)`` (and of its gradient) reads back
    with ``jax.export.deserialize`` to the rewritten program: same signature, the 16-bit
    or fp8 dots, the same results as the compiled function."""
    x, w = _rand(0, (16, 32)), _rand(1, (32, 16))  # fp8 GEMMs take dimensions of 16 up
    amp = hlo_amp.compile(_matmul, policy)
    narrow = "f8E4M3FN" if policy.startswith("fp8") else "bf16"
    read_back = jax.export.deserialize(jax.export.export(jax.jit(amp))(x, w).serialize())
    assert (read_back.in_avals, read_back.out_avals) == (
        (jax.typeof(x), jax.typeof(w)), (jax.typeof(_matmul(x, w)),))
    assert narrow in read_back.mlir_module()
    np.testing.assert_array_equal(read_back.call(x, w), amp(x, w))
    grad = jax.jit(jax.grad(lambda w: jnp.sum(amp(x, w) ** 2)))
    grad_back = jax.export.deserialize(jax.export.export(grad)(w).serialize())
    assert grad_back.mlir_module().count(narrow) >= 2
    np.testing.assert_array_equal(grad_back.call(w), grad(w))


def test_an_output_that_is_no_array_is_named_as_jax_jit_names_it():
    """The error names the user's function and line (it named hlo_amp's flat_fn)."""
    def step(x):
        return x @ x.T, "done"

    x = _rand(0, (3, 3))
    with pytest.raises(TypeError) as want:
        jax.jit(step)(x)
    with pytest.raises(TypeError) as got:
        hlo_amp.compile(step, "bf16")(x)
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]
    assert "test_compile.py" in str(got.value).splitlines()[0]


def _varargs(ws, *data, scale, **kw):
    return [ws, data, scale, kw]


def _statics(a, n, *rest, mode="x", b=None):
    return [a, rest, b]


def _plain(a, b):
    return [a, b]


@pytest.mark.parametrize("fn, args, kwargs, statics", [
    (_varargs, ({"a": 1.0}, 2.0, (3.0, 4.0)), {"scale": 5.0, "extra": {"q": 6.0}, "alpha": 7.0},
     {}),
    (_statics, (1.0, 2, 3.0, [4.0]), {"mode": "y", "b": 5.0},
     {"static_argnums": 1, "static_argnames": "mode"}),
    (_plain, (1.0,), {"b": {"k": (2.0, 3.0)}}, {}),
])
def test_a_calls_argument_names_are_jax_jits(fn, args, kwargs, statics):
    """The passes tell parameters from data by jax.jit's names of a function's arguments
    (``params['w']``), which a call's export is given: the first argument a ``*data``
    takes was named ``args[1]`` there and a keyword ``**kw`` takes by its key alone, where
    jax names them ``data[0]`` and ``kw['x']``, and paired other arguments with results
    (a call 68% off where ``.lower()`` was right, review h129)."""
    from hlo_amp.runtime.signature import leaf_names

    text = jax.jit(fn, keep_unused=True, **statics).lower(*args, **kwargs).as_text(
        debug_info=True)
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    want = re.findall(r'%arg\d+: [^%]*?loc\("([^"]*)"\)', main)
    got = leaf_names(inspect.signature(fn), args, kwargs, statics.get("static_argnums", ()),
                     (statics.get("static_argnames", ()),) if statics else ())
    assert len(want) == len(jax.tree_util.tree_leaves((args, kwargs))) - (2 if statics else 0)
    assert got == want


@jax.tree_util.register_pytree_node_class
class _Checked:
    """A pytree node that checks what it is made of, as a dataclass with validation."""

    def __init__(self, value):
        if not hasattr(value, "shape"):
            raise TypeError(f"_Checked holds an array, not {value!r}")
        self.value = value

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_a_result_node_that_checks_its_leaves_comes_back():
    """The names of a call's results were read off its output tree rebuilt from zeros,
    which a node that checks its leaves refuses: every call raised (review h129). They
    are taken while the function is traced."""
    def step(w, x):
        return _Checked(jnp.tanh(x @ w))

    w, x = _rand(0, (8, 4)), _rand(1, (2, 8))
    got = hlo_amp.compile(step, "mixed_bfloat16")(w, x)
    assert isinstance(got, _Checked)
    _close_bf16(got.value, jax.jit(step)(w, x).value)


def test_a_symbolic_dimension_reads_as_a_question_mark_in_the_report():
    # It printed MLIR's dynamic-size sentinel, -9223372036854775808x3.
    x = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 8"), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    report = hlo_amp.compile(_matmul, "bf16").lower(x, w).report()
    assert [d.shape for d in report.decisions] == ["?x3"]


@pytest.mark.parametrize("policy", ["bf16", "f16", "mixed_bfloat16", "fp8"])
def test_a_complex_convolution_is_left_as_written(policy):
    """jax lowers a complex convolution as three real ones (Gauss's trick) whose results
    are subtracted: converted to 16 bit, a small imaginary part was mostly rounding
    (relative error 1.59 under bf16). Complex ops stay as written, as a complex dot does."""
    x = (jax.random.normal(jax.random.key(0), (2, 8, 16, 16))
         + 1e-3j * jax.random.normal(jax.random.key(1), (2, 8, 16, 16)))
    k = (jax.random.normal(jax.random.key(2), (16, 8, 3, 3)) / 8).astype(jnp.complex64)

    def conv(x, k):
        return jax.lax.conv(x, k, (1, 1), "SAME")

    want = jax.jit(conv)(x, k)
    amp = hlo_amp.compile(conv, policy)
    got = amp(x, k)
    assert got.dtype == want.dtype
    assert float(jnp.max(jnp.abs(got.imag - want.imag))) <= 1e-5 * float(
        jnp.max(jnp.abs(want.imag)))
    decisions = amp.lower(x, k).report().decisions
    assert len(decisions) == 3 and not any(d.changed for d in decisions)
    assert all("complex" in d.reason for d in decisions)
