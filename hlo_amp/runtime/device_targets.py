"""Compiling for a GPU or TPU this machine does not have: named targets, their mesh, flags.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

# Where JAX was told not to use a TPU, libtpu serves only deviceless compiles: it need not
# ask for a TPU VM's metadata, and several processes (a test and the CLI it runs) may load
# it without its lockfile refusing the second (set before jax initialises its backends).
if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# XLA's flags for every deviceless GPU compile (see the module docstring).
DEVICELESS_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


@dataclass(frozen=True)
class DeviceTarget:
    """A device to compile for without having it."""

    name: str  # what the user wrote: "h100", or a config file's path
    device: str  # short name in reports: "H100"
    description: str  # "NVIDIA H100 80GB HBM3"
    platform: str  # JAX's lowering platform: "cuda"
    target_config: str  # the GpuTargetConfig text proto
    pipeline_target: str = "gpu"  # the pass pipeline's target facts
    # Published dense peaks, FLOP/s by operand type ("f32" is TF32 on tensor cores where
    # XLA's default precision uses them), and HBM bytes/s; empty for a user's own file.
    peak_flops: dict[str, float] = field(default_factory=dict)
    hbm_bytes_per_second: float | None = None
    topology: str = ""  # TPU: the slice compiled for, "v5e:2x2"; GPU: ""
    # Compute dtypes XLA runs on this device only by upcasting (refused, with why).
    unsupported: tuple[tuple[str, str], ...] = ()

    @property
    def compiler_options(self) -> dict[str, Any]:
        return dict(DEVICELESS_GPU_OPTIONS) if self.platform == "cuda" else {}

    def refusal(self, dtypes: set[str]) -> str | None:
        """Why this device cannot run a policy computing in ``dtypes``, else None."""
        for dtype, why in self.unsupported:
            if dtype in dtypes:
                return f"it computes in {dtype}, and {why}"
        return None


@dataclass(frozen=True)
class _GpuFacts:
    """The ``gpu_device_info`` fields XLA reads, from NVIDIA's public specifications."""

    description: str
    compute_capability: tuple[int, int]
    core_count: int  # SMs
    fpus_per_core: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int


def _target_config(facts: _GpuFacts) -> str:
    """A ``GpuTargetConfig`` text proto. ``runtime_version`` is required: without it XLA's
    GEMM rewriter silently leaves fp8 off; the cuDNN version is a current 9.x."""
    major, minor = facts.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {facts.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {facts.core_count}
  fpus_per_core: {facts.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(facts.memory_bandwidth)}
  l2_cache_size: {facts.l2_bytes}
  clock_rate_ghz: {facts.clock_ghz}
  device_memory_size: {facts.memory_bytes}
  shared_memory_per_block_optin: {facts.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  runtime_version: "12.8.0"
  dnn_version: "9.10.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{facts.description}"
"""


_GPUS: dict[str, tuple[str, _GpuFacts, dict[str, float]]] = {
    # name: (short name, facts, dense peaks in FLOP/s: H100/H200 SXM, A100 SXM datasheets)
    "h100": ("H100", _GpuFacts("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 84942979072,
                               3.35e12, 52428800, 233472, 232448),
             {"f32": 494.7e12, "bf16": 989.4e12, "f16": 989.4e12, "f8": 1978.9e12}),
    "h200": ("H200", _GpuFacts("NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 1.98,
                               151397597184, 4.8e12, 52428800, 233472, 232448),
             {"f32": 494.7e12, "bf16": 989.4e12, "f16": 989.4e12, "f8": 1978.9e12}),
    "a100": ("A100", _GpuFacts("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 85100068864,
                               2.039e12, 41943040, 167936, 166912),
             {"f32": 156e12, "bf16": 312e12, "f16": 312e12}),
}
GPU_NAMES = tuple(_GPUS)

# TPU generations: (JAX's device name prefix, the smallest slice libtpu describes without
# a device, bf16 peak FLOP/s per chip, HBM bytes/s per chip; Google Cloud's public specs;
# whether the matrix unit has fp8 modes). A jax.jit f32 dot runs as one bf16 pass on TPU
# (DEFAULT precision), hence f32 = bf16.
_TPUS: dict[str, tuple[str, str, float, float, bool]] = {
    "tpu-v4": ("TPU v4", "v4:2x2x1", 275e12, 1228e9, False),
    "tpu-v5e": ("TPU v5e", "v5e:2x2", 197e12, 819e9, True),
    "tpu-v5p": ("TPU v5p", "v5p:2x2x1", 459e12, 2765e9, True),
    "tpu-v6e": ("TPU v6e", "v6e:2x2", 918e12, 1640e9, True),
}
TPU_NAMES = tuple(_TPUS)

# What XLA:TPU does with the forms hlo_amp writes is invisible in its optimized HLO (the
# convolution keeps f16 or fp8 operand types) but plain in libtpu's LLO
# (--xla_jf_dump_llo_text; libtpu 0.0.42.1 and 0.0.50.1, a 512x512 dot per generation):
# bf16 runs as bf16 matrix-unit (MXU) instructions; f16 operands are unpacked and the dot
# runs as f32 MXU instructions, twice as many. v5e, v5p and v6e have fp8 MXU modes for
# e5m2 and Google's e4m3b11fnuz only: a dot with an e4m3fn operand (both of hlo_amp's fp8
# actions have one) runs as f32 instructions, as every fp8 dot does on v4. Compiling
# such a policy would report ops "kept" that the chip runs slower than bf16.
_TPU_F16 = ("float16", ("XLA:TPU upcasts f16 dots to f32 matrix-unit instructions "
                        "(the matrix unit takes bf16, not f16)"))


def _tpu_fp8(device: str, fp8_modes: bool) -> tuple[tuple[str, str], ...]:
    why = (f"XLA:TPU upcasts a dot with an e4m3fn operand to f32 matrix-unit instructions "
           f"({device}'s fp8 modes are e5m2 and e4m3b11fnuz; hlo_amp's fp8 dots read "
           "e4m3fn)" if fp8_modes else
           f"XLA:TPU upcasts fp8 dots to f32 matrix-unit instructions ({device} has no "
           "fp8 matrix unit)")
    return (("float8_e4m3fn", why), ("float8_e5m2", why))


def _tpu_target(name: str) -> DeviceTarget:
    generation, _, shape = name.partition(":")
    device, slice_name, bf16, hbm, fp8_modes = _TPUS[generation]
    topology = f"{slice_name.split(':')[0]}:{shape}" if shape else slice_name
    return DeviceTarget(name, device, f"Google {device} ({topology})", "tpu", "",
                        pipeline_target="tpu", peak_flops={"f32": bf16, "bf16": bf16},
                        hbm_bytes_per_second=hbm, topology=topology,
                        unsupported=(_TPU_F16, *_tpu_fp8(device, fp8_modes)))


def resolve_target(target: str | DeviceTarget) -> DeviceTarget:
    """``"h100"``, ``"h200"``, ``"a100"``, the path of a ``GpuTargetConfig`` text proto, or
    a TPU generation (``"tpu-v5e"``; with a slice: ``"tpu-v5e:2x2"``)."""
    if isinstance(target, DeviceTarget):
        return target
    if not isinstance(target, str):
        raise TypeError(f"target={target!r}: expected one of {', '.join(GPU_NAMES + TPU_NAMES)}"
                        " or the path of a GpuTargetConfig .txtpb file")
    key = target.strip().lower()
    if key.partition(":")[0] in _TPUS:
        return _tpu_target(key)
    if key in _GPUS:
        device, facts, peaks = _GPUS[key]
        return DeviceTarget(key, device, facts.description, "cuda", _target_config(facts),
                            peak_flops=dict(peaks), hbm_bytes_per_second=facts.memory_bandwidth)
    path = Path(target)
    if not path.is_file():
        raise ValueError(f"target={target!r} is neither a known GPU ({', '.join(GPU_NAMES)}), "
                         f"a TPU ({', '.join(TPU_NAMES)}, optionally with a slice such as "
                         "tpu-v5e:2x2) nor an existing GpuTargetConfig text-proto file")
    text = path.read_text()
    description = _proto_string(text, "device_description_str") or path.stem
    return DeviceTarget(str(path), description, description, "cuda", text)


def refuse_policy_on_device(policy: Any, target: DeviceTarget) -> None:
    """A ValueError when ``policy`` computes in a dtype ``target`` has no matrix unit for
    (f16 and fp8 on TPUs), naming what is accepted."""
    dtypes = {policy.compute_dtype, *(a for a in policy.actions if isinstance(a, str))}
    why = target.refusal(dtypes)
    if why:
        raise ValueError(f"policy {policy.to_string()!r} cannot be compiled for "
                         f"{target.name}: {why}; on {target.device} use bf16, "
                         "mixed_bfloat16 or f32")


def _proto_string(text: str, key: str) -> str | None:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(f"{key}:"):
            return stripped.split(":", 1)[1].strip().strip('"')
    return None


class NoCompilerForTarget(RuntimeError):
    """The XLA backend for the target is not installed (the CUDA PJRT plugin)."""


def target_mesh(target: DeviceTarget) -> jax.sharding.Mesh:
    """A one-device mesh on the target's topology (abstract devices, nothing to run on)."""
    if target.platform == "tpu":
        return _tpu_mesh(target.topology, target.description)
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
        default = next((t[1] for t in _TPUS.values()
                        if t[1].split(":")[0] == topology_name.split(":")[0]), "")
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


def abstract_arguments(tree: Any, target: DeviceTarget) -> Any:
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


def lower_for_target(jitted: Any, args: tuple, kwargs: dict, target: DeviceTarget) -> Any:
    """``jitted`` (a ``jax.jit`` function) traced on abstract arguments and lowered for
    ``target``: a JAX ``Lowered`` whose ``compile(target.compiler_options)`` runs XLA for
    that device."""
    args, kwargs = abstract_arguments((args, kwargs), target)
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=(target.platform,))


def compile_for_target(jitted: Any, *args: Any, target: str | DeviceTarget = "h100",
                       compiler_options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A ``jax.jit`` function compiled for ``target`` without the device: JAX's
    ``Compiled`` (``as_text()``, ``memory_analysis()``); the peer of
    ``AmpFunction.lower(..., target=...).compile()`` for comparisons on one footing.
    ``compiler_options`` override the target's XLA flags."""
    device = resolve_target(target)
    options = {**device.compiler_options, **(compiler_options or {})}
    return lower_for_target(jitted, args, kwargs, device).compile(options)


def compile_module_for_target(module: Any, target: DeviceTarget) -> Any:
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
