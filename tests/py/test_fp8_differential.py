"""benchmarks/fp8_differential.py: fp8's same-bits passes against the pipeline without
them, on a random decoder and a random control-flow program where four of them act."""

from __future__ import annotations

import pytest

from benchmarks import fp8_differential as differential


@pytest.mark.parametrize("make, seed", [(differential.decoder, 13),
                                        (differential.control_flow, 13)])
def test_the_passes_change_no_bits_where_they_act(make, seed):
    step, args, policy, description = make(seed)
    runs = {cls: cls.run for cls in differential.SAME_BITS_PASSES}
    differs, acted = differential.compare(step, args, policy)
    assert differs is None, (description, policy, differs)
    assert {"reuse-amax", "hoist-amax", "hoist-quantize", "merge-amax"} <= set(acted), acted
    # The passes run again after the comparison.
    assert {cls: cls.run for cls in differential.SAME_BITS_PASSES} == runs


def test_a_pass_that_changes_bits_is_caught(monkeypatch):
    """hoist_quantize made to divide what it rebuilds by twice the scale."""
    from hlo_amp.passes import hoist_quantize

    build = hoist_quantize._build

    def doubled(quantize, value, scale, axis):
        from jaxlib.mlir.dialects import stablehlo as hlo
        return build(quantize, value, hlo.add(scale, scale), axis)

    monkeypatch.setattr(hoist_quantize, "_build", doubled)
    step, args, policy, _ = differential.decoder(13)
    differs, acted = differential.compare(step, args, policy)
    assert "hoist-quantize" in acted
    assert differs is not None and differs.startswith("step 1"), differs
