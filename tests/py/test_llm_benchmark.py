"""benchmarks/llm.py: the Llama-style step compiles sharded for a node of GPUs, its
parameters keep their FSDP x TP shardings, the hand-cast peer runs its GEMMs in bf16, and
the scanned form (stacked blocks, ``jax.lax.scan``) computes what the unrolled form does
and gathers its stacked blocks in 16 bit inside the loop. Two tiny blocks keep each
compile to seconds."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import hlo_amp
from benchmarks import llm
from hlo_amp.targets.kept_by_xla import xla_gemms

TINY = dataclasses.replace(llm.SMALL, layers=2, dim=128, hidden=256, vocab=512, seq=64)


def test_default_size_is_about_a_billion_parameters() -> None:
    assert 1.0e9 < llm.param_count(llm.Config()) < 1.3e9
    assert llm.param_count(TINY) < 1e6
    assert llm.param_count(TINY) == llm.param_count(dataclasses.replace(TINY,
                                                                        scan_layers=False))


def test_a_batch_the_mesh_cannot_split_is_refused() -> None:
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})
    with pytest.raises(ValueError, match=r"batch=6 does not split over a mesh axis of 4"):
        llm.abstract_state(dataclasses.replace(TINY, batch=6), mesh)


def test_scanned_and_unrolled_forms_give_the_same_loss_and_gradients() -> None:
    scanned = dataclasses.replace(TINY, batch=2)
    unrolled = dataclasses.replace(scanned, scan_layers=False)
    # numpy values (jax's threefry would compile for seconds): the unrolled list of
    # blocks, and the same blocks stacked for the scan.
    rng = np.random.default_rng(0)
    params_u = jax.tree.map(
        lambda shape: np.ones(shape, np.float32) if len(shape) == 1
        else 0.02 * rng.standard_normal(shape, np.float32),
        llm.param_shapes(unrolled), is_leaf=lambda x: isinstance(x, tuple))
    params_s = {**params_u, "blocks": jax.tree.map(lambda *layers: np.stack(layers),
                                                   *params_u["blocks"])}
    tokens = rng.integers(0, scanned.vocab, (2, scanned.seq + 1), dtype=np.int32)
    results = []
    for config, params in ((scanned, params_s), (unrolled, params_u)):
        grad_fn = jax.value_and_grad(lambda p, t, c=config: llm.loss_fn(p, t, c))
        results.append(jax.jit(grad_fn)(params, tokens))
    (loss_s, grads_s), (loss_u, grads_u) = results
    assert abs(float(loss_s) - float(loss_u)) < 1e-5 * abs(float(loss_u))
    # The scanned step's block gradients are the unrolled step's, stacked per layer.
    stacked_u = jax.tree.map(lambda *layers: np.stack(layers), *grads_u["blocks"])
    assert grads_s["blocks"].keys() == stacked_u.keys()
    for name, grad in grads_s["blocks"].items():
        assert grad.shape[0] == TINY.layers and np.abs(grad).max() > 0, name
        np.testing.assert_allclose(grad, stacked_u[name], rtol=1e-3, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(grads_s["embed"], grads_u["embed"], rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("variant", ["hand-cast bf16", "hlo_amp bf16"])
def test_scanned_variant_compiles_sharded_for_h100x8(variant: str) -> None:
    assert TINY.scan_layers
    compiled = llm.compile_variant(variant, "h100x8", TINY, {"fsdp": 4, "tp": 2})
    jax_compiled = getattr(compiled, "jax_compiled", compiled)
    params_in = jax_compiled.input_shardings[0][0]
    blocks = params_in["blocks"]  # stacked: the layer axis unsplit, then Megatron's split
    assert blocks["wq"].spec == llm.block_spec("wq", TINY) == jax.sharding.PartitionSpec(
        None, "fsdp", "tp")
    assert blocks["wo"].spec == llm.block_spec("wo", TINY)
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
        return
    report = compiled.report()
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    assert dots and all(d.operands_after == ("bf16", "bf16") for d in dots)
    # The blocks' FSDP gathers sit in the scan's while loop, once per layer (forward and
    # the rematerialised forward), and move the bf16 casts, not the f32 stack.
    gathers = [c for c in report.collectives
               if c.kind == "all-gather" and "/while/body/" in c.op_name]
    assert len(gathers) >= 2, report.collectives
    assert all(c.element_types == ("bf16",) and c.count == TINY.layers for c in gathers), \
        gathers


def test_no_constraints_leaves_the_residual_stream_unconstrained(tmp_path, monkeypatch) -> None:
    # issue 48: --no-constraints builds the step without a mesh for forward()'s
    # with_sharding_constraint and writes a RESULTS section of its own.
    meshes = []
    real = llm.make_train_step

    def recording(config, dtype, mesh=None):
        meshes.append(mesh)
        return real(config, dtype, mesh)

    monkeypatch.setattr(llm, "make_train_step", recording)
    results = tmp_path / "RESULTS.md"
    results.write_text("<!-- benchmarks.llm --device h100x8: begin -->\nkept\n"
                       "<!-- benchmarks.llm --device h100x8: end -->\n")
    llm.main(["--device", "h100x8", "--small", "--layers", "1", "--no-constraints",
              "--variant", "f32", "--results", str(results)])
    assert meshes == [None]
    text = results.read_text()
    assert "kept" in text  # the constrained section stays
    assert "<!-- benchmarks.llm --device h100x8 --no-constraints: begin" in text
    assert "no activation constraints" in text
    meshes.clear()
    llm.compile_variant("f32", "h100x8", TINY, {"fsdp": 4, "tp": 2})
    assert meshes and meshes[0] is not None  # the default constrains on the mesh


def test_the_step_donates_its_state_unless_told_not_to() -> None:
    # As a training loop (and --device gpu) runs it: XLA aliases the new parameters and
    # optimizer state to the old ones, so its temp cannot hide in output buffers.
    axes = {"fsdp": 4, "tp": 2}
    donated = llm.compile_variant("hlo_amp mixed_bfloat16", "h100x8", TINY, axes)
    kept = llm.compile_variant("hlo_amp mixed_bfloat16", "h100x8", TINY, axes, donate=False)
    state = donated.memory_analysis().argument_size_in_bytes
    assert donated.memory_analysis().alias_size_in_bytes >= 0.99 * state > 0
    assert kept.memory_analysis().alias_size_in_bytes == 0


def test_the_cudnn_peer_is_refused_off_a_gpu(tmp_path, capsys) -> None:
    results = tmp_path / "RESULTS.md"
    llm.main(["--device", "tpu-v5e:4x4", "--small", "--layers", "1",
              "--variant", llm.CUDNN_PEER, "--results", str(results)])
    text = results.read_text()
    assert (f"- {llm.CUDNN_PEER}: not compiled: jax.nn.dot_product_attention"
            in text) and "NVIDIA GPU only" in text
    assert "parameters and optimizer state donated" in text
