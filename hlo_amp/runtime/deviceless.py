"""Compiling for a GPU or TPU this machine does not have: the mesh on its topology,
lowering and compiling on it. The devices themselves (their config protos, slices, peaks,
refusals) are targets: hlo_amp/targets/gpu.py and tpu.py.

XLA compiles for a GPU described by a ``GpuTargetConfig`` text proto with no device
present: ``jax.experimental.topologies`` makes a topology (and a mesh on it) from the
proto, JAX lowers for ``"cuda"`` with arguments placed on that mesh, and XLA:GPU runs its
whole pipeline (GEMM rewriting to cuBLAS, cuDNN convolutions, fusion, buffer assignment).
Only the CUDA PJRT plugin is needed (``pip install 'hlo_amp[gpu]'``), no driver, no GPU.

What such a compile cannot tell: kernel choices a real GPU would autotune. There is no
autotuning without a device, and XLA's Triton GEMM fusion then fails on some programs
(``Couldn't find output tile sizes``), so every GEMM is compiled as a cuBLAS call
(``xla_gpu_enable_triton_gemm=false``); a real run may pick Triton for some of them.
``cost_analysis()`` is empty; ``memory_analysis()`` and the optimized HLO are XLA's own.

TPUs the same way with libtpu (``pip install 'hlo_amp[tpu]'``): ``get_topology_desc``
makes a generation's smallest slice (``v5e:2x2``) from its name, and one of its devices
holds the replicated arguments. libtpu looks for a TPU VM's metadata server unless
``TPU_SKIP_MDS_QUERY`` is set, so it is set before the first TPU topology is made (and at
import where ``JAX_PLATFORMS`` excludes TPUs, with ``ALLOW_MULTIPLE_LIBTPU_LOAD``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax

from hlo_amp.targets import GpuTarget, Target, TpuTarget, device_target
from hlo_amp.targets.tpu import default_slice

# Where JAX was told not to use a TPU, libtpu serves only deviceless compiles: it need not
# ask for a TPU VM's metadata, and several processes (a test and the CLI it runs) may load
# it without its lockfile refusing the second (set before jax initialises its backends).
if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

class NoCompilerForTarget(RuntimeError):
    """The XLA backend for the target is not installed (the CUDA PJRT plugin)."""


def target_mesh(target: Target) -> jax.sharding.Mesh:
    """A one-device mesh on the target's topology (abstract devices, nothing to run on)."""
    if isinstance(target, TpuTarget):
        return _tpu_mesh(target.topology, target.description)
    if not isinstance(target, GpuTarget) or not target.target_config:
        raise ValueError(f"target {target.name!r} is not a device to compile for")
    return _mesh(target.platform, target.target_config, target.description)


@functools.cache
def _tpu_mesh(topology_name: str, description: str) -> jax.sharding.Mesh:
    import numpy as np
    from jax.experimental import topologies

    from hlo_amp.quiet_stderr import fd2_muted

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    try:
        # libtpu prints its host probes (accelerator type, worker hostnames: none here,
        # harmless) straight to fd 2 when it loads; failures still arrive as exceptions.
        with fd2_muted():
            topology = topologies.get_topology_desc(topology_name, "tpu")
    except Exception as error:  # noqa: BLE001 - libtpu missing, or a slice it refuses
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        missing = ("tpu" in first.lower() and "unknown backend" in first.lower()
                   or "libtpu" in first.lower())
        default = default_slice(topology_name)
        advice = ("It needs libtpu matching your jaxlib: pip install 'hlo_amp[tpu]'"
                  if missing else f"A slice that works: tpu-{default} (the default)"
                  if default and default != topology_name else "")
        raise NoCompilerForTarget(
            f"cannot compile for {description} without a device: {first}. {advice}".strip()
        ) from None
    return jax.sharding.Mesh(np.array(topology.devices[:1]), ("device",))


@functools.cache
def _mesh(platform: str, target_config: str, description: str) -> jax.sharding.Mesh:
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform=platform, target_config=target_config, topology="1x1x1")
    except Exception as error:  # noqa: BLE001 - the plugin is missing or refuses the proto
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise NoCompilerForTarget(
            f"cannot compile for {description} without a device: {first}. {_plugin_advice()}"
        ) from None
    return topologies.make_mesh(topology, (1,), ("device",))


def _plugin_advice() -> str:
    import importlib.util

    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return ("It needs the CUDA PJRT plugin matching your jaxlib: "
                "pip install 'hlo_amp[gpu]'")
    # Installed but not registered: on a machine without a CUDA runtime the plugin's
    # version check fails unless CPU was asked for explicitly.
    return ("The CUDA plugin is installed but did not register: on a machine without a "
            "GPU, start Python with JAX_PLATFORMS=cpu")


def abstract_arguments(tree: Any, target: Target) -> Any:
    """``tree`` with every array leaf an abstract value placed on the target's mesh.

    Leaves already placed on that mesh (``jax.ShapeDtypeStruct(..., sharding=...)`` with
    ``target_mesh(target)``) keep their sharding; every other array is replicated.
    """
    mesh = target_mesh(target)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(leaf: Any) -> Any:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            if isinstance(leaf, (bool, int, float, complex)):  # traced like jax.jit does
                return jax.ShapeDtypeStruct((), jax.numpy.asarray(leaf).dtype,
                                            sharding=replicated, weak_type=True)
            return leaf
        sharding = getattr(leaf, "sharding", None)
        if not (isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh):
            sharding = replicated
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding,
                                    weak_type=bool(getattr(leaf, "weak_type", False)))

    return jax.tree_util.tree_map(place, tree)


def lower_for_target(jitted: Any, args: tuple, kwargs: dict, target: Target) -> Any:
    """``jitted`` (a ``jax.jit`` function) traced on abstract arguments and lowered for
    ``target``: a JAX ``Lowered`` whose ``compile(target.compiler_options)`` runs XLA for
    that device."""
    args, kwargs = abstract_arguments((args, kwargs), target)
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=(target.platform,))


def compile_for_target(jitted: Any, *args: Any, target: str | Target = "h100",
                       compiler_options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A ``jax.jit`` function compiled for ``target`` without the device: JAX's
    ``Compiled`` (``as_text()``, ``memory_analysis()``); the peer of
    ``AmpFunction.lower(..., target=...).compile()`` for comparisons on one footing.
    ``compiler_options`` override the target's XLA flags."""
    device = device_target(target)
    options = {**device.compiler_options, **(compiler_options or {})}
    return lower_for_target(jitted, args, kwargs, device).compile(options)


def compile_module_for_target(module: Any, target: Target) -> Any:
    """A StableHLO ``ir.Module`` (one device, as ``hlo-amp-opt`` reads it) compiled by XLA
    for ``target``: an executable with ``hlo_modules()`` and
    ``get_compiled_memory_stats()``; nothing to run."""
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client

    device = target_mesh(target).devices.flat[0]
    options = compiler.get_compile_options(
        1, 1, device_assignment=np.array([[device]]),
        env_options_overrides=target.compiler_options)
    return device.client.compile(module, xla_client.DeviceList((device,)), options)
