"""Property: on a sharded step without activation constraints, the fast mode's collectives
are the hand cast's up to element type (issue 48).

Random small decoders (tests/py/plain_decoder.py: GQA by repeat or grouped einsum, 2 or 4
KV heads, one or two layers, unrolled or scanned, widths and vocabulary drawn), FSDP 4 x
TP 2 on 8 H100s, compiled without devices: per (kind, array shape, replica groups) the
same executions per step (``plain_decoder.plan``). Before the fix the first drawn decoder
failed it. A few examples by default (each is two compiles); ``HYPOTHESIS_PROFILE=slow``
(tests/py/test_properties.py's profiles) runs 40.

One KV head on TP 2 (its head dimension split across the pair) is left out: scanned, with
GQA by repeat, the fast mode's step then gathers the roped K over TP at the score dot, two
more bf16[4,64,8] gathers than the hand cast, which gathers it once after its own f32 ->
bf16 convert (the same shardings; 0.92 times the hand cast's bytes in all). Not traced
further (issue 48's closing note).
"""

from __future__ import annotations

import os

import plain_decoder as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = 2 if os.environ.get("HYPOTHESIS_PROFILE", "default") == "default" else 40

DECODERS = st.builds(
    pd.Cfg,
    layers=st.integers(1, 2),
    dim=st.sampled_from([128, 256]),
    kv_heads=st.sampled_from([2, 4]),
    hidden=st.sampled_from([256, 512]),
    vocab=st.sampled_from([512, 1024]),
    seq=st.sampled_from([64, 128]),
    gqa=st.sampled_from(["repeat", "einsum"]),
    scan=st.booleans(),
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(DECODERS)
def test_fast_mode_collectives_are_the_hand_casts_up_to_element_type(cfg: pd.Cfg) -> None:
    plans = {variant: pd.plan(pd.compile_step(cfg, variant, "h100x8").as_text())
             for variant in ("hand", "mixed_bfloat16")}
    assert plans["hand"], cfg
    assert plans["mixed_bfloat16"] == plans["hand"], (
        cfg, plans["mixed_bfloat16"] - plans["hand"], plans["hand"] - plans["mixed_bfloat16"])
