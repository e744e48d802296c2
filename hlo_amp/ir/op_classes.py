"""The propagation classes of StableHLO ops: the one table the mixed_* modes paint by.

In the manner of TensorFlow's auto-mixed-precision lists, each op kind (its StableHLO or
CHLO name without the dialect prefix) has a class:

- ``allow``: the matrix ops (``dot_general``, ``dot``, ``convolution`` and CHLO's
  ``ragged_dot``, a mixture-of-experts' grouped matmul); ``insert_converts`` puts them in
  16 bit and they seed 16-bit regions.
- ``infer``: elementwise arithmetic that follows its inputs; painted only when it sits
  on a path between 16-bit ops.
- ``clear``: data movement that does not change values (a max/min ``reduce`` or
  ``reduce_window`` picks one of its inputs; Shardy's ``sdy.sharding_constraint`` and
  ``sdy.reshard``, which only say where the elements live); painted like ``infer``.
- ``deny``: computed in f32 (on GPU and TPU a 16-bit input is converted up in front
  of the op, on CPU the value it reads stays f32), and the infer ops downstream of it
  stay f32 (see ``passes/propagate/solve.py``): exponentials and logs (error grows with
  the argument), powers,
  ``rsqrt``, sums (``reduce`` with an add body: sums, means, variances; ``reduce_window``
  with an add body over more than ``SHORT_SUM`` elements: cumulative sums), the levels
  of a product tree (``product_tree_level``: how JAX differentiates prod and cumprod),
  scatters,
  sorts, and JAX's own precision idiom ``reduce_precision``, which must stay exactly as
  written (one that rounds to its operand's own format, jax.checkpoint's mark on a saved
  residual, is ``clear``: it changes no value, and it is rewritten to the 16-bit
  format when painted). ``optimization_barrier`` is deny here, but the propagation pass passes each
  of its operands through as a loop carry (a link) unless a rule keeps it.

An add ``reduce_window`` over at most ``SHORT_SUM`` (16) elements, i.e. an average-pool
window and its gradient, is ``infer`` under bf16: it is a short chain of adds, as exact in
16 bit as ``add`` itself, and keeping it f32 would cut every conv net's regions at each
pool. Under f16 it is ``deny``: sixteen elements of 9,000 sum past f16's 65504.
So is an add ``scatter`` whose indices name one position (per batch element, when it
has batching dimensions): no two updates meet, so it is one add per element, not a sum
(the gradient of ``take_along_axis``: a cross-entropy's label pick). A scatter whose
updates may meet (an embedding's gradient) is a sum: ``deny``.

Any op kind not in the table is never painted and keeps its inputs f32, like ``deny``.

f16 is stricter than bf16: f16 tops out at 65504 while bf16 has f32's exponent range, so
ops whose result can be far larger than their inputs stay f32 under f16 only:
``divide`` (a quotient by a small divisor overflows), ``tan`` (unbounded near π/2), a
square (``chlo.square``, ``x * x``: past 256; the tanh GELU's ``x ** 3`` and its
gradient's ``3 x²``, a squared ReLU, a norm's ``x²``), a product only sums read (a
norm's backward ``x * dy`` under a loss scale), ``erfc`` (below f16's smallest value
past 3.9: ``log_ndtr``'s log of it was -inf) and short sums; all but the short sums
spread deny on CPU too, their readers' values may not fit either (the rsqrt's
derivative ``rsqrt(y) / y``).
Sums and means stay f32 under both, and so does a square only sums read, a second
moment, under bf16 too where deny ops convert their own inputs (``second_moments``:
Flax's fast variance ``mean(x²) - mean²`` magnified its rounding). Under either, an infer
or clear op reading a constant f16 cannot hold (a mask's fill of f32's largest
magnitude, -1e9) stays f32 under f16; under bf16 f32's extremes are clamped into its range
instead (passes/propagate/graph.py, rewrite.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

ALLOW = "allow"
INFER = "infer"
CLEAR = "clear"
DENY = "deny"
OTHER = "other"  # not in the table: treated like deny

OP_CLASSES: dict[str, str] = {
    # allow
    "dot_general": ALLOW, "dot": ALLOW, "convolution": ALLOW, "ragged_dot": ALLOW,
    # infer
    "add": INFER, "subtract": INFER, "multiply": INFER, "divide": INFER,
    "negate": INFER, "abs": INFER, "sign": INFER, "tanh": INFER, "logistic": INFER,
    "erf": INFER, "erfc": INFER, "sqrt": INFER, "cbrt": INFER, "square": INFER,
    "maximum": INFER, "minimum": INFER, "select": INFER, "clamp": INFER,
    "compare": INFER, "is_finite": INFER, "floor": INFER, "ceil": INFER,
    "round_nearest_even": INFER, "round_nearest_afz": INFER, "tan": INFER,
    "atan": INFER,
    # clear (reduce / reduce_window only with a max or min body; see op_class)
    "reshape": CLEAR, "transpose": CLEAR, "broadcast_in_dim": CLEAR, "broadcast": CLEAR,
    "slice": CLEAR, "dynamic_slice": CLEAR, "dynamic_update_slice": CLEAR,
    "concatenate": CLEAR, "pad": CLEAR, "reverse": CLEAR, "gather": CLEAR,
    "reduce": CLEAR, "reduce_window": CLEAR,
    "sdy.sharding_constraint": CLEAR, "sdy.reshard": CLEAR,
    # deny
    "exponential": DENY, "exponential_minus_one": DENY, "log": DENY,
    "log_plus_one": DENY, "power": DENY, "rsqrt": DENY, "sine": DENY, "cosine": DENY,
    "sinh": DENY, "cosh": DENY, "remainder": DENY, "atan2": DENY, "lgamma": DENY,
    "digamma": DENY, "erf_inv": DENY, "reduce_precision": DENY,
    "optimization_barrier": DENY, "scatter": DENY, "select_and_scatter": DENY,
    "sort": DENY, "all_reduce": DENY, "reduce_scatter": DENY, "cholesky": DENY,
    "triangular_solve": DENY, "fft": DENY, "batch_norm_training": DENY,
    "batch_norm_inference": DENY, "batch_norm_grad": DENY, "custom_call": DENY,
}

# Ops an op rule may not paint 16-bit, and why: the propagation retypes an op's operands
# and results, and these read them by the types they were written for (each made an
# invalid module or a failed run). Policy refuses such a rule.
NOT_RETYPED = {
    "sort": "its comparator compares values of the types it was written for",
    "bitcast_convert": "it reinterprets the bits of its input's type",
    "custom_call": "its target reads the buffer types it was written for",
    "composite": "its decomposition computes in the types it was written for",
}

# The matrix op kinds that are CHLO ops: jax lowers ragged_dot for GPU and TPU as
# ``chlo.ragged_dot`` (on CPU it writes dense dot_generals instead).
_CHLO_MATRIX_OPS = frozenset({"ragged_dot"})
# The matrix ops by their MLIR names, with their op kind ("stablehlo.dot_general":
# "dot_general", "chlo.ragged_dot": "ragged_dot").
MATRIX_OP_KINDS = {f"{'chlo' if kind in _CHLO_MATRIX_OPS else 'stablehlo'}.{kind}": kind
                   for kind, cls in OP_CLASSES.items() if cls == ALLOW}
MATRIX_OP_NAMES = frozenset(MATRIX_OP_KINDS)

# Stricter under f16 only (see the module docstring).
F16_DENY = frozenset({"divide", "tan", "square", "erfc"})

# Elementwise op kinds whose result is one of their operands' elements (a select's side,
# a clip's bound): no rounding compounds through them, and a fill they pick is the fill.
PICKING_KINDS = frozenset({"select", "maximum", "minimum", "clamp"})

# An add reduce_window over at most this many elements (2x2, 3x3, 4x4 pooling) is infer.
SHORT_SUM = 16
# reduce / reduce_window bodies that only pick an input: data movement, not arithmetic.
_PICKING_BODIES = frozenset({"stablehlo.maximum", "stablehlo.minimum"})


def short_name(op_name: str) -> str:
    """``stablehlo.add`` -> ``add``; ``chlo.erfc`` -> ``erfc``."""
    return op_name.removeprefix("stablehlo.").removeprefix("chlo.")


def table_class(kind: str, compute_dtype: str) -> str:
    """The class of an op kind from the table alone, for ``compute_dtype``."""
    if compute_dtype == "float16" and kind in F16_DENY:
        return DENY
    return OP_CLASSES.get(kind, OTHER)


def picks_an_input(op: Any) -> bool:
    """True for a single-input reduce/reduce_window whose body is one max or min."""
    body = _body_names(op)
    return len(body) == 2 and body[0] in _PICKING_BODIES and body[1] == "stablehlo.return"


def _body_names(op: Any) -> list[str]:
    if len(op.operation.regions) != 1 or len(op.operation.results) != 1:
        return []
    blocks = list(op.operation.regions[0].blocks)
    if len(blocks) != 1:
        return []
    return [inner.operation.name for inner in blocks[0].operations]


def body_is_one_add(op: Any) -> bool:
    """A one-result op whose body is one add: a sum (reduce, reduce_window) or an add
    scatter."""
    return _body_names(op) == ["stablehlo.add", "stablehlo.return"]


def short_window_sum(op: Any) -> bool:
    """A single-input add reduce_window over at most SHORT_SUM elements (a pooling
    window): a short chain of adds, as exact in 16 bit as ``add`` itself."""
    if not body_is_one_add(op):
        return False
    window = 1
    for extent in ir.DenseI64ArrayAttr(op.attributes["window_dimensions"]):
        window *= extent
    return window <= SHORT_SUM


def _squares(op: Any) -> bool:
    operands = op.operation.operands
    return len(operands) == 2 and operands[0] == operands[1]


def _summed_only(op: Any) -> bool:
    """Whether every reader of ``op``'s result is an add reduce (a norm's statistic, its
    backward's ``sum(x * dy)``): the sum reads f32, and the product, under a loss scale,
    can pass 65504 before it."""
    uses = list(op.operation.results[0].uses)
    return bool(uses) and all(
        use.owner.name == "stablehlo.reduce" and body_is_one_add(use.owner) for use in uses)


def single_update_scatter(op: Any) -> bool:
    """A one-input add scatter whose indices name one position (per batch element): no
    two updates meet, so each element gets at most one add."""
    if not body_is_one_add(op) or len(op.operation.operands) != 3:
        return False
    indices = op.operation.operands[1].type
    if not isinstance(indices, ir.RankedTensorType):
        return False
    numbers = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    shape = ir.RankedTensorType(indices).shape
    skip = {numbers.index_vector_dim, *numbers.scatter_indices_batching_dims}
    extents = [extent for dim, extent in enumerate(shape) if dim not in skip]
    return all(extent >= 0 for extent in extents) and math.prod(extents) == 1


def op_class(op: Any, compute_dtype: str, second_moments: bool = True) -> str:
    """The class of one op: the table, with reduce/reduce_window classed by their body,
    an add scatter by whether its updates can meet, and under f16 a square (``x * x``,
    what jax writes for ``x ** 2`` and ``x ** 3``) as deny."""
    kind = short_name(op.operation.name)
    found = table_class(kind, compute_dtype)
    if kind == "multiply" and compute_dtype == "float16" and (
            _squares(op) or _summed_only(op)):
        return DENY
    if kind == "multiply" and product_tree_level(op):
        return DENY
    # A square only sums read is a second moment: a 16-bit square, summed, is off by 2^-9
    # of x^2, which Flax's fast variance mean(x^2) - mean^2 magnifies by mean^2 / var
    # (a LayerNorm over activations of mean 50: loss 2.4e5 times off; review h116). Flax
    # and Keras compute it in f32; XLA fuses it into the sum either way. Not with
    # ``second_moments`` off (CPU, where a deny op pins the stream it reads f32, and
    # XLA:CPU squares in f32 anyway); under f16 it is deny for the range regardless.
    if kind in ("multiply", "square") and (kind == "square" or _squares(op)) and (
            (second_moments or compute_dtype == "float16") and _summed_only(op)):
        return DENY
    if kind == "scatter" and single_update_scatter(op):
        return INFER
    if kind == "reduce_precision" and rounds_to_its_own_type(op):
        return CLEAR
    if kind in ("reduce", "reduce_window") and found == CLEAR and not picks_an_input(op):
        # Under f16 a short sum overflows too (16 elements of 9,000: 144,000).
        if kind == "reduce_window" and short_window_sum(op) and compute_dtype != "float16":
            return INFER
        return DENY
    return found


def product_tree_level(op: Any) -> bool:
    """Whether a ``multiply`` is a level of a product tree: it multiplies two parts of one
    value along an axis (its halves, the second padded with 1 when odd, or its even and
    odd elements), and the value it reads is such a product too, or its result is read
    so. JAX differentiates ``prod`` by such a tree (``_reduce_prod_jvp_rule``) and
    ``cumprod`` by ``associative_scan``: a product of many factors, as a sum is, classed
    as the ``reduce`` and ``reduce_window`` it replaces (painted, a product of 256
    factors near 1 drifted 6% in bf16: review h113). One level alone (a gated linear
    unit's halves multiplied) is no tree."""
    source = _parts_of_one_value(op)
    if source is None:
        return False
    producer = source.owner
    if isinstance(producer, ir.OpView):
        producer = producer.operation
    if isinstance(producer, ir.Operation) and _parts_of_one_value(producer) is not None:
        return True
    result = op.results[0]
    for reader in _parts_readers(op):
        read = _parts_of_one_value(reader)
        if read is not None and read == result:
            return True
    return False


def _parts_readers(op: Any) -> list[Any]:
    """The multiplies reading ``op``'s result through slices, pads and converts (this
    pass's own, on a second run: review h115)."""
    found, pending = [], [(op, 0)]
    while pending:
        current, depth = pending.pop()
        for use in current.results[0].uses:
            reader = use.owner
            if reader.name == "stablehlo.multiply" and depth:
                found.append(reader)
            elif reader.name in _THROUGH_PARTS and depth < 4:
                pending.append((reader, depth + 1))
    return found


# What a product tree's part may pass through between its value and its multiply.
_THROUGH_PARTS = frozenset({"stablehlo.slice", "stablehlo.pad", "stablehlo.convert"})


def _without_converts(value: ir.Value) -> ir.Value:
    while isinstance(value, ir.OpResult) and value.owner.name == "stablehlo.convert":
        value = value.owner.operands[0]
    return value


def _parts_of_one_value(op: Any) -> ir.Value | None:
    """The value a ``multiply`` reads two complementary parts of along one axis (halves,
    the second padded, or even and odd elements), converts looked through, or None."""
    if op.name != "stablehlo.multiply" or len(op.operands) != 2:
        return None
    parts = []
    for operand in op.operands:
        owner = _without_converts(operand).owner
        if getattr(owner, "name", "") == "stablehlo.pad":
            owner = _without_converts(owner.operands[0]).owner
        if getattr(owner, "name", "") != "stablehlo.slice":
            return None
        parts.append(owner)
    first, second = parts
    source = _without_converts(first.operands[0])
    if source != _without_converts(second.operands[0]):
        return None
    starts = [list(ir.DenseI64ArrayAttr(p.attributes["start_indices"])) for p in parts]
    limits = [list(ir.DenseI64ArrayAttr(p.attributes["limit_indices"])) for p in parts]
    strides = [list(ir.DenseI64ArrayAttr(p.attributes["strides"])) for p in parts]
    shape = ir.RankedTensorType(first.operands[0].type).shape
    axes = [d for d in range(len(shape)) if (starts[0][d], limits[0][d], strides[0][d]) != (
        starts[1][d], limits[1][d], strides[1][d])]
    if len(axes) != 1:
        return None
    d, n = axes[0], shape[axes[0]]
    for k in range(len(shape)):  # every other axis whole
        if k != d and (starts[0][k], limits[0][k], strides[0][k]) != (0, shape[k], 1):
            return None
    halves = (strides[0][d] == strides[1][d] == 1 and starts[0][d] == 0
              and limits[0][d] == starts[1][d] and limits[1][d] == n)
    interleaved = (strides[0][d] == strides[1][d] == 2 and {starts[0][d], starts[1][d]}
                   == {0, 1})
    return source if halves or interleaved else None


# (exponent bits, mantissa bits) of each float type: reduce_precision to its own format
# changes no value.
FULL_FORMAT = {"f64": (11, 52), "f32": (8, 23), "bf16": (8, 7), "f16": (5, 10)}


def rounds_to_its_own_type(op: Any) -> bool:
    """Whether a ``reduce_precision`` rounds to its operand type's own format: jax's mark
    on each residual a ``jax.checkpoint`` policy saves (``e8m23`` on an f32 value, so that
    XLA keeps the saved value's precision); it changes no value, so the fast mode may
    carry the residual in 16 bit, the mark rewritten to that type's format (deny, it kept
    every saved residual f32 where a hand cast saves bf16)."""
    element = str(ir.RankedTensorType(op.operands[0].type).element_type)
    exponent = ir.IntegerAttr(op.attributes["exponent_bits"]).value
    mantissa = ir.IntegerAttr(op.attributes["mantissa_bits"]).value
    return FULL_FORMAT.get(element) == (exponent, mantissa)


@functools.cache
def op_names() -> frozenset[str]:
    """Every StableHLO and CHLO op name the bindings know, without the dialect prefix."""
    from jaxlib.mlir.dialects import chlo
    from jaxlib.mlir.dialects import stablehlo as hlo

    names = {
        short_name(cls.OPERATION_NAME)
        for module in (hlo, chlo)
        for cls in vars(module).values()
        if isinstance(cls, type) and isinstance(getattr(cls, "OPERATION_NAME", None), str)
    }
    names = {name for name in names if not name.startswith("_")}  # private kernels
    return frozenset(names | set(OP_CLASSES))
