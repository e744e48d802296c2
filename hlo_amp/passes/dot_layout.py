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
pass also relays NN dots whose result is transposed. XLA:CPU transposes on its own
around a reduce_window that scans a major dimension (``jnp.cumsum(x, 0)``,
``lax.cummax``): such a scan counts as a transpose of the dot that produces it, and its
result as a permuted operand of the dot that reads it (``is_major_scan``; before, the
bf16 dot failed at run time).

In a partitioned module the relay's reshapes would merge sharded dimensions (and lose
their shardings), so there the same dots are computed from f32 copies of their operands
instead (``WIDENED``), as XLA:CPU computes a dot its bf16 kernel does not take.

Relaid, the dot keeps its result type, location and precision: only the layout of its operands
changes, so the products and the f32 accumulation are the same and the result differs
from XLA's upcast-to-f32 kernel only by summation order. See
``benchmarks/DOT_LAYOUT.md``: on CPUs without native bf16 arithmetic (no AVX512-BF16 or
AMX-BF16) YNNPACK's bf16 dots are *slower* than f32 ones in every layout, so convert a
dot to bf16 for speed only where :func:`is_fast_on_cpu` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.layouts import fenced, reshaped
from hlo_amp.ir.modules import decision_of, discard, walk_operations, with_element
from hlo_amp.ir.shardings import is_partitioned
from hlo_amp.ir.sites import location_name
from hlo_amp.targets.cpu import (
    _MAX_PROVENANCE_DEPTH,
    DotLayout,
    _is_bf16_to_f32,
    _maybe_permuted,
    _provenance,
    dot_layout,
    layout_is_fast,
    meets_ynn_size,
    needs_layout_rewrite,
)

# The note a relaid dot gets in the report (details of the permutation follow it).
RELAID = "dot relaid to the NT form [batch, m, k] x [batch, n, k] for XLA:CPU's bf16 path"
# ... and the note of one computed in f32 instead, in a partitioned program.
WIDENED = ("dot computed from f32 copies of its bf16 operands (XLA:CPU's f32 path): "
           "relaying it for XLA:CPU's bf16 path would reshape values of a partitioned "
           "program, whose shardings the reshapes drop")

__all__ = ["FastDotLayout"]

_DOT_GENERAL = frozenset({"stablehlo.dot_general"})


def _fresh(provenance: tuple[tuple[bool, int], ...]) -> tuple[bool, ...]:
    """Per operand, `_maybe_permuted` from its `_provenance`."""
    return tuple(answer or last > _MAX_PROVENANCE_DEPTH for answer, last in provenance)


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

    # False: relay only NN dots with a transposed result, not the ones XLA would merely
    # upcast. Not safe as a default: a ViT train step still failed in XLA:CPU with it.
    relay_slow: bool = True
    name: str = "hlo-amp-fast-dot-layout"

    def run(self, module: ir.Module, report: Any = None) -> None:
        """Rewrite `module` in place."""
        # Decide on every dot before changing anything: the provenance memo is keyed
        # by value and only valid on the unchanged module.
        memo: dict[ir.Value, tuple[bool, int]] = {}
        todo = []
        dynamic = []
        for op in walk_operations(module, names=_DOT_GENERAL):
            if not _is_bf16_to_f32(op):
                continue
            if any(ir.ShapedType(v.type).has_rank and not ir.ShapedType(v.type)
                   .has_static_shape for v in list(op.operands)[:2]):
                # A dynamic dimension (a shape-polymorphic export): XLA:CPU's dot kernel
                # has no bf16 x bf16 -> f32 form for it ("Unsupported element type for
                # DotThunk::Execute"), and no layout is read: computed from f32 copies.
                dynamic.append(op)
                continue
            layout = dot_layout(op)
            if layout is None or not meets_ynn_size(layout):
                continue
            lhs, rhs = op.operands
            provenance = (_provenance(lhs, memo), _provenance(rhs, memo))
            fresh = _fresh(provenance)
            if needs_layout_rewrite(op, layout=layout, fresh=fresh) and (
                self.relay_slow or layout_is_fast(op, layout=layout, fresh=fresh)
            ):
                todo.append((op, layout, provenance))
        memo.clear()
        shared: dict[tuple[Any, ...], ir.Value] = {}
        for op in dynamic:
            self._widen(op, shared, report)
        if todo and is_partitioned(module):
            # The NT form collapses dimensions and fences operands through 1-D reshapes:
            # a sharded dimension merged into an unsharded one loses its sharding (an
            # activation sharded on its sequence axis came back replicated). An f32 dot
            # is what XLA:CPU runs for a layout YNNPACK refuses anyway, and it cannot
            # meet the bf16 dot's run-time failure a transposed result brings.
            for relaid in todo:
                self._widen(relaid[0], shared, report)
            return
        nt_dims: dict[int, ir.Attribute] = {}  # the NT dimension numbers per batch rank
        for op, layout, provenance in todo:
            # A dot relaid before this one may have put a reshape on an operand's
            # producer chain (its result went through reshape(new dot)): one step
            # longer, which flips the answer only for a chain that ends right at the
            # depth limit. Those few are asked again; the rest keep the memo's answer.
            fresh = tuple(
                _maybe_permuted(value) if last == _MAX_PROVENANCE_DEPTH else flag
                for value, (_, last), flag in zip(op.operands, provenance, _fresh(provenance))
            )
            self._rewrite(op, layout, fresh, shared, nt_dims, report)

    def _rewrite(
        self,
        op: hlo.DotGeneralOp,
        layout: DotLayout,
        fresh: tuple[bool, ...],
        shared: dict[tuple[Any, ...], ir.Value],
        nt_dims: dict[int, ir.Attribute],
        report: Any,
    ) -> None:
        perms = (layout.lhs_permutation(), layout.rhs_permutation())
        lhs_shape, rhs_shape, out_shape = layout.nt_shapes()
        nb = len(layout.lhs_batch)
        block = op.operation.block
        location = op.location
        decision = decision_of(op)
        notes = []
        with location, ir.InsertionPoint(op):
            operands = []
            for side, value, perm, shape, needs_fresh in zip(
                ("lhs", "rhs"), op.operands, perms, (lhs_shape, rhs_shape), fresh
            ):
                operands.append(self._nt_operand(value, perm, shape, needs_fresh, block, shared))
                if operands[-1] != value:
                    notes.append(f"{side} {list(perm)} -> {list(shape)}")
            dims = nt_dims.get(nb)
            if dims is None:
                dims = nt_dims[nb] = hlo.DotDimensionNumbers.get(
                    lhs_batching_dimensions=list(range(nb)),
                    rhs_batching_dimensions=list(range(nb)),
                    lhs_contracting_dimensions=[nb + 1],
                    rhs_contracting_dimensions=[nb + 1],
                )
            result_type = op.result.type
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
                restored = reshaped(result_type, new.result)
                op.result.replace_all_uses_with(restored)
                discard(op)
                notes.append(f"result {list(out_shape)} -> {list(result_type.shape)}")
        if report is not None and hasattr(report, "note"):
            report.note(f"{RELAID} ({'; '.join(notes)})", decision, location_name(location))

    @staticmethod
    def _widen(op: hlo.DotGeneralOp, shared: dict[tuple[Any, ...], ir.Value],
               report: Any) -> None:
        """``op`` computed from f32 copies of its operands (one per value and block)."""
        with op.location, ir.InsertionPoint(op):
            f32 = ir.F32Type.get()
            for index, value in enumerate(list(op.operands)[:2]):
                key = (op.operation.block, value, "f32")
                if key not in shared:
                    shared[key] = hlo.convert(with_element(value.type, f32), value)
                op.operands[index] = shared[key]
        if report is not None and hasattr(report, "note"):
            report.note(WIDENED, decision_of(op), location_name(op.location))

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
        ttype = value.type
        identity = perm == tuple(range(len(perm)))
        if identity and not needs_fresh:
            if tuple(ttype.shape) == shape:
                return value
            return reshaped(ir.RankedTensorType.get(shape, ttype.element_type), value)
        key = (block, value, perm, shape)
        if key in shared:
            return shared[key]
        current = fenced(value if identity else hlo.transpose(value, list(perm)), shape)
        shared[key] = current
        return current
