"""Dimension roles: what each dimension of a value in an attention is, read off the
scores' ``dot_general`` and carried through transposes, broadcasts, reductions and
unit reshapes (match.py's docstring says which roles there are).
"""

from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.passes.fused_attention.calls import SHARDING_CONSTRAINT
from hlo_amp.passes.fused_attention.constants import unit_reshape_map

Role = tuple  # ("B", i), ("Q", j), ("S",), ("H",), ("Hv",), ("1",); None: not known yet
S_ROLE, H_ROLE, HV_ROLE, UNIT = ("S",), ("H",), ("Hv",), ("1",)

ELEMENTWISE = frozenset({
    "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.divide",
    "stablehlo.negate", "stablehlo.exponential", "stablehlo.maximum",
    "stablehlo.minimum", "stablehlo.select", "stablehlo.convert", "stablehlo.compare",
    "stablehlo.and", "stablehlo.or", "stablehlo.not", "stablehlo.abs", "stablehlo.sign",
})


DROPOUT = "dropout on the probabilities (cuDNN's dropout draws its own random numbers)"


class NotFused(Exception):
    """Why a site is not fused; ``attention`` says whether it is an attention at all."""

    def __init__(self, reason: str, attention: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.attention = reason, attention
        self.direction: str | None = None  # the site's, as far as the analysis saw
        # The attention's matmuls found before it was refused (match.py's match_site),
        # and whether its backward is in another function.
        self.matmuls: list = []
        self.split_backward = False


def shape_of(value: ir.Value) -> tuple[int, ...]:
    return tuple(ir.RankedTensorType(value.type).shape)


def dot_dims(op: ir.Operation) -> hlo.DotDimensionNumbers:
    return hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])


def free_dims(rank: int, *used: list[int]) -> list[int]:
    taken = {d for dims in used for d in dims}
    return [d for d in range(rank) if d not in taken]


def unify(lists: list[list[Role] | None]) -> list[Role] | None:
    known = [r for r in lists if r is not None]
    if not known:
        return None
    merged = list(known[0])
    for roles in known[1:]:
        if len(roles) != len(merged):
            raise NotFused("an elementwise op reads values of different ranks")
        for i, role in enumerate(roles):
            if merged[i] is None:
                merged[i] = role
            elif role is not None and role != merged[i] and UNIT not in (role, merged[i]):
                raise NotFused("the scores' dimensions are mixed up between ops")
    return merged


def result_roles(op: ir.Operation, inputs: list[list[Role] | None]) -> list[Role] | None:
    """The roles of ``op``'s result from its operands' (None where not known)."""
    name = op.name
    if name in ELEMENTWISE:
        shapes = [shape_of(v) for v in op.operands]
        result = shape_of(op.results[0])
        same = [r for r, s in zip(inputs, shapes) if s == result]
        return unify(same)
    source = inputs[0]
    if source is None:
        return None
    if name == "stablehlo.transpose":
        permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
        return [source[p] for p in permutation]
    if name == "stablehlo.broadcast_in_dim":
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
        result = shape_of(op.results[0])
        operand = shape_of(op.operands[0])
        roles: list[Role | None] = [UNIT if size == 1 else None for size in result]
        for i, d in enumerate(dims):
            if operand[i] == result[d]:
                roles[d] = source[i]
        return roles
    if name == "stablehlo.reduce":
        dims = set(ir.DenseI64ArrayAttr(op.attributes["dimensions"]))
        return [r for d, r in enumerate(source) if d not in dims]
    if name == "stablehlo.reshape":
        mapping = unit_reshape_map(shape_of(op.operands[0]), shape_of(op.results[0]))
        if mapping is None:
            raise NotFused("a reshape merges or splits the scores' dimensions")
        roles = [UNIT] * len(shape_of(op.results[0]))
        for i, d in enumerate(mapping):
            if d is not None:
                roles[d] = source[i]
        return roles
    return None


def base_of(value: ir.Value) -> tuple[ir.Value, list[int | None]]:
    """``value`` before transposes, converts, unit reshapes and sharding constraints in its
    block, and each of its dimensions' dimension there (None: a size-1 one added)."""
    mapping: list[int | None] = list(range(len(shape_of(value))))
    steps = 0
    while steps < 8:
        if isinstance(value, ir.BlockArgument):
            break
        op = value.owner.operation
        name = op.name
        steps += name != SHARDING_CONSTRAINT  # (one after every op: no step)
        if name in ("stablehlo.convert", SHARDING_CONSTRAINT):
            value = op.operands[0]
        elif name == "stablehlo.transpose":
            permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
            mapping = [None if m is None else permutation[m] for m in mapping]
            value = op.operands[0]
        elif name == "stablehlo.reshape":
            inner = unit_reshape_map(shape_of(op.operands[0]), shape_of(value))
            if inner is None:
                break
            back = {d: i for i, d in enumerate(inner) if d is not None}
            mapping = [None if m is None else back.get(m) for m in mapping]
            value = op.operands[0]
        else:
            break
    return value, mapping


def pair_roles(dot: ir.Operation, number: int, roles: list[Role],
                other_shape: tuple[int, ...]) -> list[Role | None]:
    """The roles of the other operand's dimensions that ``dot`` pairs with operand
    ``number``'s (batch and contracting); None for its free dimensions."""
    dims = dot_dims(dot)
    mine_batch = list(dims.lhs_batching_dimensions if number == 0
                      else dims.rhs_batching_dimensions)
    other_batch = list(dims.rhs_batching_dimensions if number == 0
                       else dims.lhs_batching_dimensions)
    mine_contract = list(dims.lhs_contracting_dimensions if number == 0
                         else dims.rhs_contracting_dimensions)
    other_contract = list(dims.rhs_contracting_dimensions if number == 0
                          else dims.lhs_contracting_dimensions)
    other: list[Role | None] = [None] * len(other_shape)
    for a, b in zip(mine_batch + mine_contract, other_batch + other_contract):
        other[b] = roles[a]
    return other


def dot_result_roles(dot: ir.Operation, number: int, roles: list[Role],
                         other_roles: list[Role]) -> list[Role]:
    """A dot's result roles: batch, then the lhs's free dimensions, then the rhs's."""
    dims = dot_dims(dot)
    lhs_roles, rhs_roles = (roles, other_roles) if number == 0 else (other_roles, roles)
    lhs_batch = list(dims.lhs_batching_dimensions)
    lhs_free = free_dims(len(lhs_roles), lhs_batch, list(dims.lhs_contracting_dimensions))
    rhs_free = free_dims(len(rhs_roles), list(dims.rhs_batching_dimensions),
                     list(dims.rhs_contracting_dimensions))
    return ([lhs_roles[d] for d in lhs_batch] + [lhs_roles[d] for d in lhs_free]
            + [rhs_roles[d] for d in rhs_free])
