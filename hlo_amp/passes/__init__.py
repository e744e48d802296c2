"""The pass pipeline: ordered passes over a StableHLO module, verified once at the end.

Verifying walks the whole module, so by default it runs once, on the pipeline's result;
a debug option verifies after every pass instead, to name the pass that broke the
module: ``run_pipeline(..., verify_each=True)``, the environment variable
``HLO_AMP_VERIFY_EACH=1`` (which reaches ``hlo_amp.compile`` too) or
``hlo-amp-opt --verify-each``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Sequence
from typing import Any, Protocol

from jaxlib.mlir import ir

from hlo_amp.ir.chlo_composites import recompose_chlo_composites
from hlo_amp.ir.modules import (
    ModuleError,
    PassError,
    decision_of,
    drop_discarded,
    element_type,
    erase_discarded,
    mark_program_converts,
    op_in_traceback,
    strip_decision_marks,
    walk_operations,
)
from hlo_amp.ir.op_classes import MATRIX_OP_KINDS
from hlo_amp.ir.program_hints import strip_program_hints
from hlo_amp.ir.shardings import is_partitioned, name_shard_map_bodies
from hlo_amp.passes.batch_amax import BatchAmax
from hlo_amp.passes.cleanup import CleanupConverts
from hlo_amp.passes.comm_precision import CommPrecision
from hlo_amp.passes.dot_layout import FastDotLayout
from hlo_amp.passes.fp8 import Fp8Quantize
from hlo_amp.passes.fused_attention import FusedAttention
from hlo_amp.passes.hoist_amax import HoistAmax
from hlo_amp.passes.hoist_quantize import HoistQuantize
from hlo_amp.passes.insert_converts import ALREADY_FP8, InsertConverts
from hlo_amp.passes.insert_converts.plan import TypeNames
from hlo_amp.passes.keep_shardings import KeepShardings
from hlo_amp.passes.merge_amax import MergeAmax
from hlo_amp.passes.propagate import Propagate
from hlo_amp.passes.propagate.body import clear_type_kinds
from hlo_amp.passes.recompute_residuals import RecomputeResiduals
from hlo_amp.passes.reuse_amax import ReuseAmax
from hlo_amp.passes.scatter_select import ScatterToSelect
from hlo_amp.policy import Policy
from hlo_amp.report import Report, is_narrow
from hlo_amp.targets import Target, as_target


class Pass(Protocol):
    name: str

    def run(self, module: ir.Module, report: Report | None = None) -> None: ...


def default_pipeline(policy: Policy, target: str | Target | None = None, *,
                     fused_as: Target | None = None) -> list[Pass]:
    """The passes ``hlo_amp.compile`` and ``hlo-amp-opt`` run, in order, for ``target``
    (a `Target`, or what ``targets.as_target`` takes: None, "cpu", "gpu", "tpu", a
    device name).

    Where the target relays dots (CPU) bf16 dots are also relaid into the form XLA:CPU
    runs in bf16: without it some layouts are upcast, and a bf16 dot whose result XLA
    transposes fails at run time (see passes/dot_layout.py). The mixed_* modes add propagation and
    then the scatter-to-select rewrite (passes/scatter_select.py). A policy with fp8
    actions adds the fp8 pass after propagation (which leaves fp8 dots' f32 operands
    alone): it quantises the dots insert_converts marked (see passes/fp8.py),
    reuse_amax reads the amaxes remat's backward loop recomputes from the forward loop,
    hoist_amax takes a scanned weight's amax once per layer before its loop,
    hoist_quantize quantises a scanned weight once per step before its forward loop, and
    batch_amax reduces the amaxes delayed scaling records in a block together, and
    merge_amax takes two amaxes of tensors computed from the same values in one
    reduction. Then
    comm_precision moves 16-bit converts above data movement (sharding constraints,
    collectives) and applies the policy's ``reduce`` (passes/comm_precision.py). Last, in a
    partitioned module, the converts written of values with a given sharding keep it
    (passes/keep_shardings.py). First of all, when a rule computes a dot_general in 16
    bit (``fuse_attention``, on by default), softmax attention becomes a fused kernel on
    targets that have one, and the report lists every attention site
    (passes/fused_attention/). With ``fused_as`` (a GPU), attention is fused where that
    GPU would fuse it, with the reference kernel, and the rest is rewritten for
    ``target``: a program that runs here and computes what the GPU's does (the target
    autopolicy measures its errors on it).
    """
    target = as_target(target)
    passes: list[Pass] = []
    if policy.fuse_attention and policy.may_fuse_attention:
        passes.append(FusedAttention(policy, target) if fused_as is None
                      else FusedAttention(policy, fused_as, "reference"))
    passes.append(InsertConverts(policy, target))
    if policy.propagate:
        passes += [Propagate(policy, target), ScatterToSelect(target)]
        if target.recomputes_residuals:
            passes.append(RecomputeResiduals(policy, target))
    if policy.uses_fp8:
        passes += [Fp8Quantize(policy.scaling), ReuseAmax(), HoistAmax(), HoistQuantize(),
                   BatchAmax(), MergeAmax()]
    passes += [CommPrecision(policy), CleanupConverts()]
    if target.relays_dots:  # every slow layout (CpuTarget.relays_dots says why)
        passes.append(FastDotLayout())
    passes.append(KeepShardings())  # last: after every pass that writes or moves converts
    return passes


def pass_names(policy: Policy, target: str | Target | None = None) -> dict[str, Pass]:
    """Every pass by its CLI name, for ``hlo-amp-opt --pass NAME``."""
    target = as_target(target)
    passes: list[Any] = [FusedAttention(policy, target), InsertConverts(policy, target),
                         Propagate(policy, target),
                         ScatterToSelect(target), RecomputeResiduals(policy, target),
                         Fp8Quantize(policy.scaling), ReuseAmax(), HoistAmax(), HoistQuantize(),
                         BatchAmax(),
                         MergeAmax(), CommPrecision(policy),
                         CleanupConverts(), FastDotLayout(), KeepShardings()]
    return {p.name: p for p in passes}


VERIFY_EACH_ENV = "HLO_AMP_VERIFY_EACH"


def verify_each_requested() -> bool:
    """Whether ``HLO_AMP_VERIFY_EACH`` asks to verify after every pass (1, true, yes)."""
    return os.environ.get(VERIFY_EACH_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def run_pipeline(module: ir.Module, policy: Policy, *, report: Report | None = None,
                 passes: Sequence[Pass] | None = None,
                 target: str | Target | None = None,
                 verify_each: bool | None = None) -> Report:
    """Run ``passes`` (default: the full pipeline) in place, then verify the module once.

    With ``verify_each`` (default: the ``HLO_AMP_VERIFY_EACH`` environment variable)
    the module is verified after every pass instead, so an error names the pass that
    produced the invalid module. Either way an invalid result raises ModuleError.
    """
    if report is None:
        report = Report(policy=policy.to_string(), rules=policy.rule_names())
    if verify_each is None:
        verify_each = verify_each_requested()
    pipeline = list(passes if passes is not None else default_pipeline(policy, target))
    if not report.decisions and not any(isinstance(p, InsertConverts) for p in pipeline):
        report.matrix_ops_decided = False
    # The passes make no reference cycles: all they allocate is freed by reference
    # counting (tests/py/test_pass_cost.py checks), so the cyclic collector has nothing
    # to find in them. Left on, the tens of thousands of short-lived objects a large
    # module takes trigger collections of the whole heap mid-pass: in a process that has
    # traced a ViT one full collection costs ~150 ms, more than the passes themselves.
    collecting = gc.isenabled()
    gc.disable()
    drop_discarded()  # a pass run outside a pipeline (a test) leaves its own marks only
    recompose_chlo_composites(module)  # a jax.export artifact's (ir/chlo_composites.py)
    name_shard_map_bodies(module)
    if is_partitioned(module):  # keep_shardings, their one reader, acts only then
        mark_program_converts(module)
    try:
        for current in pipeline:
            run_pass(current, module, report)
            if verify_each:
                _verify(module, f"pass {current.name}")
        record_final_types(module, report, policy)
        strip_decision_marks(module)
        strip_program_hints(module)
        if not verify_each or not pipeline:
            names = ", ".join(p.name for p in pipeline) or "no passes"
            _verify(module, f"the pass pipeline ({names})",
                    hint=f" ({VERIFY_EACH_ENV}=1 or hlo-amp-opt --verify-each names the "
                         f"pass)")
    finally:
        clear_type_kinds()
        if collecting:
            gc.enable()
    return report


def record_final_types(module: ir.Module, report: Report, policy: Policy) -> None:
    """Each decision's operand and result types as the module has them after every pass:
    insert_converts records them when it decides, and later passes retype (the fast
    mode's 16-bit result of a GPU or TPU matrix op, an fp8 dot's f32 result of an f16
    program, ``reduce=``). A dot the program quantised itself keeps its fp8 types."""
    if not report.decisions:
        return
    names = TypeNames()
    decided = {d.op_kind for d in report.decisions}
    kinds = frozenset(name for name, kind in MATRIX_OP_KINDS.items() if kind in decided)
    seen: set[int] = set()
    for op in walk_operations(module, names=kinds):
        index = decision_of(op)
        if index is None or index in seen or not 0 <= index < len(report.decisions):
            continue
        seen.add(index)  # the first copy of an op speaks for its clones
        found = report.decisions[index]
        if found.reason == ALREADY_FP8:
            continue
        operands = tuple(names.name(element_type(v)) for v in list(op.operands)[:2])
        result = names.name(element_type(op.results[0]))
        if (operands, result) == (found.operands_after, found.result_after):
            continue
        notes = found.notes
        narrower = is_narrow(result) and not is_narrow(found.result_after)
        if policy.propagate and narrower and not any(result in n for n in notes):
            notes += (f"result stored as {result}: the fast mode keeps matrix-op results "
                      "16-bit on this target"),
        # An fp8 plan's reason names the result type it was planned with.
        reason = found.reason.replace(f", {found.result_after} result", f", {result} result")
        report.decisions[index] = dataclasses.replace(
            found, operands_after=operands, result_after=result, notes=notes, reason=reason,
            changed=found.changed or operands != found.operands_before
            or result != found.result_before)


def run_pass(current: Pass, module: ir.Module, report: Report | None) -> None:
    """Run one pass, then erase the ops it discarded (hlo_amp/ir/modules.py: nothing is
    freed while a pass holds objects pointing into the module). A pass that fails
    raises PassError, naming itself and the op it was working on; a ModuleError it
    raises on purpose (a module it cannot work on) goes through as it is."""
    try:
        current.run(module, report)
    except ModuleError:
        drop_discarded()
        raise
    except Exception as error:
        drop_discarded()
        raise PassError(current.name, op_in_traceback(error.__traceback__),
                        f"{type(error).__name__}: {error}") from error
    erase_discarded(current.name)


def _verify(module: ir.Module, what: str, hint: str = "") -> None:
    try:
        module.operation.verify()
    except ir.MLIRError as error:  # a bug in a pass, never the user's input
        raise ModuleError(
            f"internal error: {what} produced an invalid module{hint}: {error}"
        ) from error
