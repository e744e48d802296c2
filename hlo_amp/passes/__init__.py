"""The pass pipeline: ordered passes over a StableHLO module, verified after each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from jax._src.lib.mlir import ir

from hlo_amp.modules import ModuleError
from hlo_amp.passes.cleanup import CleanupConverts
from hlo_amp.passes.dot_layout import FastDotLayout
from hlo_amp.passes.insert_converts import InsertConverts
from hlo_amp.passes.propagate import Propagate
from hlo_amp.policy import Policy
from hlo_amp.report import Report


class Pass(Protocol):
    name: str

    def run(self, module: ir.Module, report: Report | None = None) -> None: ...


def default_pipeline(policy: Policy, target: str | None = None) -> list[Pass]:
    """The passes ``hlo_amp.compile`` and ``hlo-amp-opt`` run, in order.

    For ``target="cpu"`` bf16 dots are also relaid into the form XLA:CPU runs in bf16:
    without it some layouts are upcast, and a bf16 dot whose result XLA transposes
    fails at run time (see passes/dot_layout.py).
    """
    passes: list[Pass] = [InsertConverts(policy, target)]
    if policy.propagate:
        passes.append(Propagate(policy, target))
    passes.append(CleanupConverts())
    if target == "cpu":
        # Relay every slow layout, even where the bf16 path is slower than f32: relaying
        # only the known-failing ones (relay_slow=False) still let a ViT train step fail
        # at run time in XLA:CPU (benchmarks/DOT_LAYOUT.md), and running beats speed.
        passes.append(FastDotLayout())
    return passes


def pass_names(policy: Policy, target: str | None = None) -> dict[str, Pass]:
    """Every pass by its CLI name, for ``hlo-amp-opt --pass NAME``."""
    passes: list[Any] = [InsertConverts(policy, target), Propagate(policy, target),
                         CleanupConverts(), FastDotLayout()]
    return {p.name: p for p in passes}


def run_pipeline(module: ir.Module, policy: Policy, *, report: Report | None = None,
                 passes: Sequence[Pass] | None = None, target: str | None = None) -> Report:
    """Run ``passes`` (default: the full pipeline) in place; verify after each."""
    if report is None:
        report = Report(policy=policy.to_string(), rules=policy.rule_names())
    for current in passes if passes is not None else default_pipeline(policy, target):
        current.run(module, report)
        try:
            module.operation.verify()
        except ir.MLIRError as error:  # a bug in the pass, never the user's input
            raise ModuleError(
                f"internal error: pass {current.name} produced an invalid module: {error}"
            ) from error
    return report
