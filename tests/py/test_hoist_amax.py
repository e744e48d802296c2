"""passes/hoist_amax.py on real fp8 steps: a scanned, checkpointed model's weight amax is
taken once per layer before the loops, and the step computes the same bits as without
the pass, under current and delayed scaling (tests/lit/hoist_amax.mlir has the IR)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir import ir

import hlo_amp
from hlo_amp.ir.modules import parse_module, walk_operations
from hlo_amp.passes.hoist_amax import HoistAmax

# Every dot fp8 (this small program's first and last matrix ops included), the fast mode.
ALL = "first_matrix_op=none,last_matrix_op=none"


def _scan_step(p: dict, x: jax.Array):
    def loss(p: dict, x: jax.Array) -> jax.Array:
        @jax.checkpoint
        def layer(h, w):
            return h + jnp.tanh(h @ w["a"]) @ w["b"] / 4, None

        h = x @ p["w_in"]
        h, _ = jax.lax.scan(layer, h, p["layers"])
        return jnp.mean((h @ p["w_out"] - 1.0) ** 2)

    value, grads = jax.value_and_grad(loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, grads), value


def _args() -> tuple[dict, jax.Array]:
    rng = np.random.default_rng(7)
    # Layers of different magnitudes: a wrong row of the per-layer amax changes the scale.
    sizes = np.asarray([1.0, 4.0, 0.25])[:, None, None]
    p = {"w_in": jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32),
         "layers": {"a": jnp.asarray(rng.standard_normal((3, 32, 32)) / 6 * sizes, jnp.float32),
                    "b": jnp.asarray(rng.standard_normal((3, 32, 32)) / 6 / sizes,
                                     jnp.float32)},
         "w_out": jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32)}
    return p, jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)


def _amaxes(text: str) -> tuple[int, int]:
    """fp8.py's amax reductions of a magnitude: (to a scalar, to one value per layer),
    each input of a reduction that takes several (passes/merge_amax.py) counted."""
    scalar = per_layer = 0
    module = parse_module(text)  # held: its ops live as long as it does
    for op in walk_operations(module.operation, names=frozenset({"stablehlo.reduce"})):
        for source, result in zip(list(op.operands)[:len(op.results)], op.results):
            if not isinstance(source, ir.BlockArgument) and source.owner.name == "stablehlo.abs":
                rank = ir.RankedTensorType(result.type).rank
                scalar += rank == 0
                per_layer += rank == 1
    return scalar, per_layer


def _three_steps(step, p, x) -> list:
    """Losses and parameters of three steps."""
    out = []
    for _ in range(3):
        p, loss = step(p, x)
        out.append((np.asarray(loss), [np.asarray(leaf) for leaf in jax.tree.leaves(p)]))
    return out


def _compiled_with_count(step, scaling: str, args: tuple, note: str
                         ) -> tuple[object, object, int, str]:
    """``step`` compiled under fp8 with ``scaling`` (the ends quantised too), lowered for
    ``args``: (compiled, lowered, the count its report's ``note`` line gives, the line)."""
    compiled = hlo_amp.compile(step, f"fp8,scaling={scaling},{ALL}")
    lowered = compiled.lower(*args)
    (line,) = [n for n in lowered.report().notes if n.startswith(note)]
    return compiled, lowered, int(line.split()[1]), line


def _assert_same_bits(with_pass: list, without: list, compiled: object, other: object,
                      scaling: str) -> None:
    """Three steps' losses and parameters equal bit for bit (``_three_steps``); under
    delayed scaling the amax histories the two compiled steps kept too."""
    for (loss_a, leaves_a), (loss_b, leaves_b) in zip(with_pass, without):
        assert np.array_equal(loss_a, loss_b)
        assert all(np.array_equal(a, b) for a, b in zip(leaves_a, leaves_b))
    if scaling == "delayed":  # the history recorded the same amax per tensor
        assert np.array_equal(np.asarray(compiled.fp8_state()), np.asarray(other.fp8_state()))


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_the_step_is_the_same_bits_with_the_amax_taken_before_the_loop(scaling, monkeypatch):
    policy = f"fp8,scaling={scaling},{ALL}"
    p, x = _args()
    hoisted, lowered, count, note = _compiled_with_count(_scan_step, scaling, (p, x),
                                                         "hoist-amax:")
    # Two stacked weights, each in the forward loop and the backward loop's recompute.
    assert count >= 4, note
    with_pass = _three_steps(hoisted, p, x)  # compiled now, with the pass

    monkeypatch.setattr(HoistAmax, "run", lambda self, module, report=None: None)
    in_loop = hlo_amp.compile(_scan_step, policy)
    text_in_loop = in_loop.lower(p, x).as_text()
    # The slices' amaxes became per-layer amaxes of the stacks before the loops.
    scalar, per_layer = _amaxes(lowered.as_text())
    scalar_in_loop, per_layer_in_loop = _amaxes(text_in_loop)
    assert scalar <= scalar_in_loop - 4 and per_layer >= 2 and per_layer_in_loop == 0

    _assert_same_bits(with_pass, _three_steps(in_loop, p, x), hoisted, in_loop, scaling)
    # The scales matter here: a wrong layer's amax changes the bits (the layers' sizes
    # differ 16-fold), and the steps moved the parameters.
    assert not np.array_equal(with_pass[-1][1][0], np.asarray(jax.tree.leaves(p)[0]))
