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

from hlo_amp.ir.loops import loop_body
from hlo_amp.ir.modules import element_type, terminator
from hlo_amp.ir.op_classes import CLEAR, DENY, INFER, MATRIX_OP_NAMES
from hlo_amp.passes.propagate.graph import LINK

if TYPE_CHECKING:
    from hlo_amp.passes.propagate.graph import Graph, Node

LOOP_ACCUMULATOR = "accumulates a loop-carried value over iterations"
# Infer ops that pick one of their inputs: no rounding compounds through them.
_PICKING = frozenset({"select", "maximum", "minimum", "clamp", "compare"})


def deny_loop_accumulators(graph: Graph) -> None:
    """Deny the infer and clear ops of each accumulation cycle of a loop carry, and keep
    the carry f32, unless the carry is a stream of layers."""
    loops: dict[tuple[int, int], _Loop] = {}
    for node in graph.nodes:
        if node.cls != LINK or node.kind != "while" or node.reason:
            continue
        members = _accumulation(graph, node)
        if not members:
            continue
        key = (node.inst, node.index)
        if key not in loops:
            loops[key] = _Loop(graph, node.inst, graph.instances[node.inst].ops[node.index])
        if loops[key].streams_layers(node.slot):
            continue
        for member in members + [node]:
            # arithmetic and data movement: deny; the carries: f32, not painted
            member.cls = DENY if member.cls in (INFER, CLEAR) else member.cls
            member.reason = LOOP_ACCUMULATOR


def _accumulation(graph: Graph, carry: Node) -> list[Node]:
    """The infer, clear and link nodes on a path from ``carry``'s body argument to its
    body result through such nodes, if one of them is arithmetic."""
    start, end = carry.outputs[0], carry.inputs[1]
    if start[1] == end[1]:  # passed through unchanged
        return []
    reached: dict[int, Node] = {}
    seen, pending = {start}, [start]
    while pending:
        for reader in graph.consumers(pending.pop()):
            if (isinstance(reader, str) or reader is carry or id(reader) in reached
                    or reader.cls not in (INFER, CLEAR, LINK)):
                continue
            reached[id(reader)] = reader
            for key in reader.outputs:
                if key not in seen:
                    seen.add(key)
                    pending.append(key)
    if end not in seen:
        return []
    cycle: dict[int, Node] = {}
    back = [graph.producer.get(end)]
    while back:
        node = back.pop()
        if node is None or id(node) not in reached or id(node) in cycle:
            continue
        cycle[id(node)] = node
        back.extend(graph.producer.get(key) for key in node.inputs)
    members = list(cycle.values())
    if not any(n.cls == INFER and n.kind not in _PICKING for n in members):
        return []  # data movement alone: each entry is rounded once, nothing compounds
    return members


_Key = tuple[int, ir.Value]  # (instance, value)
_FLOATS = frozenset({"f64", "f32", "bf16", "f16"})
_NONE: frozenset[int] = frozenset()


class _Loop:
    """One while loop's body seen backward from its values to its carries (through
    called functions and nested loops): which carries a value depends on."""

    def __init__(self, graph: Graph, inst_id: int, loop: Any) -> None:
        self.graph = graph
        self.inst_id = inst_id
        self.body = loop_body(loop)
        self.results = list(terminator(self.body).operands)
        arguments = list(self.body.arguments)
        self.changing = {slot for slot, value in enumerate(self.results)
                         if value != arguments[slot]}
        self.float_changing = {slot for slot in self.changing
                               if str(element_type(arguments[slot])) in _FLOATS}
        self.memo: dict[_Key, frozenset[int]] = {}

    def streams_layers(self, slot: int) -> bool:
        """Whether carry ``slot`` is a stream of layers: a matrix op on its way from its
        body argument to its body result reads, beside a value made from it, a value
        each iteration makes from the loop counter alone (a slice of stacked weights,
        dequantised or split as it may be) and from no float carry the loop changes. A
        per-step input (an RNN's x_t) is read with loop-invariant weights, a recurrence's
        weights are invariant, and what a loop sums its gradients of reads no layer."""
        for inst_id, op in self._matrix_ops_behind((self.inst_id, self.results[slot])):
            sides = [self.carries_behind((inst_id, value)) for value in list(op.operands)[:2]]
            for own, other in (sides, sides[::-1]):
                if (slot in own and other & self.changing
                        and not other & self.float_changing):
                    return True
        return False

    def carries_behind(self, key: _Key) -> frozenset[int]:
        """The carries (slots) the value ``key`` depends on within one iteration."""
        if key in self.memo:
            return self.memo[key]
        pending: list[tuple[_Key, bool]] = [(key, False)]
        before: dict[_Key, list[_Key]] = {}
        while pending:
            current, expanded = pending.pop()
            if current in self.memo:
                continue
            if expanded:
                self.memo[current] = _NONE.union(
                    *(self.memo.get(k, _NONE) for k in before.pop(current)))
                continue
            if current in before:  # a nested loop's carry reached again: no new carry
                continue
            found = self._step_back(current)
            if isinstance(found, frozenset):
                self.memo[current] = found
                continue
            before[current] = found
            pending.append((current, True))
            pending.extend((k, False) for k in found if k not in self.memo)
        return self.memo.get(key, _NONE)

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
            if owner.name == "stablehlo.while":  # a nested loop's carry
                return [(inst_id, owner.operands[value.arg_number]),
                        (inst_id, terminator(loop_body(owner)).operands[value.arg_number])]
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
            return [(inst_id, op.operands[number]),
                    (inst_id, terminator(loop_body(op)).operands[number])]
        if op.name == "stablehlo.optimization_barrier":  # jax.checkpoint's: pairwise
            return [(inst_id, op.operands[number])]
        if op.name in ("stablehlo.case", "stablehlo.if"):
            return [(inst_id, op.operands[0])] + [
                (inst_id, terminator(region.blocks[0]).operands[number])
                for region in op.regions]
        return [(inst_id, operand) for operand in op.operands]
