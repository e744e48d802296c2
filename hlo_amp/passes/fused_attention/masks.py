"""The masks of an attention site: each mask select's predicate split into ANDed
parts, the constant ones evaluated (constants.py) and compared with a causal mask, the
others kept as values of the home block for the kernel's bias; and which of the
query's free dimensions is the query position.
"""

from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir

from hlo_amp.passes.fused_attention.calls import Stack
from hlo_amp.passes.fused_attention.constants import (
    evaluate,
    splat_value,
    unit_reshape_map,
)
from hlo_amp.passes.fused_attention.roles import H_ROLE, HV_ROLE, S_ROLE, NotFused, Role, shape_of
from hlo_amp.passes.fused_attention.site import MaskLeaf


def band_of(array: np.ndarray) -> tuple[int, int] | None:
    """(lo, hi) where the [T, S] ``array`` is true exactly where lo <= s - t <= hi (a
    causal mask of any lengths, a sliding window), else None. Read per row (its first
    and last true key, its count): no T x S array of positions."""
    t, s = array.shape
    count = array.sum(axis=1)
    rows = np.flatnonzero(count)
    if rows.size == 0:
        return None
    first = array.argmax(axis=1)
    last = s - 1 - array[:, ::-1].argmax(axis=1)
    if (count[rows] != last[rows] - first[rows] + 1).any():  # a row with a gap
        return None
    lo, hi = int((first[rows] - rows).min()), int((last[rows] - rows).max())
    queries = np.arange(t)
    low, high = np.maximum(queries + lo, 0), np.minimum(queries + hi, s - 1)
    empty = low > high
    full = ~empty
    if (count[empty] != 0).any() or (count[full] == 0).any() or (
            first[full] != low[full]).any() or (last[full] != high[full]).any():
        return None
    return lo, hi


def _is_boolean(value: ir.Value) -> bool:
    element = ir.RankedTensorType(value.type).element_type
    return isinstance(element, ir.IntegerType) and element.width == 1


def causal_window(array: np.ndarray, outer: np.ndarray) -> int | None:
    """For a square [T, T] ``array`` that is causal ANDed with ``outer`` (rows and keys
    masked whole: constant sequence lengths), 0; causal with a sliding window, keys
    t - w < s <= t (cuDNN's ``sliding_window_length``, jax's ``local_window_size=(w - 1,
    0)``), w; else None."""
    t = array.shape[0]
    causal = np.tri(t, t, dtype=bool) & outer
    if np.array_equal(array, causal):  # no window (query lengths or padded keys may
        return 0                       # hide row T - 1's first key: review h94)
    rows = np.flatnonzero(array.any(axis=1))
    if rows.size == 0:
        return None
    lowest = int((array.argmax(axis=1)[rows] - rows).min())  # the least s - t seen
    if not 1 - t < lowest <= 0:
        return None
    window = 1 - lowest
    return window if np.array_equal(array, causal & ~np.tri(t, t, lowest - 1, dtype=bool)) \
        else None


class MaskReading:
    """The mask half of match.py's site analysis (``view``, ``memo``, ``sizes`` and
    ``q_roles`` are the site's)."""

    def mask(self, selects: list, roles_of_select: list[list[Role]]
             ) -> tuple[list[tuple[np.ndarray, tuple[Role, ...]]], list[MaskLeaf],
                        list[Role]]:
        """The constant parts (evaluated, ANDed per set of roles they vary along: a
        causal or window part [T, S], sequence lengths [T] or [S], never broadcast to
        one another), the program's mask values (in the home block) of every mask
        select, and the roles the constant parts vary along."""
        # Each constant part: its array over the select dimensions it varies along.
        constant: list[tuple[np.ndarray, list[int], list[Role]]] = []
        leaves: list[MaskLeaf] = []
        for (pred, stack, negated, _select), roles in zip(selects, roles_of_select):
            if negated:
                raise NotFused("the mask selects the fill where it is true")
            shape = shape_of(pred)
            self._leaves(pred, stack, list(range(len(shape))), roles, constant, leaves)
        axis_roles = sorted({rs[a] for _array, dims, rs in constant for a in dims})
        parts: dict[tuple[Role, ...], np.ndarray] = {}
        for array, dims, rs in constant:
            f_roles = [rs[a] for a in dims]
            order = sorted(range(len(f_roles)), key=lambda i: axis_roles.index(f_roles[i]))
            key = tuple(f_roles[i] for i in order)
            array = np.transpose(array, order) if order else array
            parts[key] = array if key not in parts else np.logical_and(parts[key], array)
        return [(np.asarray(a, dtype=bool), k) for k, a in parts.items()], leaves, axis_roles

    def _leaves(self, value: ir.Value, stack: Stack, dims: list[int | None],
                roles: list[Role], constant: list, leaves: list) -> None:
        """Split the mask ``value`` (its dimension i is the select's ``dims[i]``) into
        ANDed parts: evaluated constants, or values of the home block."""
        shape = shape_of(value)
        folded = evaluate(self.view, value, stack, self.memo)
        if folded is not None and folded.exact:
            if folded.array.dtype != bool:
                raise NotFused("the mask is not boolean")
            if not folded.array.all():
                array = folded.array
                select_dims = [dims[a] for a in folded.axes]
                # A batch or head axis the mask is the same along says nothing (a causal
                # mask broadcast to [1, N, T, S], nnx.make_causal_mask's [B, 1, T, T]),
                # nor does one of size 1 (that mask at batch 1, where the scores' batch
                # axis is of size 1 too).
                for i in reversed(range(array.ndim)):
                    if (select_dims[i] is not None and roles[select_dims[i]][0] == "B"
                            and (array == array.take([0], axis=i)).all()):
                        array = array.take(0, axis=i)
                        del select_dims[i]
                if None in select_dims and array.size > 1:
                    raise NotFused("the mask varies along a dimension the scores lack")
                keep = [i for i, d in enumerate(select_dims) if d is not None]
                array = array.reshape([array.shape[i] for i in keep])
                constant.append((array, [select_dims[i] for i in keep], roles))
            return
        op, value, stack = self.view.producer(value, stack)
        if op is None or stack == () and op.name not in (
                "stablehlo.and", "stablehlo.broadcast_in_dim", "stablehlo.transpose",
                "stablehlo.reshape", "stablehlo.convert", "stablehlo.compare"):
            if stack != ():
                raise NotFused("the mask is computed inside a called function")
            leaves.append(self._hoisted(value, dims, roles, constant)
                          or MaskLeaf(value, [None if d is None else roles[d] for d in dims]))
            return
        name = op.name
        if name == "stablehlo.convert" and _is_boolean(value) and _is_boolean(op.operands[0]):
            # (jnp's astype(bool) of a boolean: Flax's combine_masks writes one.)
            self._leaves(op.operands[0], stack, dims, roles, constant, leaves)
            return
        if name == "stablehlo.and" and _is_boolean(value):
            # (An integer mask's bitwise and, (a & b) != 0, is no logical and of a != 0
            # and b != 0: it stays whole.)
            for operand in op.operands:
                self._leaves(operand, stack, dims, roles, constant, leaves)
            return
        nonzero = self._nonzero(op, stack)
        if nonzero is not None:
            # x != 0, jnp's astype(bool) of a 0/1 float mask (inside jnp.where's own
            # function): x is the leaf, and the bias compares it with 0 (Builder.bias).
            self._leaves(*nonzero, dims, roles, constant, leaves)
            return
        if name == "stablehlo.broadcast_in_dim":
            inner = op.operands[0]
            bdims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
            inner_shape = shape_of(inner)
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
            mapping = unit_reshape_map(shape_of(op.operands[0]), shape)
            if mapping is None:
                raise NotFused("the mask is reshaped")
            new = [None if m is None else dims[m] for m in mapping]
            self._leaves(op.operands[0], stack, new, roles, constant, leaves)
            return
        if stack != ():
            raise NotFused(f"the mask is computed inside a called function ({name})")
        leaves.append(MaskLeaf(value, [None if d is None else roles[d] for d in dims]))

    def _hoisted(self, value: ir.Value, dims: list[int | None], roles: list[Role],
                 constant: list) -> MaskLeaf | None:
        """The leaf of a mask jax computed before a loop and passes through it unchanged
        (a remat'd scan's causal AND padding mask, broadcast to the scores' [B, K, G, T,
        S]): read at index 0 along the dimensions the mask before the loop does not vary
        along (a GQA group axis is no second query axis), its constant parts read there
        too (cuDNN's causal mask). None where ``value`` is no such carry or that mask
        cannot be read."""
        # Followed out of the loop, out of the function called once, through
        # jax.checkpoint's optimization barrier (its backward site lost cuDNN's causal
        # mask: review h101); nothing followed, no mask made before.
        op, before, stack = self.view.producer(value, (), invariant_carries=True)
        if op is None or before == value:
            return None
        before_constant: list = []
        before_leaves: list[MaskLeaf] = []
        try:
            self._leaves(before, stack, dims, roles, before_constant, before_leaves)
        except NotFused:
            return None
        varying = {rs[d] for _array, select_dims, rs in before_constant for d in select_dims}
        # A constant part that varies along the batch or heads (a prefix-LM mask of
        # per-sequence prefix lengths) is no constant mask of the kernel's: the bias
        # reads it in the loop's value.
        if any(r[0] != "Q" and r != S_ROLE for r in varying):
            before_constant = []
        varying |= {r for leaf in before_leaves for r in leaf.roles if r is not None}
        shape = shape_of(value)
        first_only = tuple(i for i, d in enumerate(dims)
                           if shape[i] > 1 and (d is None or roles[d] not in varying))
        constant.extend(before_constant)
        return MaskLeaf(value, [None if d is None or i in first_only else roles[d]
                                for i, d in enumerate(dims)], first_only)

    def _nonzero(self, op: ir.Operation, stack: Stack) -> tuple[ir.Value, Stack] | None:
        """``x`` (and its stack) where ``op`` is ``compare NE x, 0`` of a float or
        integer ``x``; ``b`` where ``x`` is ``convert(b)`` of a boolean ``b``."""
        if op.name != "stablehlo.compare" or str(
                op.attributes["comparison_direction"]).split()[-1].rstrip(">") != "NE":
            return None
        x, zero = op.operands
        if splat_value(self.view, zero, stack) != 0:
            x, zero = zero, x
        if splat_value(self.view, zero, stack) != 0:
            return None
        if _is_boolean(x):
            return None
        # convert(b) != 0 of a boolean b is b (Flax's 0/1 float masks, combine_masks of
        # make_causal_mask: the causal part went into the bias, review h101).
        made, _value, made_stack = self.view.producer(x, stack)
        if made is not None and made.name == "stablehlo.convert" and _is_boolean(
                made.operands[0]):
            return made.operands[0], made_stack
        return x, stack

    def _query_axis(self, constant: bool, axis_roles: list[Role], leaves: list) -> Role:
        """The query position among the query's free dimensions: the one the mask varies
        along, else the longest. A dimension of size 1 varies along nothing (jax hoists a
        padding mask out of a remat'd scan broadcast to the scores' [1, B, N, T, S] with a
        GQA group axis of 1: 'varies along more than one query dimension')."""
        candidates = [r for r in self.q_roles if r[0] == "Q"]
        named = {r for r in axis_roles if r in candidates} if constant else set()
        for leaf in leaves:
            named |= {r for r in leaf.roles if r in candidates}
        varying = {r for r in named if self.sizes[r] > 1}
        if len(varying) > 1:
            raise NotFused("the mask varies along more than one query dimension")
        if varying:
            return varying.pop()
        if len(named) == 1:  # a decode step's query of length 1 (a GQA group is longer)
            return named.pop()
        if not candidates:  # q [B, N, H] against a cache: one query, no axis for it
            raise NotFused("the query has no query-length dimension (a decode step: give "
                           "q a length-1 axis, [B, 1, N, H])")
        return max(candidates, key=lambda r: (self.sizes[r], -r[1]))

    def _constant_mask(self, parts: list[tuple[np.ndarray, tuple[Role, ...]]],
                       axis_roles: list[Role], t_role: Role
                       ) -> tuple[bool, int, tuple[np.ndarray, ...]]:
        """Whether a constant part is causal (cuDNN's own mask), the length of a causal
        sliding window in it (cuDNN's own too; 0: none), and the other parts for the
        kernel's bias, each [T, S], [T, 1] or [1, S] (a two-sided window, a prefix-LM
        or block-causal mask, causal over queries and keys of different lengths,
        constant sequence lengths: no part broadcast to T x S); none that masks
        nothing."""
        if set(axis_roles) - {t_role, S_ROLE}:
            raise NotFused("a constant mask that varies along the batch or heads")
        t, s = self.sizes[t_role], self.sizes[S_ROLE]
        factors = []
        for array, roles in parts:
            if roles == (S_ROLE, t_role):
                array = array.T
            factor = array.reshape([t if t_role in roles else 1, s if S_ROLE in roles else 1])
            if not factor.all():
                factors.append(np.ascontiguousarray(factor))
        # A [T, S] part that is a [T] and an [S] mask ANDed (jax's sequence lengths, read
        # as one constant), causal or not, goes as them (no T x S constant).
        causal = False
        window = 0
        split: list[np.ndarray] = []
        for factor in factors:
            if factor.shape == (t, s) and 1 not in factor.shape:
                rows, keys = factor.any(axis=1, keepdims=True), factor.any(axis=0, keepdims=True)
                outer = rows & keys
                found = causal_window(factor, outer) if t == s and not causal else None
                if found is not None:
                    causal, window = True, found
                    split += [v for v in (rows, keys) if not v.all()]
                    continue
                if np.array_equal(factor, outer):
                    split += [v for v in (rows, keys) if not v.all()]
                    continue
            split.append(factor)
        return causal, window, tuple(split)

    def _check_leaves(self, match: object) -> None:
        for leaf in match.mask_leaves:  # type: ignore[attr-defined]
            if HV_ROLE in leaf.roles or H_ROLE in leaf.roles:
                raise NotFused("the mask has a head dimension")
