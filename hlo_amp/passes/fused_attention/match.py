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
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import function_name, op_key, walk_operations
from hlo_amp.ir.op_classes import rounds_to_its_own_type
from hlo_amp.ir.sites import site_of
from hlo_amp.passes.fused_attention.calls import CallView, Stack
from hlo_amp.passes.fused_attention.constants import splat_value
from hlo_amp.passes.fused_attention.exits import ExitReading
from hlo_amp.passes.fused_attention.masks import MaskReading
from hlo_amp.passes.fused_attention.roles import (
    DROPOUT,
    ELEMENTWISE,
    H_ROLE,
    S_ROLE,
    NotFused,
    Role,
    dot_dims,
    free_dims,
    result_roles,
    shape_of,
    unify,
)
from hlo_amp.passes.fused_attention.site import Match

# The op kinds of a softmax's gradient from dP to dS (jax's and a hand-written one's).
_GRADIENT_OPS = frozenset({
    "stablehlo.multiply", "stablehlo.divide", "stablehlo.subtract", "stablehlo.add",
    "stablehlo.negate", "stablehlo.select", "stablehlo.convert", "stablehlo.broadcast_in_dim",
    "stablehlo.reshape", "stablehlo.transpose", "stablehlo.reduce"})
# A cluster larger than this is no attention's (the scores reach the rest of the program).
MAX_CLUSTER = 400
# A mask's fill is a large negative number (finfo.min, -0.7 * finfo.max, -1e9, -inf).
MASK_FILL = -1e4

_LAYOUT = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.reshape",
                     "stablehlo.transpose", "stablehlo.reduce"})
CLUSTER_OPS = ELEMENTWISE | _LAYOUT
_DOT = "stablehlo.dot_general"
# How far the ops after a matrix op are followed before the walk decides (a scale, a
# mask, a cast, the row maximum's reduction, its broadcast and the subtraction take eight
# to a softmax's exponential).
_NEAR = 24
# ... and how many values: a residual stream goes on; a sum's chain ends in a few.
_NEAR_VALUES = 48
_NEAR_THROUGH = frozenset({"stablehlo.tanh", "stablehlo.reduce_precision"})


def _along_queries(direction: str) -> NotFused:
    """A softmax along the queries: the roles take the summed axis for the keys, so the
    axis P·V contracts reads as the queries."""
    error = NotFused("the softmax runs along the queries, not along the axis P·V "
                     "contracts (the keys)")
    error.direction = direction
    return error


def _direction_swapped(exits: dict[str, tuple[ir.Operation, int]], view: CallView
                       ) -> str | None:
    """The direction of a training step's attention whose softmax runs along the
    queries, read off its matrix ops' locations: its forward P·V reads as ``dv`` and
    dV = Pᵀ·dO, a backward op, as ``out``. None where the roles agree with the
    locations, or no location names a backward op (nothing to tell by)."""
    backward = {kind: site_of(op.location, "dot_general", view.prefix_of(op)).gradient_pass
                for kind, (op, _) in exits.items()}
    if not any(backward.values()):
        return None
    if backward.get("dv") is False:  # P·V in the forward pass
        return "forward and backward"
    return "backward" if backward.get("out") else None


def _partial(which: str, forward: bool = False) -> NotFused:
    """A backward pass that reads only part of the attention (``which``); ``forward``:
    the step computes the output too."""
    error = NotFused(f"only part of the attention's backward reads it ({which})")
    error.direction = "forward and backward" if forward else "backward"
    return error


# ---- the site ------------------------------------------------------------------------------


class _Site(MaskReading, ExitReading):
    """The analysis of one candidate scores op; ``match()`` returns a Match or raises
    NotFused."""

    def __init__(self, view: CallView, scores: ir.Operation) -> None:
        self.view = view
        self.scores = scores
        self.home = scores.block
        self.memo = view.constants  # evaluated constants, shared by every site
        # Cluster ops by (op key, stack), in the order found.
        self.ops: dict[tuple[int, Stack], tuple[ir.Operation, Stack]] = {}
        self.values: set[tuple[ir.Value, Stack]] = {(scores.results[0], ())}
        self.roles: dict[tuple[ir.Value, Stack], list[Role] | None] = {}
        self.exits: list[tuple[ir.Operation, int]] = []
        self.escapes: list[str] = []
        self.role_error: NotFused | None = None
        # softmax(where=): the divide's sum reads select(where, exp, 0), and P is zeroed
        # where masked; read as a softmax so the site is found, then refused.
        self.masked_sum = False
        # The forward returns the probabilities to a backward in another function (as
        # its results ``returned``).
        self.split_backward = False
        self.returned: list[int] = []
        # The exponential is divided by its sum plus a term (exp / (sum + eps)).
        self.shifted_sum = False
        self._canon: dict[tuple[ir.Value, Stack], tuple[ir.Value, Stack]] = {}
        # The constants the scores are multiplied by on their way to the softmax (a
        # divide's as its reciprocal): the backward multiplies the gradient by each once.
        self.scale_factors: list[float] = []

    # -- the cluster ----------------------------------------------------------------------

    def walk(self, start: ir.Value | None = None) -> None:
        """The cluster and its exits, from the scores (or from ``start``)."""
        queue = [(self.scores.results[0] if start is None else start, ())]
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
                    if name == "func.return" and self.view.returned_to_calls(self.home,
                                                                              number):
                        self.split_backward = True
                        self.returned.append(number)
                        self.escapes.append(
                            "its function returns them to another function's backward "
                            "(a jax.jit inside the differentiated function, or a scan body "
                            "without jax.checkpoint, puts the forward and backward in two "
                            "functions, which the pass does not fuse across: drop the "
                            "inner jax.jit, or checkpoint the scan body)")
                        continue
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

    def matmuls_found(self) -> list[ir.Operation]:
        """The matmuls of the attention as far as the walk got: the scores', those that
        read the cluster (P·V, and a training step's Pᵀ·dO, dS·K, dSᵀ·Q), also inside
        called functions, and those whose results enter it (dP = dO·Vᵀ)."""
        found = {op_key(self.scores): self.scores}
        for op, _number in self.exits:
            found.setdefault(op_key(op), op)
        for op, stack in self.ops.values():
            for value in op.operands:
                if self.in_cluster(value, stack):
                    continue
                made, _value, _stack = self.view.producer(value, stack)
                if made is not None and made.name == _DOT:
                    found.setdefault(op_key(made), made)
            for result in op.results:
                for reader, _number, _stack in self.view.readers(result, stack):
                    if reader.name == _DOT:
                        found.setdefault(op_key(reader), reader)
        # The backward in another function: the matmuls that read what the forward
        # returns it, through elementwise and layout ops (dV = Pᵀ·dO, dS·K, dSᵀ·Q).
        parent = self.home.owner
        parent = getattr(parent, "operation", parent)
        callers = self.view.callers.get(ir.StringAttr(parent.attributes["sym_name"]).value,
                                        []) if self.returned and parent is not None else []
        queue = [(call.results[n], ()) for call in callers for n in self.returned]
        # And past jax.checkpoint's save of the scores or probabilities (a policy that
        # saves them): the backward's softmax recomputed from the saved copy, and its
        # matmuls (hunt h108: they went fp8 with the site refused).
        for value, stack in [(self.scores.results[0], ()), *self.values]:
            for reader, number, at in self.view.readers(value, stack):
                if reader.name == "stablehlo.optimization_barrier":
                    queue.append((reader.results[number], at))
                elif _is_saved_marker(reader):
                    queue.append((reader.results[0], at))
        seen: set[tuple[int, Stack]] = set()
        while queue and len(seen) < MAX_CLUSTER:
            value, stack = queue.pop()
            for reader, number, reader_stack in self.view.readers(value, stack):
                if reader.name == _DOT:
                    found.setdefault(op_key(reader), reader)
                elif (reader.name == "stablehlo.optimization_barrier"
                      and (op_key(reader), reader_stack) not in seen):
                    seen.add((op_key(reader), reader_stack))
                    queue.append((reader.results[number], reader_stack))
                elif ((reader.name in CLUSTER_OPS or _is_saved_marker(reader))
                      and (op_key(reader), reader_stack) not in seen):
                    seen.add((op_key(reader), reader_stack))
                    queue.extend((result, reader_stack) for result in reader.results)
                    for operand in reader.operands:  # dP, which dS = P·(dP - ...) reads
                        made, _value, _stack = self.view.producer(operand, reader_stack)
                        if made is not None and made.name == _DOT:
                            found.setdefault(op_key(made), made)
        if _batched(self.scores):  # then so are its other matmuls, and no projection
            return [op for op in found.values() if _batched(op)]
        return list(found.values())

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
        dims = dot_dims(self.scores)
        lhs, rhs = self.scores.operands[0], self.scores.operands[1]
        lhs_batch = list(dims.lhs_batching_dimensions)
        rhs_batch = list(dims.rhs_batching_dimensions)
        lhs_free = free_dims(len(shape_of(lhs)), lhs_batch, list(dims.lhs_contracting_dimensions))
        rhs_free = free_dims(len(shape_of(rhs)), rhs_batch, list(dims.rhs_contracting_dimensions))
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
                    result = result_roles(op, inputs)
                    if result is None:
                        continue
                    merged = unify([old, result]) if old is not None else result
                except NotFused as error:  # an error only if this is an attention
                    self.role_error = self.role_error or error
                    continue
                if merged != old:
                    self.roles[key] = merged
                    changed = True
                if op.name in ELEMENTWISE:  # an entry (dP, a bias) gets the op's roles
                    for v in op.operands:
                        entry = self.canon(v, stack)
                        if (entry not in self.values and shape_of(v) == shape_of(op.results[0])
                                and self.roles.get(entry) != merged):
                            try:
                                self.roles[entry] = unify([self.roles.get(entry), merged])
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

    def softmax(self) -> tuple[ir.Operation, Stack, ir.Operation, int]:
        """The cluster's exponential, its stack, the divide by its sum and the summed
        axis; NotFused (no attention) without them."""
        exps = [(op, st) for op, st in self.ops.values() if op.name == "stablehlo.exponential"]
        if not exps:
            crossed, past = self._softmax_past()
            if crossed is not None and crossed.name == "stablehlo.tanh" and _batched(
                    self.scores):
                self.walk(crossed.results[0])  # its exits tell the site's direction
                raise NotFused("the scores pass through tanh before the softmax "
                               "(soft-capping), which cuDNN's flash attention does not "
                               "compute")
            if crossed is not None and (crossed.name == "stablehlo.optimization_barrier"
                                        or _is_saved_marker(crossed)):
                if past is not None and _batched(self.scores):
                    # The matmuls past the save (P·V) come with the refusal, which keeps
                    # them 16-bit under fp8 (they went fp8: hunt h108).
                    self.walk(past)
                raise _saved("scores are")
            raise NotFused("no softmax", attention=False)
        if len(exps) > 1:
            raise NotFused("more than one exponential follows the scores", attention=False)
        exp, stack = exps[0]
        normalised = self._normalisation(exp, stack)
        if normalised is None:
            if self.shifted_sum and _batched(self.scores):
                raise NotFused("the softmax divides by its sum plus a term (exp / (sum + "
                               "eps)), which cuDNN's flash attention does not compute")
            if self.exits and self._reads_dp(exp, stack):  # q or k's backward alone: no P
                raise _partial("the gradient of q or k alone")
            if any(_is_saved_marker(reader) for reader, _, _ in
                   self.view.readers(exp.results[0], stack)):
                raise _saved("softmax's exponential and its sum are")  # everything_saveable
            raise NotFused("no softmax normalisation (exp over its sum) follows the scores",
                           attention=False)
        return exp, stack, *normalised

    def forward_chain(self, exp: ir.Operation, stack: Stack, divide: ir.Operation,
                      reduce_dim: int) -> tuple[tuple[ir.Value, Stack], Role, float, list]:
        """(P, the role of the summed axis: the keys', scale, mask selects) or NotFused."""
        roles = self.roles.get((divide.results[0], stack))
        key_role = roles[reduce_dim] if roles is not None and len(roles) > reduce_dim else None
        if key_role is None:
            raise NotFused("the softmax's dimensions could not be read", attention=False)
        scale, masks = self._to_scores(exp, stack, key_role)
        return (divide.results[0], stack), key_role, scale, masks

    def _strip(self, value: ir.Value, stack: Stack) -> tuple[ir.Value, Stack]:
        """``value`` before converts (seen through calls)."""
        while True:
            op, value, stack = self.view.producer(value, stack)
            if op is None or not float_convert(op):
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
            producer, p_stack = self._past_layout(op.operands[1], op_stack)
            if producer is not None and producer.name == "stablehlo.add" and any(
                    self._sum_of(v, p_stack, e) for v in producer.operands):
                self.shifted_sum = True  # e / (sum(e) + eps): no softmax, but say so
            if producer is None or producer.name != "stablehlo.reduce":
                continue
            summed = self._strip(producer.operands[0], p_stack)
            masked = summed != e and self._zeroed(*summed) == e
            if summed != e and not masked:
                continue
            if not _is_sum(self.view, producer, p_stack):
                # A sum from another start (lax.reduce(e, 1.0, add)) is sum(e) plus a term.
                if _adds(producer) and not masked:
                    self.shifted_sum = True
                continue
            dims = list(ir.DenseI64ArrayAttr(producer.attributes["dimensions"]))
            if len(dims) != 1:
                continue
            self.masked_sum = masked
            return op, dims[0]
        return None

    def _past_layout(self, value: ir.Value, stack: Stack
                     ) -> tuple[ir.Operation | None, Stack]:
        """The op that makes ``value``, seen through broadcasts, reshapes and converts
        (None: an argument), and its stack."""
        producer, _, stack = self.view.producer(value, stack)
        while producer is not None and producer.name in (
                "stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert"):
            producer, _, stack = self.view.producer(producer.operands[0], stack)
        return producer, stack

    def _sum_of(self, value: ir.Value, stack: Stack, e: tuple[ir.Value, Stack]) -> bool:
        """Whether ``value`` is a sum of ``e`` over one axis, through broadcasts,
        reshapes and converts."""
        producer, stack = self._past_layout(value, stack)
        return (producer is not None and producer.name == "stablehlo.reduce"
                and _is_sum(self.view, producer, stack)
                and self._strip(producer.operands[0], stack) == e)

    def _zeroed(self, value: ir.Value, stack: Stack) -> tuple[ir.Value, Stack] | None:
        """``x`` (before converts) where ``value`` is ``select(m, x, 0)``, else None."""
        op, _, stack = self.view.producer(value, stack)
        if op is None or op.name != "stablehlo.select":
            return None
        if splat_value(self.view, op.operands[2], stack) != 0:
            return None
        return self._strip(op.operands[1], stack)

    def _softmax_past(self) -> tuple[ir.Operation | None, ir.Value | None]:
        """The op the scores reach an exponential through, outside the cluster: an
        ``optimization_barrier`` (jax.checkpoint saving them: a remat policy's saved
        residuals pass one) or a ``tanh`` (soft-capping), and the value right past it
        where that is in the site's own function (else None); (None, None) without."""
        pending: list[tuple[ir.Value, Stack, ir.Operation | None, ir.Value | None]] = [
            (self.scores.results[0], (), None, None)]
        seen: set[tuple[ir.Value, Stack]] = set()
        while pending and len(seen) < 64:
            value, stack, crossed, crossed_value = pending.pop()
            for reader, number, at in self.view.readers(value, stack):
                name = reader.name
                if name == "stablehlo.exponential" and crossed is not None:
                    return crossed, crossed_value
                if name == "stablehlo.optimization_barrier":
                    follow, past = [reader.results[number]], crossed or reader
                elif name == "stablehlo.tanh" or _is_saved_marker(reader):
                    follow, past = list(reader.results), crossed or reader
                elif name in CLUSTER_OPS or name == "stablehlo.reduce_precision":
                    follow, past = list(reader.results), crossed
                else:
                    continue
                for result in follow:
                    if (result, at) not in seen:
                        seen.add((result, at))
                        after = crossed_value if crossed is not None else (
                            result if past is not None and not at else None)
                        pending.append((result, at, past, after))
        return None, None

    def _to_scores(self, exp: ir.Operation, stack: Stack, key_role: Role
                   ) -> tuple[float, list]:
        """Walk from exp's input back to the scores: the scale and the mask selects."""
        value = exp.operands[0]
        op, value, stack = self.view.producer(value, stack)
        # The fast mode's own output converts the 16-bit subtract to f32 for the exp:
        # seen through, a second run of the pipeline finds the site again.
        while op is not None and float_convert(op):
            op, value, stack = self.view.producer(op.operands[0], stack)
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
            if name in ("stablehlo.transpose", "stablehlo.reshape") or float_convert(op):
                value = operands[0]
                continue
            chain = [i for i, v in enumerate(operands) if self.in_cluster(v, stack)]
            if name in ("stablehlo.multiply", "stablehlo.divide") and len(chain) == 1:
                other = splat_value(self.view, operands[1 - chain[0]], stack)
                if other is None or other == 0 or (name == "stablehlo.divide" and chain[0] != 0):
                    raise NotFused(f"the scores are scaled by a {name.split('.')[-1]} "
                                   "that is not a constant")
                factor = other if name == "stablehlo.multiply" else 1.0 / other
                scale *= factor
                self.scale_factors.append(factor)
                value = operands[chain[0]]
                continue
            if name == "stablehlo.select" and chain and chain[0] in (1, 2) and len(chain) == 1:
                fill = splat_value(self.view, operands[3 - chain[0]], stack)
                # What the softmax sees is the fill times the scales after the select
                # (``scale`` so far: the walk goes back from the exp): where(m, s, -1e4)
                # * 1e-4 masks nothing (-1), nor does a negative scale (+1e9); a NaN
                # fill (every comparison false) makes the program's rows NaN.
                if fill is None or not fill * scale <= MASK_FILL:
                    raise NotFused("the scores are selected against a value that is not a "
                                   "large negative constant (a mask's fill) where the "
                                   "softmax reads it")
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

    # -- the exits -----------------------------------------------------------------------------

    def _exponential_near(self) -> bool:
        """Whether an exponential may follow the scores (through the ops a cluster
        holds, a barrier and tanh, on values of the scores' size): False where those end
        within ``_NEAR`` hops without one. Most matrix ops are such, and the walk of their cluster (up to
        ``MAX_CLUSTER`` ops, through a residual stream) cost 2.5 ms each."""
        # A softmax exponentiates values of the scores' size: smaller ones (a row's
        # maximum, a loss's sum) are not followed.
        size = math.prod(shape_of(self.scores.results[0]))
        frontier, seen = [(self.scores.results[0], ())], 0
        for _hop in range(_NEAR):
            following = []
            for value, stack in frontier:
                for reader, number, at in self.view.readers(value, stack):
                    name = reader.name
                    if name == "stablehlo.exponential":
                        return True
                    if name == "stablehlo.optimization_barrier":
                        results = [reader.results[number]]
                    elif name in CLUSTER_OPS or name in _NEAR_THROUGH:
                        results = list(reader.results)
                    else:
                        continue
                    following.extend((r, at) for r in results
                                     if math.prod(shape_of(r)) >= size)
            if not following:
                return False
            seen += len(following)
            if seen > _NEAR_VALUES:
                return True  # not told cheaply: the walk tells
            frontier = following
        return True  # still going: the walk tells (only a chain that ends is no softmax)

    def match(self) -> Match:
        if not self._exponential_near():
            raise NotFused("no softmax", attention=False)
        self.walk()
        softmax = self.softmax()  # before the roles: most matmuls have no softmax after
        self.assign_roles()
        # The key axis is the summed one: the operand whose free dimension it is is K.
        p_value, key_role, scale, selects = self.forward_chain(*softmax)
        if key_role[0] not in ("L", "R"):
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
        swapped = _direction_swapped(exits, self.view)
        if swapped is not None:  # told only by "an input ... computed after its first use"
            raise _along_queries(swapped)
        if "out" not in exits and "dv" not in exits:
            saved = [(reader, at) for value, stack in p_like
                     for reader, _number, at in self.view.readers(value, stack)
                     if _is_saved_marker(reader)]
            if saved:  # a policy saving the probabilities (save_only_these_names): P·V
                for reader, at in saved:  # reads the saved copy, whose matmuls the
                    if not at:  # refusal keeps 16-bit under fp8 (hunt h108)
                        self.walk(reader.results[0])
                raise _saved("probabilities are")
            if any(self._dropped_out(op.operands[n], p_like) for op, n in self.exits):
                raise NotFused(DROPOUT)  # P·V reads the probabilities after dropout
            if exits and self._reads_dp(*softmax[:2]):  # the gradient of q or k alone
                raise _partial(", ".join(sorted(exits)), "out" in exits)
            raise NotFused("no matrix op reads the probabilities", attention=False)
        if set(exits) == {"dv"} and not self._reads_dp(*softmax[:2]):
            # P·V contracting what the roles call the queries: a forward whose softmax
            # runs along the other free axis, not a backward.
            raise _along_queries("forward")
        if self.masked_sum:
            raise NotFused("softmax(where=) masks the softmax's sum (a mask on the scores, "
                           "jnp.where(mask, scores, finfo.min), or dot_product_attention's "
                           "mask=, fuses)")
        if self.role_error is not None:
            raise self.role_error
        if self.escapes:
            raise NotFused(f"the scores or probabilities have another reader: "
                           f"{self.escapes[0]}")
        if set(exits) not in ({"out"}, {"dv", "dq", "dk"}, {"out", "dv", "dq", "dk"}):
            raise _partial(", ".join(sorted(exits)), "out" in exits)
        if "dq" in exits:
            self._check_gradient_terms(*softmax[:2], selects)
        roles_of_selects = [self.roles.get((op.results[0], st)) for _, st, _, op in selects]
        if any(r is None or None in r for r in roles_of_selects):
            raise NotFused("the mask's dimensions could not be read")
        parts, leaves, axis_roles = self.mask(selects, roles_of_selects)
        match = Match(home=self.home, scores=self.scores, q=self.q, k=self.k,
                      q_roles=self.q_roles, k_roles=self.k_roles, sizes=self.sizes,
                      scale=scale, causal=False, mask_leaves=leaves, exits={},
                      home_ops=[op for op, stack in self.ops.values() if not stack])
        self._fill_exits(match, exits)
        match.t_role = self._query_axis(bool(parts), axis_roles, leaves)
        if parts:
            match.causal, match.window, match.constant_mask = self._constant_mask(
                parts, axis_roles, match.t_role)
        self._check_leaves(match)
        return match

    def _is_dp(self, value: ir.Value, stack: Stack) -> bool:
        """Whether ``value`` (outside the cluster) is dP = dO·Vᵀ: a batched matrix op's
        result of the scores' dimensions, through converts and transposes."""
        made, _, at = self.view.producer(value, stack)
        while made is not None and made.name in ("stablehlo.convert", "stablehlo.transpose"):
            made, _, at = self.view.producer(made.operands[0], at)
        return (made is not None and made.name == _DOT and _batched(made)
                and sorted(shape_of(made.results[0])) == sorted(shape_of(
                    self.scores.results[0])))

    def _check_gradient_terms(self, exp: ir.Operation, exp_stack: Stack,
                              selects: list) -> None:
        """The backward computes dS from dP as the softmax's gradient alone: its ops (those
        after dP) are the softmax gradient's kinds, add and subtract two different terms
        that both come from dP, multiply by dP's terms, the forward's softmax values (the
        exponential, its sum and what is made of them: _softmax_powers) and each
        constant the forward scaled the scores by, once (and by 1, -1), sum along the
        keys only, select dP's term against 0 only by the forward's own mask, and reach
        the matrix ops as P·dP and P·rowsum(P·dP) (_degrees_in_p). The row max's
        gradient (_max_gradient), zero, may be scaled or selected by anything. cuDNN's
        backward computes that gradient, so a term the program adds (a custom_vjp
        clipping, doubling, scaling or weighting the scores' or probabilities' gradient,
        the gradient of a penalty on them) was lost: dq and dk 26% to 320% off. (Not
        every such change can be told by its ops: a sign flip reads as the softmax's own
        negate.)"""
        # The values computed from dP, to a fixpoint (the walk's order need not put
        # every reader after its producer).
        after_dp: set[tuple[ir.Value, Stack]] = set()

        def from_dp(v: ir.Value, stack: Stack) -> bool:
            return self.canon(v, stack) in after_dp or (
                not self.in_cluster(v, stack) and self._is_dp(v, stack))

        changed = True
        while changed:
            changed = False
            for op, stack in self.ops.values():
                if self.canon(op.results[0], stack) in after_dp:
                    continue
                if any(from_dp(v, stack) for v in op.operands):
                    after_dp.update(self.canon(r, stack) for r in op.results)
                    changed = True
        power = self._softmax_powers(exp, exp_stack, after_dp)
        max_path = self._max_gradient(exp, exp_stack, after_dp, from_dp)

        def on_max_path(operands: list[ir.Value], stack: Stack) -> bool:
            terms = [self.canon(v, stack) for v in operands if from_dp(v, stack)]
            return bool(terms) and all(t in max_path for t in terms)

        unmatched = list(self.scale_factors)  # each forward scale, matched once
        # The forward masks (_mask_key) and the side of their select the scores are on.
        mask_sides = {self._mask_key(pick, st): 2 if on_false else 1
                      for pick, st, on_false, _ in selects}
        why = ("the gradient of the scores has a term the softmax's does not ({}): "
               "cuDNN's backward computes the softmax's alone (a custom_vjp on the "
               "scores, a penalty on them)")

        for op, stack in self.ops.values():
            if self.canon(op.results[0], stack) not in after_dp:
                continue
            name = op.name
            if name not in _GRADIENT_OPS:
                raise NotFused(why.format(f"{name.split('.')[-1]} after dP"))
            operands = list(op.operands)
            if name in ("stablehlo.add", "stablehlo.subtract"):
                if not all(from_dp(v, stack) or splat_value(self.view, v, stack) == 0
                           for v in operands):
                    raise NotFused(why.format(f"{name.split('.')[-1]} of a term not from dP"))
                if self._unscaled(operands[0], stack) == self._unscaled(operands[1], stack):
                    raise NotFused(why.format(f"{name.split('.')[-1]} of a term with itself"))
            elif name in ("stablehlo.multiply", "stablehlo.divide"):
                # A factor is dP's, the softmax's own values or a forward scale: not the
                # scores or what else is computed from them, not a constant array, nor
                # a value from outside the site; and the gradient is linear in dP: no
                # product of two of its terms. The row max's gradient (the row sum of
                # the gradient at the exponential's input, and what a guard, initial=,
                # a floor, a scale or the max's indicators make of it) is zero, as a
                # softmax does not change when its row is shifted, whatever multiplies
                # it.
                if all(from_dp(v, stack) for v in operands):
                    raise NotFused(why.format(f"{name.split('.')[-1]} of two gradient terms"))
                on_rows = on_max_path(operands, stack)
                for position, v in enumerate(operands):
                    if from_dp(v, stack):
                        continue
                    if self.in_cluster(v, stack):
                        known = self.canon(v, stack)
                        # On the row max's gradient (zero) anything may: a max's
                        # indicators route it to the scores, a guard or floor scales it.
                        if known in power or on_rows:
                            continue
                        raise NotFused(why.format("a factor computed from the scores"))
                    factor = splat_value(self.view, v, stack)
                    if factor is None:
                        raise NotFused(why.format("a factor from outside the attention"))
                    if factor == 0.0:  # the gradient zeroed (g * 0), not the softmax's
                        raise NotFused(why.format("a factor of 0"))
                    if factor in (1.0, -1.0) or on_rows:
                        continue
                    applied = 1.0 / factor if name == "stablehlo.divide" and position else factor
                    if not _match_scale(applied, unmatched):
                        raise NotFused(why.format(f"a factor of {factor:g}"))
            elif name == "stablehlo.reduce" and not (
                    _is_sum(self.view, op, stack) and self._along_rows(op.results[0], stack)):
                # The softmax's gradient sums along the keys only (its row term, the
                # row max's): g - g.max(-1) or a sum along the queries was fused.
                raise NotFused(why.format("a reduction other than a sum along the keys"))
            elif name == "stablehlo.select":
                # A mask's select of dP's term against 0 (or anything on the row max's
                # gradient: a guard, the max's indicators); one whose choice is computed
                # from the scores otherwise, or from the gradient, or whose other side
                # is not 0, clips or replaces it.
                pick, *sides = operands
                # From outside the cluster, only the forward's own mask, laid out as there
                # and keeping the gradient on the scores' side: a head mask, a column
                # gate, the padding mask along the queries or inverted pick part of the
                # gradient away.
                side = mask_sides.get(self._mask_key(pick, stack))
                foreign = (self.in_cluster(pick, stack) or side is None
                           or not from_dp(operands[side], stack))
                if from_dp(pick, stack) or (foreign and not on_max_path(sides, stack)) or not all(
                        from_dp(v, stack) or splat_value(self.view, v, stack) == 0
                        for v in sides):
                    raise NotFused(why.format("a select of the gradient against another "
                                              "value"))
        degrees = self._degrees_in_p(power, after_dp, max_path, from_dp)
        for op, number in self.exits:
            found = degrees.get(self.canon(op.operands[number], ()))
            # Both terms: with the sum held constant (e / stop_gradient(sum(e))) the
            # row term is missing, and cuDNN's backward would subtract it (88% off).
            if found is not None and found != {(1, -1), (2, -2)}:
                raise NotFused(why.format(
                    "a power of the probabilities other than the softmax's "
                    f"P·dP and P·rowsum(P·dP): {_powers_text(found)}"))

    def _softmax_powers(self, exp: ir.Operation, exp_stack: Stack,
                        after_dp: set[tuple[ir.Value, Stack]]
                        ) -> dict[tuple[ir.Value, Stack], tuple[int, int]]:
        """The forward values the softmax's gradient multiplies by, with the powers of
        the exponential e and of its sum along the keys s each holds (P = e / s: (1,
        -1)): e, s, and their products, quotients, converts, broadcasts, reshapes and
        transposes, with constants. Not what a comparison or a sum with a constant
        makes of them (p > 0.1, p + 1: a custom_vjp's weighting)."""
        power: dict[tuple[ir.Value, Stack], tuple[int, int]] = {
            self.canon(exp.results[0], exp_stack): (1, 0)}
        keep = ("stablehlo.convert", "stablehlo.broadcast_in_dim", "stablehlo.reshape",
                "stablehlo.transpose")
        changed = True
        while changed:
            changed = False
            for op, stack in self.ops.values():
                key = self.canon(op.results[0], stack)
                if key in after_dp or key in power:
                    continue
                known = [power.get(self.canon(v, stack)) if self.in_cluster(v, stack)
                         else (0, 0) if splat_value(self.view, v, stack) is not None
                         else None for v in op.operands]
                if None in known or not known:
                    continue
                if op.name in keep:
                    power[key] = known[0]
                elif op.name == "stablehlo.multiply":
                    power[key] = (known[0][0] + known[1][0], known[0][1] + known[1][1])
                elif op.name == "stablehlo.divide":
                    power[key] = (known[0][0] - known[1][0], known[0][1] - known[1][1])
                elif (op.name == "stablehlo.reduce" and _is_sum(self.view, op, stack)
                      and known[0] == (1, 0)):
                    power[key] = (0, 1)  # the exponential's sum
                else:
                    continue
                changed = True
        return power

    def _degrees_in_p(self, power: dict[tuple[ir.Value, Stack], tuple[int, int]],
                      after_dp: set[tuple[ir.Value, Stack]],
                      max_path: set[tuple[ir.Value, Stack]], from_dp: Any
                      ) -> dict[tuple[ir.Value, Stack], set[tuple[int, int]]]:
        """Per gradient term, the powers of e and s its products hold: the softmax's
        gradient P * (dP - rowsum(dP * P)) holds P = e / s once and twice, (1, -1) and
        (2, -2); a custom_vjp multiplying the probabilities' gradient by them (g * p:
        285% off) or by the sum (g * s) holds others. The row max's gradient (zero)
        holds none that counts."""
        degrees: dict[tuple[ir.Value, Stack], set[tuple[int, int]]] = {}
        changed = True
        while changed:  # the gradient's terms
            changed = False
            for op, stack in self.ops.values():
                key = self.canon(op.results[0], stack)
                if key not in after_dp or key in max_path:
                    continue
                terms: set[tuple[int, int]] = set()
                shift = (0, 0)
                for position, v in enumerate(op.operands):
                    value = self.canon(v, stack)
                    if value in max_path:
                        continue
                    if from_dp(v, stack):
                        terms |= degrees.get(value, {(0, 0)} if not self.in_cluster(
                            v, stack) else set())
                    elif value in power and op.name == "stablehlo.multiply":
                        shift = (shift[0] + power[value][0], shift[1] + power[value][1])
                    elif value in power and op.name == "stablehlo.divide" and position:
                        shift = (shift[0] - power[value][0], shift[1] - power[value][1])
                new = {(e + shift[0], s + shift[1]) for e, s in terms}
                if new and not new <= degrees.get(key, set()):
                    degrees[key] = degrees.get(key, set()) | new
                    changed = True
        return degrees

    def _along_rows(self, value: ir.Value, stack: Stack) -> bool:
        """Whether ``value`` (of the cluster) is known not to vary along the keys: a row
        value, such as the scores' row max and what is computed from it."""
        roles = self.role(value, stack)
        return roles is not None and None not in roles and S_ROLE not in roles

    def _max_gradient(self, exp: ir.Operation, exp_stack: Stack,
                      after_dp: set[tuple[ir.Value, Stack]], from_dp: Any
                      ) -> set[tuple[ir.Value, Stack]]:
        """The row max's gradient: a sum along the keys of dZ, the gradient at the
        exponential's input (a dP term times the exponential, negated or converted),
        and what is computed from it with no other gradient term."""
        exponential = self.canon(exp.results[0], exp_stack)
        # dZ is the last product by the exponential: in exp / sum(exp)'s own backward
        # an earlier one, inside the softmax's row term sum(dP * e), leads to it.
        readers: dict[tuple[ir.Value, Stack], list[tuple[ir.Value, Stack]]] = {}
        products = []
        for op, stack in self.ops.values():
            key = self.canon(op.results[0], stack)
            if key not in after_dp:
                continue
            for v in op.operands:
                readers.setdefault(self.canon(v, stack), []).append(key)
            if op.name == "stablehlo.multiply" and exponential in [
                    self._strip(v, stack) for v in op.operands]:
                products.append(key)

        def leads_to_another(start: tuple[ir.Value, Stack]) -> bool:
            seen, queue = {start}, [start]
            while queue:
                for reader in readers.get(queue.pop(), ()):
                    if reader in products:
                        return True
                    if reader not in seen:
                        seen.add(reader)
                        queue.append(reader)
            return False

        dz = {key for key in products if not leads_to_another(key)}
        found: set[tuple[ir.Value, Stack]] = set()
        changed = True
        while changed:
            changed = False
            for op, stack in self.ops.values():
                key = self.canon(op.results[0], stack)
                if key not in after_dp or key in dz or key in found:
                    continue
                operands = [self.canon(v, stack) for v in op.operands]
                if op.name in ("stablehlo.negate", "stablehlo.convert") and operands[0] in dz:
                    dz.add(key)
                elif (op.name == "stablehlo.reduce" and operands[0] in dz
                      and self._along_rows(op.results[0], stack)
                      and _is_sum(self.view, op, stack)) or (
                        found and all(v in found for v, raw in zip(operands, op.operands)
                                      if from_dp(raw, stack))):
                    found.add(key)  # the row sum of dZ, or computed from it alone
                else:
                    continue
                changed = True
        return found

    def _mask_key(self, value: ir.Value, stack: Stack) -> tuple:
        """A mask as a select reads it: the value past float converts, and how a
        broadcast lays it out (a reshape of a mask is another layout: m[:, None, :, None]
        is no m[:, None, None, :])."""
        value, stack = self._strip(value, stack)
        op, _made, made_stack = self.view.producer(value, stack)
        if op is not None and op.name == "stablehlo.broadcast_in_dim":
            dims = tuple(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
            return (self._strip(op.operands[0], made_stack), dims,
                    tuple(shape_of(op.results[0])))
        return ((value, stack), None, None)

    def _unscaled(self, value: ir.Value, stack: Stack) -> tuple[ir.Value, Stack]:
        """``value`` past multiplies by one (g + 1.0 * g adds a term to itself)."""
        for _step in range(8):
            op, _made, made_stack = self.view.producer(value, stack)
            if op is None or op.name != "stablehlo.multiply":
                break
            units = [splat_value(self.view, v, made_stack) == 1.0 for v in op.operands]
            if units.count(True) != 1:
                break
            value, stack = op.operands[units.index(False)], made_stack
        return self.canon(value, stack)

    def _reads_dp(self, exp: ir.Operation, exp_stack: Stack) -> bool:
        """Whether the cluster is a softmax's (the exponential summed along an axis) over
        batched scores and reads dP = dO·Vᵀ: a batched matrix op's result with the
        scores' dimensions (an attention's backward; a softmax classifier's reads none,
        an MLP's scores are not batched)."""
        if not _batched(self.scores) or not any(
                op.name == "stablehlo.reduce" and _is_sum(self.view, op, st)
                and self._strip(op.operands[0], st) == (exp.results[0], exp_stack)
                for op, st in self.ops.values()):
            return False
        return any(not self.in_cluster(value, stack) and self._is_dp(value, stack)
                   for op, stack in self.ops.values() for value in op.operands)

    def _set_operand_roles(self, q_index: int) -> None:
        dims = dot_dims(self.scores)
        batch = [list(dims.lhs_batching_dimensions), list(dims.rhs_batching_dimensions)]
        contracting = [list(dims.lhs_contracting_dimensions),
                       list(dims.rhs_contracting_dimensions)]
        operands = list(self.scores.operands)
        if len(contracting[0]) != 1:
            raise NotFused("the scores contract more than one head dimension")
        roles_of = []
        for side in (0, 1):
            shape = shape_of(operands[side])
            roles: list[Role] = [None] * len(shape)
            for i, d in enumerate(batch[side]):
                roles[d] = ("B", i)
            roles[contracting[side][0]] = H_ROLE
            free = free_dims(len(shape), batch[side], contracting[side])
            for j, d in enumerate(free):
                roles[d] = ("Q", j) if side == q_index else S_ROLE
            roles_of.append(roles)
        self.q, self.k = operands[q_index], operands[1 - q_index]
        self.q_roles, self.k_roles = roles_of[q_index], roles_of[1 - q_index]
        self.sizes: dict[Role, int] = {}
        for value, roles in ((self.q, self.q_roles), (self.k, self.k_roles)):
            for role, size in zip(roles, shape_of(value)):
                self.sizes[role] = size

    def _p_like(self, p_value: tuple[ir.Value, Stack]) -> set[tuple[ir.Value, Stack]]:
        """P and what converts, transposes and unit reshapes make of it."""
        found = {p_value}
        changed = True
        while changed:
            changed = False
            for op, stack in self.ops.values():
                if self.masked_sum and op.name == "stablehlo.select" and self._zeroed(
                        op.results[0], stack) in found:
                    source = True  # softmax(where=)'s where(mask, P, 0)
                else:
                    source = (op.name in ("stablehlo.transpose", "stablehlo.reshape")
                              or float_convert(op)) and self.canon(
                                  op.operands[0], stack) in found
                if source:
                    key = (op.results[0], stack)
                    if key not in found:
                        found.add(key)
                        changed = True
        return found


def _powers_text(found: set[tuple[int, int]]) -> str:
    """Terms as powers of the exponential e and its sum s (P = e / s)."""
    return ", ".join(f"e^{e} s^{s}" for e, s in sorted(found))


def _match_scale(applied: float, unmatched: list[float]) -> bool:
    """Whether a constant factor of the backward is one of the forward's scales not yet
    matched (sign aside), or the product of all of them (removed from ``unmatched``)."""
    for index, scale in enumerate(unmatched):
        if math.isclose(abs(applied), abs(scale), rel_tol=1e-6):
            del unmatched[index]
            return True
    if unmatched and math.isclose(abs(applied), abs(math.prod(unmatched)), rel_tol=1e-6):
        unmatched.clear()
        return True
    return False


def _batched(dot: ir.Operation) -> bool:
    return bool(list(dot_dims(dot).lhs_batching_dimensions))


def _is_sum(view: CallView, reduce: ir.Operation, stack: Stack) -> bool:
    """Whether ``reduce`` sums, from 0: ``lax.reduce(e, 1.0, add)`` is 1 + sum(e), a
    softmax's sum plus a term (it was fused as a plain softmax, 56% off)."""
    return (_adds(reduce) and len(reduce.operands) == 2
            and splat_value(view, reduce.operands[1], stack) == 0)


def _adds(reduce: ir.Operation) -> bool:
    """Whether ``reduce``'s body adds."""
    body = reduce.regions[0].blocks[0]
    return [op.operation.name for op in body.operations][:1] == ["stablehlo.add"]


def float_convert(op: ir.Operation) -> bool:
    """Whether ``op`` converts a float to a float: a convert to or from an integer type
    between the scores and the softmax rounds them (it was walked through as a no-op)."""
    return op.name == "stablehlo.convert" and all(
        isinstance(ir.RankedTensorType(v.type).element_type, ir.FloatType)
        for v in (op.operands[0], op.results[0]))


# How many values the walk back from one exponential may meet before it gives up (an
# exponential of the residual stream reaches the whole program).
_SOURCE_VALUES = 400


def _saved(what: str) -> NotFused:
    saved = NotFused(f"the {what} saved for the backward pass (a jax.checkpoint policy "
                     "that saves them, such as dots_saveable or everything_saveable, keeps "
                     "them; one that does not, such as nothing_saveable, fuses)")
    saved.direction = "forward and backward"  # saved for a backward pass
    saved.saved = True  # the reason stands whatever reads the attention
    return saved


def _is_saved_marker(op: ir.Operation) -> bool:
    """A ``reduce_precision`` to exactly its operand's own format: what jax marks a residual
    a checkpoint policy saves with, in a scan or under everything_saveable (it rounds
    nothing; jax's barrier against the value being recomputed)."""
    return op.name == "stablehlo.reduce_precision" and rounds_to_its_own_type(op)


def exponential_sources(view: CallView, module: ir.Module) -> set[int] | None:
    """The op keys of the ``dot_general`` ops an exponential may follow: walking back from
    every exponential through the ops the probe and the walk follow forward (a cluster's
    ops, a barrier, tanh), into called functions and out to every caller of a function.
    A scores matmul is among them (its softmax's exponential follows it so); most matrix
    ops are not, and need no probe. None where a walk meets more than ``_SOURCE_VALUES``
    values: then every matrix op is asked."""
    sources: set[int] = set()
    followed = CLUSTER_OPS | _NEAR_THROUGH
    for exponential in walk_operations(module, names=frozenset({"stablehlo.exponential"})):
        pending: list[tuple[ir.Value, Stack]] = [(exponential.operands[0], ())]
        seen: set[tuple[ir.Value, Stack]] = set()
        while pending:
            value, stack = pending.pop()
            if (value, stack) in seen:
                continue
            seen.add((value, stack))
            if len(seen) > _SOURCE_VALUES:
                return None
            op, made, at = view.producer(value, stack)
            if op is None:  # an argument: of a called function, every call's operand
                owner = made.owner.owner
                owner = getattr(owner, "operation", owner)
                if owner is not None and owner.name == "func.func":
                    pending.extend((call.operands[made.arg_number], ())
                                   for call in view.callers.get(function_name(owner), ()))
                continue
            if op.name == _DOT:
                sources.add(op_key(op))
            elif op.name == "stablehlo.optimization_barrier":
                pending.append((op.operands[ir.OpResult(made).result_number], at))
            elif op.name in followed:
                pending.extend((operand, at) for operand in op.operands)
    return sources


def match_site(view: CallView, scores: ir.Operation) -> Match:
    """The attention starting at ``scores`` (a ``dot_general``), or NotFused (with the
    matmuls of the attention found so far, ``error.matmuls``)."""
    site = _Site(view, scores)
    try:
        return site.match()
    except NotFused as error:
        error.matmuls = site.matmuls_found()
        # A saved refusal's backward may sit in another loop's body (a scan of
        # checkpointed layers): found by name too, as a split backward's (review h111).
        error.split_backward = site.split_backward or getattr(error, "saved", False)
        # A forward pass has one matrix op reading its cluster (P·V); a training step's
        # backward adds Pᵀ·dO, dS·K and dSᵀ·Q.
        readers = len(site.exits)
        if site.split_backward:
            error.direction = error.direction or "forward and backward"
        if readers and all(_forward_mode(op) for op, _number in site.exits) and not getattr(
                error, "saved", False):
            # jax.jvp's tangents read the probabilities too (dP·V, P·dV): not a backward,
            # whatever a check that took them for one said (jvp in q alone: "only part of
            # the attention's backward reads it").
            error.direction = "forward"
            if "backward" in error.reason:
                error.reason = ("jax.jvp's tangents read the attention (forward-mode "
                                "differentiation), which the kernel does not compute")
                error.args = (error.reason,)
        error.direction = error.direction or ("forward" if readers < 2 else
                           "forward and backward" if readers >= 4 else "backward")
        raise


def _forward_mode(op: ir.Operation) -> bool:
    """Whether ``op``'s location names it a forward-mode op (under ``jvp(...)``, not a
    backward's ``transpose(...)``); False where it says neither."""
    site = site_of(op.location, "dot_general")
    return not site.backward and any(t.startswith("jvp") for t in site.transforms)


