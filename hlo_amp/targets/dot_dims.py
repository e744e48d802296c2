"""The dimension facts of one ``stablehlo.dot_general`` (batch, free and contracting
dimensions, the canonical m, k, n), as XLA's DotDecomposer
(xla/hlo/transforms/expanders/dot_decomposer.cc) and the targets' dot rules read them:
XLA:CPU's bf16 dot layouts (targets/cpu.py) and cuBLASLt's fp8 GEMM form (targets/fp8_gemm.py);
the passes read which of a dot's operands is a layer's weight from them too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo


@dataclass(frozen=True)
class DotLayout:
    """The shape facts about one dot_general that decide XLA:CPU's dot path."""

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]

    def batch(self, side: int) -> tuple[int, ...]:
        """The batch dimensions of operand ``side`` (0: lhs, 1: rhs)."""
        return self.rhs_batch if side else self.lhs_batch

    def contracting(self, side: int) -> tuple[int, ...]:
        """The contracting dimensions of operand ``side``."""
        return self.rhs_contracting if side else self.lhs_contracting

    def contracts_edge(self, side: int, *, leading: bool) -> bool:
        """Whether operand ``side`` is contracted along its leading dimensions alone (a
        weight's rows) or, with ``leading=False``, its trailing ones (features)."""
        rank = len(self.rhs_shape if side else self.lhs_shape)
        count = len(self.contracting(side))
        edge = range(count) if leading else range(rank - count, rank)
        return sorted(self.contracting(side)) == list(edge)

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
