"""Keep the shardings a partitioned program gave its values on the converts the pipeline
wrote of them.

A step's arguments carry the shardings the user gave them, closed: XLA's partitioner
(Shardy) may not shard a replicated parameter. A convert the pipeline writes of one (the
mixed modes' bf16 copy of an RMSNorm's replicated scale) is a new value with no sharding
of its own, and propagation may shard it on an axis its argument leaves free: the
activations' model dimension, in a step without activation constraints. The forward
multiply then reads a slice of it and the backward pass, batch-sharded, gathers it back
(issue 48): a collective the program did not have. So each such convert carries its
operand's sharding, as given, behind an ``sdy.sharding_constraint``: the copy is
partitioned as the value it copies. Only where that sharding leaves a mesh axis free
(a sharding that uses every axis is what propagation gives the copy anyway), only for
the converts the pipeline wrote (``run_pipeline`` marks the program's own first:
``modules.mark_program_converts``), and only in a partitioned module.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir

from hlo_amp.ir.modules import functions, is_program_convert, walk_operations
from hlo_amp.ir.shardings import constrain, fixed_sharding, is_partitioned, leaves_an_axis_free
from hlo_amp.report import Report

_CONVERT = frozenset({"stablehlo.convert"})


@dataclass(frozen=True)
class KeepShardings:
    """Constrain the pipeline's converts of values with a given sharding to it."""

    name: str = "hlo-amp-keep-shardings"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if not is_partitioned(module):
            return
        kept = 0
        for fn in functions(module):
            for op in walk_operations(fn, names=_CONVERT):
                if is_program_convert(op):
                    continue
                sharding = fixed_sharding(op.operands[0])
                if sharding is None or not leaves_an_axis_free(module, sharding):
                    continue
                result = op.results[0]
                readers = [(use.owner, use.operand_number) for use in result.uses]
                with op.location, ir.InsertionPoint(op):
                    constrained = constrain(result, sharding, opened=False)
                op.move_before(constrained.owner)  # the constraint reads the convert
                for reader, number in readers:
                    reader.operands[number] = constrained
                kept += 1
        if report is not None and kept:
            report.notes.append(f"keep-shardings: {kept} convert(s) of a value with a given "
                                f"sharding keep that sharding")
