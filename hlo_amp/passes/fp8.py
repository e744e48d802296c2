"""fp8 dots: per-tensor current scaling, emitted in the form XLA:GPU makes one fp8 GEMM.

insert_converts decides which ``dot_general`` ops run in fp8 and marks them with the
attribute ``hlo_amp.fp8 = [lhs type, rhs type, dequantise type]`` (it also checked that
the dot can take XLA's fp8 GEMM form: ``Target.fp8_obstacle``, targets/fp8_gemm.py). This
pass quantises each marked operand ``x`` in the program itself (no state to thread
through the train step) and rewrites the dot to read the fp8 tensors directly:

    amax  = reduce_max(abs(x))                        (f32)
    s     = amax * (1 / fmax)                         (fmax: 448 for e4m3fn, 57344 e5m2)
    s     = convert(convert(s) -> D) -> f32           (the scale D can hold exactly)
    s     = s > 0 and is_finite(s) ? s : (s == 0 ? 1.0 : NaN)
                                                      (all-zero: 1; inf or NaN amax: NaN)
    q     = convert(clamp(-fmax, x / broadcast(s), fmax)) -> fp8
    y     = dot_general(q_lhs, q_rhs) -> result type  *  broadcast(s_lhs * s_rhs)

(D, the dequantise type, is bf16 by default; the dot's result type stays what the
program wrote, except f16, which is computed and scaled in f32 and converted after.)
That is Flax's and Transformer Engine's form: XLA:GPU's gemm_rewriter.cc makes the dot
one ``__cublas$lt$matmul$f8`` custom call and folds the scale product into it, and with
Triton GEMM on it stays a Triton fp8 fusion (the older dequantise-then-dot form became a
bf16 GEMM there; docs/fp8.md). An f32 operand computed from a matrix op (the accurate
mode's) is quantised behind an ``optimization_barrier`` so the rewriter cannot fuse a
scale into the GEMM whose own amax computes it. Values saturate at ``fmax`` (Transformer
Engine's and Flax's ``clip``). An operand holding inf or NaN makes the dot's whole result
NaN (its scale is NaN), so the step's gradients are non-finite and the loss scaler skips
it; with scale 1, an inf saturated at ``fmax`` and an overflowed f16 gradient gave
finite, wrong gradients. Under delayed scaling (the scale from earlier steps) the clamp
is taken only where the value is finite (``where_finite``): inf and NaN reach the
result in the rows and columns they touch, as without fp8.

One quantisation per (value, fp8 type, dequantise type) and block: a weight read by the
forward dot and by the backward dot computing dx is quantised once. Ops get the dot's
location, so the quantise ops and the scale multiply sit in the dot's scope.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import (
    FP8_MARK,
    ModuleError,
    element_type,
    functions,
    op_key,
    walk_operations,
    where_finite,
    with_element,
)
from hlo_amp.ir.op_classes import MATRIX_OP_NAMES
from hlo_amp.passes.fp8_state import (
    HistoryThreads,
    callers_by_name,
    find_state,
    i32_scalar,
    iterations,
    one_caller_each,
    vector_element,
)
from hlo_amp.policy import COMPUTE, FIRST_MATRIX_OP, FP8_SHORT, LAST_MATRIX_OP, Policy
from hlo_amp.policy_terms import is_fp8
from hlo_amp.report import Report
from hlo_amp.targets.fp8_gemm import FP8_FALLBACK, FP8_MAX

_DOT = frozenset({"stablehlo.dot_general"})


def _holds_mark(fn: Any) -> bool:
    return any(FP8_MARK in op.attributes for op in walk_operations(fn, names=_DOT))


def _read_mark(op: ir.Operation) -> tuple[ir.Type, ir.Type, ir.Type]:
    """(lhs fp8 type, rhs fp8 type, dequantise type) of ``op``'s FP8_MARK; ModuleError
    for a mark insert_converts did not write (a module from outside)."""
    mark = op.attributes[FP8_MARK]
    try:
        types = [ir.TypeAttr(t).value for t in ir.ArrayAttr(mark)]
        if len(types) == 3 and str(types[0]) in FP8_SHORT and str(types[1]) in FP8_SHORT:
            return types[0], types[1], types[2]
    except ValueError:
        pass
    raise ModuleError(f"{FP8_MARK} = {mark} on a dot_general: expected [lhs fp8 type, rhs "
                      f"fp8 type, dequantise type] as hlo-amp-insert-converts writes it, "
                      f"e.g. [f8E4M3FN, f8E5M2, bf16]")


@dataclass(frozen=True)
class Fp8Quantize:
    """Quantise the operands of the dots insert_converts marked for fp8, with current
    or (``scaling="delayed"``, where the module carries the state) delayed scaling."""

    scaling: str = "current"
    name: str = "hlo-amp-fp8"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        pairs: dict[str, int] = {}
        with module.context, ir.Location.unknown():
            threads = None
            if self.scaling == "delayed":
                barrier = find_state(module)
                if barrier is not None:
                    one_caller_each(module, _holds_mark)
                threads = HistoryThreads(module, barrier) if barrier is not None else None
            marked = [op for fn in functions(module) for op in walk_operations(fn, names=_DOT)
                      if FP8_MARK in op.attributes]
            # Only delayed scaling has history columns to count (a column per
            # iteration needs the calls of each function).
            callers = (None if self.scaling != "delayed" else
                       threads.callers if threads is not None else callers_by_name(module))
            quantizing = _Quantizing(threads, callers)
            for op in marked:
                lhs, rhs, dequantize = _read_mark(op)
                del op.attributes[FP8_MARK]
                _direct(op, [quantizing.quantized(op, index, fp8, dequantize)
                             for index, fp8 in enumerate((lhs, rhs))])
                pair = f"{FP8_SHORT[str(lhs)]} x {FP8_SHORT[str(rhs)]}"
                pairs[pair] = pairs.get(pair, 0) + 1
            if threads is not None:
                threads.finish()
        if report is not None:
            report.fp8_state_columns = (quantizing.columns if self.scaling == "delayed"
                                        else 0)
            if pairs:
                report.notes.append(_summary(report, pairs, quantizing, self.scaling,
                                             threads))
            elif report.decisions:
                # An fp8 policy that quantises nothing (a two-dot model: both ends kept
                # 16-bit by the preset) said nothing, and ran exactly as mixed_bfloat16.
                rules = Counter(d.rule or "no rule" for d in report.decisions)
                line = ("fp8: no dot_general as fp8 GEMMs; the matrix ops' rules: "
                        + ", ".join(f"{rule} {n}" for rule, n in rules.most_common()))
                fallbacks = _fallbacks(report)
                # The ends' advice only where the end rules, at the compute type (the fp8
                # preset's or the user's), are all there is, on dots, and none=none puts
                # them under an fp8 op rule: they alone kept every dot 16-bit (not a small
                # dot, a convolution, a target that leaves dots as written or a 16-bit op
                # rule: reviews h106, h107, h109; the wording names no preset: h112).
                if report.policy and is_fp8(
                        Policy.parse(report.policy).ops.get("dot_general")) and all(
                        d.rule in (FIRST_MATRIX_OP, LAST_MATRIX_OP) and d.action == COMPUTE
                        and d.op_kind == "dot_general" for d in report.decisions):
                    line += (" (the first_matrix_op and last_matrix_op rules keep the first "
                             "and last matrix ops 16-bit; first_matrix_op=none,"
                             "last_matrix_op=none puts them under the fp8 rule)")
                if fallbacks:
                    line += (f"; {fallbacks} fp8 fallback(s) to the compute dtype (reasons "
                             "per op)")
                report.notes.append(line)


def _fallbacks(report: Report) -> int:
    """How many ops an fp8 rule asked for and the compute dtype took (``why`` per op)."""
    return sum(1 for d in report.decisions if d.reason.startswith(FP8_FALLBACK))


def _summary(report: Report, pairs: dict[str, int], quantizing: _Quantizing, scaling: str,
             threads: HistoryThreads | None) -> str:
    """``fp8: 48 dot_general as fp8 GEMMs (e4m3fn x e4m3fn 16, e5m2 x e4m3fn 32), ...``"""
    count = sum(pairs.values())
    kinds = ", ".join(f"{pair} {n}" for pair, n in sorted(pairs.items()))
    total = sum(d.flops or 0 for d in report.decisions)
    fp8_flops = sum(d.flops or 0 for d in report.decisions if d.fp8)
    # One decimal: a rounded 95% would hide a 94.85% (issue 47's target is 95% fp8).
    share = f"{100.0 * fp8_flops / total:.1f}%" if total else "n/a"
    fallbacks = _fallbacks(report)
    quantised = len(quantizing.found)
    line = (f"fp8: {count} dot_general as fp8 GEMMs ({kinds}), {share} of FLOPs; "
            f"{quantised} tensor(s) quantised with per-tensor ")
    if scaling != "delayed":
        line += "current scaling"
    elif threads is None:
        line += ("current scaling (scaling=delayed: this module carries no fp8 state; "
                 "hlo_amp.compile's call carries it)")
    else:
        line += (f"delayed scaling ({quantizing.delayed} from an amax history of "
                 f"{threads.length} step(s)")
        if quantizing.per_iteration:
            line += (f", in {quantizing.columns} columns: one per loop iteration for "
                     f"{quantizing.per_iteration} of them")
        if quantizing.delayed < quantised:
            line += (f"; {quantised - quantizing.delayed} the history does not reach, "
                     "current")
        line += ")"
    if fallbacks:
        line += f"; {fallbacks} fp8 fallback(s) to the compute dtype (reasons per op)"
    return line


def _scalar(value: float, element: ir.Type) -> ir.Value:
    scalar = ir.RankedTensorType.get([], element)
    return hlo.constant(ir.DenseElementsAttr.get_splat(scalar, ir.FloatAttr.get(element,
                                                                                value)))


def max_abs(x: ir.Value, dimensions: list[int]) -> ir.Value:
    """``reduce(abs(x), init 0, maximum)`` over ``dimensions``, in ``x``'s element type,
    built at the current insertion point (passes/hoist_amax.py matches this form)."""
    shaped = ir.RankedTensorType(x.type)
    element = shaped.element_type
    kept = [size for axis, size in enumerate(shaped.shape) if axis not in dimensions]
    scalar = ir.RankedTensorType.get([], element)
    reduce = hlo.ReduceOp([ir.RankedTensorType.get(kept, element)], [hlo.abs(x)],
                          [_scalar(0.0, element)], ir.DenseI64ArrayAttr.get(dimensions))
    body = reduce.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        hlo.return_([hlo.maximum(body.arguments[0], body.arguments[1])])
    return reduce.results[0]


def _amax(x: ir.Value) -> ir.Value:
    """max(abs(x)) as an f32 scalar, built at the current insertion point. The maximum
    is exact in any float type, so a 16-bit ``x`` is reduced as it is (no f32 copy)."""
    f32 = ir.F32Type.get()
    amax = max_abs(x, list(range(ir.RankedTensorType(x.type).rank)))
    return amax if element_type(amax) == f32 else hlo.convert(
        ir.RankedTensorType.get([], f32), amax)


def _scale(amax: ir.Value, dequantize: ir.Type, fmax: float,
           non_finite: float = 1.0) -> ir.Value:
    """The f32 scale (a value the dequantise type holds exactly) for an amax (f32
    scalar) and an fp8 type of largest value ``fmax``, at the current insertion point:
    1 for an all-zero tensor, ``non_finite`` for an amax that is inf or NaN."""
    f32 = ir.F32Type.get()
    scalar = ir.RankedTensorType.get([], f32)
    # amax / fmax as XLA computes it anyway (its simplifier turns a division by a
    # constant into a product with the f32 reciprocal), so the scale is the same bits
    # whichever backend compiles it and a NumPy model of the recipe can match it.
    scale = hlo.multiply(amax, _scalar(1.0 / fmax, f32))
    if dequantize != f32:  # the scale the dequantise type holds, used on both sides
        scale = hlo.convert(scalar, hlo.convert(ir.RankedTensorType.get([], dequantize),
                                                scale))
    positive = hlo.compare(scale, _scalar(0.0, f32), hlo.ComparisonDirectionAttr.get("GT"),
                           compare_type=hlo.ComparisonTypeAttr.get("FLOAT"))
    finite = hlo.is_finite(scale)
    usable = hlo.and_(positive, finite)
    fallback = _scalar(1.0, f32)
    if non_finite != 1.0:
        fallback = hlo.select(finite, fallback, _scalar(non_finite, f32))
    return hlo.select(usable, scale, fallback)


# How many producers to look through before assuming a matrix op is among them.
_SEARCH_LIMIT = 256


def _from_matrix_op(value: ir.Value) -> bool:
    """Whether ``value`` is computed from a matrix op's result in its block (XLA fuses
    bias, activation and data movement into a GEMM's epilogue, so any path counts)."""
    seen: set[int] = set()  # op_key of each op looked at
    stack = [value]
    while stack:
        owner = stack.pop().owner
        operation = owner if isinstance(owner, ir.Operation) else getattr(owner, "operation",
                                                                          None)
        if not isinstance(operation, ir.Operation) or op_key(operation) in seen:
            continue  # a block argument, or already looked at
        if operation.name in MATRIX_OP_NAMES or len(seen) >= _SEARCH_LIMIT:
            return True
        seen.add(op_key(operation))
        stack.extend(operation.operands)
    return False


class _Quantizing:
    """The quantised tensors of one module, shared per (block, value, types); under
    delayed scaling each gets a column of the amax history, in the order met."""

    def __init__(self, threads: HistoryThreads | None,
                 callers: dict[str, list[Any]] | None):
        self.threads = threads
        self.callers = callers
        # (block, value, types) -> (q, scale), in insertion order: a tensor's history
        # columns follow the columns of those before it.
        self.found: dict[tuple[Any, ...], tuple[ir.Value, ir.Value]] = {}
        self.columns = 0  # history columns taken (a tensor in a scan: one per iteration)
        self.per_iteration = 0  # tensors with a column per iteration
        self.delayed = 0  # tensors scaled from the history

    def quantized(self, op: Any, index: int, fp8: ir.Type, dequantize: ir.Type
                  ) -> tuple[ir.Value, ir.Value]:
        """(q, scale): operand ``index`` of ``op`` quantised to ``fp8`` and its f32
        scale (a value the dequantise type holds exactly)."""
        value = op.operands[index]
        key = (op.block, value, str(fp8), str(dequantize))
        found = self.found.get(key)
        if found is None:
            # The same count whether the module's history has its columns or none yet
            # (runtime/fp8_state.py counts them with an empty one).
            count = None if self.callers is None else iterations(op.block, self.callers)
            column, self.columns = self.columns, self.columns + (count or 1)
            self.per_iteration += count is not None
            history = iteration = None
            threads = self.threads
            if (threads is not None and self.columns <= threads.columns
                    and threads.reachable(op.block)):
                history = threads.history_max(op.block)
                if count is not None:
                    iteration = threads.iteration(op.block)
                self.delayed += 1
            found = _quantize(op, value, fp8, dequantize, history, column, iteration,
                              threads)
            self.found[key] = found
        return found


def _quantize(op: Any, value: ir.Value, fp8: ir.Type, dequantize: ir.Type,
              history: ir.Value | None, column: int, iteration: ir.Value | None,
              threads: HistoryThreads | None) -> tuple[ir.Value, ir.Value]:
    """``value`` quantised before ``op``: scaled by its own amax (current scaling), or by
    column ``column`` of ``history`` (the history maximum in ``op``'s block; column
    ``column + iteration`` where the tensor has one per iteration), this step's amax
    then recorded with ``threads``."""
    f32 = ir.F32Type.get()
    fmax = FP8_MAX[str(fp8)]
    shape = ir.RankedTensorType(value.type)
    with op.location, ir.InsertionPoint(op):
        held = value
        if history is not None:
            # The scale is known before the value: XLA may fuse the quantisation into
            # the producer (a GEMM's fp8 output) and this step's amax beside it.
            if iteration is None:
                threads.contribute(op.block, column, _amax(value))
                picked = vector_element(history, column)
            else:
                at = iteration if not column else hlo.add(iteration, i32_scalar(column))
                threads.contribute_at(op.block, at, _amax(value))
                picked = hlo.dynamic_slice(history, [at], ir.DenseI64ArrayAttr.get([1]))
            past = hlo.reshape(ir.RankedTensorType.get([], f32), picked)
            scale = _scale(past, dequantize, fmax)
        else:
            # XLA:GPU's GEMM rewriter would fuse this quantisation (the D scale) and the
            # amax of the producing GEMM's output into that GEMM, although the scale is
            # computed from that very amax: "A cycle is detected". The barrier keeps the
            # quantisation out of the producer; it then runs as its own fusion. The
            # rewriter's pattern (F8ConvertD) is convert(clamp(divide(GEMM, scale))):
            # the divide reads the GEMM's own f32 result. A 16-bit value (the fast
            # mode's activations) is converted to f32 first, which the pattern does not
            # take, so it needs no barrier, and without one XLA fuses the amax and the
            # quantisation into the value's producer (tests/py/test_gpu_target.py
            # compiles both modes).
            if shape.element_type == f32 and _from_matrix_op(value):
                held = hlo.optimization_barrier([held])
                held = held[0] if isinstance(held, (list, tuple)) else held
            # An inf or NaN in the tensor: scale NaN, so the dot's result is NaN and
            # the loss scaler skips the step (with scale 1 an inf saturated at fmax, and
            # an overflowed f16 gradient gave finite, wrong gradients).
            scale = _scale(_amax(held), dequantize, fmax, non_finite=float("nan"))
        x32 = held
        if shape.element_type != f32:
            x32 = hlo.convert(with_element(value.type, f32), held)
        scaled = hlo.divide(x32, hlo.broadcast_in_dim(x32.type, scale, []))
        clamped = hlo.clamp(_scalar(-fmax, f32), scaled, _scalar(fmax, f32))
        if history is not None:
            # A past scale says nothing of an inf or NaN this step: they pass the clamp
            # as they are (inf becomes NaN in e4m3fn), so the dot's result is non-finite
            # and the loss scaler skips the step; clamped, an overflowed f16 gradient
            # gave finite, wrong gradients.
            clamped = where_finite(x32, clamped, scaled)
        return hlo.convert(with_element(value.type, fp8), clamped), scale


def _direct(op: Any, operands: list[tuple[ir.Value, ir.Value]]) -> None:
    """Rewrite ``op`` to ``dot_general(q_lhs, q_rhs) * (scale_lhs * scale_rhs)``: the dot
    reads the fp8 tensors themselves and keeps its result type; the product of the two
    scales (f32, exact: each holds at most 8 significant bits) multiplies its result."""
    (q_lhs, s_lhs), (q_rhs, s_rhs) = operands
    result = op.results[0]
    written_type = result.type
    element = ir.RankedTensorType(written_type).element_type
    f32 = ir.F32Type.get()
    # An f16 result cannot hold the unscaled sums (one e4m3 product reaches 448**2, past
    # f16's 65504) nor a small scale product (1e-10 is 0 in f16): every element came out
    # inf or NaN. Such a dot computes and scales in f32, then converts to f16.
    in_f32 = element == ir.F16Type.get()
    if in_f32:
        result.set_type(with_element(written_type, f32))
        element = f32
    with op.location, ir.InsertionPoint(op):
        op.operands[0], op.operands[1] = q_lhs, q_rhs
        scale = hlo.multiply(s_lhs, s_rhs)
        if element != f32:
            scale = hlo.convert(ir.RankedTensorType.get([], element), scale)
    with op.location, ir.InsertionPoint.after(op):
        scaled = hlo.multiply(result, hlo.broadcast_in_dim(result.type, scale, []))
        last = scaled.owner.operation
        if in_f32:
            scaled = hlo.convert(written_type, scaled)
    result.replace_all_uses_except(scaled, last)
