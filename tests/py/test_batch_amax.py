"""passes/batch_amax.py on real fp8 steps: under delayed scaling the amaxes a step records
are reduced together per block (in the main function and in a scanned layer), under
current scaling the amaxes of the step's arguments, and the step computes the same bits
(and records the same history) as without the pass (tests/lit/batch_amax.mlir has the
IR)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir import ir
from test_hoist_amax import ALL, _amaxes, _assert_same_bits, _three_steps
from test_hoist_amax import _scan_step as _step

import hlo_amp
from hlo_amp.ir.modules import parse_module, walk_operations
from hlo_amp.passes.batch_amax import BatchAmax


def _args() -> tuple[dict, jax.Array]:
    """test_hoist_amax's scanned, checkpointed step at sizes of 32,768 and 65,536 elements
    (two and four rows of 16,384), in the main function and in the scanned layer."""
    rng = np.random.default_rng(11)
    sizes = np.asarray([1.0, 3.0])[:, None, None]  # layers of different magnitudes
    p = {"w_in": jnp.asarray(rng.standard_normal((128, 256)) / 11, jnp.float32),
         "layers": {k: jnp.asarray(rng.standard_normal((2, 256, 256)) / 16 * sizes,
                                   jnp.float32) for k in "ab"},
         "w_out": jnp.asarray(rng.standard_normal((256, 128)) / 16, jnp.float32)}
    return p, jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)


def _stacked_where(text: str) -> set[str]:
    """Where the stacks of amax rows (2-D concatenates of 16-bit rows) are: "main" (the
    public function's own block) or "layer" (a loop body, or a function it calls)."""
    module = parse_module(text)  # held: its ops live as long as it does
    found = set()
    for op in walk_operations(module.operation, names=frozenset({"stablehlo.concatenate"})):
        shaped = ir.RankedTensorType(op.results[0].type)
        if shaped.rank == 2 and str(shaped.element_type) == "bf16":
            parent = op.parent
            in_main = parent.name == "func.func" and ir.StringAttr(
                parent.attributes["sym_name"]).value == "main"
            found.add("main" if in_main else "layer")
    return found


def _batched(lowered) -> tuple[int, int]:
    """What the report's batch-amax line counts: (amaxes recorded for delayed scaling,
    amaxes of the step's arguments); zeros without one."""
    lines = [n for n in lowered.report().notes if n.startswith("batch-amax:")]
    if not lines:
        return 0, 0
    recorded, arguments = re.search(r"\((\d+) recorded .*, (\d+) of the step", lines[0]).groups()
    return int(recorded), int(arguments)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_same_amaxes_from_fewer_reductions(scaling, monkeypatch):
    policy = f"fp8,scaling={scaling},{ALL}"
    p, x = _args()
    batching = hlo_amp.compile(_step, policy)
    lowered = batching.lower(p, x)
    recorded, arguments = _batched(lowered)
    if scaling == "delayed":
        # Every amax is recorded (the arguments' too): both the main function's and a
        # scanned layer's (jax 0.10 calls the layer from the loop body, jax 0.11 inlines
        # it).
        assert recorded >= 4 and arguments == 0, lowered.report().notes
        assert _stacked_where(lowered.as_text()) == {"main", "layer"}
    else:
        # Each amax is a scale: only the arguments' (x, w_in, w_out) are known at the
        # step's start, where they are reduced together.
        assert recorded == 0 and arguments == 3, lowered.report().notes
        assert _stacked_where(lowered.as_text()) == {"main"}
    with_pass = _three_steps(batching, p, x)

    monkeypatch.setattr(BatchAmax, "run", lambda self, module, report=None: None)
    separate = hlo_amp.compile(_step, policy)
    text_separate = separate.lower(p, x).as_text()
    # Each batched amax is one reduction to a scalar fewer.
    assert (_amaxes(lowered.as_text())[0]
            == _amaxes(text_separate)[0] - recorded - arguments)
    _assert_same_bits(with_pass, _three_steps(separate, p, x), batching, separate, scaling)
    assert not np.array_equal(with_pass[0][0], with_pass[-1][0])  # the steps trained
    if scaling == "delayed":
        assert np.asarray(batching.fp8_state()).max() > 0  # amaxes were recorded
