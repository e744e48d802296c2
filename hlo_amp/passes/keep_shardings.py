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

A value jax leaves ``unreduced`` (partial sums of a dot whose contracting dimension is
sharded, summed where a later sharding says: ``out_sharding=P(..., unreduced=...)``, the
gradient of a ``reduced`` parameter) carries that sharding on the op that made it, and
jax writes it again after each op it passes through. A convert or an fp8 scale the
pipeline writes between a dot and its unreduced constraint has none: Shardy then sums the
dot's partial results at the dot, and the constraint marks the sum as partial again, so
the later reshard sums it once more (8x the value on 8 devices). So each op the pipeline
wrote there reads its operand through a copy of that constraint, as jax writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir

from hlo_amp.ir.modules import functions, is_program_convert, walk_operations
from hlo_amp.ir.shardings import (
    GIVEN_SHARDINGS,
    constrain,
    fixed_sharding,
    is_partitioned,
    leaves_an_axis_free,
    leaves_unreduced,
)
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
        unreduced = _constrain_unreduced_producers(module)
        if report is not None and unreduced:
            report.notes.append(f"keep-shardings: {unreduced} value(s) of partial sums left "
                                f"unreduced keep that sharding on the op that made them")


# Ops the pipeline writes between a matrix op and the program's readers of its result,
# with the result's shape: a convert, an fp8 dot's multiply by its scales.
_RESULT_OPS = frozenset({"stablehlo.convert", "stablehlo.multiply"})


def _partial_operand(op: ir.Operation) -> int | None:
    """The operand of ``op`` (in ``_RESULT_OPS``) that carries the partial sums: the one
    of the result's shape not broadcast from a scale; None if not exactly one."""
    shape = ir.RankedTensorType(op.results[0].type).shape
    found = [number for number, value in enumerate(op.operands)
             if ir.RankedTensorType(value.type).shape == shape
             and (isinstance(value, ir.BlockArgument)
                  or value.owner.name != "stablehlo.broadcast_in_dim")]
    return found[0] if len(found) == 1 else None


def _constrain_unreduced_producers(module: ir.Module) -> int:
    """Put each unreduced sharding also on the operands of the ops the pipeline wrote
    between it and the op that made the partial sums; the count of constraints added."""
    added = 0
    for fn in functions(module):
        for given in walk_operations(fn, names=GIVEN_SHARDINGS):
            if not leaves_unreduced(given):
                continue
            sharding = given.attributes["sharding"]
            value = given.operands[0]
            while not isinstance(value, ir.BlockArgument) and value.owner.name in _RESULT_OPS:
                producer = value.owner.operation
                number = _partial_operand(producer)
                if number is None:
                    break
                inner = producer.operands[number]
                if (not isinstance(inner, ir.BlockArgument)
                        and inner.owner.name in GIVEN_SHARDINGS):
                    break  # already given a sharding, as jax writes it
                with producer.location, ir.InsertionPoint(producer):
                    producer.operands[number] = constrain(inner, sharding, opened=False)
                added += 1
                value = inner
    return added
