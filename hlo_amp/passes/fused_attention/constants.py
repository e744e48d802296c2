"""Evaluating the constant parts of an attention with numpy: its scale, the fill value of
its mask, and a mask computed from iotas and constants (``jnp.tril``,
``nnx.make_causal_mask``), which the pass compares with a causal mask.

A value is evaluated in broadcast form, `Folded`: an array over the dimensions it varies
along and the dimensions of the value they are, so a ``[1, 1, T, S]`` mask broadcast to
``[B, N, T, S]`` costs a ``T x S`` array, never the full shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from hlo_amp.ir.modules import NUMPY_TYPES, dense_value, element_type
from hlo_amp.passes.fused_attention.calls import CallView, Stack

# Larger constants are left unevaluated (the pass then treats the value as not constant).
MAX_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Folded:
    """A value of ``shape`` equal to ``array`` broadcast: ``array``'s dimension i is the
    value's dimension ``axes[i]``; the value is the same along every other dimension."""

    array: np.ndarray
    axes: tuple[int, ...]
    shape: tuple[int, ...]
    # Whether ``array`` is what the program computes bit for bit: exp, log, rsqrt and a
    # float power are evaluated correctly rounded, which XLA's approximations are not
    # (their last bit differs for about 1 in 10 inputs); a comparison or a rounding of
    # such a value may flip where the program's does not (a mask read wrong, fused as
    # causal: 42% off), so none is evaluated. A scale may be one (a last-bit difference).
    exact: bool = True

    def expanded(self, axes: tuple[int, ...]) -> np.ndarray:
        """``array`` with dimensions ``axes`` (a superset of its own, sorted), size 1 where
        it does not vary."""
        order = sorted(range(len(self.axes)), key=lambda i: self.axes[i])
        array = np.transpose(self.array, order) if order else self.array
        mine = [self.axes[i] for i in order]
        shape = [self.shape[a] if a in mine else 1 for a in axes]
        return array.reshape(shape)


def splat_value(view: CallView, value: ir.Value, stack: Stack) -> float | None:
    """The one value a constant splat (possibly broadcast, reshaped, converted) holds."""
    folded = evaluate(view, value, stack, {})
    if folded is None or folded.array.size != 1:
        return None
    return float(folded.array.reshape(()))


def evaluate(view: CallView, value: ir.Value, stack: Stack, memo: dict) -> Folded | None:
    """``value`` computed from constants and iotas alone, seen through calls and loop
    carries the loop passes on unchanged; None when it reads anything else. An integer
    value is held in its own type (unsigned ones wrap, as in the program), a float one
    in float64."""
    key = (value, stack)
    if key not in memo:
        memo[key] = None  # a cycle (a loop carry) is not constant
        found = _evaluate(view, value, stack, memo)
        # Held in the value's own type: a float iota's np.arange is float64, not int64
        # (a float difference converted to uint8 wrapped, where XLA saturates).
        dtype = _numpy_type(value) or np.dtype(np.float64)
        if found is not None and found.array.dtype != dtype:
            found = Folded(found.array.astype(dtype), found.axes, found.shape, found.exact)
        # A float value rounded to its own type, as the program computes it: bf16
        # positions (jnp.arange(T, dtype=bfloat16)) round 259 and 260 to one number, so
        # their comparison is no causal mask.
        rounding = _ROUNDED.get(_element_name(value))
        if found is not None and rounding is not None:
            with np.errstate(all="ignore"):
                narrow = found.array.astype(rounding)
                # XLA flushes subnormals to zero (a product of 1e-20 and 1e-19 is 0
                # there): a value holding one is not evaluated bit for bit.
                tiny = ml_dtypes.finfo(rounding).smallest_normal
                subnormal = bool(np.any((narrow != 0) & (np.abs(narrow) < tiny)))
            found = Folded(narrow.astype(np.float64), found.axes, found.shape,
                           found.exact and not subnormal)
        memo[key] = found
    return memo[key]


# Integer element types as numpy holds them (i1: bool).
_INTEGERS = {name: kind for name, kind in NUMPY_TYPES.items() if name[0] in "iu"}


# Float element types narrower than float64, which evaluate() rounds each value to.
_ROUNDED = {name: kind for name, kind in NUMPY_TYPES.items()
            if name in ("f32", "f16", "bf16")}


def _element_name(value: ir.Value) -> str | None:
    element = element_type(value)
    return None if element is None else str(element)


def _numpy_type(value: ir.Value) -> np.dtype | None:
    """The numpy type of an integer or boolean ``value``; None for floats (float64)."""
    found = _INTEGERS.get(_element_name(value))
    return None if found is None else np.dtype(found)


def _shape(value: ir.Value) -> tuple[int, ...] | None:
    if not isinstance(value.type, ir.RankedTensorType):
        return None
    ranked = ir.RankedTensorType(value.type)
    return tuple(ranked.shape) if ranked.has_static_shape else None


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """StableHLO's divide: integers truncated toward zero (a mask's ``lax.div(i, 4)``
    was evaluated as true division, and a block-causal mask taken for causal); None
    where an integer divisor is 0 (XLA's result is its own)."""
    if a.dtype.kind in "iu":
        if np.any(b == 0):
            return None
        quotient = np.abs(a.astype(np.int64)) // np.abs(b.astype(np.int64))
        return (np.sign(a.astype(np.int64)) * np.sign(b.astype(np.int64)) * quotient
                ).astype(a.dtype)
    return np.divide(a, b)


def _remainder(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """StableHLO's remainder: the sign of the dividend (C's ``%``, numpy's ``fmod``)."""
    if a.dtype.kind in "iu" and np.any(b == 0):
        return None
    return np.fmod(a, b)


def _bitwise(logical: object, bitwise: object) -> object:
    """StableHLO's and/or/xor: logical on i1, bitwise on other integers (``i & 3`` was
    taken as a truth value)."""
    return lambda a, b: (logical if a.dtype == bool else bitwise)(a, b)


_BINARY = {
    "stablehlo.and": _bitwise(np.logical_and, np.bitwise_and),
    "stablehlo.or": _bitwise(np.logical_or, np.bitwise_or),
    "stablehlo.xor": _bitwise(np.logical_xor, np.bitwise_xor), "stablehlo.add": np.add,
    "stablehlo.subtract": np.subtract, "stablehlo.multiply": np.multiply,
    "stablehlo.maximum": np.maximum, "stablehlo.minimum": np.minimum,
    "stablehlo.divide": _divide, "stablehlo.remainder": _remainder,
    "stablehlo.power": np.power,
}
# Correctly rounded in XLA as here (IEEE's sqrt; abs).
_EXACT_UNARY = frozenset({"stablehlo.sqrt", "stablehlo.abs"})
_UNARY = {"stablehlo.sqrt": np.sqrt, "stablehlo.rsqrt": lambda a: 1.0 / np.sqrt(a),
          "stablehlo.exponential": np.exp, "stablehlo.log": np.log, "stablehlo.abs": np.abs}
# Evaluated in the value's own type (a float position rounded as the program rounds it):
# jnp's integer floor division writes sign, a float one floor (the chunked masks of
# Llama 4's local attention, q // C == k // C).
_ROUNDING = {"stablehlo.sign": np.sign, "stablehlo.floor": np.floor,
             "stablehlo.ceil": np.ceil, "stablehlo.round_nearest_even": np.rint}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "GE": np.greater_equal,
            "GT": np.greater, "LE": np.less_equal, "LT": np.less}


def _evaluate(view: CallView, value: ir.Value, stack: Stack, memo: dict) -> Folded | None:
    op, value, stack = view.producer(value, stack, invariant_carries=True)
    shape = _shape(value)
    if op is None or shape is None:
        return None
    name = op.name
    operands = list(op.operands)

    def of(index: int) -> Folded | None:
        return evaluate(view, operands[index], stack, memo)

    if name == "stablehlo.constant":
        attr = dense_value(op)
        if attr is None:  # complex elements, a dense_resource blob
            return None
        if attr.is_splat:
            return Folded(np.asarray(_scalar(attr.get_splat_value())), (), shape)
        if int(np.prod(shape)) > MAX_ELEMENTS:
            return None
        return Folded(np.array(attr), tuple(range(len(shape))), shape)
    if name == "stablehlo.iota":
        dim = ir.IntegerAttr(op.attributes["iota_dimension"]).value
        return Folded(np.arange(shape[dim]), (dim,), shape)
    if name == "stablehlo.broadcast_in_dim":
        inner = of(0)
        if inner is None:
            return None
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
        keep = [i for i, a in enumerate(inner.axes)
                if inner.shape[a] == shape[dims[a]]]
        array = inner.array
        dropped = [i for i in range(len(inner.axes)) if i not in keep]
        if dropped:
            array = array.reshape([array.shape[i] for i in keep]) if array.size else array
        return Folded(array, tuple(dims[inner.axes[i]] for i in keep), shape, inner.exact)
    if name == "stablehlo.transpose":
        inner = of(0)
        if inner is None:
            return None
        permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
        return Folded(inner.array, tuple(permutation.index(a) for a in inner.axes), shape,
                      inner.exact)
    if name == "stablehlo.reshape":
        inner = of(0)
        mapping = unit_reshape_map(_shape(operands[0]), shape)
        if inner is None or mapping is None:
            return None
        keep = [i for i, a in enumerate(inner.axes) if mapping[a] is not None]
        array = inner.array.reshape([inner.array.shape[i] for i in keep])
        return Folded(array, tuple(mapping[inner.axes[i]] for i in keep), shape, inner.exact)
    if name == "stablehlo.convert":
        inner = of(0)
        if inner is None:
            return None
        element = str(ir.RankedTensorType(value.type).element_type)
        if not inner.exact and element in _INTEGERS:  # to i1 a comparison, to an
            return None  # integer a rounding: of an inexact value, not evaluated
        return Folded(_cast(inner.array, element), inner.axes, shape, inner.exact)
    if name == "stablehlo.not":
        inner = of(0)
        if inner is None:
            return None
        array = (np.logical_not(inner.array) if inner.array.dtype == bool
                 else np.invert(inner.array))
        return Folded(array, inner.axes, shape, inner.exact)
    if name in _UNARY:  # a scale written as 1 / sqrt(d) of a constant d
        inner = of(0)
        if inner is None:
            return None
        with np.errstate(all="ignore"):
            return Folded(_UNARY[name](inner.array.astype(np.float64)), inner.axes, shape,
                          inner.exact and name in _EXACT_UNARY)
    if name == "stablehlo.negate":
        inner = of(0)
        return None if inner is None else Folded(-inner.array, inner.axes, shape,
                                                 inner.exact)
    if name in _ROUNDING:
        inner = of(0)
        if inner is None or not inner.exact:
            return None
        return Folded(_ROUNDING[name](inner.array), inner.axes, shape)
    if name == "stablehlo.slice":  # a causal mask of the longest length, cut to T x S
        inner = of(0)
        if inner is None:
            return None
        bounds = [list(ir.DenseI64ArrayAttr(op.attributes[key]))
                  for key in ("start_indices", "limit_indices", "strides")]
        cut = tuple(slice(bounds[0][a], bounds[1][a], bounds[2][a]) for a in inner.axes)
        return _checked(inner.array[cut], inner.axes, shape, inner.exact)
    if name in _BINARY or name == "stablehlo.compare":
        left, right = of(0), of(1)
        if left is None or right is None:
            return None
        exact = left.exact and right.exact
        if name == "stablehlo.compare" and not exact:
            return None
        axes = tuple(sorted(set(left.axes) | set(right.axes)))
        if name == "stablehlo.compare":
            direction = str(op.attributes["comparison_direction"]).split()[-1].rstrip(">")
            function = _COMPARE.get(direction)
            if function is None:
                return None
        else:
            function = _BINARY[name]
        with np.errstate(all="ignore"):
            array = function(left.expanded(axes), right.expanded(axes))
        if name == "stablehlo.power" and array is not None and array.dtype.kind == "f":
            exact = False
        if name == "stablehlo.divide" and array is not None and array.dtype.kind == "f" and (
                not _powers_of_two(right.array)):
            exact = False  # XLA divides by a constant as a multiply by its reciprocal
        return None if array is None else _checked(array, axes, shape, exact)
    if name == "stablehlo.select":
        parts = [of(i) for i in range(3)]
        if any(p is None for p in parts):
            return None
        axes = tuple(sorted(set().union(*(p.axes for p in parts))))
        pick, yes, no = (p.expanded(axes) for p in parts)
        return _checked(np.where(pick, yes, no), axes, shape, all(p.exact for p in parts))
    return None


def _powers_of_two(array: np.ndarray) -> bool:
    """Whether every element is a power of two (its reciprocal exact)."""
    with np.errstate(all="ignore"):
        mantissa, _ = np.frexp(np.abs(array.astype(np.float64)))
    return bool(np.all(mantissa == 0.5))


def _checked(array: np.ndarray, axes: tuple[int, ...], shape: tuple[int, ...],
             exact: bool = True) -> Folded | None:
    """``array`` squeezed to the axes it varies along (a broadcast of size-1 axes)."""
    if array.size > MAX_ELEMENTS:
        return None
    keep = [i for i in range(array.ndim) if array.shape[i] != 1 or shape[axes[i]] == 1]
    return Folded(array.reshape([array.shape[i] for i in keep]),
                  tuple(axes[i] for i in keep), shape, exact)


def _scalar(attr: ir.Attribute) -> object:
    for kind in (ir.BoolAttr, ir.FloatAttr, ir.IntegerAttr):
        if isinstance(attr, kind):
            return kind(attr).value
    for kind in (ir.BoolAttr, ir.FloatAttr, ir.IntegerAttr):
        try:
            return kind(attr).value
        except (ValueError, TypeError):
            continue
    raise ValueError(f"unreadable constant {attr}")


def _cast(array: np.ndarray, element: str) -> np.ndarray:
    """A convert to ``element``: an integer type wraps as the program's does (it was
    int64 for every integer, so an unsigned mask never wrapped)."""
    integer = _INTEGERS.get(element)
    if integer is not None:
        if integer is np.bool_:
            return array != 0
        if array.dtype.kind == "f":
            # As XLA converts: toward zero, saturating at the type's range, NaN to 0
            # (numpy wraps: -1.0 to uint8 is 255 there, 0 in the program).
            info = np.iinfo(integer)
            array = np.clip(np.trunc(np.nan_to_num(array, nan=0.0)), info.min, info.max)
        with np.errstate(all="ignore"):
            return array.astype(integer)
    return array.astype(np.float64)


def unit_reshape_map(source: tuple[int, ...] | None, result: tuple[int, ...] | None
                     ) -> list[int | None] | None:
    """For a reshape that only adds or drops size-1 dimensions: each source dimension's
    result dimension (None for a dropped size-1 one); None for any other reshape."""
    if source is None or result is None:
        return None
    if tuple(source) == tuple(result):  # jax's identity reshape keeps its size-1 axes
        return list(range(len(source)))
    kept = [d for d, size in enumerate(result) if size != 1]
    mapping: list[int | None] = []
    position = 0
    for size in source:
        if size == 1:
            mapping.append(None)
            continue
        if position >= len(kept) or result[kept[position]] != size:
            return None
        mapping.append(kept[position])
        position += 1
    return mapping if position == len(kept) else None
