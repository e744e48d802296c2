"""Low-precision dataflow: 16-bit regions from the matrix ops through the ops around them.

Runs after ``insert_converts`` in the mixed_* modes, in the manner of TensorFlow's
auto-mixed-precision "paint" algorithm. The seeds are the matrix ops that pass put in
16 bit (16-bit operands, f32 result: class ``allow``); every other op has a class from
``op_classes.py``, which op and scope rules override. Then, on the def-use graph of each
function (``while``/``case``/``if`` bodies and calls to private functions included):

1. Deny ops convert their own inputs: a deny op (or one outside the table) reading a
   16-bit value gets a convert up in front of it and pins nothing, as in TensorFlow's
   algorithm and PyTorch autocast. A value is *pinned* (stays f32) only when something
   must read it exactly as f32: a convert to another type, a public ``return``, an op
   outside the graph. On CPU a deny op pins what it reads, and steps 2-3 see no f32 ops
   that convert their own inputs (``Target.deny_pins_its_inputs``).
2. Deny spreads forward only: the infer ops, and the clear ops and links that lead
   (through clear ops and links) to arithmetic, downstream of a deny op stay f32
   (TensorFlow's forward deny propagation): the centring and scaling after a layer
   norm's mean, the divide after a softmax's sum. A residual among them, a full-shape
   f32 value of the forward pass that the backward pass reads and that leads through
   forward ops to a matrix op (a batch norm's output, the activation after it), is
   painted all the same (``solve._read_by_backward``): stored in 16 bit, as Keras and
   Flax store a norm layer's output, not held in f32 from the forward to the backward
   pass. A statistic (a softmax's sum broadcast, a value a broadcast spreads) is not
   (``solve._is_statistic``); a broadcast of an activation (made from a matrix op's
   result with no reduction between: GQA's repeat of the roped K) is no statistic's
   spread. A value so stored ends the deny region, as a layer's
   16-bit output does: the painting is redone with it as a 16-bit source, so the
   activation after a batch norm and the activation's backward run in 16 bit
   (``solve._paint_stored``).
3. The *eligible* nodes are the other unpinned infer/clear ops whose float values are
   all f32 and whose scope the policy leaves to the table, plus loop carries, branch
   results and call arguments/results (links). A node is painted when it is reachable
   from an allow op through eligible nodes *and* reaches a 16-bit sink (a convert to
   the compute dtype, i.e. a matrix op's operand) through eligible nodes or through the
   f32 ops of step 1-2, which convert their own inputs: it sits between 16-bit ops (an
   activation gradient between two matrix ops, though it also feeds a bias gradient's
   sum; a pre-LN residual stream, though a layer norm's mean reads it; attention scores
   and their max before the softmax's exp). A compare whose float operands are all
   16-bit is painted too, and an equality test (EQ, NE) with one 16-bit operand, after
   a deny op too: jax's gradient of maximum, minimum and clip asks whether an operand
   is the result, which holds only between the operand rounded and the 16-bit result. The updates of an add scatter the table keeps f32 (an
   embedding's gradient) count as a 16-bit sink: the gradient reaching it is 16-bit up
   to it, as between two matrix ops, and the scatter converts it up and sums in f32
   (comm_precision then sums it in 16 bit where devices sum it and ``reduce=`` says so).
   An ``optimization_barrier`` (jax.checkpoint's, around what the backward pass
   recomputes from) is one link per operand-result pair, unless a rule keeps it.
4. An allow op's result becomes 16-bit when it is not pinned: on GPU and TPU the op
   returns the 16-bit type itself, also where only f32 ops read it (a weight gradient
   read by the optimizer, the logits read by the loss), as TensorFlow's and PyTorch's
   AMP write every matrix result; those readers convert it up (after a transpose or
   reshape of it, which then moves 16-bit values). On CPU, and with the
   policy's ``keep_f32_results``, only where it feeds a painted op or a sink; on CPU
   it keeps its f32 result and a convert follows (``Target.matrix_result_in_16bit``).
5. On GPU, an f32 value after a deny op that only matrix ops and sums read (the logits
   gradient: the head's GEMMs and its bias gradient) is rounded once after it is
   computed; the sums read that 16-bit copy through an ``optimization_barrier``, which
   keeps XLA from folding their convert back up into a read of the f32 value
   (``Target.sums_read_a_16bit_copy``).

Converts go only on region boundaries, one per value, target type and block; a painted
op's f32 operand is converted down, a 16-bit value read by an unpainted op is converted
back up, and the old operand converts of the matrix ops become no-ops and are erased. A
private function whose call sites need different paintings is cloned per painting;
public signatures never change. Painting is a pure function of the graph, so running
the pass on its own output changes nothing.

One pass in five parts, each importing only those before it: ``body`` (function bodies
walked once, value kinds), ``graph`` (nodes, links and their readers), ``solve`` (the
painting, steps 1-3 and which values step 5 copies), ``rewrite`` (steps 4-5, clones,
converts and barriers) and ``accounting``
(the report's op counts and bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import discard, erase_discarded, walk_operations
from hlo_amp.passes.propagate.accounting import bytes_table, intermediate_bytes, op_counts
from hlo_amp.passes.propagate.body import Body
from hlo_amp.passes.propagate.graph import Graph
from hlo_amp.passes.propagate.recurrences import deny_loop_accumulators
from hlo_amp.passes.propagate.rewrite import Rewriter
from hlo_amp.passes.propagate.solve import solve
from hlo_amp.policy import DTYPE_TO_ELEMENT, Policy
from hlo_amp.report import Report
from hlo_amp.targets import NO_TARGET, Target

__all__ = ["Propagate"]


@dataclass(frozen=True)
class Propagate:
    """Keep activations in the compute dtype between the matrix ops (mixed_* modes)."""

    policy: Policy
    target: Target = NO_TARGET  # its paint form and matrix-result form
    name: str = "hlo-amp-propagate"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        low = ir.Type.parse(DTYPE_TO_ELEMENT[self.policy.compute_dtype], module.context)
        # One walk per function body, shared by everything below: every op the bindings
        # hand out is a new Python object. The rewrite only adds and discards converts,
        # which the byte count skips by name (and step 5's barriers, which hold such a
        # convert's value), so the walks stay good for the "after".
        _drop_same_type_converts(module)
        erase_discarded(self.name)  # gone before any walk lists them (nothing holds them)
        walks: dict[int, Body] = {}
        before = intermediate_bytes(module, walks)
        form = self.target.paint_form(self.policy.keep_f32_results)
        graph = Graph(self.policy, low, walks, second_moments=not form.pin_at_deny)
        graph.build(module)
        deny_loop_accumulators(graph)
        in_16bit = self.target.matrix_result_in_16bit
        solve(graph, form)
        counts = op_counts(graph)
        with ir.Location.unknown(module.context):  # types are built outside any op
            clones = Rewriter(graph, low, in_16bit, self.target).rewrite(module)
        if report is not None:
            report.propagation = _merged(report.propagation, {
                "ops": counts,
                "functions": bytes_table(before, intermediate_bytes(module, walks)),
                "clones": clones,
            })
            report.rules_used.update(graph.rules_used)
            for loser, winner in graph.rules_outranked.items():
                report.note_outranked(winner, [loser])


def _merged(earlier: dict[str, Any] | None, this: dict[str, Any]) -> dict[str, Any]:
    """The propagation's figures for one more module added to a report's (the chunks of
    hlo-amp-opt --split-input-file share one report: the last chunk's replaced them)."""
    if earlier is None:
        return this
    ops = {kind: {"painted": row["painted"], "f32": dict(row["f32"])}
           for kind, row in earlier["ops"].items()}
    for kind, row in this["ops"].items():
        into = ops.setdefault(kind, {"painted": 0, "f32": {}})
        into["painted"] += row["painted"]
        for why, count in row["f32"].items():
            into["f32"][why] = into["f32"].get(why, 0) + count
    return {"ops": ops, "functions": [*earlier["functions"], *this["functions"]],
            "clones": earlier["clones"] + this["clones"]}


def _drop_same_type_converts(module: ir.Module) -> None:
    """Readers of a convert to its own type (jax writes one after a weakly typed
    ``jnp.where``) read its operand: the graph has no node for such a convert, and the
    f32 kept behind a -1e9 fill under f16 stopped at it (the add after it converted the
    fill to f16: -inf, and a masked row's softmax NaN)."""
    for op in walk_operations(module, names=_CONVERTS):
        if op.operands[0].type == op.results[0].type:
            op.results[0].replace_all_uses_with(op.operands[0])
            discard(op)


_CONVERTS = frozenset({"stablehlo.convert"})
