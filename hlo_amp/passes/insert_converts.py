"""The core rewrite: run dot/conv ops in the policy's precision with f32 accumulation.

For every ``stablehlo.dot_general``, ``stablehlo.dot`` and ``stablehlo.convolution``
the policy decides an action from the op's Site:

- ``compute``: convert each float operand wider than the compute dtype to it and keep
  the result type, so the op accumulates in (and returns) f32.
- a dtype: convert operands and result to that dtype, then convert the result back, so
  consumers see the type the program wrote.
- ``keep`` or no rule: leave the op alone.
- ``float8_e4m3fn`` / ``float8_e5m2``: a ``dot_general`` that can run as XLA:GPU's fp8
  GEMM (`Target.fp8_obstacle`, hlo_amp/targets/fp8_gemm.py) is marked with its operand
  formats (attribute ``hlo_amp.fp8``) for the fp8 pass, which quantises the operands and
  writes the direct form (``dot_general(f8, f8)`` times the scale product); the report
  already shows the fp8 operand types. With ``float8_e5m2`` the operand of a
  backward dot that carries the incoming gradient (hlo_amp/gradients.py) is e5m2, the
  rest e4m3fn. Anything else under an fp8 action computes in the compute dtype, and the
  report says why.

The policy's ``first_matrix_op``/``last_matrix_op`` rules apply to the first and last
float matrix op of each public function's forward program, in program order (calls to
private functions followed), and to the backward ops with the same scope, op kind and
source call stack (their transposes).

Ops inside private functions are decided in the context of their call site; a function
called from sites that need different decisions is cloned per decision vector, so
nothing is decided once for all callers. Public signatures never change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from hlo_amp.gradients import GradientFlow
from hlo_amp.ir.loops import LoopCounts, Runs
from hlo_amp.ir.modules import (
    callee_name,
    clone_private,
    element_count,
    element_type,
    function_name,
    functions,
    is_public,
    live_uses,
    mark_decision,
    op_key,
    walk_operations,
    with_element,
)
from hlo_amp.ir.op_classes import MATRIX_OP_NAMES
from hlo_amp.ir.sites import (
    Site,
    asks_for_precision,
    call_prefix,
    join_names,
    location_name,
    operand_precisions,
    site_of,
)
from hlo_amp.policy import (
    COMPUTE,
    DTYPE_BITS,
    DTYPE_TO_ELEMENT,
    FIRST_MATRIX_OP,
    FP8_E5M2,
    FP8_SHORT,
    FP8_TO_ELEMENT,
    KEEP,
    LAST_MATRIX_OP,
    OP_KINDS,
    Policy,
    is_fp8,
)
from hlo_amp.report import Decision, Report
from hlo_amp.targets import NO_TARGET, Target
from hlo_amp.targets.fp8_gemm import FP8_FALLBACK, FP8_MARK, dequantized_format

# The candidate ops by name, with their policy op kind.
_MATRIX_OPS = {f"stablehlo.{kind}": kind for kind in OP_KINDS}
_CALL = "func.call"
_WATCHED = frozenset({*_MATRIX_OPS, _CALL})


def float_bits(element: ir.Type | None) -> int | None:
    """Bit width of a float element type; None for int, complex, bool, unranked."""
    if element is None or not isinstance(element, ir.FloatType):
        return None
    return ir.FloatType(element).width


def estimate_flops(op: Any, kind: str) -> int | None:
    """2 × multiply-adds of a dot or conv; None when a shape is dynamic."""
    result = ir.RankedTensorType(op.result.type)
    if not result.has_static_shape:
        return None
    out = 1
    for size in result.shape:
        out *= size
    lhs = ir.RankedTensorType(op.operands[0].type)
    rhs = ir.RankedTensorType(op.operands[1].type)
    if not (lhs.has_static_shape and rhs.has_static_shape):
        return None
    if kind == "dot_general":
        numbers = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        contracted = 1
        for dim in numbers.lhs_contracting_dimensions:
            contracted *= lhs.shape[dim]
        return 2 * out * contracted
    if kind == "dot":
        return 2 * out * (lhs.shape[-1] if lhs.rank else 1)
    numbers = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    kernel = 1
    for size in rhs.shape:
        kernel *= size
    out_features = rhs.shape[numbers.kernel_output_feature_dimension]
    return 2 * out * kernel // max(out_features, 1)


@dataclass(frozen=True)
class Plan:
    """The decision for one candidate op, before any IR is touched."""

    action: str | None
    rule: str
    operand_targets: tuple[str | None, ...]  # per operand: new element type or None
    result_target: str | None  # new result element type, or None to keep it
    reason: str
    # fp8: the (lhs, rhs) fp8 element types and the dequantise type D (the type the
    # scales are rounded to); the fp8 pass writes the quantisation and the direct-form
    # dot. None for every other plan.
    fp8: tuple[str, str, str] | None = None
    # An f32 dot kept f32 because the target runs it as one pass of this 16-bit element
    # type anyway (_left_to_the_target); comm_precision reads it (Decision.runs_as).
    runs_as: str | None = None


def plan_op(op: Any, kind: str, policy: Policy, action: str | None, rule: str,
            target: Target = NO_TARGET,
            elements: tuple[list[ir.Type | None], ir.Type | None] | None = None,
            gradient: int | None = None, backward: bool = False) -> Plan:
    """What to do to one op under ``action``, given its operand and result types
    (``elements``: the element types of its first two operands and of its result, when
    the caller has read them already). For fp8 actions, ``gradient`` is the operand that
    carries the incoming gradient of a ``backward`` dot (None: no single one)."""
    if elements is None:
        elements = ([element_type(v) for v in list(op.operands)[:2]],
                    element_type(op.result))
    if is_fp8(action):
        return _plan_fp8(op, kind, policy, action, rule, target, elements, gradient,
                         backward)
    operands, result = elements
    bits = [float_bits(t) for t in operands]
    result_bits = float_bits(result)
    none = (None,) * len(operands)
    if action is None:
        return Plan(action, rule, none, None, "no rule for this op kind")
    if action == KEEP:
        return Plan(action, rule, none, None, "kept as written")
    if any(b is None for b in bits) or result_bits is None:
        return Plan(action, rule, none, None, "not a float op")
    if action == COMPUTE:
        target_bits = DTYPE_BITS[policy.compute_dtype]
        if 64 in bits + [result_bits] and not policy.include_f64:
            return Plan(action, rule, none, None, "f64 op (not asked: include_f64)")
        targets = tuple(
            DTYPE_TO_ELEMENT[policy.compute_dtype] if b > target_bits else None for b in bits
        )
        compute = DTYPE_TO_ELEMENT[policy.compute_dtype]
        # In the mixed_* modes the propagation pass gives such ops their 16-bit result.
        result_target = (compute if target.low_result(kind) and not
                         policy.propagate and result_bits > target_bits else None)
        if all(t is None for t in targets) and result_target is None:
            return Plan(action, rule, none, None, "already low precision")
        slower = policy.only_if_faster and target.slower_in_16bit(op, kind,
                                                                  policy.compute_dtype)
        if slower:
            return Plan(action, rule, none, None, slower)
        if result_target is not None:
            return Plan(action, rule, targets, result_target,
                        f"{compute} operands and result (cuDNN's form), converted to "
                        f"{result}")
        return Plan(action, rule, targets, None, f"{compute} operands, {result} accumulation")
    element = DTYPE_TO_ELEMENT[action]
    targets = tuple(element if str(t) != element else None for t in operands)
    result_target = element if str(result) != element else None
    if all(t is None for t in targets) and result_target is None:
        return Plan(action, rule, none, None, f"already {action}")
    return Plan(action, rule, targets, result_target, f"forced to {action}")


_E4M3, _E5M2 = FP8_TO_ELEMENT["float8_e4m3fn"], FP8_TO_ELEMENT[FP8_E5M2]
# The reason of a dot whose operands already are fp8 (the direct form: the pipeline run on
# its own output), or dequantised fp8: nothing to do, but the report still shows the fp8
# types.
ALREADY_FP8 = "already fp8"


def _plan_fp8(op: Any, kind: str, policy: Policy, action: str, rule: str,
              target: Target, elements: tuple[list[ir.Type | None], ir.Type | None],
              gradient: int | None, backward: bool) -> Plan:
    """An fp8 plan for a dot that can run as an XLA:GPU fp8 GEMM; else the compute
    dtype's plan with the reason the dot cannot."""
    operands, result = elements
    none = (None,) * len(operands)
    bits = [float_bits(t) for t in operands]
    if any(b is None for b in bits) or float_bits(result) is None:
        return Plan(action, rule, none, None, "not a float op")
    already = tuple(dequantized_format(v) for v in list(op.operands)[:2])
    if kind == "dot_general" and all(already):
        return Plan(action, rule, none, None, ALREADY_FP8,
                    fp8=(already[0], already[1], str(operands[0])))
    obstacle = (f"fp8 takes dot_general only, not {kind}" if kind != "dot_general"
                else target.fp8_obstacle(op))
    if obstacle is not None:
        fallback = plan_op(op, kind, policy, COMPUTE, rule, target, elements)
        return dataclasses.replace(fallback, action=action,
                                   reason=f"{FP8_FALLBACK}: {obstacle}; {fallback.reason}")
    slower = policy.only_if_faster and target.fp8_slower()
    if slower:
        return Plan(action, rule, none, None, slower)
    formats = [_E4M3, _E4M3]
    how = ""
    if action == FP8_E5M2 and backward:
        if gradient is None:
            how = " (no single incoming-gradient operand found: e4m3fn for both)"
        else:
            formats[gradient] = _E5M2
            how = f" ({('lhs', 'rhs')[gradient]} is the incoming gradient)"
    # The dequantise type D: the type the scales are rounded to (Target.fp8_dequantize
    # says why, per target).
    result_name = str(result)
    dequantize = target.fp8_dequantize(result_name, policy.compute_dtype)
    return Plan(action, rule, none, None,
                f"fp8 {FP8_SHORT[formats[0]]} x {FP8_SHORT[formats[1]]}{how}, per-tensor "
                f"{dequantize} scales, {result_name} result",
                fp8=(formats[0], formats[1], dequantize))


class _TypeNames:
    """``str`` of element types, printed once per type (printing a type is slow)."""

    def __init__(self) -> None:
        self._names: dict[Any, str] = {}

    def name(self, element: ir.Type | None) -> str:
        found = self._names.get(element)
        if found is None:
            found = self._names[element] = str(element)
        return found


@dataclass
class _Instance:
    """One function body to rewrite, and the call-site name its ops are seen under."""

    fn: Any
    prefix: str


@dataclass
class _CallGraph:
    """Call-site contexts and the clones needed so each body has one decision vector."""

    policy: Policy
    by_name: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # clone name -> original
    memo: dict[tuple[str, tuple], str] = field(default_factory=dict)
    used_names: set[str] = field(default_factory=set)
    instances: list[_Instance] = field(default_factory=list)
    clones: int = 0
    signatures: dict[tuple[str, str], tuple] = field(default_factory=dict)
    # op_key of a function -> its matrix ops (with their kind) and calls (kind None), in
    # program order: one walk per function body, shared by both phases.
    watched: dict[int, list[tuple[Any, str | None]]] = field(default_factory=dict)
    sites: dict[tuple[Any, str, str], Site] = field(default_factory=dict)
    type_names: _TypeNames = field(default_factory=lambda: _TypeNames())
    # (original function name, index in ops_of, call-site prefix) -> first/last rules
    positions: dict[tuple[str, int, str], tuple[str, ...]] = field(default_factory=dict)
    loops: LoopCounts = field(default_factory=LoopCounts)
    # function name (after cloning) -> how often it runs per call of the program
    runs: dict[str, Runs] = field(default_factory=dict)

    def count_runs(self) -> None:
        """Fill ``runs`` for every instance: a public function runs once; a private one
        as often as all its call sites together, each its caller's runs times the trip
        counts of the loops around the call (after ``visit``: calls name the clones)."""
        callers: dict[str, list[tuple[str, Any]]] = {}
        for instance in self.instances:
            caller = function_name(instance.fn)
            for op, kind in self.ops_of(instance.fn):
                if kind is None and callee_name(op) in self.by_name:
                    callers.setdefault(callee_name(op), []).append((caller, op))
        for instance in self.instances:
            self._runs_of(function_name(instance.fn), callers, ())

    def _runs_of(self, name: str, callers: dict[str, list[tuple[str, Any]]],
                 stack: tuple[str, ...]) -> Runs:
        found = self.runs.get(name)
        if found is not None:
            return found
        sites = [] if is_public(self.by_name[name]) else callers.get(name, [])
        if not sites or name in stack:  # public (or a cycle, which JAX never writes)
            found = Runs(1)
        else:
            count, unknown = 0, 0
            for caller, call in sites:
                outer = self._runs_of(caller, callers, stack + (name,))
                here = self.loops.runs(call)
                count += outer.count * here.count
                unknown += outer.unknown + here.unknown
            found = Runs(count, unknown)
        self.runs[name] = found
        return found

    def ops_of(self, fn: Any) -> list[tuple[Any, str | None]]:
        """The matrix ops and calls of ``fn`` (walked once; the rewrite adds only
        converts, so the list stays good)."""
        found = self.watched.get(op_key(fn))
        if found is None:
            found = self.watched[op_key(fn)] = [
                (op, _MATRIX_OPS.get(op.name)) for op in walk_operations(fn, names=_WATCHED)]
        return found

    def site(self, op: Any, kind: str, prefix: str) -> Site:
        """``site_of`` an op, once per (location, kind, prefix): a private function's
        ops are decided twice (its signature, then its rewrite)."""
        key = (op.location, kind, prefix)
        found = self.sites.get(key)
        if found is None:
            found = self.sites[key] = site_of(key[0], kind, prefix)
        return found

    def signature(self, name: str, prefix: str) -> tuple:
        """The decisions a body would get under ``prefix``, nested calls included."""
        original = self.origin.get(name, name)
        known = self.signatures.get((original, prefix))
        if known is not None:
            return known
        fn = self.by_name[original]
        parts: list[Any] = []
        for index, (op, kind) in enumerate(self.ops_of(fn)):
            if kind is not None:
                site = self.site(op, kind, prefix)
                positions = self.positions.get((original, index, prefix), ())
                parts.append(self.policy.decide(site.scope, kind, site.backward, positions,
                                                asks_for_precision(op)).action)
            elif callee_name(op) in self.by_name:
                inner = callee_name(op)
                parts.append(self.signature(inner, self._callee_prefix(prefix, op)))
        self.signatures[(original, prefix)] = tuple(parts)
        return self.signatures[(original, prefix)]

    @staticmethod
    def _callee_prefix(prefix: str, call: Any) -> str:
        return call_prefix(join_names(prefix, location_name(call.location)))

    def visit(self, fn: Any, prefix: str) -> None:
        self.instances.append(_Instance(fn, prefix))
        for op, kind in self.ops_of(fn):
            if kind is not None or callee_name(op) not in self.by_name:
                continue
            name = callee_name(op)
            original = self.origin.get(name, name)
            callee_prefix = self._callee_prefix(prefix, op)
            key = (original, self.signature(original, callee_prefix))
            target = self.memo.get(key)
            if target is None:
                target = self._instantiate(original)
                self.memo[key] = target
                self.visit(self.by_name[target], callee_prefix)
            if target != name:
                op.attributes["callee"] = ir.FlatSymbolRefAttr.get(target, context=op.context)

    def find_ends(self, public: list[Any]) -> None:
        """Fill ``positions``: per public function, the first and last float matrix op
        of its forward program, and the backward ops with their scope, kind and source
        call stack (before any cloning: keys use original names)."""
        for fn in public:
            order: list[tuple[tuple[str, int, str], Any, str]] = []
            self._program_order(function_name(fn), "", order, ())
            forward = []
            for key, op, kind in order:
                if (not self.site(op, kind, key[2]).backward
                        and all(float_bits(element_type(v)) for v in list(op.operands)[:2])):
                    forward.append((key, op, kind))
            if not forward:
                continue
            stacks: dict[tuple[str, str, str], tuple[str, ...]] = {}
            for position, (key, op, kind) in ((FIRST_MATRIX_OP, forward[0]),
                                              (LAST_MATRIX_OP, forward[-1])):
                self.positions[key] = self.positions.get(key, ()) + (position,)
                stack = _stack_key(self.site(op, kind, key[2]), op, kind)
                stacks[stack] = stacks.get(stack, ()) + (position,)
            if len(stacks) == 1 and forward[0][0] != forward[-1][0]:
                continue  # first and last look alike: their backward ops cannot be told
            for key, op, kind in order:
                site = self.site(op, kind, key[2])
                found = stacks.get(_stack_key(site, op, kind)) if site.backward else None
                if found:
                    self.positions[key] = self.positions.get(key, ()) + found

    def _program_order(self, name: str, prefix: str,
                       out: list[tuple[tuple[str, int, str], Any, str]],
                       stack: tuple[str, ...]) -> None:
        for index, (op, kind) in enumerate(self.ops_of(self.by_name[name])):
            if kind is not None:
                out.append(((name, index, prefix), op, kind))
            elif callee_name(op) in self.by_name and callee_name(op) not in stack:
                self._program_order(callee_name(op), self._callee_prefix(prefix, op), out,
                                    stack + (name,))

    def _instantiate(self, original: str) -> str:
        if original not in self.used_names:
            self.used_names.add(original)
            return original
        name = function_name(clone_private(self.by_name[original], "amp", self.by_name))
        self.origin[name] = original
        self.used_names.add(name)
        self.clones += 1
        return name


def _stack_key(site: Site, op: Any, kind: str) -> tuple[str, str, str]:
    """What a forward op shares with its backward ops: scope, kind and the source call
    stack of its location (JAX gives a transposed op its primal's stack)."""
    location = op.location
    stack = str(location.child_loc) if isinstance(location, ir.NameLoc) else str(location)
    return site.scope_path, kind, stack


@dataclass(frozen=True)
class InsertConverts:
    """Insert ``stablehlo.convert`` around dot/conv ops as the policy decides."""

    policy: Policy
    target: Target = NO_TARGET  # its only_if_faster rule, 16-bit result and fp8 forms
    name: str = "hlo-amp-insert-converts"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        graph = _CallGraph(self.policy)
        for fn in functions(module):
            graph.by_name[function_name(fn)] = fn
        # Phase 1: contexts and clones, on pristine bodies (clones copy unrewritten IR).
        # A public function keeps its own (top-level) context; a call to one from
        # another function gets a private clone under the call site's context.
        public = [fn for fn in functions(module) if is_public(fn)]
        graph.used_names.update(function_name(fn) for fn in public)
        if (self.policy.first_matrix_op, self.policy.last_matrix_op) != (None, None):
            graph.find_ends(public)
        for fn in public:
            graph.visit(fn, "")
        if report is not None:
            graph.count_runs()
        # Which operand of a backward dot is the gradient: only e5m2 asks, and the
        # dataflow is read before any body is rewritten.
        flow = None
        if FP8_E5M2 in self.policy.actions:
            flow = GradientFlow([(i.fn, i.prefix) for i in graph.instances])
        # Phase 2: rewrite each body once, under its own context.
        for instance in graph.instances:
            self._rewrite_body(instance, graph, report, flow)
        if report is not None and graph.clones:
            report.notes.append(f"specialised {graph.clones} private function(s) per "
                                f"call-site decision")

    def _rewrite_body(self, instance: _Instance, graph: _CallGraph,
                      report: Report | None, flow: GradientFlow | None = None) -> None:
        fn_name = function_name(instance.fn)
        original = graph.origin.get(fn_name, fn_name)
        shared: dict[tuple[Any, Any, str], ir.Value] = {}
        names = graph.type_names
        for index, (op, kind) in enumerate(graph.ops_of(instance.fn)):
            if kind is None:
                continue
            site = graph.site(op, kind, instance.prefix)
            positions = graph.positions.get((original, index, instance.prefix), ())
            rule = self.policy.decide(site.scope, kind, site.backward, positions,
                                      asks_for_precision(op))
            elements = ([element_type(v) for v in list(op.operands)[:2]],
                        element_type(op.result))
            gradient = None
            if flow is not None and site.backward and rule.action == FP8_E5M2:
                gradient = flow.incoming_gradient(op)
            plan = plan_op(op, kind, self.policy, rule.action, rule.rule, self.target,
                           elements, gradient=gradient, backward=site.backward)
            if rule.reason is not None:
                plan = dataclasses.replace(plan, reason=rule.reason)
            plan = _left_to_the_target(op, kind, elements, plan, self.policy, self.target,
                                       names)
            plan = _kept_for_its_result(op, kind, elements, plan, self.policy, self.target,
                                        names)
            before = tuple(names.name(t) for t in elements[0])
            result_before = names.name(elements[1])
            changed = any(plan.operand_targets) or plan.result_target is not None
            after, result_after = before, result_before  # untouched unless changed
            if plan.fp8 is not None:  # the fp8 pass quantises; the types it will have
                after = plan.fp8[:2]
                changed = plan.reason != ALREADY_FP8
                if changed:
                    _mark_fp8(op, plan.fp8)
            elif changed:
                _apply(op, plan, shared)
                after = tuple(names.name(element_type(v)) for v in list(op.operands)[:2])
                result_after = names.name(element_type(op.result))
            if report is not None:
                runs = _op_runs(graph, fn_name, op)
                flops = estimate_flops(op, kind)
                index = report.add(Decision(
                    function=fn_name, op_kind=kind, scope=site.scope_path,
                    direction=site.direction, operands_before=before,
                    operands_after=after,
                    result_before=result_before,
                    result_after=result_after, action=rule.action,
                    rule=rule.rule, changed=changed, reason=plan.reason,
                    runs_as=plan.runs_as,
                    flops=None if flops is None else flops * runs.count,
                    runs=runs.count,
                    notes=(UNKNOWN_TRIPS,) if runs.unknown else (),
                    shape="x".join(str(s) for s in ir.RankedTensorType(op.result.type).shape)
                    if isinstance(op.result.type, ir.RankedTensorType) else "?",
                    location=site.name, source=site.source,
                ))
                mark_decision(op, index)


def _at_default_precision(op: Any) -> bool:
    """Whether ``op`` leaves its precision to the backend: no algorithm, and a precision
    config absent or DEFAULT on every operand (not HIGH, not HIGHEST)."""
    entries = operand_precisions(op)
    return entries is not None and all("DEFAULT" in entry for entry in entries)


_DOT_KINDS = frozenset({"dot_general", "dot"})


def _accurate_f32_conversion(plan: Plan, policy: Policy, elements: tuple,
                             names: _TypeNames) -> bool:
    """Whether ``plan`` is the accurate mode's conversion of an all-f32 matrix op (what
    the two rules below may leave f32): not the mixed modes, not fp8, something to
    convert."""
    return (not policy.propagate and plan.action == COMPUTE and plan.fp8 is None
            and (any(plan.operand_targets) or plan.result_target is not None)
            and all(names.name(t) == "f32" for t in (*elements[0], elements[1])))


def _left_to_the_target(op: Any, kind: str, elements: tuple, plan: Plan, policy: Policy,
                        target: Target, names: _TypeNames) -> Plan:
    """``plan`` for one op, with the accurate mode's f32×f32 dots left f32 where the
    target runs them as one pass of the compute dtype anyway (``Target.f32_dot_runs_as``:
    XLA:TPU at DEFAULT precision): the same arithmetic without a 16-bit copy in the
    program. XLA:TPU places its own converts (its optimized f32 program already shows
    most dots with bf16 operands); one of ours only changes what it fuses and stores: a
    bf16 convert that two dots share is a copy it stores (the softmax backward's
    gradient, read by the dQ and dK dots: 256 MiB per device on benchmarks/llm.py's v5e-16
    step), and the dots with their own operands converted still left that step's temp
    0.2 MiB above f32's. Not in the mixed modes (propagate seeds its 16-bit regions from
    the converted dots). The kept plan names the type the dot runs as (``Plan.runs_as``,
    then ``Decision.runs_as``): under a 16-bit ``reduce=`` comm_precision gives a kept dot
    whose sum crosses devices that result type, as it does a converted one."""
    why = target.f32_dot_runs_as(policy.compute_dtype)
    if (why is None or kind not in _DOT_KINDS or plan.result_target is not None
            or not _accurate_f32_conversion(plan, policy, elements, names)
            or not _at_default_precision(op)):
        return plan
    return dataclasses.replace(plan, operand_targets=(None,) * len(plan.operand_targets),
                               runs_as=DTYPE_TO_ELEMENT[policy.compute_dtype],
                               reason=f"kept f32: {why}")


def _kept_for_its_result(op: Any, kind: str, elements: tuple, plan: Plan, policy: Policy,
                         target: Target, names: _TypeNames) -> Plan:
    """``plan`` for one op, with the accurate mode's f32 matrix ops left f32 where the
    result outweighs the operands (as many elements or more: a weight gradient over a
    small batch, a squeeze-excite's or a 1x1 head's filter gradient) and the target
    writes the 16-bit form's result once more than f32's (``Target.
    writes_16bit_form_twice``: cuDNN's 16-bit convolution result, cuBLAS's padded GEMM).
    Such an op is bound by its result's bytes: rounding its operands saves at most half
    of theirs, fewer than the extra result costs, in time and in memory (the f32 weight
    gradient of a 1x1 convolution on 1x1 pixels, Keras MobileNetV3Small's head, is
    written by the convolution into the buffer the optimizer updates in place; its bf16
    form wrote a 1.1 MiB bf16 copy first). Not in the mixed modes, which write a 16-bit
    result anyway, as the hand cast does."""
    if not _accurate_f32_conversion(plan, policy, elements, names):
        return plan
    sizes = [element_count(value) for value in (*list(op.operands)[:2], op.result)]
    if None in sizes or sizes[2] < sizes[0] + sizes[1]:
        return plan
    why = target.writes_16bit_form_twice(op, kind)
    if why is None or not _read_on_the_way_out(op):
        return plan
    return dataclasses.replace(
        plan, operand_targets=(None,) * len(plan.operand_targets), result_target=None,
        reason=f"kept f32: its result outweighs its operands and {why}")


# Ops whose readers the walk below does not follow: any of them may lead to a matrix op
# (a region's terminator: a loop carry, a branch result).
_OPAQUE_READERS = frozenset({"func.call", "stablehlo.while", "stablehlo.case",
                             "stablehlo.if", "stablehlo.custom_call",
                             "stablehlo.optimization_barrier", "stablehlo.return"})
_MAX_READERS_WALKED = 64


def _read_on_the_way_out(op: Any) -> bool:
    """Whether ``op``'s result reaches no matrix op, only a public function's return
    (through the ops of its own block): a weight gradient that only the optimizer reads,
    which XLA writes into the buffer the update overwrites. An input gradient reaches
    the previous layer's matrix ops instead; its f32 form is a larger buffer than its
    16-bit one, whose convert up XLA fuses into the readers."""
    pending, seen = [op.result], 0
    while pending:
        seen += 1
        if seen > _MAX_READERS_WALKED:
            return False
        for use in live_uses(pending.pop()):
            reader = use.owner.operation
            if reader.name == "func.return":
                if not is_public(reader.parent):
                    return False
                continue
            if reader.name in MATRIX_OP_NAMES or reader.name in _OPAQUE_READERS:
                return False
            pending.extend(reader.results)
    return True


# The note of an op inside a loop whose trip count could not be read (a while_loop, a
# fori_loop with traced bounds): its FLOPs count that loop once.
UNKNOWN_TRIPS = ("trip count of an enclosing while loop unknown: FLOPs count one "
                 "iteration of it")


def _op_runs(graph: _CallGraph, fn_name: str, op: Any) -> Runs:
    """How often ``op`` runs per call of the program: its function's runs times the
    trip counts of the loops around it in that function."""
    outer = graph.runs.get(fn_name, Runs(1))
    here = graph.loops.runs(op)
    return Runs(outer.count * here.count, outer.unknown + here.unknown)


def _mark_fp8(op: Any, formats: tuple[str, str, str]) -> None:
    """Tell the fp8 pass to quantise ``op``: [lhs fp8 type, rhs fp8 type, dequantise]."""
    with op.context:
        op.attributes[FP8_MARK] = ir.ArrayAttr.get(
            [ir.TypeAttr.get(ir.Type.parse(name)) for name in formats])


def _apply(op: Any, plan: Plan, shared: dict[tuple[Any, Any, str], ir.Value]) -> None:
    """Rewrite ``op`` in place per ``plan``; converts are shared per (block, value, type)."""
    block = op.operation.block
    with op.location:
        for index, target in enumerate(plan.operand_targets):
            if target is None:
                continue
            value = op.operands[index]
            key = (block, value, target)
            converted = shared.get(key)
            if converted is None:
                new_type = with_element(value.type, ir.Type.parse(target))
                with ir.InsertionPoint(op):
                    converted = hlo.convert(new_type, value)
                shared[key] = converted
            op.operands[index] = converted
        if plan.result_target is not None:
            original_type = op.result.type
            op.result.set_type(with_element(original_type, ir.Type.parse(plan.result_target)))
            with ir.InsertionPoint.after(op):
                back = hlo.convert(original_type, op.result)
            op.result.replace_all_uses_except(back, back.owner.operation)
