"""The exits of an attention site: the ``dot_general`` ops that read its cluster, told
apart by what they contract (P·V, Pᵀ·dO, dS·K, dSᵀ·Q), each with its result's roles;
V and dO, the values the kernel reads besides Q and K, from them (or, in a backward pass
that never recomputes P·V, V from dP = dO·Vᵀ).
"""

from __future__ import annotations

from jaxlib.mlir import ir

from hlo_amp.ir.sites import location_name
from hlo_amp.passes.fused_attention.calls import SHARDING_CONSTRAINT, Stack
from hlo_amp.passes.fused_attention.roles import (
    DROPOUT,
    H_ROLE,
    HV_ROLE,
    S_ROLE,
    UNIT,
    NotFused,
    Role,
    base_of,
    dot_dims,
    dot_result_roles,
    pair_roles,
    shape_of,
)
from hlo_amp.passes.fused_attention.site import Exit, Match

_DOT = "stablehlo.dot_general"
_RANDOM = ("random_bits", "threefry", "bernoulli", "random_uniform")


class ExitReading:
    """The exit half of match.py's site analysis (``exits``, ``q``, ``k``, ``q_roles``,
    ``sizes``, ``ops`` and the role lookups are the site's)."""

    def _classify_exits(self, p_like: set) -> dict[str, tuple[ir.Operation, int]]:
        q_roles = {r for r in self.q_roles if r[0] == "Q"}
        found: dict[str, tuple[ir.Operation, int]] = {}
        for op, number in self.exits:
            value = op.operands[number]
            roles = self.role(value, ())
            if roles is None or None in roles:
                raise NotFused("a matrix op reads a cluster value whose dimensions are not "
                               "known")
            dims = dot_dims(op)
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
                if self._reads_random_bits():
                    raise NotFused(DROPOUT)
                raise NotFused(f"two matrix ops read the attention as its {kind}")
            found[kind] = (op, number)
        return found

    def _fill_exits(self, match: Match, exits: dict) -> None:
        base_q, base_k = base_of(self.q), base_of(self.k)
        for kind, (op, number) in exits.items():
            value = op.operands[number]
            other = op.operands[1 - number]
            roles = self.role(value, ())
            other_roles = pair_roles(op, number, roles, shape_of(other))
            if kind in ("out", "dv"):
                free = [i for i, r in enumerate(other_roles) if r is None]
                if len(free) != 1:
                    raise NotFused("V (or dO) has more than one free dimension")
                if kind == "out" and any(r is not None and r[0] == "Q" for r in other_roles):
                    # A V with a query axis (a different V per query: a router mixing
                    # each token's expert outputs) is no attention the kernel computes;
                    # rewritten, the module failed to verify.
                    raise NotFused("V has a query dimension (a value per query: not "
                                   "attention over keys)", attention=False)
                other_roles[free[0]] = HV_ROLE
            else:
                free = [i for i, r in enumerate(other_roles) if r is None]
                if len(free) != 1:
                    raise NotFused("a backward matrix op has more than one free dimension")
                other_roles[free[0]] = H_ROLE
                expected = (base_k if kind == "dq" else base_q)
                if base_of(other)[0] != expected[0]:
                    raise NotFused(f"the {kind} matrix op reads another "
                                   f"{'key' if kind == 'dq' else 'query'}")
            result = dot_result_roles(op, number, roles, other_roles)
            match.exits[kind] = Exit(op, result)
            if kind == "out":
                match.v, match.v_roles = other, other_roles
            elif kind == "dv":
                match.d_out, match.d_out_roles = other, other_roles
        if match.training and match.v is None:
            match.v, match.v_roles = self._v_from_dp(match)
        for role in match.v_roles:
            if role == HV_ROLE:
                size = shape_of(match.v)[match.v_roles.index(HV_ROLE)]
                self.sizes[HV_ROLE] = size
        if self.sizes.get(HV_ROLE) != self.sizes.get(H_ROLE):
            raise NotFused("V's head dimension differs from Q's and K's")

    def _v_from_dp(self, match: Match) -> tuple[ir.Value, list[Role]]:
        """V from dP = dO·Vᵀ, the one matrix op whose result the backward cluster reads."""
        d_out_base = base_of(match.d_out)[0]
        for op, stack in self.ops.values():
            for value in op.operands:
                if self.in_cluster(value, stack) or stack:
                    continue
                producer = value.owner.operation
                steps = 0
                while (not isinstance(value, ir.BlockArgument) and steps < 4
                       and producer.name in ("stablehlo.transpose", "stablehlo.convert",
                                             "stablehlo.reshape", SHARDING_CONSTRAINT)):
                    # (Under an Explicit mesh a sharding constraint follows every op:
                    # no step.)
                    steps += producer.name != SHARDING_CONSTRAINT
                    value = producer.operands[0]
                    producer = value.owner.operation
                if isinstance(value, ir.BlockArgument) or producer.name != _DOT:
                    continue
                operands = list(producer.operands)
                bases = [base_of(v)[0] for v in operands]
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
        d_base, d_map = base_of(d_value)
        dout_base, dout_map = base_of(match.d_out)
        if d_base != dout_base:
            raise NotFused("dP reads another dO")
        # dO's roles in the base's dimensions, then in this operand's.
        base_roles: dict[int, Role] = {}
        for i, m in enumerate(dout_map):
            if m is not None:
                base_roles[m] = match.d_out_roles[i]
        d_roles = [UNIT if m is None else base_roles.get(m) for m in d_map]
        v_roles = pair_roles(dot, d_index, d_roles, shape_of(dot.operands[v_index]))
        free = [i for i, r in enumerate(v_roles) if r is None]
        if len(free) != 1:
            raise NotFused("V has more than one free dimension")
        v_roles[free[0]] = S_ROLE
        return v_roles

    def _reads_random_bits(self) -> bool:
        """Whether a cluster op reads a value made from random bits (a dropout mask:
        jax names those ops ``random_bits``, ``threefry2x32``, ``bernoulli``)."""
        return self._from_random_bits([(value, stack) for op, stack in self.ops.values()
                                       for value in op.operands
                                       if not self.in_cluster(value, stack)])

    def _dropped_out(self, value: ir.Value, p_like: set) -> bool:
        """Whether the exit operand ``value`` is P after dropout: selected or multiplied
        with a random mask (and scaled, converted, transposed) on its way from P."""
        stack: Stack = ()
        random = False
        for _step in range(8):
            if self.canon(value, stack) in p_like:
                return random
            op, value, stack = self.view.producer(value, stack)
            if op is None:
                return False
            chain = [v for v in op.operands if self.in_cluster(v, stack)]
            if len(chain) != 1:
                return False
            others = [(v, stack) for v in op.operands if not self.in_cluster(v, stack)]
            if op.name in ("stablehlo.select", "stablehlo.multiply"):
                random = random or self._from_random_bits(others)
            elif op.name not in ("stablehlo.divide", "stablehlo.convert",
                                 "stablehlo.transpose", "stablehlo.reshape"):
                return False
            value = chain[0]
        return False

    def _from_random_bits(self, values: list[tuple[ir.Value, Stack]]) -> bool:
        """Whether any of ``values`` is computed from random bits."""
        seen: set[tuple[object, Stack]] = set()
        pending = list(values)
        while pending and len(seen) < 400:
            current, at = pending.pop()
            producer, made, at = self.view.producer(current, at)
            if producer is None or (made, at) in seen:
                continue
            seen.add((made, at))
            name = location_name(producer.location)
            if "rng" in producer.name or any(word in name for word in _RANDOM):
                return True
            pending.extend((v, at) for v in producer.operands)
        return False
