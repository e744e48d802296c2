"""Finding a softmax attention in a module, however it was written, and what a fused
kernel needs to replace it.

A site starts at a ``dot_general`` S = Q·Kᵀ (the scores). Everything its result reaches
without passing through another ``dot_general`` is the site's *cluster*: the forward
chain (scale, mask, softmax) and, in a training step, the backward of that chain. The
``dot_general`` ops that read the cluster are its *exits*, told apart by what they
contract (jax's transposes of the two attention matmuls):

- ``out``: P·V, the attention's output (contracts the key axis; reads P);
- ``dv``: Pᵀ·dO (contracts the query axes; reads P);
- ``dq``: dS·K (contracts the key axis; reads a backward value);
- ``dk``: dSᵀ·Q (contracts the query axes; reads a backward value).

A forward pass has ``out`` alone; a backward pass ``dv``, ``dq`` and ``dk`` (and ``out``
too when jax.checkpoint recomputes the output). The only other values the cluster may
read are constants, the mask and dP = dO·Vᵀ. Replacing the exits' results with a fused
kernel's leaves the whole cluster dead: the S×S scores and probabilities are gone.

Dimensions are told apart by *roles*, read off S's ``dot_general``: ``("B", i)`` for its
batch dimensions (batch, and the key/value heads), ``("Q", j)`` for the query's free
dimensions (the query position and, under grouped-query attention, the group), ``("S",)``
for the key position, ``("H",)`` for the head dimension and ``("Hv",)`` for V's. Every
cluster value gets a role per dimension, through transposes, broadcasts and reductions,
so the exits' layouts are known whatever order the program wrote them in.

The forward chain must be, in any order, converts and transposes, one constant scale, a
select of a mask with a large negative fill, then ``exp(y - row)`` (any per-row value:
it cancels in the softmax) divided by its sum over the key axis. Anything else (an
additive bias read from the program, dropout, a different normalisation, a reader of the
probabilities outside the attention) leaves the site unfused with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import op_key
from hlo_amp.passes.fused_attention.calls import CallView, Stack
from hlo_amp.passes.fused_attention.constants import (
    Folded,
    evaluate,
    splat_value,
    unit_reshape_map,
)

Role = tuple  # ("B", i), ("Q", j), ("S",), ("H",), ("Hv",), ("1",); None: not known yet
S_ROLE, H_ROLE, HV_ROLE, UNIT = ("S",), ("H",), ("Hv",), ("1",)

# A cluster larger than this is no attention's (the scores reach the rest of the program).
MAX_CLUSTER = 400
# A mask's fill is a large negative number (finfo.min, -0.7 * finfo.max, -1e9, -inf).
MASK_FILL = -1e4

_ELEMENTWISE = frozenset({
    "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.divide",
    "stablehlo.negate", "stablehlo.exponential", "stablehlo.maximum",
    "stablehlo.minimum", "stablehlo.select", "stablehlo.convert", "stablehlo.compare",
    "stablehlo.and", "stablehlo.or", "stablehlo.not", "stablehlo.abs", "stablehlo.sign",
})
_LAYOUT = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.reshape",
                     "stablehlo.transpose", "stablehlo.reduce"})
CLUSTER_OPS = _ELEMENTWISE | _LAYOUT
_DOT = "stablehlo.dot_general"


class NotFused(Exception):
    """Why a site is not fused; ``attention`` says whether it is an attention at all."""

    def __init__(self, reason: str, attention: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.attention = reason, attention


@dataclass
class Exit:
    """One exit ``dot_general`` and the roles of its result's dimensions."""

    op: ir.Operation
    roles: list[Role]


@dataclass
class Match:
    """An attention site as the fused kernel sees it (all values in the home block)."""

    home: ir.Block
    scores: ir.Operation  # S = Q·Kᵀ
    q: ir.Value
    k: ir.Value
    q_roles: list[Role]
    k_roles: list[Role]
    sizes: dict[Role, int]
    scale: float
    causal: bool
    # Values of the home block, each with the role of each dimension (None: size 1 or
    # broadcast), whose AND is where attention may look; empty: nowhere masked.
    mask_leaves: list[tuple[ir.Value, list[Role | None]]]
    exits: dict[str, Exit]
    v: ir.Value | None = None
    v_roles: list[Role] = field(default_factory=list)
    d_out: ir.Value | None = None  # dO, the gradient of the output (a training step)
    d_out_roles: list[Role] = field(default_factory=list)
    t_role: Role = ("Q", 0)  # the query position among the query's free dimensions
    cluster_size: int = 0
    # The cluster's ops in the home block: dead once the exits are replaced.
    home_ops: list[ir.Operation] = field(default_factory=list)

    @property
    def training(self) -> bool:
        return "dq" in self.exits

    @property
    def b_roles(self) -> list[Role]:
        return sorted(r for r in self.sizes if r[0] == "B")

    @property
    def q_free_roles(self) -> list[Role]:
        return sorted(r for r in self.sizes if r[0] == "Q")


# ---- roles -------------------------------------------------------------------------------


def _shape(value: ir.Value) -> tuple[int, ...]:
    return tuple(ir.RankedTensorType(value.type).shape)


def _dims(op: ir.Operation) -> hlo.DotDimensionNumbers:
    return hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])


def _free(rank: int, *used: list[int]) -> list[int]:
    taken = {d for dims in used for d in dims}
    return [d for d in range(rank) if d not in taken]


def _unify(lists: list[list[Role] | None]) -> list[Role] | None:
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


def _result_roles(op: ir.Operation, inputs: list[list[Role] | None]) -> list[Role] | None:
    """The roles of ``op``'s result from its operands' (None where not known)."""
    name = op.name
    if name in _ELEMENTWISE:
        shapes = [_shape(v) for v in op.operands]
        result = _shape(op.results[0])
        same = [r for r, s in zip(inputs, shapes) if s == result]
        return _unify(same)
    source = inputs[0]
    if source is None:
        return None
    if name == "stablehlo.transpose":
        permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
        return [source[p] for p in permutation]
    if name == "stablehlo.broadcast_in_dim":
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
        result = _shape(op.results[0])
        operand = _shape(op.operands[0])
        roles: list[Role | None] = [UNIT if size == 1 else None for size in result]
        for i, d in enumerate(dims):
            if operand[i] == result[d]:
                roles[d] = source[i]
        return roles
    if name == "stablehlo.reduce":
        dims = set(ir.DenseI64ArrayAttr(op.attributes["dimensions"]))
        return [r for d, r in enumerate(source) if d not in dims]
    if name == "stablehlo.reshape":
        mapping = unit_reshape_map(_shape(op.operands[0]), _shape(op.results[0]))
        if mapping is None:
            raise NotFused("a reshape merges or splits the scores' dimensions")
        roles = [UNIT] * len(_shape(op.results[0]))
        for i, d in enumerate(mapping):
            if d is not None:
                roles[d] = source[i]
        return roles
    return None


# ---- the site ------------------------------------------------------------------------------


class _Site:
    """The analysis of one candidate scores op; ``match()`` returns a Match or raises
    NotFused."""

    def __init__(self, view: CallView, scores: ir.Operation) -> None:
        self.view = view
        self.scores = scores
        self.home = scores.block
        self.memo: dict = {}
        # Cluster ops by (op key, stack), in the order found.
        self.ops: dict[tuple[int, Stack], tuple[ir.Operation, Stack]] = {}
        self.values: set[tuple[ir.Value, Stack]] = {(scores.results[0], ())}
        self.roles: dict[tuple[ir.Value, Stack], list[Role] | None] = {}
        self.exits: list[tuple[ir.Operation, int]] = []
        self.escapes: list[str] = []
        self.role_error: NotFused | None = None
        self._canon: dict[tuple[ir.Value, Stack], tuple[ir.Value, Stack]] = {}

    # -- the cluster ----------------------------------------------------------------------

    def walk(self) -> None:
        queue = [(self.scores.results[0], ())]
        while queue:
            value, stack = queue.pop()
            for reader, number, reader_stack in self.view.readers(value, stack):
                name = reader.name
                if name == _DOT:
                    if reader_stack:
                        self.escapes.append("a matrix op inside a called function reads "
                                            "them")
                    elif all(e[0] != reader for e in self.exits):
                        self.exits.append((reader, number))
                    else:
                        self.escapes.append("a matrix op reads them twice")
                    continue
                if name not in CLUSTER_OPS:
                    what = ("the function returns them" if name == "func.return" else
                            f"{name.split('.')[-1]} reads them")
                    self.escapes.append(what)
                    continue
                key = (op_key(reader), reader_stack)
                if key in self.ops:
                    continue
                if len(self.ops) >= MAX_CLUSTER:
                    self.escapes.append(f"they reach more than {MAX_CLUSTER} ops")
                    return
                self.ops[key] = (reader, reader_stack)
                for result in reader.results:
                    self.values.add((result, reader_stack))
                    queue.append((result, reader_stack))

    def canon(self, value: ir.Value, stack: Stack) -> tuple[ir.Value, Stack]:
        """The value as the op that makes it sees it (a call's result is the callee's
        returned value, a callee's argument the call's operand): one key per value."""
        key = (value, stack)
        found = self._canon.get(key)
        if found is None:
            _op, made, made_stack = self.view.producer(value, stack)
            found = self._canon[key] = (made, made_stack)
        return found

    def role(self, value: ir.Value, stack: Stack) -> list[Role] | None:
        return self.roles.get(self.canon(value, stack))

    def in_cluster(self, value: ir.Value, stack: Stack) -> bool:
        return self.canon(value, stack) in self.values

    # -- roles ------------------------------------------------------------------------------

    def assign_roles(self) -> None:
        dims = _dims(self.scores)
        lhs, rhs = self.scores.operands[0], self.scores.operands[1]
        lhs_batch = list(dims.lhs_batching_dimensions)
        rhs_batch = list(dims.rhs_batching_dimensions)
        lhs_free = _free(len(_shape(lhs)), lhs_batch, list(dims.lhs_contracting_dimensions))
        rhs_free = _free(len(_shape(rhs)), rhs_batch, list(dims.rhs_contracting_dimensions))
        self.roles[(self.scores.results[0], ())] = (
            [("B", i) for i in range(len(lhs_batch))] + [("L", j) for j in range(len(lhs_free))]
            + [("R", j) for j in range(len(rhs_free))])
        for _round in range(8):
            changed = False
            for op, stack in self.ops.values():
                inputs = [self.role(v, stack) for v in op.operands]
                key = (op.results[0], stack)
                old = self.roles.get(key)
                try:
                    result = _result_roles(op, inputs)
                    if result is None:
                        continue
                    merged = _unify([old, result]) if old is not None else result
                except NotFused as error:  # an error only if this is an attention
                    self.role_error = self.role_error or error
                    continue
                if merged != old:
                    self.roles[key] = merged
                    changed = True
                if op.name in _ELEMENTWISE:  # an entry (dP, a bias) gets the op's roles
                    for v in op.operands:
                        entry = self.canon(v, stack)
                        if (entry not in self.values and _shape(v) == _shape(op.results[0])
                                and self.roles.get(entry) != merged):
                            try:
                                self.roles[entry] = _unify([self.roles.get(entry), merged])
                            except NotFused as error:
                                self.role_error = self.role_error or error
                                continue
                            changed = True
            if not changed:
                break

    def rename(self, mapping: dict[Role, Role]) -> None:
        for key, roles in self.roles.items():
            if roles is not None:
                self.roles[key] = [mapping.get(r, r) for r in roles]

    # -- the forward chain --------------------------------------------------------------------

    def forward_chain(self) -> tuple[tuple[ir.Value, Stack], int, float, list]:
        """(P, the softmax's axis in P's producer, scale, mask selects) or NotFused."""
        exps = [(op, st) for op, st in self.ops.values() if op.name == "stablehlo.exponential"]
        if not exps:
            raise NotFused("no softmax", attention=False)
        if len(exps) > 1:
            raise NotFused("more than one exponential follows the scores", attention=False)
        exp, stack = exps[0]
        normalised = self._normalisation(exp, stack)
        if normalised is None:
            raise NotFused("no softmax normalisation (exp over its sum) follows the scores",
                           attention=False)
        divide, reduce_dim = normalised
        roles = self.roles.get((divide.results[0], stack))
        key_role = roles[reduce_dim] if roles is not None and len(roles) > reduce_dim else None
        if key_role is None:
            raise NotFused("the softmax's dimensions could not be read", attention=False)
        scale, masks = self._to_scores(exp, stack, key_role)
        return (divide.results[0], stack), reduce_dim, scale, masks

    def _strip(self, value: ir.Value, stack: Stack) -> tuple[ir.Value, Stack]:
        """``value`` before converts (seen through calls)."""
        while True:
            op, value, stack = self.view.producer(value, stack)
            if op is None or op.name != "stablehlo.convert":
                return value, stack
            value = op.operands[0]

    def _normalisation(self, exp: ir.Operation, stack: Stack
                       ) -> tuple[ir.Operation, int] | None:
        """The ``divide(e, broadcast(sum(e)))`` after ``exp`` and the summed axis."""
        e = (exp.results[0], stack)
        for op, op_stack in self.ops.values():
            if op.name != "stablehlo.divide":
                continue
            if self._strip(op.operands[0], op_stack) != e:
                continue
            producer, _, p_stack = self.view.producer(op.operands[1], op_stack)
            while producer is not None and producer.name in (
                    "stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert"):
                producer, _, p_stack = self.view.producer(producer.operands[0], p_stack)
            if producer is None or producer.name != "stablehlo.reduce":
                continue
            if self._strip(producer.operands[0], p_stack) != e:
                continue
            if not _is_sum(producer):
                continue
            dims = list(ir.DenseI64ArrayAttr(producer.attributes["dimensions"]))
            if len(dims) != 1:
                continue
            return op, dims[0]
        return None

    def _to_scores(self, exp: ir.Operation, stack: Stack, key_role: Role
                   ) -> tuple[float, list]:
        """Walk from exp's input back to the scores: the scale and the mask selects."""
        value = exp.operands[0]
        op, value, stack = self.view.producer(value, stack)
        if op is not None and op.name == "stablehlo.subtract":
            row, row_stack = op.operands[1], stack
            if not self._is_row_value(row, row_stack, key_role):
                raise NotFused("the softmax subtracts a value that varies along the keys")
            value = op.operands[0]
        scale = 1.0
        masks: list[tuple[ir.Value, Stack, bool, ir.Operation]] = []
        target = self.scores.results[0]
        for _step in range(32):
            if value == target and stack == ():
                return scale, masks
            op, value, stack = self.view.producer(value, stack)
            if op is None:
                raise NotFused("the softmax's input is not computed from the scores")
            if value == target and stack == ():
                return scale, masks
            name = op.name
            operands = list(op.operands)
            if name in ("stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape"):
                value = operands[0]
                continue
            chain = [i for i, v in enumerate(operands) if self.in_cluster(v, stack)]
            if name in ("stablehlo.multiply", "stablehlo.divide") and len(chain) == 1:
                other = splat_value(self.view, operands[1 - chain[0]], stack)
                if other is None or other == 0 or (name == "stablehlo.divide" and chain[0] != 0):
                    raise NotFused(f"the scores are scaled by a {name.split('.')[-1]} "
                                   "that is not a constant")
                scale *= other if name == "stablehlo.multiply" else 1.0 / other
                value = operands[chain[0]]
                continue
            if name == "stablehlo.select" and chain and chain[0] in (1, 2) and len(chain) == 1:
                fill = splat_value(self.view, operands[3 - chain[0]], stack)
                if fill is None or fill > MASK_FILL:
                    raise NotFused("the scores are selected against a value that is not a "
                                   "large negative constant (a mask's fill)")
                masks.append((operands[0], stack, chain[0] == 2, op))
                value = operands[chain[0]]
                continue
            if name == "stablehlo.add" and len(chain) == 1:
                raise NotFused("an additive bias on the scores (cuDNN's bias is not used "
                               "for a bias the program computes)")
            raise NotFused(f"{name.split('.')[-1]} between the scores and the softmax")
        raise NotFused("too many ops between the scores and the softmax")

    def _is_row_value(self, value: ir.Value, stack: Stack, key_role: Role) -> bool:
        """Whether ``value`` (subtracted before exp) is constant along the key axis."""
        op, value, stack = self.view.producer(value, stack)
        while op is not None and op.name in ("stablehlo.broadcast_in_dim",
                                             "stablehlo.reshape", "stablehlo.convert"):
            inner = op.operands[0]
            roles = self.role(inner, stack)
            if roles is not None and key_role not in roles and None not in roles:
                return True
            op, value, stack = self.view.producer(inner, stack)
        roles = self.role(value, stack)
        return roles is not None and key_role not in roles and None not in roles

    # -- the mask ------------------------------------------------------------------------------

    def mask(self, selects: list, roles_of_select: list[list[Role]]
             ) -> tuple[Folded | None, list[tuple[ir.Value, list[Role | None]]],
                        list[Role]]:
        """The constant part (evaluated, over select dimensions mapped to roles) and the
        program's mask values (in the home block) of every mask select."""
        constant: list[tuple[Folded, list[Role]]] = []
        leaves: list[tuple[ir.Value, list[Role | None]]] = []
        for (pred, stack, negated, _select), roles in zip(selects, roles_of_select):
            if negated:
                raise NotFused("the mask selects the fill where it is true")
            shape = _shape(pred)
            self._leaves(pred, stack, list(range(len(shape))), roles, constant, leaves)
        folded = None
        axis_roles: list[Role] = []
        if constant:
            axis_roles = sorted({rs[a] for f, rs in constant for a in f.axes})
            arrays = []
            for f, rs in constant:
                f_roles = [rs[a] for a in f.axes]
                order = sorted(range(len(f_roles)), key=lambda i: axis_roles.index(f_roles[i]))
                array = np.transpose(f.array, order) if order else f.array
                shape = [self.sizes[r] if r in f_roles else 1 for r in axis_roles]
                arrays.append(np.broadcast_to(array.reshape(shape),
                                              [self.sizes[r] for r in axis_roles]))
            combined = np.logical_and.reduce(arrays) if len(arrays) > 1 else arrays[0]
            folded = Folded(np.asarray(combined, dtype=bool), tuple(range(len(axis_roles))),
                            tuple(self.sizes[r] for r in axis_roles))
        return folded, leaves, axis_roles

    def _leaves(self, value: ir.Value, stack: Stack, dims: list[int | None],
                roles: list[Role], constant: list, leaves: list) -> None:
        """Split the mask ``value`` (its dimension i is the select's ``dims[i]``) into
        ANDed parts: evaluated constants, or values of the home block."""
        shape = _shape(value)
        folded = evaluate(self.view, value, stack, self.memo)
        if folded is not None:
            if folded.array.dtype != bool:
                raise NotFused("the mask is not boolean")
            if not folded.array.all():
                select_dims = [dims[a] for a in folded.axes]
                if None in select_dims and folded.array.size > 1:
                    raise NotFused("the mask varies along a dimension the scores lack")
                keep = [i for i, d in enumerate(select_dims) if d is not None]
                array = folded.array.reshape([folded.array.shape[i] for i in keep])
                full_roles = list(roles)
                constant.append((Folded(array, tuple(select_dims[i] for i in keep),
                                        tuple(self.scores_shape_of(roles))), full_roles))
            return
        op, value, stack = self.view.producer(value, stack)
        if op is None or stack == () and op.name not in (
                "stablehlo.and", "stablehlo.broadcast_in_dim", "stablehlo.transpose",
                "stablehlo.reshape"):
            if stack != ():
                raise NotFused("the mask is computed inside a called function")
            leaves.append((value, [None if d is None else roles[d] for d in dims]))
            return
        name = op.name
        if name == "stablehlo.and":
            for operand in op.operands:
                self._leaves(operand, stack, dims, roles, constant, leaves)
            return
        if name == "stablehlo.broadcast_in_dim":
            inner = op.operands[0]
            bdims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
            inner_shape = _shape(inner)
            new = [dims[b] if inner_shape[i] == shape[b] else None for i, b in enumerate(bdims)]
            self._leaves(inner, stack, new, roles, constant, leaves)
            return
        if name == "stablehlo.transpose":
            permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
            new: list[int | None] = [None] * len(permutation)
            for i, p in enumerate(permutation):
                new[p] = dims[i]
            self._leaves(op.operands[0], stack, new, roles, constant, leaves)
            return
        if name == "stablehlo.reshape":
            mapping = unit_reshape_map(_shape(op.operands[0]), shape)
            if mapping is None:
                raise NotFused("the mask is reshaped")
            new = [None if m is None else dims[m] for m in mapping]
            self._leaves(op.operands[0], stack, new, roles, constant, leaves)
            return
        if stack != ():
            raise NotFused(f"the mask is computed inside a called function ({name})")
        leaves.append((value, [None if d is None else roles[d] for d in dims]))

    def scores_shape_of(self, roles: list[Role]) -> list[int]:
        return [self.sizes.get(r, 1) for r in roles]

    # -- the exits -----------------------------------------------------------------------------

    def match(self) -> Match:
        self.walk()
        self.assign_roles()
        p_value, reduce_dim, scale, selects = self.forward_chain()
        # The key axis is the summed one: the operand whose free dimension it is is K.
        exp_roles = self._roles_of_normalised(p_value, reduce_dim)
        key_role = exp_roles[reduce_dim]
        if key_role is None or key_role[0] not in ("L", "R"):
            raise NotFused("the softmax does not run along the keys", attention=False)
        q_side = "R" if key_role[0] == "L" else "L"
        sides = [r for rs in self.roles.values() if rs for r in rs
                 if r is not None and r[0] == key_role[0]]
        if len(set(sides)) != 1:
            raise NotFused("the keys have more than one free dimension")
        mapping = {key_role: S_ROLE}
        q_count = len({r for rs in self.roles.values() if rs for r in rs
                       if r is not None and r[0] == q_side})
        for j in range(q_count):
            mapping[(q_side, j)] = ("Q", j)
        self.rename(mapping)
        q_index = 0 if q_side == "L" else 1
        self._set_operand_roles(q_index)
        p_like = self._p_like(p_value)
        exits = self._classify_exits(p_like)
        if "out" not in exits and "dv" not in exits:
            raise NotFused("no matrix op reads the probabilities", attention=False)
        if self.role_error is not None:
            raise self.role_error
        if self.escapes:
            raise NotFused(f"the scores or probabilities have another reader: "
                           f"{self.escapes[0]}")
        if set(exits) not in ({"out"}, {"dv", "dq", "dk"}, {"out", "dv", "dq", "dk"}):
            raise NotFused("only part of the attention's backward reads it "
                           f"({', '.join(sorted(exits))})")
        roles_of_selects = [self.roles.get((op.results[0], st)) for _, st, _, op in selects]
        if any(r is None or None in r for r in roles_of_selects):
            raise NotFused("the mask's dimensions could not be read")
        folded, leaves, axis_roles = self.mask(selects, roles_of_selects)
        match = Match(home=self.home, scores=self.scores, q=self.q, k=self.k,
                      q_roles=self.q_roles, k_roles=self.k_roles, sizes=self.sizes,
                      scale=scale, causal=False, mask_leaves=leaves, exits={},
                      cluster_size=len(self.ops),
                      home_ops=[op for op, stack in self.ops.values() if not stack])
        self._fill_exits(match, exits)
        match.t_role = self._query_axis(folded, axis_roles, leaves)
        if folded is not None:
            match.causal = self._is_causal(folded, axis_roles, match.t_role)
        self._check_leaves(match)
        return match

    def _roles_of_normalised(self, p_value: tuple[ir.Value, Stack], reduce_dim: int
                             ) -> list[Role]:
        # The divide's operand e has P's roles; the reduce read e itself.
        roles = self.roles.get(p_value)
        if roles is None or len(roles) <= reduce_dim:
            raise NotFused("the softmax's dimensions could not be read", attention=False)
        return roles

    def _set_operand_roles(self, q_index: int) -> None:
        dims = _dims(self.scores)
        batch = [list(dims.lhs_batching_dimensions), list(dims.rhs_batching_dimensions)]
        contracting = [list(dims.lhs_contracting_dimensions),
                       list(dims.rhs_contracting_dimensions)]
        operands = list(self.scores.operands)
        if len(contracting[0]) != 1:
            raise NotFused("the scores contract more than one head dimension")
        roles_of = []
        for side in (0, 1):
            shape = _shape(operands[side])
            roles: list[Role] = [None] * len(shape)
            for i, d in enumerate(batch[side]):
                roles[d] = ("B", i)
            roles[contracting[side][0]] = H_ROLE
            free = _free(len(shape), batch[side], contracting[side])
            for j, d in enumerate(free):
                roles[d] = ("Q", j) if side == q_index else S_ROLE
            roles_of.append(roles)
        self.q, self.k = operands[q_index], operands[1 - q_index]
        self.q_roles, self.k_roles = roles_of[q_index], roles_of[1 - q_index]
        self.sizes: dict[Role, int] = {}
        for value, roles in ((self.q, self.q_roles), (self.k, self.k_roles)):
            for role, size in zip(roles, _shape(value)):
                self.sizes[role] = size

    def _p_like(self, p_value: tuple[ir.Value, Stack]) -> set[tuple[ir.Value, Stack]]:
        """P and what converts, transposes and unit reshapes make of it."""
        found = {p_value}
        changed = True
        while changed:
            changed = False
            for op, stack in self.ops.values():
                if op.name in ("stablehlo.convert", "stablehlo.transpose",
                               "stablehlo.reshape") and self.canon(op.operands[0],
                                                                   stack) in found:
                    key = (op.results[0], stack)
                    if key not in found:
                        found.add(key)
                        changed = True
        return found

    def _classify_exits(self, p_like: set) -> dict[str, tuple[ir.Operation, int]]:
        q_roles = {r for r in self.q_roles if r[0] == "Q"}
        found: dict[str, tuple[ir.Operation, int]] = {}
        for op, number in self.exits:
            value = op.operands[number]
            roles = self.role(value, ())
            if roles is None or None in roles:
                raise NotFused("a matrix op reads a cluster value whose dimensions are not "
                               "known")
            dims = _dims(op)
            contracting = list(dims.lhs_contracting_dimensions if number == 0
                               else dims.rhs_contracting_dimensions)
            contracted = {roles[d] for d in contracting}
            reads_p = self.canon(value, ()) in p_like
            if contracted == {S_ROLE}:
                kind = "out" if reads_p else "dq"
            elif contracted == q_roles:
                kind = "dv" if reads_p else "dk"
            else:
                raise NotFused("a matrix op reads the probabilities along other dimensions")
            if kind in found:
                raise NotFused(f"two matrix ops read the attention as its {kind}")
            found[kind] = (op, number)
        return found

    def _fill_exits(self, match: Match, exits: dict) -> None:
        base_q, base_k = _base(self.q), _base(self.k)
        for kind, (op, number) in exits.items():
            value = op.operands[number]
            other = op.operands[1 - number]
            roles = self.role(value, ())
            other_roles = _pair_roles(op, number, roles, _shape(other))
            if kind in ("out", "dv"):
                free = [i for i, r in enumerate(other_roles) if r is None]
                if len(free) != 1:
                    raise NotFused("V (or dO) has more than one free dimension")
                other_roles[free[0]] = HV_ROLE
            else:
                free = [i for i, r in enumerate(other_roles) if r is None]
                if len(free) != 1:
                    raise NotFused("a backward matrix op has more than one free dimension")
                other_roles[free[0]] = H_ROLE
                expected = (base_k if kind == "dq" else base_q)
                if _base(other)[0] != expected[0]:
                    raise NotFused(f"the {kind} matrix op reads another "
                                   f"{'key' if kind == 'dq' else 'query'}")
            result = _result_roles_of_dot(op, number, roles, other_roles)
            match.exits[kind] = Exit(op, result)
            if kind == "out":
                match.v, match.v_roles = other, other_roles
            elif kind == "dv":
                match.d_out, match.d_out_roles = other, other_roles
        if match.training and match.v is None:
            match.v, match.v_roles = self._v_from_dp(match)
        for role in match.v_roles:
            if role == HV_ROLE:
                size = _shape(match.v)[match.v_roles.index(HV_ROLE)]
                self.sizes[HV_ROLE] = size
        if self.sizes.get(HV_ROLE) != self.sizes.get(H_ROLE):
            raise NotFused("V's head dimension differs from Q's and K's")

    def _v_from_dp(self, match: Match) -> tuple[ir.Value, list[Role]]:
        """V from dP = dO·Vᵀ, the one matrix op whose result the backward cluster reads."""
        d_out_base = _base(match.d_out)[0]
        for op, stack in self.ops.values():
            for value in op.operands:
                if self.in_cluster(value, stack) or stack:
                    continue
                producer = value.owner.operation
                steps = 0
                while (not isinstance(value, ir.BlockArgument) and steps < 4
                       and producer.name in ("stablehlo.transpose", "stablehlo.convert",
                                             "stablehlo.reshape")):
                    value = producer.operands[0]
                    producer = value.owner.operation
                    steps += 1
                if isinstance(value, ir.BlockArgument) or producer.name != _DOT:
                    continue
                operands = list(producer.operands)
                bases = [_base(v)[0] for v in operands]
                if d_out_base not in bases:
                    continue
                d_index = bases.index(d_out_base)
                v = operands[1 - d_index]
                return v, self._v_roles_from_dp(producer, 1 - d_index, match)
        raise NotFused("dP = dO·Vᵀ was not found in the backward pass")

    def _v_roles_from_dp(self, dot: ir.Operation, v_index: int, match: Match) -> list[Role]:
        """V's roles in dP = dO·Vᵀ: paired with dO's batch dimensions, its contracting
        one is the head dimension, its free one the keys."""
        d_index = 1 - v_index
        d_value = dot.operands[d_index]
        d_base, d_map = _base(d_value)
        dout_base, dout_map = _base(match.d_out)
        if d_base != dout_base:
            raise NotFused("dP reads another dO")
        # dO's roles in the base's dimensions, then in this operand's.
        base_roles: dict[int, Role] = {}
        for i, m in enumerate(dout_map):
            if m is not None:
                base_roles[m] = match.d_out_roles[i]
        d_roles = [UNIT if m is None else base_roles.get(m) for m in d_map]
        v_roles = _pair_roles(dot, d_index, d_roles, _shape(dot.operands[v_index]))
        free = [i for i, r in enumerate(v_roles) if r is None]
        if len(free) != 1:
            raise NotFused("V has more than one free dimension")
        v_roles[free[0]] = S_ROLE
        return v_roles

    def _query_axis(self, folded: Folded | None, axis_roles: list[Role],
                    leaves: list) -> Role:
        """The query position among the query's free dimensions: the one the mask varies
        along, else the longest."""
        candidates = self.q_free_roles_of()
        varying = {r for r in axis_roles if r in candidates} if folded is not None else set()
        for _value, roles in leaves:
            varying |= {r for r in roles if r in candidates}
        if len(varying) > 1:
            raise NotFused("the mask varies along more than one query dimension")
        if varying:
            return varying.pop()
        return max(candidates, key=lambda r: (self.sizes[r], -r[1]))

    def q_free_roles_of(self) -> list[Role]:
        return [r for r in self.q_roles if r[0] == "Q"]

    def _is_causal(self, folded: Folded, axis_roles: list[Role], t_role: Role) -> bool:
        if set(axis_roles) - {t_role, S_ROLE}:
            raise NotFused("a constant mask that varies along the batch or heads")
        if set(axis_roles) != {t_role, S_ROLE}:
            raise NotFused("a constant mask that is not causal")
        array = folded.array
        if axis_roles.index(t_role) != 0:
            array = array.T
        t, s = array.shape
        if t != s or not np.array_equal(array, np.tril(np.ones((t, s), dtype=bool))):
            raise NotFused("a constant mask that is not causal (cuDNN takes causal or a "
                           "bias)")
        return True

    def _check_leaves(self, match: Match) -> None:
        for _value, roles in match.mask_leaves:
            if HV_ROLE in roles or H_ROLE in roles:
                raise NotFused("the mask has a head dimension")


def _is_sum(reduce: ir.Operation) -> bool:
    body = reduce.regions[0].blocks[0]
    names = [op.operation.name for op in body.operations]
    return names[:1] == ["stablehlo.add"]


def _base(value: ir.Value) -> tuple[ir.Value, list[int | None]]:
    """``value`` before transposes, converts and unit reshapes in its block, and each of
    its dimensions' dimension there (None: a size-1 one added)."""
    mapping: list[int | None] = list(range(len(_shape(value))))
    for _step in range(8):
        if isinstance(value, ir.BlockArgument):
            break
        op = value.owner.operation
        name = op.name
        if name == "stablehlo.convert":
            value = op.operands[0]
        elif name == "stablehlo.transpose":
            permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
            mapping = [None if m is None else permutation[m] for m in mapping]
            value = op.operands[0]
        elif name == "stablehlo.reshape":
            inner = unit_reshape_map(_shape(op.operands[0]), _shape(value))
            if inner is None:
                break
            back = {d: i for i, d in enumerate(inner) if d is not None}
            mapping = [None if m is None else back.get(m) for m in mapping]
            value = op.operands[0]
        else:
            break
    return value, mapping


def _pair_roles(dot: ir.Operation, number: int, roles: list[Role],
                other_shape: tuple[int, ...]) -> list[Role | None]:
    """The roles of the other operand's dimensions that ``dot`` pairs with operand
    ``number``'s (batch and contracting); None for its free dimensions."""
    dims = _dims(dot)
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


def _result_roles_of_dot(dot: ir.Operation, number: int, roles: list[Role],
                         other_roles: list[Role]) -> list[Role]:
    """A dot's result roles: batch, then the lhs's free dimensions, then the rhs's."""
    dims = _dims(dot)
    lhs_roles, rhs_roles = (roles, other_roles) if number == 0 else (other_roles, roles)
    lhs_batch = list(dims.lhs_batching_dimensions)
    lhs_free = _free(len(lhs_roles), lhs_batch, list(dims.lhs_contracting_dimensions))
    rhs_free = _free(len(rhs_roles), list(dims.rhs_batching_dimensions),
                     list(dims.rhs_contracting_dimensions))
    return ([lhs_roles[d] for d in lhs_batch] + [lhs_roles[d] for d in lhs_free]
            + [rhs_roles[d] for d in rhs_free])


def match_site(view: CallView, scores: ir.Operation) -> Match:
    """The attention starting at ``scores`` (a ``dot_general``), or NotFused."""
    return _Site(view, scores).match()


def flops(match: Match) -> int:
    """Multiply-adds x 2 of the attention's two forward matmuls."""
    b = math.prod(match.sizes[r] for r in match.b_roles)
    q = math.prod(match.sizes[r] for r in match.q_free_roles)
    return 2 * 2 * b * q * match.sizes[S_ROLE] * match.sizes[H_ROLE]
