"""ScatterToSelect (passes/scatter_select.py): one-position add scatters into a constant
become selects that give the same values bit for bit, and only those."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hlo_amp
from hlo_amp.ir.modules import copy_module, module_text
from hlo_amp.jax_internals import swap_module
from hlo_amp.passes import run_pipeline
from hlo_amp.passes.scatter_select import ScatterToSelect
from hlo_amp.policy import Policy


def _label_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _pick_axis0(x, rows):  # take_along_axis over the leading dim, a batch after it
    return jnp.sum(jnp.take_along_axis(x, rows[None, :], axis=0) ** 2)


def _pick_one(x, k):  # one column picked by a traced index array of one element
    return jnp.sum(jnp.take(x, k, axis=-1) * 3.0)


def _picks_with_select(fn, *args):
    """(``fn``'s value and its scatters rewritten, scatters before, scatters after)."""
    lowered = jax.jit(fn).lower(*args)
    module = copy_module(lowered.compiler_ir("stablehlo"))
    before = module_text(module).count("stablehlo.scatter")
    run_pipeline(module, Policy.parse("mixed_bfloat16"), passes=[ScatterToSelect()])
    after = module_text(module).count("stablehlo.scatter")
    return swap_module(lowered, module).compile()(*args), before, after


def _add_at(update, index):  # one position of a dim longer than a narrow index type counts
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                              scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter_add(jnp.zeros((300,), jnp.float32), index, update, numbers)


def _add_at_row_start(update, index):  # (index, 0) of a 100 x 300 buffer
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0, 1), scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter_add(jnp.zeros((100, 300), jnp.float32), index, update, numbers)


def _cases():
    key = jax.random.key(0)
    logits = jax.random.normal(key, (4, 6, 32)) * 4.0
    # out of range (40) and wrapped-negative out of range (-100): gathers fill, the
    # gradient's scatter drops them; the select must match no position for them either
    labels = jnp.array([[0, 31, 5, 40, 7, 7], [1, 2, 3, 4, 5, -100],
                        [9, 9, 9, 9, 9, 9], [30, 0, 1, 2, 3, 4]], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (5, 7))
    return {
        "label pick f32": (jax.grad(_label_loss), logits, labels),
        "label pick bf16": (jax.grad(_label_loss), logits.astype(jnp.bfloat16), labels),
        "leading axis": (jax.grad(_pick_axis0), x, jnp.array([0, 4, 2, 2, 1, 3, 9])),
        "one column": (jax.grad(_pick_one), x, jnp.array([3])),
        # An int8 index into a dim it counts, the row's start (position 0 of a dim of
        # 300) fixed: an 8-bit position iota wrapped there, 0 matched 256 too.
        "int8 index, a wider dim at 0": (_add_at_row_start, jnp.float32(2.5),
                                         jnp.array([7], jnp.int8)),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_select_gives_the_scatters_values_bit_for_bit(case):
    fn, *args = _cases()[case]
    got, before, after = _picks_with_select(fn, *args)
    want = jax.jit(fn)(*args)
    assert before >= 1 and after == 0, (before, after)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("index", [np.array([10], np.uint8), np.array([-1], np.int8),
                                   np.array([100], np.int8)])
def test_a_narrow_index_into_a_dim_its_type_cannot_count_stays_a_scatter(index):
    """An index type whose largest value is below the dim's last position: XLA checks
    the bound in that type (int8 100 into 300 is dropped), and the select compared
    positions in it (uint8 10 also matched 266, int8 -1 matched 255)."""
    update = jnp.float32(2.5)
    got, before, after = _picks_with_select(_add_at, update, jnp.asarray(index))
    assert before == after >= 1
    np.testing.assert_array_equal(got, jax.jit(_add_at)(update, jnp.asarray(index)))
    fast = hlo_amp.compile(lambda w, u, i: (w @ w, _add_at(u, i)), "mixed_bfloat16")
    np.testing.assert_array_equal(fast(jnp.eye(4), update, jnp.asarray(index))[1],
                                  jax.jit(_add_at)(update, jnp.asarray(index)))


def test_scatters_that_can_meet_or_add_into_a_computed_buffer_stay():
    def embedding_grad(table, ids):  # rows may repeat: two updates can meet
        return jax.grad(lambda t: jnp.sum(t[ids] ** 2))(table)

    def cache_add(cache, labels, value):  # one position, but into a computed buffer
        rows = jnp.arange(cache.shape[0])
        return (cache * 2.0).at[rows, labels].add(value)

    table = jnp.ones((10, 4))
    for fn, args in ((embedding_grad, (table, jnp.array([1, 1, 3]))),
                     (cache_add, (jnp.ones((3, 8)), jnp.array([1, 2, 7]), jnp.ones(3)))):
        got, before, after = _picks_with_select(fn, *args)
        assert before >= 1 and after == before, (fn.__name__, before, after)
        np.testing.assert_array_equal(got, jax.jit(fn)(*args))


def test_mixed_mode_writes_the_label_gradient_as_select_accurate_mode_does_not():
    key = jax.random.key(2)
    w = jax.random.normal(key, (16, 32)) * 0.3
    x = jax.random.normal(jax.random.key(3), (8, 16))
    labels = jnp.arange(8) % 32

    def grad(w, x, labels):
        return jax.grad(lambda w: _label_loss(x @ w, labels))(w)

    texts = {policy: hlo_amp.compile(grad, policy).lower(w, x, labels).as_text()
             for policy in ("mixed_bfloat16", "bf16")}
    assert "stablehlo.scatter" not in texts["mixed_bfloat16"]
    assert "stablehlo.scatter" in texts["bf16"]
    scatters = texts["bf16"].count('"stablehlo.scatter"(')
    notes = hlo_amp.compile(grad, "mixed_bfloat16").lower(w, x, labels).report().notes
    assert f"scatter-select: wrote {scatters} one-position add scatter(s) into a constant " \
        "as select" in notes, (scatters, notes)
    got = hlo_amp.compile(grad, "mixed_bfloat16")(w, x, labels)
    want = jax.jit(grad)(w, x, labels)
    assert got.dtype == jnp.float32
    error, scale = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
    assert error <= 1e-5 + 2.3e-2 * scale, (error, scale)
