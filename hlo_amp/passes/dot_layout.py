"""Put bf16×bf16→f32 dot_generals in the layout XLA:CPU sends to YNNPACK.

XLA:CPU (jaxlib 0.10.2) runs a bf16×bf16→f32 dot in bf16 only when YNNPACK takes it;
otherwise ``OperandUpcaster`` converts both operands back to f32 and Eigen runs an f32
dot. The choice is made right after import, on the layouts the StableHLO→HLO import
infers, and YNNPACK takes a dot only when (after ``DotDecomposer``):

* the lhs holds its single contracting dimension minor-most (``[batch..., m, k]``),
* every operand has a row-major (descending) layout,
* m > 1, n > 1 and max(m, k, n) >= 8.

``DotDecomposer`` fixes dots it considers non-canonical (several contracting or free
dimensions, batch dimensions not leading), but it leaves a rank-2 (after batch) lhs in
``[k, m]`` order alone: the weight-gradient dot ``x^T @ dy`` (``contracting_dims =
[0] x [0]``) and attention's ``bhqk,bhqd->bhkd`` fall off the fast path. So does any
operand that comes, through layout-preserving ops such as ``convert``, from a
``stablehlo.transpose``: the import gives a transpose the permuted layout that makes it
a bitcast.

The rewrite puts both operands in the NT form, ``[batch, m, k] x [batch, n, k]``, and
gives each permuted (or transposed-layout) operand a fresh row-major layout that XLA
cannot fold away::

    transpose -> reshape to 1-D -> optimization_barrier -> reshape back

(a plain transpose is folded back into the dimension numbers; a transpose behind a
barrier keeps its bitcast layout; a reshape to the same shape is folded away). NT rather
than NN because XLA absorbs a transpose of a dot's result by swapping its operands after
the bf16 decision: a swapped NN bf16 dot leaves YNNPACK's path and the executable fails
at run time (see :func:`has_transposed_result`); a swapped NT dot is still NT. So the
pass also relays NN dots whose result is transposed.

The dot keeps its result type, location and precision: only the layout of its operands
changes, so the products and the f32 accumulation are the same and the result differs
from XLA's upcast-to-f32 kernel only by summation order. See
``benchmarks/DOT_LAYOUT.md``: on CPUs without native bf16 arithmetic (no AVX512-BF16 or
AMX-BF16) YNNPACK's bf16 dots are *slower* than f32 ones in every layout, so convert a
dot to bf16 for speed only where :func:`is_fast_on_cpu` says so.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

__all__ = [
    "DotLayout",
    "FastDotLayout",
    "cpu_has_native_bf16",
    "dot_layout",
    "has_transposed_result",
    "is_fast_on_cpu",
    "layout_is_fast",
    "meets_ynn_size",
    "needs_layout_rewrite",
]

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

    @property
    def lhs_free(self) -> tuple[int, ...]:
        """lhs dimensions that are neither batch nor contracting, in order."""
        used = set(self.lhs_batch) | set(self.lhs_contracting)
        return tuple(d for d in range(len(self.lhs_shape)) if d not in used)

    @property
    def rhs_free(self) -> tuple[int, ...]:
        """rhs dimensions that are neither batch nor contracting, in order."""
        used = set(self.rhs_batch) | set(self.rhs_contracting)
        return tuple(d for d in range(len(self.rhs_shape)) if d not in used)

    @property
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
    for value in (op.operands[0], op.operands[1]):
        if not isinstance(value.type, ir.RankedTensorType):
            return None
        ttype = ir.RankedTensorType(value.type)
        if not ttype.has_static_shape:
            return None
        shapes.append(tuple(ttype.shape))
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


def _is_scalar(value: ir.Value) -> bool:
    return isinstance(value.type, ir.RankedTensorType) and ir.RankedTensorType(value.type).rank == 0


def _rank(value: ir.Value) -> int | None:
    if not isinstance(value.type, ir.RankedTensorType):
        return None
    return ir.RankedTensorType(value.type).rank


def _maybe_permuted(value: ir.Value, depth: int = 0) -> bool:
    """True when XLA's import may give `value` a non-row-major layout.

    The import lays a transpose out so that it is a bitcast, and unary ops, converts,
    broadcasts, slices, pads, reductions and reshapes that can stay bitcasts pass that
    layout on. Ops with two or more tensor operands (binary arithmetic, select,
    concatenate, dot_general), reshapes to 1-D, block arguments, constants and opaque
    producers start from row-major. Deep chains count as permuted (conservative).
    """
    rank = _rank(value)
    if rank is None or rank <= 1:
        return False
    if isinstance(value, ir.BlockArgument):
        return False
    if depth > _MAX_PROVENANCE_DEPTH:
        return True
    owner = ir.OpResult(value).owner
    owner = owner.opview if hasattr(owner, "opview") else owner
    if isinstance(owner, hlo.TransposeOp):
        perm = list(ir.DenseI64ArrayAttr(owner.attributes["permutation"]))
        return perm != sorted(perm) or _maybe_permuted(owner.operands[0], depth + 1)
    if isinstance(owner, hlo.OptimizationBarrierOp):
        index = ir.OpResult(value).result_number
        return _maybe_permuted(owner.operands[index], depth + 1)
    if owner.operation.name in _OPAQUE_PRODUCERS:
        return False
    tensors = [v for v in owner.operands if _rank(v) is not None and not _is_scalar(v)]
    if len(tensors) != 1:
        return False
    return _maybe_permuted(tensors[0], depth + 1)


def _operands_need_fresh_layout(op: hlo.DotGeneralOp) -> tuple[bool, bool]:
    return _maybe_permuted(op.operands[0]), _maybe_permuted(op.operands[1])


def layout_is_fast(op: hlo.DotGeneralOp) -> bool:
    """True when XLA:CPU hands `op`, as written, to YNNPACK if its operands are bf16.

    A statement about dimensions and layouts only: element types are not looked at, so
    a rule can ask it of an f32 dot before deciding to convert it.
    """
    layout = dot_layout(op)
    if layout is None or not meets_ynn_size(layout):
        return False
    if any(_operands_need_fresh_layout(op)):
        return False
    if not layout.decomposer_canonical():
        # DotDecomposer transposes the operands into [batch, m, k] x [batch, k, n].
        return True
    lhs_rank = len(layout.lhs_shape)
    return layout.lhs_contracting == (lhs_rank - 1,)


def has_transposed_result(op: hlo.DotGeneralOp) -> bool:
    """True when the result of `op` reaches a stablehlo.transpose, directly or through
    reshapes.

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
            user = use.owner
            user = user.opview if hasattr(user, "opview") else user
            if isinstance(user, hlo.TransposeOp):
                return True
            if isinstance(user, hlo.ReshapeOp):
                pending.append(user.result)
    return False


def needs_layout_rewrite(op: hlo.DotGeneralOp) -> bool:
    """True when FastDotLayout rewrites `op` (element types aside).

    That is a dot of YNNPACK's sizes that YNNPACK would not take as written, or one
    whose transposed result would make XLA:CPU fail (see :func:`has_transposed_result`),
    unless it already is in the NT form.
    """
    layout = dot_layout(op)
    if layout is None or not meets_ynn_size(layout):
        return False
    if not layout_is_fast(op):
        return True
    return not layout.is_nt() and has_transposed_result(op)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this host's CPU has bf16 dot instructions (AVX512-BF16 or AMX-BF16).

    Without them YNNPACK emulates bf16 and its bf16 dots run at 0.5-0.9x of f32 (see
    benchmarks/DOT_LAYOUT.md). Reads /proc/cpuinfo; False where that is missing.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


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
    return with_layout_pass or layout_is_fast(op)


def _element_type(value: ir.Value) -> ir.Type | None:
    if not isinstance(value.type, ir.RankedTensorType):
        return None
    return ir.RankedTensorType(value.type).element_type


def _is_bf16_to_f32(op: hlo.DotGeneralOp) -> bool:
    lhs, rhs = (_element_type(v) for v in op.operands)
    out = _element_type(op.result)
    return (
        isinstance(lhs, ir.BF16Type)
        and isinstance(rhs, ir.BF16Type)
        and isinstance(out, ir.F32Type)
    )


def _walk_ops(operation: ir.Operation) -> Iterator[ir.OpView]:
    """Every op nested in `operation`, in program order."""
    for region in operation.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child
                yield from _walk_ops(child.operation)


@dataclass(frozen=True)
class FastDotLayout:
    """Relay bf16×bf16→f32 dot_generals into the NT form XLA:CPU runs in bf16.

    The NT form is lhs ``[batch, m, k]`` x rhs ``[batch, n, k]``, both row-major; it is
    on YNNPACK's path and stays there when XLA swaps the operands to absorb a transpose
    of the result. Only dots that :func:`needs_layout_rewrite` flags are touched: dots
    XLA would upcast to f32 for their layout, and NN dots whose transposed result would
    crash XLA:CPU. Dots of other element types, dots YNNPACK refuses for their sizes and
    dots already fast and safe are left alone. One relaid operand is shared by every dot
    in a block that needs the same permutation of the same value.
    """

    name: str = "hlo-amp-fast-dot-layout"

    def run(self, module: ir.Module, report: Any = None) -> None:
        """Rewrite `module` in place."""
        dots = [
            op
            for op in _walk_ops(module.operation)
            if isinstance(op, hlo.DotGeneralOp) and _is_bf16_to_f32(op) and needs_layout_rewrite(op)
        ]
        shared: dict[tuple[Any, ...], ir.Value] = {}
        for op in dots:
            self._rewrite(op, shared, report)

    def _rewrite(
        self, op: hlo.DotGeneralOp, shared: dict[tuple[Any, ...], ir.Value], report: Any
    ) -> None:
        layout = dot_layout(op)
        assert layout is not None
        fresh = _operands_need_fresh_layout(op)
        perms = (layout.lhs_permutation(), layout.rhs_permutation())
        lhs_shape, rhs_shape, out_shape = layout.nt_shapes()
        nb = len(layout.lhs_batch)
        block = op.operation.block
        location = op.location
        notes = []
        with op.location, ir.InsertionPoint(op):
            operands = []
            for side, value, perm, shape, needs_fresh in zip(
                ("lhs", "rhs"), op.operands, perms, (lhs_shape, rhs_shape), fresh
            ):
                operands.append(self._nt_operand(value, perm, shape, needs_fresh, block, shared))
                if operands[-1] != value:
                    notes.append(f"{side} {list(perm)} -> {list(shape)}")
            dims = hlo.DotDimensionNumbers.get(
                lhs_batching_dimensions=list(range(nb)),
                rhs_batching_dimensions=list(range(nb)),
                lhs_contracting_dimensions=[nb + 1],
                rhs_contracting_dimensions=[nb + 1],
            )
            result_type = ir.RankedTensorType(op.result.type)
            if tuple(result_type.shape) == out_shape:
                op.operands[0], op.operands[1] = operands
                op.attributes["dot_dimension_numbers"] = dims
            else:
                extra = {
                    name: op.attributes[name]
                    for name in ("precision_config", "algorithm")
                    if name in op.attributes
                }
                new = hlo.DotGeneralOp(
                    ir.RankedTensorType.get(out_shape, result_type.element_type),
                    operands[0],
                    operands[1],
                    dims,
                    **extra,
                )
                restored = hlo.reshape(result_type, new.result)
                op.result.replace_all_uses_with(restored)
                op.operation.erase()
                notes.append(f"result {list(out_shape)} -> {list(result_type.shape)}")
        if report is not None and hasattr(report, "note"):
            report.note(
                str(location),
                "dot relaid to the NT form [batch, m, k] x [batch, n, k] for XLA:CPU's bf16 path ("
                + "; ".join(notes)
                + ")",
            )

    @staticmethod
    def _nt_operand(
        value: ir.Value,
        perm: tuple[int, ...],
        shape: tuple[int, ...],
        needs_fresh: bool,
        block: ir.Block,
        shared: dict[tuple[Any, ...], ir.Value],
    ) -> ir.Value:
        """`value` permuted by `perm` and collapsed to `shape` ([batch, free, contracting]).

        A permuted or transposed-layout operand goes through transpose, reshape to 1-D,
        optimization_barrier, reshape: a row-major copy XLA cannot fold back. An operand
        that is only collapsed gets a plain reshape (a bitcast); one already in shape is
        returned as is.
        """
        ttype = ir.RankedTensorType(value.type)
        identity = perm == tuple(range(len(perm)))
        if identity and not needs_fresh:
            if tuple(ttype.shape) == shape:
                return value
            return hlo.reshape(ir.RankedTensorType.get(shape, ttype.element_type), value)
        key = (block, value, perm, shape)
        if key in shared:
            return shared[key]
        current = value if identity else hlo.transpose(value, list(perm))
        flat = ir.RankedTensorType.get([math.prod(shape)], ttype.element_type)
        current = hlo.reshape(flat, current)
        current = hlo.optimization_barrier([current])
        if not isinstance(current, ir.Value):
            current = current[0]
        current = hlo.reshape(ir.RankedTensorType.get(shape, ttype.element_type), current)
        shared[key] = current
        return current
