"""XLA:CPU as a target: which bf16 dots it runs fast (layouts, sizes, this host's bf16
instructions) and `CpuTarget`, the facts the passes consult on CPU.

Read by the fast-dot-layout pass (which relays dots into the fast form), the
insert-converts pass (whose ``only_if_faster`` option leaves a dot in f32 when the CPU
cannot run it faster in bf16) and the propagate pass. Findings and measurements:
benchmarks/DOT_LAYOUT.md (XLA:CPU's dot emitter and YNNPACK, jaxlib 0.10.2),
benchmarks/RESULTS.md (CPU section).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import element_type
from hlo_amp.targets.dot_dims import DotLayout, dot_layout
from hlo_amp.targets.target import Target

__all__ = ["CPU", "CpuTarget", "DotLayout", "cpu_has_native_bf16", "dot_layout",
           "has_transposed_result", "is_fast_on_cpu", "is_major_scan", "layout_is_fast",
           "meets_ynn_size", "native_bf16_flags", "needs_layout_rewrite"]

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


def _gather_transposes(gather: ir.Operation, rank: int) -> bool:
    """Whether XLA writes ``gather`` as a gather and a transpose: its offset (sliced)
    dimensions are not the result's trailing ones (``h[:, idx]``), and the canonical
    gather puts them last. That transpose folds into a bf16 dot reading it, which
    XLA:CPU's DotThunk cannot run ("Unsupported element type ... BF16 x BF16 = F32")."""
    numbers = hlo.GatherDimensionNumbers(gather.attributes["dimension_numbers"])
    offset = list(numbers.offset_dims)
    return offset != list(range(rank - len(offset), rank))


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
        elif is_major_scan(owner) or (name == "stablehlo.gather"
                                       and _gather_transposes(owner, ttype.rank)):
            found = (True, 0)
            break
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


def _callee_block(call: ir.Operation) -> ir.Block | None:
    """The body of the function ``call`` calls, or None if not found or not one block."""
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
    return blocks[0] if len(blocks) == 1 else None


def _returned_value(call: ir.Operation, result: ir.Value) -> ir.Value | None:
    """The value the callee of ``call`` returns for ``result``, or None if not found."""
    block = _callee_block(call)
    if block is None:
        return None
    terminator = list(block.operations)[-1]
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


# Sharding constraints too: jax writes one after each op of unreduced partial sums
# (dot, constraint, transpose, constraint, reshard), which the partitioner removes.
_FOLLOWED_TO_A_TRANSPOSE = frozenset({"stablehlo.reshape", "stablehlo.convert",
                                      "sdy.sharding_constraint", "sdy.reshard"})


def is_major_scan(op: ir.Operation) -> bool:
    """A reduce_window whose window spans a whole dimension other than the minor one
    (``jnp.cumsum(x, 0)``): XLA:CPU's ReduceWindowRewriter scans it along the minor
    dimension between two transposes, which XLA folds into a dot that produces or reads
    it (the bf16 dot then fails at run time, as under :func:`has_transposed_result`)."""
    if op.name != "stablehlo.reduce_window":
        return False
    shape = ir.RankedTensorType(op.operands[0].type).shape
    window = list(ir.DenseI64ArrayAttr(op.attributes["window_dimensions"]))
    return any(size > 1 and size == extent
               for size, extent in zip(window[:-1], shape[:-1], strict=False))


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
            if name == "stablehlo.transpose" or is_major_scan(user):
                return True
            if name in _FOLLOWED_TO_A_TRANSPOSE:
                pending.append(user.result)
            elif name == "func.call":  # jnp.cumsum is a private function: into it
                block = _callee_block(user)
                if block is not None:
                    pending.append(block.arguments[use.operand_number])
            elif name == "stablehlo.return" and user.parent is not None and (
                    user.parent.name in ("stablehlo.case", "stablehlo.if")):
                # Out of a branch (jax.export for several platforms puts each dot in a
                # case over them): the case's result the branch returns.
                pending.append(user.parent.results[use.operand_number])
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


@dataclass(frozen=True)
class CpuTarget(Target):
    """XLA:CPU (jaxlib 0.10.2, its dot emitter and YNNPACK)."""

    name: str = "cpu"
    family: ClassVar[str | None] = "cpu"
    # XLA:CPU has no fp8 dot: it widens the operands (see fp8_slower).
    fp8_kept_note: ClassVar[str] = ("XLA:CPU computes fp8 dots in a wider type: a numerics "
                                    "preview, not a speed-up")
    no_fused_attention: ClassVar[str] = "CPU: cuDNN's fused attention is a GPU kernel"

    @property
    def matrix_result_in_16bit(self) -> bool:
        """No: XLA:CPU upcasts every 16-bit-result dot to f32 (slower than f32 alone), so
        the dot keeps its f32 result and a ``convert`` follows it
        (benchmarks/DOT_LAYOUT.md)."""
        return False

    @property
    def deny_pins_its_inputs(self) -> bool:
        """Yes. XLA:CPU computes 16-bit elementwise ops in f32, so a 16-bit value saves
        storage only, and where f32 ops read it too its fusions materialise f32 copies
        (a softmax's broadcast 1/sum, an average pool's padded gradient): with deny ops
        converting their own inputs the ViT step's temp memory was 2139 MB against 1876 MB
        (benchmarks/RESULTS.md, CPU section)."""
        return True

    @property
    def relays_dots(self) -> bool:
        """Yes: relay every slow layout, even where the bf16 path is slower than f32:
        relaying only the known-failing ones (relay_slow=False) still let a ViT train step
        fail at run time in XLA:CPU (benchmarks/DOT_LAYOUT.md), and running beats speed."""
        return True

    def slower_in_16bit(self, op: Any, kind: str, compute_dtype: str) -> str | None:
        """XLA:CPU's convolutions and f16 dots gain nothing; bf16 dots only with native bf16
        instructions and a shape YNNPACK takes (benchmarks/DOT_LAYOUT.md)."""
        if kind == "convolution":
            return "left as written: XLA:CPU convolutions gain nothing in 16-bit"
        if compute_dtype == "float16":
            return "left as written: XLA:CPU upcasts every f16 dot to f32"
        if not cpu_has_native_bf16():
            return "left as written: this CPU has no native bf16 dot (bf16 runs slower)"
        if kind == "dot_general" and not is_fast_on_cpu(op, native_bf16=True):
            return "left as written: XLA:CPU has no fast bf16 path for this dot's shape"
        return None

    def fp8_slower(self) -> str | None:
        """XLA:CPU has no fp8 dot: it widens the fp8 operands to f32 and runs the dot in
        f32."""
        return ("left as written: XLA:CPU has no fp8 dot (it widens the fp8 operands to "
                "f32 and runs the dot in f32)")

    def fp8_dequantize(self, result: str, compute_dtype: str) -> str:
        """f32: XLA:CPU has no fp8 dot; it widens the fp8 operands to f32 and runs the dot
        in f32 (docs/fp8.md, "Cost: CPU and Hopper"), so the scales stay f32, as the
        Hopper GEMM applies them, and nothing is rounded to bf16 on the way."""
        return "f32"


CPU = CpuTarget()
