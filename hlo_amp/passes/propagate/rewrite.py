"""Applying a painting: clones per painting, retyped values, converts on boundaries."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ml_dtypes
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    SAME_VALUE_OPS,
    callee_name,
    clone_private,
    discard,
    element_type,
    function_name,
    is_call,
    is_discarded,
    op_key,
    set_function_type,
    terminator,
    where_finite,
    with_element,
)
from hlo_amp.ir.op_classes import ALLOW, FULL_FORMAT, PICKING_KINDS
from hlo_amp.passes.propagate.body import (
    BARRIER,
    CONTROL_FLOW_OPS,
    F32,
    LINK_CONSUMERS,
    Body,
    first_block,
    is_f32,
    type_kind,
    walk_once,
)
from hlo_amp.passes.propagate.graph import LINK, Graph, Instance
from hlo_amp.targets import NO_TARGET, Target

# bf16's largest finite value: f32's extremes beyond it are saturated (``_saturated``).
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


# Ops whose result holds elements of their float operands (and a pad's padding value):
# a mask bias padded, rolled, flipped, sliced, joined or gathered holds its fill.
_MOVING_OPS = frozenset({"stablehlo.pad", "stablehlo.slice", "stablehlo.dynamic_slice",
                         "stablehlo.concatenate", "stablehlo.reverse", "stablehlo.gather",
                         "stablehlo.dynamic_update_slice"})


# Ops whose result is one of their operands' elements: a fill clipped or capped
# (jnp.clip(bias, finfo.min), jnp.minimum of two mask biases) is the fill (a select's
# sides are read before these, by position).
_PICKING_OPS = frozenset(f"stablehlo.{kind}" for kind in PICKING_KINDS)


def _value_sources(op: Any, number: int) -> list[ir.Value]:
    """The values result ``number`` of ``op`` is one of: a select's sides, a loop's start
    and carried value, each branch's result, the float operands data movement takes its
    elements from (``jnp.pad``, ``jnp.roll``, ``jnp.flip``, a concatenation) or a clamp,
    minimum or maximum picks one of, a barrier's operand; none for any other op."""
    name = op.name
    if name == "stablehlo.select":
        return [op.operands[1], op.operands[2]]
    if name in _MOVING_OPS or name in _PICKING_OPS:
        return [v for v in op.operands if isinstance(element_type(v), ir.FloatType)]
    if name == "stablehlo.optimization_barrier":  # remat's: each result its operand
        return [op.operands[number]]
    if name == "stablehlo.while":
        return [op.operands[number], terminator(op.regions[1].blocks[0]).operands[number]]
    if name in ("stablehlo.case", "stablehlo.if"):
        return [terminator(region.blocks[0]).operands[number] for region in op.regions]
    return []


class Rewriter:
    """Apply a painting: clone private functions per painting, retype, insert converts."""

    def __init__(self, graph: Graph, low: ir.Type, result_in_16bit: bool,
                 target: Target = NO_TARGET) -> None:
        self.graph = graph
        self.low = low
        self.result_in_16bit = result_in_16bit
        self.target = target
        self.retyped: dict[ir.Value, ir.Type] = {}  # value -> its type before the pass
        # (value, instance, calls entered) -> whether it may hold f32's extremes
        # (_may_hold_extreme, which _saturated asks)
        self._extremes: dict[tuple[ir.Value, int, tuple], bool] = {}
        self.facts: dict[int, dict[str, set]] = defaultdict(
            lambda: {key: set() for key in ("painted", "carries", "args", "results",
                                            "allow", "sum_copies")})

    def rewrite(self, module: ir.Module) -> int:
        """Rewrite every instance; returns how many functions were cloned."""
        graph = self.graph
        for node in graph.nodes:
            if (not node.painted and node.cls == ALLOW and self.result_in_16bit
                    and self.target.low_result(node.kind)):
                # Outside a region too, the target runs this op kind in 16 bit only with
                # a 16-bit result: it returns that, and its f32 readers get a convert.
                self.facts[node.inst]["allow"].add(node.index)
            if node.sums_read_low_copy:
                self.facts[node.inst]["sum_copies"].add(node.index)
            if not node.painted:
                continue
            facts = self.facts[node.inst]
            if node.cls == ALLOW:
                facts["allow"].add(node.index)
            elif node.cls != LINK:
                facts["painted"].add(node.index)
            elif node.kind in ("while", "case", "barrier"):
                facts["carries"].add((node.index, node.slot))
            else:  # call argument or result: a fact about the callee's signature
                child = graph.instances[node.inst].calls[node.index]
                self.facts[child]["args" if node.kind == "arg" else "results"].add(node.slot)
        # Signatures bottom-up: children were instantiated after their parents.
        for inst_id in reversed(range(len(graph.instances))):
            inst = graph.instances[inst_id]
            facts = self.facts[inst_id]
            own = tuple(tuple(sorted(facts[key])) for key in
                        ("painted", "carries", "args", "results", "allow", "sum_copies"))
            children = tuple(graph.instances[c].signature for _, c in sorted(inst.calls.items()))
            inst.signature = (own, children)
        # One function per (function, signature): the first keeps the name, the others
        # are cloned from pristine bodies before anything is rewritten.
        targets: dict[tuple[str, tuple], Any] = {}
        taken: set[str] = set()
        chosen: list[Any] = []
        for inst in graph.instances:
            name = function_name(inst.fn)
            key = (name, inst.signature)
            if key not in targets:
                targets[key] = (inst.fn if name not in taken
                               else clone_private(inst.fn, "mixed", graph.by_name))
                taken.add(name)
            chosen.append(targets[key])
        clones = len(targets) - len(taken)
        done: set[str] = set()  # by name: a function's hash changes as it is rewritten
        for inst_id, inst in enumerate(graph.instances):
            fn = chosen[inst_id]
            if function_name(fn) in done:
                continue
            done.add(function_name(fn))
            body = inst.body if fn is inst.fn else walk_once(fn, graph.walks)
            for index, child in inst.calls.items():
                body.ops[index].attributes["callee"] = ir.FlatSymbolRefAttr.get(
                    function_name(chosen[child]), context=fn.context)
            self._apply(fn, body, inst_id)
        return clones

    def _retype(self, value: ir.Value) -> None:
        if value in self.retyped or not is_f32(value):
            return
        self.retyped[value] = value.type
        value.set_type(with_element(value.type, self.low))

    def _apply(self, fn: Any, body: Body, inst_id: int) -> None:
        ops, names = body.ops, body.names
        inst = self.graph.instances[inst_id]
        facts = self.facts[inst_id]
        entry = first_block(fn.regions[0])
        # 1. Retype what is 16-bit now.
        for index in facts["painted"]:
            op = ops[index]
            for result in op.results:
                self._retype(result)
            if op.operation.name == "stablehlo.reduce_precision":
                # A residual's mark (rounds to its own type): now to the 16-bit type's.
                exponent, mantissa = FULL_FORMAT[str(self.low)]
                i32 = ir.IntegerType.get_signless(32)
                op.operation.attributes["exponent_bits"] = ir.IntegerAttr.get(i32, exponent)
                op.operation.attributes["mantissa_bits"] = ir.IntegerAttr.get(i32, mantissa)
            for region in op.operation.regions:  # reduce bodies: a scalar max/min
                for block in region.blocks:
                    for argument in block.arguments:
                        self._retype(argument)
                    for inner in block.operations:
                        for result in inner.results:
                            self._retype(result)
        if self.result_in_16bit:
            for index in facts["allow"]:
                self._retype(ops[index].results[0])
        for index, slot in facts["carries"]:
            op = ops[index]
            self._retype(op.results[slot])
            if op.operation.name == "stablehlo.while":
                for region in op.operation.regions:
                    self._retype(first_block(region).arguments[slot])
        for slot in facts["args"]:
            self._retype(entry.arguments[slot])
        for index, child in inst.calls.items():
            for slot in self.facts[child]["results"]:
                self._retype(ops[index].results[slot])
        # 2. Converts on the boundaries: each operand gets the type its reader needs.
        # (Only this op's own operands change while it is looked at, so the operand
        # lists read when the graph was built still hold.)
        owners = self._terminator_owners(body)
        shared: dict[tuple[Any, ir.Value, str], ir.Value] = {}
        retyped = self.retyped
        painted = facts["painted"]
        for index, (name, operands) in enumerate(zip(names, body.operands())):
            if name == "stablehlo.convert":
                continue
            op = ops[index]
            if not (index in painted or name in LINK_CONSUMERS or index in inst.calls):
                # An unpainted op (``_wants_low`` is False): a retyped operand goes back
                # to its type before the pass.
                for number, value in enumerate(operands):
                    want = retyped.get(value)
                    if want is not None and want != value.type:
                        op.operands[number] = self._convert(op, value, want, shared, inst_id)
                continue
            for number, value in enumerate(operands):
                wants_low = self._wants_low(index, op, name, number, inst, facts, owners)
                if wants_low is None or (not wants_low and value not in retyped):
                    continue  # wants what it has
                want = retyped.get(value, value.type)  # the type before the pass
                if wants_low and type_kind(want) == F32:
                    want = with_element(want, self.low)
                if want != value.type:
                    op.operands[number] = self._convert(op, value, want, shared, inst_id)
        for index, name in enumerate(names):  # the matrix ops' operand converts whose
            if name != "stablehlo.convert":   # input is 16-bit now
                continue
            op = ops[index]
            source, result = op.operands[0], op.results[0]
            if source.type == result.type:
                result.replace_all_uses_with(source)
                discard(op)
        for index in sorted(facts["sum_copies"]):
            self._sums_read_low_copy(ops[index])
        if facts["args"] or facts["results"]:
            old = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
            set_function_type(fn, [with_element(t, self.low) if slot in facts["results"]
                                   else t for slot, t in enumerate(old.results)])

    def _sums_read_low_copy(self, op: Any) -> None:
        """The matrix ops and the sums reading ``op``'s f32 result read one 16-bit copy
        of it; the sums through an ``optimization_barrier``, so that XLA does not fold
        their convert back up (f32 -> 16 -> f32) into a read of the f32 value."""
        value = op.results[0]
        readers = [(use.owner, use.operand_number) for use in value.uses
                   if not is_discarded(use.owner)]
        with op.location, ir.InsertionPoint.after(op):
            low = hlo.convert(with_element(value.type, self.low), value)
            kept = hlo.optimization_barrier([low])
            kept = kept[0] if isinstance(kept, (list, tuple)) else kept
            wide = hlo.convert(value.type, kept)
        for owner, number in readers:
            if owner.operation.name == "stablehlo.convert" and owner.result.type == low.type:
                owner.result.replace_all_uses_with(kept)
                discard(owner)
            else:  # a sum (``solve`` allows no other reader)
                owner.operands[number] = wide

    @staticmethod
    def _terminator_owners(body: Body) -> dict[int, tuple[str, int]]:
        """Each while-body / branch terminator (by ``op_key``) -> ("carry", owner index)."""
        owners: dict[int, tuple[str, int]] = {}
        for index, name in enumerate(body.names):
            if name not in CONTROL_FLOW_OPS:
                continue
            regions = list(body.ops[index].regions)
            if name == "stablehlo.while":
                owners[op_key(terminator(first_block(regions[1])))] = ("carry", index)
                owners[op_key(terminator(first_block(regions[0])))] = ("cond", index)
            else:
                for region in regions:
                    owners[op_key(terminator(first_block(region)))] = ("carry", index)
        return owners

    def _wants_low(self, index: int, op: Any, name: str, number: int, inst: Instance,
                   mine: dict[str, set], owners: dict[int, tuple[str, int]]) -> bool | None:
        """Whether operand ``number`` of ``op`` (named ``name``) must be 16-bit (None:
        leave it); ``mine`` are the facts of the instance being rewritten."""
        if index in mine["painted"]:
            return True
        if name in ("stablehlo.while", BARRIER):
            return (index, number) in mine["carries"]
        if name == "stablehlo.return":
            owner = owners.get(op_key(op))
            if owner is None or owner[0] == "cond":
                return None
            return (owner[1], number) in mine["carries"]
        if name == "func.return":
            return number in mine["results"]
        if index in inst.calls:
            return number in self.facts[inst.calls[index]]["args"]
        return False

    def _convert(self, consumer: Any, value: ir.Value, want: ir.Type,
                 shared: dict[tuple[Any, ir.Value, str], ir.Value], inst_id: int) -> ir.Value:
        block = consumer.operation.block
        key = (block, value, str(want))
        converted = shared.get(key)
        if converted is None:
            with consumer.location, ir.InsertionPoint(consumer):
                converted = hlo.convert(want, self._saturated(value, want, inst_id))
            shared[key] = converted
        return converted

    def _saturated(self, value: ir.Value, want: ir.Type, inst_id: int) -> ir.Value:
        """``value`` with its finite elements clamped to bf16's range where it may hold a
        constant beyond it (f32's extremes: finfo(f32).min as a mask's fill; graph.py
        paints what reads them under bf16), at the current insertion point; converted
        as they are they would be -inf, and a masked row's softmax NaN. inf and NaN stay
        as they are, so a function body that other call sites pass runtime values
        computes for them what the plain conversion would (finite values past bf16's
        range finite, not inf). Else ``value``."""
        if (str(ir.RankedTensorType(want).element_type) != "bf16"
                or not self._may_hold_extreme(value, inst_id)):
            return value
        element = ir.RankedTensorType(value.type).element_type
        scalar = ir.RankedTensorType.get([], element)
        low, high = (hlo.constant(ir.DenseElementsAttr.get_splat(
            scalar, ir.FloatAttr.get(element, bound))) for bound in (-_BF16_MAX, _BF16_MAX))
        return where_finite(value, hlo.clamp(low, value, high), value)

    def _may_hold_extreme(self, value: ir.Value, inst_id: int) -> bool:
        """Whether ``value`` may hold a constant of f32's extremes: through data movement,
        a select's either side, a call's, loop's or branch's result, a loop carry's start
        and what the body passes on, and a function's argument to what some call of the
        function passes (any instance: clones and bodies shared by several call sites
        alike). (The select of jnp.where(mask, 0, finfo.min) in a function of its own, a
        mask bias, and a fill a scan body closes over were converted as they were: -inf,
        and a masked row's softmax NaN.)"""
        return self._holds_extreme(value, inst_id, (), 0)

    def _holds_extreme(self, value: ir.Value, inst_id: int, calls: tuple, depth: int
                       ) -> bool:
        """``_may_hold_extreme`` of ``value`` in instance ``inst_id``, inside the callees
        of ``calls`` (entered through their results); each (value, instance, calls)
        answered once (selects that swap two values each round were walked 2^depth
        times: 5.7 s for 20 rounds)."""
        key = (value, inst_id, tuple(op_key(call) for call in calls))
        found = self._extremes.get(key)
        if found is None:
            self._extremes[key] = False  # a cycle through loop carries holds none
            found = self._extremes[key] = self._holds_extreme_once(
                value, inst_id, calls, depth)
        return found

    def _holds_extreme_once(self, value: ir.Value, inst_id: int, calls: tuple, depth: int
                            ) -> bool:
        if depth > 24:
            return False
        while not isinstance(value, ir.BlockArgument) and value.owner.name in SAME_VALUE_OPS:
            value = value.owner.operands[0]
        if not isinstance(value, ir.BlockArgument):
            op = value.owner
            if op.name == "stablehlo.constant":
                found = self.graph.constant_magnitude(inst_id, value)
                return found is not None and found > _BF16_MAX
            if is_call(op):
                callee = self.graph.by_name.get(callee_name(op))
                returned = None if callee is None else terminator(
                    first_block(callee.regions[0])).operands[ir.OpResult(value).result_number]
                return returned is not None and self._holds_extreme(
                    returned, inst_id, (*calls, op), depth + 1)
            sources = _value_sources(op, ir.OpResult(value).result_number)
            return any(self._holds_extreme(v, inst_id, calls, depth + 1) for v in sources)
        parent = value.owner.owner.operation
        number = value.arg_number
        if parent.name == "stablehlo.while":  # a carry: its start or what the body passes
            body = parent.regions[1].blocks[0]
            return any(self._holds_extreme(v, inst_id, calls, depth + 1) for v in (
                parent.operands[number], terminator(body).operands[number]))
        if parent.name != "func.func":  # a loop condition's or another region's
            return False
        if calls:  # a callee entered through its call: that call's operand
            return self._holds_extreme(calls[-1].operands[number], inst_id, calls[:-1],
                                       depth + 1)
        # What any call of this function passes (a body several call sites share).
        name = function_name(parent)
        for other, inst in enumerate(self.graph.instances):
            if function_name(inst.fn) != name:
                continue
            argument = first_block(inst.fn.regions[0]).arguments[number]
            caller = self.graph.call_argument.get((other, argument))
            if caller is not None and self._may_hold_extreme(caller[1], caller[0]):
                return True
        return False
