"""XLA:GPU as a target: `GpuTarget` (cuDNN's same-type convolutions, the sums that read a
16-bit copy, the library calls its optimized HLO runs matrix ops as) and the GPUs compiled
for without the device (one entry each in ``_GPUS``, or a user's ``GpuTargetConfig``
file). What XLA:GPU turns into a Hopper fp8 GEMM is targets/fp8_gemm.py.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hlo_amp.targets.dot_dims import dot_layout
from hlo_amp.targets.target import Target
from hlo_amp.targets.topology import NoCompilerForTarget, first_devices

# XLA's flags for every deviceless GPU compile: without a device there is no autotuning,
# and XLA's Triton GEMM fusion then fails on some programs (``Couldn't find output tile
# sizes``), so every GEMM is compiled as a cuBLAS call (docs/gpu_target.md).
DEVICELESS_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


@dataclass(frozen=True)
class GpuTarget(Target):
    """XLA:GPU; with ``target_config`` set, one GPU compiled for without the device."""

    name: str = "gpu"
    target_config: str = field(default="", repr=False)  # the GpuTargetConfig text proto
    # XLA's GPU topology: slices x nodes x GPUs per node ("1x2x8": two nodes of 8).
    topology: str = "1x1x1"
    family: ClassVar[str | None] = "gpu"
    platform: ClassVar[str] = "cuda"
    # cuBLAS(Lt) GEMMs and cuDNN convolutions (forward, filter and input gradients), the
    # call targets of xla/service/gpu/cublas_cudnn.cc; ``$f8``: the Hopper fp8 GEMM.
    # cuDNN's fused attention (``__cudnn$fmha...``) is no matrix op of a decision: the
    # report's attention sites read it (kept_by_xla.mark_attention_kept).
    matrix_calls: ClassVar[tuple[tuple[str, str, bool], ...]] = (
        ("__cublas$lt$matmul$f8", "cuBLAS fp8", False), ("__cublas$", "cuBLAS", False),
        ("__cudnn$conv", "cuDNN", True))
    attention_call: ClassVar[str] = "__cudnn$fmha"

    def low_result(self, kind: str) -> bool:
        """Convolutions: cuDNN runs same-type 16-bit convolutions only (bf16→bf16, f16→f16,
        accumulating in f32 inside), and XLA:GPU upcasts ``convolution(bf16, bf16) -> f32``
        to f32×f32 (xla/service/gpu/transforms/conv_rewriter.cc; lit
        tests/lit/gpu_conv.mlir). cuBLASLt has bf16×bf16→f32 GEMMs: dots keep the f32
        result."""
        return kind == "convolution"

    def accumulates_16bit_into_f64(self, kind: str) -> bool:
        """Not a dot: cuBLAS has no 16-bit GEMM with an f64 result ("GEMM is not supported
        by cublasLt"), so under ``f64=true`` a dot accumulates in f32, converted to f64.
        Convolutions compile (XLA:GPU runs a bf16 -> f64 one in f64)."""
        return kind == "convolution"

    @property
    def sums_read_a_16bit_copy(self) -> bool:
        """Yes. XLA:GPU folds the sum's round trip (f32 -> 16 -> f32) back into a read of
        the f32 value (``SimplifyFPConversions``), so it writes the value in f32 for the sum
        and in 16 bit for the GEMMs: on the decoder's step 128 MiB more at the peak and
        1.813 against 1.753 ms of roofline (benchmarks/RESULTS.md)."""
        return True

    @property
    def recomputes_residuals(self) -> bool:
        """Yes. XLA:GPU stores a batch norm's f32 ``2 * (x - mean)`` from the forward to
        the backward pass, where ``x``, half its bytes, is stored too; recomputed, it is
        fused into the backward kernels (Keras MobileNetV3Small's first blocks, 32x32,
        batch 8, on H100: 262,144 B less temp)."""
        return True

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The GPU's CUDA compute capability: the target config's, or (a GPU of this
        machine, ``target_config`` empty) the first CUDA device's; None if unknown."""
        if self.target_config:
            # Proto text leaves a zero out: XLA's own spec files write 8.0 as
            # "{ major: 8 }" (read as no capability, fp8 was applied to an A100).
            found = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", self.target_config)
            if found is None:
                return None
            fields = dict(re.findall(r"(major|minor)\s*:\s*(\d+)", found[1]))
            if "major" not in fields:
                return None
            return int(fields["major"]), int(fields.get("minor", 0))
        return _local_compute_capability()

    @property
    def lowering_capability(self) -> tuple[int, int] | None:
        """The target config's capability; with no config, None where this machine has a
        CUDA GPU (jax asks it), else Ampere's 8.0 (``hlo-amp-opt --target gpu`` on a
        machine without a GPU: fused_attention_obstacle takes it to be one)."""
        if self.target_config:
            return self.compute_capability
        return None if _local_compute_capability() is not None else (8, 0)

    def fused_attention_obstacle(self) -> str | None:
        """cuDNN's flash attention (the kernel jax's
        ``dot_product_attention(implementation="cudnn")`` calls) needs an NVIDIA GPU of
        compute capability 8.0 (Ampere) or later: A100, H100, H200. A GPU target with no
        GPU known (``hlo-amp-opt --target gpu`` on a machine without one) is taken to be
        such a GPU; an AMD GPU of this machine is not one."""
        if not self.target_config and _local_platform() == "rocm":
            return "an AMD GPU: cuDNN's fused attention runs on NVIDIA GPUs"
        capability = self.compute_capability
        if capability is None:
            return None
        if capability < (8, 0):
            return (f"cuDNN's flash attention needs compute capability 8.0 or later; this "
                    f"GPU has {capability[0]}.{capability[1]}")
        return None

    def fp8_obstacle(self, op: Any) -> str | None:
        """The dot's form (Target's), and the GPU: XLA makes a dot an fp8 GEMM only on
        compute capability 8.9 or later (Ada, Hopper: gemm_rewriter.cc's
        ``CreateF8CustomCall``); on an A100 it ran the quantised dot as a bf16 GEMM,
        every quantisation paid for nothing (0 of 6 fp8 GEMMs kept)."""
        capability = self.compute_capability
        if capability is not None and capability < (8, 9):
            return (f"compute capability {capability[0]}.{capability[1]} (XLA's fp8 GEMM "
                    f"needs 8.9 or later: Ada, Hopper)")
        return super().fp8_obstacle(op)

    def writes_16bit_form_twice(self, op: Any, kind: str) -> str | None:
        """A convolution: cuDNN returns its 16-bit result, which a convert writes again in
        f32 (``low_result``). A dot whose m or n is not a multiple of 8, compiled with
        cuBLAS GEMMs: XLA pads a 16-bit GEMM's dimensions to multiples of 8
        (cublas_pad_for_gemms) and writes the padded result, which the f32 result is
        sliced from (measured on flax's examples/vae: its weight gradient [196, 128],
        written [200, 128], no longer shares the optimizer output's buffer)."""
        if kind == "convolution":
            return "cuDNN returns a 16-bit convolution's result in 16 bit, then f32"
        if (kind not in ("dot_general", "dot")
                or self.compiler_options.get("xla_gpu_enable_triton_gemm", True)):
            return None
        layout = dot_layout(op) if kind == "dot_general" else None
        if layout is None:
            return None
        m, _, n = layout.mkn
        if m % 8 == 0 and n % 8 == 0:
            return None
        return (f"XLA:GPU pads a 16-bit GEMM's {m}x{n} result to multiples of 8 for "
                "cuBLAS and slices the f32 result from it")

    @property
    def compiler_options(self) -> dict[str, Any]:
        return dict(DEVICELESS_GPU_OPTIONS)

    def live_compiler_options(self, fp8: bool) -> dict[str, Any]:
        """An fp8 policy's module compiles on this machine's CUDA GPU with Triton GEMM
        off, as every deviceless compile does. Measured on one H200 (jax 0.11.2,
        2026-11-30, docs/fp8.md): XLA's autotuner times Triton tilings of each GEMM
        against cuBLASLt, and with them off the 1.1B decoder's fp8 step compiled in 3.3
        s against 43.8 (delayed: 3.9 against 77.7) and ran as fast (195.2 against 196.1
        ms), benchmarks.run's ViT and decoder faster (10.16 against 11.84 ms, 6.60
        against 7.28). Not on ROCm (not measured), nor where XLA_FLAGS sets the flag."""
        if (not fp8 or _local_platform() != "cuda"
                or xla_flag_given("xla_gpu_enable_triton_gemm")):
            return {}
        return {"xla_gpu_enable_triton_gemm": False}

    def topology_devices(self) -> tuple:
        """The GPUs of XLA's topology made from ``target_config`` (a node or nodes:
        ``topology``), by the CUDA PJRT plugin without a GPU."""
        if not self.target_config:
            return super().topology_devices()
        return first_devices(self, _gpu_topology(self.platform, self.target_config,
                                                 self.topology, self.description))


GPU = GpuTarget()


@functools.cache
def _gpu_topology(platform: str, target_config: str, topology_name: str,
                  description: str) -> tuple:
    from jax.experimental import topologies

    from hlo_amp.quiet_stderr import fd2_captured

    # XLA logs why it refuses a config (the line and column of a text-proto error) on
    # fd 2 and raises a bare "Failed to parse": the log is read back into the one line.
    with fd2_captured() as logged:
        try:
            topology = topologies.get_topology_desc(
                platform=platform, target_config=target_config, topology=topology_name)
        except Exception as error:  # noqa: BLE001 - the plugin is missing or refuses the proto
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            if "GpuTargetConfig" in first:
                where = [line.split("] ", 1)[-1].strip() for line in logged().splitlines()
                         if "Expected" in line or "Error parsing" in line
                         or re.search(r"\b\d+:\d+: ", line)]
                raise NoCompilerForTarget(
                    f"cannot compile for {description}: its target config is not a "
                    f"GpuTargetConfig text proto XLA reads ({where[-1] if where else first}); "
                    f"docs/gpu_target.md shows one") from None
            raise NoCompilerForTarget(f"cannot compile for {description} without a device: "
                                      f"{first}. {_plugin_advice()}") from None
    return tuple(topology.devices)


def _plugin_advice() -> str:
    import importlib.util

    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return ("It needs the CUDA PJRT plugin matching your jaxlib: "
                "pip install 'hlo_amp[gpu]'")
    # Installed but not registered: on a machine without a CUDA runtime the plugin's
    # version check fails unless CPU was asked for explicitly.
    return ("The CUDA plugin is installed but did not register: on a machine without a "
            "GPU, start Python with JAX_PLATFORMS=cpu")


@functools.cache
def _local_gpus() -> tuple[Any, ...]:
    """This machine's GPU devices, asked once per process (every fused-attention pass
    asks; the devices do not change). Asking jax may start its CUDA plugin, whose stub
    prints to fd 2 where there is no GPU: dropped, as at hlo_amp's import."""
    import os

    from hlo_amp.quiet_stderr import fd2_filtered, import_jax_for_cli, is_cli_process

    if is_cli_process():
        # hlo-amp-opt runs jax on CPU unless JAX_PLATFORMS asks for more: without it, no
        # GPU, and no jax imported to say so.
        if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
            return ()
        import_jax_for_cli()
    import jax

    with fd2_filtered():
        try:
            return tuple(d for d in jax.devices() if d.platform == "gpu")
        except RuntimeError:
            return ()


def xla_flag_given(name: str) -> bool:
    """Whether ``XLA_FLAGS`` sets the flag ``name`` (``--name=value`` or ``--name``)."""
    return any(token.lstrip("-").split("=", 1)[0] == name
               for token in os.environ.get("XLA_FLAGS", "").split())


def _local_platform() -> str | None:
    """"cuda" or "rocm" for this machine's first GPU, None without one."""
    devices = _local_gpus()
    if not devices:
        return None
    version = str(getattr(devices[0].client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def _local_compute_capability() -> tuple[int, int] | None:
    """The compute capability of this machine's first CUDA device, if it has one."""
    devices = _local_gpus()
    text = getattr(devices[0], "compute_capability", None) if devices else None
    if not text:
        return None
    major, _, minor = str(text).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:  # an AMD GPU's "gfx90a"
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

# Bytes/s one GPU sends (one direction): to the GPUs of its node over NVLink through
# NVSwitch, and to other nodes over its own network adapter.
_LINKS: dict[str, tuple[float, float]] = {
    # NVLink 4: 18 links, 900 GB/s bidirectional per GPU (H100 SXM datasheet); DGX H100 /
    # H200: one ConnectX-7 400 Gb/s InfiniBand NDR adapter per GPU (DGX BasePOD guide).
    "h100": (450e9, 50e9),
    "h200": (450e9, 50e9),
    # NVLink 3: 12 links, 600 GB/s bidirectional per GPU (A100 SXM datasheet); DGX A100:
    # one ConnectX-6 200 Gb/s InfiniBand HDR adapter per GPU.
    "a100": (300e9, 25e9),
}
# GPUs in one NVLink node: an HGX/DGX board holds 8 SXM GPUs behind its NVSwitches. XLA
# itself takes any count ("1x1x3" too); more than 8 per node is no machine.
MAX_GPUS_PER_NODE = 8
# "h100", "h100x8" (one node of 8), "h100:2x8" (2 nodes of 8).
_GPU_NAME = re.compile(r"^(?P<gpu>[a-z]\d+)(?:x(?P<count>\d+)|:(?P<nodes>\d+)x(?P<per_node>\d+))?$")
GPU_FORMS = ("NAME (one GPU), NAMExN (one node of N GPUs on NVLink, N from 1 to "
             f"{MAX_GPUS_PER_NODE}) or NAME:MxN (M nodes of N)")


def gpu_device(key: str) -> GpuTarget | None:
    """A named GPU (``"h100"``), a node of them (``"h100x8"``) or several nodes
    (``"h100:2x8"``); None for a name that is not one of ``_GPUS``'s. A known GPU with a
    count XLA's topology or a node cannot have is a ValueError naming what is accepted."""
    match = _GPU_NAME.match(key)
    if match is None or match["gpu"] not in _GPUS:
        if key.split("x")[0].split(":")[0] in _GPUS:
            raise ValueError(f"target={key!r}: a GPU target is {GPU_FORMS}, e.g. h100, "
                             "h100x8, h100:2x8")
        return None
    name = match["gpu"]
    nodes = int(match["nodes"] or 1)
    per_node = int(match["count"] or match["per_node"] or 1)
    if not 1 <= per_node <= MAX_GPUS_PER_NODE or nodes < 1:
        raise ValueError(f"target={key!r} is {nodes} node(s) of {per_node} GPUs; a GPU "
                         f"target is {GPU_FORMS}, e.g. h100x8 or h100:2x8")
    device, facts, peaks = _GPUS[name]
    nvlink, network = _LINKS[name]
    count = nodes * per_node
    where = (f"{nodes} nodes of {per_node}" if nodes > 1 else f"{count}" if count > 1 else "")
    return GpuTarget(key, device, facts.description + (f" x {where}" if where else ""),
                     peak_flops=dict(peaks), hbm_bytes_per_second=facts.memory_bandwidth,
                     devices=count, link_bytes_per_second=network if nodes > 1 else nvlink,
                     target_config=_target_config(facts), topology=f"1x{nodes}x{per_node}")


def gpu_from_config_file(path: Path) -> GpuTarget:
    """A GPU described by a user's ``GpuTargetConfig`` text-proto file (no peaks)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"target config file {str(path)!r} is not text (not UTF-8); "
                         f"accepted: a GpuTargetConfig text proto (docs/gpu_target.md)"
                         ) from None
    if not text.strip():  # as the GPU of this machine it made "not a device to compile for"
        raise ValueError(f"target config file {str(path)!r} is empty; accepted: a "
                         f"GpuTargetConfig text proto (docs/gpu_target.md)")
    unset = [name for name in _POSITIVE_DEVICE_FIELDS if not _positive_number(text, name)]
    if unset:
        raise ValueError(
            f"target config file {str(path)!r} gives no positive {', '.join(unset)} in its "
            f"gpu_device_info (XLA divides by them: a missing or zero one kills the "
            f"process); accepted: a GpuTargetConfig text proto with each set "
            f"(docs/gpu_target.md)")
    description = _proto_string(text, "device_description_str") or path.stem
    return GpuTarget(str(path), description, description, target_config=text)


# gpu_device_info fields a compile divides by or sizes launches with: XLA:GPU died of a
# SIGFPE (threads_per_warp, block_dim_limit_x) or a SIGSEGV (threads_per_block_limit,
# shared_memory_per_block) where one was missing or 0 (checked one field at a time on a
# matmul, a reduction, a convolution, a sort and a cumsum).
_POSITIVE_DEVICE_FIELDS = ("threads_per_block_limit", "threads_per_warp",
                           "shared_memory_per_block", "block_dim_limit_x")


def _positive_number(text: str, key: str) -> bool:
    """Whether ``key: N`` is set to a positive number in the proto text, as its text
    format reads it: anywhere on a line (a block on one line), ended by a space, ``,``
    or ``;``, an integer hex too (``0x20``); a ``#`` comment is no setting."""
    uncommented = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    found = re.search(rf"(?<![\w.]){key}\s*:\s*([^\s,;{{}}]+)", uncommented)
    if found is None:
        return False
    try:
        return int(found.group(1), 0) > 0
    except ValueError:
        try:
            return float(found.group(1)) > 0
        except ValueError:
            return False


def _proto_string(text: str, key: str) -> str | None:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(f"{key}:"):
            return stripped.split(":", 1)[1].strip().strip('"')
    return None
