"""The ``hlo_amp_call`` primitive: a rewritten program that composes with JAX transforms.

A compiled function called with tracers binds ``amp_call_p`` with a ``Program``: a
function of flat array leaves. The rules answer each transformation with a new program
that is exported and rewritten in turn, never with the unrewritten function:

- ``vmap``: the program ``vmap(fn)`` over the batched axes;
- ``jvp``, ``linearize``, ``grad``: a forward program that returns the outputs and the
  vjp residuals, plus ``amp_lin_p``, linear in the tangents. Transposing it runs the
  rewritten backward program on the residuals (reverse mode never recomputes the
  forward); evaluating it forward runs the rewritten ``jvp(fn)``;
- lowering: the rewritten exported module, inlined with ``Exported.call``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from hlo_amp import jax_internals as internals

# shape, dtype, weak type, sharding in the type (Explicit mesh axes) or None
AvalsKey = tuple[tuple[tuple[int, ...], np.dtype, bool, Any], ...]


class ProgramOwner(Protocol):
    """What a Program needs from the compiled function it came from (its store of
    programs, runtime/compile.py's ProgramStore, never the function itself)."""

    def export_program(self, program: Program, avals: AvalsKey,
                       platforms: tuple[str, ...] | None = None, devices: int = 1) -> Any: ...

    def out_avals(self, program: Program, avals: AvalsKey) -> list: ...

    def residual_tree(self, program: Program, avals: AvalsKey) -> Any: ...

    def residual_avals(self, program: Program, avals: AvalsKey) -> tuple: ...

    def record_residuals(self, program: Program, avals: AvalsKey, tree: Any,
                         residual_avals: tuple) -> None: ...

    def checked_program(self, key: Any, avals: AvalsKey,
                        make: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]: ...


@dataclasses.dataclass(frozen=True)
class BackwardOf:
    """A backward program's forward: the program that returned its residuals, for the
    primals' ``avals``; its arguments are ``residuals`` residuals, then the incoming
    cotangents (ir/program_hints.py says why the passes need to know)."""

    forward: Program
    avals: AvalsKey
    residuals: int


class Program:
    """A function of flat array leaves returning a list of leaves, run rewritten.

    Equal programs (same owner, same key) compute the same function, so JAX's caches
    keyed on primitive parameters hit across calls.
    """

    __slots__ = ("argument_names", "backward_of", "fn", "key", "name", "owner")

    def __init__(self, owner: ProgramOwner, fn: Callable[..., list], name: str, key: Any,
                 backward_of: BackwardOf | None = None,
                 argument_names: Sequence[str] | None = None):
        self.owner = owner
        self.fn = fn
        self.name = name
        self.key = key
        self.backward_of = backward_of
        # jax.jit's names of fn's arguments (``params['w']``), where fn is a call's
        # whole function: written into its export, whose are ``args[i]``
        self.argument_names = argument_names

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Program) and self.owner is other.owner
                and self.key == other.key)

    def __hash__(self) -> int:
        return hash((id(self.owner), self.key))

    def __repr__(self) -> str:
        return f"Program({self.name})"

    def derive(self, tag: Any, fn: Callable[..., list], name: str,
               backward_of: BackwardOf | None = None) -> Program:
        return Program(self.owner, fn, name, (tag, self.key), backward_of)

    def exported(self, avals: AvalsKey, platforms: tuple[str, ...] | None = None,
                 devices: int = 1) -> Any:
        """The rewritten export for ``avals``, for ``platforms`` (None: jax's default),
        for a caller partitioned over ``devices``."""
        return self.owner.export_program(self, avals, platforms, devices)


def avals_key(values: Sequence[Any]) -> AvalsKey:
    """(shape, dtype, weak type, ``explicit_sharding``) of each value or abstract value:
    the export cache key.

    The weak type matters: a Python scalar times a bf16 array stays bf16 under jax.jit.
    """
    out = []
    for value in values:
        aval = value if isinstance(value, internals.ShapedArray) else jax.typeof(value)
        out.append((tuple(aval.shape), _dtype_key(aval.dtype), bool(aval.weak_type),
                    explicit_sharding(aval)))
    return tuple(out)


def explicit_sharding(aval: Any) -> Any:
    """The sharding in ``aval``'s type where its mesh has Explicit axes (jax.make_mesh's
    default), on the abstract mesh; else None. Such a type decides what the function
    traces to: shard_map checks its in_specs against it, a dot's result sharding and
    ``jax.typeof`` follow it."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not mesh.explicit_axes:
        return None
    abstract = getattr(mesh, "abstract_mesh", mesh)  # a concrete Mesh's abstract one
    return sharding if abstract is mesh else jax.sharding.NamedSharding(abstract,
                                                                         sharding.spec)


def _dtype_key(dtype: Any) -> Any:
    """A hashable dtype: numpy's for array dtypes, JAX's own for extended ones (PRNG key
    types such as ``key<fry>``, which numpy cannot interpret)."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def shape_structs(avals: AvalsKey) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak, sharding=sharding)
            for shape, dtype, weak, sharding in avals]


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


# ---- amp_call_p --------------------------------------------------------------------------

amp_call_p = internals.Primitive("hlo_amp_call")
amp_call_p.multiple_results = True


def _call(*args: Any, program: Program) -> Any:
    with _devices_named(program):
        return program.exported(avals_key(args)).call(*args)


@contextlib.contextmanager
def _devices_named(program: Program) -> Iterator[None]:
    """jax's refusal of a program exported for several devices (a ``shard_map``'s mesh)
    in a context of one, which uncommitted arguments outside ``jax.set_mesh`` make,
    said with the ways out (jax names only its own ``_forward_with_residuals``)."""
    try:
        yield
    except ValueError as error:
        found = _DEVICE_COUNTS.search(str(error))
        if found is None:
            raise
        name = program.name
        while (inner := re.fullmatch(r"\w+\((.*)\)", name)) is not None:
            name = inner.group(1)  # fwd(step): the compiled function's own name
        raise ValueError(
            f"hlo_amp.compile({name}) runs on {found.group(1)} devices (a shard_map's mesh) and is "
            f"called under a transformation (jax.grad, jax.vmap, ...) in a context of "
            f"{found.group(2)}: give it arrays placed on those devices (jax.device_put(x, "
            f"NamedSharding(mesh, P()))), or trace it under jax.set_mesh(mesh); called "
            f"directly it runs as it is") from None


_DEVICE_COUNTS = re.compile(r"was exported for (\d+) devices and is called in a context "
                            r"with (\d+) devices")


def _abstract_eval(*avals: Any, program: Program) -> list:
    # Inside jax.shard_map an output varies along the manual axes its inputs vary along,
    # as a jax.jit's does (typed invariant, the residuals of a replicated weight's
    # gradient were device 0's on every device).
    varying = _varying_along(avals)
    outs = program.owner.out_avals(program, avals_key(avals))
    return [internals.with_varying(out, varying) for out in outs] if varying else outs


def _varying_along(values: Sequence[Any]) -> frozenset:
    """The manual (shard_map) axes any of ``values`` varies along."""
    return frozenset().union(*(internals.varying_axes(
        value if isinstance(value, internals.ShapedArray) else jax.typeof(value))
        for value in values))


def vary_alike(values: Sequence[Any]) -> list:
    """``values`` each made to vary along every manual axis one of them varies along, as
    jax does to a primitive's operands inside shard_map: the transpose of that cast sums
    an invariant operand's cotangent over the axes (a replicated weight's gradient)."""
    varying = _varying_along(values)
    if not varying:
        return list(values)
    return [value if varying <= (missing := _varying_along([value])) else jax.lax.pcast(
        value, tuple(sorted(varying - missing)), to="varying") for value in values]


def _lower(ctx: Any, *args: Any, program: Program) -> Any:
    """The export for the platforms being lowered for (``jax.export`` with ``platforms=``,
    ``lowering_platforms=``, a GPU target), inlined with ``Exported.call``."""
    platforms = tuple(ctx.module_context.platforms)
    devices = _partitioned_devices(ctx.module_context.axis_context)

    def call(*values: Any) -> Any:
        return program.exported(avals_key(values), platforms, devices).call(*values)

    with _devices_named(program):
        return internals.lower_fun(call, multiple_results=True)(ctx, *args)


def _partitioned_devices(axis_context: Any) -> int:
    """The devices XLA's partitioner splits the caller's program over (jax.jit with
    shardings: a ShardingContext; a mesh's axes not manual: an SPMDAxisContext), 1 in a
    program of one device or a shard_map body (manual: per device)."""
    devices = getattr(axis_context, "num_devices", None)
    if devices is not None:
        return int(devices)
    mesh = getattr(axis_context, "mesh", None)
    if mesh is None:
        return 1
    manual = getattr(axis_context, "manual_axes", frozenset())
    return math.prod(size for name, size in mesh.shape.items() if name not in manual)


amp_call_p.def_impl(_call)
amp_call_p.def_abstract_eval(_abstract_eval)
internals.register_lowering(amp_call_p, _lower)


def _vmapped(fn: Callable[..., list], in_axes: tuple, out_axes: tuple | int, size: int,
             axis_name: Any, *args: Any) -> list:
    # fn returns a list: vmap reads a list of axes as its pytree prefix
    axes = out_axes if isinstance(out_axes, int) else list(out_axes)
    return jax.vmap(fn, in_axes=in_axes, out_axes=axes, axis_size=size,
                    axis_name=axis_name)(*args)


def _example(value: Any, axis: int | None) -> jax.ShapeDtypeStruct:
    """One example of a vmapped argument (``axis``: its batch axis, None: unbatched)."""
    aval = jax.typeof(value)
    shape = tuple(n for i, n in enumerate(aval.shape) if i != axis)
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type)


def _batched_outputs(fn: Callable[..., list], args: Sequence[Any], in_axes: tuple,
                     axis_name: str | None = None, size: int | None = None
                     ) -> tuple[bool, ...] | None:
    """Per output of ``fn``: whether it depends on a batched argument (else it is the
    same for every example, and vmap may return it unbatched: ``out_axes=None``). None
    where ``fn`` cannot be traced alone. It is traced with the vmap's named axis bound:
    a sum or gather over that axis (``psum``, ``pmean``, ``all_gather``) is the same for
    every example, as jax.jit's vmap gives it; an ``axis_index`` of the axis is
    batched: it varies along the axis with no batched input."""
    env = [(axis_name, size)] if axis_name is not None and size is not None else None
    try:
        jaxpr = jax.make_jaxpr(fn, axis_env=env)(*map(_example, args, in_axes)).jaxpr
    except Exception:  # noqa: BLE001
        return None
    batched = {v for v, d in zip(jaxpr.invars, in_axes) if d is not None}
    for eqn in jaxpr.eqns:
        if axis_name is not None and _over_axis(eqn, axis_name, _SAME_ALONG_AXIS):
            continue
        if any(not isinstance(v, Literal) and v in batched for v in eqn.invars) or (
                axis_name is not None and (_indexes_axis(eqn, axis_name)
                                           or _over_axis(eqn, axis_name, _VARY_ALONG_AXIS))):
            batched.update(eqn.outvars)
    return tuple(not isinstance(v, Literal) and v in batched for v in jaxpr.outvars)


# Collectives whose result is the same at every index of the axes they run over, and
# those whose result differs at each (a scatter's share, a permutation), whatever they
# read.
_SAME_ALONG_AXIS = frozenset({"psum", "pmax", "pmin", "all_gather", "psum_invariant"})
_VARY_ALONG_AXIS = frozenset({"reduce_scatter", "ppermute", "all_to_all"})


def _axis_names(eqn: Any) -> tuple:
    """The named axes ``eqn`` runs over (a collective's ``axes``, an ``axis_index``'s or
    gather's ``axis_name``); none for another op."""
    names = eqn.params.get("axes", eqn.params.get("axis_name"))
    return () if names is None else names if isinstance(names, tuple) else (names,)


def _over_axis(eqn: Any, axis_name: str, primitives: frozenset[str]) -> bool:
    """Whether ``eqn`` is one of ``primitives`` run over ``axis_name``."""
    return eqn.primitive.name in primitives and axis_name in _axis_names(eqn)


def _eqns_within(eqn: Any) -> Iterator[Any]:
    """The equations of the jaxprs in ``eqn``'s parameters (a nested jit, a scan body, a
    shard_map's), at any depth."""
    pending = list(eqn.params.values())
    while pending:
        value = pending.pop()
        if isinstance(value, (tuple, list)):
            pending.extend(value)
            continue
        for inner in getattr(getattr(value, "jaxpr", value), "eqns", ()):
            yield inner
            pending.extend(inner.params.values())


def collective_axes(jaxpr: Any) -> set:
    """The axis names the collectives of ``jaxpr`` run over, at any depth of nested
    jaxprs (a shard_map's own mesh axes aside)."""
    return {name for top in jaxpr.eqns for eqn in (top, *_eqns_within(top))
            if eqn.primitive.name != "shard_map" for name in _axis_names(eqn)}


def _indexes_axis(eqn: Any, axis_name: str) -> bool:
    """Whether ``eqn`` is ``lax.axis_index(axis_name)`` or holds one in a jaxpr of its
    parameters (a nested jit, a scan body)."""
    return any(_over_axis(e, axis_name, _AXIS_INDEX) for e in (eqn, *_eqns_within(eqn)))


_AXIS_INDEX = frozenset({"axis_index"})


def _batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], *,
           program: Program) -> tuple[list, list]:
    in_axes = tuple(dims)
    # Only a string name can be used inside the exported program (psum over "batch");
    # JAX's anonymous axes are fresh objects, which would defeat the export cache.
    axis_name = axis_data.name if isinstance(axis_data.name, str) else None
    # An output no batched argument reaches stays unbatched, as under jax.jit (a caller's
    # out_axes=None asks for that).
    found = (_batched_outputs(program.fn, args, in_axes, axis_name, axis_data.size)
             if axis_name is not None or any(d is not None for d in in_axes) else None)
    if all(d is None for d in in_axes) and not any(found or ()):
        # Nothing batched here (jacfwd's primal pass), nor an axis_index of the axis.
        outs = amp_call_p.bind(*args, program=program)
        return outs, [None] * len(outs)
    out_axes = tuple(0 if b else None for b in found) if found is not None else None
    batched = program.derive(
        ("vmap", in_axes, out_axes, axis_data.size, axis_name),
        functools.partial(_vmapped, program.fn, in_axes, 0 if out_axes is None else out_axes,
                          axis_data.size, axis_name),
        f"vmap({program.name})")
    outs = amp_call_p.bind(*args, program=batched)
    return outs, list(out_axes) if out_axes is not None else [0] * len(outs)


internals.fancy_primitive_batchers[amp_call_p] = _batch


def _forward_with_residuals(program: Program, *primals: Any) -> list:
    outs, vjp_fn = jax.vjp(program.fn, *primals)
    residuals, tree = jax.tree_util.tree_flatten(vjp_fn)
    program.owner.record_residuals(program, avals_key(primals), tree,
                                   tuple(jax.typeof(r) for r in residuals))
    return [*outs, *residuals]


_FORWARD = "fwd"


def _forward_program(program: Program) -> Program:
    """``program``'s outputs and its vjp residuals, as one program."""
    return program.derive(_FORWARD, functools.partial(_forward_with_residuals, program),
                          f"fwd({program.name})")


def is_forward_program(program: Program) -> bool:
    """Whether ``program`` returns another's outputs and vjp residuals: the forward a
    backward program may be split from (its ends are what the backward is told)."""
    return program.key[0] == _FORWARD


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
         program: Program) -> tuple[list, list]:
    nonzero_in = tuple(type(t) is not internals.Zero and _is_float(jax.typeof(p).dtype)
                       for p, t in zip(primals, tangents))
    outs_and_residuals = amp_call_p.bind(*primals, program=_forward_program(program))
    tree = program.owner.residual_tree(program, avals_key(primals))
    n_out = len(outs_and_residuals) - tree.num_leaves
    outs, residuals = outs_and_residuals[:n_out], outs_and_residuals[n_out:]
    out_avals = tuple(jax.typeof(o) for o in outs)
    float_out = tuple(_is_float(a.dtype) for a in out_avals)
    if not any(float_out):
        return outs, [internals.Zero(a.to_tangent_aval()) for a in out_avals]
    live_tangents = [internals.instantiate_zeros(t)
                     for t, nonzero in zip(tangents, nonzero_in) if nonzero]
    tangents_out = iter(amp_lin_p.bind(
        *primals, *residuals, *live_tangents, program=program, residual_tree=tree,
        nonzero_in=nonzero_in, out_avals=out_avals))
    return outs, [next(tangents_out) if is_float else internals.Zero(a.to_tangent_aval())
                  for a, is_float in zip(out_avals, float_out)]


internals.primitive_jvps[amp_call_p] = _jvp


def _not_transposable(cts: Any, *args: Any, program: Program) -> Any:
    # Linear or not, the compiled call is one opaque primitive to jax: it cannot read
    # off its transpose (it called a linear map "not linear").
    raise TypeError(
        f"hlo_amp: jax.linear_transpose cannot transpose a call of the compiled "
        f"{program.name}: jax sees it as one primitive without a transpose rule: compile "
        f"the outer function instead (hlo_amp.compile(outer, policy)), or transpose the "
        f"linear map jax.linearize(compiled, x)[1] returns")


internals.primitive_transposes[amp_call_p] = _not_transposable


# ---- checkify: the program with its checks, rewritten -------------------------------------


def _checked(program: Program, enabled_errors: Any, avals: AvalsKey) -> tuple[Any, Any]:
    """``program.fn``'s jaxpr checked for ``enabled_errors`` from the empty error: it takes
    the function's arguments and returns ``(error, outputs)`` flat; and that tree. Traced
    once per program and avals (the store keeps it): checkify numbers each error as it
    is traced, and the error the rule returns must know the numbers the program
    computes."""
    def make() -> tuple[Any, Any]:
        closed = jax.make_jaxpr(lambda *args: program.fn(*args))(*shape_structs(avals))
        empty = jax.tree_util.tree_structure(internals.checkify_init_error)
        checked, out_tree, _ = internals.jaxpr_to_checkify_jaxpr(
            closed, enabled_errors, empty, *closed.in_avals)
        return checked, out_tree

    return program.owner.checked_program((("checkify", enabled_errors), program.key),
                                         avals, make)


def _run_checked(program: Program, enabled_errors: Any, *values: Any) -> list:
    checked, _ = _checked(program, enabled_errors, avals_key(values))
    return internals.eval_jaxpr(checked.jaxpr, checked.consts, *values)


def _checkify(error: Any, enabled_errors: Any, *args: Any, program: Program) -> tuple:
    """checkify's rule: the program with checkify's checks, exported and rewritten as
    a program (it saw one opaque call: a NaN made inside was no error, and a
    ``checkify.check`` inside raised "not functionalized"). The program starts from the
    empty error, so one export serves every call; its error joins the incoming one
    here, the incoming first, as checkify keeps the first error."""
    _, out_tree = _checked(program, enabled_errors, avals_key(args))
    checked = program.derive(("checkify", enabled_errors),
                             functools.partial(_run_checked, program, enabled_errors),
                             f"checkify({program.name})")
    found, outs = jax.tree_util.tree_unflatten(out_tree, amp_call_p.bind(*args,
                                                                         program=checked))
    # checkify reports the failed check of the lowest number, numbers given as it traces:
    # the program's were given when it was first traced, so they are numbered again
    # here, after the checks traced before this call and before those after it.
    numbers = {old: internals.checkify_next_code() for old in sorted(found._metadata)}
    metadata = {numbers[old]: tree for old, tree in found._metadata.items()}
    for effect, failed in found._pred.items():
        code = found._code[effect]
        for old, new in numbers.items():
            code = jnp.where(code == old, new, code)
        error = internals.checkify_update_error(error, failed, code, metadata,
                                                found._payload[effect], effect)
    return error, outs


if None not in (internals.checkify_rules, internals.jaxpr_to_checkify_jaxpr,
                internals.checkify_init_error, internals.checkify_update_error,
                internals.checkify_next_code):
    internals.checkify_rules[amp_call_p] = _checkify


# ---- amp_lin_p: the tangent map at a point -----------------------------------------------
# Arguments: the primals (n), the vjp residuals, the nonzero tangents.

amp_lin_p = internals.Primitive("hlo_amp_linear")
amp_lin_p.multiple_results = True


def _tangent_map(program: Program, nonzero_in: tuple, float_out: tuple, *args: Any) -> list:
    primals, tangents = list(args[:len(nonzero_in)]), args[len(nonzero_in):]
    moving = [i for i, nonzero in enumerate(nonzero_in) if nonzero]

    # Differentiated in the arguments with a tangent only, the others closed over: jax
    # keeps their tangents symbolic zeros, as jax.jvp of fn itself does. As zero arrays
    # they were computed with (x @ 0), a form XLA:CPU (jaxlib 0.10.2) miscompiled under
    # vmap: jax.jacfwd of a compiled function returned values of 1e10 or NaN.
    def of_moving(*values: Any) -> Any:
        full = list(primals)
        for i, value in zip(moving, values):
            full[i] = value
        return program.fn(*full)

    _, tangents_out = jax.jvp(of_moving, tuple(primals[i] for i in moving), tuple(tangents))
    return [t for t, is_float in zip(tangents_out, float_out) if is_float]


def _as_traced(value: Any, aval: Any) -> Any:
    """``value`` (a residual read back from the forward program) in the type the forward
    traced it with. A residual made inside ``jax.sharding.auto_axes`` has a type on the
    Auto mesh, which a program's output loses to the caller's Explicit mesh; the vjp
    ends then mix meshes ("context mesh ... should match the aval mesh")."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    current = getattr(jax.typeof(value).sharding, "mesh", None)
    if mesh is None or mesh.empty or current is None or current.empty or mesh == current:
        return value
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.reshard(value, aval.sharding.spec)


def _cotangent_map(residual_tree: Any, residual_avals: tuple, nonzero_in: tuple,
                   out_avals: tuple, *args: Any) -> list:
    n_residuals = len(residual_avals)
    vjp_fn = jax.tree_util.tree_unflatten(
        residual_tree, list(map(_as_traced, args[:n_residuals], residual_avals)))
    live = iter(args[n_residuals:])
    cotangents = [next(live) if _is_float(a.dtype)
                  else np.zeros(a.shape, jax.dtypes.float0) for a in out_avals]
    cotangents_in = vjp_fn(cotangents)
    return [ct for ct, nonzero in zip(cotangents_in, nonzero_in) if nonzero]


def _split_lin_args(args: Sequence[Any], residual_tree: Any, nonzero_in: tuple
                    ) -> tuple[list, list, list]:
    n, r = len(nonzero_in), residual_tree.num_leaves
    return list(args[:n]), list(args[n:n + r]), list(args[n + r:])


def _tangent_program(program: Program, nonzero_in: tuple, out_avals: tuple) -> Program:
    float_out = tuple(_is_float(a.dtype) for a in out_avals)
    return program.derive(
        ("jvp", nonzero_in, float_out),
        functools.partial(_tangent_map, program, nonzero_in, float_out),
        f"jvp({program.name})")


def _lin_abstract_eval(*avals: Any, program: Program, residual_tree: Any,
                       nonzero_in: tuple, out_avals: tuple) -> list:
    return [a.to_tangent_aval() for a in out_avals if _is_float(a.dtype)]


def _lin_call(*args: Any, program: Program, residual_tree: Any, nonzero_in: tuple,
              out_avals: tuple) -> Any:
    primals, _, tangents = _split_lin_args(args, residual_tree, nonzero_in)
    return amp_call_p.bind(*primals, *tangents,
                           program=_tangent_program(program, nonzero_in, out_avals))


def _lin_batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], *,
               program: Program, residual_tree: Any, nonzero_in: tuple,
               out_avals: tuple) -> tuple[list, list]:
    # Under vmap the map is evaluated, not transposed: batch jvp(fn) itself.
    primals, _, tangents = _split_lin_args(args, residual_tree, nonzero_in)
    primal_dims, _, tangent_dims = _split_lin_args(dims, residual_tree, nonzero_in)
    return _batch(axis_data, [*primals, *tangents], [*primal_dims, *tangent_dims],
                  program=_tangent_program(program, nonzero_in, out_avals))


def _lin_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, program: Program,
             residual_tree: Any, nonzero_in: tuple, out_avals: tuple) -> tuple[list, list]:
    # Second order (jvp of jvp): differentiate the tangent map as a program of its own.
    args, _, live = _split_lin_args(primals, residual_tree, nonzero_in)
    dargs, _, dlive = _split_lin_args(tangents, residual_tree, nonzero_in)
    return _jvp([*args, *live], [*dargs, *dlive],
                program=_tangent_program(program, nonzero_in, out_avals))


def _lin_transpose(cotangents: Sequence[Any], *args: Any, program: Program,
                   residual_tree: Any, nonzero_in: tuple, out_avals: tuple) -> list:
    primals, residuals, _ = _split_lin_args(args, residual_tree, nonzero_in)
    residual_avals = program.owner.residual_avals(program, avals_key(primals))
    backward = program.derive(
        ("vjp", residual_tree, residual_avals, nonzero_in),
        functools.partial(_cotangent_map, residual_tree, residual_avals, nonzero_in,
                          out_avals),
        f"vjp({program.name})",
        BackwardOf(_forward_program(program), avals_key(primals), len(residuals)))
    live = [internals.instantiate_zeros(ct) for ct in cotangents]
    cotangents_in = amp_call_p.bind(*residuals, *live, program=backward)
    return [None] * (len(primals) + len(residuals)) + list(cotangents_in)


amp_lin_p.def_impl(_lin_call)
amp_lin_p.def_abstract_eval(_lin_abstract_eval)
internals.register_lowering(amp_lin_p, internals.lower_fun(_lin_call, multiple_results=True))
internals.fancy_primitive_batchers[amp_lin_p] = _lin_batch
internals.primitive_jvps[amp_lin_p] = _lin_jvp
internals.primitive_transposes[amp_lin_p] = _lin_transpose
