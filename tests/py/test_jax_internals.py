"""Every private JAX entry point hlo_amp uses exists here, with the parameters we pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import hlo_amp
from hlo_amp import jax_internals


def test_every_entry_point_exists_with_expected_parameters():
    assert jax_internals.missing_entry_points() == []
    jax_internals.check()


def test_lowered_objects_have_the_private_fields_we_swap():
    lowered = jax.jit(lambda x: x @ x).trace(jnp.ones((4, 4))).lower()
    for name in ("_lowering", "_no_kwargs", "args_info", "out_tree"):
        assert hasattr(lowered, name), name
    for name in ("_hlo", "_executable", "stablehlo"):
        assert hasattr(lowered._lowering, name), name
    assert jax_internals.lowering_platforms(lowered) == (jax.default_backend(),)


def test_jit_cache_size_counts_signatures():
    jitted = jax.jit(lambda a: a * 2)
    assert jax_internals.jit_cache_size(jitted) == 0
    jitted(jnp.ones(3))
    jitted(jnp.ones(4))
    jitted(jnp.ones(3))
    assert jax_internals.jit_cache_size(jitted) == 2


def test_swap_module_compiles_the_module_it_was_given():
    x = jnp.arange(16.0).reshape(4, 4)
    lowered = jax.jit(lambda a: a @ a).trace(x).lower()
    other = jax.jit(lambda a: a + a).trace(x).lower()
    swapped = jax_internals.swap_module(lowered, other.compiler_ir("stablehlo"))
    assert jnp.array_equal(swapped.compile()(x), x + x)


def test_missing_entry_point_is_one_clear_import_error(monkeypatch):
    entries = dict(jax_internals.ENTRY_POINTS)
    entries["jax._src.interpreters.mlir.lower_fun"] = (None, None)
    entries["jax._src.interpreters.mlir.register_lowering"] = (lambda prim: None,
                                                               ("prim", "rule"))
    monkeypatch.setattr(jax_internals, "ENTRY_POINTS", entries)
    with pytest.raises(ImportError) as info:
        jax_internals.check()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"hlo_amp needs jax {jax_internals.SUPPORTED_JAX}; found {jax.__version__}: ")
    assert "lower_fun is gone" in message
    assert "register_lowering takes no rule" in message


def test_supported_range_matches_the_pin():
    import pathlib
    import re

    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    low, high = re.search(r'"jax>=([\d.]+),<([\d.]+)"', pyproject).groups()
    assert jax_internals.SUPPORTED_JAX.startswith(low)
    major, minor = high.split(".")[:2]
    assert jax_internals.SUPPORTED_JAX.endswith(f"{major}.{int(minor) - 1}.x")
    assert hlo_amp.compile  # the package imported, so check() passed at import


def test_shardy_propagation_is_registered():
    # hlo_amp/ir/shardings.py reads the shardings XLA's partitioner gives a value; without
    # the pipeline scatter_select leaves a partitioned module's scatters as they are.
    from hlo_amp import jaxlib_internals
    from hlo_amp.ir.modules import new_context

    assert jaxlib_internals.shardy_propagation(new_context()) is not None


def test_jaxlib_entry_points_exist_and_make_jaxs_context():
    """hlo_amp/jaxlib_internals.py builds, without jax, the context jax builds: the same
    dialects registered, and a sharded module jax lowered parses and verifies in it."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    from hlo_amp import jaxlib_internals

    assert jaxlib_internals.missing_entry_points() == []
    ours, theirs = jaxlib_internals.make_ir_context(), jax_mlir.make_ir_context()
    for name in ("func.func", "stablehlo.dot_general", "chlo.erf", "sdy.sharding_constraint",
                 "mhlo.copy", "arith.constant", "mpmd.fragment", "gpu.launch", "llvm.add"):
        assert (ours.is_registered_operation(name)
                == theirs.is_registered_operation(name)), name
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    text = jax.jit(lambda a: a * 2, in_shardings=spec).lower(jnp.ones(4)).as_text()
    assert "sdy." in text
    module = ir.Module.parse(text, ours)
    assert module.operation.verify()
