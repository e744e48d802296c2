"""Dataflow seen through private-function calls, for matching an attention whose ops jax
split over small helper functions (``jnp.where``, ``jnp.tril`` and a scan body are
``func.call``s of their own under jax 0.10).

A value is seen from the block it was reached from together with the stack of calls it
was reached through (outermost first, as op keys): the ops inside a helper are read as
if they were inlined at that call, and a value the helper returns goes back out through
the same call.
"""

from __future__ import annotations

from collections.abc import Iterator

from jaxlib.mlir import ir

from hlo_amp.ir.modules import (
    BODY_ATTRIBUTE,
    body_name,
    callee_name,
    function_name,
    functions,
    is_public,
    live_uses,
    op_key,
    terminator,
    walk_operations,
)
from hlo_amp.ir.sites import call_prefix, join_names, location_name

Stack = tuple[int, ...]  # op keys of the func.call ops, outermost first

_CALL = "func.call"
_BODIES = frozenset(BODY_ATTRIBUTE)
_RETURN = "func.return"
_WHILE = "stablehlo.while"
_BARRIER = "stablehlo.optimization_barrier"
# Shardy's constraint (jax writes one after every op under an Explicit mesh, and for
# with_sharding_constraint): the same values, seen through as if absent.
SHARDING_CONSTRAINT = "sdy.sharding_constraint"


class CallView:
    """The module's functions and every call op met so far, by key."""

    def __init__(self, module: ir.Module) -> None:
        self.functions = {function_name(fn): fn for fn in functions(module)}
        self.calls: dict[int, ir.Operation] = {}
        # Constants evaluated so far (constants.evaluate's memo), shared by every site:
        # a causal mask hoisted out of a scan serves its forward and recomputed copies.
        self.constants: dict = {}
        # Each private function's call sites (a function called once has one caller),
        # and each function's calls, from one walk.
        self.callers: dict[str, list[ir.Operation]] = {}
        self.calls_in: dict[str, list[ir.Operation]] = {}
        # ... and its calls and composites, whose decompositions' ops are named under
        # them (the matcher does not follow a composite: its types are its own).
        self._bodies_in: dict[str, list[ir.Operation]] = {}
        self._prefixes: dict[str, str] | None = None
        for name, fn in self.functions.items():
            found = self._bodies_in[name] = walk_operations(fn, names=_BODIES)
            self.calls_in[name] = [op for op in found if op.name == _CALL]
            for call in self.calls_in[name]:
                self.callers.setdefault(callee_name(call), []).append(call)

    def call_prefixes(self) -> dict[str, str]:
        """Each private function's call-site name prefix (its first caller's, from the
        public functions down, a composite's for its decomposition), as insert_converts
        names ops in private functions (worked out once per module)."""
        if self._prefixes is not None:
            return self._prefixes
        prefixes: dict[str, str] = {}
        self._prefixes = prefixes
        pending = [(name, "") for name, fn in self.functions.items() if is_public(fn)]
        while pending:
            name, prefix = pending.pop()
            for call in self._bodies_in[name]:
                callee = body_name(call)
                fn = self.functions.get(callee)
                if fn is not None and callee not in prefixes and not is_public(fn):
                    prefixes[callee] = call_prefix(
                        join_names(prefix, location_name(call.location)))
                    pending.append((callee, prefixes[callee]))
        return prefixes

    def prefix_of(self, op: ir.Operation) -> str:
        """The call-site name prefix of the function holding ``op``."""
        parent = op.operation.parent
        while parent is not None and parent.name != "func.func":
            parent = parent.parent
        if parent is None:
            return ""
        return self.call_prefixes().get(ir.StringAttr(parent.attributes["sym_name"]).value, "")

    def remember(self, call: ir.Operation) -> int:
        key = op_key(call)
        self.calls[key] = call
        return key

    def callee_block(self, call: ir.Operation) -> ir.Block | None:
        fn = self.functions.get(callee_name(call))
        if fn is None or not fn.regions[0].blocks:
            return None
        return fn.regions[0].blocks[0]

    def readers(self, value: ir.Value, stack: Stack
                ) -> Iterator[tuple[ir.Operation, int, Stack]]:
        """Each op reading ``value`` (not discarded), seen through calls and sharding
        constraints: (reader, operand number, the reader's stack). A call is entered, a
        helper's return goes back out through the call on top of ``stack``; the home
        function's own return is yielded as a reader."""
        for use in live_uses(value):
            owner = use.owner.operation
            number = use.operand_number
            if owner.name == SHARDING_CONSTRAINT:
                yield from self.readers(owner.results[0], stack)
                continue
            if owner.name == _CALL:
                block = self.callee_block(owner)
                if block is not None:
                    yield from self.readers(block.arguments[number],
                                            stack + (self.remember(owner),))
                    continue
            elif owner.name == _RETURN and stack:
                call = self.calls[stack[-1]]
                yield from self.readers(call.results[number], stack[:-1])
                continue
            yield owner, number, stack

    def returned_to_calls(self, home: ir.Block, number: int) -> bool:
        """Whether the private function of ``home`` has callers and, at each, its result
        ``number`` is read by other calls alone: a ``jax.jit`` inside a differentiated
        function returns its residuals so, to its backward's function."""
        parent = home.owner
        parent = getattr(parent, "operation", parent)
        if parent is None or parent.name != "func.func" or is_public(parent.opview):
            return False
        callers = self.callers.get(ir.StringAttr(parent.attributes["sym_name"]).value, [])
        uses = [use for call in callers for use in live_uses(call.results[number])]
        return bool(callers) and bool(uses) and all(
            use.owner.operation.name == _CALL for use in uses)

    def producer(self, value: ir.Value, stack: Stack, *, invariant_carries: bool = False
                 ) -> tuple[ir.Operation | None, ir.Value, Stack]:
        """The op making ``value``, seen through calls and sharding constraints: (op, the
        value it makes, its stack); op is None for an argument of the home function or
        region. With
        ``invariant_carries`` (for evaluating constants), a loop-body argument the loop
        passes on unchanged is followed to the loop's operand, and an argument of a
        private function called once (or passed one value by every call) to the call's
        operand, and an optimization barrier's result to its operand (a constant mask jax
        hoisted out of a scan reaches the scan's body so, and jax.checkpoint's backward
        through a barrier)."""
        while True:
            if isinstance(value, ir.BlockArgument):
                parent = value.owner.owner
                parent = getattr(parent, "operation", parent)  # an OpView's .name differs
                if parent is not None and parent.name == "func.func" and stack:
                    call = self.calls[stack[-1]]
                    value, stack = call.operands[value.arg_number], stack[:-1]
                    continue
                if invariant_carries and parent is not None and parent.name == "func.func":
                    name = ir.StringAttr(parent.attributes["sym_name"]).value
                    callers = self.callers.get(name, [])
                    # Called once, or every call passing the same value (the fill jax
                    # hoists for a scan unrolled twice: review h101).
                    passed = [call.operands[value.arg_number] for call in callers]
                    if passed and all(v == passed[0] for v in passed) and not is_public(
                            parent.opview):
                        value = passed[0]
                        continue
                if invariant_carries and parent is not None and parent.name == _WHILE:
                    loop = parent
                    body = loop.regions[1].blocks[0]
                    index = value.arg_number
                    if (value.owner == body
                            and terminator(body).operands[index] == value):
                        value = loop.operands[index]
                        continue
                    cond = loop.regions[0].blocks[0]
                    if value.owner == cond and terminator(body).operands[index] == \
                            body.arguments[index]:
                        value = loop.operands[index]
                        continue
                return None, value, stack
            op = value.owner
            op = op.operation if hasattr(op, "operation") else op
            if op.name == SHARDING_CONSTRAINT:
                value = op.operands[0]
                continue
            if invariant_carries and op.name == _BARRIER:
                value = op.operands[ir.OpResult(value).result_number]
                continue
            if op.name == _CALL:
                block = self.callee_block(op)
                if block is not None:
                    number = ir.OpResult(value).result_number
                    stack = stack + (self.remember(op),)
                    value = terminator(block).operands[number]
                    continue
            return op, value, stack
