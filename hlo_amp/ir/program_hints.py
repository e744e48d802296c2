"""What a backward program split from its forward program cannot see in itself.

``jax.grad`` of a compiled function runs two rewritten programs (runtime/amp_call.py):
the forward, returning the vjp residuals, and the backward, from the residuals and the
incoming cotangents to the gradients. Rewritten alone, the backward program lost two
facts the whole program gives the passes: which values carry the incoming gradient (its
cotangents are arguments, where in a whole program they come from the seed the backward
starts from: hlo_amp/gradients.py) and which backward ops belong to the forward's first
and last matrix ops (passes/insert_converts/call_graph.py ``find_ends``). Under the fp8
preset its gradients were quantised to e4m3fn instead of e5m2 and the ends' backward
dots ran in fp8. The runtime writes both facts into the backward module as attributes
before the passes run; ``run_pipeline`` removes them after.

- ``hlo_amp.incoming_gradient`` (unit, on a public function's argument): the argument
  carries the incoming gradient;
- ``hlo_amp.forward_ends`` (on the module): ``[[scope path, op kind, source call stack,
  position, ...], ...]``, the forward's first and last matrix ops (``EndStacks``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.modules import ModuleError

INCOMING_GRADIENT = "hlo_amp.incoming_gradient"
FORWARD_ENDS = "hlo_amp.forward_ends"
# The devices a program exported for one device is partitioned over once inlined (an
# outer jax.jit with shardings): its module says 1.
CALLER_DEVICES = "hlo_amp.caller_devices"

# (scope path, op kind, source call stack) of a first or last matrix op -> its positions
EndStacks = dict[tuple[str, str, str], tuple[str, ...]]


def mark_backward_program(main: Any, gradient_arguments: Iterable[int],
                          ends: EndStacks) -> None:
    """Write the facts of a backward program into it (``main``: its entry function)."""
    module = main.operation.parent
    with main.context:
        count = len(main.regions[0].blocks[0].arguments)
        attrs = (list(ir.ArrayAttr(main.attributes["arg_attrs"]))
                 if "arg_attrs" in main.attributes else [ir.DictAttr.get({})] * count)
        unit = ir.UnitAttr.get()
        for index in gradient_arguments:
            entries = {named.name: named.attr for named in ir.DictAttr(attrs[index])}
            attrs[index] = ir.DictAttr.get({**entries, INCOMING_GRADIENT: unit})
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
        if ends:
            module.attributes[FORWARD_ENDS] = ir.ArrayAttr.get([
                ir.ArrayAttr.get([ir.StringAttr.get(part) for part in (*key, *positions)])
                for key, positions in ends.items()])


def name_leaves(main: Any, arguments: dict[int, str], results: Sequence[str]) -> None:
    """Name ``main``'s arguments (by position) and its last ``len(results)`` results as
    jax.jit names a function's (an argument's location ``params['w']``, a result's
    ``jax.result_info`` ``result[1]['w']``)."""
    with main.context:
        block = main.regions[0].blocks[0]
        for position, name in arguments.items():
            block.arguments[position].set_location(ir.Location.name(name))
        count = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value
                                    ).results)
        attrs = (list(ir.ArrayAttr(main.attributes["res_attrs"]))
                 if "res_attrs" in main.attributes else [ir.DictAttr.get({})] * count)
        for position, name in zip(range(count - len(results), count), results):
            entries = {named.name: named.attr for named in ir.DictAttr(attrs[position])}
            attrs[position] = ir.DictAttr.get({**entries,
                                               "jax.result_info": ir.StringAttr.get(name)})
        main.attributes["res_attrs"] = ir.ArrayAttr.get(attrs)


def unname_arguments(main: Any) -> None:
    """Take the names off ``main``'s arguments (those of a flat function jax named
    ``primals[0]``, ``args[1]``: a jax.grad's forward or backward program)."""
    with main.context:
        for argument in main.regions[0].blocks[0].arguments:
            argument.set_location(ir.Location.unknown())


def forward_ends(module: ir.Module) -> EndStacks:
    """The forward ends a backward program was given (empty for any other module)."""
    attributes = module.operation.attributes
    if FORWARD_ENDS not in attributes:
        return {}
    ends: EndStacks = {}
    try:
        for entry in ir.ArrayAttr(attributes[FORWARD_ENDS]):
            parts = [ir.StringAttr(part).value for part in ir.ArrayAttr(entry)]
            if len(parts) < 4:
                raise ValueError(parts)
            ends[(parts[0], parts[1], parts[2])] = tuple(parts[3:])
    except ValueError:
        raise ModuleError(
            f"the module's {FORWARD_ENDS} = {attributes[FORWARD_ENDS]}: expected a list "
            f'of ["scope", "op kind", "location", "first_matrix_op" or "last_matrix_op", '
            f"...] entries, as hlo_amp writes it for a backward program "
            f"(tests/lit/backward_program.mlir)") from None
    return ends


def gradient_arguments(fn: Any) -> frozenset[int]:
    """The positions of ``fn``'s arguments marked as carrying the incoming gradient."""
    if "arg_attrs" not in fn.attributes:
        return frozenset()
    return frozenset(index for index, attrs in enumerate(ir.ArrayAttr(fn.attributes["arg_attrs"]))
                     if INCOMING_GRADIENT in ir.DictAttr(attrs))


def mark_caller_devices(module: ir.Module, devices: int) -> None:
    """Write that ``module``, exported for one device, runs partitioned over ``devices``
    in its caller's program."""
    module.operation.attributes[CALLER_DEVICES] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64, context=module.context), devices)


def caller_devices(module: ir.Module) -> int:
    """The devices ``mark_caller_devices`` wrote (1 where it wrote nothing)."""
    attributes = module.operation.attributes
    return ir.IntegerAttr(attributes[CALLER_DEVICES]).value if CALLER_DEVICES in attributes else 1


def strip_program_hints(module: ir.Module) -> None:
    """Remove the facts: the rewritten module carries no hlo_amp attribute."""
    attributes = module.operation.attributes
    for name in (FORWARD_ENDS, CALLER_DEVICES):
        if name in attributes:
            del attributes[name]
    with module.context:
        for op in module.body.operations:
            if op.operation.name != "func.func" or "arg_attrs" not in op.attributes:
                continue
            attrs = list(ir.ArrayAttr(op.attributes["arg_attrs"]))
            if not any(INCOMING_GRADIENT in ir.DictAttr(a) for a in attrs):
                continue
            op.attributes["arg_attrs"] = ir.ArrayAttr.get([
                ir.DictAttr.get({named.name: named.attr for named in ir.DictAttr(a)
                                 if named.name != INCOMING_GRADIENT}) for a in attrs])
