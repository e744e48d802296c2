"""Compiling for several devices this machine does not have: a node of GPUs
(``"h100x8"``), nodes (``"h100:2x8"``), a TPU slice (``"tpu-v5e:4x4"``).

``hlo_amp.target_mesh`` makes a mesh over the target's abstract devices; arguments
sharded on it keep their shardings through ``.lower(..., target=...)``, XLA's SPMD
partitioner runs, and the optimized HLO holds each device's share and the collectives.
Tiny shapes throughout: every compile here takes about a second.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_devices import host_devices_env
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hlo_amp
from hlo_amp import targets
from hlo_amp.runtime import deviceless

HLO_AMP_OPT = str(Path(sys.executable).parent / "hlo-amp-opt")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")
_ENTRY_PARAM = re.compile(r"(\w+)\[([\d,]*)\]")


# -- names -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "devices", "family"), [
    ("h100", 1, "gpu"), ("h100x8", 8, "gpu"), ("h200x8", 8, "gpu"), ("a100x8", 8, "gpu"),
    ("h100x3", 3, "gpu"), ("h100:2x8", 16, "gpu"), ("tpu-v5e", 1, "tpu"),
    ("tpu-v5e:4x4", 16, "tpu"), ("tpu-v6e:4x4", 16, "tpu"), ("tpu-v5p:2x2x4", 16, "tpu"),
    # libtpu's v4 topology has a device per TensorCore: 8 chips, 16 devices.
    ("tpu-v4:2x2x2", 16, "tpu"),
])
def test_names_give_the_device_count(name: str, devices: int, family: str) -> None:
    target = targets.device_target(name)
    assert target.devices == devices and target.family == family
    assert target.link_bytes_per_second and target.link_bytes_per_second > 0
    assert len(deviceless.target_mesh(target).devices.flat) == devices


def test_link_bandwidth_is_nvlink_in_a_node_and_the_network_between_nodes() -> None:
    node, nodes = targets.device_target("h100x8"), targets.device_target("h100:2x8")
    # NVLink 4: 900 GB/s both directions per GPU (H100 SXM datasheet), half each way.
    assert node.link_bytes_per_second == 900e9 / 2
    assert nodes.link_bytes_per_second < node.link_bytes_per_second
    assert (targets.device_target("a100x8").link_bytes_per_second
            < node.link_bytes_per_second)
    # A TPU's ICI is per chip whatever the slice.
    assert (targets.device_target("tpu-v5e:4x4").link_bytes_per_second
            == targets.device_target("tpu-v5e:2x2").link_bytes_per_second)


@pytest.mark.parametrize(("name", "accepted"), [
    ("h100x9", r"is 1 node\(s\) of 9 GPUs.*NAMExN .*N from 1 to 8"),
    ("h100x0", r"of 0 GPUs.*NAME:MxN"),
    ("h100x", r"a GPU target is NAME \(one GPU\)"),
    ("a100:2", r"a GPU target is NAME"),
    ("tpu-v5e:3x7", r"is 21 chips: a tpu-v5e slice is AxB chips with A and B even"),
    ("tpu-v5e:32x32", r"is 1024 chips: .*at most 256 chips"),
    ("tpu-v5p:2x2", r"a tpu-v5p slice is AxBxC chips .* e\.g\. tpu-v5p:2x2x1"),
    ("tpu-v6e:4xfour", r"a tpu-v6e slice is AxB chips"),
    ("tpu-v5e:", r"a tpu-v5e slice is AxB chips"),  # was one chip named "tpu-v5e:"
])
def test_bad_names_say_what_is_accepted(name: str, accepted: str) -> None:
    with pytest.raises(ValueError, match=rf"target={name!r}.*{accepted}"):
        targets.device_target(name)
    f = hlo_amp.compile(lambda a: a @ a, "bf16")
    with pytest.raises(ValueError, match=accepted):
        f.lower(jnp.ones((8, 8)), target=name)


# -- target_mesh -------------------------------------------------------------------------


def test_target_mesh_shapes() -> None:
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})
    assert dict(mesh.shape) == {"fsdp": 4, "tp": 2}
    assert len({d.id for d in mesh.devices.flat}) == 8
    assert {d.platform for d in mesh.devices.flat} == {"gpu"}
    nodes = hlo_amp.target_mesh("h100:2x8", {"data": 2, "fsdp": 4, "tp": 2})
    assert nodes.devices.shape == (2, 4, 2)
    # No axes: one axis over every device; a one-device target is one device, as before.
    assert dict(hlo_amp.target_mesh("tpu-v5e:4x4").shape) == {"device": 16}
    assert hlo_amp.target_mesh("h100").devices.shape == (1,)
    assert hlo_amp.target_mesh(targets.device_target("tpu-v5e")).devices.shape == (1,)


def test_target_mesh_errors() -> None:
    with pytest.raises(ValueError, match=r"make a mesh of 16 devices; target 'h100x8' has "
                                         r"8: their sizes must multiply to 8"):
        hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 4})
    with pytest.raises(ValueError, match=r"make a mesh of 8 devices; target 'h100' has 1"):
        hlo_amp.target_mesh("h100", {"fsdp": 8})
    with pytest.raises(TypeError, match=r"expected a dict of axis names to positive sizes"):
        hlo_amp.target_mesh("h100x8", {"fsdp": 8.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"neither a known GPU"):
        hlo_amp.target_mesh("h900x8")


def test_a_device_target_makes_its_own_topology_and_mesh() -> None:
    """The topology and the mesh are the target's (targets/topology.py): target_mesh only
    names the target; a family target with no device has no topology to compile for."""
    node = targets.device_target("h100x8")
    assert node.mesh({"fsdp": 4, "tp": 2}) == hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})
    assert [d.id for d in node.topology_devices()] == list(range(8))
    assert len(targets.device_target("tpu-v5e").topology_devices()) == 1
    for family in (targets.CPU, targets.GPU, targets.TPU, targets.NO_TARGET):
        with pytest.raises(ValueError, match=r"is not a device to compile for"):
            family.mesh()


# -- a sharded train step -------------------------------------------------------------------


def _loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for w in params[:-1]:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)


def train_step(params: list, x: jax.Array, y: jax.Array) -> list:
    grads = jax.grad(_loss)(params, x, y)
    return [p - 0.1 * g for p, g in zip(params, grads)]


PARAM_SHAPES = ((64, 128), (128, 128), (128, 64))


def sharded_arguments(mesh: jax.sharding.Mesh) -> tuple:
    def sds(shape: tuple, spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    params = [sds(shape, P("fsdp", "tp")) for shape in PARAM_SHAPES]
    return params, sds((32, 64), P("fsdp", None)), sds((32, 64), P("fsdp", None))


def entry_parameters(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, per-device shape) of each parameter of XLA's entry computation."""
    entry = next(line for line in hlo.splitlines() if line.startswith("ENTRY"))
    params = entry[entry.index("(") + 1:entry.index(")")]
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ENTRY_PARAM.findall(params)]


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
@pytest.mark.parametrize(("target", "axes"), [("h100x8", {"fsdp": 4, "tp": 2}),
                                              ("tpu-v5e:4x4", {"fsdp": 4, "tp": 4})])
def test_sharded_train_step_keeps_its_shardings(target: str, axes: dict, policy: str) -> None:
    mesh = hlo_amp.target_mesh(target, axes)
    params, x, y = sharded_arguments(mesh)
    lowered = hlo_amp.compile(train_step, policy).lower(params, x, y, target=target)
    compiled = lowered.compile()
    jax_compiled = compiled.jax_compiled
    in_params = jax_compiled.input_shardings[0][0]
    assert [s.spec for s in in_params] == [P("fsdp", "tp")] * 3
    assert all(s.mesh.devices.size == mesh.devices.size for s in in_params)
    # The updated params come back as jax.jit would leave them: sharded like the params.
    assert [s.spec for s in jax_compiled.output_shardings] == [P("fsdp", "tp")] * 3
    hlo = compiled.as_text()
    # Each device holds its share: (64, 128) over fsdp=4, tp=axes["tp"].
    shares = {(rows // axes["fsdp"], cols // axes["tp"]) for rows, cols in PARAM_SHAPES}
    assert shares <= {shape for _, shape in entry_parameters(hlo)}
    assert all(dtype == "f32" for dtype, _ in entry_parameters(hlo))  # signature kept
    assert any(name in hlo for name in COLLECTIVES)
    report = compiled.report()
    changed = [d for d in report.decisions if d.changed]
    # On TPU the accurate mode leaves its f32 dots f32: XLA:TPU rounds their operands to
    # bf16 itself at DEFAULT precision (Target.f32_dot_runs_as).
    left = [d for d in report.decisions
            if d.reason.startswith("kept f32: XLA:TPU rounds an f32 dot's operands")]
    assert len(changed) + len(left) == len(report.decisions)
    assert changed if policy != "bf16" or not target.startswith("tpu") else left
    assert all(d.operands_after == ("bf16", "bf16") for d in changed
               if d.op_kind == "dot_general")
    assert all(d.kept_by_xla for d in changed if d.op_kind == "dot_general")


@pytest.mark.parametrize(("target", "axes"), [
    ("h100:2x8", {"data": 2, "fsdp": 4, "tp": 2}), ("a100x4", {"fsdp": 2, "tp": 2}),
    ("tpu-v4:2x2x2", {"fsdp": 8, "tp": 2}), ("tpu-v5p:2x2x4", {"fsdp": 8, "tp": 2}),
    ("tpu-v6e:4x4", {"fsdp": 8, "tp": 2})])
def test_nodes_and_slices_compile_each_devices_share(target: str, axes: dict) -> None:
    mesh = hlo_amp.target_mesh(target, axes)
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", "tp")))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    compiled = hlo_amp.compile(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)),
                               "bf16").lower(w, x, target=target).compile()
    shares = {shape for _, shape in entry_parameters(compiled.as_text())}
    assert shares == {(128 // axes["fsdp"], 256 // axes["tp"]), (64 // axes["fsdp"], 128)}
    assert all(d.kept_by_xla for d in compiled.report().decisions if d.changed)


@pytest.mark.parametrize("policy", ["bf16", "bf16,reduce=bfloat16"])
def test_tpu_accurate_mode_sums_gradients_in_the_reduce_dtype(policy: str) -> None:
    """On TPU the accurate mode leaves its f32 dots to XLA:TPU's one bf16 pass; under
    reduce=bfloat16 the weight gradients, whose batch "fsdp" shards, still return bf16
    and XLA:TPU sums them in bf16 across devices. Without reduce= every sum is f32."""
    mesh = hlo_amp.target_mesh("tpu-v5e:2x2", {"fsdp": 2, "tp": 2})
    lowered = hlo_amp.compile(train_step, policy).lower(*sharded_arguments(mesh),
                                                         target="tpu-v5e:2x2")
    assert "hlo_amp." not in lowered.as_text()  # the pass's marks stay inside it
    compiled = lowered.compile()
    report = compiled.report()
    assert report.decisions and all(
        d.operands_after == d.operands_before and d.reason.startswith("kept f32: XLA:TPU rounds")
        for d in report.decisions)
    # Under reduce=bfloat16 the summed dots return bf16, as the report says (and so are
    # changed); without it nothing is.
    retyped = [d for d in report.decisions if d.changed]
    assert all(d.result_after == "bf16" for d in retyped)
    assert bool(retyped) == ("reduce" in policy)
    sums = [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")
            and c.element_types != ("s32",)]
    sixteen = [c for c in sums if c.element_types == ("bf16",)]
    assert sums and (len(sixteen) >= len(PARAM_SHAPES) if "reduce" in policy
                     else not sixteen), sums


def test_arguments_of_another_size_or_unsharded_are_replicated() -> None:
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})
    other = hlo_amp.target_mesh("tpu-v5e:2x2", {"fsdp": 4})  # 4 devices, not 8
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"),
                                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def sds(sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=sharding)

    args = (sds(NamedSharding(mesh, P("fsdp"))), sds(NamedSharding(other, P("fsdp"))),
            jnp.ones((16, 16)), sds(NamedSharding(abstract, P("data", "model"))))
    with pytest.warns(UserWarning, match=r"mesh of 4 devices .* replicated on the 8 "
                      r"devices of target 'h100x8'.*target_mesh"):
        placed = deviceless.abstract_arguments(args, targets.device_target("h100x8"))
    assert placed[0].sharding == args[0].sharding
    assert [a.sharding.spec for a in placed[1:3]] == [P(), P()]
    assert all(a.sharding.mesh.devices.size == 8 for a in placed)
    # An abstract mesh of 8: the same axes, their types kept, on the target's devices.
    assert placed[3].sharding.spec == P("data", "model")
    rebuilt = placed[3].sharding.mesh
    assert (rebuilt.axis_names, rebuilt.axis_types) == (abstract.axis_names,
                                                        abstract.axis_types)


def test_with_sharding_constraint_and_shard_map_compile() -> None:
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})

    def constrained(w: jax.Array, x: jax.Array) -> jax.Array:
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("fsdp", "tp")))
        return jnp.sum(h ** 2)

    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "tp")))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    compiled = hlo_amp.compile(jax.grad(constrained), "bf16").lower(
        w, x, target="h100x8").compile()
    assert compiled.jax_compiled.output_shardings.spec == P(None, "tp")
    assert "all-reduce" in compiled.as_text()

    def body(wb: jax.Array, xb: jax.Array) -> jax.Array:
        return jax.lax.psum(xb @ wb, "tp")

    def blockwise(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P("fsdp", "tp")),
                             out_specs=P("fsdp", None))(w, x)

    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("tp")))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32,
                             sharding=NamedSharding(mesh, P("fsdp", "tp")))
    compiled = hlo_amp.compile(blockwise, "bf16").lower(w, x, target="h100x8").compile()
    assert [shape for _, shape in entry_parameters(compiled.as_text())] == [(32, 128), (8, 32)]
    assert "all-reduce" in compiled.as_text()
    [dot] = compiled.report().decisions
    assert dot.operands_after == ("bf16", "bf16") and dot.kept_by_xla is True


_CPU_ARRAYS = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import hlo_amp
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    w = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P("fsdp", "tp")))
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("fsdp")))
    lowered = hlo_amp.compile(lambda w, x: jnp.tanh(x @ w), "bf16").lower(w, x, target="h100x8")
    compiled = lowered.compile().jax_compiled
    print(json.dumps([[list(s.spec), s.mesh.devices.flat[0].platform,
                       dict(s.mesh.shape)] for s in compiled.input_shardings[0]]))
""")


def test_real_arrays_sharded_on_this_machine_keep_their_shardings() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CPU_ARRAYS], capture_output=True, text=True, check=False,
        env=host_devices_env(8))
    assert proc.returncode == 0, proc.stderr
    shardings = json.loads(proc.stdout.splitlines()[-1])
    assert shardings == [[["fsdp", "tp"], "gpu", {"fsdp": 4, "tp": 2}],
                         [["fsdp"], "gpu", {"fsdp": 4, "tp": 2}]]


def test_one_device_target_keeps_a_sharding_on_its_mesh() -> None:
    mesh = hlo_amp.target_mesh("h100")
    a = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("device")))
    compiled = hlo_amp.compile(lambda a: a @ a, "bf16").lower(a, target="h100").compile()
    assert compiled.jax_compiled.input_shardings[0][0] == a.sharding
    assert not any(name in compiled.as_text() for name in COLLECTIVES)


# -- hlo-amp-opt ---------------------------------------------------------------------------


def test_cli_compiles_a_module_sharded_over_a_node(tmp_path: Path) -> None:
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", "tp")))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    text = jax.jit(lambda w, x: jnp.tanh(x @ w) @ w.T).trace(w, x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mhlo.num_partitions = 8" in text
    module = tmp_path / "sharded.mlir"
    module.write_text(text)
    report_path = tmp_path / "report.json"
    proc = subprocess.run([HLO_AMP_OPT, str(module), "--policy", "bf16", "--xla-target",
                           "h100x8", "--report", str(report_path), "-o",
                           str(tmp_path / "out.mlir")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["xla_device"] == "H100"
    assert [d["kept_by_xla"] for d in report["decisions"] if d["changed"]] == [True, True]
    # XLA's partitioner moves the sharded operands: the report lists what it moves.
    assert {c["kind"] for c in report["collectives"]} & {"all-gather", "all-reduce",
                                                         "reduce-scatter", "all-to-all"}
    assert "mhlo.num_partitions = 8" in (tmp_path / "out.mlir").read_text()
    # One GPU cannot hold an 8-way partitioned module: one line, naming targets that can.
    proc = subprocess.run([HLO_AMP_OPT, str(module), "--xla-target", "h100", "-o",
                           str(tmp_path / "o.mlir")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [(
        "hlo-amp-opt: error: --xla-target h100: the module is partitioned over 8 devices "
        "(mhlo.num_partitions); target 'h100' has 1: compile it for a target with 8 "
        "devices (h100x8, tpu-v5e:2x4)")]


@pytest.mark.parametrize("policy", [
    "bf16", "fp8,scaling=delayed,first_matrix_op=none,last_matrix_op=none"])
def test_a_jax_jit_with_shardings_compiles_for_a_target_as_its_peer(policy: str) -> None:
    """hlo_amp.compile of a jax.jit given in_shardings and out_shardings, compiled for
    h100x8: its arguments are placed by its in_shardings, as compile_for_target's peer
    places them. They were replicated on the target's one-axis mesh: with out_shardings
    the compile failed (IndivisibleError), with in_shardings each GPU took the whole
    weight (5.00 MiB of arguments against the peer's 0.75). Under delayed scaling the
    step is wrapped to carry its amax history: its shardings were missed so until
    2026-11-29 (the history, replicated, comes first)."""
    mesh = hlo_amp.target_mesh("h100x8", {"fsdp": 4, "tp": 2})

    def step(w, x):
        return jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    jitted = jax.jit(step, in_shardings=(NamedSharding(mesh, P("fsdp", "tp")),
                                         NamedSharding(mesh, P("fsdp"))),
                     out_shardings=NamedSharding(mesh, P("fsdp", "tp")))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    peer = hlo_amp.compile_for_target(jitted, w, x, target="h100x8").jax_compiled
    ours = hlo_amp.compile(jitted, policy).lower(w, x, target="h100x8").compile().jax_compiled
    inputs = jax.tree.leaves(ours.input_shardings)
    history_bytes = 0
    if "delayed" in policy:
        history, *inputs = inputs
        assert history.is_fully_replicated
        history_bytes = math.prod(ours.in_avals[0][0].shape) * 4
        assert history_bytes > 0  # the step's dots are fp8
    assert len(inputs) == 2
    for got, want in zip(inputs, jax.tree.leaves(peer.input_shardings)):
        assert got.is_equivalent_to(want, 2), (got, want)
    assert jax.tree.leaves(ours.output_shardings)[0].is_equivalent_to(
        jax.tree.leaves(peer.output_shardings)[0], 2)
    assert (ours.memory_analysis().argument_size_in_bytes - history_bytes
            == peer.memory_analysis().argument_size_in_bytes)


def test_a_jax_jit_sharded_on_this_machines_devices_is_refused_for_a_target() -> None:
    """A jax.jit whose shardings are on this machine's CPU devices, compiled nested for
    a GPU target, compiled for those devices: XLA:CPU's program (bf16 dots upcast,
    collectives in f32) came back as the GPU's, 'kept by XLA: 0/11'. It is refused
    naming what to do; the jit built on the target's mesh compiles for the target."""
    def step(w, x):
        return jnp.tanh(x @ w) @ w.T

    w, x = jax.ShapeDtypeStruct((32, 32), jnp.float32), jax.ShapeDtypeStruct((64, 32),
                                                                            jnp.float32)
    host = Mesh(np.array(jax.devices()[:1]), ("b",))
    jitted = jax.jit(step, in_shardings=(NamedSharding(host, P()), NamedSharding(host, P())))
    with pytest.raises(ValueError, match=r"name this machine's cpu devices.*target_mesh"):
        hlo_amp.compile(jitted, "bf16").lower(w, x, target="h100")
    target = hlo_amp.target_mesh("h100", {"b": 1})
    jitted = jax.jit(step, in_shardings=(NamedSharding(target, P()), NamedSharding(target, P())))
    report = hlo_amp.compile(jitted, "bf16").lower(w, x, target="h100").compile().report()
    assert [d.kept_by_xla for d in report.decisions] == [True, True]
