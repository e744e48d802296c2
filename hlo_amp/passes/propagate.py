"""Low-precision dataflow: 16-bit regions from the matrix ops through the ops around them.

Runs after ``insert_converts`` in the mixed_* modes, in the manner of TensorFlow's
auto-mixed-precision "paint" algorithm. The seeds are the matrix ops that pass put in
16 bit (16-bit operands, f32 result: class ``allow``); every other op has a class from
``op_classes.py``, which op and scope rules override. Then, on the def-use graph of each
function (``while``/``case``/``if`` bodies and calls to private functions included):

1. Deny ops convert their own inputs: a deny op (or one outside the table) reading a
   16-bit value gets a convert up in front of it and pins nothing, as in TensorFlow's
   algorithm and PyTorch autocast. A value is *pinned* (stays f32) only when something
   must read it exactly as f32: a convert to another type, a public ``return``, an op
   outside the graph.
2. Deny spreads forward only: the infer ops, and the clear ops and links that lead
   (through clear ops and links) to arithmetic, downstream of a deny op stay f32
   (TensorFlow's forward deny propagation): the centring and scaling after a layer
   norm's mean, the divide after a softmax's sum.
3. The *eligible* nodes are the other unpinned infer/clear ops whose float values are
   all f32 and whose scope the policy leaves to the table, plus loop carries, branch
   results and call arguments/results (links). A node is painted when it is reachable
   from an allow op through eligible nodes *and* reaches a 16-bit sink (a convert to
   the compute dtype, i.e. a matrix op's operand) through eligible nodes or through the
   f32 ops of step 1-2, which convert their own inputs: it sits between 16-bit ops (an
   activation gradient between two matrix ops, though it also feeds a bias gradient's
   sum; a pre-LN residual stream, though a layer norm's mean reads it; attention scores
   and their max before the softmax's exp). A compare whose float operands are all
   16-bit is painted too.
4. An allow op's result becomes 16-bit when it is not pinned and feeds a painted op or
   a sink: on GPU the op returns the 16-bit type itself, on CPU it keeps its f32
   result and a convert follows (``cpu_dots.matrix_result_in_16bit``).

Converts go only on region boundaries, one per value, target type and block; a painted
op's f32 operand is converted down, a 16-bit value read by an unpainted op is converted
back up, and the old operand converts of the matrix ops become no-ops and are erased. A
private function whose call sites need different paintings is cloned per painting;
public signatures never change. Painting is a pure function of the graph, so running
the pass on its own output changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from hlo_amp.cpu_dots import matrix_result_in_16bit
from hlo_amp.modules import (
    callee_name,
    clone_private,
    element_type,
    function_name,
    functions,
    is_call,
    is_public,
    set_function_type,
    terminator,
    walk_operations,
    with_element,
)
from hlo_amp.op_classes import ALLOW, CLEAR, DENY, INFER, op_class, short_name, table_class
from hlo_amp.passes.insert_converts import low_result_on_target
from hlo_amp.policy import AMP_STOP, COMPUTE, DTYPE_TO_ELEMENT, OP_KINDS, Policy
from hlo_amp.report import Report
from hlo_amp.sites import call_prefix, join_names, location_name, parse_name

_CONTROL_FLOW_OPS = frozenset({"stablehlo.while", "stablehlo.case", "stablehlo.if"})
# Ops that hold no activation of their own: not graph nodes, not counted in byte totals.
_NOT_VALUE_OPS = frozenset({"stablehlo.convert", "stablehlo.constant", "stablehlo.iota",
                            "stablehlo.return", "func.return", "func.call", *_CONTROL_FLOW_OPS})
# The ops whose operands may enter a link (loop carry, branch result, call argument or
# result): only their uses are looked up in ``_Graph.link_use``.
_LINK_CONSUMERS = frozenset({"stablehlo.while", "stablehlo.return", "func.call",
                             "func.return"})
# Reasons the painting itself gives (reset when it runs again).
_FEEDS_EXACT = "feeds an op that reads f32 exactly"
_AFTER_DENY = "downstream of a deny op"
_NOT_BETWEEN = "not between 16-bit ops"
_SOLVE_REASONS = frozenset({_FEEDS_EXACT, _AFTER_DENY, _NOT_BETWEEN})
_DENY_CLASS = "deny class"  # the reason of an op the table (not a rule) keeps f32
LINK = "link"
SINK = "sink"  # a convert to the compute dtype: where a region may end
# Op kinds whose class depends on their body as well as the table (see op_class).
_BODY_CLASSED = frozenset({"reduce", "reduce_window"})


def body_ops(fn: Any) -> list[ir.Operation]:
    """The ops of ``fn`` in program order, descending into while/case/if regions only.

    Other ops' regions (reduce bodies, sort comparators) are scalar computations that a
    painted op retypes as a whole; they are not part of the dataflow graph.
    """
    return walk_operations(fn, into=_CONTROL_FLOW_OPS)


def first_block(region: Any) -> Any:
    """The entry block of a region (every region here has exactly one)."""
    return next(iter(region.blocks))


class _Body:
    """One function body, walked once (``body_ops``), and what the pass reads of its ops,
    each read once: every binding call makes a Python object, and the graph, the byte
    counts and the rewrite all look at the same ops. The rewrite only adds converts
    (not listed) and erases converts (skipped by name, never touched again), so the
    lists stay good for the whole pass."""

    __slots__ = ("_inner_uses", "_operands", "_results", "_uses", "names", "ops")

    def __init__(self, fn: Any) -> None:
        self.ops = body_ops(fn)
        self.names = [op.name for op in self.ops]
        self._operands: list[tuple[ir.Value, ...]] | None = None
        self._results: list[tuple[ir.Value, ...]] | None = None
        self._uses: dict[ir.Value, list[tuple[int, int]]] | None = None
        self._inner_uses: set[ir.Value] | None = None

    def operands(self) -> list[tuple[ir.Value, ...]]:
        if self._operands is None:
            self._operands = [tuple(op.operands) for op in self.ops]
        return self._operands

    def results(self) -> list[tuple[ir.Value, ...]]:
        if self._results is None:
            self._results = [tuple(op.results) for op in self.ops]
        return self._results

    def uses(self) -> dict[ir.Value, list[tuple[int, int]]]:
        """Value -> (op index, operand number) of each use by an op of this body."""
        if self._uses is None:
            uses: dict[ir.Value, list[tuple[int, int]]] = defaultdict(list)
            for index, operands in enumerate(self.operands()):
                for number, value in enumerate(operands):
                    uses[value].append((index, number))
            self._uses = dict(uses)
        return self._uses

    def inner_uses(self) -> set[ir.Value]:
        """The values read inside the regions the walk does not enter (reduce bodies,
        sort comparators): their uses are not all in ``uses``."""
        if self._inner_uses is None:
            self._inner_uses = set()
            for op, name in zip(self.ops, self.names):
                if name in _CONTROL_FLOW_OPS or not len(op.regions):
                    continue
                for inner in walk_operations(op):
                    self._inner_uses.update(inner.operands)
        return self._inner_uses


# Element kinds of a value's type, cached per type: a module has few distinct types.
_F32, _FLOAT, _PLAIN, _BAD = "f32", "float", "plain", "bad"
_KINDS: dict[ir.Type, str] = {}


def _type_kind(value_type: ir.Type) -> str:
    """f32 tensor, other float tensor, int/bool tensor, or anything else (bad)."""
    kind = _KINDS.get(value_type)
    if kind is None:
        if not isinstance(value_type, ir.RankedTensorType):
            kind = _BAD
        else:
            element = ir.RankedTensorType(value_type).element_type
            if isinstance(element, ir.F32Type):
                kind = _F32
            elif isinstance(element, ir.FloatType):
                kind = _FLOAT
            elif isinstance(element, ir.ComplexType):
                kind = _BAD
            else:
                kind = _PLAIN
        if len(_KINDS) > 10_000:  # types of many modules: start over
            _KINDS.clear()
        _KINDS[value_type] = kind
    return kind


def _is_f32(value: ir.Value) -> bool:
    return _type_kind(value.type) == _F32


@dataclass(eq=False, slots=True)
class _Node:
    """An op, or a link (loop carry, branch result, call argument or result)."""

    cls: str  # ALLOW, INFER, CLEAR, DENY, OTHER or LINK
    inst: int
    index: int  # op index in the instance's body_ops (the owning op for links)
    kind: str  # op kind for ops, "while"/"case"/"arg"/"result" for links
    slot: int = -1  # carry, result or argument number for links
    inputs: list[tuple[int, ir.Value]] = field(default_factory=list)
    outputs: list[tuple[int, ir.Value]] = field(default_factory=list)
    reason: str = ""  # why it is not eligible, when it is not
    pinned: bool = False
    eligible: bool = False
    fwd: bool = False
    bwd: bool = False
    painted: bool = False  # for allow ops: the result is 16-bit
    deferred: bool = False  # its policy check waits until it is painted (amp_stop only)
    has_f32: bool = False  # an f32 operand or result (ops only: counted in the report)
    # per f32 output, its readers (``_Graph.consumers``); set by ``solve``
    readers: list[list[Any]] = field(default_factory=list)


@dataclass
class _Instance:
    """One function body seen from one call path."""

    fn: Any
    prefix: str
    body: _Body
    calls: dict[int, int] = field(default_factory=dict)  # call op index -> child instance
    index: dict[Any, int] = field(default_factory=dict)  # operation -> op index (lazy)
    signature: tuple = ()

    @property
    def ops(self) -> list[ir.Operation]:
        return self.body.ops


@dataclass(frozen=True)
class Propagate:
    """Keep activations in the compute dtype between the matrix ops (mixed_* modes)."""

    policy: Policy
    target: str | None = None  # "cpu": matrix ops keep f32 results followed by a convert
    name: str = "hlo-amp-propagate"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        low = ir.Type.parse(DTYPE_TO_ELEMENT[self.policy.compute_dtype], module.context)
        # One walk per function body, shared by everything below: every op the bindings
        # hand out is a new Python object. The rewrite only adds and erases converts,
        # which the byte count skips by name, so the walks stay good for the "after".
        walks: dict[Any, _Body] = {}
        before = intermediate_bytes(module, walks)
        graph = _Graph(self.policy, low, walks)
        graph.build(module)
        graph.solve()
        counts = graph.counts()
        with ir.Location.unknown(module.context):  # types are built outside any op
            clones = _Rewriter(graph, low, matrix_result_in_16bit(self.target),
                               self.target).rewrite(module)
        if report is not None:
            report.propagation = {
                "ops": counts,
                "functions": _bytes_table(before, intermediate_bytes(module, walks)),
                "clones": clones,
            }
            report.rules_used.update(graph.rules_used)


class _Graph:
    """The dataflow graph over every instance of every function, and its painting."""

    def __init__(self, policy: Policy, low: ir.Type, walks: dict[Any, _Body]) -> None:
        self.policy = policy
        self.low = low
        self.walks = walks  # function operation -> its _Body, shared with the byte count
        self.instances: list[_Instance] = []
        self.nodes: list[_Node] = []
        self.op_node: dict[tuple[int, int], _Node] = {}  # (inst, op index) -> node
        self.producer: dict[tuple[int, ir.Value], _Node] = {}
        # (inst, consuming op) -> {operand number: node}: uses that enter a link
        self.link_use: dict[tuple[int, Any], dict[int, _Node]] = defaultdict(dict)
        self.by_name: dict[str, Any] = {}
        self.rules_used: set[str] = set()
        self._decided: dict[tuple[str, str, str], tuple[str | None, str]] = {}
        # value -> _type_kind of its type, read once (the graph is built and solved
        # before the rewrite retypes anything)
        self._kinds: dict[ir.Value, str] = {}
        self._classes: dict[str, tuple[str, str]] = {}  # op name -> (kind, table class)
        # Whether any rule could name a non-matrix op (amp_stop aside).
        self._site_rules = bool(policy.scopes) or policy.backward is not None or any(
            kind not in OP_KINDS for kind in policy.ops)

    # ---- building -------------------------------------------------------------------

    def build(self, module: ir.Module) -> None:
        self.by_name = {function_name(fn): fn for fn in functions(module)}
        for fn in functions(module):
            if is_public(fn):
                self._instantiate(fn, "")
        for inst_id, inst in enumerate(self.instances):
            self._op_nodes(inst_id, inst)
        for inst_id, inst in enumerate(self.instances):
            self._links(inst_id, inst)

    def _instantiate(self, fn: Any, prefix: str) -> int:
        inst_id = len(self.instances)
        if len(self.instances) > 100_000:
            raise RecursionError("hlo-amp-propagate: call graph too deep or recursive")
        inst = _Instance(fn, prefix, walk_once(fn, self.walks))
        self.instances.append(inst)
        for index, name in enumerate(inst.body.names):
            if name != "func.call":
                continue
            op = inst.ops[index]
            if is_call(op) and callee_name(op) in self.by_name:
                callee = self.by_name[callee_name(op)]
                if is_public(callee):
                    continue  # a public callee keeps its signature: a boundary
                child_prefix = call_prefix(join_names(prefix, location_name(op.location)))
                inst.calls[index] = self._instantiate(callee, child_prefix)
        return inst_id

    def _kind(self, value: ir.Value) -> str:
        kind = self._kinds.get(value)
        if kind is None:
            kind = self._kinds[value] = _type_kind(value.type)
        return kind

    def _f32(self, value: ir.Value) -> bool:
        return self._kind(value) == _F32

    def _types_ok(self, *groups: tuple[ir.Value, ...]) -> tuple[bool, bool]:
        """(some value is f32, every value is an int, bool or f32 ranked tensor with at
        least one f32)."""
        has_f32, only_plain = False, True
        known = self._kinds
        for values in groups:
            for value in values:
                kind = known.get(value)
                if kind is None:
                    kind = known[value] = _type_kind(value.type)
                if kind == _F32:
                    has_f32 = True
                elif kind != _PLAIN:
                    only_plain = False
        return has_f32, has_f32 and only_plain

    def _add(self, node: _Node) -> _Node:
        self.nodes.append(node)
        for key in node.outputs:
            self.producer[key] = node
        return node

    def _op_nodes(self, inst_id: int, inst: _Instance) -> None:
        compute = self.policy.compute_dtype
        body = inst.body
        all_operands, all_results = body.operands(), body.results()
        by_name = self._classes
        for index, name in enumerate(body.names):
            if name in _NOT_VALUE_OPS:
                continue
            op = body.ops[index]
            operands, results = all_operands[index], all_results[index]
            has_f32, types_ok = self._types_ok(operands, results)
            known = by_name.get(name)
            if known is None:
                kind = short_name(name)
                known = by_name[name] = (kind, table_class(kind, compute))
            kind, cls = known
            if kind in _BODY_CLASSED:  # reduce, reduce_window: classed by their body
                cls = op_class(op, compute)
            node = _Node(cls, inst_id, index, kind,
                         inputs=[(inst_id, v) for v in operands],
                         outputs=[(inst_id, v) for v in results], has_f32=has_f32)
            if cls == ALLOW:  # a matrix op: a seed only if insert_converts made it 16-bit
                low = [v for v in operands[:2] if element_type(v) == self.low]
                if not (len(low) == 2 and results and self._f32(results[0])):
                    node.cls, node.reason = DENY, "matrix op not in 16 bit"
            elif cls in (INFER, CLEAR):
                if not types_ok:
                    node.cls, node.reason = DENY, "not an f32 op"
                elif not self._site_rules:
                    node.deferred = True  # only amp_stop could name it: checked if painted
                else:
                    override = self._policy_class(op, inst.prefix, node.kind)
                    if override is not None:
                        node.cls, node.reason = override
            elif not self._site_rules:
                node.reason = _DENY_CLASS if cls == DENY else "not in the op table"
            else:
                override = self._policy_class(op, inst.prefix, node.kind)
                if override is not None and override[0] in (INFER, CLEAR) and types_ok:
                    node.cls, node.reason = override
                else:
                    node.reason = _DENY_CLASS if cls == DENY else "not in the op table"
            self.op_node[(inst_id, index)] = self._add(node)

    def _policy_class(self, op: Any, prefix: str, kind: str) -> tuple[str, str] | None:
        """(class, reason) when a rule overrides the table for this op, else None."""
        name = location_name(op.location)
        if not self._site_rules and AMP_STOP not in name and AMP_STOP not in prefix:
            return None  # no rule can name this op: its scopes come from prefix and name
        key = (prefix, name, kind)
        decided = self._decided.get(key)
        if decided is None:
            site = parse_name(join_names(prefix, name), kind)
            rule = self.policy.decide(site.scope, kind, site.backward)
            decided = self._decided[key] = (rule.action, rule.rule)
        action, rule = decided
        if action is None:
            return None
        self.rules_used.add(rule)
        if action in (COMPUTE, self.policy.compute_dtype):
            if rule.startswith("op:"):
                return INFER, ""  # the user moved this kind into the paintable classes
            return None  # a scope that computes in 16 bit: the table decides
        return DENY, f"rule {rule}"  # keep, float32 or another dtype: stays as written

    def _links(self, inst_id: int, inst: _Instance) -> None:
        for index, name in enumerate(inst.body.names):
            if name == "stablehlo.while":
                self._while_links(inst_id, index, inst.ops[index])
            elif name in ("stablehlo.case", "stablehlo.if"):
                self._branch_links(inst_id, index, inst.ops[index])
            elif index in inst.calls:
                self._call_links(inst_id, index, inst.ops[index], inst.calls[index])

    def _link(self, inst_id: int, index: int, kind: str, slot: int,
              inputs: list[tuple[Any, tuple[int, ir.Value], int]],
              outputs: list[tuple[int, ir.Value]]) -> None:
        """A link node; ``inputs`` are (consuming op, value key, operand number)."""
        node = _Node(LINK, inst_id, index, kind, slot,
                     inputs=[key for _, key, _ in inputs], outputs=outputs)
        values = [key[1] for key in node.inputs] + [key[1] for key in outputs]
        if not all(self._f32(v) for v in values):
            node.reason = "not an f32 value"
        self._add(node)
        for consumer, key, number in inputs:
            self.link_use[(key[0], consumer.operation)][number] = node

    def _while_links(self, inst_id: int, index: int, op: Any) -> None:
        cond, body = (first_block(region) for region in op.operation.regions)
        body_return = terminator(body)
        for slot in range(len(op.operands)):
            self._link(inst_id, index, "while", slot,
                       [(op, (inst_id, op.operands[slot]), slot),
                        (body_return, (inst_id, body_return.operands[slot]), slot)],
                       [(inst_id, body.arguments[slot]), (inst_id, cond.arguments[slot]),
                        (inst_id, op.results[slot])])

    def _branch_links(self, inst_id: int, index: int, op: Any) -> None:
        returns = [terminator(first_block(region)) for region in op.operation.regions]
        for slot in range(len(op.results)):
            self._link(inst_id, index, "case", slot,
                       [(ret, (inst_id, ret.operands[slot]), slot) for ret in returns],
                       [(inst_id, op.results[slot])])

    def _call_links(self, inst_id: int, index: int, op: Any, child: int) -> None:
        callee = self.instances[child].fn
        entry = first_block(callee.regions[0])
        for slot, argument in enumerate(entry.arguments):
            self._link(inst_id, index, "arg", slot,
                       [(op, (inst_id, op.operands[slot]), slot)], [(child, argument)])
        child_body = self.instances[child].body
        returns = [child_body.ops[i] for i, name in enumerate(child_body.names)
                   if name == "func.return"]
        for slot in range(len(op.results)):
            self._link(inst_id, index, "result", slot,
                       [(ret, (child, ret.operands[slot]), slot) for ret in returns],
                       [(inst_id, op.results[slot])])

    # ---- solving --------------------------------------------------------------------

    def consumers(self, key: tuple[int, ir.Value]) -> list[_Node | str]:
        """The nodes reading a value; SINK for converts to the compute dtype; DENY for
        anything that must see f32 (deny ops, other converts, a public return)."""
        inst_id, value = key
        body = self.instances[inst_id].body
        if value in body.inner_uses():  # some of its uses are not in the walk
            return self._consumers_of_uses(key)
        uses = body.uses().get(value)
        if not uses:
            return []
        names, op_node = body.names, self.op_node
        found: list[_Node | str] = []
        for index, number in uses:
            name = names[index]
            if name in _LINK_CONSUMERS:
                link = self.link_use.get((inst_id, body.ops[index]), {}).get(number)
                if link is not None:
                    found.append(link)
                    continue
            if name == "stablehlo.convert":
                result = body.results()[index][0]
                is_sink = element_type(result) == self.low and self._f32(value)
                found.append(SINK if is_sink else DENY)
                continue
            node = op_node.get((inst_id, index))
            found.append(node if node is not None else DENY)
        return found

    def _consumers_of_uses(self, key: tuple[int, ir.Value]) -> list[_Node | str]:
        """``consumers`` from the value's use list, for a value some op outside the walk
        reads (e.g. from inside a reduce body)."""
        inst_id, value = key
        found: list[_Node | str] = []
        for use in value.uses:
            owner = use.owner
            link = self.link_use.get((inst_id, owner.operation), {}).get(use.operand_number)
            if link is not None:
                found.append(link)
                continue
            if owner.operation.name == "stablehlo.convert":
                is_sink = element_type(owner.result) == self.low and self._f32(value)
                found.append(SINK if is_sink else DENY)
                continue
            node = self._node_of(inst_id, owner)
            found.append(node if node is not None else DENY)
        return found

    def _node_of(self, inst_id: int, op: Any) -> _Node | None:
        inst = self.instances[inst_id]
        if not inst.index:
            inst.index = {o.operation: i for i, o in enumerate(inst.ops)}
        index = inst.index.get(op.operation)
        return None if index is None else self.op_node.get((inst_id, index))

    def solve(self) -> None:
        """Paint; then, when only amp_stop could name a non-matrix op, check just the
        painted ops for it (locations are slow to read) and paint again if one is."""
        f32 = self._f32
        for node in self.nodes:
            node.readers = [self.consumers(key) for key in node.outputs if f32(key[1])]
        try:
            self._solve()
        finally:  # readers point at nodes, loops make cycles: undone for refcounting
            for node in self.nodes:
                node.readers = []

    def _solve(self) -> None:
        self._paint()
        while True:
            stopped = False
            for node in self.nodes:
                if node.painted and node.deferred:
                    node.deferred = False
                    inst = self.instances[node.inst]
                    override = self._policy_class(inst.ops[node.index], inst.prefix, node.kind)
                    if override is not None:
                        node.cls, node.reason = override
                        stopped = True
            if not stopped:
                return
            for node in self.nodes:  # start over from the build-time classes
                node.pinned = node.eligible = node.fwd = node.bwd = node.painted = False
                if node.reason in _SOLVE_REASONS:
                    node.reason = ""
            self._paint()

    def _paint(self) -> None:
        # Only readers that must see the exact f32 value pin it: converts to another
        # type, public returns, ops outside the graph. Deny and unknown ops convert their
        # own 16-bit inputs up (TensorFlow's and PyTorch autocast's way), so they pin
        # nothing.
        for node in self.nodes:
            node.pinned = any(c == DENY for group in node.readers for c in group)
        denied = self._downstream_of_deny()
        for node in self.nodes:
            if node.cls in (INFER, CLEAR, LINK) and not node.reason:
                if node.pinned:
                    node.reason = _FEEDS_EXACT
                elif id(node) in denied:
                    node.reason = _AFTER_DENY
                else:
                    node.eligible = True
        # Forward: reachable from an allow op through eligible nodes.
        pending = [n for n in self.nodes if n.cls == ALLOW and not n.pinned]
        while pending:
            node = pending.pop()
            for group in node.readers:
                for reader in group:
                    if isinstance(reader, _Node) and reader.eligible and not reader.fwd:
                        reader.fwd = True
                        pending.append(reader)
        # Backward: reaches a sink through eligible nodes, or through the f32 ops after
        # a deny op that convert their own inputs (a layer norm in front of a matrix op).
        pending = []
        seen: set[int] = set()
        for node in self.nodes:
            if node.cls != ALLOW and any(SINK in group for group in node.readers):
                node.bwd = node.eligible
                seen.add(id(node))
                pending.append(node)
        while pending:
            node = pending.pop()
            for key in node.inputs:
                producer = self.producer.get(key)
                if (producer is None or id(producer) in seen or producer.cls == ALLOW
                        or not (producer.eligible or id(producer) in denied
                                or producer.cls == DENY)):
                    continue
                seen.add(id(producer))
                producer.bwd = producer.eligible
                pending.append(producer)
        for node in self.nodes:
            if node.eligible and node.fwd and node.bwd and node.readers:
                node.painted = True
            elif node.eligible and not node.reason:
                node.reason = _NOT_BETWEEN
        for node in self.nodes:  # allow ops: a 16-bit result where a region reads it
            if node.cls == ALLOW and not node.pinned:
                node.painted = any(r == SINK or (isinstance(r, _Node) and r.painted)
                                   for group in node.readers for r in group)
        for node in self.nodes:  # compares (no float result) of 16-bit values
            if node.eligible and not node.painted and not node.readers:
                floats = [key for key in node.inputs if self._f32(key[1])]
                if (any(self.is_low(key) for key in floats)
                        and all(self.is_low(key) or self._constant(key) for key in floats)):
                    node.painted, node.reason = True, ""
        # Data movement read only by painted ops moves in 16 bit too, so the convert
        # lands on its (smaller) input: a bias before its broadcast, not after.
        for node in reversed(self.nodes):
            groups = node.readers
            if (node.cls == CLEAR and node.eligible and not node.painted and groups
                    and all(r == SINK or (isinstance(r, _Node) and r.painted)
                            for group in groups for r in group)):
                node.painted = True
        for node in self.nodes:
            if node.painted:
                node.reason = ""

    def _downstream_of_deny(self) -> set[int]:
        """ids of the infer, clear and link nodes a deny op's value reaches through infer,
        clear and link nodes: what a deny op computes stays f32 downstream (TensorFlow's
        forward deny propagation). As there, data movement is entered only when it leads
        (through data movement) to arithmetic, so a transpose between a sum and a matrix
        op may still move 16-bit values."""
        leads: set[int] = set()  # clear/link nodes upstream of arithmetic via clear/link
        pending = [n for n in self.nodes if n.cls not in (CLEAR, LINK, ALLOW)]
        while pending:
            node = pending.pop()
            for key in node.inputs:
                producer = self.producer.get(key)
                if (producer is not None and producer.cls in (CLEAR, LINK)
                        and id(producer) not in leads):
                    leads.add(id(producer))
                    pending.append(producer)
        denied: set[int] = set()
        pending = [n for n in self.nodes if n.cls == DENY and n.reason == _DENY_CLASS]
        while pending:
            node = pending.pop()
            for group in node.readers:
                for reader in group:
                    if (isinstance(reader, _Node) and id(reader) not in denied
                            and (reader.cls == INFER or id(reader) in leads)):
                        denied.add(id(reader))
                        pending.append(reader)
        return denied

    def _constant(self, key: tuple[int, ir.Value], depth: int = 0) -> bool:
        """A constant, possibly broadcast or reshaped: rounding it is exact enough."""
        value = key[1]
        if isinstance(value, ir.BlockArgument) or depth > 4:
            return False
        owner = value.owner
        name = owner.name
        if name == "stablehlo.constant":
            return True
        if name in ("stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert"):
            return self._constant((key[0], owner.operands[0]), depth + 1)
        return False

    def is_low(self, key: tuple[int, ir.Value]) -> bool:
        producer = self.producer.get(key)
        return producer is not None and producer.painted

    # ---- reporting ------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, Any]]:
        """Per op kind: painted, and why the rest stayed f32 (one count per instance)."""
        table: dict[str, dict[str, Any]] = {}
        for node in self.nodes:
            if node.cls == LINK or not node.has_f32:
                continue
            row = table.setdefault(node.kind, {"painted": 0, "f32": {}})
            if node.painted:
                row["painted"] += 1
            else:
                reason = node.reason or ("matrix result read by f32 ops"
                                         if node.cls == ALLOW else "not between 16-bit ops")
                row["f32"][reason] = row["f32"].get(reason, 0) + 1
        return dict(sorted(table.items()))


class _Rewriter:
    """Apply a painting: clone private functions per painting, retype, insert converts."""

    def __init__(self, graph: _Graph, low: ir.Type, result_in_16bit: bool,
                 target: str | None = None) -> None:
        self.graph = graph
        self.low = low
        self.result_in_16bit = result_in_16bit
        self.target = target
        self.retyped: dict[ir.Value, ir.Type] = {}  # value -> its type before the pass
        self.facts: dict[int, dict[str, set]] = defaultdict(
            lambda: {key: set() for key in ("painted", "carries", "args", "results",
                                            "allow")})

    def rewrite(self, module: ir.Module) -> int:
        """Rewrite every instance; returns how many functions were cloned."""
        graph = self.graph
        for node in graph.nodes:
            if (not node.painted and node.cls == ALLOW and self.result_in_16bit
                    and low_result_on_target(node.kind, self.target)):
                # Outside a region too, the target runs this op kind in 16 bit only with
                # a 16-bit result: it returns that, and its f32 readers get a convert.
                self.facts[node.inst]["allow"].add(node.index)
            if not node.painted:
                continue
            facts = self.facts[node.inst]
            if node.cls == ALLOW:
                facts["allow"].add(node.index)
            elif node.cls != LINK:
                facts["painted"].add(node.index)
            elif node.kind in ("while", "case"):
                facts["carries"].add((node.index, node.slot))
            else:  # call argument or result: a fact about the callee's signature
                child = graph.instances[node.inst].calls[node.index]
                self.facts[child]["args" if node.kind == "arg" else "results"].add(node.slot)
        # Signatures bottom-up: children were instantiated after their parents.
        for inst_id in reversed(range(len(graph.instances))):
            inst = graph.instances[inst_id]
            facts = self.facts[inst_id]
            own = tuple(tuple(sorted(facts[key])) for key in
                        ("painted", "carries", "args", "results", "allow"))
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
        done: set[Any] = set()
        for inst_id, inst in enumerate(graph.instances):
            fn = chosen[inst_id]
            if fn.operation in done:
                continue
            done.add(fn.operation)
            body = inst.body if fn is inst.fn else walk_once(fn, graph.walks)
            for index, child in inst.calls.items():
                body.ops[index].attributes["callee"] = ir.FlatSymbolRefAttr.get(
                    function_name(chosen[child]), context=fn.context)
            self._apply(fn, body, inst_id)
        return clones

    def _retype(self, value: ir.Value) -> None:
        if value in self.retyped or not _is_f32(value):
            return
        self.retyped[value] = value.type
        value.set_type(with_element(value.type, self.low))

    def _apply(self, fn: Any, body: _Body, inst_id: int) -> None:
        ops, names = body.ops, body.names
        inst = self.graph.instances[inst_id]
        facts = self.facts[inst_id]
        entry = first_block(fn.regions[0])
        # 1. Retype what is 16-bit now.
        for index in facts["painted"]:
            op = ops[index]
            for result in op.results:
                self._retype(result)
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
            if not (index in painted or name in _LINK_CONSUMERS or index in inst.calls):
                # An unpainted op (``_wants_low`` is False): a retyped operand goes back
                # to its type before the pass.
                for number, value in enumerate(operands):
                    want = retyped.get(value)
                    if want is not None and want != value.type:
                        op.operands[number] = self._convert(op, value, want, shared)
                continue
            for number, value in enumerate(operands):
                wants_low = self._wants_low(index, op, name, number, inst, facts, owners)
                if wants_low is None or (not wants_low and value not in retyped):
                    continue  # wants what it has
                want = retyped.get(value, value.type)  # the type before the pass
                if wants_low and _type_kind(want) == _F32:
                    want = with_element(want, self.low)
                if want != value.type:
                    op.operands[number] = self._convert(op, value, want, shared)
        for index, name in enumerate(names):  # the matrix ops' operand converts whose
            if name != "stablehlo.convert":   # input is 16-bit now
                continue
            op = ops[index]
            source, result = op.operands[0], op.results[0]
            if source.type == result.type:
                result.replace_all_uses_with(source)
                op.erase()
        if facts["args"] or facts["results"]:
            old = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
            set_function_type(fn, [with_element(t, self.low) if slot in facts["results"]
                                   else t for slot, t in enumerate(old.results)])

    @staticmethod
    def _terminator_owners(body: _Body) -> dict[Any, tuple[str, int]]:
        """Each while-body / branch terminator -> ("carry", owner index)."""
        owners: dict[Any, tuple[str, int]] = {}
        for index, name in enumerate(body.names):
            if name not in _CONTROL_FLOW_OPS:
                continue
            regions = list(body.ops[index].regions)
            if name == "stablehlo.while":
                owners[terminator(first_block(regions[1])).operation] = ("carry", index)
                owners[terminator(first_block(regions[0])).operation] = ("cond", index)
            else:
                for region in regions:
                    owners[terminator(first_block(region)).operation] = ("carry", index)
        return owners

    def _wants_low(self, index: int, op: Any, name: str, number: int, inst: _Instance,
                   mine: dict[str, set], owners: dict[Any, tuple[str, int]]) -> bool | None:
        """Whether operand ``number`` of ``op`` (named ``name``) must be 16-bit (None:
        leave it); ``mine`` are the facts of the instance being rewritten."""
        if index in mine["painted"]:
            return True
        if name == "stablehlo.while":
            return (index, number) in mine["carries"]
        if name == "stablehlo.return":
            owner = owners.get(op.operation)
            if owner is None or owner[0] == "cond":
                return None
            return (owner[1], number) in mine["carries"]
        if name == "func.return":
            return number in mine["results"]
        if index in inst.calls:
            return number in self.facts[inst.calls[index]]["args"]
        return False

    def _convert(self, consumer: Any, value: ir.Value, want: ir.Type,
                 shared: dict[tuple[Any, ir.Value, str], ir.Value]) -> ir.Value:
        block = consumer.operation.block
        key = (block, value, str(want))
        converted = shared.get(key)
        if converted is None:
            with consumer.location, ir.InsertionPoint(consumer):
                converted = hlo.convert(want, value)
            shared[key] = converted
        return converted


def walk_once(fn: Any, walks: dict[Any, _Body]) -> _Body:
    """The ``_Body`` of ``fn``, walked once per function and kept in ``walks``."""
    found = walks.get(fn.operation)
    if found is None:
        found = walks[fn.operation] = _Body(fn)
    return found


def intermediate_bytes(module: ir.Module, walks: dict[Any, _Body] | None = None
                       ) -> dict[str, tuple[int, int]]:
    """Per function: (bytes, 16-bit-or-narrower bytes) of the float values its ops make.

    Converts, constants and control-flow results are left out: they hold no new
    activation. Dynamic shapes count as zero.
    """
    walks = {} if walks is None else walks
    sizes: dict[ir.Type, tuple[int, int]] = {}  # type -> (bytes, 16-bit bytes)
    table: dict[str, tuple[int, int]] = {}
    for fn in functions(module):
        total = low = 0
        body = walk_once(fn, walks)
        for name, results in zip(body.names, body.results()):
            if name in _NOT_VALUE_OPS:
                continue
            for result in results:
                result_type = result.type  # read again: the rewrite retypes values
                size = sizes.get(result_type)
                if size is None:
                    size = sizes[result_type] = _float_bytes(result_type)
                total += size[0]
                low += size[1]
        table[function_name(fn)] = (total, low)
    return table


def _float_bytes(value_type: ir.Type) -> tuple[int, int]:
    """(bytes, bytes if 16-bit or narrower) of a static float tensor type, else zeros."""
    if _type_kind(value_type) not in (_F32, _FLOAT):
        return 0, 0
    ranked = ir.RankedTensorType(value_type)
    if not ranked.has_static_shape:
        return 0, 0
    width = ir.FloatType(ranked.element_type).width
    size = 1
    for extent in ranked.shape:
        size *= extent
    nbytes = size * width // 8
    return nbytes, nbytes if width <= 16 else 0


def _bytes_table(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
                 ) -> list[dict[str, Any]]:
    rows = []
    for name, (total, low) in after.items():
        old_total, old_low = before.get(name, before.get(name.rsplit("_mixed", 1)[0], (0, 0)))
        rows.append({"function": name, "bytes_before": old_total, "low_bytes_before": old_low,
                     "bytes_after": total, "low_bytes_after": low})
    return rows


