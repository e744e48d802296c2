"""What XLA kept: match the report's converted ops to the dots in XLA's optimized HLO.

Both sides are named by JAX's name stack (the report by the op's location, XLA by the
``op_name`` metadata), but XLA's names differ in three ways that the matching undoes:

* segments for calls the StableHLO location does not carry: ``closed_call`` after a
  ``while/body`` (scan and fori bodies are private functions), ``jit(inner)`` for an
  inner ``jax.jit``, ``shard_map`` for a ``shard_map`` body (its ops' locations start
  inside it), and the outer ``jit(f)`` that ``hlo-amp-opt`` inputs may lack;
* the last segment: a dot whose result XLA transposes takes the transpose's name
  (``…/dense/transpose``), so ops are matched by scope, not by op name, and within a
  scope first by their result's element count (a transposed result keeps it);
* counts: XLA merges equal dots (the recomputed forward of a ``remat``) and drops dead
  ones, so a scope can hold fewer dots than the report. Those decisions stay unknown
  (``None``) rather than being guessed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass

from hlo_amp.ir.sites import split_segments, unwrap
from hlo_amp.report import Decision, Report, is_narrow
from hlo_amp.targets import CpuTarget, GpuTarget, Target, TpuTarget, as_target
from hlo_amp.targets.hlo_text import parse_instruction

# Where the backend is not known (no target facts), any backend's matrix calls.
_ANY_BACKEND_CALLS = tuple(c for family in (CpuTarget, GpuTarget, TpuTarget)
                           for c in family.matrix_calls)

_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[")
_HLO_MATMUL = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[[^\]]*\][^ ]*\s+(dot|convolution)\(([^)]*)\)"
)
# One operand: "%x", or "bf16[2,3]{1,0} %x" (commas inside brackets are not separators).
_OPERAND = re.compile(r"(?:\w+\[[^\]]*\](?:\{[^}]*\})?\s+)?%?[\w.\-]+")
_CUSTOM_CALL = re.compile(r"custom-call\(([^)]*)\)")
_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# A computation's header: ``%name (params) -> type {`` or ``ENTRY %name ...{``.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Fusions whose dots Triton emits (XLA's GEMM fusion, with default flags on GPU).
_TRITON_FUSION = re.compile(r'calls=%?([\w.\-]+).*"kind":"__triton')
# Name-stack segments one side has and the other may not (see the module docstring); the
# call segments of sites.STRUCTURAL that XLA adds or drops, not the transforms.
_CALL_SEGMENT = re.compile(r"^(?:closed_call|core_call|shard_map|eval_jaxpr|p?jit\(.*\))$")

UNMATCHED = "no matrix op of its scope left in XLA's HLO (merged or removed)"
# XLA:GPU runs a ragged_dot as a GEMM named ``…/ragged_dot_general``; XLA:TPU as Mosaic
# kernels (``tpu_custom_call``) named ``ragged-dot-…``, without the name stack.
RAGGED_UNREAD = ("ragged_dot: no GEMM named for it in XLA's HLO (XLA:TPU runs it as a "
                 "Mosaic kernel without the op's name)")
MERGED = "XLA merged or removed some matrix ops of its scope"


@dataclass(frozen=True)
class XlaGemm:
    """A matrix op in XLA's optimized HLO: a ``dot``/``convolution``, a cuBLAS GEMM or a
    cuDNN convolution call."""

    op_name: str  # the name stack in its metadata
    operand_types: tuple[str, ...]  # element types of its two matrix operands
    runner: str = "XLA"  # "cuBLAS", "cuBLAS fp8", "cuDNN", "Triton" or "XLA" (a plain op)
    conv: bool = False  # a convolution (XLA's op or a cuDNN call), not a GEMM
    # Elements of its (first) result, which a decision's ``shape`` also gives: two ops of
    # one scope are told apart by it. None where the line does not say.
    elements: int | None = None

    @property
    def ragged(self) -> bool:
        """Whether it runs a ``ragged_dot`` (its op name's last segment says so)."""
        return self.op_name.rsplit("/", 1)[-1].startswith("ragged_dot")

    @property
    def low(self) -> bool:
        """Whether it computes in 16 bit or narrower."""
        return bool(self.operand_types) and all(map(is_narrow, self.operand_types))

    @property
    def fp8(self) -> bool:
        """Whether it is an fp8 GEMM (cuBLASLt's ``$f8`` call, or a dot of fp8 operands)."""
        return bool(self.operand_types) and all(t.startswith("f8") for t in self.operand_types)

    @property
    def form(self) -> str:
        """How XLA runs it, in words: ``cuDNN f32×f32``, ``cuBLAS bf16×bf16``."""
        return f"{self.runner} {'×'.join(self.operand_types)}"


def xla_gemms(hlo_text: str, target: Target | None = None) -> list[XlaGemm]:
    """Every dot and convolution in optimized HLO, and every custom call ``target`` runs
    a matrix op as (`Target.matrix_calls`: cuBLAS GEMMs, cuDNN convolutions; any
    backend's without target facts), in text order."""
    calls = (target.matrix_calls if target is not None and target.family
             else _ANY_BACKEND_CALLS)
    types: dict[str, str] = {}
    lines = hlo_text.splitlines()
    triton: set[str] = set()
    for line in lines:
        match = _HLO_DEF.match(line)
        if match:
            types[match.group(1)] = match.group(2)
        fusion = _TRITON_FUSION.search(line)
        if fusion:
            triton.add(fusion.group(1))
    found = []
    computation = ""
    for line in lines:
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{", 1)[0]:
            computation = header.group(1)
            continue
        match = _HLO_MATMUL.match(line)
        operands = match.group(2) if match else None
        runner = "Triton" if computation in triton else "XLA"
        library = _CALL_TARGET.search(line) if match is None else None
        form = next((c for c in calls if c[0] and library
                     and library.group(1).startswith(c[0])), None)
        if form and "custom-call(" in line:
            call = _CUSTOM_CALL.search(line)
            # Library calls take (a, b, then scales / bias): only a and b are matrices.
            operands = ",".join(_OPERAND.findall(call.group(1))[:2]) if call else None
            runner = form[1]
        if operands is None:
            continue
        operand_types = []
        for operand in _OPERAND.findall(operands):
            inline = re.match(r"^(\w+)\[", operand)  # "bf16[2,3]{1,0} %x" form
            name = operand.split()[-1].lstrip("%")
            operand_types.append(inline.group(1) if inline else types.get(name, "?"))
        op_name = _OP_NAME.search(line)
        name = op_name.group(1) if op_name else ""
        # XLA:TPU emits dots as convolutions too (``dim_labels=bf_io->bf``); JAX's name
        # for the op says which it was.
        conv = form[2] if form else bool(match and match.group(1) == "convolution"
                                         and not name.rsplit("/", 1)[-1].startswith("dot"))
        found.append(XlaGemm(name, tuple(operand_types), runner, conv, _result_elements(line)))
    return found


def _result_elements(line: str) -> int | None:
    """Elements of an HLO line's (first) result: ``f32[2,288]``, or a library call's
    ``(f32[2,288], s8[...])``."""
    instruction = parse_instruction(line)
    if instruction is None or not instruction.arrays:
        return None
    return math.prod(instruction.arrays[0].shape)


def _decision_elements(decision: Decision) -> int | None:
    """Elements of a decision's result (its ``shape``, "256x2048"); None if unknown."""
    try:
        return math.prod(int(d) for d in decision.shape.split("x")) if decision.shape else None
    except ValueError:  # a dynamic dimension ("?")
        return None


_ATTENTION_CALL = re.compile(r'custom_call_target="__cudnn\$fmha[^"]*"')


def mark_attention_kept(report: Report, hlo_text: str) -> None:
    """Each fused attention site's ``kept_by_xla``: whether XLA's optimized HLO calls
    cuDNN's fused attention under the site's name (its forward, and its backward where
    the site has one; passes/fused_attention/ names the kernel's ops so)."""
    names = []
    for line in hlo_text.splitlines():
        if _ATTENTION_CALL.search(line):
            found = _OP_NAME.search(line)
            names.append(found.group(1) if found else "")
    for index, site in enumerate(report.attention):
        if not site.fused:
            continue
        wanted = [site.kernel_name]
        if site.direction != "forward":
            wanted.append(site.kernel_name + "_backward")
        kept = all(any(name.endswith(w) for name in names) for w in wanted)
        report.attention[index] = dataclasses.replace(site, kept_by_xla=kept)


def scope_key(name: str) -> str:
    """A name stack without call segments and without its last (op name) segment; a
    call inside transforms keeps the transforms alone (XLA's ``jvp(jit(layer))``, the
    report's ``jvp()``: a jax.jit layer under grad or vmap read "merged or removed")."""
    segments = []
    for segment in split_segments(name):
        if _CALL_SEGMENT.match(segment):
            continue
        wrappers, inner = unwrap(segment)
        if wrappers and (not inner or _CALL_SEGMENT.match(inner)):
            segment = "".join(f"{w}(" for w in wrappers) + ")" * len(wrappers)
        segments.append(segment)
    return "/".join(segments[:-1])


def _is_float(element_type: str) -> bool:
    return element_type.startswith(("f", "bf"))


def _matches(decision: Decision, gemm: XlaGemm) -> bool:
    """Whether ``gemm`` computes as ``decision`` asks: an fp8 op's an fp8 GEMM, a 16-bit
    op's one of its own 16-bit types (a bf16 op took an fp8 GEMM, or an f16 one)."""
    if decision.fp8:
        return gemm.fp8
    return gemm.low and not gemm.fp8 and set(gemm.operand_types) <= set(
        decision.operands_after)


def _same_formats(decision: Decision, gemm: XlaGemm) -> bool:
    """Whether ``gemm`` reads the element types ``decision`` gave its operands."""
    return sorted(t.lower() for t in decision.operands_after) == sorted(
        t.lower() for t in gemm.operand_types)


def _assign(decisions: list[Decision], gemms: list[XlaGemm], complete: bool,
            reserved: list[Decision] = ()) -> list[tuple[bool | None, str | None]]:
    """(kept, XLA's form) per converted decision of one scope, against the scope's ops.

    An fp8 op is kept by an fp8 GEMM, a 16-bit op by one of its 16-bit type; each XLA op
    keeps at most one decision, one of its own kind (a convolution, a dot) where there is
    one. ``reserved``: the scope's ops the program wrote narrow itself, which take their
    GEMMs first (a converted op that XLA merged away was credited with the program's own
    GEMM). Ops left over are not kept (False, with the form of a leftover XLA op of their
    kind) when XLA has every op of the scope, else unknown (None).
    """
    free = list(gemms)
    for same_size in (True, False):
        for decision in list(reserved):
            size = _decision_elements(decision)
            pick = next((g for g in free if _matches(decision, g)
                         and (not same_size or g.elements == size)), None)
            if pick is not None:
                free.remove(pick)
                reserved = [d for d in reserved if d is not decision]
    result: list[tuple[bool | None, str | None]] = [(None, None)] * len(decisions)
    order = sorted(range(len(decisions)), key=lambda i: not decisions[i].fp8)
    sizes = [_decision_elements(d) for d in decisions]
    # First against XLA ops of the decision's own operand formats and result size (two
    # dots of one scope, one kept and one upcast, took each other's verdicts; an e4m3fn x
    # e4m3fn dot was given an e5m2 x e4m3fn GEMM's form), then against any.
    for same_format, same_size, same_kind in ((True, True, True), (True, False, True),
                                              (False, True, True), (False, False, True),
                                              (False, False, False)):
        for i in order:
            if result[i][0]:
                continue
            decision = decisions[i]
            for gemm in free:
                if (_matches(decision, gemm)
                        and (not same_format or _same_formats(decision, gemm))
                        and (not same_size or (sizes[i] is not None
                                               and gemm.elements == sizes[i]))
                        and (not same_kind or gemm.conv == (decision.op_kind == "convolution"))):
                    free.remove(gemm)
                    result[i] = (True, gemm.form)
                    break
    for i, (kept, _) in enumerate(result):
        if kept or not complete:
            continue
        conv = decisions[i].op_kind == "convolution"
        # Its own size first; an fp8 op XLA ran as a 16-bit GEMM shows that form first,
        # then the wide ones.
        # (Not an integer GEMM the program wrote, which ties with the wide float ones.)
        rest = sorted(free, key=lambda g: (g.elements != sizes[i], g.conv != conv, not g.low,
                                           not any(map(_is_float, g.operand_types))))
        result[i] = (False, rest[0].form if rest else None)
    return result


def _fill_from_unnamed(xla_by_scope: dict[tuple[str, bool], list[XlaGemm]],
                       unnamed: list[XlaGemm],
                       wanted: dict[tuple[str, bool], list[tuple[bool, int | None]]]) -> None:
    """Give each scope that XLA has fewer matrix ops of than the report some of the ops
    XLA's HLO names no scope for (XLA:CPU's weight-gradient convolution lost its
    ``op_name``, a composite's inlined dot is named ``dot_general`` alone, and their
    scopes' every op read "merged or removed"). ``wanted``: each scope's decisions as
    (convolution?, result elements). What a scope's named ops do not match is filled
    first by unnamed ops of that kind and size across every scope, then of that kind;
    what is left is the top level's."""
    missing: dict[tuple[str, bool], list[tuple[bool, int | None]]] = {}
    for key, decisions in wanted.items():
        named = xla_by_scope.get(key, [])
        have = Counter((gemm.conv, gemm.elements) for gemm in named)
        unmatched = []
        for item in decisions:
            if have[item]:
                have[item] -= 1
            else:
                unmatched.append(item)
        missing[key] = unmatched[:max(len(decisions) - len(named), 0)]
    for same_size in (True, False):
        for key, unmatched in missing.items():
            for item in list(unmatched):
                pick = next((g for g in unnamed if g.ragged == key[1] and g.conv == item[0]
                             and (not same_size or g.elements == item[1])), None)
                if pick is not None:
                    unnamed.remove(pick)
                    unmatched.remove(item)
                    xla_by_scope.setdefault(key, []).append(pick)
    for gemm in unnamed:
        xla_by_scope.setdefault(("", gemm.ragged), []).append(gemm)


def mark_kept_by_xla(report: Report, hlo_text: str, target: Target | str | None = None,
                     device: str | None = None) -> None:
    """Fill ``kept_by_xla`` for each converted decision from XLA's optimized HLO.

    Per scope, the report's converted ops are compared with XLA's matrix ops: an fp8 op
    counts as kept only against an fp8 GEMM, a 16-bit op against any 16-bit or narrower
    one. As many as XLA has are kept (True); when XLA has every op of the scope, the rest
    were upcast (False); when it has fewer (merged or dead), the rest stay unknown (None),
    and ``report.unknown_to_xla`` counts why. Each decided op also gets ``xla_form``, how
    XLA runs it (``cuBLAS bf16×bf16``; for an op not kept, the form of one of its scope's
    ops that is not). A CPU ``target`` (or ``"cpu"``) notes that XLA:CPU has no fp8
    GEMM; ``device`` names a GPU or TPU compiled for without one (``"H100"``, ``"TPU v5e"``).
    """
    target = as_target(target)
    # Per scope, and ragged_dot apart from the dense ops: one's verdict is no other's.
    xla_by_scope: dict[tuple[str, bool], list[XlaGemm]] = {}
    unnamed: list[XlaGemm] = []
    for gemm in xla_gemms(hlo_text, target):
        # No name, or an op's name alone (a composite's decomposition, which XLA inlines
        # without its caller's name stack; every other op's starts with jit(f)/).
        if "/" not in gemm.op_name:
            unnamed.append(gemm)
            continue
        xla_by_scope.setdefault((scope_key(gemm.op_name), gemm.ragged), []).append(gemm)
    converted: dict[tuple[str, bool], list[int]] = {}
    own_narrow: dict[tuple[str, bool], list[Decision]] = {}  # written narrow by the program
    wanted: dict[tuple[str, bool], list[tuple[bool, int | None]]] = {}
    for index, decision in enumerate(report.decisions):
        key = (scope_key(decision.location), decision.op_kind == "ragged_dot")
        wanted.setdefault(key, []).append((decision.op_kind == "convolution",
                                           _decision_elements(decision)))
        if decision.low_precision and decision.changed:
            converted.setdefault(key, []).append(index)
        elif decision.low_precision and all(map(is_narrow, decision.operands_after)):
            # (An int8 GEMM the program wrote is narrow too, but XLA's s8 GEMM is no
            # float one for a converted op to take: it reserves none.)
            own_narrow.setdefault(key, []).append(decision)
    _fill_from_unnamed(xla_by_scope, unnamed, wanted)
    unknown: dict[str, int] = {}
    for key, indices in converted.items():
        gemms = xla_by_scope.get(key)
        scope, ragged = key
        if gemms is None:  # a location without its caller's prefix (hlo-amp-opt inputs)
            gemms = [g for (name, kind), found in xla_by_scope.items()
                     if scope and kind == ragged and name.endswith("/" + scope)
                     for g in found]
        if not gemms:
            why = RAGGED_UNREAD if ragged else UNMATCHED
            unknown[why] = unknown.get(why, 0) + len(indices)
            continue
        complete = len(gemms) >= len(wanted[key])
        verdicts = _assign([report.decisions[i] for i in indices], gemms, complete,
                           own_narrow.get(key, []))
        for index, (verdict, form) in zip(indices, verdicts):
            report.decisions[index] = dataclasses.replace(
                report.decisions[index], kept_by_xla=verdict, xla_form=form)
        undecided = sum(verdict is None for verdict, _ in verdicts)
        if undecided:
            unknown[MERGED] = unknown.get(MERGED, 0) + undecided
    report.unknown_to_xla = unknown
    mark_attention_kept(report, hlo_text)
    report.xla_target = target.family
    report.xla_fp8_note = target.fp8_kept_note
    report.xla_device = device
    report.xla_checked = True

