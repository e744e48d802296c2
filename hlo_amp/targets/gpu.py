"""XLA:GPU as a target: `GpuTarget` (cuDNN's same-type convolutions, the sums that read a
16-bit copy), the GPUs compiled for without the device (one entry each in ``_GPUS``, or a
user's ``GpuTargetConfig`` file), and what XLA:GPU turns into a Hopper fp8 GEMM.

The fp8 GEMM form is read by insert_converts (which decides per dot whether it can take
it, else falls back to the compute dtype with the reason) and the fp8 pass (which writes
the fp8 operands and their scales). Nothing here depends on the machine the program runs
on.

What this relies on, read from XLA's sources (openxla/xla, as vendored in
tensorflow/tensorflow, 2025):

- ``xla/service/gpu/transforms/gemm_rewriter.cc``: with ``GemmRewriterOptions::kFp8Only``
  (run before the Triton GEMM fusion) ``HandleDot`` rewrites a dot into the
  ``__cublas$lt$matmul$f8`` custom call when ``MatchFp8Param`` matches *both* operands:
  walking up from the dot operand, an fp8 value, then a ``convert`` to a wider type, then
  ``multiply`` (either order) or ``divide`` by a ``broadcast`` of a *scalar* scale, then
  only ops that commute with dequantisation (bitcast, broadcast, copy, dynamic-slice,
  pad, reshape, select with a zero operand, slice, transpose; all-gather, all-to-all and
  collective-permute under SPMD). ``CreateF8CustomCall`` then requires: compute
  capability >= 8.9 (Ada/Hopper) and CUDA >= 12; both fp8 types in {F8E4M3FN, F8E5M2}
  and *not both* F8E5M2; scales scalar (converted to f32 if needed); output type BF16,
  F16 or F32 (or fp8); exactly one contracting dimension per operand and operands of
  rank batch + 2 (one free dimension each) after canonicalisation. It pads every
  non-batch dimension to a multiple of 16 (cuBLASLt's fp8 requirement) and slices the
  result back. The scales become the custom call's a_scale/b_scale operands, so the
  dequantising multiplies disappear into the GEMM.
- ``xla/hlo/transforms/expanders/dot_decomposer.cc`` (run early by
  ``xla/service/gpu/gpu_compiler.cc``, after ``DotDimensionSorter``): any dot that is not
  canonical is rewritten as transpose + reshape of each operand into
  ``[batch, free, contracting]`` with the batch dimensions first, several contracting
  (or free) dimensions merged into one. Transpose and reshape commute with
  dequantisation, so several contracting dimensions, non-leading batch dimensions and
  rank-3 activations all reach the fp8 GEMM. What it cannot give the GEMM is a free
  dimension where the operand has none (or only size-1 ones): it drops a free product
  of 1, the operand's rank falls to batch + 1 and ``CreateF8CustomCall`` refuses it.

Hence the per-dot rule here (``fp8_obstacle``): static shapes; f32/bf16/f16 operands and
result; per operand a contracting and a free dimension, and after merging (the
canonical m, k, n) every one of them at least 16 -- below that the GEMM is padded to 16
and runs mostly on zeros, and matrix-vector products go to XLA's gemv path instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from jax.extend.mlir import ir

from hlo_amp.ir.modules import element_type
from hlo_amp.targets.dot_dims import dot_layout
from hlo_amp.targets.target import Target

# The discardable attribute insert_converts puts on a dot it decided to run in fp8, and
# the fp8 pass reads (and removes): [lhs fp8 type, rhs fp8 type, dequantise type].
FP8_MARK = "hlo_amp.fp8"

# Largest finite value of each fp8 format (ml_dtypes' finfo(...).max).
FP8_MAX = {"f8E4M3FN": 448.0, "f8E5M2": 57344.0}
# How a dot's report reason starts when it could not take the fp8 GEMM form.
FP8_FALLBACK = "fp8 fallback"

# cuBLASLt fp8 GEMMs pad every non-batch dimension to a multiple of this.
MIN_GEMM_EXTENT = 16
_WIDE_TYPES = ("f32", "bf16", "f16")


def fp8_obstacle(op: Any) -> str | None:
    """Why ``op`` (a ``stablehlo.dot_general``) cannot run as an XLA:GPU fp8 GEMM, in
    words for the report; None when it can."""
    types = [str(element_type(v)) for v in list(op.operands)[:2]] + [
        str(element_type(op.result))]
    if any(t == "f64" for t in types):
        return "f64 dot (the fp8 GEMM dequantises to f32, bf16 or f16)"
    if any(t not in _WIDE_TYPES for t in types):
        return f"{'x'.join(types[:2])}->{types[2]} dot (the fp8 GEMM takes f32, bf16, f16)"
    layout = dot_layout(op)
    if layout is None or not isinstance(op.result.type, ir.RankedTensorType) or any(
            size < 0 for size in ir.RankedTensorType(op.result.type).shape):
        return "dynamic shape"
    if not layout.lhs_contracting:
        return "no contracting dimension (an outer product)"
    m, k, n = layout.mkn
    if not layout.lhs_free or not layout.rhs_free or m == 1 or n == 1:
        return ("a matrix-vector product (the fp8 GEMM needs a free dimension on each "
                "operand)")
    small = [f"{name}={size}" for name, size in (("m", m), ("k", k), ("n", n))
             if size < MIN_GEMM_EXTENT]
    if small:
        return (f"{', '.join(small)} under {MIN_GEMM_EXTENT} (cuBLASLt pads fp8 GEMMs to "
                f"multiples of {MIN_GEMM_EXTENT})")
    return None


def dequantized_format(value: ir.Value) -> str | None:
    """The fp8 type of an operand already in fp8: an fp8 tensor (the direct form the fp8
    pass writes), or ``convert(q: fp8) * broadcast(scale)`` (either order, the
    dequantised form the GEMM rewriter also matches); else None."""
    own = str(element_type(value))
    if own in FP8_MAX:
        return own
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.name != "stablehlo.multiply":
        return None
    found = None
    names = []
    for operand in owner.operands:
        producer = operand.owner
        name = "" if isinstance(producer, ir.Block) else producer.name
        names.append(name)
        if name == "stablehlo.convert":
            source = str(element_type(producer.operands[0]))
            if source in FP8_MAX:
                found = source
    return found if found and "stablehlo.broadcast_in_dim" in names else None


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

    def low_result(self, kind: str) -> bool:
        """Convolutions: cuDNN runs same-type 16-bit convolutions only (bf16→bf16, f16→f16,
        accumulating in f32 inside), and XLA:GPU upcasts ``convolution(bf16, bf16) -> f32``
        to f32×f32 (xla/service/gpu/transforms/conv_rewriter.cc; lit
        tests/lit/gpu_conv.mlir). cuBLASLt has bf16×bf16→f32 GEMMs: dots keep the f32
        result."""
        return kind == "convolution"

    @property
    def sums_read_a_16bit_copy(self) -> bool:
        """Yes. XLA:GPU folds the sum's round trip (f32 -> 16 -> f32) back into a read of
        the f32 value (``SimplifyFPConversions``), so it writes the value in f32 for the sum
        and in 16 bit for the GEMMs: on the decoder's step 128 MiB more at the peak and
        1.813 against 1.753 ms of roofline (benchmarks/RESULTS.md)."""
        return True

    @property
    def compiler_options(self) -> dict[str, Any]:
        return dict(DEVICELESS_GPU_OPTIONS)


GPU = GpuTarget()


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
    text = path.read_text()
    description = _proto_string(text, "device_description_str") or path.stem
    return GpuTarget(str(path), description, description, target_config=text)


def _proto_string(text: str, key: str) -> str | None:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(f"{key}:"):
            return stripped.split(":", 1)[1].strip().strip('"')
    return None
