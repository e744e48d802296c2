"""What XLA:CPU runs fast: the layout and hardware facts behind bf16 dot speed; and, at
the end, the form a matrix op takes per target (CPU, GPU, TPU).

Shared by the fast-dot-layout pass (which relays dots into the fast form), the
insert-converts pass (whose ``only_if_faster`` option leaves a dot in f32 when the
CPU cannot run it faster in bf16) and the propagate pass. Findings and measurements:
benchmarks/DOT_LAYOUT.md, docs/gpu_target.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from hlo_amp.modules import element_type

# YNNPACK skips dots whose largest extent is below this (its overhead dominates).
_YNN_MIN_EXTENT = 8
# How far `_maybe_permuted` follows layout-preserving producers before giving up.
_MAX_PROVENANCE_DEPTH = 16
# Ops whose results XLA lays out on their own terms, whatever their operands.
_OPAQUE_PRODUCERS = (
    "stablehlo.custom_call",
    "stablehlo.while",
    "stablehlo.case",
    "stablehlo.if",
    "func.call",
    "call",
)


@dataclass(frozen=True)
class DotLayout:
    """The shape facts about one dot_general that decide XLA:CPU's dot path."""

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]

    @functools.cached_property
    def lhs_free(self) -> tuple[int, ...]:
        """lhs dimensions that are neither batch nor contracting, in order."""
        used = set(self.lhs_batch) | set(self.lhs_contracting)
        return tuple(d for d in range(len(self.lhs_shape)) if d not in used)

    @functools.cached_property
    def rhs_free(self) -> tuple[int, ...]:
        """rhs dimensions that are neither batch nor contracting, in order."""
        used = set(self.rhs_batch) | set(self.rhs_contracting)
        return tuple(d for d in range(len(self.rhs_shape)) if d not in used)

    @functools.cached_property
    def mkn(self) -> tuple[int, int, int]:
        """(m, k, n) of the matrix product per batch element."""
        m = math.prod(self.lhs_shape[d] for d in self.lhs_free)
        k = math.prod(self.lhs_shape[d] for d in self.lhs_contracting)
        n = math.prod(self.rhs_shape[d] for d in self.rhs_free)
        return m, k, n

    def decomposer_canonical(self) -> bool:
        """True when XLA's DotDecomposer leaves the dot as written."""

        def canonical(rank: int, batch: tuple[int, ...], contracting: tuple[int, ...]) -> bool:
            return (
                len(contracting) == 1
                and rank <= len(batch) + 2
                and batch == tuple(range(len(batch)))
            )

        return canonical(len(self.lhs_shape), self.lhs_batch, self.lhs_contracting) and canonical(
            len(self.rhs_shape), self.rhs_batch, self.rhs_contracting
        )

    def lhs_permutation(self) -> tuple[int, ...]:
        """lhs order YNNPACK takes: batch (paired order), free (kept order), contracting."""
        return self.lhs_batch + self.lhs_free + self.lhs_contracting

    def rhs_permutation(self) -> tuple[int, ...]:
        """rhs order of the NT form: batch (paired order), free (kept order), contracting
        (in the order that pairs with the lhs)."""
        return self.rhs_batch + self.rhs_free + self.rhs_contracting

    def is_nt(self) -> bool:
        """True when the dot reads [batch, m, k] x [batch, n, k] with one free and one
        contracting dimension per operand, the form DotDecomposer leaves alone."""
        single = (
            len(self.lhs_free) == 1 and len(self.rhs_free) == 1 and len(self.lhs_contracting) == 1
        )
        return (
            single
            and self.lhs_permutation() == tuple(range(len(self.lhs_shape)))
            and self.rhs_permutation() == tuple(range(len(self.rhs_shape)))
        )

    def nt_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(lhs, rhs, result) shapes of the NT form: [batch, m, k] x [batch, n, k] -> [batch, m, n]."""
        batch = tuple(self.lhs_shape[d] for d in self.lhs_batch)
        m, k, n = self.mkn
        return batch + (m, k), batch + (n, k), batch + (m, n)


def dot_layout(op: hlo.DotGeneralOp) -> DotLayout | None:
    """The layout facts of `op`, or None when an operand is not a static ranked tensor."""
    shapes = []
    for value in op.operands[:2]:
        ttype = value.type
        if not isinstance(ttype, ir.RankedTensorType):
            return None
        shape = tuple(ttype.shape)
        if shape and min(shape) < 0:  # a dynamic dimension (ShapedType's kDynamic)
            return None
        shapes.append(shape)
    dims = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    return DotLayout(
        lhs_shape=shapes[0],
        rhs_shape=shapes[1],
        lhs_batch=tuple(dims.lhs_batching_dimensions),
        rhs_batch=tuple(dims.rhs_batching_dimensions),
        lhs_contracting=tuple(dims.lhs_contracting_dimensions),
        rhs_contracting=tuple(dims.rhs_contracting_dimensions),
    )


def meets_ynn_size(layout: DotLayout) -> bool:
    """YNNPACK's size rules: a real contraction, no matrix-vector products, not tiny."""
    if not layout.lhs_contracting:
        return False
    if 0 in layout.lhs_shape or 0 in layout.rhs_shape:
        return False
    m, k, n = layout.mkn
    return m > 1 and n > 1 and max(m, k, n) >= _YNN_MIN_EXTENT


# What `_provenance` says of a value: (answer, last), where `answer` is what
# `_maybe_permuted` returns for it when the depth limit is not reached, and `last` is
# how many producer steps from the value the depth limit is last checked (-1: never).
_Provenance = tuple[bool, int]
_ROW_MAJOR: _Provenance = (False, -1)


def _provenance(value: ir.Value, memo: dict[ir.Value, _Provenance] | None = None) -> _Provenance:
    """Follow the layout-preserving producers of `value` (see :func:`_maybe_permuted`).

    Iterative. Without `memo` the walk stops once the depth limit is passed. With it, the
    chain is followed to its end and every value on it is recorded, so each value of a
    module is looked at once however many dots reach it. A memo is only valid while the
    module is not changed: values are keyed by identity, and an erased op's values may
    share it with new ones.
    """
    chain: list[ir.Value] = []
    # Calls being looked through (XLA inlines them, so a layout flows through a call):
    # inside a callee, a value's answer depends on the call site, so it is not memoised.
    calls: list[ir.Operation] = []
    context_free = 0  # how many of chain's first values are memoisable
    found: _Provenance
    while True:
        if not calls:
            context_free = len(chain)
        if memo is not None and not calls:
            hit = memo.get(value)
            if hit is not None:
                found = hit
                break
        ttype = value.type
        if isinstance(value, ir.BlockArgument) and calls and _is_entry_argument(value):
            call = calls.pop()  # back out of the callee to the call site's operand
            chain.append(value)
            value = call.operands[ir.BlockArgument(value).arg_number]
            continue
        if (
            not isinstance(ttype, ir.RankedTensorType)
            or ttype.rank <= 1
            or isinstance(value, ir.BlockArgument)
        ):
            found = _ROW_MAJOR
            break
        if memo is None and len(chain) > _MAX_PROVENANCE_DEPTH:
            found = (True, 0)  # past the limit whatever follows
            break
        owner = value.owner.operation
        name = owner.name
        following = None
        if name == "stablehlo.transpose":
            perm = list(ir.DenseI64ArrayAttr(owner.attributes["permutation"]))
            if perm != sorted(perm):
                found = (True, 0)
                break
            following = owner.operands[0]
        elif name == "stablehlo.optimization_barrier":
            following = owner.operands[ir.OpResult(value).result_number]
        elif name == "func.call" and (returned := _returned_value(owner, value)) is not None:
            calls.append(owner)
            following = returned
        elif name not in _OPAQUE_PRODUCERS:
            for operand in owner.operands:
                otype = operand.type
                if (isinstance(otype, ir.RankedTensorType) and otype.rank != 0
                        and not _takes_any_layout(operand)):
                    if following is not None:  # two or more tensors: row-major
                        following = None
                        break
                    following = operand
        if following is None:
            found = (False, 0)
            break
        chain.append(value)
        value = following
    answer, last = found
    if memo is not None:
        if hit is None and not calls:
            memo[value] = found
        for index in reversed(range(len(chain))):
            last += 1
            if index < context_free:
                memo[chain[index]] = (answer, last)
    else:
        last += len(chain)
    return answer, last


def _is_entry_argument(value: ir.Value) -> bool:
    """Whether ``value`` is an argument of a function's body (not of a loop body)."""
    parent = ir.BlockArgument(value).owner.owner  # an op view: its .name may be a symbol
    return parent is not None and parent.operation.name == "func.func"


def _returned_value(call: ir.Operation, result: ir.Value) -> ir.Value | None:
    """The value the callee of ``call`` returns for ``result``, or None if not found."""
    module = call.parent
    while module is not None and module.operation.name != "builtin.module":
        module = module.parent
    if module is None:
        return None
    callee_name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
    try:
        callee = ir.SymbolTable(module)[callee_name]
    except KeyError:
        return None
    blocks = callee.regions[0].blocks
    if len(blocks) != 1:
        return None
    terminator = list(blocks[0].operations)[-1]
    return terminator.operands[ir.OpResult(result).result_number]


_ANY_LAYOUT_PRODUCERS = frozenset({
    "stablehlo.broadcast_in_dim", "stablehlo.constant", "stablehlo.iota"})


def _takes_any_layout(value: ir.Value) -> bool:
    """Whether XLA lays ``value`` out to suit its consumer: a broadcast (a bias, a ReLU's
    zero) beside a transposed activation leaves the activation's layout in charge, so
    ``add(transpose(dot), broadcast(bias))`` keeps the transpose's permuted layout (in
    the mixed_* modes through bf16 bias adds and ReLUs into the next bf16 dot)."""
    return (not isinstance(value, ir.BlockArgument)
            and value.owner.operation.name in _ANY_LAYOUT_PRODUCERS)


def _maybe_permuted(
    value: ir.Value, depth: int = 0, memo: dict[ir.Value, _Provenance] | None = None
) -> bool:
    """True when XLA's import may give `value` a non-row-major layout.

    The import lays a transpose out so that it is a bitcast, and unary ops, converts,
    broadcasts, slices, pads, reductions and reshapes that can stay bitcasts pass that
    layout on, and so do binary ops whose other operands are broadcasts or constants
    (a bias add, a ReLU). Ops with two or more other tensor operands (binary arithmetic,
    select, concatenate, dot_general), reshapes to 1-D, block arguments, constants and opaque
    producers start from row-major. Deep chains count as permuted (conservative).
    `memo` (see :func:`_provenance`) shares the walk between calls on an unchanged module.
    """
    answer, last = _provenance(value, memo)
    return answer or depth + last > _MAX_PROVENANCE_DEPTH


def _operands_need_fresh_layout(
    op: hlo.DotGeneralOp, memo: dict[ir.Value, _Provenance] | None = None
) -> tuple[bool, bool]:
    lhs, rhs = op.operands[:2]
    return _maybe_permuted(lhs, memo=memo), _maybe_permuted(rhs, memo=memo)


def _fast_as_written(layout: DotLayout, fresh: tuple[bool, bool]) -> bool:
    """`layout_is_fast` for a dot of YNNPACK's sizes, given its operands' fresh flags."""
    if any(fresh):
        return False
    if not layout.decomposer_canonical():
        # DotDecomposer transposes the operands into [batch, m, k] x [batch, k, n].
        return True
    lhs_rank = len(layout.lhs_shape)
    return layout.lhs_contracting == (lhs_rank - 1,)


def _sized_layout(op: hlo.DotGeneralOp, layout: DotLayout | None,
                  fresh: tuple[bool, bool] | None) -> tuple[DotLayout, tuple[bool, bool]] | None:
    """(layout, fresh) of a dot of YNNPACK's sizes, computing what was not given; None
    for other dots."""
    if layout is None:
        layout = dot_layout(op)
    if layout is None or not meets_ynn_size(layout):
        return None
    return layout, _operands_need_fresh_layout(op) if fresh is None else fresh


def layout_is_fast(
    op: hlo.DotGeneralOp,
    *,
    layout: DotLayout | None = None,
    fresh: tuple[bool, bool] | None = None,
) -> bool:
    """True when XLA:CPU hands `op`, as written, to YNNPACK if its operands are bf16.

    A statement about dimensions and layouts only: element types are not looked at, so
    a rule can ask it of an f32 dot before deciding to convert it. `layout` (from
    :func:`dot_layout`) and `fresh` (from :func:`_operands_need_fresh_layout`) may be
    passed when the caller already has them.
    """
    known = _sized_layout(op, layout, fresh)
    return known is not None and _fast_as_written(*known)


_FOLLOWED_TO_A_TRANSPOSE = frozenset({"stablehlo.reshape", "stablehlo.convert"})


def has_transposed_result(op: hlo.DotGeneralOp) -> bool:
    """True when the result of `op` reaches a stablehlo.transpose, directly or through
    reshapes and converts (in the mixed_* modes a CPU dot's f32 result is converted to
    the 16-bit type before the region's transpose; XLA folds both into the dot).

    XLA's algebraic simplifier folds such a transpose into the dot by swapping its
    operands *after* the bf16-or-f32 decision: a bf16 dot in [m, k] x [k, n] (NN) form
    becomes [k, n] x [m, k], which YNNPACK refuses, and the executable then fails at run
    time with ``UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x
    BF16 = F32`` (jaxlib 0.10.2). The NT form ([m, k] x [n, k]) survives the swap.
    """
    pending = [op.result]
    seen = 0
    while pending and seen < _MAX_PROVENANCE_DEPTH:
        value = pending.pop()
        seen += 1
        for use in value.uses:
            user = use.owner.operation
            name = user.name
            if name == "stablehlo.transpose":
                return True
            if name in _FOLLOWED_TO_A_TRANSPOSE:
                pending.append(user.result)
    return False


def needs_layout_rewrite(
    op: hlo.DotGeneralOp,
    *,
    layout: DotLayout | None = None,
    fresh: tuple[bool, bool] | None = None,
) -> bool:
    """True when FastDotLayout rewrites `op` (element types aside).

    That is a dot of YNNPACK's sizes that YNNPACK would not take as written, or one
    whose transposed result would make XLA:CPU fail (see :func:`has_transposed_result`),
    unless it already is in the NT form. `layout` and `fresh` as for
    :func:`layout_is_fast`.
    """
    known = _sized_layout(op, layout, fresh)
    if known is None:
        return False
    if not _fast_as_written(*known):
        return True
    return not known[0].is_nt() and has_transposed_result(op)


@functools.cache
def native_bf16_flags() -> tuple[str, ...]:
    """Which of ``avx512_bf16`` / ``amx_bf16`` this host's /proc/cpuinfo flags list
    (empty where the file is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return tuple(f for f in ("avx512_bf16", "amx_bf16") if f in flags)
    return ()


def cpu_has_native_bf16() -> bool:
    """True when this host's CPU has bf16 dot instructions (AVX512-BF16 or AMX-BF16).

    Without them YNNPACK emulates bf16 and its bf16 dots run at 0.5-0.9x of f32 (see
    benchmarks/DOT_LAYOUT.md).
    """
    return bool(native_bf16_flags())


def is_fast_on_cpu(
    op: hlo.DotGeneralOp,
    *,
    native_bf16: bool | None = None,
    with_layout_pass: bool = True,
) -> bool:
    """True when XLA:CPU should run `op` faster as bf16×bf16→f32 than as f32.

    Needs a CPU with native bf16 dot instructions (`native_bf16`; None asks
    :func:`cpu_has_native_bf16`) and a dot YNNPACK takes: any dot of YNNPACK's sizes once
    FastDotLayout has run (`with_layout_pass`), else only one whose layout is already
    fast. Element types of `op` are not looked at.
    """
    if native_bf16 is None:
        native_bf16 = cpu_has_native_bf16()
    if not native_bf16:
        return False
    layout = dot_layout(op)
    if layout is None or not meets_ynn_size(layout):
        return False
    return with_layout_pass or layout_is_fast(op, layout=layout)


def _is_bf16_to_f32(op: hlo.DotGeneralOp) -> bool:
    lhs, rhs = op.operands
    return (
        isinstance(element_type(lhs), ir.BF16Type)
        and isinstance(element_type(rhs), ir.BF16Type)
        and isinstance(element_type(op.result), ir.F32Type)
    )


def matrix_result_in_16bit(target: str | None) -> bool:
    """Whether a matrix op inside a 16-bit region should return the 16-bit type itself.

    On GPU and TPU (``target`` None, ``"gpu"`` or ``"tpu"``) yes: XLA:GPU and XLA:TPU
    accumulate 16-bit matrix ops in f32, and on GPU a separate ``convert`` of a GEMM
    result is not fused into the cuBLAS epilogue.
    On CPU no: XLA:CPU upcasts every 16-bit-result dot to f32 (slower than f32 alone),
    so the dot keeps its f32 result and a ``convert`` follows it.
    """
    return target != "cpu"


def low_result_on_target(kind: str, target: str | None) -> bool:
    """Whether ``target`` runs this op kind in 16 bit only with a 16-bit result.

    GPU: cuDNN runs same-type 16-bit convolutions only (bf16→bf16, f16→f16, accumulating
    in f32 inside), and XLA:GPU upcasts ``convolution(bf16, bf16) -> f32`` to f32×f32; so
    there a convolution produces the 16-bit type and a convert follows it. cuBLASLt has
    bf16×bf16→f32 GEMMs: dots keep the f32 result. TPU keeps bf16×bf16→f32 dots and
    convolutions (docs/gpu_target.md). CPU: the forms above.
    """
    return target == "gpu" and kind == "convolution"


def deny_pins_its_inputs(target: str | None) -> bool:
    """Whether, in the mixed modes, an f32-only (deny) op keeps the value it reads f32.

    GPU and TPU: no; deny ops convert their own 16-bit inputs (TensorFlow's AMP and
    PyTorch autocast), so a residual stream or an activation gradient that a layer
    norm's mean or a bias gradient's sum also reads is stored in 16 bit.
    CPU: yes. XLA:CPU computes 16-bit elementwise ops in f32, so a 16-bit value saves
    storage only, and where f32 ops read it too its fusions materialise f32 copies
    (a softmax's broadcast 1/sum, an average pool's padded gradient): with deny ops
    converting their own inputs the ViT step's temp memory was 2139 MB against 1876 MB
    (benchmarks/RESULTS.md, CPU section).
    """
    return target == "cpu"


def sums_read_a_16bit_copy(target: str | None) -> bool:
    """Whether, in the mixed modes, sums that read an f32 value which matrix ops read in
    16 bit (the logits gradient: the head's GEMMs and its bias gradient) read the 16-bit
    copy, behind an ``optimization_barrier``.

    GPU: yes. XLA:GPU folds the sum's round trip (f32 -> 16 -> f32) back into a read of
    the f32 value (``SimplifyFPConversions``), so it writes the value in f32 for the sum
    and in 16 bit for the GEMMs: on the decoder's step 128 MiB more at the peak and
    1.813 against 1.753 ms of roofline (benchmarks/RESULTS.md).
    TPU: no. XLA:TPU fuses the convert into the matrix op's operand fusion; the barrier
    makes it write the copy (decoder: 23.25 -> 25.98 ms, temp 328.6 -> 404.5 MiB).
    CPU: no such value (``deny_pins_its_inputs``). None (no target facts): no.
    """
    return target == "gpu"
