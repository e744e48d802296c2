"""The fp8 preset is the fast mode (issue 47 item 1): the activations between matrix ops
stay 16-bit as under ``mixed_bfloat16`` (its f32-critical ops stay f32), fp8 appears only
at the GEMM inputs (e4m3fn forward, e5m2 for the incoming gradient), and
``fp8,propagate=false`` is the accurate mode (f32 activations).

Two train steps lowered for an H100 without a device: an MLP whose two middle dots are
fp8 (the first and the last matrix op stay bf16, the preset's rule) and a two-block
Llama-style decoder (tests/py/plain_decoder.py). The rewritten StableHLO is read from
``as_text(debug_info=True)`` (op locations name the scopes), XLA's temp bytes from
``memory_analysis()``; the numbers run on CPU, where the fp8 dots multiply the
dequantised operands in f32.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import plain_decoder as pd
import pytest
from jax.extend.mlir import ir

import hlo_amp
from hlo_amp.ir.modules import parse_module, walk_operations
from hlo_amp.ir.sites import location_name
from hlo_amp.policy import Policy

FAST, ACCURATE, MIXED = "fp8", "fp8,propagate=false", "mixed_bfloat16"
F8 = ("f8E4M3FN", "f8E5M2")


# ---- the workloads ---------------------------------------------------------------------

BATCH, D_IN, WIDTH, CLASSES = 256, 64, 128, 16


def _mlp_loss(p: dict, x: jax.Array, labels: jax.Array) -> jax.Array:
    with jax.named_scope("stem"):
        h = x @ p["w0"]  # the first matrix op: bf16 under the preset
    with jax.named_scope("act0"):
        h = jax.nn.gelu(h)
    with jax.named_scope("mid1"):
        h = h @ p["w1"]  # fp8
    with jax.named_scope("act1"):  # between the two fp8 dots
        h = jax.nn.gelu(h) + h * p["b1"]
    with jax.named_scope("mid2"):
        h = h @ p["w2"]  # fp8
    with jax.named_scope("act2"):
        h = jax.nn.gelu(h)
    with jax.named_scope("head"):
        logits = h @ p["w3"]  # the last matrix op: bf16 under the preset
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _mlp_step(p: dict, x: jax.Array, labels: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(_mlp_loss)(p, x, labels)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss


def _mlp_args() -> tuple[Any, ...]:
    rng = np.random.default_rng(47)
    def weight(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
    p = {"w0": weight(D_IN, WIDTH), "w1": weight(WIDTH, WIDTH), "b1": np.ones(WIDTH, np.float32),
         "w2": weight(WIDTH, WIDTH), "w3": weight(WIDTH, CLASSES)}
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    return p, x, rng.integers(0, CLASSES, BATCH).astype(np.int32)


DECODER = pd.Cfg(layers=2, dim=256, heads=4, kv_heads=2, hidden=512, vocab=512, seq=128,
                 batch=8)


def _decoder_args() -> tuple[Any, ...]:
    sds = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
    shapes = pd._shapes(DECODER)
    params = {"embed": sds((DECODER.vocab, DECODER.dim)),
              "blocks": [{n: sds(s) for n, s in shapes.items()} for _ in range(DECODER.layers)],
              "final_norm": sds((DECODER.dim,)), "head": sds((DECODER.dim, DECODER.vocab))}
    return params, sds((DECODER.batch, DECODER.seq + 1), jnp.int32)


WORKLOADS = {"mlp": (_mlp_step, _mlp_args),
             "decoder": (pd.pytree_step(DECODER, jnp.float32), _decoder_args)}


@functools.cache
def _lowered(workload: str, policy: str) -> Any:
    step, args = WORKLOADS[workload]
    return hlo_amp.compile(step, policy).lower(*args(), target="h100")


@functools.cache
def _module(workload: str, policy: str) -> ir.Module:
    """The rewritten module, parsed with its locations (kept: its ops live in it)."""
    return parse_module(_lowered(workload, policy).as_text(debug_info=True))


def _ops(workload: str, policy: str) -> list[ir.Operation]:
    return walk_operations(_module(workload, policy))


@functools.cache
def _temp(workload: str, policy: str) -> int:
    return int(_lowered(workload, policy).compile().memory_analysis().temp_size_in_bytes)


def _element(value: Any) -> str:
    """The element type of a tensor value (``bf16``, ``f32``, ``f8E4M3FN``, ...)."""
    return str(ir.RankedTensorType(value.type).element_type)


def _producer(value: Any) -> ir.Operation | None:
    owner = value.owner
    return owner if isinstance(owner, ir.Operation) else getattr(owner, "operation", None)


def _types_off_the_matrix_ops(workload: str, policy: str) -> Counter:
    """(op name, result element type) of every op but the matrix ops and what the pass
    puts at them (operand and result converts, fp8 quantisation: located at the dot)."""
    found: Counter = Counter()
    for op in _ops(workload, policy):
        if op.name in ("stablehlo.optimization_barrier", "stablehlo.dot_general"):
            continue
        # A convert at a dot that other ops read too is also theirs: cleanup merged the
        # program's convert of a value into the quantisation's convert of it.
        if location_name(op.location).endswith("dot_general") and not (
                op.name == "stablehlo.convert" and any(
                    not location_name(use.owner.location).endswith("dot_general")
                    for use in op.results[0].uses)):
            continue
        found.update((op.name, _element(r)) for r in op.results
                     if isinstance(r.type, ir.RankedTensorType))
    return found


# ---- the policy --------------------------------------------------------------------------


def test_the_preset_is_the_fast_mode_and_propagate_false_the_accurate_one() -> None:
    fast, accurate = Policy.preset("fp8"), Policy.parse(ACCURATE)
    assert fast.propagate and not accurate.propagate
    # Nothing else differs: the same fp8 and first/last rules.
    assert {**fast.to_dict(), "propagate": False} == accurate.to_dict()
    for policy in (fast, accurate):
        assert Policy.parse(str(policy)) == policy
        assert Policy.from_dict(policy.to_dict()) == policy


# ---- (a) 16-bit activations --------------------------------------------------------------


def test_the_activations_between_two_fp8_dots_are_bf16() -> None:
    """The gelu and the residual-style add between the fp8 dots of mid1 and mid2 (their
    forward ops on [batch, width] tensors) return bf16, as under mixed_bfloat16; in the
    accurate mode they are f32."""
    def act1_types(policy: str) -> Counter:
        return Counter((op.name, _element(op.results[0])) for op in _ops("mlp", policy)
                       if "jvp(act1)" in location_name(op.location)
                       and "transpose(" not in location_name(op.location)
                       and len(op.results) == 1
                       and isinstance(op.results[0].type, ir.RankedTensorType)
                       and ir.RankedTensorType(op.results[0].type).shape == [BATCH, WIDTH])

    fast = act1_types(FAST)
    kinds = {name for name, _ in fast}
    assert {"stablehlo.tanh", "stablehlo.add", "stablehlo.multiply"} <= kinds, fast
    assert {element for _, element in fast} == {"bf16"}, fast
    assert fast == act1_types(MIXED)
    assert {element for _, element in act1_types(ACCURATE)} == {"f32"}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_op_off_the_matrix_ops_has_mixed_bfloat16s_type(workload: str) -> None:
    """Off the matrix ops, the fast fp8 program is mixed_bfloat16's, op for op: the same
    activations in bf16 and the same f32-critical ops (softmax, norms, the loss, the
    optimizer) in f32. The accurate mode differs: more f32."""
    fast = _types_off_the_matrix_ops(workload, FAST)
    assert fast == _types_off_the_matrix_ops(workload, MIXED)
    assert fast[("stablehlo.exponential", "f32")] > 0  # the softmax stays f32
    assert fast[("stablehlo.exponential", "bf16")] == 0
    accurate = _types_off_the_matrix_ops(workload, ACCURATE)
    assert sum(n for (_, e), n in accurate.items() if e == "f32") > sum(
        n for (_, e), n in fast.items() if e == "f32")


# ---- (b) fp8 at the GEMM inputs ------------------------------------------------------------


def _quantised_from(convert: ir.Operation) -> str:
    """The element type the fp8 quantisation ``convert(clamp(x32 / scale))`` read: that
    of ``x32``'s own input when ``x32`` is a widening convert, else ``x32``'s."""
    clamp = _producer(convert.operands[0])
    assert clamp is not None and clamp.name == "stablehlo.clamp"
    divide = _producer(clamp.operands[1])
    assert divide is not None and divide.name == "stablehlo.divide"
    x32 = divide.operands[0]
    widening = _producer(x32)
    if widening is not None and widening.name == "stablehlo.convert":
        return _element(widening.operands[0])
    return _element(x32)


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_fp8_dots_read_e4m3fn_forward_and_e5m2_gradients_quantised_from_bf16(
        workload: str) -> None:
    dots = [op for op in _ops(workload, FAST) if op.name == "stablehlo.dot_general"
            and any(_element(v) in F8 for v in op.operands)]
    forward = [op for op in dots if "transpose(" not in location_name(op.location)]
    backward = [op for op in dots if "transpose(" in location_name(op.location)]
    assert forward and backward
    for op in forward:
        assert [_element(v) for v in op.operands] == ["f8E4M3FN", "f8E4M3FN"]
    for op in backward:  # the incoming gradient e5m2, the forward value e4m3fn
        assert sorted(_element(v) for v in op.operands) == ["f8E4M3FN", "f8E5M2"]
    # The same dots are fp8, with the same formats, as in the accurate mode.
    def formats(policy: str) -> list[tuple[str, str, tuple[str, ...]]]:
        return sorted((d.scope, d.direction, d.operands_after)
                      for d in _lowered(workload, policy).report().decisions if d.fp8)
    assert formats(FAST) == formats(ACCURATE)
    assert len(formats(FAST)) == len(dots)
    if workload == "mlp":
        assert {d[0] for d in formats(FAST)} == {"mid1", "mid2"}  # stem and head bf16
    # Every fp8 tensor is quantised from a bf16 value (the accurate mode's from f32).
    def sources(policy: str) -> Counter:
        return Counter(_quantised_from(op) for op in _ops(workload, policy)
                       if op.name == "stablehlo.convert" and _element(op.results[0]) in F8)
    assert set(sources(FAST)) == {"bf16"}, sources(FAST)
    assert set(sources(ACCURATE)) == {"f32"}, sources(ACCURATE)


# ---- (c) memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_xla_temp_of_the_fast_mode_is_at_most_the_accurate_modes(workload: str) -> None:
    fast, accurate = _temp(workload, FAST), _temp(workload, ACCURATE)
    assert 0 < fast <= accurate, (fast, accurate)
    if workload == "decoder":  # f32 activations saved for the backward: strictly more
        assert fast < accurate, (fast, accurate)


# ---- (d) the numbers -----------------------------------------------------------------------

# Bounds, from the formats. One e4m3fn rounding errs by at most 2**-4 relative (3 stored
# mantissa bits), one e5m2 rounding by 2**-3; as noise their rms is about 2**-4 / sqrt(12)
# * 2 / sqrt(3) = 0.036 and twice that, per quantised operand. A weight gradient of the
# MLP meets two quantisations in its own dot (e5m2 gradient x e4m3fn activation) and
# the errors of the gradient's backward path before it: its norm-wise relative error is
# a few of those rms values, under 0.2 (framework_steps' fp8 loss tolerance is 0.15 for a
# whole training). The loss, a mean of cross-entropies through one fp8 layer pair, is a
# far smoother function: one e4m3fn unit, 2**-4, bounds it.
LOSS_RTOL = 2.0**-4
GRAD_RTOL = 0.2


def _errors(policy: str | None) -> tuple[float, float]:
    """(relative error of the loss, largest norm-wise relative error of a parameter's
    update) of one step against f32 ``jax.jit``; ``policy`` None: f32 itself."""
    p, x, labels = _mlp_args()
    want_p, want_loss = jax.jit(_mlp_step)(p, x, labels)
    step = jax.jit(_mlp_step) if policy is None else hlo_amp.compile(_mlp_step, policy)
    got_p, got_loss = step(p, x, labels)
    loss_error = abs(float(got_loss) - float(want_loss)) / abs(float(want_loss))
    update_error = max(
        float(np.linalg.norm(np.asarray(got_p[k]) - np.asarray(want_p[k]))
              / np.linalg.norm(np.asarray(want_p[k]) - p[k])) for k in p)
    return loss_error, update_error


def test_the_fast_fp8_step_on_cpu_is_within_fp8_tolerance_of_f32() -> None:
    fast_loss, fast_update = _errors(FAST)
    assert fast_loss <= LOSS_RTOL, fast_loss
    assert fast_update <= GRAD_RTOL, fast_update
    # It is fp8: further from f32 than mixed_bfloat16's step.
    _, mixed_update = _errors(MIXED)
    assert fast_update > mixed_update, (fast_update, mixed_update)
    # The bf16 activations add bf16-sized error to the accurate fp8's, no more.
    _, accurate_update = _errors(ACCURATE)
    assert fast_update <= accurate_update + 2 * mixed_update, (fast_update, accurate_update,
                                                                mixed_update)
