"""fp8 delayed scaling (policy ``scaling=delayed``, passes/fp8_state.py, runtime/fp8_state.py):
what the amax history records and how it shifts, the first step's scale 1, the history
length, threading through scan + checkpoint, training numerics against bf16 and current
scaling, overflow with the dynamic loss scaler, the errors, and the fallback to current
scaling where a module carries no state.

Everything runs on CPU (XLA:CPU upcasts the fp8 dots, keeping the fp8 rounding). Shapes
are at least 16 on every GEMM extent, else the dot falls back to bf16 (cuBLASLt padding).
Expected values are computed here with NumPy, never copied from output.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from host_devices import RESULTS, run_on_host_devices

import hlo_amp
from hlo_amp.ir.modules import parse_module
from hlo_amp.policy import Policy
from hlo_amp.runtime.scaler import (
    DynamicScalerState,
    all_finite,
    dynamic_scale_value_and_grad,
    select_tree,
)

# Every dot in fp8 (a small program's first and last matrix ops included), in the accurate
# mode: the recipe's NumPy models quantise the f32 values (the fast mode rounds them to
# bf16 first; tests/py/test_fp8_fast_mode.py covers it).
ALL = "first_matrix_op=none,last_matrix_op=none,propagate=false"
FP8_MAX = 448.0  # e4m3fn


def _delayed(length: int) -> str:
    return f"fp8,scaling=delayed,amax_history={length},{ALL}"


def _mlp_loss(p: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def _mlp_step(p: dict, x: jax.Array):
    value, grads = jax.value_and_grad(_mlp_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, grads), value


def _mlp_params(seed: int = 0) -> tuple[dict, jax.Array]:
    rng = np.random.default_rng(seed)
    p = {"w1": jnp.asarray(rng.standard_normal((32, 32)) / 4, jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 32)) * 3, jnp.float32)
    return p, x


def _amax(a) -> np.float32:
    return np.float32(np.abs(np.asarray(a, np.float32)).max())


def _quantise(x: np.ndarray, scale: np.float32, fmt=ml_dtypes.float8_e4m3fn,
              fmax: float = FP8_MAX) -> np.ndarray:
    """x quantised with a given scale and dequantised (f32, as on CPU)."""
    x = np.asarray(x, np.float32)
    return np.clip(x / scale, -fmax, fmax).astype(fmt).astype(np.float32) * scale


def _delayed_scale(history_column: np.ndarray, fmax: float = FP8_MAX) -> np.float32:
    """The scale the pass takes from a history column: max * (1 / fmax) in f32 (these
    programs' dots are f32 throughout, so the dequantise type is f32: no rounding to
    bf16); 1 where that is 0 or non-finite."""
    scale = np.float32(np.max(history_column)) * np.float32(1.0 / fmax)
    return scale if (scale > 0 and np.isfinite(scale)) else np.float32(1.0)


def _fp8_note(report) -> str:
    """The report's one ``fp8:`` line."""
    (note,) = [n for n in report.notes if n.startswith("fp8:")]
    return note


def _quantised(note: str) -> int:
    """How many tensors an ``fp8:`` line says were quantised."""
    return int(note.split("; ")[1].split(" tensor")[0])


# ---- 1. the history records each step's amax, newest first -------------------------------


def test_history_records_each_steps_amax_and_shifts() -> None:
    p, x = _mlp_params()
    f = hlo_amp.compile(_mlp_step, _delayed(8))
    states, params = [], [p]
    for _ in range(4):
        p, _ = f(p, x)
        params.append(p)
        states.append(np.asarray(f.fp8_state()))
    first = states[0]
    assert first.shape == (8, f.lower(params[0], x).report().fp8_state_columns)
    assert first.shape[1] >= 4  # x, w1, gelu(x @ w1), w2 and the backward cotangents
    # Row 0 after one call: the forward operands' amax, exact in f32 (x, w1, w2 are
    # quantised as the f32 values given, every dot being fp8 with an f32 result).
    recorded = set(first[0].tolist())
    for name, value in (("x", x), ("w1", params[0]["w1"]), ("w2", params[0]["w2"])):
        assert float(_amax(value)) in recorded, name
    assert (first[0] > 0).all() and np.isfinite(first).all()
    assert (first[1:] == 0).all()
    # Each call pushes a row: row i at step k is row i-1 at step k-1.
    for before, after in itertools.pairwise(states):
        np.testing.assert_array_equal(after[1:], before[:-1])
    # The weights changed between calls, and their new amax is what the next row holds.
    for k in range(1, 4):
        row = set(states[k][0].tolist())
        assert float(_amax(params[k]["w1"])) in row and float(_amax(params[k]["w2"])) in row
    assert float(_amax(params[1]["w1"])) != float(_amax(params[0]["w1"]))
    # fp8_state() is a copy: the held history is donated to the next call, the copy
    # stays readable and unchanged.
    copy = f.fp8_state()
    f(p, x)
    np.testing.assert_array_equal(np.asarray(copy), states[-1])
    np.testing.assert_array_equal(np.asarray(f.fp8_state())[1:], states[-1][:-1])


# ---- 2. the first step (empty history) uses scale 1 ---------------------------------------


def _big_matmul_inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    x = (rng.standard_normal((32, 64)) * 400).astype(np.float32)  # |x| up to ~1600
    assert _amax(x) > 2 * FP8_MAX
    return w, x


def test_first_step_scale_is_one_then_the_history_scale() -> None:
    w, x = _big_matmul_inputs()
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = 0.15 * np.abs(exact).max()  # a few e4m3 roundings of a 64-long dot

    delayed = hlo_amp.compile(lambda w, x: x @ w, _delayed(16))
    first = np.asarray(delayed(w, x), np.float64)
    # Scale 1 (TE's first step): x saturates at 448; the product is that of clipped x.
    clipped = _quantise(x, np.float32(1.0)).astype(np.float64) @ _quantise(
        w, np.float32(1.0)).astype(np.float64)
    np.testing.assert_allclose(first, clipped, rtol=0, atol=1e-3 * np.abs(clipped).max())
    assert np.abs(first - exact).max() > 2 * bound  # visibly not the f32 product
    history = np.asarray(delayed.fp8_state())
    assert sorted(history[0].tolist()) == sorted([float(_amax(x)), float(_amax(w))])

    second = np.asarray(delayed(w, x), np.float64)
    assert np.abs(second - exact).max() <= bound
    # The second call's scale is the history's: a NumPy model of that recipe matches.
    model = (_quantise(x, _delayed_scale(history[:, list(history[0]).index(_amax(x))]))
             .astype(np.float64)
             @ _quantise(w, _delayed_scale(history[:, list(history[0]).index(_amax(w))]))
             .astype(np.float64))
    tolerance = 64 * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-6
    assert (np.abs(second - model) <= tolerance).all()

    # Current scaling needs no history: right from the first call.
    current = hlo_amp.compile(lambda w, x: x @ w, f"fp8,{ALL}")
    assert np.abs(np.asarray(current(w, x), np.float64) - exact).max() <= bound


# ---- 3. the history length ----------------------------------------------------------------


def test_history_keeps_amax_history_rows_and_drops_the_oldest() -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    factors = [64.0, 1.0, 0.5, 2.0, 1.0, 1.0]  # one large step, then it ages out
    f = hlo_amp.compile(lambda w, x: x @ w, _delayed(3))
    amaxes: list[np.float32] = []
    for step, factor in enumerate(factors):
        xs = x * np.float32(factor)
        before = np.asarray(f.fp8_state()) if step else np.zeros((3, 2), np.float32)
        y = np.asarray(f(w, xs), np.float64)
        amaxes.append(_amax(xs))
        state = np.asarray(f.fp8_state())
        assert state.shape == (3, 2)
        column = list(state[0]).index(_amax(xs))  # x's column (w's amax differs)
        expected = (amaxes[::-1] + [0, 0, 0])[:3]  # the 3 newest, newest first
        np.testing.assert_array_equal(state[:, column], np.asarray(expected, np.float32))
        # The scale this call used: the maximum over the history before it.
        s_x = _delayed_scale(before[:, column])
        s_w = _delayed_scale(before[:, 1 - column])
        model = _quantise(xs, s_x).astype(np.float64) @ _quantise(w, s_w).astype(np.float64)
        tolerance = 64 * 2.0**-24 * (np.abs(xs) @ np.abs(w)) + 1e-6
        assert (np.abs(y - model) <= tolerance).all(), step
    # Steps 1-3 still saw the 64x step's amax; by step 4 it had dropped out.
    assert _delayed_scale(np.asarray([amaxes[0]])) > 8 * _delayed_scale(
        np.asarray(amaxes[1:4]))
    assert float(_amax(x * np.float32(64))) not in set(np.asarray(f.fp8_state()).ravel())


# ---- 4. threading through a scan over checkpointed layers ----------------------------------


def _scan_step(p: dict, x: jax.Array):
    def loss(p: dict, x: jax.Array) -> jax.Array:
        @jax.checkpoint
        def layer(h, w):
            return h + jnp.tanh(h @ w) / 4, None

        h = x @ p["w_in"]
        h, _ = jax.lax.scan(layer, h, p["layers"])
        return jnp.mean((h @ p["w_out"] - 1.0) ** 2)

    value, grads = jax.value_and_grad(loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, grads), value


def test_scan_with_checkpoint_threads_the_history_and_trains_like_current() -> None:
    rng = np.random.default_rng(4)
    p0 = {"w_in": jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32),
          "layers": jnp.asarray(rng.standard_normal((3, 32, 32)) / 6
                                * np.asarray([1.0, 4.0, 0.5])[:, None, None], jnp.float32),
          "w_out": jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)

    delayed = hlo_amp.compile(_scan_step, _delayed(4))
    lowered = delayed.lower(p0, x)
    text = lowered.as_text()
    assert "stablehlo.while" in text and "func.call" in text  # scan body, remat calls
    assert parse_module(text).operation.verify()  # parse_module verifies, too
    report = lowered.report()
    note = _fp8_note(report)
    quantised = _quantised(note)
    per_iteration = int(note.split("one per loop iteration for ")[1].split(" ")[0])
    # A tensor quantised in the 3-layer scan (its body or the remat'd function it calls)
    # has a column per layer; the others one each.
    assert 0 < per_iteration < quantised
    assert report.fp8_state_columns == quantised + 2 * per_iteration
    assert (f"delayed scaling ({quantised} from an amax history of 4 step(s), in "
            f"{report.fp8_state_columns} columns") in note
    assert "does not reach" not in note
    # Quantisations inside the scanned body exist: some dot in the while body is fp8.
    body = text[text.index("stablehlo.while"):]
    assert "f8E4M3FN" in body

    current = hlo_amp.compile(_scan_step, f"fp8,{ALL}")
    p_d, p_c = p0, p0
    losses_d, losses_c = [], []
    for _ in range(20):
        p_d, l_d = delayed(p_d, x)
        p_c, l_c = current(p_c, x)
        losses_d.append(float(l_d))
        losses_c.append(float(l_c))
        if len(losses_d) == 1:
            # The scanned layer weight has a column per layer, each with its own amax
            # (layer 1 is 4x larger than layer 0, layer 2 half), as current scaling takes.
            row = set(np.asarray(delayed.fp8_state())[0].tolist())
            layers = np.asarray(p0["layers"])
            assert {float(_amax(layer)) for layer in layers} <= row
    state = np.asarray(delayed.fp8_state())
    assert np.isfinite(state).all() and (state > 0).all()  # every column, 4 rows filled
    assert losses_d[-1] < 0.7 * losses_d[0]  # it trains
    assert abs(losses_d[-1] - losses_c[-1]) <= 0.02 * losses_c[-1], (losses_d, losses_c)


def _scanned_forward(p: dict, x: jax.Array) -> jax.Array:
    def layer(h, w):
        return jnp.tanh(h @ w) * 8.0, None

    h, _ = jax.lax.scan(layer, x, p["layers"])
    return h @ p["w_out"]


def _counted_forward(p: dict, x: jax.Array) -> jax.Array:
    """The same layers in a while_loop whose counter runs 2, 5, 8, 11 (the iteration
    number is read from it: (counter - 2) / 3)."""
    def body(carry):
        i, h = carry
        w = jax.lax.dynamic_index_in_dim(p["layers"], (i - 2) // 3, keepdims=False)
        return i + 3, jnp.tanh(h @ w) * 8.0

    _, h = jax.lax.while_loop(lambda carry: carry[0] < 14, body, (2, x))
    return h @ p["w_out"]


@pytest.mark.parametrize("forward", [_scanned_forward, _counted_forward])
def test_a_scanned_layer_is_scaled_by_its_own_history_as_current_scaling_is(forward) -> None:
    """Layers 1000x apart in one scan, a history of one step, one input: each call's
    scales are the last call's amax, so once every layer's input is computed from exact
    scales (layer k's from call k + 2 on; the first call quantises with scale 1) the
    output is current scaling's bit for bit. A column shared by the layers (scaled by
    the largest) is not."""
    rng = np.random.default_rng(7)
    sizes = np.asarray([1.0, 1000.0, 0.001, 3.0], np.float32)[:, None, None]
    p = {"layers": jnp.asarray(rng.standard_normal((4, 32, 32)) / 6 * sizes, jnp.float32),
         "w_out": jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    delayed = hlo_amp.compile(forward, _delayed(1))
    current = hlo_amp.compile(forward, f"fp8,{ALL}")
    report = delayed.lower(p, x).report()
    note = _fp8_note(report)
    assert "one per loop iteration for 2 of them" in note  # the body's h and w
    expected = np.asarray(current(p, x))
    outputs = [np.asarray(delayed(p, x)) for _ in range(6)]
    assert not np.array_equal(outputs[0], expected)  # scale 1 on the first call
    np.testing.assert_array_equal(outputs[-1], expected)
    state = np.asarray(delayed.fp8_state())
    layers = np.asarray(p["layers"])
    assert {float(_amax(layer)) for layer in layers} <= set(state[0].tolist())


@pytest.mark.parametrize("length", [256, 257])
def test_a_scan_of_more_than_256_iterations_shares_one_column(length) -> None:
    """A column per iteration up to 256 iterations (a scan over layers); a longer scan (a
    sequence's time steps) would multiply the state by its length, so one column."""
    def unrolled_in_time(w, x):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=length)[0]

    w, x = jnp.ones((16, 16)) / 16, jnp.ones((16, 16))
    report = hlo_amp.compile(unrolled_in_time, _delayed(2)).lower(w, x).report()
    note = _fp8_note(report)
    quantised = _quantised(note)
    assert quantised == 2  # h and w in the body
    assert report.fp8_state_columns == (2 * length if length <= 256 else 2)


# ---- 5. numerics: a tiny decoder against bf16 ---------------------------------------------


VOCAB, D, HEADS, SEQ, BATCH, LAYERS = 32, 32, 2, 16, 4, 2


def _decoder_params(seed: int = 0) -> dict:
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

    def normal(shape, scale):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    layers = {"qkv": normal((LAYERS, D, 3 * D), D**-0.5),
              "out": normal((LAYERS, D, D), D**-0.5),
              "up": normal((LAYERS, D, 2 * D), D**-0.5),
              "down": normal((LAYERS, 2 * D, D), (2 * D)**-0.5)}
    return {"embed": normal((VOCAB, D), 1.0), "pos": normal((SEQ, D), 0.1),
            "layers": layers, "head": normal((D, VOCAB), D**-0.5)}


def _rms(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)


def _decoder_loss(p: dict, tokens: jax.Array) -> jax.Array:
    h = p["embed"][tokens[:, :-1]] + p["pos"][: SEQ - 1]
    mask = jnp.tril(jnp.ones((SEQ - 1, SEQ - 1), bool))
    for i in range(LAYERS):
        w = jax.tree.map(lambda a, i=i: a[i], p["layers"])
        with jax.named_scope(f"layer_{i}"):
            q, k, v = jnp.split(_rms(h) @ w["qkv"], 3, -1)
            heads = lambda a: a.reshape(*a.shape[:2], HEADS, D // HEADS)
            scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(D // HEADS)
            scores = jnp.where(mask, scores, -1e9)
            att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), heads(v))
            h = h + att.reshape(h.shape) @ w["out"]
            h = h + jax.nn.gelu(_rms(h) @ w["up"]) @ w["down"]
    logits = _rms(h) @ p["head"]
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def _adam_step(p: dict, m: dict, v: dict, t: jax.Array, tokens: jax.Array):
    loss, g = jax.value_and_grad(_decoder_loss)(p, tokens)
    t = t + 1
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
    v = jax.tree.map(lambda v, g: 0.99 * v + 0.01 * g * g, v, g)
    lr = 3e-3 * jnp.sqrt(1 - 0.99**t) / (1 - 0.9**t)
    p = jax.tree.map(lambda p, m, v: p - lr * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * p), p, m, v)
    return p, m, v, t, loss


def _bigram_batches(steps: int) -> np.ndarray:
    """Token sequences from a fixed random bigram chain (entropy floor well above 0, so
    the final loss is a plateau each policy can be compared at)."""
    rng = np.random.default_rng(11)
    transition = rng.dirichlet(np.full(VOCAB, 0.1), size=VOCAB)
    cumulative = np.cumsum(transition, 1)
    tokens = np.empty((steps, BATCH, SEQ), np.int32)
    tokens[:, :, 0] = rng.integers(0, VOCAB, (steps, BATCH))
    for t in range(1, SEQ):
        u = rng.random((steps, BATCH, 1))
        prev = cumulative[tokens[:, :, t - 1]]
        tokens[:, :, t] = np.minimum((u > prev).sum(-1), VOCAB - 1)
    return tokens


def _train_decoder(policy: str, batches: np.ndarray) -> tuple[list[float], object]:
    p = _decoder_params()
    zeros = jax.tree.map(jnp.zeros_like, p)
    m, v, t = zeros, zeros, jnp.zeros((), jnp.float32)
    step = hlo_amp.compile(_adam_step, policy)
    losses = []
    for tokens in batches:
        p, m, v, t, loss = step(p, m, v, t, tokens)
        losses.append(float(loss))
    return losses, step


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("unroll", [None, 2])
def test_a_function_called_at_two_sites_gives_each_call_its_own_columns(unroll) -> None:
    """A jax.jit layer called per layer (one private function, several call sites), or a
    scan unrolled twice, shared one history column between its calls: a layer of small
    weights was scaled by another's amax and came out all zeros (relative error 1.0)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    scales = (1e3, 1e-3, 1.0, 1.0)
    ws = jnp.stack([jnp.asarray(rng.standard_normal((64, 64)) / 8 * s, jnp.float32)
                    for s in scales])

    @jax.jit
    def dense(h, w):
        return h @ w

    if unroll is None:
        def f(ws, x):
            return jnp.stack([dense(x, w) for w in ws])
    else:
        def f(ws, x):
            def body(carry, w):
                return carry, jax.checkpoint(lambda w: x @ w)(w)
            return jax.lax.scan(body, 0.0, ws, unroll=unroll)[1]

    policy = "fp8,first_matrix_op=none,last_matrix_op=none"
    want, current = jax.jit(f)(ws, x), hlo_amp.compile(f, policy)(ws, x)
    delayed = hlo_amp.compile(f, policy + ",scaling=delayed,amax_history=4")
    for _ in range(3):
        got = delayed(ws, x)
    for layer in range(len(scales)):
        assert _relative(got[layer], want[layer]) < 1.5 * _relative(current[layer],
                                                                     want[layer]) + 1e-3
    assert delayed.fp8_state().shape == (4, 2 * len(scales))  # x and w per call


def test_one_history_however_the_arguments_are_written() -> None:
    """By keyword, a default passed, a NumPy float64 batch (an f32 program without x64):
    jax traces one program, and the call kept its history (each started a new one with
    scale 1: 0.66 off against 0.15)."""
    rng = np.random.default_rng(0)

    def forward(w, x, lr=0.1):
        return jnp.tanh(x @ w) @ w.T * lr

    w = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((32, 64)) * 1000, jnp.float32)  # amax past 448
    step = hlo_amp.compile(forward, "fp8,scaling=delayed,amax_history=16,"
                                    "first_matrix_op=none,last_matrix_op=none")
    want = jax.jit(forward)(w, x)
    for _ in range(3):
        positional = _relative(step(w, x), want)
    for got in (step(w, x=x), step(w, x, 0.1), step(w, np.asarray(x, np.float64))):
        assert _relative(got, want) == pytest.approx(positional, rel=1e-6)


def test_a_step_the_loss_scaler_retries_records_the_accepted_try() -> None:
    """redo_on_nan retries an overflowed step at half the loss scale: the history keeps
    the accepted try's amaxes, those of the same step started at that scale. The
    overflowed tries' inf won the loop's running maximum, and the gradient's column
    recorded 0 (hunt h106)."""
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"w1": jax.random.normal(k[0], (32, 64)) / 6,
              "w2": jax.random.normal(k[1], (64, 64)) / 8,
              "w3": jax.random.normal(k[2], (64, 16)) / 8}
    x, y = jax.random.normal(k[3], (32, 32)), jax.random.normal(k[4], (32, 16))

    def loss(p, x, y):
        h = jax.nn.relu(jax.nn.relu(x @ p["w1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"] - y) ** 2)

    scaled = hlo_amp.dynamic_scale_value_and_grad(loss, redo_on_nan=20)

    def step(p, state, x, y):
        return scaled(p, x, y, dynamic_scaler_state=state)[0]

    policy = "fp8,compute=float16,scaling=delayed,amax_history=4"
    retried = hlo_amp.compile(step, policy)
    state = retried(params, hlo_amp.DynamicScalerState(scaler=2.0 ** 30), x, y)
    assert int(state.total_resets) > 0  # f16 overflowed, and the step was retried
    direct = hlo_amp.compile(step, policy)
    again = direct(params, hlo_amp.DynamicScalerState(scaler=float(state.scaler)), x, y)
    assert int(again.total_resets) == 0 and float(again.scaler) == float(state.scaler)
    got, want = np.asarray(retried.fp8_state())[0], np.asarray(direct.fp8_state())[0]
    assert (want > 0).all()
    np.testing.assert_array_equal(got, want)

    # One gradient overflows, the others stay finite in the rejected tries, 2**r times
    # the accepted try's: those won the loop's running maximum (review h107). Only the
    # last try's amaxes leave the loop.
    wide = {**params, "w2": params["w2"] * 16}

    def small_loss(p, x, y):
        return loss(p, x, y) * 1e-3

    small = hlo_amp.dynamic_scale_value_and_grad(small_loss, redo_on_nan=20)

    def small_step(p, state, x, y):
        return small(p, x, y, dynamic_scaler_state=state)[0]

    every = policy + ",first_matrix_op=none,last_matrix_op=none"
    retried = hlo_amp.compile(small_step, every)
    state = retried(wide, hlo_amp.DynamicScalerState(scaler=2.0 ** 28), x, y)
    assert int(state.total_resets) > 0
    direct = hlo_amp.compile(small_step, every)
    direct(wide, hlo_amp.DynamicScalerState(scaler=float(state.scaler)), x, y)
    np.testing.assert_array_equal(np.asarray(retried.fp8_state())[0],
                                  np.asarray(direct.fp8_state())[0])

    # Under jax.vmap the loop runs while any member retries: a member done at its first
    # try (whose scale then grows, patience 1) ran its step again at the grown scale,
    # and the history took that run's amaxes (review h109).
    batched = jax.vmap(small_step, in_axes=(0, 0, None, None))
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), wide)

    def states(first: float) -> hlo_amp.DynamicScalerState:
        return hlo_amp.DynamicScalerState(
            patience=jnp.array([2000, 1], jnp.int32), adjust_factor=jnp.full(2, 2.0),
            scaler=jnp.array([first, 2.0 ** 25]), count=jnp.zeros(2, jnp.int32),
            total_resets=jnp.zeros(2, jnp.int32), min_scaler=jnp.ones(2))

    retried = hlo_amp.compile(batched, every)
    state = retried(stacked, states(2.0 ** 30), x, y)
    assert np.asarray(state.total_resets)[0] > 0 and float(state.scaler[0]) == 2.0 ** 25
    direct = hlo_amp.compile(batched, every)
    direct(stacked, states(2.0 ** 25), x, y)
    np.testing.assert_array_equal(np.asarray(retried.fp8_state())[0],
                                  np.asarray(direct.fp8_state())[0])


def test_the_remembered_dtype_names_follow_x64() -> None:
    """A call's key names its arrays' dtypes as jax traces them; the names are
    remembered (NumPy's str took most of a 300-leaf call's time), per x64 setting:
    float64 is f32 without x64 and f64 with it."""
    from hlo_amp.runtime.fp8_state import _canonical_name

    assert _canonical_name(np.dtype("float64")) == "float32"
    with jax.enable_x64(True):
        assert _canonical_name(np.dtype("float64")) == "float64"
    assert _canonical_name(np.dtype("float64")) == "float32"


def test_a_shape_that_moves_a_dot_to_bf16_keeps_another_history() -> None:
    """A dot under 16 rows falls back to bf16, so which tensors own a history's columns
    depends on the shapes: with the same count, b took a's columns (amax 4e6) and came
    out zero (relative error 1.0)."""
    rng = np.random.default_rng(0)

    def f(a, b, w):
        return (a @ w).sum(0), (b @ w).sum(0)

    w = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)

    def batch(n, m):
        return (jnp.asarray(rng.standard_normal((n, 64)) * 1e6, jnp.float32),
                jnp.asarray(rng.standard_normal((m, 64)), jnp.float32))

    step = hlo_amp.compile(f, "fp8,scaling=delayed,amax_history=16,"
                              "first_matrix_op=none,last_matrix_op=none")
    for _ in range(3):
        step(*batch(32, 8), w)  # fp8: a and w; b's 8 rows fall back to bf16
    a, b = batch(8, 32)  # fp8: b and w
    step(a, b, w)
    _, got = step(a, b, w)
    assert _relative(got, jax.jit(f)(a, b, w)[1]) < 0.1


def test_tiny_decoder_fp8_trains_within_2_percent_of_bf16() -> None:
    batches = _bigram_batches(200)
    final = {}
    for policy in ("bf16", "fp8", "fp8,scaling=delayed,amax_history=16"):
        losses, step = _train_decoder(policy, batches)
        assert np.isfinite(losses).all(), policy
        final[policy] = float(np.mean(losses[-20:]))  # the last 20 batches: less noise
        if "delayed" in policy:
            history = np.asarray(step.fp8_state())
            assert history.shape[1] > 0 and np.isfinite(history).all()
            assert (history[0] > 0).all()  # every quantised tensor's amax recorded
        assert losses[-1] < 0.8 * losses[0], (policy, losses[0], losses[-1])
    bf16 = final["bf16"]
    for policy, loss in final.items():
        assert abs(loss - bf16) <= 0.02 * bf16, final


# ---- 6. overflow with the dynamic loss scaler ---------------------------------------------


def _scaled_step(p: dict, state: DynamicScalerState, x: jax.Array):
    def loss(p: dict, x: jax.Array) -> jax.Array:
        y = jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.sum(y**2)  # cotangent 2y * scaler: overflows f32 for a huge scaler

    state, (value, grads) = dynamic_scale_value_and_grad(loss)(p, x,
                                                              dynamic_scaler_state=state)
    finite = all_finite(grads)
    new = jax.tree.map(lambda a, g: a - 2e-3 * g, p, grads)
    return select_tree(finite, new, p), state, value, finite


def test_overflowed_step_is_skipped_and_the_history_records_zero() -> None:
    rng = np.random.default_rng(6)
    p = {"w1": jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32),
         "b1": jnp.zeros((32,), jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32),
         "b2": jnp.zeros((16,), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 32)) * 2, jnp.float32)
    # 2**127 times the cotangent 2y overflows f32 (max ~2**128) wherever |y| >= 1: the
    # first step's gradients are non-finite. Backed off by 2**16, the scaler is fine.
    assert float(jnp.abs(jax.nn.gelu(x @ p["w1"]) @ p["w2"]).max()) > 1.0
    state = DynamicScalerState(scaler=2.0**127, adjust_factor=2.0**16, patience=10**6)
    f = hlo_amp.compile(_scaled_step, _delayed(4))
    columns = f.lower(p, state, x).report().fp8_state_columns
    assert columns > 0

    p1, state1, _, finite = f(p, state, x)
    assert not bool(finite)
    jax.tree.map(np.testing.assert_array_equal, p1, p)  # the update was skipped
    assert float(state1.scaler) == 2.0**111 and int(state1.total_resets) == 1
    history = np.asarray(f.fp8_state())
    assert history.shape == (4, columns) and np.isfinite(history).all()
    # The forward operands were finite and recorded; the overflowed cotangent's amax
    # (inf) was recorded as 0, not inf or NaN.
    assert float(_amax(x)) in set(history[0].tolist())
    assert float(_amax(p["w1"])) in set(history[0].tolist())
    overflowed = history[0] == 0
    assert overflowed.any()

    losses, p_t, s_t = [], p1, state1
    for _ in range(12):
        p_t, s_t, value, finite = f(p_t, s_t, x)
        losses.append(float(value))
        history = np.asarray(f.fp8_state())
        assert np.isfinite(history).all()
        assert bool(finite)
    assert (history > 0).all()  # every column's amax recorded again, scales usable
    assert float(s_t.scaler) == 2.0**111  # no more overflow
    assert losses[-1] < 0.5 * losses[0], losses  # training continued


# ---- 7. errors and the checkpoint round trip -----------------------------------------------


def test_errors() -> None:
    w, x = _big_matmul_inputs()
    f = hlo_amp.compile(lambda w, x: x @ w, _delayed(8))
    with pytest.raises(RuntimeError, match="no fp8 state yet"):
        f.fp8_state()
    with pytest.raises(ValueError, match=r"f32\[8, S\].*\(5, 2\)"):
        f.load_fp8_state(np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError, match=r"\(5,\)"):
        f.load_fp8_state(np.zeros((5,), np.float32))
    # Taken silently before: a bool history changed the loss from 1.02 to 0.088.
    f.load_fp8_state([[1.0, 2.0]] * 8)  # a list (a checkpoint as JSON) is fine
    for bad in (np.ones((8, 2), bool), np.ones((8, 2), np.int32), [[True, False]] * 8):
        with pytest.raises(TypeError, match="an fp8 state is a float array"):
            f.load_fp8_state(bad)
    for bad in (np.nan, np.inf, -1.0):
        with pytest.raises(ValueError, match="finite and not negative"):
            f.load_fp8_state(np.full((8, 2), bad, np.float32))
    f.load_fp8_state(np.zeros((8, 3), np.float32))  # right length, wrong width
    with pytest.raises(ValueError, match=r"\(8, 3\).*2 column.*\(8, 2\)"):
        f(w, x)
    with pytest.raises(TypeError, match="scaling=current"):
        jax.jit(f)(w, x)
    with pytest.raises(TypeError, match="scaling=current"):
        jax.vmap(f, in_axes=(None, 0))(w, x[None])
    # Under a trace with no tracer argument (the arrays closed over): the same error,
    # and no traced history kept (every later call raised UnexpectedTracerError).
    g = hlo_amp.compile(lambda w, x: x @ w, _delayed(8))
    with pytest.raises(TypeError, match="scaling=current"):
        jax.jit(lambda: g(w, x))()
    assert g(w, x).shape == (x.shape[0], w.shape[1])
    for spec in ("bf16,scaling=delayed", "fp8,amax_history=0", "fp8,amax_history=-3",
                 "fp8,scaling=later"):
        with pytest.raises(ValueError):
            Policy.parse(spec)
    assert Policy.parse("fp8,scaling=delayed,amax_history=16").amax_history == 16


def test_state_round_trip_continues_identically() -> None:
    p, x = _mlp_params(1)
    original = hlo_amp.compile(_mlp_step, _delayed(4))
    for _ in range(3):
        p, _ = original(p, x)
    saved = np.asarray(original.fp8_state())
    assert (saved[:3] > 0).all() and (saved[3] == 0).all()

    restored = hlo_amp.compile(_mlp_step, _delayed(4))
    loaded = jnp.asarray(saved)  # a jax array, as a checkpoint library restores it
    restored.load_fp8_state(loaded)
    # Read back before any call, and loaded into a function that has run (its own).
    np.testing.assert_array_equal(np.asarray(restored.fp8_state()), saved)
    original.load_fp8_state(saved)
    np.testing.assert_array_equal(np.asarray(original.fp8_state()), saved)
    p_a, l_a = original(p, x)
    p_b, l_b = restored(p, x)
    # The step donated its own copy: the caller's array is intact and can load again.
    np.testing.assert_array_equal(np.asarray(loaded), saved)
    assert float(l_a) == float(l_b)
    jax.tree.map(np.testing.assert_array_equal, p_a, p_b)
    np.testing.assert_array_equal(np.asarray(original.fp8_state()),
                                  np.asarray(restored.fp8_state()))
    # Without the load, the fresh function starts from zeros (scale 1): it differs.
    fresh = hlo_amp.compile(_mlp_step, _delayed(4))
    p_c, _ = fresh(p, x)
    assert not np.array_equal(np.asarray(p_c["w1"]), np.asarray(p_a["w1"]))


def _task_step(p: dict, x: jax.Array, task: str):
    """A multi-task step: ``task`` (static) picks the head; head "c" has two matrix ops."""
    def loss(p: dict) -> jax.Array:
        h = jax.nn.gelu(x @ p["w1"])
        y = h @ p["w_" + task] if task != "c" else jnp.tanh(h @ p["w_a"]) @ p["w_c"]
        return jnp.mean(y ** 2)

    value, grads = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, grads), value


def _task_params() -> tuple[dict, jax.Array]:
    p, x = _mlp_params(2)
    rng = np.random.default_rng(3)
    # Head b's values are 50 times head a's: a shared history column scales them wrongly.
    p = {"w1": p["w1"], "w_a": p["w2"], "w_b": p["w2"] * 50.0,
         "w_c": jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32)}
    return p, x


@pytest.mark.parametrize("other", ["b", "c"])  # as many quantised tensors as "a"; more
def test_a_static_argument_that_picks_other_tensors_keeps_its_own_history(other) -> None:
    """A step whose static argument picks other weights keeps a history per program:
    after steps of task "a", task ``other`` runs as it would on its own, bit for bit."""
    p, x = _task_params()
    both = hlo_amp.compile(_task_step, _delayed(4), static_argnums=2)
    alone = hlo_amp.compile(_task_step, _delayed(4), static_argnums=2)
    columns = {t: both.lower(p, x, t).report().fp8_state_columns for t in ("a", other)}
    assert (columns["a"] == columns[other]) == (other == "b")
    q, _ = both(p, x, "a")
    q, _ = both(q, x, "a")
    assert (np.asarray(both.fp8_state())[:2] > 0).all()
    for _ in range(2):
        got, got_loss = both(q, x, other)
        want, want_loss = alone(q, x, other)
        assert float(got_loss) == float(want_loss)
        jax.tree.map(np.testing.assert_array_equal, got, want)
        np.testing.assert_array_equal(np.asarray(both.fp8_state(q, x, other)),
                                      np.asarray(alone.fp8_state()))
        q = got
    note = _fp8_note(both.lower(p, x, other).report())
    assert "does not reach" not in note
    # Task "a"'s history is still its own: two rows recorded, then a third.
    both(q, x, "a")
    history = np.asarray(both.fp8_state(q, x, "a"))
    assert history.shape[1] == columns["a"] and (history[:3] > 0).all()
    assert (history[3] == 0).all()


def test_a_checkpoint_of_several_histories_names_each_by_the_arguments() -> None:
    """A multi-task step keeps a history per task: fp8_state() without arguments (the
    last call's) saved one of them and load_fp8_state gave it to whichever task ran
    next (relative error 1.0 there); now it refuses, and fp8_state(*args) /
    load_fp8_state(history, *args) save and restore each, continuing bit for bit."""
    p, x = _task_params()
    original = hlo_amp.compile(_task_step, _delayed(4), static_argnums=2)
    for _ in range(2):
        for task in ("a", "c"):
            original(p, x, task)
    with pytest.raises(ValueError, match=r"keeps 2 fp8 amax histories .*fp8_state\(\*args\)"):
        original.fp8_state()
    saved = {task: np.asarray(original.fp8_state(p, x, task)) for task in ("a", "c")}
    assert saved["a"].shape != saved["c"].shape and all((h[:2] > 0).all() for h in saved.values())
    restored = hlo_amp.compile(_task_step, _delayed(4), static_argnums=2)
    with pytest.raises(ValueError, match="expected"):  # task a's history for task c
        restored.load_fp8_state(saved["a"], p, x, "c")
    for task in ("c", "a"):  # in another order than they ran
        restored.load_fp8_state(saved[task], p, x, task)
    for task in ("a", "c"):
        want, got = original(p, x, task), restored(p, x, task)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_arguments_of_other_widths_keep_another_history_a_new_batch_shares_it() -> None:
    """A step that picks its weights by its input's width quantises other tensors in the
    same number of columns: it shared one history, and the narrow branch, scaled by the
    wide one's amax (1e6 apart), came out all 0 (relative error 1.0) on every call. A
    batch of other rows shares the history (the same tensors)."""
    rng = np.random.default_rng(0)

    def encode(p, feats):
        return feats @ (p["wide"] if feats.shape[1] == 64 else p["narrow"])

    p = {"wide": jnp.asarray(rng.standard_normal((64, 64)) * 1e3, jnp.float32),
         "narrow": jnp.asarray(rng.standard_normal((32, 64)) * 1e-3, jnp.float32)}
    wide, narrow = (jnp.asarray(rng.standard_normal((32, n)), jnp.float32) for n in (64, 32))
    step = hlo_amp.compile(encode, _delayed(16))
    for _ in range(3):
        step(p, wide), step(p, narrow)
    for x in (wide, narrow):
        assert _relative(step(p, x), encode(p, x)) < 0.1
    with pytest.raises(ValueError, match=r"keeps 2 fp8 amax histories .* per argument shape "
                                         r"beyond the leading dimension"):
        step.fp8_state()
    before = np.asarray(step.fp8_state(p, narrow))
    step(p, narrow[:16])  # 16 rows: the same tensors, the same history, one step on
    np.testing.assert_array_equal(np.asarray(step.fp8_state(p, narrow))[1:], before[:-1])


def _matmul_fn(w: jax.Array, x: jax.Array) -> jax.Array:
    return x @ w


def test_a_call_under_another_jax_config_keeps_the_steps_history() -> None:
    """jax.default_matmul_precision("highest") keeps every dot out of fp8: a program of
    its own. Its calls shifted zeros into the step's history (the next call quantised
    with scale 1: 0.73 off against 0.04), and a step first called under it kept current
    scaling and a history of no column for every later call."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((32, 64)) * 1000, jnp.float32)  # amax past 448
    want = _matmul_fn(w, x)
    first_highest = hlo_amp.compile(_matmul_fn, _delayed(2))
    with jax.default_matmul_precision("highest"):
        first_highest(w, x)
    step = hlo_amp.compile(_matmul_fn, _delayed(2))
    for _ in range(3):
        first_highest(w, x), step(w, x)
    assert first_highest.fp8_state().shape == step.fp8_state().shape == (2, 2)
    with jax.default_matmul_precision("highest"):
        step(w, x), step(w, x)
    assert _relative(step(w, x), want) < 0.1
    # A configuration that changes no fp8 dot keeps the step's history: read and
    # restored outside it (the first review of this fix keyed every configuration apart:
    # "no fp8 state for these arguments", a loaded checkpoint ignored).
    with jax.default_device(jax.devices()[0]):
        step(w, x)
    step.load_fp8_state(jnp.full((2, 2), 5000.0), w, x)
    with jax.default_device(jax.devices()[0]):
        step(w, x)
    newest, loaded = np.asarray(step.fp8_state(w, x))  # the call stepped the history on
    assert (newest < 5000).all() and (loaded == 5000).all(), (newest, loaded)


def test_a_short_last_batch_leaves_the_training_history_to_save() -> None:
    """A batch under 16 rows puts every dot back in bf16: a history of no column. Saved
    after such a batch, the checkpoint was that empty history, which the next full batch
    refused (and the training history was lost); now the empty one holds nothing to save,
    and a loaded history waits for a call that quantises."""
    p, x = _mlp_params(1)
    rows = jnp.concatenate([x, x[:8]])  # a full batch, then 8 rows
    original = hlo_amp.compile(_mlp_step, _delayed(4))
    p1, _ = original(p, rows[:len(x)])
    p2, _ = original(p1, rows[len(x):])
    saved = np.asarray(original.fp8_state())
    assert saved.shape[1] > 0 and (saved[0] > 0).all()
    restored = hlo_amp.compile(_mlp_step, _delayed(4))
    restored.load_fp8_state(saved)
    restored(p2, rows[len(x):])  # quantises nothing: the loaded history waits
    jax.tree.map(np.testing.assert_array_equal, restored(p2, x), original(p2, x))


def test_calls_from_several_threads_take_turns() -> None:
    """Each call takes the history, donates it and keeps the new one: concurrent calls
    read a history another had donated ("Buffer has been deleted or donated") and
    overwrote each other's."""
    from concurrent.futures import ThreadPoolExecutor

    p, x = _mlp_params(1)
    step = hlo_amp.compile(_mlp_step, _delayed(64))
    step(p, x)
    with ThreadPoolExecutor(max_workers=4) as pool:
        losses = list(pool.map(lambda _: float(step(p, x)[1]), range(24)))
    assert all(np.isfinite(losses))
    recorded = (np.asarray(step.fp8_state()) > 0).all(axis=1)
    assert recorded.sum() == 25  # one row per call, none lost


def test_a_python_number_and_the_weak_array_a_step_returns_for_it_share_a_history() -> None:
    """Flax's TrainState.step starts as the Python int 0 and comes back a weak int32
    array: jax.jit traces both alike, but they keyed two programs, so the second call
    quantised from an empty history again and fp8_state() refused ("2 histories")."""
    p, x = _mlp_params(1)

    def counted(p, x, state):
        p, loss = _mlp_step(p, x)
        return p, {"step": state["step"] + 1}, loss

    step = hlo_amp.compile(counted, _delayed(4))
    state = {"step": 0}
    for _ in range(3):
        p, state, _ = step(p, x, state)
    assert int(state["step"]) == 3
    history = np.asarray(step.fp8_state())
    assert (history[:3] > 0).all() and (history[3] == 0).all()


def test_a_loaded_history_outlives_a_call_that_fails() -> None:
    """It was taken before the call ran: a failing call (a deleted buffer passed) lost
    it, and the next call started from zeros."""
    p, x = _mlp_params(1)
    original = hlo_amp.compile(_mlp_step, _delayed(4))
    for _ in range(2):
        p, _ = original(p, x)
    saved = np.asarray(original.fp8_state())
    resumed = hlo_amp.compile(_mlp_step, _delayed(4))
    resumed.load_fp8_state(saved)
    dead = jax.tree.map(jnp.copy, p)
    dead["w1"].delete()
    with pytest.raises(RuntimeError):
        resumed(dead, x)
    np.testing.assert_array_equal(np.asarray(resumed.fp8_state()), saved)
    jax.tree.map(np.testing.assert_array_equal, resumed(p, x), original(p, x))


def test_a_pending_load_is_what_fp8_state_of_the_arguments_gives_and_a_later_load_wins(
        ) -> None:
    """fp8_state(*args) gave the program's previous history while a load was pending
    for its next call; a load with arguments after one without left the earlier one to
    the next call."""
    p, x = _mlp_params(1)
    step = hlo_amp.compile(_mlp_step, _delayed(4))
    step(p, x)
    columns = step.fp8_state().shape[1]
    first, second = (np.full((4, columns), value, np.float32) for value in (3.0, 5.0))
    step.load_fp8_state(first)
    np.testing.assert_array_equal(np.asarray(step.fp8_state(p, x)), first)
    step.load_fp8_state(second, p, x)
    np.testing.assert_array_equal(np.asarray(step.fp8_state()), second)
    step(p, x)
    assert (np.asarray(step.fp8_state())[1] == 5.0).all()  # started from the second


def test_an_argument_error_names_the_steps_own_position() -> None:
    """The history goes first in the step the wrapper calls: an error named args[N+1]."""
    p, x = _mlp_params(1)
    current = hlo_amp.compile(lambda p, x, tag: _mlp_step(p, x), "fp8")
    delayed = hlo_amp.compile(lambda p, x, tag: _mlp_step(p, x), _delayed(4))
    messages = []
    for step in (current, delayed):
        with pytest.raises(TypeError) as raised:
            step(p, x, "a string")
        messages.append(str(raised.value).split(":")[1])
    assert messages[0] == messages[1] and "args[2]" in messages[0]
    with pytest.raises(TypeError, match="got a ShapeDtypeStruct"):
        delayed.load_fp8_state(jax.ShapeDtypeStruct((4, 3), jnp.float32))


def test_the_stateful_step_traces_as_it_lowers() -> None:
    p, x = _mlp_params(1)
    step = hlo_amp.compile(_mlp_step, _delayed(4))
    traced = step.trace(p, x)
    history = traced.jaxpr.in_avals[0]
    assert history.shape == (4, step.lower(p, x).report().fp8_state_columns)
    # For a device target its history is the target's width: trace(...).lower(target=)
    # took this machine's (CPU keeps small dots bf16) and ran every fp8 GEMM at current
    # scaling.
    policy = _delayed(4) + ",only_if_faster=true"
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    step = hlo_amp.compile(lambda x, w: jnp.tanh(x @ w), policy)
    direct = step.lower(big, big, target="h100")
    via_trace = step.trace(big, big).lower(target="h100")
    assert via_trace.history_shape == direct.history_shape == (
        4, direct.report().fp8_state_columns) and direct.history_shape[1] > 0


def test_a_typed_prng_key_argument_is_taken() -> None:
    """A step drawing dropout from a ``jax.random.key`` (NNX's Rngs, Equinox's ``key=``):
    the history's key read the key's dtype as a number type and the call failed
    ("canonicalize_dtype called on extended dtype key<fry>")."""
    p, x = _mlp_params(4)

    def step(p, x, key):
        keep = jax.random.bernoulli(key, 0.9, x.shape)
        return jax.value_and_grad(_mlp_loss)(p, jnp.where(keep, x, 0.0))

    f = hlo_amp.compile(step, _delayed(4))
    for seed in range(3):
        value, _ = f(p, x, jax.random.key(seed))
        expected, _ = jax.jit(step)(p, x, jax.random.key(seed))
        assert abs(float(value) - float(expected)) <= 0.1 * abs(float(expected))
    assert f.cache_size() == 1 and f.fp8_state().shape[1] > 0


def test_an_argument_donated_by_position_is_donated_by_keyword_too() -> None:
    """As jax.jit: ``donate_argnums=(1,)`` donates ``w`` in ``step(x, w=w)``. The step
    behind the history takes ``(history, *args, **kwargs)``, where a keyword names no
    position: ``w`` was kept (and its buffer not reused)."""
    def step(x, w):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return x, w + 1

    f = hlo_amp.compile(step, _delayed(4), donate_argnums=(1,))
    for call in (lambda x, w: f(x, w), lambda x, w: f(x, w=w), lambda x, w: f(w=w, x=x)):
        x, w = jnp.ones((16, 32)) * 0.1, jnp.ones((32, 32)) * 0.01
        out = call(x, w)
        assert w.is_deleted() and not x.is_deleted()
        np.testing.assert_allclose(out[1], 1.01, rtol=1e-6)
    assert f.cache_size() == 1


def test_a_deleted_argument_is_named_by_the_steps_own_position() -> None:
    """A donated array passed again fails as under jax.jit, naming the step's argument:
    the executable's first argument is the history, and XLA's message said "argument 1"
    for the step's argument 0."""
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    def w_first(w, x):
        return step(w, x)

    def w_second(x, w):
        return step(w, x)

    x = jnp.ones((16, 32)) * 0.1
    for index, stepped in ((0, w_first), (1, w_second)):
        f = hlo_amp.compile(stepped, _delayed(4), donate_argnums=index)
        for fn in (f, jax.jit(stepped, donate_argnums=index)):
            w = jnp.ones((32, 32)) * 0.01
            args = (w, x) if index == 0 else (x, w)
            fn(*args)
            with pytest.raises(ValueError, match=rf"as argument {index} to replica"):
                fn(*args)
    # One array given for a donated argument and another: "flattened argument 1 ...
    # first use: 0", as jax.jit says (it said 2 and 1, the history counted).
    f = hlo_amp.compile(w_first, _delayed(4), donate_argnums=0)
    for fn in (f, jax.jit(w_first, donate_argnums=0)):
        w = jnp.ones((32, 32)) * 0.01
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"flattened argument 1, .*first use: 0\)"):
            fn(w, w)


def test_a_python_scalar_argument_is_traced_and_the_second_call_compiles_nothing() -> None:
    """A learning rate given as a Python float, a new value each step: one lowering to
    count the columns and one executable, as jax.jit gives (the first call's history
    commits nothing the arguments did not)."""
    p, x = _mlp_params(4)

    def step(p, x, lr):
        value, grads = jax.value_and_grad(_mlp_loss)(p, x)
        return jax.tree.map(lambda a, b: a - lr * b, p, grads), value

    f = hlo_amp.compile(step, _delayed(4))
    p, _ = f(p, x, 0.1)
    lowerings = f.lowerings
    for k in range(2, 5):
        p, _ = f(p, x, 0.1 / k)
    assert f.lowerings == lowerings and f.cache_size() == 1
    assert all(not leaf.committed for leaf in jax.tree.leaves(p))
    # Committed arguments commit the history to their device: still one executable.
    f = hlo_amp.compile(step, _delayed(4))
    q = jax.device_put(_mlp_params(4)[0], jax.devices()[0])
    for k in range(1, 4):
        q, _ = f(q, x, 0.1 / k)
    assert f.cache_size() == 1 and f.fp8_state().shape[1] > 0


_HISTORY_FOLLOWS_THE_ARGUMENTS = f"""
import json
import jax, jax.numpy as jnp, numpy as np
import hlo_amp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

def loss(ws, x):
    for w in ws:
        x = jax.nn.gelu(x @ w)
    return (x ** 2).mean()

keys = jax.random.split(jax.random.key(1), 3)
ws = [jax.random.normal(k, (64, 64)) / 8 for k in keys]
x = jax.random.normal(jax.random.key(0), (16, 64))
step = hlo_amp.compile(jax.grad(loss), "fp8,scaling=delayed,amax_history=4")
mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
step([jax.device_put(w, NamedSharding(mesh, P())) for w in ws],
     jax.device_put(x, NamedSharding(mesh, P("data"))))
on_mesh = len(step.fp8_state().sharding.device_set)
one = jax.devices()[1]
grads = step([jax.device_put(w, one) for w in ws], jax.device_put(x, one))
print("{RESULTS}" + json.dumps({{
    "on_mesh": on_mesh,
    "after": sorted(d.id for d in step.fp8_state().sharding.device_set),
    "grads": sorted({{d.id for g in grads for d in g.sharding.device_set}}),
}}))
"""


def test_the_history_follows_the_arguments_to_other_devices() -> None:
    # A step trained on a mesh and then called on one device (evaluation, a resharded
    # restart): the history moves with the arguments, as jax.jit's outputs would.
    found = run_on_host_devices(_HISTORY_FOLLOWS_THE_ARGUMENTS, devices=2)
    assert found == {"on_mesh": 2, "after": [1], "grads": [1]}


_EXPLICIT_MESH = f"""
import json
import jax, jax.numpy as jnp, numpy as np
import hlo_amp
from jax.sharding import NamedSharding, PartitionSpec as P

compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event else None)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

def step(w, x):
    l, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.01 * g, l

w0 = jax.random.normal(jax.random.key(0), (32, 32))
x = jax.random.normal(jax.random.key(1), (64, 32)) * 3
found = {{}}
for policy in ("mixed_bfloat16", "fp8,scaling=delayed,amax_history=4,"
               "first_matrix_op=none,last_matrix_op=none"):
    f = hlo_amp.compile(step, policy)
    w = jax.device_put(w0, NamedSharding(mesh, P()))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    per_call = []
    for _ in range(3):
        before = len(compiles)
        w, _ = f(w, xs)
        per_call.append(len(compiles) - before)
    found[policy.split(",")[0]] = {{"later_compiles": per_call[1:]}}
found["rows"] = np.asarray(f.fp8_state()).tolist()
found["amax_x"] = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))  # the fast mode's
one = jax.devices()[1]
grads, _ = f(jax.device_put(w0, one), jax.device_put(x, one))
found["after"] = sorted(d.id for d in f.fp8_state().sharding.device_set)
print("{RESULTS}" + json.dumps(found))
"""


def test_an_explicit_mesh_records_the_history_and_compiles_once() -> None:
    """On an Explicit mesh (jax.make_mesh's default) jax constrains the state barrier's
    result before returning it: the history was returned unchanged, all zeros, so every
    scale stayed 1. A step fed its own outputs (jax writes their spec P(None, None), the
    arguments had P()) compiled a second time; called on one device it failed in jax."""
    found = run_on_host_devices(_EXPLICIT_MESH, devices=4)
    assert found["mixed_bfloat16"]["later_compiles"] == [0, 0]
    assert found["fp8"]["later_compiles"] == [0, 0]
    rows = np.asarray(found["rows"])
    assert (rows[:3] > 0).all() and (rows[3] == 0).all()  # three steps recorded
    assert found["amax_x"] in rows[0]
    assert found["after"] == [1]


_COMMITTED_CHECKPOINT = f"""
import json
import jax, jax.numpy as jnp, numpy as np
import hlo_amp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
def step(w, x):
    l, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.01 * g, l
policy = "fp8,scaling=delayed,amax_history=4,first_matrix_op=none,last_matrix_op=none"
w = jax.random.normal(jax.random.key(0), (32, 32))
x = jax.random.normal(jax.random.key(1), (64, 32))
trained = hlo_amp.compile(step, policy)
trained(jax.device_put(w, NamedSharding(mesh, P())), jax.device_put(x, NamedSharding(mesh, P("data"))))
saved = trained.fp8_state()  # committed on the mesh
found = {{}}
for load in (False, True):
    f = hlo_amp.compile(step, policy)
    if load:
        f.load_fp8_state(saved)
    v = w
    for _ in range(3):
        v, _ = f(v, x)
    found[str(load)] = [v.committed, len(v.sharding.device_set), f.cache_size()]
print("{RESULTS}" + json.dumps(found))
"""


def test_a_checkpoint_from_a_mesh_does_not_commit_uncommitted_arguments() -> None:
    """A history saved on a mesh, loaded into a step called with uncommitted arrays: it
    committed the parameters the step returned to the mesh's devices, and the next calls
    compiled the step twice more. Now the step runs as it does with a fresh history."""
    found = run_on_host_devices(_COMMITTED_CHECKPOINT, devices=2)
    assert found["True"] == found["False"] == [False, 1, 1]


def test_a_loaded_state_of_another_width_is_refused_at_the_next_call() -> None:
    """A state another step saved, loaded into a step that had run: it was ignored, the
    step went on with its own history, and fp8_state() kept returning the loaded array
    (a checkpoint no step could load)."""
    p, x = _mlp_params(1)
    f = hlo_amp.compile(_mlp_step, _delayed(4))
    p, _ = f(p, x)
    columns = f.fp8_state().shape[1]
    f.load_fp8_state(np.ones((4, columns + 2), np.float32))
    with pytest.raises(ValueError, match=rf"\(4, {columns + 2}\).*expected \(4, {columns}\)"
                       r".*the loaded state is dropped"):
        f(p, x)
    p, _ = f(p, x)  # the step's own history, which fp8_state() gives again
    assert f.fp8_state().shape == (4, columns)


# ---- 8. no state barrier: current scaling, said so ----------------------------------------


def test_module_without_state_falls_back_to_current_scaling() -> None:
    w, x = _big_matmul_inputs()
    text = jax.jit(lambda w, x: x @ w).lower(w, x).as_text()
    rewritten, report = hlo_amp.rewrite(text, _delayed(8), return_report=True)
    note = _fp8_note(report)
    assert "current scaling (scaling=delayed: this module carries no fp8 state" in note
    assert report.fp8_state_columns == 2
    assert "f8E4M3FN" in rewritten and "tensor<8x" not in rewritten  # no history
    # Current scaling's numerics: no saturation at 448 on the first (only) run.
    current = hlo_amp.rewrite(text, f"fp8,{ALL}")
    assert rewritten == current


def test_quantisation_in_a_conditional_keeps_current_scaling_and_says_so() -> None:
    """A cond branch is not reached by the history (passes/fp8_state.py): its tensors
    are scaled from their own amax, so even the first call does not saturate there."""
    w, x = _big_matmul_inputs()
    w_out = np.eye(32, dtype=np.float32)

    def fn(w, w_out, x, flag):
        # The branch's result is brought under 448: the dot after the cond, in main,
        # has scale 1 on the first call.
        return jax.lax.cond(flag, lambda: (x @ w) / 1024, lambda: (x * 2) @ w) @ w_out

    f = hlo_amp.compile(fn, _delayed(4))
    report = f.lower(w, w_out, x, True).report()
    note = _fp8_note(report)
    assert "(2 from an amax history of 4 step(s); 4 the history does not reach, current)" \
        in note, note
    y = np.asarray(f(w, w_out, x, True), np.float64) * 1024
    exact = x.astype(np.float64) @ w.astype(np.float64)
    # x (|x| > 448) in the branch: current scaling, not clipped on the first call.
    assert np.abs(y - exact).max() <= 0.15 * np.abs(exact).max()
    state = np.asarray(f.fp8_state())
    assert state.shape == (4, report.fp8_state_columns)
    assert (state[0] == 0).sum() == 4  # the branch's columns are never written


def test_jax_export_of_the_stateful_function_says_what_it_supports() -> None:
    """jax.export traces the function: the same clear refusal, naming the AOT route."""
    from jax import export as jax_export

    w, x = jnp.ones((16, 16)), jnp.ones((16, 16))
    f = hlo_amp.compile(lambda w, x: x @ w, _delayed(4))
    with pytest.raises(TypeError, match=r"jax\.export.*\.lower\(\)"):
        jax_export.export(jax.jit(f))(w, x)
    lowered = f.lower(w, x)  # the supported AOT form: history first, (out, history) back
    columns = lowered.report().fp8_state_columns
    out, history = lowered.compile()(jnp.zeros((4, columns)), w, x)
    assert out.shape == (16, 16) and history.shape == (4, columns)
    assert float(history[0].max()) == 1.0  # this step's amax (all ones) recorded
    # Called as the step is, without the history: one line that names the form (it was
    # jax's "Function compiled with input pytree does not match").
    for args in [(w, x), (jnp.zeros((4, columns + 1)), w, x)]:
        with pytest.raises(TypeError, match=(
                rf"^a step compiled with scaling=delayed takes its amax history first: "
                rf"compiled\(history, \*args\) .* f32\[4, {columns}\] .* was given "
                rf"float32\[{args[0].shape[0]}, {args[0].shape[1]}\] first")):
            lowered.compile()(*args)
    # So does the form step.trace(...).lower() gives; and a history passed twice, which
    # the first call donated, is named (it was XLA's "Buffer has been deleted or donated").
    traced = f.trace(w, x).lower().compile()
    with pytest.raises(TypeError, match=r"^a step compiled with scaling=delayed takes its"):
        traced(w, x)
    traced(np.zeros(traced.history_shape), w, x)  # NumPy's float64: f32 without x64
    with pytest.raises(TypeError, match=r"^Cannot apply JAX transformations"):  # jax's
        jax.jit(traced)(jnp.zeros(traced.history_shape), w, x)
    history = jnp.zeros(traced.history_shape)
    traced(history, w, x)
    with pytest.raises(ValueError, match=r"^the amax history given first was donated to an "
                                         r"earlier call .*: pass the history that call "):
        traced(history, w, x)


def test_an_equinox_step_carries_its_history_too() -> None:
    """A filtered call (Equinox modules: non-array leaves are static) takes the history
    as an array: the empty one that counts the columns and the AOT one alike."""
    import equinox as eqx

    model = eqx.nn.MLP(32, 16, 64, depth=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 32))

    def step(model, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    f = hlo_amp.compile(step, _delayed(4))
    model, first = f(model, x)
    model, second = f(model, x)
    history = np.asarray(f.fp8_state())
    assert np.isfinite([first, second]).all() and second < first
    assert history.shape[1] > 0 and (history[:2] > 0).all()  # both steps' amax recorded
    note = _fp8_note(f.lower(model, x).report())
    assert "delayed scaling" in note and "does not reach" not in note



@pytest.mark.filterwarnings("error:Some donated buffers")
def test_an_equinox_decorators_donation_reaches_the_history_step() -> None:
    """eqx.filter_jit(donate="all-except-first") as Equinox's guide writes it (the batch
    first, kept; the model donated), compiled with delayed scaling: the model's arrays
    are donated behind the history (they were not), quietly as under Equinox."""
    import equinox as eqx

    @eqx.filter_jit(donate="all-except-first")
    def step(x, model):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    model = eqx.nn.MLP(32, 16, 64, depth=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    f = hlo_amp.compile(step, _delayed(4))
    before = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    model, _ = f(x, model)
    assert all(leaf.is_deleted() for leaf in before) and not x.is_deleted()
    assert f.fp8_state().shape[1] > 0


SHARDED_SCRIPT = """
import json, jax, jax.numpy as jnp, numpy as np, hlo_amp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
def loss(p, x):
    return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"]) ** 2)
def step(p, x):
    l, g = jax.value_and_grad(loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
specs = {"w1": P(None, "model"), "w2": P("model", None)}
p = {"w1": jax.random.normal(jax.random.key(0), (64, 128)) * 0.1,
     "w2": jax.random.normal(jax.random.key(1), (128, 32)) * 0.1}
p = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()}
x = jax.device_put(jax.random.normal(jax.random.key(2), (32, 64)), NamedSharding(mesh, P("data")))
f = hlo_amp.compile(step, "fp8,scaling=delayed,amax_history=4,first_matrix_op=none,"
                    "last_matrix_op=none", donate_argnums=0)
losses = []
for _ in range(3):
    p, l = f(p, x)
    losses.append(float(l))
history = f._histories[f._last_state]
# A shard_map body (rows of x 1000 times apart on the "data" devices): its tensors keep
# per-device current scaling; the history, replicated, must stay the same everywhere.
from functools import partial
@partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
def body(w1, x):
    return jax.lax.pmean(jnp.mean(jax.nn.gelu(x @ w1) ** 2), "data")
def mapped(p, x):
    l, g = jax.value_and_grad(lambda p: body(p["w1"], x) + loss(p, x))(p)
    return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), l
g = hlo_amp.compile(mapped, "fp8,scaling=delayed,amax_history=4,first_matrix_op=none,"
                    "last_matrix_op=none")
wide = jax.device_put(jax.random.normal(jax.random.key(3), (64, 64)) * jnp.repeat(
    jnp.array([1.0, 10.0, 100.0, 1000.0]), 16)[:, None], NamedSharding(mesh, P("data")))
q = p
for _ in range(2):
    q, _ = g(q, wide)
shards = [np.asarray(s.data) for s in g._histories[g._last_state].addressable_shards]
print("RESULTS=" + json.dumps({
    "mapped_equal": all(np.array_equal(shards[0], s) for s in shards[1:]),
    "mapped_rows": shards[0][:2].tolist(),
    "mapped_note": [n for n in g.lower(p, wide).report().notes if n.startswith("fp8")][0],
    "history_spec": list(history.sharding.spec), "history_devices": len(history.sharding.device_set),
    "history_mesh": str(history.sharding.mesh.shape_tuple),
    "params_kept": [v.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), v.ndim)
                    for k, v in p.items()], "losses": losses,
    "rows": np.asarray(f.fp8_state())[:3].tolist(),
    "amax_x": float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))}))
"""


def test_the_history_lives_replicated_on_the_parameters_mesh() -> None:
    """On a mesh of 8 host devices: the history is replicated on the parameters' mesh,
    the parameters keep their shardings, each step records the global amax; a shard_map
    body keeps current scaling and the history the same on every device."""
    from host_devices import run_on_host_devices

    found = run_on_host_devices(SHARDED_SCRIPT)
    assert found["history_spec"] == [] and found["history_devices"] == 8
    assert found["history_mesh"] == str((("data", 4), ("model", 2)))
    assert found["params_kept"] == [True, True]
    assert np.isfinite(found["losses"]).all() and found["losses"][-1] < found["losses"][0]
    rows = np.asarray(found["rows"])
    assert (rows > 0).all()  # three steps, every column recorded
    # The global amax of the sharded input (in the fast mode, of its bf16 value), exactly.
    assert found["amax_x"] in rows[0]
    # A shard_map body is not reached by the history: its tensors are counted as current
    # scaling, their columns stay 0, and every device holds the same history.
    assert "the history does not reach, current" in found["mapped_note"]
    assert found["mapped_equal"]
    mapped = np.asarray(found["mapped_rows"])
    unreached = int(found["mapped_note"].split(" the history does not reach")[0]
                    .split("; ")[-1])
    assert unreached > 0 and (mapped == 0).all(axis=0).sum() == unreached
    assert (mapped[:, (mapped != 0).any(axis=0)] > 0).all()  # the others: both steps


_SAME_DEVICES_IN_ANOTHER_ORDER = f"""
import json
import jax, jax.numpy as jnp, numpy as np
import hlo_amp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

def step(w, x):
    l, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)
    return w - 0.1 * g, l

devices = jax.devices()
forward, backward = Mesh(np.array(devices), ("data",)), Mesh(np.array(devices[::-1]), ("data",))
put = lambda a, mesh, spec: jax.device_put(a, NamedSharding(mesh, spec))
w = jax.random.normal(jax.random.key(0), (32, 32)) / 5
x = jax.random.normal(jax.random.key(1), (32, 32))
policy = "fp8,scaling=delayed,amax_history=4,first_matrix_op=none,last_matrix_op=none"
f = hlo_amp.compile(step, policy)
f(put(w, forward, P()), put(x, forward, P("data")))
saved = f.fp8_state()
_, loss = f(put(w, backward, P()), put(x, backward, P("data")))
restored = hlo_amp.compile(step, policy)
restored.load_fp8_state(saved)
_, again = restored(put(w, backward, P()), put(x, backward, P("data")))
print("{RESULTS}" + json.dumps({{
    "loss": float(loss), "restored": float(again),
    "jit": float(jax.jit(step)(put(w, backward, P()), put(x, backward, P("data")))[1]),
    "order": [d.id for d in f.fp8_state().sharding.mesh.devices.flat]}}))
"""


def test_the_history_follows_the_arguments_to_the_same_devices_in_another_order() -> None:
    """A mesh over the same devices in another order is another placement (jax.jit
    refuses arguments on both): the history stayed on the first mesh, and the step
    raised jax's 'incompatible devices ... argument history' (review h82); so did a
    history saved on one mesh and loaded into a step called on the other."""
    found = run_on_host_devices(_SAME_DEVICES_IN_ANOTHER_ORDER, devices=2)
    assert found["loss"] == pytest.approx(found["jit"], rel=0.05)
    assert found["restored"] == found["loss"]
    assert found["order"] == [1, 0]


def test_a_steps_argument_named_history_goes_by_keyword() -> None:
    """The stateful step's own history argument took the name: a step's argument
    ``history`` passed by keyword raised 'got multiple values for argument' in the
    call, ``.lower`` and ``.eval_shape`` (review h82)."""
    def step(w, x, history):
        y = jnp.tanh(x @ w) + history
        return y, y.sum()

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 5
    x = jax.random.normal(jax.random.key(1), (32, 32))
    carried = jnp.ones((32, 32))
    f = hlo_amp.compile(step, _delayed(4))
    _, total = f(w, x, history=carried)
    assert float(total) == pytest.approx(float(jax.jit(step)(w, x, history=carried)[1]),
                                         rel=0.05)
    assert f.eval_shape(w, x, history=carried)[1].shape == ()
    assert f.lower(w, x, history=carried).compile() is not None


def test_a_call_that_fails_while_it_runs_leaves_the_history_as_it_was() -> None:
    """The step donated the history it keeps: a call failing in the executable (an
    eqx.error_if on a bad batch) deleted it, and every later call and fp8_state()
    raised 'Array has been deleted' (review h82). It donates a copy now."""
    import equinox as eqx

    def step(w, x):
        x = eqx.error_if(x, ~jnp.all(jnp.isfinite(x)), "non-finite batch")
        loss, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * grad, loss

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 5
    x = jax.random.normal(jax.random.key(1), (32, 32))
    f = hlo_amp.compile(step, _delayed(4), filter=True)
    w, _ = f(w, x)
    before = np.asarray(f.fp8_state())
    with pytest.raises(Exception, match="non-finite batch"):
        f(w, x.at[0, 0].set(jnp.nan))
    np.testing.assert_array_equal(np.asarray(f.fp8_state()), before)
    _, loss = f(w, x)
    assert np.isfinite(float(loss)) and np.asarray(f.fp8_state())[0].max() > 0

    # A step quantising nothing: its empty history, donated without a copy, was deleted
    # by the failing call the same way (review h87 of fdd664d).
    def scaled(x, flag):
        return eqx.error_if(x * 2.0, flag > 0, "flagged")

    g = hlo_amp.compile(scaled, _delayed(4))
    g(x, jnp.int32(0))
    with pytest.raises(Exception, match="flagged"):
        g(x, jnp.int32(1))
    np.testing.assert_array_equal(g(x, jnp.int32(0)), x * 2.0)
    assert g.fp8_state().shape == (4, 0)


@pytest.mark.parametrize("policy", ["bf16", _delayed(4)])
def test_a_steps_parameters_named_as_the_wrappers_go_by_keyword(policy) -> None:
    """Parameters named ``args``, ``kwargs`` or ``self``, passed by keyword: jax's debug
    info raised a bare AssertionError (the stateful wrapper's own ``*args``), and
    ``self`` met the compiled function's method (review h83)."""
    def step(w, x, args, kwargs, self):
        return jnp.mean(jnp.tanh(x @ w) ** 2) + args.sum() + kwargs.sum() + self.sum()

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 5
    x = jax.random.normal(jax.random.key(1), (32, 32))
    named = {"args": jnp.ones(3), "kwargs": jnp.ones(2), "self": jnp.ones(1)}
    f = hlo_amp.compile(step, policy)
    want = float(jax.jit(step)(w, x, **named))
    assert float(f(w, x, **named)) == pytest.approx(want, rel=0.05)
    assert f.eval_shape(w, x, **named).shape == ()


@pytest.mark.parametrize("policy", ["fp8", _delayed(4)])
@pytest.mark.parametrize("method", ["lower", "eval_shape"])
def test_an_argument_it_cannot_take_is_named_by_the_steps_position(policy, method) -> None:
    """``.lower`` of a delayed step named the second argument 'args[2]' (the history
    counted), ``.eval_shape`` gave jax's message about an internal function (review
    h83): they name it as a call does."""
    def step(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    f = hlo_amp.compile(step, policy)
    with pytest.raises(TypeError, match=r"argument args\[1\] \(parameter x\) is a str"):
        getattr(f, method)(jnp.ones((32, 32)), "abc")


@pytest.mark.parametrize("method", ["fp8_state", "load_fp8_state"])
def test_the_state_methods_name_an_argument_by_the_steps_position(method) -> None:
    """``fp8_state(*args)`` and ``load_fp8_state(history, *args)`` named a bad argument
    one position further (args[2] for x: the history counted; review h114)."""
    def step(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    f = hlo_amp.compile(step, _delayed(4))
    f(jnp.ones((32, 32)), jnp.ones((32, 32)))
    history = (np.zeros((4, 2), np.float32),) if method == "load_fp8_state" else ()
    with pytest.raises(TypeError, match=r"argument args\[1\] \(parameter x\) is a str"):
        getattr(f, method)(*history, jnp.ones((32, 32)), "abc")


_ARGUMENTS_ON_DIFFERENT_DEVICES = f"""
import json
import jax, jax.numpy as jnp, hlo_amp
def step(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)
first, second = jax.devices()[:2]
w = jax.device_put(jnp.ones((32, 32)), first)
x = jax.device_put(jnp.ones((32, 32)), second)
f = hlo_amp.compile(step, "fp8,scaling=delayed,amax_history=4")
try:
    f(w, x)
    message = None
except ValueError as error:
    message = str(error)
print("{RESULTS}" + json.dumps({{"message": message}}))
"""


def test_arguments_on_different_devices_are_named() -> None:
    """jax's message named the history (placed with the first argument) against the
    second, by internal names (review h83): one message naming the step's arguments."""
    found = run_on_host_devices(_ARGUMENTS_ON_DIFFERENT_DEVICES, devices=2)
    assert found["message"].startswith(
        "hlo_amp.compile(step): its array arguments are on different devices: args[0] on "
        "[0], args[1] on [1]")


@pytest.mark.parametrize("policy", ["bf16", _delayed(4)])
def test_keywords_named_as_the_history_or_catch_alls_go_by_keyword(policy) -> None:
    """A step's parameter named as the history, or a ``**kwargs`` key named as it was
    (fp8_amax_history), went by keyword into jax's debug info beside the history's own
    name, and a callable without a signature given a keyword ``args`` met the wrapper's
    ``*args``: a bare AssertionError (review h85). (A ``**kwargs`` key named
    hlo_amp_fp8_amax_history still meets it.)"""
    class NoSignature:
        def __call__(self, *positional, **keywords):
            return jnp.tanh(keywords["args"] @ positional[0])

        @property
        def __signature__(self):
            raise ValueError("no signature")

    def named(w, hlo_amp_fp8_amax_history):
        return jnp.tanh(hlo_amp_fp8_amax_history @ w)

    def keywords(w, **given):
        return jnp.tanh(given["fp8_amax_history"] @ w)

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 5
    x = jax.random.normal(jax.random.key(1), (32, 32))
    for fn, name in ((NoSignature(), "args"), (named, "hlo_amp_fp8_amax_history"),
                     (keywords, "fp8_amax_history")):
        got = hlo_amp.compile(fn, policy)(w, **{name: x})
        want = jax.jit(fn)(w, **{name: x})
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.1


def test_an_error_of_the_step_is_not_taken_for_devices() -> None:
    """With array arguments on different devices, every TypeError or ValueError (the
    step's own, a shape error) read as the different-devices message (review h85)."""
    found = run_on_host_devices(_A_STEPS_OWN_ERROR_ON_TWO_DEVICES, devices=2)
    assert found == {"own": "step: a batch of 32 is not allowed",
                     "shape": "TypeError"}


_A_STEPS_OWN_ERROR_ON_TWO_DEVICES = f"""
import json
import jax, jax.numpy as jnp, hlo_amp
def step(w, x):
    if x.shape[0] == 32:
        raise ValueError("step: a batch of 32 is not allowed")
    return jnp.tanh(x @ w)
first, second = jax.devices()[:2]
w = jax.device_put(jnp.ones((32, 32)) / 32, first)
f = hlo_amp.compile(step, "fp8,scaling=delayed,amax_history=4")
found = {{}}
try:
    f(w, jax.device_put(jnp.ones((32, 32)), second))
except ValueError as error:
    found["own"] = str(error)
try:
    f(w, jax.device_put(jnp.ones((4, 5)), second))
except Exception as error:
    found["shape"] = type(error).__name__
print("{RESULTS}" + json.dumps(found))
"""
