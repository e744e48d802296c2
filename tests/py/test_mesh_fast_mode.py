"""The fast mode on a sharded decoder train step against the hand-cast peer (issue 35, 3c).

benchmarks/llm.py's Llama-style step at a small size (2 blocks, d 1024, 2048 tokens, a
1024-token vocabulary), FSDP 4 x TP 2, compiled without a device for 8 H100s. Compared,
from ``memory_analysis()`` and ``report().collectives`` (compile-time facts):

- temp: ``mixed_bfloat16 <= hand-cast bf16``. Before propagate painted the sharding
  constraints and jax.checkpoint's barrier, the residual stream was f32 and each block's
  input crossed the barrier as an f32 copy: 2028 MiB against the peer's 1886 (now 1870).
- collectives: the fast mode moves at most the peer's bytes, and no f32 the peer does
  not move. The residual stream, the embedding lookup and the activation gradients cross
  in bf16 (before: 134.2 MiB of f32, the lookup's all-reduce and all-to-all, block 0's
  input gradient); the embedding gradient's scatter-add sums in bf16, the fast mode's
  reduce precision, so XLA reduces the table in bf16 (before: 2.7 MiB of f32, the
  scatter summed in f32 and reduced across devices in f32).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from benchmarks import llm

# The blocks unrolled (a Python loop). Scanned (jax.lax.scan over stacked blocks, the
# benchmark's default since) the fast mode is not yet at the peer's temp: 2,007,323,064 B
# against 2,007,191,480 at this size (2,057,457,848 before the embedding gradient summed
# in bf16; issue 35's open part, in its note).
CONFIG = dataclasses.replace(llm.Config(), layers=2, dim=1024, heads=8, kv_heads=4,
                             hidden=2048, vocab=1024, seq=2048, batch=32, scan_layers=False)
AXES = {"fsdp": 4, "tp": 2}


@functools.cache
def _compiled(variant: str) -> object:
    return llm.compile_variant(variant, "h100x8", CONFIG, AXES)


def _collective_bytes(variant: str) -> dict[str, int]:
    """Per-device bytes per step by element type ("bf16", "f32", "s32")."""
    compiled = _compiled(variant)
    if variant == "hand-cast bf16":
        from hlo_amp.targets.collectives import read_collectives
        collectives = read_collectives(compiled.as_text())
    else:
        collectives = compiled.report().collectives
    out: dict[str, int] = {}
    for collective in collectives:
        kind = "+".join(sorted(set(collective.element_types)))
        out[kind] = out.get(kind, 0) + collective.bytes * collective.count
    return out


@pytest.fixture(scope="module")
def temps() -> dict[str, int]:
    return {v: int(_compiled(v).memory_analysis().temp_size_in_bytes)
            for v in ("hand-cast bf16", "hlo_amp mixed_bfloat16")}


def test_fast_mode_temp_is_at_most_the_hand_cast(temps: dict[str, int]) -> None:
    assert temps["hlo_amp mixed_bfloat16"] <= temps["hand-cast bf16"], temps


def test_fast_mode_moves_at_most_the_peers_bytes_and_no_f32_of_its_own() -> None:
    mixed = _collective_bytes("hlo_amp mixed_bfloat16")
    peer = _collective_bytes("hand-cast bf16")
    # The embedding gradient's scatter-add sums in bf16 (the fast mode's reduce
    # precision), so XLA reduces the table in bf16 as the peer's does.
    assert mixed.get("f32", 0) <= peer.get("f32", 0), (mixed, peer)
    assert sum(mixed.values()) <= sum(peer.values()), (mixed, peer)


def test_the_report_notes_the_embedding_gradient_summed_in_bf16() -> None:
    notes = _compiled("hlo_amp mixed_bfloat16").report().notes
    assert any("1 add scatter(s) summed across devices" in note and "in bfloat16" in note
               for note in notes), notes
