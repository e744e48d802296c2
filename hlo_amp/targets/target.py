"""`Target`: what one backend does with the modules hlo_amp writes, as the passes, the
deviceless compiles and the report consult it.

This base class is the target with no facts (``None`` at the public entry points:
several platforms, or ``hlo_amp.rewrite``): matrix ops in a 16-bit region return the
16-bit type, nothing is left in f32 for speed, no dot is relaid. ``CpuTarget``,
``GpuTarget`` and ``TpuTarget`` (targets/cpu.py, gpu.py, tpu.py) override the facts their
backend differs in; a device compiled for without having it (``"h100"``,
``"tpu-v5e"``) is one of those with its device fields set. Each fact's docstring says
where it was measured or read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hlo_amp.targets.fp8_gemm import fp8_obstacle
from hlo_amp.targets.topology import mesh_of


@dataclass(frozen=True)
class PaintForm:
    """What the target wants of the mixed modes' painting (passes/propagate/solve.py),
    made from its facts by `Target.paint_form`.

    ``low_results``: every unpinned matrix op returns the 16-bit type, also where only
    f32 ops read it; otherwise only where a 16-bit region reads it.
    ``pin_at_deny``: a deny op pins the value it reads (stays f32) and nothing spreads
    from it (``Target.deny_pins_its_inputs``); otherwise deny ops convert their own 16-bit
    inputs.
    ``sum_copies``: sums that read an f32 value after a deny op which matrix ops read
    too read its 16-bit copy (``Target.sums_read_a_16bit_copy``)."""

    low_results: bool
    pin_at_deny: bool
    sum_copies: bool


# One launch of a quantisation kernel and its gap on a GPU (several us on Hopper; the
# roofline does not model launches), for Target.fp8_loses.
FP8_QUANTISE_LAUNCH_SECONDS = 3e-6


@dataclass(frozen=True)
class Target:
    """No target facts; the base of every backend family's target."""

    # What the user wrote ("cpu", "h100", a GpuTargetConfig file's path, "tpu-v5e:2x2").
    name: str = "none"
    # A device compiled for without having it (empty for a family target such as "gpu"):
    device: str = ""  # short name in reports: "H100"
    description: str = ""  # "NVIDIA H100 80GB HBM3"
    # Published dense peaks, FLOP/s by operand type ("f32" is TF32 on tensor cores where
    # XLA's default precision uses them), and HBM bytes/s (the roofline's); empty for a
    # user's own GPU config file.
    peak_flops: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    hbm_bytes_per_second: float | None = None
    # Devices in the topology compiled for (8 for "h100x8", 16 for "tpu-v5e:4x4").
    devices: int = 1
    # Bytes/s one device sends over the link its collectives use (one direction; between
    # nodes the network's), for the roofline's collective time; None: not published.
    link_bytes_per_second: float | None = None
    # Compute dtypes XLA runs on this device only by upcasting (refused, with why).
    unsupported: tuple[tuple[str, str], ...] = ()

    # The backend family: "cpu", "gpu", "tpu"; None for no target facts.
    family: ClassVar[str | None] = None
    # JAX's lowering platform for a deviceless compile ("cuda", "tpu"); "" for none.
    platform: ClassVar[str] = ""
    # The custom calls this backend's optimized HLO runs a matrix op as: (custom-call
    # target prefix, the runner's name in the report, whether it is a convolution); the
    # first prefix that matches wins. Read by targets/kept_by_xla.py.
    matrix_calls: ClassVar[tuple[tuple[str, str, bool], ...]] = ()

    # -- the facts the passes consult ---------------------------------------------------

    @property
    def matrix_result_in_16bit(self) -> bool:
        """Whether a matrix op inside a 16-bit region returns the 16-bit type itself.

        Yes unless a backend says otherwise: XLA:GPU and XLA:TPU accumulate 16-bit matrix
        ops in f32 (docs/gpu_target.md), and on GPU a separate ``convert`` of a GEMM result
        is not fused into the cuBLAS epilogue.
        """
        return True

    def low_result(self, kind: str) -> bool:
        """Whether this target runs ``kind`` in 16 bit only with a 16-bit result (then the
        op produces the 16-bit type and a convert follows it). No by default."""
        return False

    def accumulates_16bit_into_f64(self, kind: str) -> bool:
        """Whether this target runs ``kind`` on 16-bit operands with an f64 result
        (``f64=true``). Yes by default (XLA:CPU and XLA:TPU do)."""
        return True

    @property
    def deny_pins_its_inputs(self) -> bool:
        """Whether, in the mixed modes, an f32-only (deny) op keeps the value it reads f32.

        No by default: deny ops convert their own 16-bit inputs (TensorFlow's AMP and
        PyTorch autocast), so a residual stream a layer norm also reads is stored in 16 bit.
        """
        return False

    @property
    def sums_read_a_16bit_copy(self) -> bool:
        """Whether, in the mixed modes, sums that read an f32 value which matrix ops read
        in 16 bit read the 16-bit copy, behind an ``optimization_barrier``. No by default."""
        return False

    @property
    def recomputes_residuals(self) -> bool:
        """Whether, in the mixed modes, the backward pass recomputes an f32 residual
        that is an elementwise function of one 16-bit value (passes/recompute_residuals.py)
        instead of reading it stored. No by default."""
        return False

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """A CUDA GPU's compute capability (GpuTarget); None for every other target."""
        return None

    @property
    def lowering_capability(self) -> tuple[int, int] | None:
        """The compute capability a GPU kernel is lowered for when jax cannot ask the
        device (GpuTarget: a GPU compiled for without it); None where this machine's
        device answers jax itself, or the target has no GPU kernels."""
        return None

    def fused_attention_obstacle(self) -> str | None:
        """Why a softmax attention cannot run here as cuDNN's fused flash-attention
        kernel (passes/fused_attention/); None where it can. The base: no device."""
        return self.no_fused_attention

    # Why attention is not fused on this family (targets/attention_kernels.py: cuDNN's
    # kernel is an NVIDIA GPU's).
    no_fused_attention: ClassVar[str] = ("no target device: fused attention is compiled "
                                         "for a GPU (target=\"h100\", \"a100\", ...)")

    @property
    def selects_scatters_before_partitioning(self) -> bool:
        """Whether XLA writes a one-position add scatter into a constant (the label pick's
        gradient) as a select itself, before its SPMD partitioner runs: then the
        partitioner sees scatter_select's form in the program as written too, and the
        select needs no sharding of its own (hlo_amp/ir/shardings.py). No by default."""
        return False

    def paint_form(self, keep_f32_results: bool = False) -> PaintForm:
        """The painting the mixed modes do for this target: its three facts above, and the
        policy's ``keep_f32_results`` (matrix ops read only by f32 ops keep f32 results)."""
        return PaintForm(low_results=self.matrix_result_in_16bit and not keep_f32_results,
                         pin_at_deny=self.deny_pins_its_inputs,
                         sum_copies=self.sums_read_a_16bit_copy)

    def f32_dot_runs_as(self, compute_dtype: str) -> str | None:
        """Why an f32 dot at DEFAULT precision already runs as one pass with
        ``compute_dtype`` operands and f32 accumulation on this target, the accurate
        mode's form without its converts, in words; None where it does not (XLA:GPU's
        default is TF32, XLA:CPU's f32)."""
        return None

    def writes_16bit_form_twice(self, op: Any, kind: str) -> str | None:
        """Why this target writes the result of ``op``'s 16-bit form (operands rounded,
        f32 result) once more than f32's, a buffer of its own the size of the result, in
        words; None where it writes it once."""
        return None

    @property
    def relays_dots(self) -> bool:
        """Whether the pipeline ends with the fast-dot-layout pass (passes/dot_layout.py)."""
        return False

    def slower_in_16bit(self, op: Any, kind: str, compute_dtype: str) -> str | None:
        """Why this target would not run ``op`` faster in ``compute_dtype`` (the policy's
        ``only_if_faster`` rule), in words; None when it would, or when unknown."""
        return None

    def fp8_obstacle(self, op: Any) -> str | None:
        """Why ``op`` (a ``stablehlo.dot_general``) cannot take the fp8 GEMM form, in words
        for the report; None when it can. XLA has one fp8 GEMM form, which XLA:GPU runs
        as a cuBLASLt ``$f8`` call or, with Triton GEMMs on, a Triton fp8 fusion
        (targets/fp8_gemm.py, read from gemm_rewriter.cc); a target that runs fp8 dots
        by upcasting quantises the same dots, so a run there shows the GPU's numerics."""
        return fp8_obstacle(op)

    # Why an fp8 dot XLA keeps here gains no speed, for the report's summary; "" if it may.
    fp8_kept_note: ClassVar[str] = ""

    def fp8_slower(self) -> str | None:
        """Why this target runs an fp8 dot no faster (``only_if_faster``); None: unknown."""
        return None

    def fp8_loses(self, flops: int, operands: list[tuple[float, int]]) -> str | None:
        """Why quantising a GEMM's operands (``operands``: elements and bits of each, the
        elements of one read by several GEMMs shared among them)
        costs more than its fp8 form saves, under ``only_if_faster``; None where fp8
        pays or the target publishes no bf16 and fp8 peaks or HBM bandwidth. Saved: the
        FLOPs at the bf16 peak minus at the fp8 peak. Cost, per operand: one read and
        one fp8 write (XLA fuses the amax into the producer or the quantisation) and one
        kernel launch, which the roofline leaves out (``FP8_QUANTISE_LAUNCH_SECONDS``).
        Calibrated on one H200 (docs/fp8.md): it keeps the 1.1B decoder's GEMMs (d 2048,
        fp8 0.86x mixed's step) and drops the ViT's (d 384, fp8 1.42x)."""
        bf16, fp8 = self.peak_flops.get("bf16"), self.peak_flops.get("f8")
        bandwidth = self.hbm_bytes_per_second
        if not (bf16 and fp8 and bandwidth):
            return None
        saved = flops / bf16 - flops / fp8
        moved = sum(count * (bits // 8 + 1) for count, bits in operands)
        launches = len(operands) * FP8_QUANTISE_LAUNCH_SECONDS
        cost = moved / bandwidth + launches
        if saved > cost:
            return None
        return (f"fp8 does not pay at this size: it saves {saved * 1e6:.3g} us of GEMM "
                f"time, quantising the operands costs {cost * 1e6:.3g} us")

    def fp8_dequantize(self, result: str, compute_dtype: str) -> str:
        """The dequantise type D of an fp8 dot: the type its scales are rounded to
        (docs/fp8.md; ``result``: the dot's result element type). The dot itself reads
        the fp8 tensors (the direct form); XLA:GPU folds the scale product into the fp8
        GEMM whatever D is (xla/service/gpu/transforms/gemm_rewriter.cc, see
        targets/fp8_gemm.py). An f16 dot computes and scales in f32 (passes/fp8.py), so
        its scales stay f32: in f16 a scale below 6e-8 (an amax under 2.7e-5) is 0."""
        if result == "f16":
            return "f32"
        if result == "bf16":
            return result
        return "bf16" if compute_dtype == "bfloat16" else "f32"

    # -- deviceless compiles ------------------------------------------------------------

    @property
    def compiler_options(self) -> dict[str, Any]:
        """XLA flags for every compile of this device without the device."""
        return {}

    def live_compiler_options(self, fp8: bool) -> dict[str, Any]:
        """XLA flags for a compile on this machine's own device, given whether the
        policy has fp8 actions; a flag the user set in ``XLA_FLAGS`` is left to them."""
        return {}

    def refusal(self, dtypes: set[str]) -> str | None:
        """Why this device cannot run a policy computing in ``dtypes``, else None."""
        for dtype, why in self.unsupported:
            if dtype in dtypes:
                return f"it computes in {dtype}, and {why}"
        return None

    def topology_devices(self) -> tuple:
        """The abstract devices XLA compiles this device for without it: the first of its
        topology for a one-device target, all of them for a node, nodes or a slice
        (`GpuTarget` and `TpuTarget` make theirs; targets/topology.py); this base is no
        device to compile for."""
        raise ValueError(f"target {self.name!r} is not a device to compile for")

    def mesh(self, axes: Mapping[str, int] | None = None) -> Any:
        """A ``jax.sharding.Mesh`` over `topology_devices` (``hlo_amp.target_mesh``):
        ``axes`` maps names to sizes whose product is the device count; without them, one
        axis ``"device"`` over all of them."""
        return mesh_of(self, axes)
