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

Ops inside private functions are decided in the context of their call site (its name
and its call path, so two calls at one scope are told apart: the first and the last call
of a block called at every layer); a function called from sites that need different
decisions is cloned per decision vector, so nothing is decided once for all callers.
Public signatures never change.

One pass in four parts, each importing only those before it: ``plan`` (an op's `Plan`
under its action), ``call_graph`` (call-site contexts, clones, first and last matrix ops,
runs per call), ``keep_f32`` (the accurate mode's ops left f32 for the target) and this
module (the decisions into the report, the converts and fp8 marks written).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.gradients import GradientFlow
from hlo_amp.ir.loops import function_runs, op_runs
from hlo_amp.ir.modules import (
    FP8_MARK,
    element_type,
    function_name,
    functions,
    is_public,
    mark_decision,
    with_element,
)
from hlo_amp.ir.program_hints import forward_ends
from hlo_amp.ir.sites import asks_for_precision
from hlo_amp.passes.insert_converts.call_graph import (
    UNKNOWN_TRIPS,
    CallGraph,
    Instance,
)
from hlo_amp.passes.insert_converts.keep_f32 import kept_for_its_result, left_to_the_target
from hlo_amp.passes.insert_converts.plan import (
    ALREADY_FP8,
    Plan,
    estimate_flops,
    float_bits,
    plan_op,
)
from hlo_amp.policy import FP8_E5M2, Policy
from hlo_amp.report import Decision, Report
from hlo_amp.targets import NO_TARGET, Target

__all__ = ["ALREADY_FP8", "UNKNOWN_TRIPS", "InsertConverts", "Plan", "estimate_flops",
           "float_bits", "plan_op"]


@dataclass(frozen=True)
class InsertConverts:
    """Insert ``stablehlo.convert`` around dot/conv ops as the policy decides."""

    policy: Policy
    target: Target = NO_TARGET  # its only_if_faster rule, 16-bit result and fp8 forms
    name: str = "hlo-amp-insert-converts"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        graph = CallGraph(self.policy)
        for fn in functions(module):
            graph.by_name[function_name(fn)] = fn
        # Phase 1: contexts and clones, on pristine bodies (clones copy unrewritten IR).
        # A public function keeps its own (top-level) context; a call to one from
        # another function gets a private clone under the call site's context.
        public = [fn for fn in functions(module) if is_public(fn)]
        graph.used_names.update(function_name(fn) for fn in public)
        if (self.policy.first_matrix_op, self.policy.last_matrix_op) != (None, None):
            graph.find_ends(public, forward_ends(module))
        for fn in public:
            graph.visit(fn, "")
        if report is not None:  # after visit: calls name the clones
            graph.runs = function_runs(module, graph.loops)
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

    def _rewrite_body(self, instance: Instance, graph: CallGraph,
                      report: Report | None, flow: GradientFlow | None = None) -> None:
        fn_name = function_name(instance.fn)
        original = graph.origin.get(fn_name, fn_name)
        shared: dict[tuple[Any, Any, str], ir.Value] = {}
        names = graph.type_names
        for index, (op, kind) in enumerate(graph.ops_of(instance.fn)):
            if kind is None:
                continue
            site = graph.site(op, kind, instance.prefix)
            positions = graph.positions.get((original, index, instance.prefix,
                                             instance.path), ())
            rule = self.policy.decide(site.scope, kind, site.gradient_pass, positions,
                                      asks_for_precision(op))
            elements = ([element_type(v) for v in list(op.operands)[:2]],
                        element_type(op.result))
            gradient = None
            if flow is not None and site.gradient_pass and rule.action == FP8_E5M2:
                gradient = flow.incoming_gradient(op)
            plan = plan_op(op, kind, self.policy, rule.action, rule.rule, self.target,
                           elements, gradient=gradient, backward=site.gradient_pass)
            if rule.reason is not None:
                plan = dataclasses.replace(plan, reason=rule.reason)
            plan = left_to_the_target(op, kind, elements, plan, self.policy, self.target,
                                      names)
            plan = kept_for_its_result(op, kind, elements, plan, self.policy, self.target,
                                       names)
            before = tuple(names.name(t) for t in elements[0])
            result_before = names.name(elements[1])
            changed = any(plan.operand_targets) or plan.result_target is not None
            after, result_after = before, result_before  # untouched unless changed
            if plan.fp8 is not None:  # the fp8 pass quantises; the types it will have
                after = plan.fp8[:2]
                changed = plan.reason != ALREADY_FP8
                if changed:
                    _apply(op, plan, shared)  # the fast mode's 16-bit operands, if any
                    _mark_fp8(op, plan.fp8)
            elif changed:
                _apply(op, plan, shared)
                after = tuple(names.name(element_type(v)) for v in list(op.operands)[:2])
                result_after = names.name(element_type(op.result))
            if report is not None:
                report.note_outranked(rule.rule, rule.outranked)
                runs = op_runs(graph.runs, graph.loops, fn_name, op)
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
                    shape=_shape_text(op.result.type),
                    location=site.name, source=site.source,
                ))
                mark_decision(op, index)


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
        if any(plan.operand_targets) and "algorithm" in op.operation.attributes:
            # An explicit dot algorithm names the operand types it was written for
            # (ALG_DOT_F32_F32_F32): kept on 16-bit operands, XLA:GPU and XLA:TPU refused
            # the dot. Converted (explicit_precision=ignore, a scope rule), the dot's
            # precision is the converted operands'.
            del op.operation.attributes["algorithm"]
        if plan.result_target is not None:
            original_type = op.result.type
            op.result.set_type(with_element(original_type, ir.Type.parse(plan.result_target)))
            with ir.InsertionPoint.after(op):
                back = hlo.convert(original_type, op.result)
            op.result.replace_all_uses_except(back, back.owner.operation)


def _shape_text(value_type: ir.Type) -> str:
    """``8x?x3`` (``?`` a dynamic dimension: a symbolic one of jax.export); ``?`` unranked."""
    if not isinstance(value_type, ir.RankedTensorType):
        return "?"
    ranked = ir.RankedTensorType(value_type)
    return "x".join("?" if ranked.is_dynamic_dim(i) else str(size)
                    for i, size in enumerate(ranked.shape))
