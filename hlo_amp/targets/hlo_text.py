"""XLA's optimized HLO as text: its computations and instructions (``parse_module``), and
the walk over a step's work that the roofline (targets/roofline.py) and the collectives
(targets/collectives.py) both take (``HloWalker``): the ENTRY computation, the bodies and
conditions of its ``while`` loops times their trip counts, ``call``/``async-start``
computations as if inlined, and the heaviest branch of a ``conditional``.

A loop's trip count is the ``known_trip_count`` XLA prints in the ``while``'s
``backend_config`` (nested loops multiply); XLA:TPU prints none, so there it is read from
the condition, ``i < N`` with ``i`` starting at a constant; a loop with neither counts
once and is counted in ``unknown_trip_counts``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

# Instructions that launch nothing: no bytes moved, no kernel.
FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
    "after-all", "add-dependency", "partition-id", "replica-id", "domain",
    "async-done", "async-update", "fusion-update", "fusion-done",
    # An async collective's kernel is its start (its result read from the done's).
    "all-gather-done", "all-reduce-done", "collective-permute-done", "reduce-scatter-done",
    # So is an async copy's or slice's (XLA:TPU's prefetch into VMEM): the done waits.
    "copy-done", "slice-done",
})
# XLA:TPU's concatenation of the slices it prefetched into one VMEM buffer: a bitcast.
_BITCAST_CALL = 'custom_call_target="ConcatBitcast"'
_SIZES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0}
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"(\w+)\[([^\]]*)\]")
_REF = re.compile(r"%([\w.\-]+)")


def _dtype_bytes(dtype: str) -> float:
    if dtype.startswith(("f8", "f4", "f6")):
        return {"f8": 1, "f6": 0.75, "f4": 0.5}[dtype[:2]]
    return _SIZES.get(dtype, 4)


def dims(text: str) -> tuple[int, ...]:
    """``(2, 3)`` of ``2,3`` (a bounded dynamic ``<=2`` as its bound)."""
    return tuple(int(d.replace("<=", "")) for d in text.split(",") if d.strip())


@dataclass(frozen=True)
class Array:
    dtype: str
    shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.ceil(_dtype_bytes(self.dtype) * math.prod(self.shape))


@dataclass
class Instruction:
    name: str
    op: str
    arrays: list[Array]  # the result's arrays (several for a tuple)
    operands: list[str]
    attrs: str  # everything after the operand list
    root: bool = False
    args: str = ""  # the operand list's text: "0" for parameter(0)

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.arrays)

    def attr(self, key: str) -> str | None:
        match = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return match.group(1) if match else None

    def backend_config(self) -> dict[str, Any]:
        start = self.attrs.find("backend_config=")
        if start < 0:
            return {}
        try:
            return json.JSONDecoder().raw_decode(self.attrs, start + len("backend_config="))[0]
        except ValueError:
            return {}


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    """One HLO instruction line: its name, op, result arrays and operands; None else."""
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.group(1), match.group(2)
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end < 0:
        return None
    shape_text, rest = rest[:end], rest[end:].lstrip()
    op_match = re.match(r"([\w\-]+)\(", rest)
    if not op_match:
        return None
    open_at = op_match.end() - 1
    close_at = _balanced(rest, open_at)
    arrays = [Array(d, dims(s)) for d, s in _ARRAY.findall(shape_text)]
    args = rest[open_at + 1:close_at - 1]
    return Instruction(name, op_match.group(1), arrays, _REF.findall(args), rest[close_at:],
                       root=line.lstrip().startswith("ROOT "), args=args)


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations of an HLO module's text, by name, and the ENTRY computation's name."""
    computations: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    entry = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("(", 1)[0]:
            current = computations.setdefault(header.group(2), [])
            if header.group(1):
                entry = header.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            instruction = parse_instruction(line)
            if instruction is not None:
                current.append(instruction)
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def _trip_count(condition: list[Instruction], init: Instruction | None,
                defs: dict[str, Instruction]) -> int | None:
    """A loop's trip count from its condition, for HLO without ``known_trip_count``
    (XLA:TPU's): ``i < N`` on a tuple element whose initial value is a constant."""
    root = next((i for i in condition if i.root), None)
    local = {i.name: i for i in condition}
    if (root is None or root.op != "compare" or "direction=LT" not in root.attrs
            or len(root.operands) != 2 or init is None or init.op != "tuple"):
        return None
    counter, bound = (local.get(o) for o in root.operands)
    if (counter is None or bound is None or counter.op != "get-tuple-element"
            or bound.op != "constant"):
        return None
    index = re.search(r"index=(\d+)", counter.attrs)
    start = defs.get(init.operands[int(index.group(1))]) if index else None
    while start is not None and start.op in ("copy", "bitcast") and start.operands:
        start = defs.get(start.operands[0])  # XLA:TPU copies the counter's constant in
    if start is None or start.op != "constant":
        return None
    return max(0, int(bound.args) - int(start.args))


class HloWalker:
    """Walks a step's work (see the module docstring); ``kernel`` says what an
    instruction that is not free adds to ``out``, ``branch_weight`` which branch counts."""

    def __init__(self, computations: dict[str, list[Instruction]]):
        self.computations = computations
        self.defs = {i.name: i for comp in computations.values() for i in comp}
        self.unknown_trip_counts = 0

    def shape(self, name: str) -> Array | None:
        """The (first) array ``name`` defines."""
        inst = self.defs.get(name)
        return inst.arrays[0] if inst is not None and inst.arrays else None

    def size(self, name: str) -> int | None:
        """Bytes of everything ``name`` defines (all of a tuple's arrays)."""
        inst = self.defs.get(name)
        return inst.bytes if inst is not None else None

    def walk(self, computation: str, count: int, out: list[Any]) -> None:
        for inst in self.computations.get(computation, []):
            if inst.op in FREE or (inst.op == "custom-call" and _BITCAST_CALL in inst.attrs):
                continue
            if inst.op == "while":
                trips = inst.backend_config().get("known_trip_count", {}).get("n")
                if trips is None and inst.operands:
                    trips = _trip_count(self.computations.get(inst.attr("condition") or "", []),
                                        self.defs.get(inst.operands[0]), self.defs)
                if trips is None:
                    self.unknown_trip_counts += 1
                n = int(trips) if trips is not None else 1
                self.walk(inst.attr("body") or "", count * n, out)
                self.walk(inst.attr("condition") or "", count * (n + 1), out)
            elif inst.op == "conditional":
                self._conditional(inst, count, out)
            elif inst.op in ("call", "async-start"):
                self.walk(inst.attr("to_apply") or inst.attr("calls") or "", count, out)
            else:
                out.append(self.kernel(inst, count))

    def _conditional(self, inst: Instruction, count: int, out: list[Any]) -> None:
        match = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
        branches = (_REF.findall(match.group(1)) if match else
                    [b for b in (inst.attr("true_computation"),
                                 inst.attr("false_computation")) if b])
        options = []
        for branch in branches:
            kernels: list[Any] = []
            self.walk(branch, count, kernels)
            options.append(kernels)
        if options:
            out.extend(max(options, key=self.branch_weight))

    @staticmethod
    def branch_weight(kernels: list[Any]) -> int:
        """What a branch of a ``conditional`` weighs: the branch weighing most counts."""
        return sum(k.bytes * k.count for k in kernels)

    def kernel(self, inst: Instruction, count: int) -> Any:
        """What ``inst``, executed ``count`` times per step, adds to the walk's list."""
        raise NotImplementedError
