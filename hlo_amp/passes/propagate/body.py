"""Function bodies as the propagation pass reads them: one walk per body, the value kinds."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import op_key, walk_operations

CONTROL_FLOW_OPS = frozenset({"stablehlo.while", "stablehlo.case", "stablehlo.if"})
# shard_map's body: per-device code, painted like any other; its arguments and results
# are the boundaries (kept in their own type, as a public function's).
MANUAL_OPS = frozenset({"sdy.manual_computation"})
# Ops that hold no activation of their own: not graph nodes, not counted in byte totals.
NOT_VALUE_OPS = frozenset({"stablehlo.convert", "stablehlo.constant", "stablehlo.iota",
                           "stablehlo.return", "func.return", "func.call", *CONTROL_FLOW_OPS})
# The ops whose operands may enter a link (loop carry, branch result, call argument or
# result): only their uses are looked up in ``Graph.link_use``.
LINK_CONSUMERS = frozenset({"stablehlo.while", "stablehlo.return", "func.call",
                            "func.return", "stablehlo.optimization_barrier"})
# An identity per operand that XLA may not move ops across (jax.checkpoint's barrier on
# what the backward pass recomputes from): each operand-result pair is a link.
BARRIER = "stablehlo.optimization_barrier"


def body_ops(fn: Any) -> list[ir.Operation]:
    """The ops of ``fn`` in program order, descending into while/case/if regions only.

    Other ops' regions (reduce bodies, sort comparators) are scalar computations that a
    painted op retypes as a whole; they are not part of the dataflow graph.
    """
    return walk_operations(fn, into=CONTROL_FLOW_OPS | MANUAL_OPS)


def first_block(region: Any) -> Any:
    """The entry block of a region (every region here has exactly one)."""
    return next(iter(region.blocks))


class Body:
    """One function body, walked once (``body_ops``), and what the pass reads of its ops,
    each read once: every binding call makes a Python object, and the graph, the byte
    counts and the rewrite all look at the same ops. The rewrite only adds converts
    (not listed) and discards converts (skipped by name; erased after the pass), so the
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
                if name in CONTROL_FLOW_OPS or not len(op.regions):
                    continue
                for inner in walk_operations(op):
                    self._inner_uses.update(inner.operands)
        return self._inner_uses


def walk_once(fn: Any, walks: dict[int, Body]) -> Body:
    """The ``Body`` of ``fn``, walked once per function and kept in ``walks``."""
    found = walks.get(op_key(fn))
    if found is None:
        found = walks[op_key(fn)] = Body(fn)
    return found


# Element kinds of a value's type, cached per type: a module has few distinct types.
# A type holds its context, and the context all of its module's types and constants:
# the pipeline clears the cache when it ends (clear_type_kinds), or every rewritten
# module's context stayed alive.
F32, FLOAT, PLAIN, BAD = "f32", "float", "plain", "bad"
_KINDS: dict[ir.Type, str] = {}


def clear_type_kinds() -> None:
    _KINDS.clear()


def type_kind(value_type: ir.Type) -> str:
    """f32 tensor, other float tensor, int/bool tensor, or anything else (bad)."""
    kind = _KINDS.get(value_type)
    if kind is None:
        if not isinstance(value_type, ir.RankedTensorType):
            kind = BAD
        else:
            element = ir.RankedTensorType(value_type).element_type
            if isinstance(element, ir.F32Type):
                kind = F32
            elif isinstance(element, ir.FloatType):
                kind = FLOAT
            elif isinstance(element, ir.ComplexType):
                kind = BAD
            else:
                kind = PLAIN
        _KINDS[value_type] = kind
    return kind


def is_f32(value: ir.Value) -> bool:
    return type_kind(value.type) == F32

