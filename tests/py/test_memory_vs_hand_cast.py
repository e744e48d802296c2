"""AMP needs no more XLA temp memory than the cast a user writes by hand (issue 33, 4).

Three small public models (benchmarks/hand_cast_workloads.py: a MobileNetV3Small cut from
Keras's own blocks, flax's examples/vae, flax's examples/mnist NNX CNN) compiled without
a device for H100 and TPU v5e, as f32 ``jax.jit``, as the hand-cast bf16 peer (Keras
``mixed_bfloat16``, Flax ``dtype=bfloat16``) and through hlo_amp in both 16-bit modes.
On H100 as ``target="h100"`` compiles (every GEMM a cuBLAS call, as a compile without a
device must for some programs: docs/gpu_target.md), and a case that misses there (UNMET)
again with XLA:GPU's default GEMM emitter, Triton (``"h100+triton"``:
``xla_gpu_enable_triton_gemm``, which these three compile with).
Compared, from ``memory_analysis().temp_size_in_bytes`` (a compile-time fact):

- the fast mode's temp against the peer's: ``mixed_bfloat16 <= peer``;
- each mode's temp against f32's plus the bytes of a 16-bit copy of every parameter
  (what casting the parameters at use may add).

The cases not met are listed in ``UNMET`` with the reason and left out of the
parametrisation (not skipped: reported in issue 33's note).
Figures on H100 at these sizes (temp bytes): MobileNet f32 5,457,472, hand cast
4,890,432, bf16 5,046,336, mixed_bfloat16 4,628,544 (4,890,688 before the backward pass
recomputed the batch norms' f32 residuals, 5,014,080 before a value stored in 16 bit
after a deny op ended the deny region, 5,046,848 before such values were stored); VAE f32 4,208,688, hand cast 4,255,792 = mixed_bfloat16, bf16 4,221,232
(4,319,792 before its two padded weight-gradient GEMMs stayed f32; f32 + parameter
copies: 4,316,120); MNIST f32 4,360,984, hand cast 4,242,456 = mixed_bfloat16, bf16
4,253,464. With Triton GEMMs there is no 4 MiB cuBLAS workspace and no cuBLAS padding,
and every check holds for all three models (measured before the residuals were
recomputed; mixed_bfloat16 MobileNet since 732,224):
MobileNet f32 1,746,496, hand cast 995,904, bf16 990,784, mixed_bfloat16 973,888; VAE
f32 117,784, hand cast 72,728 = mixed_bfloat16, bf16 14,360; MNIST f32 279,064, hand
cast 45,592, bf16 153,624, mixed_bfloat16 45,336.
At the issue's sizes the full MobileNetV3Small (64x64, batch 8) on H100: f32 5,232,456,
hand cast 7,652,680, bf16 7,304,264, mixed_bfloat16 5,208,136 (bf16 8,476,744 and
mixed 8,067,656 before the two rules of c5398f8's session, mixed 7,652,680 before the
residuals were recomputed), both under f32's plus 3,056,212 B of parameter copies
(8,288,668): ``python -m benchmarks.hand_cast_memory`` (a minute per compile).
"""

from __future__ import annotations

import functools

import pytest

from benchmarks.hand_cast_memory import COMPILES, compile_variant, parameter_copies
from benchmarks.hand_cast_workloads import NAMES

TARGETS = tuple(COMPILES)  # h100 (cuBLAS GEMMs), tpu-v5e, h100+triton (Triton GEMMs)
MODES = ("bf16", "mixed_bfloat16")
# (model, target, check) -> why it is not asserted: XLA's own choices, measured.
UNMET: dict[tuple[str, str, str], str] = {
    # Empty since passes/recompute_residuals.py. It held MobileNet on "h100", mixed <=
    # peer: 256 B over (4,890,688 against 4,890,432), the fast mode's f32 softmax
    # probabilities live at the cuBLAS workspace's peak where the hand cast holds a
    # bf16 GEMM result; recomputing the batch norms' f32 residuals took 262,144 B off.
}


@functools.cache
def _temp(name: str, target: str, variant: str) -> int:
    """XLA temp bytes of one variant ("f32", "peer" or a mode), compiled only when a
    check asks for it (the peer of a case whose only peer check is UNMET is not)."""
    compiled = compile_variant(name, target, variant, small=True)
    if COMPILES[target][1].get("xla_gpu_enable_triton_gemm"):  # the flag took
        assert "__triton" in compiled.as_text(), (name, variant)
    return int(compiled.memory_analysis().temp_size_in_bytes)


# XLA:TPU reports 0 B of temp for every variant of the three models at these sizes (the
# checks hold there trivially, measured on v5e); MobileNet's TPU compiles, half a minute
# of `make test`, are left out for that reason, the two cheap ones are kept.
SKIPPED_FOR_TIME = {("mobilenet", "tpu-v5e")}


def _cases(check: str, modes: tuple[str, ...] = ("",)) -> list[tuple[str, ...]]:
    """(name, target[, mode]) for every case of ``check`` not in UNMET. With Triton GEMMs
    ("h100+triton") only the cases UNMET on "h100": the cuBLAS-only compile's misses."""
    cases = []
    for name in NAMES:
        for target in TARGETS:
            for mode in modes:
                key = check.replace("MODE", mode.split("_")[0])
                wanted = ((name, "h100", key) in UNMET if target == "h100+triton" else
                          (name, target, key) not in UNMET
                          and (name, target) not in SKIPPED_FOR_TIME)
                if wanted:
                    cases.append((name, target, *((mode,) if mode else ())))
    return cases


@pytest.mark.parametrize("name, target", _cases("mixed<=peer"))
def test_fast_mode_needs_no_more_temp_than_the_hand_cast(name: str, target: str) -> None:
    temp = {v: _temp(name, target, v) for v in ("mixed_bfloat16", "peer")}
    assert temp["mixed_bfloat16"] <= temp["peer"], temp


@pytest.mark.parametrize("name, target, mode", _cases("MODE<=f32+params", MODES))
def test_modes_add_at_most_the_parameters_16bit_copies(name: str, target: str,
                                                       mode: str) -> None:
    temp = {v: _temp(name, target, v) for v in (mode, "f32")}
    assert temp[mode] <= temp["f32"] + parameter_copies(name, small=True), (temp, parameter_copies(name, small=True))


def test_unmet_cases_name_real_cases():
    """UNMET names only cases the tests above would run (no stale entry hides one)."""
    every = {(name, target, check) for name in NAMES for target in TARGETS
             for check in ("mixed<=peer", "bf16<=f32+params", "mixed<=f32+params")}
    assert set(UNMET) <= every
