"""Putting a fused kernel in place of a matched attention: q, k, v (and dO) into the
kernel's ``[B, T, N, H]`` layout and 16-bit type, the kernel's functions inlined at the
site, its results back into each exit's layout and type, and the now dead attention ops
discarded.

The kernel's layout groups the roles (match.py): B = the batch roles before the query
axis in Q's own order, N = the key/value-head roles after it times the group roles
(grouped-query attention: K = the head roles alone), T = the query axis, S = the keys.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    callee_name,
    discard,
    is_discarded,
    live_uses,
    mark_kernel_matmul,
    op_key,
    terminator,
    walk_operations,
)
from hlo_amp.ir.op_classes import MATRIX_OP_NAMES
from hlo_amp.passes.fused_attention.calls import SHARDING_CONSTRAINT
from hlo_amp.passes.fused_attention.masks import band_of
from hlo_amp.passes.fused_attention.roles import (
    H_ROLE,
    HV_ROLE,
    S_ROLE,
    UNIT,
    NotFused,
    Role,
    shape_of,
)
from hlo_amp.passes.fused_attention.site import Match
from hlo_amp.policy import DTYPE_TO_ELEMENT
from hlo_amp.targets.attention_kernels import AttentionCall, Kernel


@dataclass(frozen=True)
class Layout:
    """The roles of the kernel's four dimensions, each a group of the site's roles."""

    batch: tuple[Role, ...]
    heads: tuple[Role, ...]  # key/value heads
    groups: tuple[Role, ...]  # query heads per key/value head
    t: Role

    def order(self, operand: str) -> list[Role]:
        """Each operand's roles in the kernel's order (before merging groups)."""
        if operand in ("q", "dq"):
            return [*self.batch, self.t, *self.heads, *self.groups, H_ROLE]
        if operand in ("o", "do"):
            return [*self.batch, self.t, *self.heads, *self.groups, HV_ROLE]
        if operand in ("k", "dk"):
            return [*self.batch, S_ROLE, *self.heads, H_ROLE]
        if operand in ("v", "dv"):
            return [*self.batch, S_ROLE, *self.heads, HV_ROLE]
        raise ValueError(operand)


def layout_of(match: Match) -> Layout:
    q_order = [r for r in match.q_roles if r[0] in ("B", "Q")]
    position = q_order.index(match.t_role)
    batch = tuple(r for r in q_order[:position] if r[0] == "B")
    heads = tuple(r for r in q_order[position + 1:] if r[0] == "B")
    groups = tuple(r for r in q_order if r[0] == "Q" and r != match.t_role)
    return Layout(batch, heads, groups, match.t_role)


def call_of(match: Match, layout: Layout, dtype: str, bias_shape: tuple | None
            ) -> AttentionCall:
    sizes = match.sizes

    def size(roles: tuple[Role, ...]) -> int:
        return math.prod(sizes[r] for r in roles)

    return AttentionCall(
        batch=size(layout.batch), q_len=sizes[layout.t], kv_len=sizes[S_ROLE],
        q_heads=size(layout.heads) * size(layout.groups), kv_heads=size(layout.heads),
        head_dim=sizes[H_ROLE], dtype=dtype, scale=match.scale, causal=match.causal,
        bias_shape=bias_shape, training=match.training, window=match.window)


def bias_shape_of(match: Match, layout: Layout) -> tuple[int, int, int, int] | None:
    """[B|1, N|1, T, S]: full along a group only where the mask varies along it."""
    if not match.has_bias:
        return None
    varying = {r for leaf in match.mask_leaves for r in leaf.roles if r is not None}
    sizes = match.sizes
    batch = math.prod(sizes[r] for r in layout.batch) if varying & set(layout.batch) else 1
    head_roles = set(layout.heads) | set(layout.groups)
    heads = (math.prod(sizes[r] for r in (*layout.heads, *layout.groups))
             if varying & head_roles else 1)
    return (batch, heads, sizes[layout.t], sizes[S_ROLE])


class _Builder:
    """Ops written at one insertion point, named by one location."""

    def __init__(self, before: ir.Operation, location: ir.Location) -> None:
        self.point = ir.InsertionPoint(before)
        self.location = location

    def __enter__(self) -> _Builder:  # noqa: PYI034 - a plain class, never subclassed
        self.point.__enter__()
        self.location.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        self.location.__exit__(*args)
        self.point.__exit__(*args)

    @staticmethod
    def tensor(shape: list[int], element: ir.Type) -> ir.RankedTensorType:
        return ir.RankedTensorType.get(shape, element)

    def to_kernel(self, value: ir.Value, roles: list[Role], order: list[Role],
                  shape4: tuple[int, ...], element: ir.Type) -> ir.Value:
        """``value`` (dimensions ``roles``) transposed into ``order``, merged into the
        kernel's four dimensions, converted to ``element``."""
        source = ir.RankedTensorType(value.type)
        units = [i for i, r in enumerate(roles) if r == UNIT or r not in order]
        # A role of ``order`` the value lacks is of size 1 (_check_roles): the reshape
        # to ``shape4`` puts it back.
        permutation = [roles.index(r) for r in order if r in roles] + units
        if permutation != list(range(len(roles))):
            value = hlo.transpose(value, ir.DenseI64ArrayAttr.get(permutation))
        if list(ir.RankedTensorType(value.type).shape) != list(shape4):
            value = hlo.reshape(self.tensor(list(shape4), source.element_type), value)
        if source.element_type != element:
            value = hlo.convert(self.tensor(list(shape4), element), value)
        return value

    def from_kernel(self, value: ir.Value, order: list[Role], sizes: dict[Role, int],
                    roles: list[Role], target: ir.RankedTensorType) -> ir.Value:
        """The kernel's result back into ``roles``' order and ``target``'s type."""
        element = ir.RankedTensorType(value.type).element_type
        present = [r for r in roles if r != UNIT]
        # A role of ``order`` the target lacks is of size 1 (_check_roles): dropped here.
        order = [r for r in order if r in present]
        full = [sizes[r] for r in order]
        if list(ir.RankedTensorType(value.type).shape) != full:
            value = hlo.reshape(self.tensor(full, element), value)
        permutation = [order.index(r) for r in present]
        if permutation != list(range(len(order))):
            value = hlo.transpose(value, ir.DenseI64ArrayAttr.get(permutation))
        shape = list(target.shape)
        if [sizes[r] for r in present] != shape:
            value = hlo.reshape(self.tensor(shape, element), value)
        if element != target.element_type:
            value = hlo.convert(self.tensor(shape, target.element_type), value)
        return value

    def bias(self, match: Match, layout: Layout, shape4: tuple[int, int, int, int],
             element: ir.Type, dtype: str) -> ir.Value:
        """0 where every mask leaf is true, a large negative number elsewhere (jax's own
        ``combine_bias_and_mask``: -0.7 x the type's largest), ``shape4``."""
        sizes = match.sizes
        varying = {r for leaf in match.mask_leaves for r in leaf.roles if r is not None}
        order = [*layout.batch, *layout.heads, *layout.groups, layout.t, S_ROLE]
        # Full along a whole kernel dimension (B, or N: heads and groups) where the mask
        # varies along any program dimension merged into it, as bias_shape_of says: the
        # reshape to ``shape4`` merges them (one role broadcast alone did not fill it).
        full = {layout.t, S_ROLE}
        for group in (tuple(layout.batch), (*layout.heads, *layout.groups)):
            if varying & set(group):
                full |= set(group)
        expanded = [sizes[r] if r in full else 1 for r in order]
        boolean = ir.IntegerType.get_signless(1)
        combined = None
        for factor in match.constant_mask:  # [T|1, S|1]
            value = hlo.broadcast_in_dim(
                self.tensor(expanded, boolean), self.positions_mask(factor),
                ir.DenseI64ArrayAttr.get([order.index(layout.t), order.index(S_ROLE)]))
            combined = value if combined is None else hlo.AndOp(combined, value).result
        for value, roles, first_only in match.mask_leaves:
            if first_only:
                shape = list(shape_of(value))
                value = hlo.slice(value, ir.DenseI64ArrayAttr.get([0] * len(shape)),
                                  ir.DenseI64ArrayAttr.get([1 if i in first_only else n
                                                            for i, n in enumerate(shape)]),
                                  ir.DenseI64ArrayAttr.get([1] * len(shape)))
            leaf_element = ir.RankedTensorType(value.type).element_type
            if leaf_element != boolean:  # a 0/1 mask the program reads as x != 0
                zero = self._splat(0, list(shape_of(value)), leaf_element)
                value = hlo.compare(value, zero, hlo.ComparisonDirectionAttr.get("NE"))
            keep = [i for i, r in enumerate(roles) if r is not None]
            dims = [order.index(roles[i]) for i in keep]
            arranged = sorted(range(len(keep)), key=lambda j: dims[j])
            permutation = [keep[j] for j in arranged] + [
                i for i in range(len(roles)) if i not in keep]
            if permutation != list(range(len(roles))):
                value = hlo.transpose(value, ir.DenseI64ArrayAttr.get(permutation))
            squeezed = [sizes[roles[keep[j]]] for j in arranged]
            value = hlo.reshape(self.tensor(squeezed, boolean), value)
            value = hlo.broadcast_in_dim(self.tensor(expanded, boolean), value,
                                         ir.DenseI64ArrayAttr.get(sorted(dims)))
            combined = value if combined is None else hlo.AndOp(combined, value).result
        largest = float(ml_dtypes.finfo(np.dtype(dtype)).max)
        zero = self._splat(0.0, expanded, element)
        negative = self._splat(-0.7 * largest, expanded, element)
        bias = hlo.select(combined, zero, negative)
        return hlo.reshape(self.tensor(list(shape4), element), bias)

    def positions_mask(self, array: np.ndarray) -> ir.Value:
        """The [T|1, S|1] boolean ``array``: from the positions where it is a [T, S]
        band, lo <= s - t <= hi (a sliding window, causal over different lengths: no
        constant of T x S in the module), else written out."""
        boolean = ir.IntegerType.get_signless(1)
        shape = list(array.shape)
        band = band_of(array) if 1 not in shape else None
        if band is None:
            return hlo.constant(ir.DenseElementsAttr.get(
                array, type=self.tensor(shape, boolean)))
        int32 = ir.IntegerType.get_signless(32)
        query = hlo.iota(self.tensor(shape, int32), 0)
        key = hlo.iota(self.tensor(shape, int32), 1)
        offset = hlo.subtract(key, query)
        inside = None
        lo, hi = band
        for bound, direction, needed in ((lo, "GE", lo > 1 - shape[0]),
                                         (hi, "LE", hi < shape[1] - 1)):
            if needed:  # a bound every position meets is no test
                test = hlo.compare(offset, self._splat(bound, shape, int32),
                                   hlo.ComparisonDirectionAttr.get(direction))
                inside = test if inside is None else hlo.AndOp(inside, test).result
        return inside if inside is not None else self._splat(1, shape, boolean)

    def _splat(self, number: float, shape: list[int], element: ir.Type) -> ir.Value:
        scalar = ir.RankedTensorType.get([], element)
        attr = (ir.IntegerAttr.get(element, int(number)) if isinstance(element, ir.IntegerType)
                else ir.FloatAttr.get(element, number))
        constant = hlo.constant(ir.DenseElementsAttr.get_splat(scalar, attr))
        return hlo.broadcast_in_dim(self.tensor(shape, element), constant,
                                    ir.DenseI64ArrayAttr.get([]))


_LOC_DEFINITION = re.compile(r"^(#loc\d*) = loc\(.*\)$", re.MULTILINE)


def splice(text: str, operands: list[ir.Value], before: ir.Operation, name: str
           ) -> list[ir.Value]:
    """The ops of ``text``'s ``@main`` copied before ``before``, reading ``operands``, all
    named ``name``; the values it returns. Functions ``@main`` calls are copied into
    ``before``'s module under names of their own."""
    escaped = name.replace("\\", "\\\\").replace('"', '\\"')
    text = _LOC_DEFINITION.sub(lambda m: f'{m.group(1)} = loc("{escaped}")', text)
    kernel = ir.Module.parse(text, context=before.context)
    for op in walk_operations(kernel, names=MATRIX_OP_NAMES):  # the reference kernel's
        mark_kernel_matmul(op)
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op
                 for op in kernel.body.operations}
    main = functions.pop("main")
    renamed = _copy_functions(functions, before)
    block = main.regions[0].blocks[0]
    mapping: dict[ir.Value, ir.Value] = dict(zip(block.arguments, operands))
    point = ir.InsertionPoint(before)
    ops = list(block.operations)
    for op in ops[:-1]:
        copy = op.operation.clone(ip=point)
        for index, operand in enumerate(copy.operands):
            if operand in mapping:
                copy.operands[index] = mapping[operand]
        for old, new in zip(op.results, copy.results):
            mapping[old] = new
        _rename_calls(copy, renamed)
    results = [mapping[v] for v in terminator(block).operands]
    del kernel  # the copies hold nothing of it
    return results


def _copy_functions(functions: dict[str, ir.Operation], before: ir.Operation
                    ) -> dict[str, str]:
    """Copy the kernel's private functions to the end of ``before``'s module, each under
    a name no function there has; old name -> new name."""
    if not functions:
        return {}
    module_op = before
    while module_op.parent is not None:
        module_op = module_op.parent
    body = module_op.regions[0].blocks[0]
    taken = {ir.StringAttr(op.attributes["sym_name"]).value for op in body.operations
             if "sym_name" in op.attributes}
    renamed = {}
    for old in functions:
        number = 0
        while f"{old}_attention_kernel{number}" in taken:
            number += 1
        renamed[old] = f"{old}_attention_kernel{number}"
        taken.add(renamed[old])
    at_end = ir.InsertionPoint(body)
    for old, fn in functions.items():
        copy = fn.operation.clone(ip=at_end)
        copy.attributes["sym_name"] = ir.StringAttr.get(renamed[old])
        copy.attributes["sym_visibility"] = ir.StringAttr.get("private")
        _rename_calls(copy, renamed)
    return renamed


def _rename_calls(op: ir.Operation, renamed: dict[str, str]) -> None:
    if not renamed:
        return
    calls = walk_operations(op, names=frozenset({"func.call"}))
    if op.name == "func.call":
        calls.append(op)
    for call in calls:
        callee = callee_name(call)
        if callee in renamed:
            call.attributes["callee"] = ir.FlatSymbolRefAttr.get(renamed[callee])


def element_of(dtype: str) -> ir.Type:
    return ir.Type.parse(DTYPE_TO_ELEMENT[dtype])


def rewrite(match: Match, kernel: Kernel, call: AttentionCall, layout: Layout,
            dtype: str, name: str) -> None:
    """Replace ``match``'s exits with ``kernel``'s results; the kernel's forward ops are
    named ``name``, its backward's ``name + "_backward"``, the layout ops around them
    ``.../fused_attention``."""
    exits = match.exits
    ordered = _in_order([e.op for e in exits.values()])
    first = ordered[0]
    _check_defined_before([match.q, match.k, match.v]
                          + [leaf.value for leaf in match.mask_leaves], first)
    _check_roles(match, layout)
    element = element_of(dtype)
    sizes = match.sizes
    location = ir.Location.name(name.rsplit("/", 1)[0] + "/fused_attention",
                                context=first.context)
    with _Builder(first, location) as build:
        q = build.to_kernel(match.q, match.q_roles, layout.order("q"), call.q_shape, element)
        k = build.to_kernel(match.k, match.k_roles, layout.order("k"), call.kv_shape,
                            element)
        v = build.to_kernel(match.v, match.v_roles, layout.order("v"), call.kv_shape,
                            element)
        inputs = [q, k, v]
        if call.bias_shape is not None:
            inputs.append(build.bias(match, layout, call.bias_shape, element, dtype))
    forward = splice(kernel.forward, inputs, first, name)
    out = forward[0]
    if "out" in exits:
        target = exits["out"]
        with _Builder(target.op, location) as build:
            new = build.from_kernel(out, layout.order("o"), sizes, target.roles,
                                    ir.RankedTensorType(target.op.results[0].type))
        _replace(target.op, new)
    if not match.training:
        return
    backward_exits = _in_order([exits[k].op for k in ("dv", "dq", "dk")])
    where = backward_exits[0]
    _check_defined_before([match.d_out], where)
    with _Builder(where, location) as build:
        d_out = build.to_kernel(match.d_out, match.d_out_roles, layout.order("do"),
                                call.q_shape, element)
    grads = splice(kernel.backward, [*forward[1:], d_out], where, name + "_backward")
    for kind, value, operand in (("dq", grads[0], "dq"), ("dk", grads[1], "dk"),
                                 ("dv", grads[2], "dv")):
        target = exits[kind]
        with _Builder(target.op, location) as build:
            new = build.from_kernel(value, layout.order(operand), sizes, target.roles,
                                    ir.RankedTensorType(target.op.results[0].type))
        _replace(target.op, new)


def _in_order(ops: list[ir.Operation]) -> list[ir.Operation]:
    """``ops`` (of one block) in program order."""
    return sorted(ops, key=functools.cmp_to_key(
        lambda a, b: 0 if a == b else (-1 if a.is_before_in_block(b) else 1)))


def _check_defined_before(values: list[ir.Value | None], op: ir.Operation) -> None:
    for value in values:
        if value is None or isinstance(value, ir.BlockArgument):
            continue
        owner = value.owner.operation
        if owner.block == op.block and not owner.is_before_in_block(op):
            raise NotFused("an input of the attention is computed after its first use")


def _check_roles(match: Match, layout: Layout) -> None:
    """Each of q, k and v has every dimension the kernel's layout orders, but for ones of
    size 1 (checked before anything is written: a rewrite that fails half-way fails the
    compile). A backward whose output gradient is a constant (a loss linear in the
    attention's output) gave v without its kv-head dimension for one kv head, and the
    pass raised. At batch 1 a remat'd backward's v reads its batch dimension as a unit
    one: the reshapes into and out of the kernel put it back and drop it again."""
    for name, roles in (("q", match.q_roles), ("k", match.k_roles), ("v", match.v_roles)):
        missing = [role for role in layout.order(name)
                   if role not in roles and match.sizes[role] != 1]
        if missing:
            named = ", ".join(f"batch dimension {role[1]} of the scores" if role[0] == "B"
                              else str(role) for role in missing)
            raise NotFused(f"{name} as the program computes it lacks the kernel's {named}")


def _replace(op: ir.Operation, new: ir.Value) -> None:
    op.results[0].replace_all_uses_with(new)
    discard(op)


_IMPURE = frozenset({"stablehlo.custom_call", "stablehlo.send", "stablehlo.recv",
                     "stablehlo.outfeed", "stablehlo.infeed", "stablehlo.rng_bit_generator",
                     "stablehlo.while", "stablehlo.case", "stablehlo.if"})


def discard_dead(seeds: list[ir.Operation]) -> int:
    """Discard each op of ``seeds`` that nothing reads any more and that has no effects,
    then the same for the ops making their operands (an op whose readers all went is
    looked at again); how many. Ops ``seeds`` holds already discarded are followed."""
    pending = [op.operation for op in seeds]
    expanded: set[int] = set()
    count = 0
    while pending:
        operation = pending.pop()
        key = op_key(operation)
        if key in expanded:
            continue
        if not is_discarded(operation):
            name = operation.name
            if name in _IMPURE or not (name.startswith("stablehlo.")
                                       or name in ("func.call", SHARDING_CONSTRAINT)):
                continue
            if any(True for result in operation.results for _ in live_uses(result)):
                continue
            discard(operation)
            count += 1
        expanded.add(key)
        for operand in operation.operands:
            if not isinstance(operand, ir.BlockArgument):
                pending.append(operand.owner.operation)
    return count
