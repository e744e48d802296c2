"""The benchmark's model of a step compiled for an H100 without a device (hlo_amp/targets/roofline.py).

Small programs compiled by XLA:GPU for the H100 target, with FLOPs and bytes worked out
here from the shapes: a GEMM's FLOPs and traffic, a convolution's forward and gradient
calls, loop bodies counted once per iteration, a scan's in-place stacking counted per
slice, the 16-bit share, and the RESULTS.md section that ``--device h100-aot`` replaces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import hlo_amp
from benchmarks.kernel_diff import surplus
from benchmarks.run import HAND_WRITTEN, write_aot_section
from hlo_amp import compile_for_target
from hlo_amp.targets import device_target
from hlo_amp.targets.roofline import F32_NON_TENSOR, estimate

H100 = device_target("h100")
M, K, N = 256, 512, 384  # multiples of 8: XLA pads no 16-bit GEMM


def _hlo(fn, *args) -> str:
    return compile_for_target(jax.jit(fn), *args, target="h100").as_text()


def _gemms(result):
    return [k for k in result.kernels if k.matrix and k.matrix.startswith("GEMM")]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_gemm_flops_bytes_and_share(dtype) -> None:
    a, b = jnp.ones((M, K), dtype), jnp.ones((K, N), dtype)
    result = estimate(_hlo(lambda a, b: a @ b, a, b), "h100")
    [gemm] = _gemms(result)
    size = jnp.dtype(dtype).itemsize
    assert gemm.flops == 2 * M * N * K == result.matrix_flops
    assert gemm.count == 1
    assert gemm.bytes >= (M * K + K * N + M * N) * size  # workspace not counted:
    assert gemm.bytes < (M * K + K * N + M * N) * size + 4096
    low = dtype == jnp.bfloat16
    assert result.share_16bit == (1.0 if low else 0.0) and result.share_fp8 == 0.0
    assert dict(result.calls) == {("GEMM", "bf16" if low else "f32"): 1}
    peak = H100.peak_flops["bf16" if low else "f32"]  # f32: TF32, XLA's default precision
    expected = max(gemm.bytes / H100.hbm_bytes_per_second, gemm.flops / peak)
    assert gemm.seconds(H100.peak_flops, "H100", H100.hbm_bytes_per_second) == expected
    assert result.roofline_seconds >= expected


def test_full_f32_precision_uses_the_non_tensor_peak() -> None:
    a, b = jnp.ones((M, K)), jnp.ones((K, N))
    tf32 = estimate(_hlo(lambda a, b: a @ b, a, b))
    full = estimate(_hlo(lambda a, b: jnp.dot(a, b, precision="highest"), a, b))
    [fast], [slow] = _gemms(tf32), _gemms(full)
    assert slow.full_f32 and not fast.full_f32 and slow.flops == fast.flops
    assert full.roofline_seconds == slow.flops / F32_NON_TENSOR["H100"]  # compute-bound
    assert tf32.roofline_seconds < full.roofline_seconds / 2  # TF32: 494.7 TFLOP/s


def test_loop_kernels_count_once_per_iteration() -> None:
    w = jnp.ones((K, K), jnp.bfloat16) / K
    x = jnp.ones((M, K), jnp.bfloat16)

    def looped(trips):
        return lambda x, w: jax.lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ w), x)

    def unrolled(x, w):
        for _ in range(6):
            x = jnp.tanh(x @ w)
        return x

    loop6, loop3 = estimate(_hlo(looped(6), x, w)), estimate(_hlo(looped(3), x, w))
    flat = estimate(_hlo(unrolled, x, w))
    assert loop6.unknown_trip_counts == 0
    assert [k.count for k in _gemms(loop6)] == [6]  # one GEMM kernel in the body, 6 times
    per_gemm = 2 * M * K * K
    assert loop6.matrix_flops == flat.matrix_flops == 6 * per_gemm == 2 * loop3.matrix_flops
    gemm_bytes = [sum(k.bytes * k.count for k in _gemms(r)) for r in (loop6, flat, loop3)]
    assert gemm_bytes[0] == gemm_bytes[1] == 2 * gemm_bytes[2]
    assert loop6.hbm_bytes > 1.8 * loop3.hbm_bytes


def test_scan_stacking_counts_each_slice_not_the_whole_array() -> None:
    """ys written in place one slice per step: bytes grow linearly with the length."""
    w = jnp.ones((256, 256)) / 256

    def scan(length):
        def fn(h, xs):
            def cell(h, x):
                h = jnp.tanh(h @ w + x)
                return h, h
            return jax.lax.scan(cell, h, xs)[1]
        return fn, (jnp.ones((64, 256)), jnp.ones((length, 64, 256)))

    short, long = (estimate(_hlo(fn, *args)) for fn, args in (scan(8), scan(32)))
    assert long.matrix_flops == 4 * short.matrix_flops
    # Counting the whole (length, 64, 256) stack per step would grow it 16x here.
    assert long.hbm_bytes < 4.5 * short.hbm_bytes


def test_convolution_flops_forward_and_both_gradients() -> None:
    n, h, w, cin, cout = 8, 16, 16, 32, 64
    x = jnp.ones((n, h, w, cin), jnp.bfloat16)
    kernel = jnp.ones((3, 3, cin, cout), jnp.bfloat16)

    def conv(x, kernel):
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss(x, kernel):
        return conv(x, kernel).astype(jnp.float32).sum()

    flops = 2 * n * h * w * cout * 3 * 3 * cin
    forward = estimate(_hlo(conv, x, kernel))
    assert [k.flops for k in forward.kernels if k.matrix == "conv"] == [flops]
    grads = estimate(_hlo(jax.grad(loss, argnums=(0, 1)), x, kernel))
    convs = [k for k in grads.kernels if k.matrix == "conv"]
    assert len(convs) == 2 and all(k.flops == flops for k in convs)  # dx and dW
    assert grads.share_16bit == 1.0
    assert grads.calls[("conv", "bf16")] == 2


def test_results_section_replaced_and_cpu_rows_kept(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    cpu = "# hlo_amp benchmark results\n\n## mlp: CPU rows\n\n| f32 | 1 |\n"
    hand = "## The mixed_bfloat16 mode (analysis)\n\nhand text\n"
    path.write_text(f"{cpu}\n{HAND_WRITTEN}\n\n{hand}")
    write_aot_section(path, "h100-aot", ["## H100, compiled without a device", "old"])
    write_aot_section(path, "h200-aot", ["## H200, compiled without a device", "h200"])
    write_aot_section(path, "h100-aot", ["## H100, compiled without a device", "new"])
    text = path.read_text()
    assert text.startswith(cpu) and text.endswith(hand)
    assert text.count("## H100, compiled without a device") == 1
    assert "new" in text and "old" not in text and "h200" in text
    assert text.index(HAND_WRITTEN) < text.index("H100") < text.index("H200") < text.index(hand)


def test_kernel_diff_names_the_kernels_one_side_has_more_of() -> None:
    # A GEMM with an f32 result against one with a bf16 result: the surplus on each side
    # is exactly that GEMM; a step against itself has none.
    a, b = jnp.ones((M, K), jnp.bfloat16), jnp.ones((K, N), jnp.bfloat16)
    wide = estimate(_hlo(lambda a, b: jnp.tanh(jnp.dot(a, b, preferred_element_type=jnp.float32)),
                         a, b), "h100")
    low = estimate(_hlo(lambda a, b: jnp.tanh(a @ b).astype(jnp.float32), a, b), "h100")
    assert surplus(wide.kernels, wide.kernels) == []
    [(gemm, count)] = [(k, n) for k, n in surplus(wide.kernels, low.kernels) if k.matrix]
    [(other, _)] = [(k, n) for k, n in surplus(low.kernels, wide.kernels) if k.matrix]
    assert count == 1 and gemm.bytes - other.bytes == M * N * 2  # f32 vs bf16 result


def test_recorded_command_leaves_out_where_results_were_written() -> None:
    from benchmarks.run import recorded_command

    assert recorded_command(["--device", "h100-aot", "--out", "/tmp/x", "--stress-layers", "0"]
                            ) == "python -m benchmarks.run --device h100-aot --stress-layers 0"
    assert recorded_command(["--out=/tmp/x", "--quick"]) == "python -m benchmarks.run --quick"


# XLA:TPU's prefetches into VMEM (S(1)): a copy of a whole array and slices of another,
# each with its done, then a fusion reading the copies.
TPU_PREFETCH = """\
HloModule tpu_step

%add (a: f32[512,2048], b: f32[512,2048]) -> f32[512,2048] {
  %a = f32[512,2048]{1,0} parameter(0)
  %b = f32[512,2048]{1,0} parameter(1)
  ROOT %s = f32[512,2048]{1,0} add(%a, %b)
}

ENTRY %main (x: f32[4096,2048], w: f32[2048,2048]) -> f32[512,2048] {
  %x = f32[4096,2048]{1,0:T(8,128)} parameter(0)
  %w = f32[2048,2048]{1,0:T(8,128)} parameter(1)
  %copy-start = (f32[4096,2048]{1,0:T(8,128)S(1)}, f32[4096,2048]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%x), cross_program_prefetch_index=0
  %copy-done = f32[4096,2048]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %slice-start = ((f32[2048,2048]{1,0:T(8,128)}), f32[512,2048]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:512], [0:2048]}
  %slice-done = f32[512,2048]{1,0:T(8,128)S(1)} slice-done(%slice-start)
  %slice-start.1 = ((f32[2048,2048]{1,0:T(8,128)}), f32[512,2048]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[512:1024], [0:2048]}
  %slice-done.1 = f32[512,2048]{1,0:T(8,128)S(1)} slice-done(%slice-start.1)
  %joined = f32[1024,2048]{1,0:T(8,128)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  %top = f32[512,2048]{1,0} slice(%copy-done), slice={[0:512], [0:2048]}
  %half = f32[512,2048]{1,0} slice(%joined), slice={[0:512], [0:2048]}
  ROOT %sum = f32[512,2048]{1,0} fusion(%top, %half), kind=kLoop, calls=%add
}
"""


def test_an_async_prefetch_is_one_read_of_what_it_moves() -> None:
    """A copy-start reads its array once and a slice-start its slice; their dones launch
    nothing. Each half was charged its operand and its whole result tuple (the source
    again): 192 MiB for a 32 MiB copy, and mixed_bfloat16 ranked slower than f32 on
    TPU v5e (a 2048-wide MLP step: 2,040 against 1,589 us; now 954 us both, 400 against
    512 MiB)."""
    result = estimate(TPU_PREFETCH, "tpu-v5e")
    by_op = {k.op: k for k in result.kernels}
    assert "copy-done" not in by_op and "slice-done" not in by_op
    # ... and XLA:TPU's ConcatBitcast of the prefetched slices is a bitcast
    assert "custom-call" not in by_op
    assert by_op["copy-start"].bytes == 4096 * 2048 * 4
    assert by_op["slice-start"].bytes == 512 * 2048 * 4


def test_the_fp8_share_of_gemms_leaves_convolutions_out() -> None:
    """Under the fp8 preset the first and last matrix ops (here a convolution and the
    head) stay bf16: of the GEMMs, the middle dot's FLOPs are fp8; the share over every
    matrix op counts the convolution too."""
    def f(img, w1, w2, w3):
        h = jax.lax.conv_general_dilated(img, w1, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(h.reshape(256, 512))
        return jnp.tanh(h @ w2) @ w3

    args = (jnp.ones((16, 8, 8, 16)), jnp.ones((3, 3, 16, 128)), jnp.ones((512, 1024)),
            jnp.ones((1024, 256)))
    text = hlo_amp.compile(f, "fp8").lower(*args, target="h100").compile().as_text()
    result = estimate(text, "h100")
    fp8 = 2 * 256 * 512 * 1024
    gemms = fp8 + 2 * 256 * 1024 * 256
    assert sum(k.flops * k.count for k in _gemms(result)) == gemms
    assert result.gemm_share_fp8 == fp8 / gemms
    assert result.share_fp8 == fp8 / result.matrix_flops < result.gemm_share_fp8
