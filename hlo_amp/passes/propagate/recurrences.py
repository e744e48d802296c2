"""Loop-carried accumulators for the fast mode: a value a loop updates from itself
through arithmetic alone (an RNN's state ``h = a * h + x @ W``, an ODE solver's
``y = y + dt * f(y)``, gradients summed over microbatches) stays f32, as the state a
program carries in f32 stays f32 under PyTorch's autocast. Painted, it was rounded to 16
bit at every iteration: 13% to 53% error over a few hundred steps under bf16.

A stream of layers (``jax.lax.scan`` over stacked weights: a matrix op on the carry's
way reads a value made from it and a slice of a stack the loop counter picks) stays
16-bit, as between unrolled layers: its carry is each layer's activation, not a sum
over many steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxlib.mlir import ir

from hlo_amp.ir.loops import enclosing_loops, loop_body
from hlo_amp.ir.modules import element_type, op_key, terminator
from hlo_amp.ir.op_classes import CLEAR, DENY, INFER, MATRIX_OP_NAMES, PICKING_KINDS
from hlo_amp.passes.propagate.graph import LINK, STATE_UPDATE
from hlo_amp.targets.dot_dims import dot_layout

if TYPE_CHECKING:
    from hlo_amp.passes.propagate.graph import Graph, Node

LOOP_ACCUMULATOR = "accumulates a loop-carried value over iterations"
# Infer ops that pick one of their inputs, or compare them: no rounding compounds.
_PICKING = PICKING_KINDS | {"compare"}


def deny_loop_accumulators(graph: Graph) -> None:
    """Deny the infer and clear ops of each accumulation cycle of a loop carry, and keep
    the carry f32, unless the carry is a stream of layers."""
    parents = {child: (inst_id, index) for inst_id, inst in enumerate(graph.instances)
               for index, child in inst.calls.items()}
    loops: dict[tuple[int, int], _Loop] = {}
    for node in graph.nodes:
        # A carry kept f32 as state the function returns still has its cycle's ops to
        # deny (an optimizer's moments passed into a multi-step scan: 0.9 * m broke the
        # state rule's add chain, and the moments were updated in 16 bit each step).
        if node.cls != LINK or node.kind != "while" or node.reason not in ("", STATE_UPDATE):
            continue
        key = (node.inst, node.index)
        if key not in loops:
            loops[key] = _Loop(graph, node.inst, graph.instances[node.inst].ops[node.index],
                               parents)
        members = _accumulation(graph, node, loops[key])
        # Carries taking turns stream layers if any of them does (a reversible net's
        # (a, b) -> (b, a + F(b)) over stacked weights: a's own result reads no layer).
        turns = {node.slot} | {member.slot for member in members if member.kind == "while"
                               and (member.inst, member.index) == key}
        if not members or any(loops[key].streams_layers(slot) for slot in turns):
            continue
        for member in members + [node]:
            # Painted, the sum is rounded at every iteration; its carry stays f32 too.
            member.cls = DENY if member.cls in (INFER, CLEAR) else member.cls
            member.reason = member.reason or LOOP_ACCUMULATOR


def _accumulation(graph: Graph, carry: Node, loop: _Loop) -> list[Node]:
    """The infer, clear and link nodes inside ``loop`` on a path from ``carry``'s body
    argument to its body result through such nodes and the loop's other carries, if one
    of them is arithmetic."""
    start, end = carry.outputs[0], carry.inputs[1]
    if start[1] == end[1]:  # passed through unchanged
        return []

    def on_the_way(node: Node) -> bool:
        if node is carry:
            return False
        if node.cls == LINK and node.kind == "while" and (node.inst, node.index) == (
                carry.inst, carry.index):
            # Through another carry into the next iteration: carries taking turns,
            # (a, b) -> (b, a + d), sum as one does (23% error painted, under bf16).
            return True
        return node.cls in (INFER, CLEAR, LINK) and loop.holds(
            node.inst, graph.instances[node.inst].ops[node.index])

    members = graph.paths([start], on_the_way, lambda node: end in node.outputs)
    if not any(n.cls == INFER and n.kind not in _PICKING for n in members):
        return []  # data movement alone: each entry is rounded once, nothing compounds
    return members


_Key = tuple[int, ir.Value]  # (instance, value)
_NONE: frozenset[int] = frozenset()


class _Loop:
    """One while loop's body seen backward from its values to its carries (through
    called functions and nested loops): which carries a value depends on."""

    def __init__(self, graph: Graph, inst_id: int, loop: Any,
                 parents: dict[int, tuple[int, int]]) -> None:
        self.graph = graph
        self.inst_id = inst_id
        self.loop_key = op_key(loop)
        self.loop_operands = list(loop.operands)
        self.parents = parents  # instance -> (its caller's instance, the call's index)
        self.body = loop_body(loop)
        self.results = list(terminator(self.body).operands)
        arguments = list(self.body.arguments)
        self.changing = {slot for slot, value in enumerate(self.results)
                         if value != arguments[slot]}
        self.float_changing = {slot for slot in self.changing
                               if _is_float(arguments[slot])}
        self.memo: dict[_Key, frozenset[int]] = {}
        # The loop counters: integer scalars each iteration makes from themselves alone
        # (i + 1; a PRNG key the loop splits is an array, and picks no layer).
        self.counters = {slot for slot in self.changing - self.float_changing
                         if _is_integer(arguments[slot])
                         and ir.RankedTensorType(arguments[slot].type).rank == 0
                         and self.carries_behind((inst_id, self.results[slot])) <= {slot}}

    def holds(self, inst_id: int, op: Any) -> bool:
        """Whether ``op`` (of instance ``inst_id``) runs inside this loop: in it, in a
        loop or region in it, or in a function called from it."""
        while True:
            if inst_id == self.inst_id and self.loop_key in enclosing_loops(op):
                return True
            if inst_id not in self.parents:
                return False
            inst_id, index = self.parents[inst_id]
            op = self.graph.instances[inst_id].ops[index]

    def streams_layers(self, slot: int) -> bool:
        """Whether carry ``slot`` is a stream of layers: a matrix op on its way from its
        body argument to its body result contracts, along its trailing dimensions (its
        features), a value made from it with a layer's weight: a matrix without the op's
        batch dimensions that each iteration picks with the loop counter, without a
        matrix op, from no float carry the loop changes. A per-step input (an RNN's
        x_t, a delta rule's k_t = x_t @ W_k, or a k_t given as such, batched with its
        state or a vector) is no layer's weight, weights a training loop updates are
        contracted along their rows, a recurrence's weights are the same at every
        iteration, and what a loop sums its gradients of reads no layer."""
        for inst_id, op in self._matrix_ops_behind((self.inst_id, self.results[slot])):
            for side in (0, 1):
                own, other = op.operands[1 - side], op.operands[side]
                if (slot in self.carries_behind((inst_id, own)) and _weight_shaped(op, side)
                        and _features_contracted(op, 1 - side)
                        and self._picks_a_layer((inst_id, other))):
                    return True
        return False

    def _picks_a_layer(self, key: _Key) -> bool:
        carries = self.carries_behind(key)
        if not carries & self.counters or carries & self.float_changing:
            return False
        if self._matrix_ops_behind(key):
            return False
        stacks = [slot for slot in carries - self.changing  # the indices' aside
                  if _is_float(self.loop_operands[slot])]
        return not any(self._matrix_ops_behind((self.inst_id, self.loop_operands[slot]))
                       for slot in stacks)

    def carries_behind(self, key: _Key) -> frozenset[int]:
        """The carries (slots) the value ``key`` depends on within one iteration."""
        if key in self.memo:
            return self.memo[key]
        found: dict[_Key, frozenset[int]] = {}
        partial: set[_Key] = set()  # found while one of its inputs was still open
        pending: list[tuple[_Key, bool]] = [(key, False)]
        before: dict[_Key, list[_Key]] = {}
        while pending:
            current, expanded = pending.pop()
            if current in self.memo or current in found:
                continue
            if expanded:
                inputs = before.pop(current)
                found[current] = _NONE.union(
                    *(self.memo.get(k, found.get(k, _NONE)) for k in inputs))
                # A nested loop's carry met again on its own cycle adds no carry of
                # this loop, but what was found with it open is only whole at the
                # value that opened it: only complete values are memoised.
                if any(k in before or k in partial for k in inputs):
                    partial.add(current)
                else:
                    self.memo[current] = found[current]
                continue
            if current in before:
                continue
            step = self._step_back(current)
            if isinstance(step, frozenset):
                self.memo[current] = step
                continue
            before[current] = step
            pending.append((current, True))
            pending.extend((k, False) for k in step if k not in self.memo)
        return self.memo.get(key, found.get(key, _NONE))

    def _matrix_ops_behind(self, key: _Key) -> list[tuple[int, Any]]:
        """The matrix ops the value ``key`` is made from within one iteration."""
        found: list[tuple[int, Any]] = []
        seen, pending = {key}, [key]
        while pending:
            inst_id, value = current = pending.pop()
            if (not isinstance(value, ir.BlockArgument)
                    and value.owner.operation.name in MATRIX_OP_NAMES):
                found.append((inst_id, value.owner.operation))
            step = self._step_back(current)
            for k in () if isinstance(step, frozenset) else step:
                if k not in seen:
                    seen.add(k)
                    pending.append(k)
        return found

    def _step_back(self, key: _Key) -> list[_Key] | frozenset[int]:
        """The values ``key`` is made from, or the carries it is when it is one of this
        loop's body arguments (an empty set: from outside the loop)."""
        inst_id, value = key
        graph = self.graph
        if isinstance(value, ir.BlockArgument):
            block = value.owner
            if block == self.body:
                return frozenset({value.arg_number})
            owner = block.owner.operation
            if owner.name == "func.func":
                caller = graph.call_argument.get(key)
                return _NONE if caller is None else [caller]
            if owner.name == "stablehlo.while":
                return _carried(inst_id, owner, value.arg_number)
            return _NONE
        op = value.owner.operation
        number = ir.OpResult(value).result_number
        if op.name == "func.call":
            index = graph.op_index(inst_id, op)
            child = None if index is None else graph.instances[inst_id].calls.get(index)
            if child is None:
                return [(inst_id, operand) for operand in op.operands]
            entry = graph.instances[child].fn.regions[0].blocks[0]
            return [(child, terminator(entry).operands[number])]
        if op.name == "stablehlo.while":
            return _carried(inst_id, op, number)
        if op.name == "stablehlo.optimization_barrier":  # jax.checkpoint's: pairwise
            return [(inst_id, op.operands[number])]
        if op.name in ("stablehlo.case", "stablehlo.if"):
            return [(inst_id, op.operands[0])] + [
                (inst_id, terminator(region.blocks[0]).operands[number])
                for region in op.regions]
        return [(inst_id, operand) for operand in op.operands]


def _carried(inst_id: int, loop: Any, slot: int) -> list[_Key]:
    """What a nested loop's carry ``slot`` is made from: its operand and its body's
    result."""
    return [(inst_id, loop.operands[slot]), (inst_id, terminator(loop_body(loop)).operands[slot])]


def _weight_shaped(op: Any, side: int) -> bool:
    """Whether operand ``side`` of matrix op ``op`` is shaped as a layer's weight: a
    matrix (or a filter) that shares no batch dimension with the other operand."""
    if ir.RankedTensorType(op.operands[side].type).rank < 2:
        return False
    if op.name != "stablehlo.dot_general":
        return True
    layout = dot_layout(op)
    return layout is not None and not layout.batch(side)


def _features_contracted(op: Any, side: int) -> bool:
    """Whether matrix op ``op`` contracts operand ``side`` along its trailing dimensions
    alone, as a layer contracts its activations' features (a training loop's weights
    are contracted along their rows: x_t @ w)."""
    if op.name != "stablehlo.dot_general":
        return True
    layout = dot_layout(op)
    return layout is not None and layout.contracts_edge(side, leading=False)


def _is_float(value: ir.Value) -> bool:
    return isinstance(element_type(value), ir.FloatType)


def _is_integer(value: ir.Value) -> bool:
    """An integer, not a boolean (i1)."""
    element = element_type(value)
    return isinstance(element, ir.IntegerType) and ir.IntegerType(element).width > 1
