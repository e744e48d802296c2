"""The roofline: what a step compiled for a device would cost there, read from XLA's
optimized HLO (XLA:GPU's; XLA:TPU's the same way, see ``_hlo_conv_flops``). The benchmarks'
HBM and roofline columns and ``autopolicy(..., target=...)`` read it.

``estimate(hlo_text, target)`` lists the step's kernels and adds them up:

* **Kernels** are the instructions of the ENTRY computation, and of the bodies (and
  conditions) of its ``while`` loops, that launch work: fusions, custom calls (cuBLAS
  GEMMs, cuDNN convolutions, others), copies and any other instruction that is not free
  (parameters, constants, tuples, get-tuple-element, bitcasts are free; an async
  collective is the kernel of its start, its ``-done`` free). The walk and the parser are
  targets/hlo_text.py's. A loop's kernels
  count once per iteration: the ``known_trip_count`` XLA prints in the ``while``'s
  ``backend_config`` (nested loops multiply; a loop without one counts once and is
  reported in ``unknown_trip_counts``; XLA:TPU prints none, so there the count is read
  from the condition, ``i < N`` with ``i`` starting at a constant). Of a ``conditional``, the branch moving the most
  bytes counts; ``call``/``async-start`` computations are walked as if inlined.
* **HBM bytes** of a kernel: the bytes of its distinct operands plus those of its result
  (a cuBLAS call's workspace excluded). Inside a fusion, a parameter only sliced
  (``dynamic-slice``, ``slice``, ``gather``) counts the slices, and a
  ``dynamic-update-slice`` into a parameter (done in place by XLA) counts the update
  only, so a scan's per-step reads and writes are not counted as the whole stacked array.
* **Matrix FLOPs**: a GEMM's ``2 · (lhs elements) · (rhs non-contracting, non-batch
  elements)``, its dimensions from the cuBLAS call's ``dot_dimension_numbers``; a cuDNN
  convolution's ``2 · (forward output elements) · (filter elements) / (output
  features)``, the forward convolution read from ``dim_labels`` (the gradient calls
  name its input, filter and output among their operands and result); a cuDNN fused
  attention's matmuls (``_attention_flops``: two forward, five backward, half of them
  under a causal mask), whose HBM bytes are its q, k, v, output and statistics alone. ``dot``
  instructions inside fusions (Triton GEMMs) count the same way; an HLO ``convolution``
  (XLA:TPU's form of every matrix op) counts the products it computes: window positions
  on input elements, not on padding or ``lhs_dilate`` holes (XLA:TPU's batched dots are
  convolutions over a batch dilated into holes). The
  GEMM's class is its two matrix operands' element types: all 16-bit, all fp8, or wide.
* **Roofline time** of a kernel: ``max(bytes / HBM bandwidth, FLOPs / peak)``, the peak
  of its operand class (``f32`` is TF32 on tensor cores, XLA's default precision;
  ``HIGHEST``/``ALG_DOT_F32_F32_F32`` the non-tensor f32 peak); summed over kernels
  times their execution counts. Kernels without matrix FLOPs are memory-bound in it.
* **Collective time** per device (``collective_seconds``): each collective of the step
  (targets/collectives.py: its bytes per device, the larger of operand and result) over
  the target's ``link_bytes_per_second`` (one direction), times the ring algorithm's
  factor for its replica group of n devices: all-reduce 2(n-1)/n, all-gather,
  reduce-scatter and all-to-all (n-1)/n, collective-permute 1; n is the target's
  ``devices`` where the HLO names no groups. ``roofline_seconds`` is
  ``kernel_seconds`` (compute and HBM) plus it; for one device nothing changes.

Blind spots, each of which makes a real step differ from the estimate:

* no caches: every kernel reads its operands from HBM and writes its result back; L2 (50
  MiB on H100) reuse between kernels, and re-reads inside a kernel (a GEMM's tiles, a
  fusion that reads an operand twice), are not modelled; fusion-internal traffic is free;
* peaks are NVIDIA's dense datasheet numbers (H100/H200 SXM), reached by no real kernel;
  small GEMMs, launch latency (several µs per kernel), occupancy, tile quantisation and
  elementwise arithmetic are ignored, so many-small-kernel steps look too fast;
* no autotuning without a device, so Triton GEMM fusion is off: every GEMM is a cuBLAS
  call here, and a real run may choose Triton kernels (fused prologues/epilogues change
  the bytes); cuDNN algorithm choice (workspace, Winograd) is not known either;
* overlap is ideal within a kernel (max of the two bounds) and absent between kernels
  (streams, async copies); host work is absent;
* communication overlaps nothing: XLA's async collectives run beside compute, so a real
  step hides part of ``collective_seconds``; one link bandwidth prices every collective
  (no NVLink/network or ICI-torus topology, no latency per collective, no in-network
  reduction such as NVLink SHARP, the ring algorithm whatever NCCL or XLA:TPU choose);
  a collective's kernel also counts as HBM traffic in ``kernel_seconds``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hlo_amp.targets.collectives import link_factor, read_collectives
from hlo_amp.targets.hlo_text import Array, HloWalker, Instruction, dims, parse_module

_LOW16 = ("bf16", "f16")
# Async collective starts whose result is (operands, results): the operands are not written.
_ALIASING_STARTS = frozenset({"all-gather-start", "collective-permute-start",
                              "reduce-scatter-start"})
# Async copies and slices, their result (the source, the destination, a context) read back
# by a copy-done/slice-done (hlo_text.FREE).
_ASYNC_MOVES = frozenset({"copy-start", "slice-start"})
# NVIDIA's dense non-tensor-core f32 peaks (FLOP/s), for GEMMs XLA runs at full f32
# precision; Target.peak_flops["f32"] is TF32, XLA's default for f32 dots.
F32_NON_TENSOR = {"H100": 66.9e12, "H200": 66.9e12, "A100": 19.5e12}
# The bf16 passes XLA:TPU's matrix unit makes of an f32 matrix op by its precision, as
# jax.lax.Precision documents them (DEFAULT one; libtpu's LLO shows HIGH and HIGHEST
# with more instructions still, targets/tpu.py: a lower bound on their time).
_F32_PASSES = {"high": 3, "highest": 6}


@dataclass(frozen=True)
class Kernel:
    """One kernel of the step, as the model sees it."""

    name: str
    op: str  # "fusion", "custom-call", "copy", ...
    bytes: int  # HBM bytes read + written by one execution
    count: int  # executions per step (loop trip counts multiplied)
    flops: int = 0  # matrix FLOPs of one execution (GEMM, convolution)
    matrix: str | None = None  # "GEMM", "GEMM fp8", "conv" for a library call or Triton GEMM
    operand_types: tuple[str, ...] = ()  # element types of its two matrix operands
    full_f32: bool = False  # an f32 GEMM XLA runs at full f32 precision (not TF32)
    # XLA:TPU's bf16 matrix-unit passes for an f32 matrix op at HIGH (3) or HIGHEST (6)
    # precision (jax.lax.Precision); 1 at DEFAULT, one bf16 pass.
    tpu_passes: int = 1

    @property
    def dtype_class(self) -> str:
        """``fp8``, ``16-bit`` or ``wide`` (f32 or mixed widths)."""
        types = self.operand_types
        if types and all(t.startswith("f8") for t in types):
            return "fp8"
        if types and all(t in _LOW16 for t in types):
            return "16-bit"
        return "wide"

    @property
    def dtype_label(self) -> str:
        types = self.operand_types
        return types[0] if len(set(types)) == 1 else "×".join(types)

    def peak(self, peaks: dict[str, float], device: str) -> float:
        cls = self.dtype_class
        if cls == "fp8" and "f8" in peaks:
            return peaks["f8"]
        if cls == "16-bit":
            return peaks.get("f16" if set(self.operand_types) == {"f16"} else "bf16",
                             peaks.get("f32", 1.0))
        if self.full_f32:
            return F32_NON_TENSOR.get(device, peaks.get("f32", 1.0))
        if device.startswith("TPU"):
            return peaks.get("f32", 1.0) / self.tpu_passes
        return peaks.get("f32", 1.0)

    def seconds(self, peaks: dict[str, float], device: str, bandwidth: float) -> float:
        """Roofline time of one execution."""
        compute = self.flops / self.peak(peaks, device) if self.flops else 0.0
        return max(self.bytes / bandwidth, compute)


@dataclass
class Estimate:
    """The model's figures for one compiled step (see the module docstring)."""

    kernels: list[Kernel]
    device: str
    hbm_bytes_per_second: float
    peak_flops: dict[str, float]
    unknown_trip_counts: int = 0
    calls: Counter = field(default_factory=Counter)  # ("GEMM"|"GEMM fp8"|"conv", dtype) -> n
    # The step's collectives (targets/collectives.py) and what prices them: the target's
    # devices (a collective whose HLO names no replica groups spans them all) and link.
    collectives: list[Any] = field(default_factory=list)
    devices: int = 1
    link_bytes_per_second: float | None = None

    @property
    def matrix_flops(self) -> int:
        return self._flops_of()

    def _flops_of(self, cls: str | None = None, gemms: bool = False) -> int:
        """FLOPs of the kernels of dtype class ``cls`` (None: any), GEMMs alone with
        ``gemms`` (no convolution, no fused attention)."""
        return sum(k.flops * k.count for k in self.kernels
                   if (cls is None or k.dtype_class == cls)
                   and (not gemms or (k.matrix or "").startswith("GEMM")))

    @property
    def share_16bit(self) -> float:
        """Share of GEMM + convolution FLOPs whose operands are bf16/f16."""
        return self._flops_of("16-bit") / self.matrix_flops if self.matrix_flops else 0.0

    @property
    def share_fp8(self) -> float:
        """Share of GEMM + convolution FLOPs whose operands are fp8."""
        return self._flops_of("fp8") / self.matrix_flops if self.matrix_flops else 0.0

    @property
    def gemm_share_fp8(self) -> float:
        """Share of GEMM FLOPs (cuBLAS calls, Triton GEMMs: no convolution, no fused
        attention) whose operands are fp8."""
        total = self._flops_of(gemms=True)
        return self._flops_of("fp8", gemms=True) / total if total else 0.0

    @property
    def hbm_bytes(self) -> int:
        return sum(k.bytes * k.count for k in self.kernels)

    @property
    def kernel_seconds(self) -> float:
        """Compute and HBM time of the kernels (a collective's kernel as HBM traffic)."""
        return sum(k.count * k.seconds(self.peak_flops, self.device, self.hbm_bytes_per_second)
                   for k in self.kernels)

    @property
    def collective_bytes(self) -> int:
        """Bytes of the step's collectives per device (``Collective.bytes`` × count)."""
        return sum(c.bytes * c.count for c in self.collectives)

    @property
    def collective_seconds(self) -> float:
        """Link time of the step's collectives per device: bytes × the ring algorithm's
        factor (``collectives.link_factor``) / the link's bandwidth. Zero without
        collectives, or where the target publishes no link bandwidth
        (``unpriced_collectives`` then counts them)."""
        if not self.link_bytes_per_second:
            return 0.0
        return sum(c.count * c.bytes * link_factor(c.kind, c.group_size or self.devices)
                   for c in self.collectives) / self.link_bytes_per_second

    @property
    def unpriced_collectives(self) -> int:
        """Collective executions left out of ``collective_seconds`` (no link bandwidth)."""
        return 0 if self.link_bytes_per_second else sum(c.count for c in self.collectives)

    @property
    def roofline_seconds(self) -> float:
        """The step's time per device: ``kernel_seconds + collective_seconds`` (the
        benchmarks' roofline column; for one device, the kernels' time alone)."""
        return self.kernel_seconds + self.collective_seconds

    @property
    def launches(self) -> int:
        return sum(k.count for k in self.kernels)


def _is_workspace(array: Array, index: int) -> bool:
    return index > 0 and array.dtype in ("s8", "u8") and len(array.shape) == 1


def _gemm_flops(lhs: Array, rhs: Array, dims: dict[str, Any]) -> int:
    skip = {int(d) for d in dims.get("rhs_contracting_dimensions", [])}
    skip |= {int(d) for d in dims.get("rhs_batch_dimensions", [])}
    free = math.prod(n for i, n in enumerate(rhs.shape) if i not in skip)
    return 2 * math.prod(lhs.shape) * free


def _attention_flops(call: Instruction, query: Array, target: str) -> int:
    """A cuDNN fused attention call's matmul FLOPs: 2 · B·N·T·S·H per matmul, with the
    [B, N, T, S] of the scores from its backend config and H the query's last dimension
    (BTNH and BNTH alike); two matmuls forward (Q·Kᵀ, P·V), five backward (Q·Kᵀ again,
    dO·Vᵀ, Pᵀ·dO, dS·K, dSᵀ·Q), as FlashAttention-2 counts them; half of it under a
    causal mask, whose masked blocks the kernel skips, and under a causal sliding window
    of w keys the share of the scores inside it."""
    config = call.backend_config().get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    if len(scores) != 4 or not query.shape:
        return 0
    matmuls = 5 if "Backward" in target else 2
    flops = 2 * matmuls * math.prod(scores) * query.shape[-1]
    if "CAUSAL" not in str(config.get("mask_type", "")):
        return flops
    queries, keys = scores[2:]
    window = int(config.get("sliding_window_length", 0) or 0)
    if not 0 < window < queries:
        return flops // 2
    # Query t sees min(t + 1, w) keys: w(w + 1)/2 over the first w queries, w after.
    seen = window * (window + 1) // 2 + (queries - window) * window
    return flops * seen // (queries * keys)


def _dot_dims(attrs: str) -> dict[str, list[int]]:
    """``lhs_contracting_dims={1}``-style attributes of a ``dot`` as gemm dimension numbers."""
    out = {}
    for side in ("rhs_contracting", "rhs_batch"):
        match = re.search(rf"{side}_dims=\{{([\d,]*)\}}", attrs)
        out[f"{side}_dimensions"] = dims(match.group(1)) if match else ()
    return out


def _conv_flops(call: Instruction, shapes: list[Array], target: str) -> int:
    """FLOPs of a cuDNN convolution call (see the module docstring)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", call.attrs)
    if not labels or len(shapes) < 2 or not call.arrays:
        return 0
    result = call.arrays[0]
    if "BackwardFilter" in target:
        output, kernel = shapes[1], result
    elif "BackwardInput" in target:
        output, kernel = shapes[0], shapes[1]
    else:
        output, kernel = result, shapes[1]
    rhs = labels.group(2)
    out_features = kernel.shape[rhs.index("o")] if "o" in rhs else 1
    return 2 * math.prod(output.shape) * math.prod(kernel.shape) // max(1, out_features)


def window_products(out_size: int, in_size: int, size: int, stride: int = 1,
                    lhs_dilate: int = 1, rhs_dilate: int = 1, pad_low: int = 0) -> int:
    """Along one spatial dimension of a convolution, the (output position, window
    position) pairs that land on an input element: not on padding, not on a hole of
    ``lhs_dilate`` (a transposed convolution's). ``out_size * size`` without either."""
    extent = (in_size - 1) * lhs_dilate
    return sum(1 for o in range(out_size) for k in range(size)
               if 0 <= (p := o * stride + k * rhs_dilate - pad_low) <= extent
               and p % lhs_dilate == 0)


def _hlo_conv_flops(conv: Instruction, shapes: list[Array]) -> int:
    """FLOPs of an HLO ``convolution`` counting only the products XLA computes: per
    output element, the window positions that land on an input element, not on padding
    or on the holes of ``lhs_dilate``. XLA:TPU writes batched dots so (the batch as a
    window of its size over an input dilated by as much: one real product per window)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", conv.attrs)
    if not labels or len(shapes) < 2 or not conv.arrays:
        return 0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    lhs, rhs, out = shapes[0], shapes[1], conv.arrays[0]
    window: dict[str, list[int]] = {}
    match = re.search(r"window=\{([^}]*)\}", conv.attrs)
    for key, value in re.findall(r"(\w+)=([\dx_\-]+)", match.group(1) if match else ""):
        window[key] = [int(v) for v in re.split(r"[x_]", value)]
    spatial = [c for c in out_labels if c.isdigit()]
    macs = math.prod(out.shape[out_labels.index(c)] for c in "bf" if c in out_labels)
    macs *= rhs.shape[rhs_labels.index("i")] if "i" in rhs_labels else 1
    for d, label in enumerate(spatial):
        size = window.get("size", [1] * len(spatial))[d]
        stride = window.get("stride", [1] * len(spatial))[d]
        lhs_dilate = window.get("lhs_dilate", [1] * len(spatial))[d]
        rhs_dilate = window.get("rhs_dilate", [1] * len(spatial))[d]
        pad_low = window.get("pad", [0] * 2 * len(spatial))[2 * d]
        macs *= window_products(out.shape[out_labels.index(label)],
                                lhs.shape[lhs_labels.index(label)], size, stride,
                                lhs_dilate, rhs_dilate, pad_low)
    return 2 * macs


class _Walker(HloWalker):
    """The roofline's walk: a ``Kernel`` per instruction that launches one."""

    def kernel(self, inst: Instruction, count: int) -> Kernel:
        operands = list(dict.fromkeys(inst.operands))  # each distinct operand read once
        # An async fusion (fusion-start ... fusion-done, XLA 0.12's in-place updates of a
        # scan's stacked outputs) is the kernel its start launches.
        if inst.op in ("fusion", "fusion-start"):
            return self._fusion(inst, count)
        if inst.op in _ASYNC_MOVES:
            # XLA:TPU's prefetch of an array (or a slice of it) into VMEM: one read of
            # what it moves from HBM. Its result tuple holds the source again and the
            # destination, and its done the destination: a 32 MiB copy was charged
            # 192 MiB, and a mixed_bfloat16 step ranked slower than f32 on TPU v5e.
            moved = min((a.bytes for a in inst.arrays if a.shape), default=0)
            return Kernel(inst.name, inst.op, moved, count)
        written = sum(a.bytes for i, a in enumerate(inst.arrays) if not _is_workspace(a, i))
        read = sum(n for n in map(self.size, operands) if n is not None)
        if inst.op in _ALIASING_STARTS:  # its result tuple repeats its operands
            written = max(0, written - read)
        call = self._library_call(inst, [self.shape(o) for o in inst.operands[:2]])
        return Kernel(inst.name, inst.op, read + written, count, *(call or ()))

    @staticmethod
    def _library_call(inst: Instruction, shapes: list[Array | None]
                      ) -> tuple[int, str, tuple[str, ...], bool] | None:
        """(FLOPs, kind, operand types, full f32) of a cuBLAS GEMM or cuDNN convolution
        call whose two matrix operands have ``shapes``; None for any other instruction."""
        if inst.op != "custom-call" or None in shapes or len(shapes) != 2:
            return None
        target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        target = target.group(1) if target else ""
        types = tuple(s.dtype for s in shapes)
        if target.startswith("__cublas$"):
            config = inst.backend_config().get("gemm_backend_config", {})
            precision = config.get("precision_config", {})
            full = ("HIGHEST" in precision.get("operand_precision", [])
                    or precision.get("algorithm") == "ALG_DOT_F32_F32_F32")
            flops = _gemm_flops(shapes[0], shapes[1], config.get("dot_dimension_numbers", {}))
            return flops, "GEMM fp8" if target.endswith("$f8") else "GEMM", types, full
        if target.startswith("__cudnn$conv"):
            return _conv_flops(inst, shapes, target), "conv", types, False
        if target.startswith("__cudnn$fmha"):
            return _attention_flops(inst, shapes[0], target), "attention", types, False
        return None

    def _fusion(self, inst: Instruction, count: int) -> Kernel:
        body = self.computations.get(inst.attr("calls") or "", [])
        params = {int(i.args): i for i in body if i.op == "parameter" and i.args.isdigit()}
        users: dict[str, list[tuple[Instruction, int]]] = {}
        for i in body:
            for position, operand in enumerate(i.operands):
                users.setdefault(operand, []).append((i, position))
        in_place: set[str] = set()
        written = 0
        root = next((i for i in body if i.root), None)
        outputs = ([self._def_in(body, o) for o in root.operands] if root and root.op == "tuple"
                   else [root])
        for output in outputs:
            if output is None:
                continue
            update = self._in_place_update(body, output)
            if update is not None:
                written += update[0]
                in_place.add(update[1])
            else:  # a library call's workspace (XLA 0.12's dynamic-slice fusions) is not
                written += sum(a.bytes for i, a in enumerate(output.arrays)
                               if not _is_workspace(a, i))
        read, seen = 0, set()
        for position, operand in enumerate(inst.operands):
            full = self.size(operand)
            if full is None or operand in seen:  # an operand passed twice is read once
                continue
            seen.add(operand)
            param = params.get(position)
            read += full if param is None else min(full, self._read_bytes(param, users, in_place))
        flops, matrix, types, full, passes = self._fused_matrix_ops(body)
        return Kernel(inst.name, inst.op, read + written, count, flops, matrix, types, full,
                      passes)

    @staticmethod
    def _def_in(body: list[Instruction], name: str) -> Instruction | None:
        return next((i for i in body if i.name == name), None)

    def _in_place_update(self, body: list[Instruction], output: Instruction
                         ) -> tuple[int, str] | None:
        """(update bytes, buffer parameter's name) if ``output`` is a dynamic-update-slice
        (through bitcasts) into a fusion parameter: XLA writes it in place."""
        while output is not None and output.op == "bitcast":
            output = self._def_in(body, output.operands[0])
        if output is None or output.op != "dynamic-update-slice" or len(output.operands) < 2:
            return None
        buffer = self._def_in(body, output.operands[0])
        while buffer is not None and buffer.op == "bitcast":
            buffer = self._def_in(body, buffer.operands[0])
        update = self._def_in(body, output.operands[1])
        if buffer is None or buffer.op != "parameter" or update is None:
            return None
        return update.bytes, buffer.name

    def _read_bytes(self, value: Instruction, users: dict, in_place: set[str]) -> int:
        """Bytes a fusion reads of ``value``: the slices taken if it is only sliced, none
        if it is only the buffer of an in-place update, else all of it."""
        uses = users.get(value.name, [])
        if not uses:
            return 0
        if value.name in in_place and all(u.op in ("dynamic-update-slice", "bitcast")
                                          for u, _ in uses):
            return 0
        if all(u.op in ("dynamic-slice", "slice", "gather") and pos == 0 for u, pos in uses):
            return sum(u.bytes for u, _ in uses)
        if all(u.op == "bitcast" for u, _ in uses):
            return sum(self._read_bytes(u, users, in_place | ({u.name} if value.name in in_place
                                                              else set()))
                       for u, _ in uses)
        return value.bytes

    def _fused_matrix_ops(self, body: list[Instruction], depth: int = 0
                          ) -> tuple[int, str | None, tuple[str, ...], bool, int]:
        """FLOPs, kind, operand types, full-f32-ness and XLA:TPU passes (``Kernel``) of
        the dots/convolutions inside a fusion (Triton's, XLA:TPU's), and of the library
        calls in one (XLA 0.12's dynamic-slice fusions wrap a cuBLAS GEMM and the slicing
        of its operands)."""
        flops, kind, types, full, passes = 0, None, (), False, 1
        local = {i.name: i for i in body}
        for i in body:
            if i.op == "fusion" and depth < 4:
                inner = self._fused_matrix_ops(
                    self.computations.get(i.attr("calls") or "", []), depth + 1)
                flops += inner[0]
                kind, types, full = kind or inner[1], types or inner[2], full or inner[3]
                passes = max(passes, inner[4])
            if i.op not in ("dot", "convolution", "custom-call") or len(i.operands) < 2:
                continue
            shapes = [local[o].arrays[0] if o in local and local[o].arrays else self.shape(o)
                      for o in i.operands[:2]]
            if None in shapes:
                continue
            call = self._library_call(i, shapes)
            if call is not None:
                flops += call[0]
                kind, types, full = kind or call[1], types or call[2], full or call[3]
                continue
            if i.op == "custom-call":
                continue
            if i.op == "dot":
                flops += _gemm_flops(shapes[0], shapes[1], _dot_dims(i.attrs))
                kind = kind or "GEMM"
            else:
                flops += _hlo_conv_flops(i, shapes)
                kind = kind or "conv"
            types = types or tuple(s.dtype for s in shapes)
            # XLA:TPU computes the dot at its operands' highest precision (libtpu's LLO:
            # {default,highest} runs as HIGH does).
            precision = re.search(r"operand_precision=\{([\w,]+)\}", i.attrs)
            if precision and all(s.dtype == "f32" for s in shapes):
                named = precision.group(1).lower().split(",")
                passes = max(passes, _F32_PASSES["high"] if len(set(named)) > 1 and any(
                    p in _F32_PASSES for p in named) else _F32_PASSES.get(named[0], 1))
        return flops, kind, types, full, passes


def estimate(hlo_text: str, target: Any = "h100") -> Estimate:
    """The model's figures for XLA:GPU's optimized HLO of one step compiled for ``target``
    (a name for ``targets.device_target`` or a ``Target`` with peaks and bandwidth; its
    ``devices`` and ``link_bytes_per_second`` price the collectives)."""
    from hlo_amp.targets import device_target

    device = device_target(target)
    if not device.peak_flops or not device.hbm_bytes_per_second:
        raise ValueError(f"target {device.name!r} has no published peaks or HBM bandwidth")
    computations, entry = parse_module(hlo_text)
    walker = _Walker(computations)
    kernels: list[Kernel] = []
    walker.walk(entry, 1, kernels)
    calls: Counter = Counter()
    for k in kernels:
        if k.matrix:
            calls[(k.matrix, k.dtype_label)] += k.count
    return Estimate(kernels, device.device, device.hbm_bytes_per_second,
                    dict(device.peak_flops), walker.unknown_trip_counts, calls,
                    read_collectives(hlo_text), device.devices, device.link_bytes_per_second)
