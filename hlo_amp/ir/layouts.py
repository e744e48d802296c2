"""A value behind a layout fence: ``reshape`` to 1-D, ``optimization_barrier``, ``reshape``
back. XLA's layout assignment propagates a consumer's operand layout back through
layout-preserving ops (converts, elementwise fusions, slices, loop carries) and lets the
producer write that layout; a rank-1 array has one layout, so the fence stops the
propagation there and XLA makes the consumer's layout with a copy after it. The barrier
keeps XLA from folding the two reshapes into one."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jaxlib.mlir import ir


def reshaped(result_type: ir.Type, value: ir.Value) -> ir.Value:
    """A stablehlo.reshape at the current insertion point and location: the op
    ``hlo.reshape`` builds, without the generated builder's overhead."""
    return ir.Operation.create("stablehlo.reshape", results=[result_type],
                               operands=[value]).result


def fenced(value: ir.Value, shape: Sequence[int] | None = None) -> ir.Value:
    """``value`` behind a layout fence at the current insertion point, reshaped to
    ``shape`` (default its own)."""
    tensor = ir.RankedTensorType(value.type)
    flat = reshaped(ir.RankedTensorType.get([math.prod(tensor.shape)], tensor.element_type),
                    value)
    barrier = ir.Operation.create("stablehlo.optimization_barrier", results=[flat.type],
                                  operands=[flat]).result
    return reshaped(ir.RankedTensorType.get(list(tensor.shape if shape is None else shape),
                                            tensor.element_type), barrier)
