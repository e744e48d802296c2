"""Choose the precision of what crosses devices.

Two steps, one concern (the bytes collectives move):

* Converts move up through data movement. A narrowing float convert (f32 -> bf16) whose
  operand is the result of a sharding constraint (``sdy.sharding_constraint``,
  ``sdy.reshard``, ``custom_call @Sharding``, ``@SPMDFullToShardShape``,
  ``@SPMDShardToFullShape``), a reshape, a transpose, a broadcast or a data-moving
  collective (``all_gather``, ``all_to_all``, ``collective_permute``) goes before that op
  when every reader of the op's result is such a convert to the same type: the op then
  moves 16-bit data. Rounding commutes with moving elements, so the values are the same
  bit for bit; the all-gather that XLA's partitioner puts at a constraint to replicated
  (sequence-parallel K and V) gathers 16 bit (jax-ml/jax#23543). Sums (``all_reduce``,
  ``reduce_scatter``) are not data movement and are left alone here.

* ``reduce=`` (Policy.reduce) sets the result type of the matrix ops whose partial
  results XLA's SPMD partitioner sums across devices: dots whose contracting dimension
  is sharded (per the public functions' argument shardings and the sharding
  constraints, propagated forward into ``while`` bodies, ``case``/``if`` branches and
  through ``func.call``s: a scanned layer's dots, remat's checkpoint bodies). The all-reduce (or reduce-scatter) the partitioner inserts after
  such a dot has the dot's result type. ``reduce=bfloat16`` makes those dots (when their
  operands are already 16-bit, or they are f32 dots the target runs as one bf16 pass:
  their ``Decision.runs_as``) return 16 bit and converts back after: half the bytes,
  each device's partial sum rounded once and the sum done in 16 bit. ``reduce=float32``
  makes them return f32 where the fast mode gave them a 16-bit result. Not set: the
  mode's own result type (f32 in the accurate mode).

* The same precision applies to the add scatters whose partial results the partitioner
  sums across devices: an embedding's gradient, the gather's transpose, scatter-adds
  the batch's updates into the table (zeros) on each device, and XLA all-reduces the
  table right after the scatter, in the scatter's type (a convert after it is folded
  away). Where the reduce precision is 16-bit (``reduce=bfloat16``/``float16``, or not
  set in the fast mode, whose default is the compute dtype) and the updates are 16-bit
  values converted up (propagate's painting), the scatter is retyped: its operand
  converted down, the 16-bit updates read directly, the sum in 16 bit, a convert back
  to the old type after it. ``reduce=float32`` (and the accurate modes by default)
  leave it in f32. Only one-input scatters into a constant (the zeros) whose body is
  one add and whose updates can meet (not a one-position scatter, which sums nothing).

One pass in four parts, each importing only those before it: ``data_movement`` (converts
moved above data movement), ``axes`` (the sharded axes of every value, per calling
context), ``reduced_dots`` and ``reduced_scatters`` (the reduce precision on dots and add
scatters summed across devices); this module runs them and writes the report's note.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir

from hlo_amp.ir.modules import functions, walk_operations
from hlo_amp.passes.comm_precision.axes import ModuleAxes
from hlo_amp.passes.comm_precision.data_movement import move_converts_up
from hlo_amp.passes.comm_precision.reduced_dots import retype_reduced_dots
from hlo_amp.passes.comm_precision.reduced_scatters import (
    SCATTERS,
    chosen_scatters,
    sum_in_16bit,
)
from hlo_amp.policy import DTYPE_TO_ELEMENT, KEEP, Policy
from hlo_amp.report import Report


@dataclass(frozen=True)
class CommPrecision:
    """Move 16-bit converts above data movement; apply the policy's ``reduce`` dtype to
    dots whose contracting dimension is sharded. See the module docstring."""

    policy: Policy
    name: str = "hlo-amp-comm-precision"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if not any(action not in (None, KEEP, "float32", "float64")
                   for action in self.policy.actions):
            return  # the f32 preset changes nothing, a program's own converts included
        moved = sum(move_converts_up(fn) for fn in functions(module))
        retyped = summed = 0
        reduce = self.reduce_dtype
        # The axes analysis walks every function: only where a dot or a scatter may need it.
        sums_scatters = (reduce not in (None, "float32")
                         and bool(walk_operations(module, names=SCATTERS)))
        if self.policy.reduce is not None or sums_scatters:
            with module.context:
                axes = ModuleAxes(module)
                wanted = ir.Type.parse(DTYPE_TO_ELEMENT[reduce])
                scatters = chosen_scatters(module, axes, wanted) if sums_scatters else []
                if self.policy.reduce is not None:
                    retyped = retype_reduced_dots(module, axes, wanted, report)
                summed = sum_in_16bit(scatters, wanted)
        if report is not None and (moved or retyped or summed):
            note = f"comm-precision: moved {moved} 16-bit convert(s) above data movement"
            if retyped:
                note += (f", {retyped} dot(s) with a sharded contracting dimension return "
                         f"{self.policy.reduce} (reduce={self.policy.reduce})")
            if summed:
                why = (f"reduce={self.policy.reduce}" if self.policy.reduce is not None
                       else "the fast mode's default reduce precision")
                note += (f", {summed} add scatter(s) summed across devices (an embedding's "
                         f"gradient) sum their 16-bit updates in {reduce} ({why})")
            report.notes.append(note)

    @property
    def reduce_dtype(self) -> str | None:
        """The precision of the sums across devices: ``reduce=``, else the fast mode's
        compute dtype (its matrix ops return 16 bit); None: the accurate modes' own."""
        if self.policy.reduce is not None:
            return self.policy.reduce
        return self.policy.compute_dtype if self.policy.propagate else None


__all__ = ["CommPrecision"]
