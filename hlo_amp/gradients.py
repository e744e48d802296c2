"""Which values of a lowered train step carry the incoming gradient (the cotangent).

The fp8 recipe quantises the operand of a backward dot that carries the gradient to
e5m2 (more range) and the other operand, a forward value, to e4m3fn (more precision).
JAX's name stack says which *ops* belong to the backward pass (``transpose(...)``), not
which *operand* of a backward dot is the gradient, so this follows the dataflow.

Every value gets one of three kinds, in program order:

- CONST: constants, iota, and what is computed from them alone (outside the backward);
  and every value that is not a float tensor (loop counters, indices, masks);
- GRAD: a result of an op with a GRAD operand (but an add or subtract outside the
  backward pass of a GRAD and a PRIMAL value, a training step's ``p - lr * g``, is
  PRIMAL: the next step's parameters), or of a backward op (its name stack has
  ``transpose(...)``) none of whose operands is PRIMAL -- the seed cotangent JAX starts
  the backward pass from (``broadcast(1.0)``, ``1/n`` of a mean) and the zeros it
  accumulates into (not a backward op of a constant holding data, a custom_vjp's
  transpose of a constant residual; not the constants of remat's recomputed forward,
  named ``remat2``; and a constant is judged by its own name: jax.export leaves some
  unnamed, and under a backward call site's prefix they would read as the seed);
- PRIMAL: everything else: the function's arguments, forward results, and backward ops
  computing from forward values only. (An argument marked ``hlo_amp.incoming_gradient``,
  a cotangent of a backward program split from its forward, is GRAD:
  ir/program_hints.py.)

A backward dot's incoming gradient is first read off the structure: when one of its
operands (through converts, transposes, reshapes, reverses, an optimization barrier and a
private function's one call) is a residual and the other is not, the other is the
gradient. A residual is a value a forward matrix op reads (dW = x^T dy reads the
forward's x, dx = dy W^T its W) -- but not a value the backward computed (a cotangent a
K-FAC statistic d.T @ d reads) unless the dot's other operand is one too (a learned
optimizer's network reading a gradient, under its own transposes) -- or what the
backward computes from residuals and constants alone (a forward a custom_vjp's bwd
recomputes with jax.vjp, a residual it scales). That finds a seed the kinds cannot see
(the loss times a loss scale, an argument; a vjp's cotangent argument) and sees past a
wrong one (a constant factor in a custom bwd is a backward op of a constant); such a
gradient operand is made GRAD and the flow run again from it, so the backward dots it
reaches in loops and callees (whose residuals are other values) find it too. Else the
dot's gradient is its one GRAD operand; with none or two (remat's recomputed forward, a
backward program split from its forward without hints, a dot whose forward is dead code
under a loss scale) there is no single gradient operand and the caller treats the dot
like a forward one.

Ops inside remat's ``rematted_computation`` are the forward recomputed, so they do not count as backward.
``optimization_barrier`` passes each operand's kind to the result at its position; a
while loop's carry (body argument and result) gets the kind of its initial value joined
with the kind the body returns at its position (GRAD beats PRIMAL beats CONST), a carry
the body returns unchanged its initial value's alone; a
private function runs once per tuple of argument kinds its call sites pass (a context),
each call's results getting the kinds its own context returns, and a value in it the
join over its contexts. The whole is iterated until nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import (
    callee_name,
    defining_op,
    dense_value,
    element_type,
    from_constant,
    function_name,
    is_kernel_matmul,
    is_zero_constant,
    terminator,
    walk_operations,
)
from hlo_amp.ir.op_classes import MATRIX_OP_NAMES
from hlo_amp.ir.program_hints import gradient_arguments
from hlo_amp.ir.sites import RECOMPUTED, join_names, location_name, parse_name

CONST, PRIMAL, GRAD = 0, 1, 2
_NO_OPERANDS_CONST = frozenset({"stablehlo.constant", "stablehlo.iota"})
_PER_POSITION = frozenset({"stablehlo.optimization_barrier", "stablehlo.while"})
_RETURNS = frozenset({"func.return"})
_UPDATES = frozenset({"stablehlo.add", "stablehlo.subtract"})
_MAX_ROUNDS = 10
_BARRIER = "stablehlo.optimization_barrier"
_MANUAL = "sdy.manual_computation"  # a shard_map body, per position as a call
_MAX_SOURCE_STEPS = 64  # layout ops and calls followed back from a dot's operand
# Ops that hand a value on in another layout or type: a residual a backward dot reads
# through them (b.T, a convolution's reversed kernel) is still the forward's operand.
_LAYOUT_OPS = frozenset({"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape",
                         "stablehlo.reverse", "stablehlo.bitcast_convert"})
_REMAT_PRIMITIVE = "remat2"  # jax's checkpoint primitive (ad_checkpoint.remat_p)


@functools.lru_cache(maxsize=8192)
def _is_backward(name: str) -> bool:
    # jax's remat lowering names the constants of the recomputed forward after its
    # primitive ("remat2"), without "rematted_computation": they are forward values too.
    # jax 0.11 lowers that recomputation in the loop body, where their own name carries
    # the backward's "transpose(...)".
    return (parse_name(name).backward and RECOMPUTED not in name
            and _REMAT_PRIMITIVE not in name.split("/"))


def _name(prefix: str, own: str, operand_kinds: list[int]) -> str:
    """The name an op is judged backward by: under its call site's prefix, but a
    constant (no operands) by its own name only. jax.export leaves some constants of a
    private function unnamed (remat's recomputed forward's, in a function the backward
    calls): under the prefix they would read as the backward's seed."""
    return join_names(prefix, own) if operand_kinds else own


def _holds_data(constant: ir.Operation) -> bool:
    """Whether a ``stablehlo.constant`` holds more than one number."""
    read = dense_value(constant)
    return read is None or not read.is_splat


def _is_float(value: ir.Value, cache: dict[ir.Type, bool]) -> bool:
    """Whether ``value`` is a float tensor (only those carry a gradient)."""
    found = cache.get(value.type)
    if found is None:
        found = cache[value.type] = isinstance(element_type(value), ir.FloatType)
    return found


def _contexts(calls: dict[str, set[tuple[int, ...]]],
              fn: Any) -> list[tuple[int, ...] | None]:
    """The argument kinds ``fn`` is run with: one tuple per context its call sites
    pass, or None (not called: a public function)."""
    found = calls.get(function_name(fn))
    return sorted(found) if found else [None]


class GradientFlow:
    """The kind (CONST, PRIMAL, GRAD) of every value of the given function bodies."""

    def __init__(self, bodies: Sequence[tuple[Any, str]]) -> None:
        """``bodies``: (func.func, call-site prefix) pairs, callers before callees."""
        self._floats: dict[ir.Type, bool] = {}
        # The values forward matrix ops read (seen through layout ops): a backward dot's
        # operand among them is a residual, so the other one is the gradient.
        self._forward_operands: set[ir.Value] = set()
        # Values the backward pass computed: one a later forward op reads (a K-FAC
        # statistic d.T @ d of a cotangent) is no residual to a backward dot whose other
        # operand the backward did not compute (dW = d^T h reads the forward's h); a
        # gradient a forward network reads (a learned optimizer's) is one to that
        # network's transposes (their other operand is its dY, a cotangent).
        self._backward_values: set[ir.Value] = set()
        self._derived: set[ir.Value] = set()  # residuals the backward computes from some
        # A private function called once: its arguments are that call's operands (jax
        # lowers a nested jax.jit to one, its forward and backward calls apart).
        self._entry_blocks: dict[ir.Block, Any] = {}
        # Each body walked once, in program order: here and by every round of the flow.
        self._walked = [walk_operations(fn) for fn, _prefix in bodies]
        calls: dict[str, list[Any]] = {}
        backward_dots: list[Any] = []
        backward_ops: list[Any] = []  # in program order
        forward_reads: list[ir.Value] = []
        for (fn, prefix), ops in zip(bodies, self._walked):
            self._entry_blocks[fn.regions[0].blocks[0]] = fn
            for op in ops:
                if op.name == "func.call":
                    calls.setdefault(callee_name(op), []).append(op)
                backward = _is_backward(join_names(prefix, location_name(op.location)))
                if backward:
                    backward_ops.append(op)
                    self._backward_values.update(op.results)
                if op.name not in MATRIX_OP_NAMES or is_kernel_matmul(op):
                    continue  # a spliced kernel's matmuls are no program's (cuDNN's call)
                if backward:
                    backward_dots.append(op)
                else:
                    forward_reads.extend(list(op.operands)[:2])
        self._only_call = {name: found[0] for name, found in calls.items()
                           if len(found) == 1}
        # Sources once every call is known (a callee's argument is its one call's operand).
        self._forward_operands.update(self._source(v) for v in forward_reads)
        # What the backward computes from residuals alone (with constants): a forward
        # the program recomputes there (a custom_vjp whose bwd runs jax.vjp of its
        # forward), a residual it scales (w * 0.5): residuals too, not the gradient of
        # the dot beside them.
        # Strictly: not from a cotangent a forward op reads, and a matrix op from no
        # constant (the seed's broadcast 1.0 @ W^T, or times a residual, is a gradient).
        for op in backward_ops:
            if len(op.results) != 1 or not len(op.operands):
                continue
            sources = [self._source(v) for v in op.operands]
            residual = [v in self._derived or (
                v in self._forward_operands and v not in self._backward_values)
                for v in sources]
            if all(residual) if op.name in MATRIX_OP_NAMES else any(residual) and all(
                    r or from_constant(v) for v, r in zip(sources, residual)):
                self._derived.add(op.results[0])
        # A seed cotangent the dataflow cannot see (a primal value: the loss times a
        # loss scale, a vjp's cotangent argument) leaves a backward dot without a
        # gradient operand; the operand the structure names is one, and the flow is run
        # again from it (it reaches the backward dots in loops and callees).
        seeds: set[ir.Value] = set()
        for _ in range(_MAX_ROUNDS):
            self.kinds = self._flow(bodies, seeds)
            found = {op.operands[index] for op in backward_dots
                     if GRAD not in (self.kind(v) for v in list(op.operands)[:2])
                     and (index := self._residual_partner(op)) is not None}
            if found <= seeds:
                break
            seeds |= found

    def _source(self, value: ir.Value) -> ir.Value:
        """``value`` before the layout ops (_LAYOUT_OPS) that made it and the one call
        that passed it to a private function."""
        for _ in range(_MAX_SOURCE_STEPS):
            op = defining_op(value)
            if op is not None:
                if op.name == _BARRIER:  # each operand to the result at its position
                    value = op.operands[ir.OpResult(value).result_number]
                    continue
                if op.name == _MANUAL:  # a shard_map's result: what its body returns
                    value = terminator(op.regions[0].blocks[0]).operands[
                        ir.OpResult(value).result_number]
                    continue
                if op.name not in _LAYOUT_OPS:
                    return value
                value = op.operands[0]
                continue
            block = value.owner
            holder = block.owner
            if holder is not None and holder.operation.name == _MANUAL:
                value = holder.operands[ir.BlockArgument(value).arg_number]
                continue
            fn = self._entry_blocks.get(block)
            call = fn is not None and self._only_call.get(function_name(fn))
            if not call:
                return value
            value = call.operands[value.arg_number]
        return value

    def _is_residual(self, source: ir.Value, partner: ir.Value | None = None) -> bool:
        """Whether ``source`` is a residual (to a backward dot whose other operand is
        ``partner``)."""
        if source in self._derived:
            return True
        if source not in self._forward_operands:
            return False
        return (source not in self._backward_values or partner is None
                or self._source(partner) in self._backward_values)

    def _residual_partner(self, op: Any) -> int | None:
        """The index of the operand of a backward dot that is not a residual, when the
        other one is (a value a forward matrix op reads) and it is not."""
        operands = list(op.operands)[:2]
        if len(operands) != 2:
            return None
        forward = [self._is_residual(self._source(v), operands[1 - i])
                   for i, v in enumerate(operands)]
        return forward.index(False) if forward.count(True) == 1 else None

    def _flow(self, bodies: Sequence[tuple[Any, str]],
              seeds: set[ir.Value]) -> dict[ir.Value, int]:
        """Every value's kind, ``seeds`` GRAD wherever they are computed."""
        kinds: dict[ir.Value, int] = {}
        # A private function is run once per distinct tuple of argument kinds its call
        # sites pass (a context), and each call's results get the returns of its own
        # context: jax shares one private function between unrelated call sites when
        # their signatures match (dynamic_update_index_in_dim stacking forward residuals
        # and the backward's dW, for one), and a join over all of them would make the
        # forward call's results GRAD.
        calls: dict[str, set[tuple[int, ...]]] = {}
        returns: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
        states: dict[tuple[int, tuple[int, ...] | None], dict[ir.Value, int]] = {}
        for _ in range(_MAX_ROUNDS):
            changed = False
            seen_calls: dict[str, set[tuple[int, ...]]] = {}
            seen_returns: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
            for index, (fn, prefix) in enumerate(bodies):
                for given in _contexts(calls, fn):
                    state = states.setdefault((index, given), {})
                    before = dict(state)
                    self._run(fn, self._walked[index], prefix, given, state, returns,
                              seen_calls, seen_returns, seeds)
                    changed = changed or before != state
            if not changed and seen_calls == calls and seen_returns == returns:
                break
            calls, returns = seen_calls, seen_returns
        # A value's kind: joined over the contexts its function is called in.
        for index, (fn, _prefix) in enumerate(bodies):
            for given in _contexts(calls, fn):
                for value, kind in states.get((index, given), {}).items():
                    kinds[value] = max(kinds.get(value, CONST), kind)
        return kinds

    def kind(self, value: ir.Value) -> int:
        return self.kinds.get(value, PRIMAL)

    def incoming_gradient(self, op: Any) -> int | None:
        """The index (0 or 1) of the one operand of ``op`` that carries the gradient:
        the one that is not a residual when the other is, else the one GRAD operand."""
        partner = self._residual_partner(op)
        if partner is not None:
            return partner
        kinds = [self.kind(v) for v in list(op.operands)[:2]]
        return kinds.index(GRAD) if kinds.count(GRAD) == 1 else None

    def _run(self, fn: Any, ops: list[Any], prefix: str, given: tuple[int, ...] | None,
             kinds: dict[ir.Value, int],
             returns: dict[tuple[str, tuple[int, ...]], tuple[int, ...]],
             seen_calls: dict[str, set[tuple[int, ...]]],
             seen_returns: dict[tuple[str, tuple[int, ...]], tuple[int, ...]],
             seeds: set[ir.Value]) -> None:
        floats = self._floats
        name = function_name(fn)

        def settle(result: ir.Value, kind: int) -> None:
            kinds[result] = (GRAD if result in seeds else kind) if _is_float(
                result, floats) else CONST

        # Constants holding data (not one number: not a seed's 1.0 or zeros; an iota),
        # and what is computed from them alone, through calls and loop carries too: a
        # backward op reading one (a custom_vjp's transpose of a constant residual, a
        # slice of a closed-over batch or a positional table an unrolled scan's backward
        # loop reads) is not the seed.
        data: set[ir.Value] = set()
        # A backward program split from its forward: its cotangent arguments carry the
        # incoming gradient (ir/program_hints.py).
        cotangents = gradient_arguments(fn)
        for index, argument in enumerate(fn.regions[0].blocks[0].arguments):
            kinds[argument] = given[index] if given and index < len(given) else PRIMAL
            if index in cotangents or argument in seeds:
                kinds[argument] = GRAD
            if not _is_float(argument, floats):
                kinds[argument] = CONST
        for op in ops:
            op_name = op.name
            operand_kinds = [kinds.get(v, PRIMAL) for v in op.operands]
            if op_name in _RETURNS:  # only a function's own body ends in func.return
                seen_returns[(name, given)] = tuple(operand_kinds)
                continue
            if op_name == "func.call":
                callee = callee_name(op)
                context = tuple(operand_kinds)
                seen_calls.setdefault(callee, set()).add(context)
                known = returns.get((callee, context))
                if known is not None and len(known) == len(op.results):
                    for result, kind in zip(op.results, known):
                        settle(result, kind)
                    if any(v in data for v in op.operands):
                        data.update(r for r in op.results if kinds[r] == CONST)
                    continue
            results = op.results
            if op_name == _MANUAL:
                # A shard_map body: its arguments are the op's operands, its results what
                # the body returns (read from the last round: the body is walked after).
                for position, argument in enumerate(op.regions[0].blocks[0].arguments):
                    settle(argument, operand_kinds[position]
                           if position < len(operand_kinds) else PRIMAL)
                returned = terminator(op.regions[0].blocks[0]).operands
                for position, result in enumerate(results):
                    settle(result, kinds.get(returned[position], PRIMAL)
                           if position < len(returned) else PRIMAL)
                continue
            if not len(results) and op_name != "stablehlo.while":
                continue
            if op_name in _PER_POSITION:
                if op_name == "stablehlo.while":  # join with what the body returned
                    body = op.regions[1].blocks[0]
                    returned = terminator(body).operands
                    # A carry the body returns as it got it (scan's stacked residuals
                    # in its backward loop) keeps its initial value's kind: joined with
                    # itself, a kind the first round guessed (a stack built by a loop
                    # whose returns were not known yet reads as a constant, and the
                    # backward's reshape of it as the seed) would stay for good.
                    operand_kinds = [max(kind, kinds.get(returned[position], CONST))
                                     if position < len(returned)
                                     and returned[position] != body.arguments[position]
                                     else kind
                                     for position, kind in enumerate(operand_kinds)]
                    for region in op.regions:
                        for block in region.blocks:
                            for position, argument in enumerate(block.arguments):
                                kinds[argument] = (operand_kinds[position]
                                                   if position < len(operand_kinds)
                                                   and _is_float(argument, floats)
                                                   else CONST)
                                if (kinds[argument] == CONST and position < len(op.operands)
                                        and op.operands[position] in data):
                                    data.add(argument)
                for position, result in enumerate(results):
                    settle(result, operand_kinds[position]
                           if position < len(operand_kinds) else CONST)
                    if kinds[result] == CONST and op.operands[position] in data:
                        data.add(result)
                continue
            if (op_name == "stablehlo.select" and PRIMAL in operand_kinds[1:]
                    and any(is_zero_constant(v) for v in op.operands[1:])):
                # where(mask, x, 0) of a forward value in the backward pass (ragged_dot's
                # dW masks x per group): the backward's zeros are GRAD, and x with them
                # was, so both of dW's operands were.
                kind = PRIMAL
            elif (op_name in _UPDATES and GRAD in operand_kinds and PRIMAL in operand_kinds
                    and not _is_backward(_name(prefix, location_name(op.location),
                                               operand_kinds))):
                # A training step's update outside the backward pass, p - lr * g: the
                # next step's parameters, no gradient (GRAD, they made every later
                # backward dot's two operands GRAD, and both e4m3fn).
                kind = PRIMAL
            elif GRAD in operand_kinds:
                kind = GRAD
            elif PRIMAL not in operand_kinds and not any(
                    v in data for v in op.operands) and _is_backward(
                    _name(prefix, location_name(op.location), operand_kinds)):
                kind = GRAD  # the seed cotangent, or zeros the backward accumulates into
            elif not operand_kinds or op_name in _NO_OPERANDS_CONST or (
                    PRIMAL not in operand_kinds):
                kind = CONST
            else:
                kind = PRIMAL
            if kind == CONST and (any(v in data for v in op.operands) or (
                    op_name == "stablehlo.constant" and _holds_data(op))
                    or op_name == "stablehlo.iota"):
                data.update(results)
            for result in results:
                settle(result, kind)
