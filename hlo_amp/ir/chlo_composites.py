"""A ``jax.export`` artifact's ``stablehlo.composite "chlo.*"`` ops back into the CHLO ops
they stand for, before the passes.

jax lowers ``jax.lax.ragged_dot``, ``erf``, ``top_k``, ``sinh``... for GPU and TPU as CHLO
ops; a ``jax.export`` artifact (what ``hlo_amp.compile`` rewrites on a device, and what
``hlo-amp-opt`` may be given) holds each as a composite whose decomposition computes it in
StableHLO, and XLA turns the composite back into its own op from the composite's types and
attributes, never running the decomposition. So the passes read the artifact as the direct
lowering (``lower(target=...)``) has it: a ragged dot's decomposition (a dense dot per
group) had its dots converted while XLA ran f32 GEMMs, and an ``erf`` composite, opaque to
the fast mode's op table, kept a GELU's activations f32. Serialising the module wraps them
again, in the types chosen.
"""

from __future__ import annotations

import re

from jaxlib.mlir import ir

from hlo_amp.ir.modules import (
    body_name,
    discard,
    erase_discarded,
    function_name,
    functions,
    is_discarded,
    walk_operations,
)

RAGGED_DOT = "chlo.ragged_dot"
# composite_attributes' ragged_dot_dimension_numbers, in order (the StableHLO extension's
# chlo-preserve-high-level-ops writes them so).
_DIMENSION_FIELDS = ("lhs_batching_dimensions", "rhs_batching_dimensions",
                     "lhs_contracting_dimensions", "rhs_contracting_dimensions",
                     "lhs_ragged_dimensions", "rhs_group_dimensions")


def recompose_chlo_composites(module: ir.Module) -> int:
    """Replace each ``chlo.*`` composite of ``module`` by the op (a form the op does not
    take is left as it is), and drop the decompositions nothing names any more; how many
    were replaced."""
    replaced = 0
    dropped: set[str] = set()
    for composite in walk_operations(module, names=frozenset({"stablehlo.composite"})):
        name = ir.StringAttr(composite.attributes["name"]).value
        # jax.export's own: its decomposition is NAME.impl (NAME.impl_1, ... for more);
        # a jax.lax.composite a user named chlo.erf has its own, which XLA runs.
        if not name.startswith("chlo.") or not re.fullmatch(
                rf"{re.escape(name)}\.impl(_\d+)?", body_name(composite) or ""):
            continue
        attributes = (ir.DictAttr(composite.attributes["composite_attributes"])
                      if "composite_attributes" in composite.attributes else None)
        given = (_ragged_dot_attributes(attributes) if name == RAGGED_DOT
                 else {a.name: a.attr for a in attributes} if attributes is not None else {})
        if given is None:
            continue
        with composite.context, composite.location, ir.InsertionPoint(composite):
            try:
                op = ir.Operation.create(name, results=[r.type for r in composite.results],
                                         operands=list(composite.operands), attributes=given)
            except Exception:  # noqa: BLE001, S112 - an op this jaxlib does not know: left
                continue
        if not _verifies(op):
            discard(op)
            continue
        for old, new in zip(composite.results, op.results, strict=True):
            old.replace_all_uses_with(new)
        dropped.add(body_name(composite))
        discard(composite)
        replaced += 1
    if dropped:
        named = {body_name(op) for op in walk_operations(
            module, names=frozenset({"func.call", "stablehlo.composite"}))
                 if not is_discarded(op)}
        for fn in functions(module):
            if function_name(fn) in dropped - named:
                discard(fn)
    erase_discarded("recompose chlo composites")  # before a pass reads the module
    return replaced


def _ragged_dot_attributes(attributes: ir.DictAttr | None) -> dict[str, ir.Attribute] | None:
    """``chlo.ragged_dot``'s attributes from its composite's (None: not jax's form)."""
    if attributes is None or "ragged_dot_dimension_numbers" not in attributes:
        return None
    numbers = [list(ir.DenseIntElementsAttr(a))
               for a in ir.ArrayAttr(attributes["ragged_dot_dimension_numbers"])]
    if len(numbers) != len(_DIMENSION_FIELDS):
        return None
    fields = ", ".join(f"{field} = [{', '.join(map(str, dims))}]"
                       for field, dims in zip(_DIMENSION_FIELDS, numbers, strict=True))
    precision = ", ".join(f"#chlo<precision {ir.StringAttr(p).value}>"
                          for p in ir.ArrayAttr(attributes["precision_config"]))
    context = attributes.context
    return {"ragged_dot_dimension_numbers": ir.Attribute.parse(f"#chlo.ragged_dot<{fields}>",
                                                               context=context),
            "precision_config": ir.Attribute.parse(f"[{precision}]", context=context)}


def _verifies(op: ir.Operation) -> bool:
    try:
        return op.verify() is not False
    except ir.MLIRError:
        return False
