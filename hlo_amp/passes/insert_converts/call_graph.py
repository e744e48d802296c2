"""Call-site contexts for insert_converts: every function body seen under the name of
each call site that reaches it, a clone of a private function per decision vector its
call sites need, the first and last matrix ops of each public function, and how often
each op runs per call of the program (the report's FLOPs)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.loops import LoopCounts, Runs, enclosing_loops, loop_body
from hlo_amp.ir.modules import (
    BODY_ATTRIBUTE,
    SAME_VALUE_OPS,
    body_name,
    clone_private,
    element_type,
    function_name,
    functions,
    is_kernel_matmul,
    is_public,
    is_zero_constant,
    op_key,
    set_body_name,
    terminator,
    walk_operations,
)
from hlo_amp.ir.op_classes import MATRIX_OP_KINDS
from hlo_amp.ir.program_hints import EndStacks
from hlo_amp.ir.sites import (
    Site,
    asks_for_precision,
    call_prefix,
    in_backward_pass,
    join_names,
    location_name,
    site_of,
)
from hlo_amp.passes.insert_converts.plan import TypeNames, float_bits
from hlo_amp.policy import FIRST_MATRIX_OP, LAST_MATRIX_OP, OP_KINDS, Policy
from hlo_amp.targets.dot_dims import dot_layout

# The candidate ops by name, with their policy op kind.
_MATRIX_OPS = {name: kind for name, kind in MATRIX_OP_KINDS.items() if kind in OP_KINDS}
# Calls, and composites: their decompositions are what XLA runs (jax.lax.composite).
_WATCHED = frozenset({*_MATRIX_OPS, *BODY_ATTRIBUTE})


# The calls from a public function to a body: (original caller name, index of the call
# in the caller's ops_of) each. Two calls at one scope share a prefix, not a path.
CallPath = tuple[tuple[str, int], ...]


@dataclass
class Instance:
    """One function body to rewrite, the call-site name its ops are seen under, and the
    path of the first call that reached it (a clone serves calls of equal decisions)."""

    fn: Any
    prefix: str
    path: CallPath = ()


@dataclass
class CallGraph:
    """Call-site contexts and the clones needed so each body has one decision vector."""

    policy: Policy
    by_name: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # clone name -> original
    memo: dict[tuple[str, tuple], str] = field(default_factory=dict)
    used_names: set[str] = field(default_factory=set)
    instances: list[Instance] = field(default_factory=list)
    clones: int = 0
    signatures: dict[tuple[str, str, CallPath], tuple] = field(default_factory=dict)
    # op_key of a function -> its matrix ops (with their kind) and calls (kind None), in
    # program order: one walk per function body, shared by both phases.
    watched: dict[int, list[tuple[Any, str | None]]] = field(default_factory=dict)
    sites: dict[tuple[Any, str, str], Site] = field(default_factory=dict)
    type_names: TypeNames = field(default_factory=lambda: TypeNames())
    # (original function name, index in ops_of, call-site prefix, call path) -> the
    # first/last rules of that op reached through that path
    positions: dict[tuple[str, int, str, CallPath], tuple[str, ...]] = field(
        default_factory=dict)
    loops: LoopCounts = field(default_factory=LoopCounts)
    # function name (after cloning) -> how often it runs per call of the program
    runs: dict[str, Runs] = field(default_factory=dict)

    def ops_of(self, fn: Any) -> list[tuple[Any, str | None]]:
        """The matrix ops and calls of ``fn`` (walked once; the rewrite adds only
        converts, so the list stays good)."""
        found = self.watched.get(op_key(fn))
        if found is None:
            # A spliced kernel's matmuls are its own (the reference attention kernel's).
            found = self.watched[op_key(fn)] = [
                (op, _MATRIX_OPS.get(op.name)) for op in walk_operations(fn, names=_WATCHED)
                if not is_kernel_matmul(op)]
        return found

    def site(self, op: Any, kind: str, prefix: str) -> Site:
        """``site_of`` an op, once per (location, kind, prefix): a private function's
        ops are decided twice (its signature, then its rewrite)."""
        key = (op.location, kind, prefix)
        found = self.sites.get(key)
        if found is None:
            found = self.sites[key] = site_of(key[0], kind, prefix)
        return found

    def signature(self, name: str, prefix: str, path: CallPath = ()) -> tuple:
        """The decisions a body would get under ``prefix`` reached through ``path``,
        nested calls included."""
        original = self.origin.get(name, name)
        known = self.signatures.get((original, prefix, path))
        if known is not None:
            return known
        fn = self.by_name[original]
        parts: list[Any] = []
        for index, (op, kind) in enumerate(self.ops_of(fn)):
            if kind is not None:
                site = self.site(op, kind, prefix)
                positions = self.positions.get((original, index, prefix, path), ())
                # The positions too: the first and the last call of one function may
                # get one action, but each is reported under its own rule; and the scope
                # path: a layer called under two named scopes is reported (and measured
                # by attribute/autopolicy) under each, not twice under the first.
                parts.append((self.policy.decide(site.scope, kind, site.gradient_pass, positions,
                                                 asks_for_precision(op)).action, positions,
                              site.scope_path))
            elif body_name(op) in self.by_name:
                inner = body_name(op)
                parts.append(self.signature(inner, self._callee_prefix(prefix, op),
                                            path + ((original, index),)))
        self.signatures[(original, prefix, path)] = tuple(parts)
        return self.signatures[(original, prefix, path)]

    @staticmethod
    def _callee_prefix(prefix: str, call: Any) -> str:
        return call_prefix(join_names(prefix, location_name(call.location)))

    def visit(self, fn: Any, prefix: str, path: CallPath = ()) -> None:
        self.instances.append(Instance(fn, prefix, path))
        caller = self.origin.get(function_name(fn), function_name(fn))
        for index, (op, kind) in enumerate(self.ops_of(fn)):
            if kind is not None or body_name(op) not in self.by_name:
                continue
            name = body_name(op)
            original = self.origin.get(name, name)
            callee_prefix = self._callee_prefix(prefix, op)
            callee_path = path + ((caller, index),)
            key = (original, self.signature(original, callee_prefix, callee_path))
            target = self.memo.get(key)
            if target is None:
                target = self._instantiate(original)
                self.memo[key] = target
                self.visit(self.by_name[target], callee_prefix, callee_path)
            if target != name:
                set_body_name(op, target)

    def find_ends(self, public: list[Any], given: EndStacks | None = None) -> EndStacks:
        """Fill ``positions``: per public function, the first and last float matrix op
        of its forward program, and the backward ops with their scope, kind and source
        call stack (before any cloning: keys use original names). ``given``: the ends
        of the forward program a backward program was split from (``jax.grad`` of a
        compiled function: runtime/amp_call.py), whose backward ops are marked as in
        the whole program. Returns the ends' stacks found (empty where first and last
        cannot be told apart)."""
        found: EndStacks = {}
        for fn in public:
            order: list[tuple[tuple[str, int, str, CallPath], Any, str]] = []
            looped: dict[tuple[str, int, str, CallPath], tuple[int, ...]] = {}
            self._program_order(function_name(fn), "", order, (), looped)
            stacks = dict(given or {})
            forward, recomputed, gradients = [], [], []
            first_gradient = None
            for key, op, kind in order:
                if not all(float_bits(element_type(v)) for v in list(op.operands)[:2]):
                    continue
                site = self.site(op, kind, key[2])
                if not site.backward:
                    forward.append((key, op, kind))
                elif site.recomputed:
                    recomputed.append((key, op, kind))
                else:
                    gradients.append(key)
                    first_gradient = first_gradient or (key, op, kind)
            # jax.grad of a function under jax.checkpoint: the forward's matrix ops run
            # only recomputed, in the backward pass (its ends had no rule at all).
            only_recomputed = not forward
            forward = forward or recomputed
            # An end inside a loop is every iteration's op (each scanned layer's, an RNN
            # cell's), not a stem or a head: no rule for that end. Loops around every
            # matrix op, the gradients' too, run the whole step (the loss scaler's
            # redo_on_nan, a scan accumulating gradients over microbatches): they make
            # no op a layer's (the ends lost their rule there, and the stem and head
            # went fp8). A scan over layers or time runs its gradients in a loop of its
            # own. Without gradients, the loops around every forward matrix op run the
            # whole forward when the ends' weights are the same at every iteration: a
            # generation loop decoding a token per iteration (its stem and head went fp8
            # there), not a scan over stacked layers.
            whole = _common_prefix([looped.get(key, ()) for key in
                                    [k for k, _, _ in forward + recomputed] + gradients])
            dead_head = self._dead_head(first_gradient, forward + recomputed, order, looped,
                                        whole, given)
            candidates = ((FIRST_MATRIX_OP, forward[0]), (LAST_MATRIX_OP, forward[-1])
                          ) if forward else ()
            if dead_head is not None:  # the forward's last op is a layer's, not the head
                candidates = candidates[:1]
            if given and only_recomputed:
                # A backward program recomputes what was checkpointed, which need not hold
                # the ends (checkpointed layers in a Python loop between a plain stem and
                # head: the first and last hidden layers were taken for them, 16-bit): a
                # recomputed op is an end only where the forward's end, if handed on, is it.
                candidates = tuple(
                    (position, end) for position, end in candidates
                    if _is_given_end(given, position,
                                     _stack_key(self.site(end[1], end[2], end[0][2]),
                                                end[1], end[2])))
            ends = [(position, end) for position, end in candidates
                    if len(looped.get(end[0], ())) == len(whole)
                    and (gradients or not whole or self._reads_invariant(end[0], end[1]))]
            own: EndStacks = {}
            own_frames: dict[tuple[str, str, str], tuple[str, ...]] = {}
            end_stacks: dict[str, tuple[str, str, str]] = {}
            bases: dict[str, set[Any]] = {}
            for position, (key, op, kind) in ends:
                self.positions[key] = self.positions.get(key, ()) + (position,)
                stack = _stack_key(self.site(op, kind, key[2]), op, kind)
                own[stack] = own.get(stack, ()) + (position,)
                frame = _innermost(stack)
                own_frames[frame] = own_frames.get(frame, ()) + (position,)
                end_stacks[position] = stack
                bases[position] = self._bases(op, key[3])
            if dead_head is not None:  # its backward ops, by stack alone
                own[dead_head] = own.get(dead_head, ()) + (LAST_MATRIX_OP,)
                bases[LAST_MATRIX_OP] = set()
            alike = len(own) == 1 and len(ends) == 2 and forward[0][0] != forward[-1][0]
            if not alike:  # first and last that look alike are no stacks to hand on
                # Nor is the stack of a layer written in a Python loop, which every
                # layer's op has: a backward program marks by stack alone, and every
                # layer's gradients went 16-bit (jax.grad of a compiled fp8 loss). Ops
                # on one line that read one value are an end's siblings (two heads of
                # one activation, two stems of one input): that stack is handed on.
                reads_by_stack: dict[tuple[str, str, str], list[set[Any]]] = {}
                for key, op, kind in forward:
                    stack = _stack_key(self.site(op, kind, key[2]), op, kind)
                    if stack in own:
                        reads_by_stack.setdefault(stack, []).append(self._bases(op, key[3]))
                found.update({stack: positions for stack, positions in own.items()
                              if all(read & bases[position]
                                     for read in reads_by_stack.get(stack, ())
                                     for position in positions if position in bases)})
            backward = [(key, op, kind, _stack_key(site, op, kind))
                        for key, op, kind in order
                        for site in (self.site(op, kind, key[2]),) if site.backward]
            # An end's backward ops read one of its operands (dW reads x, dx reads W):
            # of the ops with its stack (every layer written on one line has it), those.
            # By key, not by op: a function called at several sites (a jax.jit layer's
            # backward, called per layer) is one op on several call paths.
            sharing = {(position, key) for key, op, _, stack in backward
                       for position in own.get(stack, ())
                       if bases[position] & self._bases(op, key[3])}
            found_by_operand = {position for position, _ in sharing}
            for key, op, kind, stack in backward:
                marked = tuple(stacks.get(stack, ()))  # a forward program's, handed on
                if given and not marked:
                    # A checkpointed end's recomputation and backward have the
                    # checkpointed call's frame, which the forward's stack lacks.
                    for end_stack, positions in given.items():
                        if _recomputes(end_stack, stack):
                            marked += positions
                for position in own.get(stack, ()):
                    if (position, key) in sharing or (
                            position not in found_by_operand and not alike):
                        marked += (position,)  # no op reads its operands: by stack alone
                if stack not in own:
                    # Under jax.checkpoint the forward's stack lacks the checkpointed
                    # call's frame that its recomputation and backward have: the end's
                    # frames among theirs, and one of the end's operands (or of its
                    # recomputation's, which its weight gradient reads), make them its.
                    for position in own_frames.get(_innermost(stack), ()):
                        if (_within(end_stacks[position], stack)
                                and bases[position] & self._bases(op, key[3])):
                            marked += (position,)
                            if self.site(op, kind, key[2]).recomputed:
                                bases[position] = bases[position] | self._bases(op, key[3])
                if marked:
                    self.positions[key] = self.positions.get(key, ()) + marked
        return found

    def end_positions(self) -> dict[int, tuple[str, ...]]:
        """``positions`` by op (``op_key``), over every call path: for a pass that reads
        the ends before insert_converts has cloned anything (fused attention)."""
        found: dict[int, tuple[str, ...]] = {}
        for (name, index, _prefix, _path), positions in self.positions.items():
            key = op_key(self.ops_of(self.by_name[name])[index][0])
            found[key] = tuple(dict.fromkeys(found.get(key, ()) + positions))
        return found

    def _dead_head(self, first_gradient: tuple | None, forward: list[tuple], order: list,
                   looped: dict, whole: tuple[int, ...], given: EndStacks | None
                   ) -> tuple[str, str, str] | None:
        """Under ``jax.grad`` of a loss linear in the head (a critic's mean score) the
        head's forward matmul is dead, removed, and its backward dots run first in the
        gradient program: their stack, whose source line no forward op has, reading a
        weight no forward matrix op reads, is the last end (the forward's last op was
        taken for it, and the head's gradients went fp8).
        None otherwise, and for a backward program split from its forward (``given``)."""
        if first_gradient is None or not forward or given:
            return None
        key, op, kind = first_gradient
        site = self.site(op, kind, key[2])
        stack = _stack_key(site, op, kind)
        lines = {_innermost(_stack_key(self.site(o, k, at[2]), o, k))[2]
                 for at, o, k in forward}
        # A line of the user's (a linalg solve's backward dots have none)...
        if (site.source is None or _innermost(stack)[2] in lines
                or len(looped.get(key, ())) != len(whole)):
            return None
        # ...whose dots read a forward value no forward matrix op reads: the dead head's
        # weight (an argument, a constant, a scaled or tied one) or input. A custom_vjp's
        # backward dots on lines of their own read the live head's operands.
        read = set().union(*(self._bases(o, at[3]) for at, o, _ in forward))
        head = [(at, o) for at, o, k in order
                if _stack_key(self.site(o, k, at[2]), o, k) == stack]
        if not any(_forward_value(base)
                   for at, o in head for base in self._bases(o, at[3]) - read):
            return None
        return stack

    def _bases(self, op: Any, path: CallPath) -> set[Any]:
        """``_operand_bases`` of ``op`` in the function instance ``path`` reaches, each
        argument of a called function followed to the operand its call passes (a
        ``jax.jit`` layer called per layer: its forward and the backward function its
        transpose calls read the caller's x and W through their own arguments)."""
        found = set()
        for value in _operand_bases(op):
            at = path
            while at and isinstance(value, ir.BlockArgument):
                function = value.owner.owner
                if function.operation.name != "func.func":  # a loop's or branch's
                    break
                caller, index = at[-1]
                call = self.ops_of(self.by_name[caller])[index][0]
                if call.name != "func.call" or value.arg_number >= len(call.operands):
                    break
                value, at = _base(call.operands[value.arg_number]), at[:-1]
            found.add(value)
        return found

    def _reads_invariant(self, key: tuple[str, int, str, CallPath], op: Any) -> bool:
        """Whether a matrix op (``key``: its function, index, prefix and call path) reads
        a value the loops around it do not change and no weight they pick: a stem's or
        a head's, not a scanned layer's (a slice of a stack, different at every
        iteration, read as a weight, whatever the other operand is; a step's input the
        loop picks, a teacher-forced token's embedding, is read as an activation)."""
        memo: dict[tuple[Any, ...], str] = {}
        origins = [self._origin(value, key[3], (), memo) for value in list(op.operands)[:2]]
        return _INVARIANT in origins and not any(
            origin == _PICKED and _read_as_weight(op, side)
            for side, origin in enumerate(origins))

    def _origin(self, value: Any, path: CallPath, entered: tuple[Any, ...],
                memo: dict[tuple[Any, ...], str], depth: int = 0) -> str:
        """What ``value`` is made from across the loops around it: ``_INVARIANT`` (the
        program's arguments and constants, through loop carries passed on unchanged,
        calls, data movement and arithmetic: a padded head's slice, a tied embedding's
        transpose, a dequantised weight), ``_PICKED`` (a slice such a value's stack
        gives at an index: a scanned layer's weight) or ``_COMPUTED``. ``path``: the
        calls from the program down to ``value``'s function; ``entered``: calls whose
        results were followed into their callees; ``memo``: the answers so far (a value
        read on several paths, ``z * z + z``, is walked once)."""
        key = (value, path, entered)
        if key not in memo:
            memo[key] = self._origin_of(value, path, entered, memo, depth)
        return memo[key]

    def _origin_of(self, value: Any, path: CallPath, entered: tuple[Any, ...],
                   memo: dict[tuple[Any, ...], str], depth: int) -> str:
        """``_origin`` without the memo."""
        if depth > 24:
            return _COMPUTED
        if isinstance(value, ir.BlockArgument):
            owner = value.owner.owner.operation
            if owner.name == "stablehlo.while":
                # A carry, read in the body or the condition: the body's result for it.
                body = loop_body(owner)
                if terminator(body).operands[value.arg_number] != body.arguments[
                        value.arg_number]:
                    return _COMPUTED  # a carry the loop changes
                return self._origin(owner.operands[value.arg_number], path, entered, memo,
                                    depth + 1)
            if owner.name != "func.func":
                return _COMPUTED
            source = self._argument_source(value, path, entered)
            if source is None:
                return _INVARIANT  # the program's own argument
            return self._origin(*source, memo, depth + 1)
        op = value.owner
        name = op.name
        if name in ("stablehlo.constant", "stablehlo.iota"):
            return _INVARIANT
        if name in MATRIX_OP_KINDS or name in ("stablehlo.while", "stablehlo.case"):
            return _COMPUTED
        if name in BODY_ATTRIBUTE:  # a call, or a composite's decomposition
            returned = self._returned(op, value)
            if returned is None:
                return _COMPUTED
            return self._origin(returned, path, entered + (op,), memo, depth + 1)
        origins = []
        for operand in op.operands:
            if float_bits(element_type(operand)):
                origins.append(self._origin(operand, path, entered, memo, depth + 1))
                if origins[-1] == _COMPUTED:
                    return _COMPUTED
        if name in ("stablehlo.dynamic_slice", "stablehlo.gather") and origins == [_INVARIANT]:
            # A slice a loop's counter picks is a layer's; one a value the program
            # computes picks (a token's embedding row) is an activation.
            indices = [v for v in op.operands if not float_bits(element_type(v))]
            if any(self._read_from_floats(v, path, entered, set()) for v in indices):
                return _COMPUTED
            return _PICKED
        if _COMPUTED in origins or not origins:
            return _COMPUTED
        return _PICKED if _PICKED in origins else _INVARIANT

    def _read_from_floats(self, value: Any, path: CallPath, entered: tuple[Any, ...],
                          seen: set[Any], depth: int = 0) -> bool:
        """Whether the integer ``value`` (an index) is made from a float value: a token
        a generation loop took from its logits, not a loop counter (through the loops
        that carry it: their body's result for it, and their operand)."""
        if depth > 24 or value in seen:
            return depth > 24
        seen.add(value)
        if float_bits(element_type(value)):
            return True
        if isinstance(value, ir.BlockArgument):
            owner = value.owner.owner.operation
            if owner.name == "stablehlo.while":  # the body's result for it, in either region
                return any(self._read_from_floats(v, path, entered, seen, depth + 1) for v in (
                    owner.operands[value.arg_number],
                    terminator(loop_body(owner)).operands[value.arg_number]))
            source = (self._argument_source(value, path, entered)
                      if owner.name == "func.func" else None)
            return source is not None and self._read_from_floats(*source, seen, depth + 1)
        op = value.owner
        if op.name in BODY_ATTRIBUTE:
            returned = self._returned(op, value)
            return returned is None or self._read_from_floats(
                returned, path, entered + (op,), seen, depth + 1)
        return any(self._read_from_floats(v, path, entered, seen, depth + 1)
                   for v in op.operands)

    def _argument_source(self, argument: Any, path: CallPath, entered: tuple[Any, ...]
                         ) -> tuple[Any, CallPath, tuple[Any, ...]] | None:
        """What a function's ``argument`` is at the call that reached it (the last of
        ``entered``, else the last of ``path``), with the calls left: (value, path,
        entered); None for an argument of the program itself."""
        if entered:
            return entered[-1].operands[argument.arg_number], path, entered[:-1]
        if not path:
            return None
        caller, index = path[-1]
        call = self.ops_of(self.by_name[caller])[index][0]
        return call.operands[argument.arg_number], path[:-1], ()

    def _returned(self, call: Any, result: Any) -> Any | None:
        """What the function a call or composite runs returns for its ``result``; None
        for a function without a body."""
        callee = self.by_name.get(body_name(call))
        if callee is None or not callee.regions[0].blocks:
            return None
        return terminator(callee.regions[0].blocks[0]).operands[
            ir.OpResult(result).result_number]

    def _program_order(self, name: str, prefix: str,
                       out: list[tuple[tuple[str, int, str, CallPath], Any, str]],
                       stack: tuple[str, ...],
                       looped: dict[tuple[str, int, str, CallPath], tuple[int, ...]],
                       loops: tuple[int, ...] = (), path: CallPath = ()) -> None:
        """Matrix ops in program order into ``out``, keyed by function, index, prefix
        and call path (a function called twice at one scope has each call's ops); for
        those that run inside loops (while bodies, or a function called from one), the
        loops around them, outermost first, into ``looped``."""
        for index, (op, kind) in enumerate(self.ops_of(self.by_name[name])):
            around = loops + enclosing_loops(op)
            if kind is not None:
                out.append(((name, index, prefix, path), op, kind))
                if around:
                    looped[(name, index, prefix, path)] = around
            elif body_name(op) in self.by_name and body_name(op) not in stack:
                self._program_order(body_name(op), self._callee_prefix(prefix, op), out,
                                    stack + (name,), looped, around, path + ((name, index),))

    def _instantiate(self, original: str) -> str:
        if original not in self.used_names:
            self.used_names.add(original)
            return original
        name = function_name(clone_private(self.by_name[original], "amp", self.by_name))
        self.origin[name] = original
        self.used_names.add(name)
        self.clones += 1
        return name


def end_stacks(module: ir.Module, policy: Policy) -> EndStacks:
    """The first and last matrix ops of ``module`` (a forward program, not yet
    rewritten) as their backward ops will know them: what ``mark_backward_program``
    hands to the backward program split from it."""
    if (policy.first_matrix_op, policy.last_matrix_op) == (None, None):
        return {}
    graph = CallGraph(policy)
    for fn in functions(module):
        graph.by_name[function_name(fn)] = fn
    return graph.find_ends([fn for fn in functions(module) if is_public(fn)])


def _common_prefix(tuples: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The longest tuple every one of ``tuples`` starts with (() for none)."""
    if not tuples:
        return ()
    shortest = min(tuples, key=len)
    for length in range(len(shortest), -1, -1):
        if all(t[:length] == shortest[:length] for t in tuples):
            return shortest[:length]
    return ()


def _forward_value(value: Any) -> bool:
    """Whether ``value`` is an argument or made by an op of the forward pass (not from a
    cotangent, which the backward pass's ops make)."""
    return isinstance(value, ir.BlockArgument) or not in_backward_pass(value.owner)


def _operand_bases(op: Any) -> set[Any]:
    """``op``'s matrix operands before transposes, converts, reshapes, broadcasts and
    optimization barriers (jax.checkpoint's: its recomputed forward and the backward
    read the forward's values through one)."""
    return {_base(value) for value in list(op.operands)[:2]}


def _base(value: Any) -> Any:
    """``value`` before transposes, converts, reshapes, broadcasts, barriers and a
    select of it against zeros (ragged_dot's dW on CPU masks x per group)."""
    for _step in range(8):
        if isinstance(value, ir.BlockArgument):
            break
        if value.owner.name == "stablehlo.optimization_barrier":
            value = value.owner.operands[ir.OpResult(value).result_number]
            continue
        if value.owner.name == "stablehlo.select":
            kept = [v for v in list(value.owner.operands)[1:] if not is_zero_constant(v)]
            if len(kept) != 1:
                break
            value = kept[0]
            continue
        if value.owner.name not in SAME_VALUE_OPS:
            break
        value = value.owner.operands[0]
    return value


def _is_given_end(given: EndStacks, position: str, stack: tuple[str, str, str]) -> bool:
    """Whether an op of ``stack`` may be the end ``position`` of a forward whose ends
    ``given`` holds: the end's stack, or it within a checkpointed call; any op where
    ``given`` holds no stack for that end (one it could not tell apart)."""
    ends = [end for end, positions in given.items() if position in positions]
    return not ends or any(_recomputes(end, stack) for end in ends)


def _recomputes(end: tuple[str, str, str], stack: tuple[str, str, str]) -> bool:
    """Whether an op of ``stack`` is the end of ``end``'s stack or its recomputation, its
    backward, within a checkpointed call (whose frames the forward's stack lacks)."""
    return end == stack or (end[:2] == stack[:2] and _frames(end[2])[:1] == _frames(
        stack[2])[:1] and _within(end, stack))


def _innermost(stack: tuple[str, str, str]) -> tuple[str, str, str]:
    """``stack`` with its location's innermost frame alone."""
    scope, kind, location = stack
    at = location.find(" at ")
    return scope, kind, location if at < 0 else location[:at]


def _within(end: tuple[str, str, str], stack: tuple[str, str, str]) -> bool:
    """Whether ``end``'s call frames are ``stack``'s with some left out, in order: the
    frame of a checkpointed call, which the forward's location lacks. (A helper's
    matrix op called from another line has another frame, not one more.)"""
    frames = iter(_frames(stack[2]))
    return all(any(frame == other for other in frames) for frame in _frames(end[2]))


def _frames(location: str) -> list[str]:
    """A location's call frames, innermost first, without the ``loc(callsite(`` and
    the closing parentheses their nesting adds."""
    # (a recomputed op's location nests its inner frames once more: callsite(callsite(")
    return [re.sub(r"^(loc\()?(callsite\()*", "", frame).rstrip(")")
            for frame in location.split(" at ")]


def _stack_key(site: Site, op: Any, kind: str) -> tuple[str, str, str]:
    """What a forward op shares with its backward ops: scope, kind and the source call
    stack of its location (JAX gives a transposed op its primal's stack)."""
    location = op.location
    stack = str(location.child_loc) if isinstance(location, ir.NameLoc) else str(location)
    return site.scope_path, kind, stack


# What a matrix op's operand is made from across the loops around it (CallGraph._origin).
_INVARIANT, _PICKED, _COMPUTED = "invariant", "picked", "computed"

def _read_as_weight(op: Any, side: int) -> bool:
    """Whether matrix op ``op`` reads operand ``side`` as a layer reads its weight: a
    convolution's filter, or a dot operand contracted along its leading dimensions (its
    rows) without batch dimensions; an activation is contracted along its features."""
    if op.name != "stablehlo.dot_general":
        return side == 1
    layout = dot_layout(op)
    return (layout is not None and not layout.batch(side)
            and layout.contracts_edge(side, leading=True))


# The note of an op inside a loop whose trip count could not be read (a while_loop, a
# fori_loop with traced bounds): its FLOPs count that loop once.
UNKNOWN_TRIPS = ("trip count of an enclosing while loop unknown: FLOPs count one "
                 "iteration of it")
