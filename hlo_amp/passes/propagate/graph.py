"""The def-use graph the pass paints: nodes for ops and links, over every call path."""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from hlo_amp.ir.modules import (
    SAME_VALUE_OPS,
    callee_name,
    dense_value,
    element_count,
    element_type,
    function_name,
    functions,
    is_call,
    is_public,
    named_outside_calls,
    op_key,
    terminator,
    walk_operations,
)
from hlo_amp.ir.op_classes import (
    ALLOW,
    CLEAR,
    DENY,
    F16_DENY,
    INFER,
    MATRIX_OP_NAMES,
    OP_CLASSES,
    PICKING_KINDS,
    body_is_one_add,
    op_class,
    product_tree_level,
    short_name,
    table_class,
)
from hlo_amp.ir.sites import (
    Site,
    call_prefix,
    join_names,
    location_name,
    location_source,
    parse_name,
)
from hlo_amp.passes.propagate.body import (
    BARRIER,
    F32,
    LINK_CONSUMERS,
    NOT_VALUE_OPS,
    PLAIN,
    Body,
    first_block,
    type_kind,
    walk_once,
)
from hlo_amp.policy import AMP_STOP, COMPUTE, OP_KINDS, Policy

DENY_CLASS = "deny class"  # the reason of an op the table (not a rule) keeps f32
# The reasons of ops kept f32 because their result, or a constant they read, is beyond
# the 16-bit type's range: what they compute stays f32 downstream in every form.
OUT_OF_RANGE = "beyond the 16-bit range"
# An add or subtract in a chain of them from a public argument to a public result (a
# parameter update, carried through the steps of a scan): f32 state, kept so.
STATE_UPDATE = "updates f32 state the function returns"
# Ops that carry a value's entries along unchanged (moved, picked or written): in a chain
# from a public argument to a public result they are state too, as a KV cache a decode
# step slices per layer, writes a slot of and stacks again. The table's data movement,
# less the reductions (a clear reduce picks a maximum, it moves no entry), and the
# select and scatter that write entries.
_STATE_MOVES = frozenset(
    {kind for kind, cls in OP_CLASSES.items() if cls == CLEAR} - {"reduce", "reduce_window"}
    | {"select", "scatter"})

# Ops a parameter update passes the parameters through, their shape kept: adds and
# entries written back (``.at[].set`` freezing a part). No op moving entries to a new
# shape: embedding rows gathered, which a residual stream adds to, are no state.
_STATE_UPDATES = frozenset({"add", "subtract", "dynamic_update_slice", "scatter"})
# Ops a training step's update passes the parameters through too, in a chain that
# applies a gradient (``Graph._steps_state``): decays, selects and projections. A relu'd,
# masked or scaled residual stream passes the same ops and applies none.
_STEPS = frozenset({"multiply", "divide"}) | PICKING_KINDS
# A decay scales state by a number near 1 (optax's b1 = 0.9 and b2 = 0.999, an EMA's
# 0.999, 1 - lr * wd); other constants (a mean's 1 / N, a square's 2) scale
# activations and gradients (an input's gradient).
_DECAYS = (0.8, 1.25)

LINK = "link"
# A convert to the compute dtype, or the updates of an add scatter kept f32: where a
# region may end.
SINK = "sink"
# jax primitives computed by a series or a loop, by the name jax gives their ops.
SPECIAL_FUNCTIONS = frozenset({
    "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad",
    "regularized_incomplete_beta", "polygamma", "zeta", "bessel_i0e", "bessel_i1e",
    "erf_inv"})
# Op kinds whose class depends on their body or attributes as well as the table (see
# op_class).
_BODY_CLASSED = frozenset({"reduce", "reduce_window", "scatter", "reduce_precision"})


def _updates_state(node: Node) -> bool:
    return node.cls == LINK or (node.cls in (INFER, CLEAR, DENY) and node.kind in _STATE_UPDATES)


def _moves_state(node: Node) -> bool:
    return node.cls == LINK or (node.cls in (INFER, CLEAR) and node.kind in _STATE_MOVES)


@dataclass(eq=False, slots=True)
class Node:
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
    # an f32 value that matrix ops and sums read: the sums read its 16-bit copy
    sums_read_low_copy: bool = False
    deferred: bool = False  # its policy check waits until it is painted (amp_stop only)
    has_f32: bool = False  # an f32 operand or result (ops only: counted in the report)
    # per f32 output, its readers (``Graph.consumers``); set by ``solve``
    readers: list[list[Any]] = field(default_factory=list)


@dataclass
class Instance:
    """One function body seen from one call path."""

    fn: Any
    prefix: str
    body: Body
    calls: dict[int, int] = field(default_factory=dict)  # call op index -> child instance
    index: dict[int, int] = field(default_factory=dict)  # op_key -> op index (lazy)
    signature: tuple = ()

    @property
    def ops(self) -> list[ir.Operation]:
        return self.body.ops


class Graph:
    """The dataflow graph over every instance of every function (painted by ``solve``)."""

    def __init__(self, policy: Policy, low: ir.Type, walks: dict[int, Body],
                 second_moments: bool = True) -> None:
        self.policy = policy
        self.low = low
        self.second_moments = second_moments  # op_class's: a summed square is deny
        self.walks = walks  # op_key of a function -> its Body, shared with the byte count
        # the values that reach a forward matrix op, and those that reach a recomputed one
        # through recomputed ops (``reaches_forward_matrix_op``), by whether recomputed
        self._reach: dict[bool, set[tuple[int, ir.Value]]] = {}
        # value -> (the model's own, depends on an argument, made through a lookup, from
        # a parameter): ``made_from_arguments``'s
        self._made_from: dict[tuple[int, ir.Value], tuple[bool, ...]] = {}
        self._parameters: frozenset[tuple[int, ir.Value]] | None = None  # ``_flags``
        self._sites: dict[tuple[int, int, str], Site] = {}  # ``site``'s
        # (instance, op index) -> the op's source line (``recomputed_name``'s)
        self._source_lines: dict[tuple[int, int], str | None] = {}
        self.instances: list[Instance] = []
        self.nodes: list[Node] = []
        self.op_node: dict[tuple[int, int], Node] = {}  # (inst, op index) -> node
        self.producer: dict[tuple[int, ir.Value], Node] = {}
        # (inst, consuming op) -> {operand number: node}: uses that enter a link
        # (instance, op_key of the consuming op) -> operand number -> link node
        self.link_use: dict[tuple[int, int], dict[int, Node]] = defaultdict(dict)
        self.by_name: dict[str, Any] = {}
        self.named_elsewhere: set[str] = set()
        self.rules_used: set[str] = set()
        self.rules_outranked: dict[str, str] = {}  # rule -> the rule that won over it
        self._decided: dict[tuple[str, str, str], tuple[str | None, str]] = {}
        # value -> type_kind of its type, read once (the graph is built and solved
        # before the rewrite retypes anything)
        self._kinds: dict[ir.Value, str] = {}
        self._classes: dict[str, tuple[str, str]] = {}  # op name -> (kind, table class)
        # (callee instance, its argument) -> (caller instance, the call's operand)
        self.call_argument: dict[tuple[int, ir.Value], tuple[int, ir.Value]] = {}
        # Whether any rule could name a non-matrix op (amp_stop aside).
        self._site_rules = bool(policy.scopes) or policy.backward is not None or any(
            kind not in OP_KINDS for kind in policy.ops)

    # ---- building -------------------------------------------------------------------

    def build(self, module: ir.Module) -> None:
        self.by_name = {function_name(fn): fn for fn in functions(module)}
        # A function a composite decomposes into or a custom call runs keeps its
        # signature, as a public one: a call of it too is a boundary (retyped for the
        # call, it no longer matched the composite's types: an invalid module).
        self.named_elsewhere = named_outside_calls(walk_operations(
            module, names=frozenset({"stablehlo.composite", "stablehlo.custom_call"})))
        for fn in functions(module):
            if is_public(fn):
                self._instantiate(fn, "")
        for inst_id, inst in enumerate(self.instances):
            self._op_nodes(inst_id, inst)
        for inst_id, inst in enumerate(self.instances):
            self._links(inst_id, inst)
        self._deny_constants_out_of_range()
        self._deny_state_updates()

    def _deny_state_updates(self) -> None:
        """Keep f32 what carries a public argument to a public result through loop
        carries and either adds, subtracts and writes only (``_STATE_UPDATES``) or data
        movement only, and a chain through decays, selects and projections too where it
        applies a gradient (``_steps_state``): several training steps in one function,
        where the next step's dots read the new parameters too, had ``p + u`` painted
        (``w * (1 - lr * wd)``, a clip or a select skipping a step too, until
        2026-11-30), and the parameters rounded to 16 bit every step (5.6x the update's
        error of a hand cast under bf16); a KV cache a decode step slices, writes and
        stacks came back with every entry rounded to 16 bit, those it did not write too.
        (A chain mixing gathers and adds is no state: an embedding row that a residual
        stream adds to; nor is a relu'd, masked or scaled residual stream, which applies
        no gradient.)"""
        starts = [(inst_id, argument) for inst_id, inst in enumerate(self.instances)
                  if is_public(inst.fn) for argument in first_block(inst.fn.regions[0]).arguments
                  if self.f32(argument)]

        def returned(node: Node) -> bool:
            return any(self._publicly_returned(key) for key in node.outputs)

        found = [node for follows in (_updates_state, _moves_state)
                 for node in self.paths(starts, follows, returned)]
        updated = {id(node) for node in found}  # what an add chain already keeps
        if any(node.kind in _STEPS for node in self.nodes):
            for start in starts:
                # A step keeps the parameters' shape (an evaluation after the step, its
                # activations made from the new biases, is no state).
                shape = ir.ShapedType(start[1].type).shape

                def steps(node: Node, shape: list = shape) -> bool:
                    return self._steps_state(node) and all(
                        ir.ShapedType(value.type).shape == shape for _, value in node.outputs)

                chain = self.paths([start], steps, returned)
                if any(not _updates_state(node) for node in chain) and (
                        self._applies_a_gradient(chain, shape, updated)):
                    found += chain
        for node in found:
            node.cls = DENY if node.cls in (INFER, CLEAR) else node.cls  # a link: f32
            node.reason = node.reason or STATE_UPDATE

    def _applies_a_gradient(self, chain: list[Node], shape: list[int],
                            updated: set[int]) -> bool:
        """Whether an add or subtract of ``chain``, itself outside the backward pass,
        adds a value made from a gradient of the state's ``shape`` a few ops up (``w -
        lr * g``, ``g * lr`` after a long schedule, ``w - lr * (g @ Q)``): read breadth
        first up to the first backward op (``transpose(...)`` in its name stack) of each
        way, into a forward matrix op's operands but no further, and not through another
        state's update (``updated``), or adds another state's new value of that shape
        (an EMA of the parameters). (A gradient stream's own adds add gradients too; an
        evaluation after the step reads weights and biases made from gradients.)"""
        on_chain = {id(node) for node in chain}
        for node in chain:
            if node.kind not in ("add", "subtract") or self.in_backward(node):
                continue
            pending = deque((key, True) for key in node.inputs)
            seen: set[int] = set()
            while pending and len(seen) < 256:
                key, onward = pending.popleft()
                producer = self._producer_through_converts(key)
                if producer is None or id(producer) in seen or id(producer) in on_chain:
                    continue
                seen.add(id(producer))
                same_shape = all(ir.ShapedType(value.type).shape == shape
                                 for _, value in producer.outputs)
                if producer.cls != LINK and self.in_backward(producer):
                    if same_shape:
                        return True
                    continue
                if onward and id(producer) in updated and same_shape:
                    # Another state's new value, not a matrix op's operand: an EMA of
                    # the updated parameters (a mean teacher, a target network), whose
                    # update over unrolled steps was rounded to 16 bit between them and
                    # lost (hunt h96).
                    return True
                if onward and id(producer) not in updated:
                    pending.extend((key, producer.cls != ALLOW) for key in producer.inputs)
        return False

    def _producer_through_converts(self, key: tuple[int, ir.Value]) -> Node | None:
        """The node making ``key``'s value, seen through converts the graph has no node
        for (those insert_converts put before a matrix op)."""
        inst_id, value = key
        for _step in range(4):
            node = self.producer.get((inst_id, value))
            if node is not None or isinstance(value, ir.BlockArgument) or (
                    value.owner.name != "stablehlo.convert"):
                return node
            value = value.owner.operands[0]
        return None

    def site(self, inst_id: int, index: int, kind: str) -> Site:
        """Where op ``index`` of instance ``inst_id`` sits, the caller's names included
        (read once per op: printing a location is the slow part)."""
        found = self._sites.get((inst_id, index, kind))
        if found is None:
            inst = self.instances[inst_id]
            name = join_names(inst.prefix, location_name(inst.ops[index].location))
            found = self._sites[(inst_id, index, kind)] = parse_name(name, kind)
        return found

    def in_backward(self, node: Node) -> bool:
        """Whether the op (for a link: the loop, branch or call) is in the backward pass
        (``transpose(...)`` in its name stack, the caller's included)."""
        return self.site(node.inst, node.index, node.kind).backward

    def recomputed_name(self, node: Node) -> tuple[bool, tuple]:
        """(whether the op is remat's recomputed forward, its name as the forward pass
        has it too: kind, user scopes and source line)."""
        site = self.site(node.inst, node.index, node.kind)
        key = (node.inst, node.index)
        if key not in self._source_lines:  # printed once per op: asked every round
            location = self.instances[node.inst].ops[node.index].location
            self._source_lines[key] = location_source(location)
        return site.recomputed, (node.kind, site.scope, self._source_lines[key])

    def reaches_forward_matrix_op(self, node: Node, recomputed: bool = False) -> bool:
        """Whether one of the node's values reaches a matrix op's operand through forward
        ops (of any type: what an earlier run of the pass put in 16 bit counts alike),
        into and out of private functions, loop carries and branches (a loss in a jitted
        helper, in a scan over microbatches; review h116). A function that keeps its
        signature and shard_map's bodies are not followed: taken as reaching one. With
        ``recomputed``, remat's recomputed forward in the backward pass, its ops and
        matrix ops, instead of the forward pass."""
        if recomputed not in self._reach:
            self._reach[recomputed] = self._forward_reach_all(recomputed)
        return any(key in self._reach[recomputed] for key in node.outputs)

    def _forward_reach_all(self, recomputed: bool) -> set[tuple[int, ir.Value]]:
        """Every (instance, value) reaching a forward (or recomputed) matrix op's operand
        (see above)."""
        def forward(inst_id: int, index: int) -> bool:
            kind = short_name(self.instances[inst_id].body.names[index])
            site = self.site(inst_id, index, kind)
            return site.recomputed if recomputed else not site.backward

        pending: list[tuple[int, ir.Value]] = []
        for inst_id, inst in enumerate(self.instances):
            for index, name in enumerate(inst.body.names):
                opaque = name in _OPAQUE_OPS or (name == "func.call"
                                                 and index not in inst.calls)
                if (name in MATRIX_OP_NAMES or opaque) and forward(inst_id, index):
                    pending += [(inst_id, v) for v in inst.body.operands()[index]]
        found: set[tuple[int, ir.Value]] = set()
        while pending:
            key = pending.pop()
            if key in found:
                continue
            found.add(key)
            inst_id, value = key
            if isinstance(value, ir.BlockArgument):
                owner = value.owner.owner  # the block's op: the function, a loop
                if owner.operation.name in _OPAQUE_OPS:
                    pending += [(inst_id, v) for v in owner.operands]
                    continue
            else:
                index = self.op_index(inst_id, value.owner)
                if index is None or not forward(inst_id, index):
                    continue
            pending += self._made_of(key) or []
        return found

    def _made_of(self, key: tuple[int, ir.Value]) -> list[tuple[int, ir.Value]] | None:
        """The values ``key``'s value is made from: a private function's argument's the
        caller's operand, a call's result the callee's return, a loop carry its initial
        and next value, a branch result each branch's, remat's barrier slot by slot, an
        op's result its operands ([] for a public function's argument). None where not
        followed: a reducer's or shard_map's body, an op not walked, a call of a function
        that keeps its signature."""
        inst_id, value = key
        if isinstance(value, ir.BlockArgument):
            owner = value.owner.owner
            if owner.operation.name == "func.func":
                caller = self.call_argument.get(key)
                return [] if caller is None else [caller]
            if owner.operation.name == "stablehlo.while":
                return _carried_into(inst_id, owner, value.arg_number)
            return None
        op = value.owner
        index = self.op_index(inst_id, op)
        if index is None:
            return None
        inst = self.instances[inst_id]
        name = op.name
        slot = ir.OpResult(value).result_number
        if name == "func.call":
            child = inst.calls.get(index)
            return None if child is None else [
                (child, ret.operands[slot]) for ret in self.instances[child].ops
                if ret.operation.name == "func.return"]
        if name == "stablehlo.while":
            return _carried_into(inst_id, op, slot)
        if name in ("stablehlo.case", "stablehlo.if"):
            return [(inst_id, terminator(first_block(region)).operands[slot])
                    for region in op.regions]
        if name == "stablehlo.optimization_barrier":
            return [(inst_id, op.operands[slot])]
        return [(inst_id, v) for v in inst.body.operands()[index]]

    def made_from_arguments(self, key: tuple[int, ir.Value], *, lookup: bool = True) -> bool:
        """Whether the value is made from a public function's arguments, or arrays held
        as constants (a closed-over data set), without a matrix op (through private
        functions' results, loop carries and branches): data, such as a regression's
        targets and statistics, not a value of the model. Without ``lookup``, also
        through no gather (a token embedding's rows are picked from the model's table)
        and from no parameter (``_find_parameters``) or array held (a sinusoidal
        position table). Settled for every value the walk reads, once per graph (the
        painting asks again each round)."""
        if not lookup and self._parameters is None:  # asked only here: found once
            self._parameters = self._find_parameters()
        is_model, argument, looked_up, parameter = self._flags(key)
        return argument and not is_model and (lookup or not (looked_up or parameter))

    def made_by_model(self, key: tuple[int, ir.Value]) -> bool:
        """Whether the value is made with a matrix op (or from a value not followed)."""
        return self._flags(key)[0]

    def _flags(self, key: tuple[int, ir.Value]) -> tuple[bool, ...]:
        """(made by the model, from an argument or array held, through a lookup, from a
        parameter: known once ``_find_parameters`` has run) for ``made_from_arguments``."""
        made = self._made_from
        if key not in made:
            found: dict[tuple[int, ir.Value], tuple[list, bool, bool, bool, bool]] = {}
            pending = [key]
            while pending:
                current = pending.pop()
                if current in found:
                    continue
                found[current] = sources, model, *_ = self._sources(current)
                if not model:
                    pending += [source for source in sources
                                if source not in found and source not in made]
            # A value is the model's if any value it is made from is (loops: a fixpoint),
            # and it depends on an argument, a lookup or a parameter if any of them does.
            flags = tuple({k for k, facts in found.items() if facts[number]}
                          for number in (1, 2, 3, 4))
            readers: dict[tuple[int, ir.Value], list] = defaultdict(list)
            for current, (sources, *_) in found.items():
                for source in sources:
                    if source in made:
                        for flag, known in zip(flags, made[source]):
                            if known:
                                flag.add(current)
                    else:
                        readers[source].append(current)
            for spread in flags:
                pending = list(spread)
                while pending:
                    for reader in readers.get(pending.pop(), ()):
                        if reader not in spread:
                            spread.add(reader)
                            pending.append(reader)
            for current in found:
                made[current] = tuple(current in flag for flag in flags)
        return made[key]

    def _find_parameters(self) -> frozenset[tuple[int, ir.Value]]:
        """The public functions' arguments of a type some public result made by the model
        has: parameters whose gradients or updated values a step returns, state a stage
        returns anew (hidden states, a cache), not data the model reads (inputs,
        targets, noise keys). Where jax named them, a result goes with the arguments
        whose pytree it ends with (``_Matches``): so an input of a parameter's type is
        none (review h128: a batch of 64 states of 16 had the type of a 64 x 16
        weight); a result no argument's name matches goes with the top-level argument
        at its place in a tuple of results, else with every argument of its type. An
        argument the function returns as it came is one too where it is a Flax
        variable's value (``rest['table'].value``: ``nnx.split``'s non-parameter state,
        review h132) or the function returns the whole argument it is part of, as it
        came or anew, and that argument holds parameters or none does (a module's
        state: Flax nnx's non-parameter variables, a sinusoidal table among them, in a
        train step or an eval step), not one array of it (review h129: a step that
        returned its input states gave them the parameters' place, loss 61% off; h130:
        so did one that returned ``a[1]`` of its ``*a``)."""
        self._parameters = frozenset()  # the results' model flags need none
        found: set[tuple[int, ir.Value]] = set()
        for inst_id, inst in enumerate(self.instances):
            if inst.prefix or not is_public(inst.fn):
                continue
            block = first_block(inst.fn.regions[0])
            returned = terminator(block).operands
            arguments = [_Named(argument, str(argument.type), *_argument_name(argument))
                         for argument in block.arguments]
            paths = _result_paths(inst.fn, len(returned))
            matches = _Matches(arguments, {parts: str(result.type) for result, parts
                                           in zip(returned, paths) if parts is not None})
            parameters: set[ir.Value] = set()
            for result, parts in zip(returned, paths):
                if self._flags((inst_id, result))[0]:
                    parameters.update(matches.of(str(result.type), parts))
            # A step's own data it returns whole (``return loss, batch``) is in no
            # argument holding parameters (review h131: 129% off); an eval step's module
            # state, where none is found, is.
            holders = {named.head for named in arguments if named.value in parameters}
            returned_at: dict[ir.Value, list] = defaultdict(list)  # an argument's paths
            for value, parts in zip(returned, paths):
                returned_at[value].append(parts)
            passed = [named.value for named in arguments if any(
                _variable_value(named) or ((not holders or named.head in holders)
                                           and matches.returned_whole(named, parts))
                for parts in returned_at.get(named.value, ()))]
            parameters.update(passed)
            found |= {(inst_id, argument) for argument in parameters}
        self._made_from.clear()  # their parameter flags were unknown: walked again
        return frozenset(found)

    def _sources(self, key: tuple[int, ir.Value]) -> tuple[list, bool, bool, bool, bool]:
        """(the values ``key``'s value is made from, whether it is the model's own: a
        matrix op's result or a value not followed, whether it is an argument or an
        array held as a constant, whether it is a gather's result, whether it is a
        parameter or an array held) for ``made_from_arguments``. A mask converted to
        floats is made of nothing: numbers."""
        made_of = self._made_of(key)
        value = key[1]
        if made_of is None or (isinstance(value, ir.OpResult) and (
                value.owner.name in MATRIX_OP_NAMES or value.owner.name in _OPAQUE_OPS)):
            return [], True, False, False, False
        if isinstance(value, ir.BlockArgument):
            return made_of, False, not made_of and value.owner.owner.operation.name == (
                "func.func"), False, key in (self._parameters or ())
        if value.owner.name == "stablehlo.constant":
            held = dense_value(value.owner)
            table = held is not None and not held.is_splat
            return [], False, table, False, table and element_count(value) >= _TABLE_SIZE
        if value.owner.name == "stablehlo.convert" and _is_mask(value.owner.operands[0]):
            # A mask's 0s and 1s (dropout's ``x * mask / 0.9``) are numbers, as a splat
            # constant's, that every float type holds: taken for data, they kept
            # dropout's product f32 (review h128: 2% more temp, reported as promotion).
            return [], False, False, False, False
        return made_of, False, False, value.owner.name in _LOOKUPS, False

    def _steps_state(self, node: Node) -> bool:
        """``_updates_state``, a decay (a multiply or divide by a constant near 1 or by a
        number computed at run time: optax's moments ``b1 * m + (1 - b1) * g``,
        decoupled weight decay as PyTorch writes it, ``w * (1 - lr * wd) - lr * g``), a
        select (a step skipped when not finite, ``hlo_amp.select_tree``; an EMA's
        warm-up; entries kept) or a projection (a clip, WGAN's weight clipping,
        ``projection_non_negative``). Not a product with a tensor (a norm's backward
        multiplies the stream made from a parameter into that parameter's gradient) or
        other constants (an input gradient's 2 / N)."""
        if _updates_state(node):
            return True
        if node.cls not in (INFER, CLEAR, DENY) or node.kind not in _STEPS:
            return False
        if node.kind not in ("multiply", "divide"):
            return True
        operands = list(self.instances[node.inst].ops[node.index].operands)
        # A divide scales by its divisor only (``s / x`` is no scaling of ``s``).
        scalings = operands if node.kind == "multiply" else operands[1:]
        return any(number is not None and (
            np.isnan(number) or _DECAYS[0] <= number <= _DECAYS[1])
            for number in (self._one_number(node.inst, value) for value in scalings))

    def _one_number(self, inst_id: int, value: ir.Value) -> float | None:
        """Where ``value`` holds one number (possibly broadcast, reshaped or converted;
        seen through a called function's arguments): that number if it is a constant
        (an integer one too), else NaN (computed at run time, or a boolean); None where
        it holds several."""
        found, source = self._same_value_source(inst_id, value)
        constant = _defining_constant(found, source)
        if constant is not None:
            attr = dense_value(constant)
            if attr is not None and attr.is_splat:
                splat = attr.get_splat_value()
                for kind in (ir.FloatAttr, ir.IntegerAttr):
                    if splat.typeid == kind.static_typeid:
                        return float(kind(splat).value)
                return np.nan  # a boolean
        return np.nan if math.prod(ir.ShapedType(source.type).shape) == 1 else None

    def paths(self, starts: list[tuple[int, ir.Value]], follows: Callable[[Node], bool],
              ends: Callable[[Node], bool]) -> list[Node]:
        """The nodes on a path from a value of ``starts`` to a node ``ends`` admits,
        through nodes ``follows`` admits alone."""
        reached: dict[int, Node] = {}
        seen, pending = set(starts), list(starts)
        while pending:
            for reader in self.consumers(pending.pop()):
                if not isinstance(reader, Node) or id(reader) in reached or not follows(reader):
                    continue
                reached[id(reader)] = reader
                for key in reader.outputs:
                    if key not in seen:
                        seen.add(key)
                        pending.append(key)
        found: dict[int, Node] = {}
        back = [n for n in reached.values() if ends(n)]
        while back:
            node = back.pop()
            if node is None or id(node) not in reached or id(node) in found:
                continue
            found[id(node)] = node
            back.extend(self.producer.get(key) for key in node.inputs)
        return list(found.values())

    def _publicly_returned(self, key: tuple[int, ir.Value]) -> bool:
        inst_id, value = key
        return is_public(self.instances[inst_id].fn) and any(
            use.owner.name == "func.return" for use in value.uses)

    def _deny_constants_out_of_range(self) -> None:
        """An infer or clear op that reads a constant the compute type cannot hold (jax's
        and Flax's mask fills -0.7 * f32 max and finfo(f32).min, -1e9 under f16, a scale
        of 1e8 under f16) stays f32: converted to 16 bit the constant is inf, and a
        masked row's softmax, or the product, NaN. Likewise under f16 a nonzero constant
        below its smallest subnormal number (6e-8), which f16 rounds to zero or to twice
        itself: odeint's default tolerances (1.4e-8) made its error scale 0, and the
        solve NaN. (A norm's eps of 1e-5 or 1e-6 is a subnormal f16 holds to 0.3% or
        1%: not kept, as that would keep every norm's output f32.)"""
        finfo = ml_dtypes.finfo(np.dtype(self.policy.compute_dtype))
        largest = float(finfo.max)
        # bf16's smallest subnormal is f32's: nothing f32 holds is under it.
        smallest = (float(finfo.smallest_subnormal) if self.policy.compute_dtype == "float16"
                    else 0.0)
        if self.policy.compute_dtype == "bfloat16":
            # bf16 has f32's exponent range: only f32's own extremes (finfo(f32).min, a
            # mask's fill) pass bf16's largest, by 0.4%, and the rewrite saturates them
            # (Rewriter._convert), as a hand cast with finfo(bf16).min writes. Kept f32,
            # a causal mask's fill kept the scores and probabilities f32 behind it (2.75
            # times the hand cast's temp on TPU, where nothing fuses the attention).
            largest = float(np.finfo(np.float32).max)
        for node in self.nodes:
            if node.cls not in (INFER, CLEAR):
                continue
            for inst_id, value in node.inputs:
                op = self.constant_op(inst_id, value)
                magnitudes = None if op is None else _finite_magnitudes(op)
                if magnitudes is None or not magnitudes.size:
                    continue
                nonzero = magnitudes[magnitudes > 0]
                if magnitudes.max() > largest or (nonzero.size and nonzero.min() < smallest):
                    node.cls, node.reason = DENY, f"{OUT_OF_RANGE}: reads a constant"
                    break

    def constant_magnitude(self, inst_id: int, value: ir.Value) -> float | None:
        """The largest finite magnitude of the f32 constant that ``value`` holds, seen
        through converts, broadcasts, reshapes and a called function's arguments; None
        where ``value`` is no such constant."""
        op = self.constant_op(inst_id, value)
        return None if op is None else largest_finite(op)

    def constant_op(self, inst_id: int, value: ir.Value) -> Any | None:
        """The ``stablehlo.constant`` ``value`` holds, as ``constant_magnitude`` sees
        through; None where it is no constant."""
        return _defining_constant(*self._same_value_source(inst_id, value))

    def _same_value_source(self, inst_id: int, value: ir.Value) -> tuple[bool, ir.Value]:
        """Where ``value`` comes from through converts, broadcasts, reshapes, transposes
        and a called function's arguments (at most 8 steps): (whether the walk ended
        within them, the value it ended at)."""
        for _step in range(8):
            if isinstance(value, ir.BlockArgument):
                caller = self.call_argument.get((inst_id, value))
                if caller is None:
                    return True, value
                inst_id, value = caller
                continue
            op = value.owner
            if op.name not in SAME_VALUE_OPS:
                return True, value
            value = op.operands[0]
        return False, value

    def _instantiate(self, fn: Any, prefix: str) -> int:
        inst_id = len(self.instances)
        if len(self.instances) > 100_000:
            raise RecursionError("hlo-amp-propagate: call graph too deep or recursive")
        inst = Instance(fn, prefix, walk_once(fn, self.walks))
        self.instances.append(inst)
        for index, name in enumerate(inst.body.names):
            if name != "func.call":
                continue
            op = inst.ops[index]
            if is_call(op) and callee_name(op) in self.by_name:
                callee = self.by_name[callee_name(op)]
                if is_public(callee) or callee_name(op) in self.named_elsewhere:
                    continue  # it keeps its signature (named_elsewhere): a boundary
                child_prefix = call_prefix(join_names(prefix, location_name(op.location)))
                inst.calls[index] = self._instantiate(callee, child_prefix)
        return inst_id

    def _kind(self, value: ir.Value) -> str:
        kind = self._kinds.get(value)
        if kind is None:
            kind = self._kinds[value] = type_kind(value.type)
        return kind

    def f32(self, value: ir.Value) -> bool:
        return self._kind(value) == F32

    def _types_ok(self, *groups: tuple[ir.Value, ...]) -> tuple[bool, bool]:
        """(some value is f32, every value is an int, bool or f32 ranked tensor with at
        least one f32)."""
        has_f32, only_plain = False, True
        known = self._kinds
        for values in groups:
            for value in values:
                kind = known.get(value)
                if kind is None:
                    kind = known[value] = type_kind(value.type)
                if kind == F32:
                    has_f32 = True
                elif kind != PLAIN:
                    only_plain = False
        return has_f32, has_f32 and only_plain

    def _add(self, node: Node) -> Node:
        self.nodes.append(node)
        for key in node.outputs:
            self.producer[key] = node
        return node

    def _op_nodes(self, inst_id: int, inst: Instance) -> None:
        compute = self.policy.compute_dtype
        body = inst.body
        all_operands, all_results = body.operands(), body.results()
        by_name = self._classes
        for index, name in enumerate(body.names):
            if name in NOT_VALUE_OPS:
                continue
            op = body.ops[index]
            if name == BARRIER and not self._barrier_kept(op, inst.prefix):
                continue  # its operand-result pairs are links (``_links``)
            operands, results = all_operands[index], all_results[index]
            has_f32, types_ok = self._types_ok(operands, results)
            known = by_name.get(name)
            if known is None:
                kind = short_name(name)
                known = by_name[name] = (kind, table_class(kind, compute))
            kind, cls = known
            if kind in _BODY_CLASSED or kind in ("multiply", "square"):
                # by the body, a product tree, a second moment, f16's square
                cls = op_class(op, compute, self.second_moments)
            node = Node(cls, inst_id, index, kind,
                         inputs=[(inst_id, v) for v in operands],
                         outputs=[(inst_id, v) for v in results], has_f32=has_f32)
            if cls == ALLOW:  # a matrix op: a seed only if insert_converts made it 16-bit
                low = [v for v in operands[:2] if element_type(v) == self.low]
                if not (len(low) == 2 and results and self.f32(results[0])):
                    node.cls, node.reason = DENY, "matrix op not in 16 bit"
            elif cls in (INFER, CLEAR):
                if not types_ok:
                    node.cls, node.reason = DENY, "not an f32 op"
                elif not self._site_rules:
                    node.deferred = True  # only amp_stop could name it: checked if painted
                else:
                    override = self.policy_class(op, inst.prefix, node.kind)
                    if override is not None:
                        node.cls, node.reason = override
            elif not self._site_rules:
                node.reason = DENY_CLASS if cls == DENY else "not in the op table"
            else:
                override = self.policy_class(op, inst.prefix, node.kind)
                if override is not None and override[0] in (INFER, CLEAR) and types_ok:
                    node.cls, node.reason = override
                else:
                    node.reason = DENY_CLASS if cls == DENY else "not in the op table"
            # Its value may not fit f16 (a quotient by a small divisor: the rsqrt's
            # derivative rsqrt(y) / y, 1e6), so deny spreads from it on CPU too: its
            # readers painted in f16 made inf of it (review h116).
            # (A product tree's level is deny for its precision, not the range: h121.)
            if ((kind in F16_DENY or kind == "multiply") and compute == "float16"
                    and node.cls == DENY and node.reason == DENY_CLASS
                    and not (kind == "multiply" and product_tree_level(op))):
                node.reason = (f"{OUT_OF_RANGE}: a square, a summed product, a quotient, "
                               "a tangent or erfc under float16")
            self.op_node[(inst_id, index)] = self._add(node)

    def policy_class(self, op: Any, prefix: str, kind: str) -> tuple[str, str] | None:
        """(class, reason) when a rule overrides the table for this op, or the op is a
        special function's arithmetic (deny), else None."""
        name = location_name(op.location)
        if name.rsplit("/", 1)[-1] in SPECIAL_FUNCTIONS:
            # The arithmetic a special function is lowered to (jax.export expands CHLO's
            # lgamma, digamma, igamma... into adds, divides and loops): deny, as the
            # table has the CHLO op (its series lose 10% in bf16).
            return DENY, DENY_CLASS
        if not self._site_rules and AMP_STOP not in name and AMP_STOP not in prefix:
            return None  # no rule can name this op: its scopes come from prefix and name
        key = (prefix, name, kind)
        decided = self._decided.get(key)
        if decided is None:
            site = parse_name(join_names(prefix, name), kind)
            rule = self.policy.decide(site.scope, kind, site.gradient_pass)
            decided = self._decided[key] = (rule.action, rule.rule)
            for loser in rule.outranked:
                self.rules_outranked.setdefault(loser, rule.rule)
        action, rule = decided
        if action is None:
            return None
        self.rules_used.add(rule)
        if action in (COMPUTE, self.policy.compute_dtype):
            if rule.startswith("op:"):
                return INFER, ""  # the user moved this kind into the paintable classes
            return None  # a scope that computes in 16 bit: the table decides
        return DENY, f"rule {rule}"  # keep, float32 or another dtype: stays as written

    def _barrier_kept(self, op: Any, prefix: str) -> bool:
        """Whether a rule (an op or scope rule, amp_stop) keeps an optimization barrier
        as written: then it is a deny op, reading f32, not a set of links."""
        override = self.policy_class(op, prefix, "optimization_barrier")
        return override is not None and override[0] == DENY

    def _links(self, inst_id: int, inst: Instance) -> None:
        for index, name in enumerate(inst.body.names):
            if name == "stablehlo.while":
                self._while_links(inst_id, index, inst.ops[index])
            elif name == BARRIER and (inst_id, index) not in self.op_node:
                op = inst.ops[index]
                for slot in range(len(op.operands)):
                    self._link(inst_id, index, "barrier", slot,
                               [(op, (inst_id, op.operands[slot]), slot)],
                               [(inst_id, op.results[slot])])
            elif name in ("stablehlo.case", "stablehlo.if"):
                self._branch_links(inst_id, index, inst.ops[index])
            elif index in inst.calls:
                self._call_links(inst_id, index, inst.ops[index], inst.calls[index])

    def _link(self, inst_id: int, index: int, kind: str, slot: int,
              inputs: list[tuple[Any, tuple[int, ir.Value], int]],
              outputs: list[tuple[int, ir.Value]]) -> None:
        """A link node; ``inputs`` are (consuming op, value key, operand number)."""
        node = Node(LINK, inst_id, index, kind, slot,
                     inputs=[key for _, key, _ in inputs], outputs=outputs)
        values = [key[1] for key in node.inputs] + [key[1] for key in outputs]
        if not all(self.f32(v) for v in values):
            node.reason = "not an f32 value"
        self._add(node)
        for consumer, key, number in inputs:
            self.link_use[(key[0], op_key(consumer))][number] = node

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
            self.call_argument[(child, argument)] = (inst_id, op.operands[slot])
            self._link(inst_id, index, "arg", slot,
                       [(op, (inst_id, op.operands[slot]), slot)], [(child, argument)])
        child_body = self.instances[child].body
        returns = [child_body.ops[i] for i, name in enumerate(child_body.names)
                   if name == "func.return"]
        for slot in range(len(op.results)):
            self._link(inst_id, index, "result", slot,
                       [(ret, (child, ret.operands[slot]), slot) for ret in returns],
                       [(inst_id, op.results[slot])])


    # ---- readers --------------------------------------------------------------------

    def consumers(self, key: tuple[int, ir.Value]) -> list[Node | str]:
        """The nodes reading a value; SINK for converts to the compute dtype and for the
        updates of an add scatter kept f32 (``_sums_updates``); DENY for anything that
        must see f32 (deny ops, other converts, a public return)."""
        inst_id, value = key
        body = self.instances[inst_id].body
        if value in body.inner_uses():  # some of its uses are not in the walk
            return self._consumers_of_uses(key)
        uses = body.uses().get(value)
        if not uses:
            return []
        names, op_node = body.names, self.op_node
        found: list[Node | str] = []
        for index, number in uses:
            name = names[index]
            if name in LINK_CONSUMERS:
                link = self.link_use.get((inst_id, op_key(body.ops[index])), {}).get(number)
                if link is not None:
                    found.append(link)
                    continue
            if name == "stablehlo.convert":
                result = body.results()[index][0]
                is_sink = element_type(result) == self.low and self.f32(value)
                found.append(SINK if is_sink else DENY)
                continue
            node = op_node.get((inst_id, index))
            if node is not None and _sums_updates(node, body.ops[index], number):
                found.append(SINK)
                continue
            found.append(node if node is not None else DENY)
        return found

    def _consumers_of_uses(self, key: tuple[int, ir.Value]) -> list[Node | str]:
        """``consumers`` from the value's use list, for a value some op outside the walk
        reads (e.g. from inside a reduce body)."""
        inst_id, value = key
        found: list[Node | str] = []
        for use in value.uses:
            owner = use.owner
            link = self.link_use.get((inst_id, op_key(owner)), {}).get(use.operand_number)
            if link is not None:
                found.append(link)
                continue
            if owner.operation.name == "stablehlo.convert":
                is_sink = element_type(owner.result) == self.low and self.f32(value)
                found.append(SINK if is_sink else DENY)
                continue
            node = self._node_of(inst_id, owner)
            if node is not None and _sums_updates(node, owner, use.operand_number):
                found.append(SINK)
                continue
            found.append(node if node is not None else DENY)
        return found

    def _node_of(self, inst_id: int, op: Any) -> Node | None:
        index = self.op_index(inst_id, op)
        return None if index is None else self.op_node.get((inst_id, index))

    def op_index(self, inst_id: int, op: Any) -> int | None:
        """``op``'s index in instance ``inst_id``'s ops; None for an op not walked."""
        inst = self.instances[inst_id]
        if not inst.index:
            inst.index = {op_key(o): i for i, o in enumerate(inst.ops)}
        return inst.index.get(op_key(op))



# shard_map's manual body: its values are not followed (taken as reaching a matrix op).
_OPAQUE_OPS = frozenset({"sdy.manual_computation", "sdy.return"})
_LOOKUPS = frozenset({"stablehlo.gather", "stablehlo.dynamic_gather"})
# An array held as a constant this large is the model's table (a sinusoidal position
# table), not a computation's own numbers (threefry's rotations, a polynomial's).
_TABLE_SIZE = 256


@dataclass(frozen=True)
class _Named:
    """A public function's argument with the name jax gave it: the argument's own name
    (``params``) and the parts of its pytree path after it (``("['w2']",)``)."""

    value: ir.BlockArgument
    type: str
    head: str | None
    parts: tuple[str, ...] | None


class _Matches:
    """Which arguments a named result goes with (``_find_parameters``). Best, those of
    the largest subtree of an argument (two or more float leaves) that the results hold
    whole under one path (``ws``'s gradients ``result[1][i][j]`` for every
    ``ws[i][j]``; a batch ``(s, y)`` of a layer pair's types is held under
    ``result[1][i]`` too, a smaller subtree: review h131): a path's tail alone can
    mislead, a ``*data``'s ``data[0]`` ends the gradient ``result[1][2][0]`` of
    ``ws[2][0]`` too (review h130: the states taken for a weight, loss 68% off). Else
    those whose path the result's ends with (``params['w2']``, an nnx state's
    ``.states[0][0]``); else, for a top-level argument, the one at its place in a tuple
    of results (``_by_position``); else every argument of the result's type."""

    def __init__(self, arguments: list[_Named], results: dict[tuple[str, ...], str]):
        self.results = results
        self.arguments = arguments
        # a tuple's path -> its places' top-level arguments (_by_position)
        self.aligned: dict[tuple[str, ...], dict[int, _Named]] = {}
        # a path -> the kinds of the results one part below it (None: a subtree there)
        self.children: dict[tuple[str, ...], dict[str, str | None]] = defaultdict(dict)
        for parts, kind in results.items():
            for cut in range(len(parts)):
                self.children[parts[:cut]][parts[cut]] = (
                    kind if cut == len(parts) - 1 else None)
        self.typed: dict[str, list[_Named]] = defaultdict(list)
        # (argument name, path to a subtree) -> the subtree's float leaves
        self.subtrees: dict[tuple, list[_Named]] = defaultdict(list)
        for named in arguments:
            self.typed[named.type].append(named)
            if named.parts is not None and isinstance(element_type(named.value),
                                                      ir.FloatType):
                for cut in range(len(named.parts) + 1):
                    self.subtrees[(named.head, named.parts[:cut])].append(named)
        self.held: dict[tuple, int] = {}

    def of(self, kind: str, parts: tuple[str, ...] | None) -> list[ir.BlockArgument]:
        typed = self.typed[kind]
        if parts is not None:
            sizes = [(self._held_size(named, parts), named) for named in typed if named.parts]
            largest = max((size for size, _ in sizes), default=0)
            if largest:
                return [named.value for size, named in sizes if size == largest]
            tail = [named.value for named in typed if named.parts
                    and _ends_with(parts, named.parts)]
            if tail:
                return tail
            by_position = self._by_position(parts)
            if by_position is not None:
                return [by_position.value]
        return [named.value for named in typed]

    def _by_position(self, parts: tuple[str, ...]) -> _Named | None:
        """The top-level argument a result at ``P[i]`` goes with by position: where the
        results hold a tuple ``P[0]``, ..., ``P[k-1]`` of arrays, the one alignment of
        it with the arguments under which two or more of its arrays have their top-level
        argument's type (jax.grad's gradients for ``argnums=(0, 1)`` of
        ``loss(v, w, s, y)``, a step's ``return v2, w2, loss``), ``s`` of ``w``'s type
        among them (loss 126% off when it went by type); else None."""
        if not parts or not re.fullmatch(r"\[\d+\]", parts[-1]):
            return None
        under = parts[:-1]
        if under not in self.aligned:
            self.aligned[under] = self._alignment(under)
        return self.aligned[under].get(int(parts[-1][1:-1]))

    def _alignment(self, under: tuple[str, ...]) -> dict[int, _Named]:
        """{i: the argument} for the tuple of arrays the results hold under ``under``:
        of the offsets between its places and the arguments', the one that pairs the
        most of them with a top-level argument of their type, two or more; empty where
        there is no such tuple or that offset is not the only one."""
        held = self.children.get(under, {})
        if len(held) < 2 or any(held.get(f"[{i}]") is None for i in range(len(held))):
            return {}  # not a tuple, or one holding more than arrays
        kinds = [held[f"[{i}]"] for i in range(len(held))]
        pairings = []
        for offset in range(1 - len(kinds), len(self.arguments)):
            pairing = {i: self.arguments[i + offset] for i, kind in enumerate(kinds)
                       if 0 <= i + offset < len(self.arguments)
                       and self.arguments[i + offset].parts == ()
                       and self.arguments[i + offset].type == kind}
            pairings.append(pairing)
        most = max(len(pairing) for pairing in pairings)
        best = [pairing for pairing in pairings if len(pairing) == most]
        return best[0] if most >= 2 and len(best) == 1 else {}

    def returned_whole(self, named: _Named, parts: tuple[str, ...] | None) -> bool:
        """Whether the result at ``parts`` is ``named``'s place in the whole argument
        ``named`` is a leaf of (two or more float leaves), returned under one path."""
        if parts is None or named.parts is None or not _ends_with(parts, named.parts):
            return False
        return self._held(named.head, (), parts[:len(parts) - len(named.parts)]) > 0

    def _held_size(self, named: _Named, parts: tuple[str, ...]) -> int:
        """The most float leaves of a subtree around ``named`` that the results hold
        whole, ``named`` at ``parts``; 0 for none."""
        best = 0
        for size in range(1, min(len(named.parts), len(parts)) + 1):
            if parts[-size] != named.parts[-size]:
                break
            best = max(best, self._held(named.head, named.parts[:-size], parts[:-size]))
        return best

    def _held(self, head: str | None, root: tuple[str, ...], under: tuple[str, ...]) -> int:
        """How many float leaves ``head``'s subtree at ``root`` has, where the results
        hold them all under ``under`` with their types and there are two or more; else
        0."""
        key = (head, root, under)
        if key not in self.held:
            leaves = self.subtrees[(head, root)]
            self.held[key] = len(leaves) if len(leaves) >= 2 and all(
                self.results.get(under + leaf.parts[len(root):]) == leaf.type
                for leaf in leaves) else 0
        return self.held[key]


def _variable_value(named: _Named) -> bool:
    """Whether jax names the argument as a Flax variable's value (``.value`` last)."""
    return bool(named.parts) and named.parts[-1] == ".value"


def _ends_with(parts: tuple[str, ...], tail: tuple[str, ...]) -> bool:
    return len(parts) >= len(tail) and parts[len(parts) - len(tail):] == tail


# The parts of a pytree path as jax writes it: ``[0]``, ``['w']``, ``.w``.
_PATH_PART = re.compile(r"\[(?:'[^']*'|\"[^\"]*\"|[^\]'\"])*\]|\.[^.\[]+")


def _path_parts(path: str) -> tuple[str, ...] | None:
    """``path`` split into its parts; None where it is not all parts."""
    parts = tuple(_PATH_PART.findall(path))
    return parts if "".join(parts) == path else None


def _argument_name(argument: ir.BlockArgument) -> tuple[str | None, tuple[str, ...] | None]:
    """The name jax gives a public function's argument, as (the argument's own name, the
    parts of its pytree path after it): ``params['w2']`` as ``("params", ("['w2']",))``;
    ``(None, None)`` where it has none. An Equinox step's are named by the argument
    ``runtime/frameworks.py``'s ``_pure_call`` keeps them in (``kept[('arg', 0)].w1``):
    that key is part of the argument's own name."""
    location = argument.location
    if not isinstance(location, ir.NameLoc):
        return None, None
    name = re.match(r"([A-Za-z_]\w*(?:\[\('(?:arg|kw)', [^\]]*\)\])?)(.*)$",
                    location.name_str)
    if name is None:
        return None, None
    return name.group(1), _path_parts(name.group(2))


def _result_paths(fn: Any, count: int) -> list[tuple[str, ...] | None]:
    """The parts of the pytree paths jax names a function's results with
    (``jax.result_info``, after its ``result``); None where a result has none."""
    if "res_attrs" not in fn.attributes:
        return [None] * count
    paths: list[tuple[str, ...] | None] = []
    for attributes in ir.ArrayAttr(fn.attributes["res_attrs"]):
        attributes = ir.DictAttr(attributes)
        info = (ir.StringAttr(attributes["jax.result_info"]).value
                if "jax.result_info" in attributes else None)
        paths.append(None if info is None or not info.startswith("result")
                     else _path_parts(info.removeprefix("result")))
    return (paths + [None] * count)[:count]


def _is_mask(value: ir.Value) -> bool:
    """Whether the value holds booleans (a compare's result)."""
    element = element_type(value)
    return isinstance(element, ir.IntegerType) and ir.IntegerType(element).width == 1


def _carried_into(inst_id: int, loop: Any, slot: int) -> list[tuple[int, ir.Value]]:
    """The values a while loop's carry ``slot`` holds: its initial value and what the body
    returns for the next iteration."""
    body_return = terminator(first_block(loop.regions[1]))
    return [(inst_id, loop.operands[slot]), (inst_id, body_return.operands[slot])]


# A non-splat constant up to this size is read whole (a mask bias held as a constant is
# one per position pair: a 300-token one is 90,000, and was not read at 1 << 16, its
# finfo.min fill became -inf), read from its buffer in about a millisecond a million; a
# larger one a chunk of this size at a time, for its extremes only.
_MAX_READ_ELEMENTS = 1 << 22


def _defining_constant(found: bool, source: ir.Value) -> Any | None:
    """The ``stablehlo.constant`` a finished walk (``Graph._same_value_source``) ended
    at, or None."""
    if not found or isinstance(source, ir.BlockArgument):
        return None
    return source.owner if source.owner.name == "stablehlo.constant" else None


def largest_finite(op: Any) -> float | None:
    """The largest finite |element| of an f32 or f64 ``stablehlo.constant``; None for
    another element type, an unreadable or a large non-splat constant."""
    found = _finite_magnitudes(op)
    return None if found is None or not found.size else float(found.max())


def _finite_magnitudes(op: Any) -> np.ndarray | None:
    attr = dense_value(op)
    if attr is None:
        return None
    if str(ir.RankedTensorType(attr.type).element_type) not in ("f32", "f64"):
        return None
    if attr.is_splat:
        values = np.asarray([ir.FloatAttr(attr.get_splat_value()).value])
    else:
        values = np.array(attr, copy=False)  # the attribute's buffer, not a copy per element
    if values.size <= _MAX_READ_ELEMENTS:
        return np.abs(values[np.isfinite(values)])
    # Larger (a 4096-token bias, a per-head one): its largest and smallest nonzero finite
    # magnitude, a chunk at a time, are all the readers ask (one over the limit was not
    # read, and its finfo.min fill became -inf).
    flat, largest, smallest = values.reshape(-1), 0.0, np.inf
    for start in range(0, flat.size, _MAX_READ_ELEMENTS):
        chunk = np.abs(flat[start:start + _MAX_READ_ELEMENTS])
        chunk = chunk[np.isfinite(chunk)]
        if chunk.size:
            largest = max(largest, float(chunk.max()))
            nonzero = chunk[chunk > 0]
            smallest = min(smallest, float(nonzero.min())) if nonzero.size else smallest
    found = [largest] + ([smallest] if np.isfinite(smallest) else [])
    return np.asarray(found)


def _sums_updates(node: Node, op: Any, number: int) -> bool:
    """Whether operand ``number`` of ``op`` is the updates of an add scatter that the op
    table keeps f32 (a sum whose updates may meet: an embedding's gradient). It reads
    them as a matrix op reads its operand: a 16-bit gradient reaches it in 16 bit (the
    gradient of block 0's input, which only the lookup's scatter reads, as in Keras's
    mixed_bfloat16 embedding), and it converts them up and sums in f32. Kept f32 up to
    it, that gradient made XLA sum block 0's row-parallel all-reduces in f32."""
    if node.kind != "scatter" or node.cls != DENY or node.reason != DENY_CLASS:
        return False
    if not body_is_one_add(op):
        return False
    inputs = (len(op.operands) - 1) // 2
    return number > inputs
