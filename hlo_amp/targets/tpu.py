"""XLA:TPU as a target: `TpuTarget`, and the TPU generations compiled for without the
device (one entry each in ``_TPUS``).

On TPU dots and convolutions keep the accurate form, bf16×bf16→f32, as XLA:TPU runs them
(the ``--target tpu`` run of tests/lit/gpu_conv.mlir), and a matrix op inside a 16-bit
region returns the 16-bit type, as on GPU: the base `Target`'s facts. What differs is
what a TPU refuses, and that an f32 dot at DEFAULT precision already runs as that form
(`TpuTarget.f32_dot_runs_as`), so the accurate mode leaves such dots f32.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import ClassVar

from hlo_amp.targets.target import Target
from hlo_amp.targets.topology import NoCompilerForTarget, first_devices


@dataclass(frozen=True)
class TpuTarget(Target):
    """XLA:TPU; with ``topology`` set, one TPU slice compiled for without the device."""

    name: str = "tpu"
    topology: str = ""  # the slice compiled for: "v5e:2x2"
    family: ClassVar[str | None] = "tpu"
    platform: ClassVar[str] = "tpu"
    no_fused_attention: ClassVar[str] = ("TPU: cuDNN's fused attention is a GPU kernel (XLA:TPU "
                                         "runs the attention as written)")

    @property
    def sums_read_a_16bit_copy(self) -> bool:
        """No. XLA:TPU fuses the convert into the matrix op's operand fusion; a barrier
        makes it write the copy (decoder: 23.25 -> 25.98 ms, temp 328.6 -> 404.5 MiB,
        benchmarks/RESULTS.md)."""
        return False

    @property
    def selects_scatters_before_partitioning(self) -> bool:
        """Yes. XLA:TPU's ``sparse-gradient-rewrite`` (its first pipeline, before the
        partitioner) writes the label pick's add scatter as a select: in the hand-cast
        decoder's dump (``--xla_dump_hlo_pass_re=.*``, tpu-v5e:4x4) that scatter is gone
        after it and Shardy's input has a ``select`` of the logits' shape; giving
        scatter_select's select the scatter's sharding there moved the plan off the hand
        cast's (tests/py/test_partition_plan.py)."""
        return True

    def f32_dot_runs_as(self, compute_dtype: str) -> str | None:
        """bf16: libtpu's LLO (--xla_jf_dump_llo_text, every generation in ``_TPUS``)
        runs an f32 dot at DEFAULT precision with the instructions of the same dot on
        operands converted to bf16 in the program: ``vpack.c.bf16`` on each operand, then
        bf16 matrix-unit instructions, as many (tests/py/test_tpu_target.py's probe). HIGH
        and HIGHEST run f32 matrix-unit instructions, about 6 and 12 times as many."""
        if compute_dtype != "bfloat16":
            return None
        return ("XLA:TPU rounds an f32 dot's operands to bf16 itself at DEFAULT precision "
                "(one bf16 matrix-unit pass, f32 accumulation)")

    def topology_devices(self) -> tuple:
        """The chips (v4: TensorCores) of the slice ``topology``, made by libtpu without
        a TPU."""
        if not self.topology:
            return super().topology_devices()
        return first_devices(self, _tpu_topology(self.topology, self.description))


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


@dataclass(frozen=True)
class _Slices:
    """The slices of a generation: libtpu's names and what the ICI gives each chip."""

    dims: int  # a slice is AxB (2D torus) or AxBxC (3D)
    max_chips: int  # the largest slice Google Cloud lists
    devices_per_chip: int  # JAX devices libtpu's deviceless topology makes per chip
    ici_bytes_per_second: float  # per chip, one direction (half the bidirectional figure)


_SLICES: dict[str, _Slices] = {
    # Google Cloud's former system-architecture table: v4 "Interchip Interconnect BW 2400
    # Gbps" (not on the v4 page, which gives none; unverified here). Pod: 4096 chips (v4
    # page). libtpu's v4 topology has one device per TensorCore, two per chip.
    "tpu-v4": _Slices(3, 4096, 2, 300e9),
    # v5e page: bidirectional ICI 400 GBps per chip; TPU Pod size 256 chips.
    "tpu-v5e": _Slices(2, 256, 1, 200e9),
    # v5p page: bidirectional ICI 1200 GBps per chip; largest slice 16x16x24 (6144 chips).
    "tpu-v5p": _Slices(3, 6144, 1, 600e9),
    # v6e page: bidirectional ICI 800 GBps per chip; TPU Pod size 256 chips.
    "tpu-v6e": _Slices(2, 256, 1, 400e9),
}
# libtpu refuses a slice whose first two dimensions its chips-per-host bounds (2x2x1) do
# not divide: "v5e:3x7", "v4:1x2x2".
_HOST_BOUNDS = 2

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
           f"({device}'s fp8 modes are e5m2 and e4m3b11fnuz; every fp8 action of hlo_amp, "
           "float8_e5m2 too, reads e4m3fn forward operands, e5m2 only for the incoming "
           "gradient)" if fp8_modes else
           f"XLA:TPU upcasts fp8 dots to f32 matrix-unit instructions ({device} has no "
           "fp8 matrix unit)")
    return (("float8_e4m3fn", why), ("float8_e5m2", why))


# The family (target="tpu", an export for "tpu": the generation is not told): what no
# TPU runs in its matrix unit (an export for a TPU took f16 and fp8 policies that a named
# TPU refuses).
TPU = TpuTarget(unsupported=(_TPU_F16, *_tpu_fp8("any TPU generation", fp8_modes=True)))


def tpu_device(name: str) -> TpuTarget | None:
    """A TPU generation (``"tpu-v5e"``: one chip of its smallest slice), or a whole slice
    (``"tpu-v5e:4x4"``, 16 chips); None for a name not in ``_TPUS``, a ValueError naming
    what is accepted for a slice libtpu does not describe."""
    generation, colon, shape = name.partition(":")
    if generation not in _TPUS:
        return None
    device, slice_name, bf16, hbm, fp8_modes = _TPUS[generation]
    slices = _SLICES[generation]
    # "tpu-v5e:" (a slice left empty) was one chip, named with its colon.
    chips = _slice_chips(name, generation, shape, slices) if shape or colon else 1
    topology = f"{slice_name.split(':')[0]}:{shape}" if shape else slice_name
    devices = chips * slices.devices_per_chip if shape else 1
    # A device is what XLA:TPU compiles the step for: on v4 one of a chip's two
    # TensorCores, with half its matrix units, HBM bandwidth and links (priced at the
    # whole chip's, a v4 step's roofline was about half XLA:TPU's own estimate).
    share = slices.devices_per_chip
    return TpuTarget(name, device, f"Google {device} ({topology})",
                     peak_flops={"f32": bf16 / share, "bf16": bf16 / share},
                     hbm_bytes_per_second=hbm / share, devices=devices,
                     link_bytes_per_second=slices.ici_bytes_per_second / share,
                     topology=topology, unsupported=(_TPU_F16, *_tpu_fp8(device, fp8_modes)))


def _slice_chips(name: str, generation: str, shape: str, slices: _Slices) -> int:
    """The chips in slice ``shape`` of ``generation``, or a ValueError naming the rule."""
    example = _TPUS[generation][1].split(":")[1]
    form = "AxB" if slices.dims == 2 else "AxBxC"
    rule = (f"a {generation} slice is {form} chips with A and B even and at most "
            f"{slices.max_chips} chips in all, e.g. {generation}:{example}")
    parts = shape.split("x")
    if len(parts) != slices.dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"target={name!r}: {rule}")
    sizes = [int(p) for p in parts]
    chips = math.prod(sizes)
    if any(size % _HOST_BOUNDS for size in sizes[:2]) or chips > slices.max_chips:
        raise ValueError(f"target={name!r} is {chips} chips: {rule}")
    return chips


def default_slice(topology: str) -> str:
    """The slice ``_TPUS`` compiles a generation for, given any slice of it ("" if none)."""
    return next((t[1] for t in _TPUS.values()
                 if t[1].split(":")[0] == topology.split(":")[0]), "")


@functools.cache
def _tpu_topology(topology_name: str, description: str) -> tuple:
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
    return tuple(topology.devices)
