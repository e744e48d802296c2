"""passes/reuse_amax.py on real fp8 steps: a scanned, checkpointed model's backward loop
reads the amaxes of its recomputed activations from the forward loop instead of
reducing them again, and the step computes the same bits as without the pass, under
current and delayed scaling (tests/lit/reuse_amax.mlir has the IR)."""

from __future__ import annotations

import numpy as np
import pytest
from test_fp8_remat import _args, _normed_scan_step
from test_hoist_amax import ALL, _amaxes, _assert_same_bits, _compiled_with_count, _three_steps

import hlo_amp
from hlo_amp.passes.reuse_amax import ReuseAmax


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_step_is_the_same_bits_with_the_forward_loops_amaxes_reused(scaling, monkeypatch):
    policy = f"fp8,scaling={scaling},{ALL}"
    p, x = _args()
    reusing, lowered, reused, note = _compiled_with_count(_normed_scan_step, scaling,
                                                          (p, x), "reuse-amax:")
    # The saved layer input and tanh's output, each recomputed in the backward loop. Under
    # delayed scaling the recomputed dot's operand has a history column of its own, so
    # tanh's input is another value there and only the saved input's amax is the same.
    assert reused >= (2 if scaling == "current" else 1), note
    with_pass = _three_steps(reusing, p, x)

    monkeypatch.setattr(ReuseAmax, "run", lambda self, module, report=None: None)
    reducing = hlo_amp.compile(_normed_scan_step, policy)
    text_reducing = reducing.lower(p, x).as_text()
    # Each reused amax is one reduction fewer (whether in the backward body or, for a
    # saved stack, per layer before the loop by hoist_amax).
    assert sum(_amaxes(lowered.as_text())) == sum(_amaxes(text_reducing)) - reused
    _assert_same_bits(with_pass, _three_steps(reducing, p, x), reusing, reducing, scaling)
    assert not np.array_equal(with_pass[0][0], with_pass[-1][0])  # the steps trained
