"""benchmarks/llm.py: the Llama-style step compiles sharded for a node of GPUs, its
parameters keep their FSDP x TP shardings, and the hand-cast peer runs its GEMMs in bf16.
A one-block model keeps each compile to seconds."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import hlo_amp
from benchmarks import llm
from hlo_amp.targets.kept_by_xla import xla_gemms

TINY = dataclasses.replace(llm.SMALL, layers=1, dim=128, hidden=256, vocab=512, seq=64)


def test_default_size_is_about_a_billion_parameters() -> None:
    assert 1.0e9 < llm.param_count(llm.Config()) < 1.3e9
    assert llm.param_count(TINY) < 1e6


def test_a_batch_the_mesh_cannot_split_is_refused() -> None:
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})
    with pytest.raises(ValueError, match=r"batch=6 does not split over a mesh axis of 4"):
        llm.abstract_state(dataclasses.replace(TINY, batch=6), mesh)


@pytest.mark.parametrize("variant", ["hand-cast bf16", "hlo_amp bf16"])
def test_variant_compiles_sharded_for_h100x8(variant: str) -> None:
    compiled = llm.compile_variant(variant, "h100x8", TINY, {"fsdp": 4, "tp": 2})
    jax_compiled = getattr(compiled, "jax_compiled", compiled)
    params_in = jax_compiled.input_shardings[0][0]
    block = params_in["blocks"][0]
    assert block["wq"].spec == llm.PARAM_SPECS["wq"] and block["wo"].spec == llm.PARAM_SPECS["wo"]
    assert params_in["embed"].spec == llm.PARAM_SPECS["embed"]
    # The updated params leave with the shardings they came in with.
    params_out = jax_compiled.output_shardings[0]
    assert jax.tree.map(lambda s: s.spec, params_out) == jax.tree.map(lambda s: s.spec,
                                                                       params_in)
    hlo = compiled.as_text()
    assert "all-gather" in hlo or "reduce-scatter" in hlo
    if variant == "hand-cast bf16":
        gemms = xla_gemms(hlo)  # cuBLAS GEMMs, every one reading bf16 operands
        assert gemms and {g.operand_types for g in gemms} == {("bf16", "bf16")}, gemms
    else:
        dots = [d for d in compiled.report().decisions if d.op_kind == "dot_general"]
        assert dots and all(d.operands_after == ("bf16", "bf16") for d in dots)
