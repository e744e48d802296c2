"""reduce= (passes/comm_precision.py) on benchmarks/llm.py's scanned step: the dots of a
``jax.lax.scan``'s body (a ``stablehlo.while``) and of the functions it calls (the scan's
``dynamic_index_in_dim`` of each stacked weight, remat's checkpoint body) learn their
shardings from the step's arguments, so the scanned form retypes each layer's dots as
the unrolled form does, and ``reduce=float32`` sums every dot's partial results in f32
inside the loop. FSDP x TP on 8 H100s, compiled without the devices."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest

import hlo_amp
from benchmarks import llm
from hlo_amp.targets import device_target

TINY = dataclasses.replace(llm.SMALL, layers=2, dim=128, hidden=256, vocab=512, seq=64)
AXES = {"fsdp": 4, "tp": 2}
RETYPED = re.compile(r"(\d+) dot\(s\) with a sharded contracting dimension")


def _retyped(config: llm.Config, policy: str) -> int:
    """The dots comm-precision retyped (its report note), from the lowered step."""
    device = device_target("h100x8")
    mesh = hlo_amp.target_mesh(device, AXES)
    step = llm.make_train_step(config, jnp.float32, mesh)
    lowered = hlo_amp.compile(step, policy).lower(*llm.abstract_state(config, mesh),
                                                  target=device)
    notes = [n for n in lowered.report().notes if n.startswith("comm-precision")]
    match = RETYPED.search(notes[0]) if notes else None
    return int(match.group(1)) if match else 0


@pytest.mark.parametrize("policy", ["bf16,reduce=bfloat16", "mixed_bfloat16,reduce=float32"])
def test_the_scanned_step_retypes_each_layer_as_the_unrolled_one(policy: str) -> None:
    # The scan's body holds one layer's dots (forward, rematerialised forward and
    # backward) once, as a one-layer unrolled step does.
    assert TINY.scan_layers
    one_layer = dataclasses.replace(TINY, layers=1, scan_layers=False)
    unrolled = _retyped(one_layer, policy)
    assert unrolled > 0
    assert _retyped(TINY, policy) == unrolled


def test_reduce_float32_sums_the_loop_dots_in_f32() -> None:
    compiled = llm.compile_variant("hlo_amp mixed reduce=float32", "h100x8", TINY, AXES)
    sums = [c for c in compiled.report().collectives
            if c.kind == "all-reduce" and "dot_general" in c.op_name]
    in_loop = [c for c in sums if "while/body" in c.op_name]
    assert in_loop and all(c.count == TINY.layers for c in in_loop), in_loop
    assert all(c.element_types == ("f32",) for c in sums), [
        (c.op_name, c.element_types) for c in sums if c.element_types != ("f32",)]
