"""hlo_amp's warnings point at the user's line on every path: call, .lower(), traced."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import hlo_amp

TYPO_POLICY = "bf16,scope:no_such_scope=float32"


def matmul(x):
    return x @ x.T


def _caught(thunk):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thunk()
    ours = [w for w in caught if "matched no op" in str(w.message)
            or "cannot rewrite" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    return ours


def test_call_lower_and_traced_call_warn_at_the_users_line():
    x = jnp.ones((4, 3))
    paths = {
        "call": lambda: hlo_amp.compile(matmul, TYPO_POLICY)(x),
        "lower": lambda: hlo_amp.compile(matmul, TYPO_POLICY).lower(x),
        "jit": lambda: jax.jit(lambda v: hlo_amp.compile(matmul, TYPO_POLICY)(v))(x),
        "vmap": lambda: jax.vmap(hlo_amp.compile(matmul, TYPO_POLICY))(x[None]),
        "grad": lambda: jax.grad(lambda v: hlo_amp.compile(matmul, TYPO_POLICY)(v).sum())(x),
        "rewrite": lambda: hlo_amp.rewrite(
            jax.jit(matmul).lower(x).as_text(debug_info=True), TYPO_POLICY),
    }
    for name, thunk in paths.items():
        for warning in _caught(thunk):
            assert warning.filename == __file__, (name, warning.filename, warning.lineno)


def test_callback_warning_under_an_outer_transformation_points_at_the_user():
    def noisy(x):
        jax.debug.print("{}", x.sum())
        return x @ x.T

    for warning in _caught(lambda: jax.jit(hlo_amp.compile(noisy, "bf16"))(jnp.ones((2, 2)))):
        assert warning.filename == __file__
