"""Reading and writing StableHLO modules; the one place an MLIR context is made."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator
from types import MappingProxyType, TracebackType
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp import jaxlib_internals
from hlo_amp.ir import input_checks
from hlo_amp.ir.op_classes import MATRIX_OP_NAMES

# MLIR element types as numpy holds them (i1: bool).
NUMPY_TYPES: MappingProxyType[str, type] = MappingProxyType({
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
    "i64": np.int64, "i32": np.int32, "i16": np.int16, "i8": np.int8,
    "ui64": np.uint64, "ui32": np.uint32, "ui16": np.uint16, "ui8": np.uint8,
    "i1": np.bool_})


class ModuleError(ValueError):
    """A module that could not be read, or that the pass cannot work on."""


class PassError(ModuleError):
    """A pass failed on a module it should have handled: a bug in hlo_amp, never the
    user's input. Names the pass and the op it was working on."""

    def __init__(self, pass_name: str, op: str | None, detail: str) -> None:
        self.pass_name, self.op, self.detail = pass_name, op, detail
        where = f" at {op}" if op else ""
        super().__init__(f"internal error in pass {pass_name}{where}: {detail}")


# ---- holding IR safely ----------------------------------------------------------------
#
# The bindings hand out Python objects that point into the module's C++ memory. Two
# things about them decide how the passes are written (docs/design.md, "How the passes
# hold IR"):
# - An ``ir.Operation``'s hash is a hash of its contents (name, attributes, operand and
#   result types), so it changes when a pass edits the op: an op is never a dict key or a
#   set element; ``op_key`` (its address) is. A value's hash is its address.
# - Erasing an op frees it; a Python object still pointing at it, or at one of its
#   results, reads freed memory when used (a segfault, or a silently wrong answer when
#   a new op reuses the address). So no pass erases: it ``discard``s an op it has made
#   dead, and ``run_pass`` erases the discarded ops after the pass has returned, when
#   none of its objects is left (cleanup also between its steps, each a function that
#   has returned). Nothing is freed while a pass runs, so every map it
#   keys by values or ops stays true for the whole pass.

DISCARDED_KEY = "hlo_amp.discarded"


class _Pending(threading.local):
    def __init__(self) -> None:
        self.ops: list[ir.Operation] = []


_PENDING = _Pending()


def op_key(op: ir.Operation | ir.OpView) -> int:
    """A dict key for ``op`` that stays the same while it lives: its address."""
    return jaxlib_internals.operation_address(op.operation)


def discard(op: ir.Operation | ir.OpView) -> None:
    """Mark ``op``, whose results the pass no longer uses, for erasure once the pass has
    returned (``erase_discarded``). Until then it stays in its block; readers of use
    lists skip it with ``is_discarded``."""
    operation = op.operation
    if DISCARDED_KEY in operation.attributes:  # twice: listed twice, it was erased twice
        return
    operation.attributes[DISCARDED_KEY] = ir.UnitAttr.get(operation.context)
    _PENDING.ops.append(operation)


def is_discarded(op: ir.Operation | ir.OpView) -> bool:
    return DISCARDED_KEY in op.operation.attributes


def live_uses(value: ir.Value) -> Iterator[ir.OpOperand]:
    """The uses of ``value`` by ops not discarded."""
    return (use for use in value.uses if not is_discarded(use.owner))


def drop_discarded() -> None:
    """Forget the ops discarded so far, unerased (a pass failed: its module is dropped)."""
    _PENDING.ops = []


def erase_discarded(pass_name: str) -> int:
    """Erase every op ``discard`` marked since the last call; how many. Ops nested in
    others go first (erasing an op frees what it holds), then each op once nothing
    reads its results. A discarded op that is still read raises PassError, naming it
    and its reader, instead of leaving a reader of freed memory."""
    pending, _PENDING.ops = _PENDING.ops, []
    pending.sort(key=_depth, reverse=True)
    erased = 0
    while pending:
        kept = []
        for operation in pending:
            if any(True for result in operation.results for _ in result.uses):
                kept.append(operation)
            else:
                operation.erase()
                erased += 1
        if len(kept) == len(pending):
            operation = kept[0]
            reader = next(use.owner for result in operation.results for use in result.uses)
            raise PassError(pass_name, describe_op(operation),
                            f"it discarded this op, but {describe_op(reader)} still reads it")
        pending = kept
    return erased


def _depth(operation: ir.Operation) -> int:
    """How many ops enclose ``operation``."""
    level, parent = 0, operation.parent
    while parent is not None:
        level, parent = level + 1, parent.parent
    return level


def describe_op(op: ir.Operation | ir.OpView) -> str:
    """``op``'s name and location, in one line, for an error message."""
    operation = op.operation
    location = str(operation.location)
    if len(location) > 160:
        location = location[:157] + "..."
    return f"{operation.name} {location}"


def op_in_traceback(traceback: TracebackType | None) -> str | None:
    """The op the innermost frame of ``traceback`` that holds one was working on
    (a local that is an ``ir.Operation`` or ``ir.OpView``), described; None if none."""
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, (ir.Operation, ir.OpView)):
                try:
                    return describe_op(value)
                except RuntimeError:  # an op the bindings know is gone
                    continue
    return None


def new_context(threads: bool = True) -> ir.Context:
    """An MLIR context with the dialects JAX lowers to (stablehlo, chlo, func, sdy...);
    ``threads=False`` for one used in a forked child (``make_ir_context``)."""
    return jaxlib_internals.make_ir_context(threads)


_DIAG_LOC = re.compile(r'^loc\("([^"]*)":(\d+):(\d+)')


def _first_diagnostic(error: ir.MLIRError, source_name: str) -> str:
    diagnostics = list(getattr(error, "error_diagnostics", []) or [])
    if diagnostics:
        diag = diagnostics[0]
        match = _DIAG_LOC.match(str(diag.location))
        where = source_name  # line 0 (bytecode, no position) is no position at all
        if match and match.group(2) != "0":
            where = f"{source_name}:{match.group(2)}:{match.group(3)}"
        return f"{where}: error: {diag.message.strip()}"
    text = " ".join(str(error).split("\n")[1:2]).strip() or str(error).strip()
    text = text.removeprefix("error: ").replace('"-":', f"{source_name}:")
    return f"{source_name}: error: {text}"


def parse_module(source: str | bytes, *, source_name: str = "<input>",
                 context: ir.Context | None = None) -> ir.Module:
    """Parse StableHLO text, MLIR bytecode or a StableHLO portable artifact, refusing in
    one line what jaxlib's bindings cannot read without ending the process
    (ir/input_checks.py)."""
    context = context or new_context()
    if isinstance(source, bytes) and not source.startswith(b"ML\xefR"):
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError:
            raise ModuleError(
                f"{source_name}: error: not MLIR text or bytecode (binary data without "
                f"the MLIR bytecode header); accepted: StableHLO text (.mlir) or bytecode"
            ) from None
    if isinstance(source, str) and not source.strip():
        raise ModuleError(
            f"{source_name}: error: the input is empty; expected a StableHLO module"
        )
    if isinstance(source, str) and "\0" in source:
        # MLIR's lexer skips a NUL as blank: NULs alone read as an empty module, a NUL
        # inside one drops a character unseen.
        line = source.count("\n", 0, source.index("\0")) + 1
        raise ModuleError(
            f"{source_name}:{line}: error: not MLIR text (a NUL byte); accepted: StableHLO "
            f"text (.mlir) or bytecode"
        )
    portable = isinstance(source, bytes) and _is_portable(source)
    if isinstance(source, bytes):
        if portable:
            _import_jax()  # before the fork: the child only reads
        # Corrupted bytecode can abort the process, a corrupted artifact segfault it:
        # read it in a child process first.
        killed = input_checks.signal_reading(
            lambda: _read_bytes(source, portable, new_context(threads=False)))
        if killed is not None:
            what = "StableHLO portable artifact" if portable else "MLIR bytecode"
            raise ModuleError(f"{source_name}: error: unreadable {what} (reading it ended a "
                              f"process with {killed}: a corrupted file)")
    else:
        _raise_if(input_checks.nesting_problem(source), source_name)
    try:
        if portable:
            module = _deserialize_portable(source, source_name, context)
        else:
            module = ir.Module.parse(source, context=context)
    except ModuleError:
        raise
    except ir.MLIRError as error:
        raise ModuleError(_first_diagnostic(error, source_name)) from None
    except Exception as error:  # noqa: BLE001 - bytecode rejected without a diagnostic
        raise ModuleError(f"{source_name}: error: unreadable module ({error})") from None
    try:
        module.operation.verify()
    except ir.MLIRError as error:
        raise ModuleError(_first_diagnostic(error, source_name)) from None
    if isinstance(source, bytes) or "\\" in source:  # else no name can hold a bad byte
        _raise_if(input_checks.name_problem(module), source_name)
    _raise_if(input_checks.attribute_problem(module), source_name)
    _raise_if(input_checks.recursion_problem(_callees(module)), source_name)
    if isinstance(source, bytes) or "hlo_amp." in source:
        strip_marks(module, RUN_MARKS)
    if not public_functions(module):
        raise ModuleError(
            f"{source_name}: error: the module has no public func.func; expected a "
            f"module with an entry function such as @main"
        )
    return module


def _callees(module: ir.Module) -> dict[str, list[str]]:
    """Each function's callees by symbol name: its calls' and its composites'
    decompositions (a cycle through a composite recursed in the passes as a call's did)."""
    return {function_name(fn): [body_name(op) for op in
                                walk_operations(fn, names=frozenset(BODY_ATTRIBUTE))]
            for fn in functions(module)}


def _raise_if(problem: str | None, source_name: str) -> None:
    if problem is not None:
        raise ModuleError(f"{source_name}: error: {problem}")


def _read_bytes(data: bytes, portable: bool, context: ir.Context) -> None:
    """Read bytecode or an artifact, quietly (what signal_reading runs in its child)."""
    from hlo_amp.quiet_stderr import fd2_muted

    with fd2_muted():
        if portable:
            from hlo_amp import jax_internals

            jax_internals.deserialize_portable_artifact(data, context)
        else:
            ir.Module.parse(data, context=context)


def _is_portable(data: bytes) -> bool:
    # A portable artifact is bytecode of the VHLO dialect.
    return b"vhlo" in data[:4096]


def _import_jax() -> None:
    from hlo_amp.quiet_stderr import import_jax_for_cli

    import_jax_for_cli()  # hlo-amp-opt imports jax here: quietly, on CPU


def _deserialize_portable(data: bytes, source_name: str, context: ir.Context) -> ir.Module:
    from hlo_amp.quiet_stderr import fd2_muted

    _import_jax()
    from hlo_amp import jax_internals  # jaxlib's XLA extension, through jax

    try:  # the context must be passed: the artifact is upgraded into it
        with fd2_muted():  # jaxlib prints its diagnostics too; the error below says it
            return jax_internals.deserialize_portable_artifact(data, context)
    except Exception as error:  # noqa: BLE001 - jaxlib raises its own runtime errors
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise ModuleError(
            f"{source_name}: error: unreadable StableHLO portable artifact ({first_line})"
        ) from None


def copy_module(module: ir.Module) -> ir.Module:
    """A deep copy of ``module`` in the same context: its attributes and location, and a
    clone of every top-level op. Prints the same as the original, debug info included;
    several times faster than a bytecode round trip (no serialising, no parsing)."""
    with module.context:
        copy = ir.Module.create(loc=module.operation.location)
        attributes = module.operation.attributes
        for i in range(len(attributes)):
            named = attributes[i]
            copy.operation.attributes[named.name] = named.attr
        at_end = ir.InsertionPoint(copy.body)
        for op in module.body.operations:
            op.operation.clone(ip=at_end)
    return copy


def module_text(module: ir.Module, *, debug_info: bool = False) -> str:
    """The module as StableHLO text; with ``debug_info`` it keeps the locations."""
    return module.operation.get_asm(enable_debug_info=debug_info,
                                    large_elements_limit=None)


def walk_ops(holder: object, into: tuple[type, ...] | None = None) -> list[ir.OpView]:
    """Every op nested in the regions of ``holder`` (an op or op view), in program order,
    as op views (``isinstance`` works); :func:`walk_operations` without the views.

    With ``into``, only the regions of ops of those classes are entered (their ops are
    listed; the ops inside other ops' regions are not).
    """
    names = None if into is None else frozenset(cls.OPERATION_NAME for cls in into)
    return [op.opview for op in walk_operations(holder, into=names)]


_ADVANCE = ir.WalkResult.ADVANCE
_SKIP = ir.WalkResult.SKIP
_PRE_ORDER = ir.WalkOrder.PRE_ORDER


def walk_operations(holder: object, *, into: frozenset[str] | None = None,
                    names: frozenset[str] | None = None) -> list[ir.Operation]:
    """Like :func:`walk_ops`, as plain ``ir.Operation`` objects, in one C++ walk.

    Two to three times faster than ``walk_ops`` and it makes no ``OpView`` per op (an
    ``OpView`` is a garbage-collected Python object: a walk of a large module in OpViews
    also triggers the collector). Match ops by ``op.name``, not ``isinstance``. ``into``
    is a set of op names whose regions are entered (None: all); ``names`` keeps only the
    ops of those names in the result (every op is still walked).
    """
    root = holder.operation if hasattr(holder, "operation") else holder
    found: list[ir.Operation] = []
    append = found.append
    started = False

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal started
        if not started:  # the holder itself: always entered, never listed
            started = True
            return _ADVANCE
        if names is None or op.name in names:
            append(op)
        if into is None or op.name in into:
            return _ADVANCE
        return _SKIP

    root.walk(visit, _PRE_ORDER)
    return found


# During one pipeline run every matrix op insert_converts decided carries its index in
# Report.decisions under this (discardable) attribute: later passes name the op by it, as
# op names differ between passes (a private function shared by several call sites names
# its ops without the caller's prefix; propagate's clones copy it). run_pipeline strips it.
DECISION_KEY = "hlo_amp.decision"


def mark_decision(op: ir.Operation | ir.OpView, index: int) -> None:
    """Give ``op`` its decision's index (``DECISION_KEY``)."""
    op.attributes[DECISION_KEY] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64, op.context), index)


def decision_of(op: ir.Operation | ir.OpView) -> int | None:
    """The index ``mark_decision`` gave ``op``, None when it has none."""
    attributes = op.attributes
    if DECISION_KEY not in attributes:
        return None
    return ir.IntegerAttr(attributes[DECISION_KEY]).value


def strip_marks(module: ir.Module, keys: frozenset[str]) -> None:
    """Remove the attributes ``keys`` from every op of ``module``."""
    for op in walk_operations(module):
        attributes = op.attributes
        for key in [key for key in keys if key in attributes]:
            del attributes[key]


def drop_marks_for_the_full_pipeline(module: ir.Module, source: str | bytes) -> None:
    """Drop the fp8 marks of a module read from outside (``source``) that the full
    pipeline is to run on: its insert_converts decides anew (a stale or forged mark
    made a dot fp8 that the report said was bf16)."""
    if isinstance(source, bytes) or FP8_MARK in source:
        strip_marks(module, frozenset({FP8_MARK}))


def strip_decision_marks(module: ir.Module) -> None:
    """Remove every ``DECISION_KEY``, ``PROGRAM_KEY``, ``ATTENTION_KEY`` and
    ``KERNEL_KEY``: they mean nothing outside the run that wrote them."""
    for op in walk_operations(module, names=MATRIX_OP_NAMES | _CONVERT):
        for key in (DECISION_KEY, PROGRAM_KEY, ATTENTION_KEY, KERNEL_KEY):
            if key in op.attributes:
                del op.attributes[key]


# The matrix ops of an attention the fused-attention pass found but left unfused (its
# scores' and output's matmuls and their backward's): an fp8 op rule leaves them in the
# 16-bit compute type, as the fused kernel runs them (insert_converts/plan.py). Stripped
# with the decision marks.
ATTENTION_KEY = "hlo_amp.attention"


def mark_attention(op: ir.Operation | ir.OpView) -> None:
    """Mark ``op`` as one of an unfused attention's matmuls (``ATTENTION_KEY``)."""
    op.attributes[ATTENTION_KEY] = ir.UnitAttr.get(op.context)


def is_attention_matmul(op: ir.Operation | ir.OpView) -> bool:
    """Whether ``mark_attention`` marked ``op``."""
    return ATTENTION_KEY in op.attributes


# The matrix ops of a fused kernel the fused-attention pass spliced in (the reference
# kernel's: jax's XLA attention, standing in for cuDNN's call on a machine without a
# GPU): the kernel's own computation, which the passes leave as it is, as they leave
# cuDNN's custom call. Stripped with the decision marks.
KERNEL_KEY = "hlo_amp.kernel"


def mark_kernel_matmul(op: ir.Operation | ir.OpView) -> None:
    """Mark ``op`` as a matrix op of a spliced kernel (``KERNEL_KEY``)."""
    op.attributes[KERNEL_KEY] = ir.UnitAttr.get(op.context)


def is_kernel_matmul(op: ir.Operation | ir.OpView) -> bool:
    """Whether ``mark_kernel_matmul`` marked ``op``."""
    return KERNEL_KEY in op.attributes


# The converts the program itself has, marked by run_pipeline before the passes in a
# partitioned module (the only kind passes/keep_shardings.py acts on), so that it tells
# them from the ones the pipeline wrote and leaves the program's own as they are.
# run_pipeline strips it with the decision marks.
PROGRAM_KEY = "hlo_amp.program"
# The discardable attribute insert_converts puts on a dot it decided to run in fp8, and
# the fp8 pass reads (and removes): [lhs fp8 type, rhs fp8 type, dequantise type].
FP8_MARK = "hlo_amp.fp8"
# The marks a pipeline run writes for its own passes and removes before it ends: in a
# module read from outside they are stale (or forged) and are dropped when it is read.
# (The fp8 mark is not among them: --pass hlo-amp-insert-converts leaves it for a later
# --pass hlo-amp-fp8; the full pipeline drops it, hlo_amp/cli.py.)
RUN_MARKS = frozenset({DISCARDED_KEY, DECISION_KEY, ATTENTION_KEY, KERNEL_KEY, PROGRAM_KEY,
                       "hlo_amp.sharding_probe"})
_CONVERT = frozenset({"stablehlo.convert"})


def mark_program_converts(module: ir.Module) -> None:
    """Mark every ``stablehlo.convert`` now in ``module`` with ``PROGRAM_KEY``."""
    with module.context:
        for op in walk_operations(module, names=_CONVERT):
            mark_program_convert(op)


def mark_program_convert(op: ir.Operation | ir.OpView) -> None:
    """Mark ``op`` as the program's own convert (one that took over a program convert's
    readers, when cleanup merged the two)."""
    op.attributes[PROGRAM_KEY] = ir.UnitAttr.get(op.context)


def is_program_convert(op: ir.Operation | ir.OpView) -> bool:
    """Whether ``op`` is a convert the program had before the pipeline ran."""
    return PROGRAM_KEY in op.attributes


def defining_op(value: ir.Value) -> ir.Operation | None:
    """The op whose result ``value`` is; None for a block argument."""
    return None if isinstance(value, ir.BlockArgument) else value.owner.operation


def producers(value: ir.Value, depth: int, follows: Callable[[ir.Operation], bool]
              ) -> tuple[list[ir.Operation], list[ir.Value]]:
    """``value``'s producers, level by level, ``depth`` levels, followed past an op only
    where ``follows(op)``. Returns (every op met; the values the walk ends on: block
    arguments, results of ops not followed past, operands beyond ``depth``)."""
    met: list[ir.Operation] = []
    ends: list[ir.Value] = []
    seen: set[int] = set()
    frontier = [value]
    for _ in range(depth):
        following = []
        for current in frontier:
            op = defining_op(current)
            followed = op is not None and follows(op)
            if not followed:
                ends.append(current)
            if op is None or op_key(op) in seen:
                continue
            seen.add(op_key(op))
            met.append(op)
            if followed:
                following.extend(op.operands)
        frontier = following
    return met, ends + frontier


def element_type(value: ir.Value) -> ir.Type | None:
    """The element type of a ranked tensor value, else None."""
    tensor_type = value.type
    return tensor_type.element_type if isinstance(tensor_type, ir.RankedTensorType) else None


# Ops that pass a value on unchanged in value (a weak-type convert, a broadcast): a
# constant through them is still that constant, an operand through them the same one.
SAME_VALUE_OPS = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.reshape",
                               "stablehlo.convert", "stablehlo.transpose"})


def from_constant(value: ir.Value, depth: int = 0) -> bool:
    """Whether ``value`` is a constant, possibly broadcast, reshaped or converted (at
    most four such steps)."""
    if isinstance(value, ir.BlockArgument) or depth > 4:
        return False
    owner = value.owner
    if owner.name == "stablehlo.constant":
        return True
    return owner.name in SAME_VALUE_OPS and from_constant(owner.operands[0], depth + 1)


def element_count(value: ir.Value) -> int | None:
    """Elements of a value of static shape; None for a dynamic shape or no tensor."""
    if not isinstance(value.type, ir.RankedTensorType):
        return None
    shaped = ir.RankedTensorType(value.type)
    return math.prod(shaped.shape) if shaped.has_static_shape else None


def where_finite(test: ir.Value, if_finite: ir.Value, otherwise: ir.Value) -> ir.Value:
    """``if_finite`` where ``test`` (an f32 tensor of their shape) is finite, else
    ``otherwise``, at the current insertion point (fp8's delayed-scaling clamp, the fast
    mode's saturation of f32's extremes into bf16: inf and NaN pass as they are). Tested
    as ``|test| < inf``, a NaN comparing false: XLA:GPU's Triton normalisation fusions
    take that into their epilogue, not is_finite (with is_finite an RMSNorm wrote its f32
    output and a kernel of its own quantised it, 1.4% more step for the 1.1B decoder in
    the roofline model)."""
    element = ir.RankedTensorType(test.type).element_type
    inf = hlo.constant(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([], element),
                                                      ir.FloatAttr.get(element, math.inf)))
    finite = hlo.compare(hlo.abs(test), hlo.broadcast_in_dim(test.type, inf, []),
                         hlo.ComparisonDirectionAttr.get("LT"),
                         compare_type=hlo.ComparisonTypeAttr.get("FLOAT"))
    return hlo.select(finite, if_finite, otherwise)


def with_element(tensor_type: ir.Type, element: ir.Type) -> ir.RankedTensorType:
    """``tensor_type`` with its element type replaced (shape and encoding kept)."""
    ranked = ir.RankedTensorType(tensor_type)
    return ir.RankedTensorType.get(ranked.shape, element, ranked.encoding)


def callee_name(call: object) -> str:
    return ir.FlatSymbolRefAttr(call.attributes["callee"]).value


# The ops an attribute of which names a function run in their place: a call's callee,
# and a composite's decomposition (XLA inlines it unless a backend knows its name).
BODY_ATTRIBUTE = MappingProxyType({"func.call": "callee",
                                   "stablehlo.composite": "decomposition"})


def body_name(op: object) -> str | None:
    """The function a ``func.call`` calls or a ``stablehlo.composite`` decomposes into;
    None for another op."""
    attribute = BODY_ATTRIBUTE.get(op.operation.name)
    if attribute is None:
        return None
    return ir.FlatSymbolRefAttr(op.operation.attributes[attribute]).value


def set_body_name(op: object, name: str) -> None:
    """Point ``op`` (a call or a composite) at the function ``name``."""
    op.operation.attributes[BODY_ATTRIBUTE[op.operation.name]] = ir.FlatSymbolRefAttr.get(
        name, context=op.context)


def call_target(custom_call: object) -> str:
    """A ``stablehlo.custom_call``'s target (``__cudnn$fmhaSoftmax``)."""
    return ir.StringAttr(custom_call.attributes["call_target_name"]).value


def is_call(op: object) -> bool:
    return isinstance(op, func_dialect.CallOp) or op.operation.name == "func.call"


def callee_entry(op: object, by_name: dict[str, Any]) -> ir.Block | None:
    """The entry block of the function a ``func.call`` ``op`` calls (``by_name``: the
    module's functions by name); None for another op, an unknown callee or one without
    a body."""
    if not is_call(op):
        return None
    callee = by_name.get(callee_name(op))
    if callee is None or not callee.regions[0].blocks:
        return None
    return callee.regions[0].blocks[0]


def readable_attribute(op: ir.Operation | ir.OpView, name: str) -> ir.Attribute | None:
    """``op``'s attribute ``name``, or None where it is missing or jaxlib's bindings cannot
    read it: a dense attribute of complex elements (a complex constant's ``value``)
    raises TypeError on every read (and aborts the process when read from a
    NamedAttribute's ``.attr``), so no pass reads one through the attribute map alone."""
    attributes = op.operation.attributes
    if name not in attributes:
        return None
    try:
        return attributes[name]
    except TypeError:
        return None


def is_zero_constant(value: ir.Value) -> bool:
    """Whether ``value`` is a float constant of zeros, possibly broadcast, reshaped,
    converted or transposed (``jnp.where(mask, x, 0)``'s fill)."""
    for _step in range(5):
        if isinstance(value, ir.BlockArgument):
            return False
        owner = value.owner
        if owner.name == "stablehlo.constant":
            read = dense_value(owner)
            if read is None or not read.is_splat:
                return False
            splat = read.get_splat_value()
            return isinstance(splat, ir.FloatAttr) and ir.FloatAttr(splat).value == 0.0
        if owner.name not in SAME_VALUE_OPS:
            return False
        value = owner.operands[0]
    return False


def dense_value(op: ir.Operation | ir.OpView) -> ir.DenseElementsAttr | None:
    """A ``stablehlo.constant``'s elements, or None where the bindings cannot read them
    (complex elements) or the constant holds none inline (a ``dense_resource`` blob,
    which hlo-amp-opt reads from a file: casting it raised ValueError)."""
    read = readable_attribute(op, "value")
    try:
        return None if read is None else ir.DenseElementsAttr(read)
    except ValueError:
        return None


def constant_value(value: ir.Value) -> ir.Attribute | None:
    """The ``value`` attribute of the ``stablehlo.constant`` that defines ``value``; None
    for another producer, a block argument or a value the bindings cannot read."""
    if isinstance(value, ir.BlockArgument) or value.owner.name != "stablehlo.constant":
        return None
    return readable_attribute(value.owner, "value")


def _symbol_refs(attribute: ir.Attribute | None) -> list[str]:
    if isinstance(attribute, ir.FlatSymbolRefAttr):
        return [attribute.value]
    if isinstance(attribute, ir.ArrayAttr):
        return [name for item in attribute for name in _symbol_refs(item)]
    return []


def named_outside_calls(ops: list[ir.Operation]) -> set[str]:
    """The symbols an attribute of an op of ``ops`` other than ``func.call`` names (a
    custom call's called computation, ...): functions whose signature a pass must keep."""
    named: set[str] = set()
    for op in ops:
        if not is_call(op):
            for attribute in op.operation.attributes:
                named.update(_symbol_refs(readable_attribute(op, attribute)))
    return named


def call_sites(ops: list[ir.Operation]) -> dict[str, list[Any]]:
    """The ``func.call`` ops among ``ops`` by callee name."""
    sites: dict[str, list[Any]] = {}
    for op in ops:
        if is_call(op):
            sites.setdefault(callee_name(op), []).append(op.opview)
    return sites


def growable_functions(module: ir.Module, ops: list[ir.Operation],
                       sites: dict[str, list[Any]] | None = None
                       ) -> list[tuple[func_dialect.FuncOp, list[Any]]]:
    """The private functions of ``module`` that only ``func.call`` ops of ``ops`` (the
    module's) name, with those calls: functions a pass may give more arguments,
    computed at every call site. ``sites``: ``call_sites(ops)``, if the caller has it."""
    sites = call_sites(ops) if sites is None else sites
    named = named_outside_calls(ops)
    return [(fn, sites[function_name(fn)]) for fn in functions(module)
            if not is_public(fn) and function_name(fn) not in named
            and sites.get(function_name(fn))]


def clone_private(fn: func_dialect.FuncOp, suffix: str, taken: dict[str, object]
                  ) -> func_dialect.FuncOp:
    """A private copy of ``fn`` right after it, named ``{name}_{suffix}{n}`` with the
    first ``n`` not in ``taken``; the copy is added to ``taken``."""
    original = function_name(fn)
    number = 0
    while f"{original}_{suffix}{number}" in taken:
        number += 1
    name = f"{original}_{suffix}{number}"
    with ir.InsertionPoint.after(fn):
        clone = fn.operation.clone()
    clone.attributes["sym_name"] = ir.StringAttr.get(name, context=clone.context)
    clone.attributes["sym_visibility"] = ir.StringAttr.get("private", context=clone.context)
    if _PENDING.ops:  # the copies of ops discarded in fn are discarded too (they were left)
        _PENDING.ops.extend(op.operation for op in walk_operations(clone)
                            if DISCARDED_KEY in op.operation.attributes)
    taken[name] = clone.opview
    return clone.opview


def terminator(block: ir.Block) -> ir.Operation:
    """The last op of ``block`` (without making a Python object per op of the block)."""
    operations = block.operations
    return operations[len(operations) - 1].operation


def set_function_type(fn: func_dialect.FuncOp, results: list[ir.Type] | None = None) -> None:
    """Make ``fn``'s function_type match its entry block's arguments, with ``results``
    (default: the results it has)."""
    old = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    arguments = [argument.type for argument in fn.regions[0].blocks[0].arguments]
    fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        arguments, list(old.results) if results is None else results, context=fn.context))


def functions(module: ir.Module) -> list[func_dialect.FuncOp]:
    return [op for op in module.body.operations if isinstance(op, func_dialect.FuncOp)]


def function_name(fn: func_dialect.FuncOp) -> str:
    return ir.StringAttr(fn.attributes["sym_name"]).value


def is_public(fn: func_dialect.FuncOp) -> bool:
    if "sym_visibility" not in fn.attributes:
        return True
    return ir.StringAttr(fn.attributes["sym_visibility"]).value == "public"


def public_functions(module: ir.Module) -> list[func_dialect.FuncOp]:
    return [fn for fn in functions(module) if is_public(fn)]
