"""Loop-carried accumulators for the fast mode: a value a loop updates from itself
through arithmetic alone (an RNN's state ``h = a * h + x @ W``, an ODE solver's
``y = y + dt * f(y)``, gradients summed over microbatches) stays f32, as the state a
program carries in f32 stays f32 under PyTorch's autocast. Painted, it was rounded to 16
bit at every iteration: 13% to 53% error over a few hundred steps under bf16.

A loop over layers (``jax.lax.scan`` over stacked weights: a matrix op reads a slice of
a stack and a value the loop computes) keeps its residual stream 16-bit, as between
unrolled layers: its carry is each layer's activation, not a sum over many steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jaxlib.mlir import ir

from hlo_amp.ir.loops import loop_body, stack_slice
from hlo_amp.ir.modules import SAME_VALUE_OPS, terminator
from hlo_amp.ir.op_classes import ALLOW, CLEAR, DENY, INFER
from hlo_amp.passes.propagate.graph import LINK

if TYPE_CHECKING:
    from hlo_amp.passes.propagate.graph import Graph, Node

LOOP_ACCUMULATOR = "accumulates a loop-carried value over iterations"
# Infer ops that pick one of their inputs: no rounding compounds through them.
_PICKING = frozenset({"select", "maximum", "minimum", "clamp", "compare"})


def deny_loop_accumulators(graph: Graph) -> None:
    """Deny the infer and clear ops of each accumulation cycle of a loop not over
    layers: from a carry's body argument back to its own body result."""
    parents = {child: (inst_id, index) for inst_id, inst in enumerate(graph.instances)
               for index, child in inst.calls.items()}
    layered: set[tuple[int, int]] = set()
    for node in graph.nodes:
        if node.cls == ALLOW:
            op = graph.instances[node.inst].ops[node.index]
            if _reads_a_layer(graph, node.inst, op):
                layered.update(_loops_around(graph, node.inst, op, parents))
    for node in graph.nodes:
        if (node.cls == LINK and node.kind == "while" and not node.reason
                and (node.inst, node.index) not in layered):
            members = _accumulation(graph, node)
            for member in members + ([node] if members else []):
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


def _reads_a_layer(graph: Graph, inst_id: int, op: Any) -> bool:
    """Whether matrix op ``op`` reads a slice of a stack (a scanned layer's weight) and a
    value its loop computes: a loop over layers."""
    sides = [_origin(graph, inst_id, value) for value in list(op.operands)[:2]]
    sliced = [stack_slice(value, graph.by_name) is not None for _, value in sides]
    return any(sliced[i] and not _invariant(*sides[1 - i]) for i in range(2))


def _origin(graph: Graph, inst_id: int, value: ir.Value) -> tuple[int, ir.Value]:
    """``value`` followed back through converts, reshapes, transposes, broadcasts and
    optimization barriers and out of called functions to their call sites, up to a
    stack slice."""
    for _step in range(16):
        if stack_slice(value, graph.by_name) is not None:
            break
        if isinstance(value, ir.BlockArgument):
            caller = graph.call_argument.get((inst_id, value))
            if caller is None:
                break
            inst_id, value = caller
        elif value.owner.name in SAME_VALUE_OPS:
            value = value.owner.operands[0]
        elif value.owner.name == "stablehlo.optimization_barrier":  # jax.checkpoint's
            value = value.owner.operands[ir.OpResult(value).result_number]
        else:
            break
    return inst_id, value


def _invariant(inst_id: int, value: ir.Value) -> bool:
    """Whether ``value`` (an ``_origin``) is the same at every iteration: a constant, a
    carry the loop passes through unchanged, or an argument of a public function."""
    if not isinstance(value, ir.BlockArgument):
        return value.owner.name == "stablehlo.constant"
    owner = value.owner.owner
    if owner.name == "func.func":
        return True
    if owner.name != "stablehlo.while" or value.owner != loop_body(owner):
        return False
    return terminator(value.owner).operands[value.arg_number] == value


def _loops_around(graph: Graph, inst_id: int, op: Any,
                  parents: dict[int, tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The (instance, op index) of each while whose body holds ``op``, through the call
    sites of the functions that hold it."""
    while True:
        inner = op.operation
        parent = inner.parent
        while parent is not None and parent.name != "func.func":
            if parent.name == "stablehlo.while" and inner.block == loop_body(parent):
                index = graph.op_index(inst_id, parent)
                if index is not None:
                    yield inst_id, index
            inner, parent = parent, parent.parent
        if inst_id not in parents:
            return
        inst_id, call_index = parents[inst_id]
        op = graph.instances[inst_id].ops[call_index]
