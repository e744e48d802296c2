"""The shardings XLA's partitioner gives a module's values, for passes that replace ops.

XLA partitions a sharded step by propagating the shardings of its arguments (and any
constraints) through every op, with Shardy; where two shardings meet, the outcome
depends on which op carried each one and when. Shardy propagates in rounds: through
elementwise ops, reshapes and transposes first; then along the dimensions an op passes
through unchanged (a scatter's or gather's batch dimensions), broadcasts only backward;
then through everything. An op a pass writes in place of another can carry a sharding in
a later round than the op it replaces, and so change the plan: the mixed modes' select
in place of the label pick's scatter carries the token batch's sharding only through a
broadcast, so a decoder's backward pass takes the embedding table's model-dimension
sharding instead, and every layer's weights stay sharded while its activations are
summed across devices (issue 48).

So a pass that replaces an op in a partitioned module asks ``result_shardings`` what
Shardy gives the op's result in the module as it stands, and puts that sharding on the
value it writes instead (``constrain``: an ``sdy.sharding_constraint`` with every
dimension open, so that propagation may still add to it, as it could to the original).
A copy the pipeline writes of a value whose sharding was given (an argument's,
``fixed_sharding``) gets that sharding as given (passes/keep_shardings.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy

from hlo_amp import jaxlib_internals
from hlo_amp.ir.modules import copy_module, is_public, walk_operations
from hlo_amp.ir.sites import call_prefix, join_names, location_name

_PROBE = "hlo_amp.sharding_probe"
_MESHES = frozenset({"sdy.mesh"})
GIVEN_SHARDINGS = frozenset({"sdy.sharding_constraint", "sdy.reshard"})  # ops giving one


def replica_count(module: ir.Module) -> int:
    """The replicas XLA runs ``module`` on (``mhlo.num_replicas``, 1 where unset)."""
    attributes = module.operation.attributes
    if "mhlo.num_replicas" not in attributes:
        return 1
    return max(1, ir.IntegerAttr(attributes["mhlo.num_replicas"]).value)


def is_partitioned(module: ir.Module) -> bool:
    """Whether XLA partitions ``module`` over several devices (``partition_count``)."""
    return partition_count(module) > 1


def partition_count(module: ir.Module) -> int:
    """The devices XLA partitions ``module`` over: its partitions
    (``mhlo.num_partitions``, as ``jax.jit(...).lower`` writes it), else its largest
    Shardy mesh (a module written by hand), else 1."""
    attributes = module.operation.attributes
    if "mhlo.num_partitions" in attributes:
        partitions = ir.IntegerAttr(attributes["mhlo.num_partitions"]).value
        if partitions > 1:
            return partitions
    largest = 1
    for op in module.body.operations:
        if op.operation.name in _MESHES:
            size = 1
            for axis in sdy.MeshAttr(op.operation.attributes["mesh"]).axes:
                size *= sdy.MeshAxisAttr(axis).size
            largest = max(largest, size)
    return largest


def result_shardings(module: ir.Module, ops: Sequence[ir.Operation]
                     ) -> dict[int, ir.Attribute | None]:
    """By index into ``ops``, the sharding (an ``#sdy.sharding``) Shardy's propagation
    gives each op's first result in ``module`` as it stands, None where it gives none
    (replicated). An op is missing where its sharding cannot be known: the module's
    shardings are not Shardy's (GSPMD's ``mhlo.sharding``), this jaxlib has no Shardy
    pipeline or no ``main`` to start from, the propagation failed, or the op is in a
    private function whose call sites give it different shardings."""
    body = [op.operation for op in module.body.operations]
    if not any(op.name in _MESHES for op in body) or not any(
            op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main"
            for op in body):
        return {}  # Shardy's pipeline starts at a ``main`` (and aborts without one)
    propagation = jaxlib_internals.shardy_propagation(module.context)
    if propagation is None:
        return {}
    with module.context:
        index_type = ir.IntegerType.get_signless(64)
        for index, op in enumerate(ops):
            op.attributes[_PROBE] = ir.IntegerAttr.get(index_type, index)
        try:  # the propagation writes shardings on every op: a copy, never the module
            copy = copy_module(module)
        finally:
            for op in ops:
                del op.attributes[_PROBE]
        try:
            propagation.run(copy.operation)
        except ir.MLIRError:
            return {}
        seen: dict[int, set[str]] = {}
        for op in walk_operations(copy.operation):
            if _PROBE in op.attributes:
                sharding = ""
                if "sdy.sharding" in op.attributes:
                    per_value = sdy.TensorShardingPerValueAttr(op.attributes["sdy.sharding"])
                    sharding = str(per_value.shardings[0])
                seen.setdefault(ir.IntegerAttr(op.attributes[_PROBE]).value, set()).add(
                    sharding)
        known: dict[int, ir.Attribute | None] = {}
        for index, shardings in seen.items():
            if len(shardings) == 1:
                (text,) = shardings
                known[index] = ir.Attribute.parse(text) if text else None
        return known


def fixed_sharding(value: ir.Value) -> ir.Attribute | None:
    """The sharding ``value`` was given, not propagated: a public function argument's
    ``sdy.sharding``, an ``sdy.sharding_constraint``'s or ``sdy.reshard``'s; else None."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        function = owner.owner.operation
        if (function.name != "func.func" or owner != function.regions[0].blocks[0]
                or not is_public(function.opview)):  # a private one's are not given
            return None
        if "arg_attrs" not in function.attributes:
            return None
        number = ir.BlockArgument(value).arg_number
        attributes = ir.DictAttr(ir.ArrayAttr(function.attributes["arg_attrs"])[number])
        if "sdy.sharding" not in attributes:
            return None
        return attributes["sdy.sharding"]
    if owner.name in GIVEN_SHARDINGS and "sharding" in owner.attributes:
        return owner.attributes["sharding"]
    return None


def leaves_unreduced(op: ir.Operation) -> bool:
    """Whether ``op`` is an ``sdy.sharding_constraint`` or ``sdy.reshard`` whose sharding
    leaves its value ``unreduced`` (partial sums, summed where a later sharding says)."""
    return (op.name in GIVEN_SHARDINGS and "sharding" in op.attributes
            and len(sdy.TensorShardingAttr(op.attributes["sharding"]).unreduced_axes) > 0)


def reads_unreduced(op: ir.Operation) -> bool:
    """Whether ``op``'s first operand is a value ``leaves_unreduced`` made."""
    if not op.operands or isinstance(op.operands[0], ir.BlockArgument):
        return False
    return leaves_unreduced(op.operands[0].owner.operation)


def leaves_an_axis_free(module: ir.Module, sharding: ir.Attribute) -> bool:
    """Whether a mesh axis of more than one device shards no dimension of ``sharding``
    (one the partitioner could give a value that reads it)."""
    tensor = sdy.TensorShardingAttr(sharding)
    used = {sdy.AxisRefAttr(axis).name for dim in tensor.dimension_shardings
            for axis in sdy.DimensionShardingAttr(dim).axes}
    mesh = _mesh(module, str(tensor.mesh_or_ref).lstrip("@"))
    return mesh is None or any(size > 1 and name not in used for name, size in mesh.items())


def _mesh(module: ir.Module, name: str) -> dict[str, int] | None:
    for op in module.body.operations:
        op = op.operation
        if op.name in _MESHES and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return {sdy.MeshAxisAttr(axis).name: sdy.MeshAxisAttr(axis).size
                    for axis in sdy.MeshAttr(op.attributes["mesh"]).axes}
    return None


def constrain(value: ir.Value, sharding: ir.Attribute | None, *, opened: bool = True
              ) -> ir.Value:
    """``value`` behind an ``sdy.sharding_constraint`` to ``sharding`` (at the current
    insertion point), with every dimension open (``opened``: propagation may add axes) or
    as given; ``value`` itself where an opened ``sharding`` would shard nothing."""
    if sharding is None:
        return value
    if opened:
        tensor = sdy.TensorShardingAttr(sharding)
        dims = [sdy.DimensionShardingAttr(d) for d in tensor.dimension_shardings]
        if not any(len(d.axes) for d in dims):
            return value
        sharding = sdy.TensorShardingAttr.get(
            tensor.mesh_or_ref,
            [sdy.DimensionShardingAttr.get(list(d.axes), False) for d in dims])
    return sdy.ShardingConstraintOp(value, sharding).result


def name_shard_map_bodies(module: ir.Module) -> None:
    """Give the ops of each ``jax.shard_map`` body (an ``sdy.manual_computation``'s
    region) the name stack of the manual computation itself. jax names them from the
    body alone (``dot_general``), where the scopes around the ``shard_map``, its
    ``transpose(jvp(...))`` and ``amp_stop`` are on the manual computation's location:
    scope rules, ``backward=`` and ``amp_stop`` missed every op in it (and said "matched
    no op"). Innermost first, so a nested body gets both prefixes; a name that already
    starts with the prefix (a jax that writes the whole stack) is left as it is."""
    manual = walk_operations(module, names=frozenset({"sdy.manual_computation"}))
    for computation in reversed(manual):  # the walk lists an outer one first
        prefix = call_prefix(location_name(computation.location))
        if not prefix:
            continue
        for op in walk_operations(computation):
            location = op.location
            if not isinstance(location, ir.NameLoc):
                continue
            name = location_name(location)
            if not name or name.startswith(f"{prefix}/"):
                continue
            op.location = ir.Location.name(join_names(prefix, name),
                                           childLoc=location.child_loc,
                                           context=location.context)
