"""``stablehlo.composite "chlo.ragged_dot"`` back into the ``chlo.ragged_dot`` it stands
for, before the passes.

jax lowers ``jax.lax.ragged_dot`` for GPU and TPU as ``chlo.ragged_dot``; a ``jax.export``
artifact (what ``hlo_amp.compile`` rewrites on a device, and what ``hlo-amp-opt`` may be
given) holds it as a composite whose decomposition is a dense dot per group. XLA turns
the composite back into its own ragged dot from the composite's operand types and
attributes and never runs the decomposition, so converting the decomposition's dots
changed nothing (f32 GEMMs under a report of bf16 ones), and a decomposition's per-group
dots would be G times the FLOPs if XLA did run them. As the op itself insert_converts
decides it as it does on the direct lowering (``lower(target=...)``), and serialising the
module wraps it again, in the types chosen.
"""

from __future__ import annotations

from jaxlib.mlir import ir

from hlo_amp.ir.modules import body_name, function_name, functions, walk_operations

RAGGED_DOT = "chlo.ragged_dot"
# composite_attributes' ragged_dot_dimension_numbers, in order (the StableHLO extension's
# chlo-preserve-high-level-ops writes them so).
_DIMENSION_FIELDS = ("lhs_batching_dimensions", "rhs_batching_dimensions",
                     "lhs_contracting_dimensions", "rhs_contracting_dimensions",
                     "lhs_ragged_dimensions", "rhs_group_dimensions")


def recompose_ragged_dots(module: ir.Module) -> int:
    """Replace each ``chlo.ragged_dot`` composite of ``module`` by the op, and drop the
    decompositions nothing else names; how many were replaced."""
    composites = [op for op in walk_operations(module, names=frozenset({"stablehlo.composite"}))
                  if ir.StringAttr(op.attributes["name"]).value == RAGGED_DOT]
    dropped: set[str] = set()
    for composite in composites:
        dropped.add(body_name(composite))
        attributes = ir.DictAttr(composite.attributes["composite_attributes"])
        numbers = [list(ir.DenseIntElementsAttr(a))
                   for a in ir.ArrayAttr(attributes["ragged_dot_dimension_numbers"])]
        if len(numbers) != len(_DIMENSION_FIELDS) or len(composite.results) != 1:
            continue  # not the form jax writes: left to XLA as it is
        fields = ", ".join(f"{field} = [{', '.join(map(str, dims))}]"
                           for field, dims in zip(_DIMENSION_FIELDS, numbers))
        precision = ", ".join(f"#chlo<precision {ir.StringAttr(p).value}>"
                              for p in ir.ArrayAttr(attributes["precision_config"]))
        with composite.context, composite.location, ir.InsertionPoint(composite):
            op = ir.Operation.create(
                RAGGED_DOT, results=[composite.results[0].type],
                operands=list(composite.operands),
                attributes={
                    "ragged_dot_dimension_numbers":
                        ir.Attribute.parse(f"#chlo.ragged_dot<{fields}>"),
                    "precision_config": ir.Attribute.parse(f"[{precision}]"),
                })
        composite.results[0].replace_all_uses_with(op.results[0])
        composite.erase()
    if dropped:
        named = {body_name(op) for op in walk_operations(
            module, names=frozenset({"func.call", "stablehlo.composite"}))}
        for fn in functions(module):
            if function_name(fn) in dropped - named:
                fn.erase()
    return len(composites)
