"""Load: one function compiled for 25 input signatures; cache and memory stay bounded.

RSS is read from /proc/self/statm (no psutil). The bound is generous (20 MB per
executable) so that it only catches a leak such as keeping every MLIR context or
every lowered module alive, not allocator noise.
"""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np

import hlo_amp

SIGNATURES = 25
MB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def step(w, x):
    with jax.named_scope("layer"):
        h = jnp.tanh(x @ w)
    return jnp.sum(h * h)


def test_many_signatures_cache_and_rss() -> None:
    fn = hlo_amp.compile(jax.value_and_grad(step), "bf16")
    w = jnp.ones((4, 4), jnp.float32) / 4
    # warm up once so one-time costs (XLA, MLIR context setup) are not counted
    fn(w, jnp.ones((1, 4), jnp.float32))
    gc.collect()
    start = rss_bytes()
    for rows in range(2, SIGNATURES + 1):
        x = jnp.full((rows, 4), 0.5, jnp.float32)
        loss, grad = fn(w, x)
        assert grad.shape == (4, 4) and grad.dtype == jnp.float32
        want = rows * 4 * np.tanh(0.5) ** 2  # every entry of x @ w is 0.5
        np.testing.assert_allclose(float(loss), want, rtol=1.6e-2)
    gc.collect()
    grown = rss_bytes() - start
    assert fn.cache_size() == SIGNATURES
    assert fn.lowerings == SIGNATURES
    # a repeated signature is a cache hit: no new lowering, same cache size
    fn(w, jnp.full((7, 4), 0.5, jnp.float32))
    assert fn.lowerings == SIGNATURES and fn.cache_size() == SIGNATURES
    per_executable = grown / (SIGNATURES - 1)
    assert per_executable < 20 * MB, f"RSS grew {grown / MB:.1f} MB over {SIGNATURES - 1}"


def test_rss_reader_sees_an_allocation() -> None:
    """The measurement itself works: a 64 MB buffer shows up in RSS."""
    before = rss_bytes()
    block = np.ones(64 * MB // 8)
    after = rss_bytes()
    assert after - before > 32 * MB
    del block
