"""The collectives of a compiled step: every all-gather, reduce-scatter, all-reduce,
all-to-all and collective-permute in XLA's optimized HLO, per device, for the report's
``collectives`` and the roofline's communication time (targets/roofline.py).

``read_collectives(hlo_text)`` walks the program as the roofline does
(targets/hlo_text.py: ENTRY, the bodies of ``while`` loops times their trip counts,
``call``/``async-start`` computations inlined, the heaviest branch of a ``conditional``)
and finds:

* the plain ops (``all-gather(...)``: XLA:CPU, XLA:TPU's synchronous form);
* the async pairs ``all-gather-start``/``-done``, ``all-reduce-start``,
  ``collective-permute-start``, ``reduce-scatter-start`` (XLA:GPU, XLA:TPU), counted once
  at their start, their result read from the matching ``-done``;
* ops wrapped in an ``async-start`` computation, and ops inside fusions (XLA:TPU fuses a
  collective with the computation it overlaps, and writes one collective into several
  fusions, its start, its overlap and its done, under one ``channel_id``: it counts once;
  XLA:GPU reuses a ``channel_id`` across distinct collectives, each of which counts).

**Bytes** of a collective are per device and per execution: the larger of its operands'
and its results' bytes, which is the whole array the collective assembles or reduces:
the result of an all-gather, the operand of a reduce-scatter, the operand (= result) of
an all-reduce, all-to-all and collective-permute. Every device runs the same SPMD
program, so the shapes in the HLO are one device's. A combined collective (XLA merges
several into one, ``all-gather-start(a, b, c)``) counts the sum of its arrays.

**Where it comes from**: XLA's ``op_name`` metadata is the JAX name stack of the op whose
sharding needed the collective; its user scopes are read as the report reads an op's
(``Decision.scope``: ``layer1``, transforms and ``jit``/``while`` segments dropped). A
combined collective's name lists its members (``prefix/(a/dot:b/dot)``): each scope is
kept. Where its ``op_name`` names no user scope (none, or not the op that needed it:
with jax 0.11.2, XLA:GPU's combined gather of three f32 weights named none), the scopes
of the instructions that read its result are kept, through its ``-done``,
``get-tuple-element``s, bitcasts, copies, converts and fusions without metadata: the
ops that needed it (a
combined reduce-scatter XLA made without metadata gets its readers', if they have any,
and else those of the instructions that made its operands: the backward dots whose
gradients it reduces).
Where an operand is an argument of the step (through converts, copies, bitcasts and
one-operand fusions), the argument's name is kept too (``params[0]``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from hlo_amp.ir.sites import parse_name, split_outside_parentheses, split_segments
from hlo_amp.targets.hlo_text import HloWalker, Instruction, parse_module

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_LOW16 = ("bf16", "f16")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
# ``replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, with device_ids=(...) maybe.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}")
# Instructions a value passes through unchanged in what it is (an argument's cast or copy).
_PASS_THROUGH = frozenset({"convert", "bitcast", "copy", "reshape", "transpose", "fusion"})
# What a collective's result reaches its readers through (see _reader_scopes).
_RESULT_THROUGH = frozenset({"get-tuple-element", "bitcast", "copy", "convert", "reshape",
                             "transpose", *(f"{kind}-done" for kind in KINDS), "async-done"})


@dataclass(frozen=True)
class Collective:
    """One collective of the step (see the module docstring for what ``bytes`` is)."""

    kind: str  # "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"
    element_types: tuple[str, ...]  # of the arrays it moves, e.g. ("bf16",)
    bytes: int  # per device, per execution: the larger of operand and result bytes
    count: int  # executions per step (loop trip counts multiplied)
    group_size: int | None  # devices in each replica group; None: all (or a permute)
    name: str  # the HLO instruction, "all-gather-start.4"
    scopes: tuple[str, ...] = ()  # the user scopes its op_name names ("layer1")
    parameters: tuple[str, ...] = ()  # arguments of the step it moves ("params[0]")
    op_name: str = ""  # XLA's metadata, the JAX name stack; "" without one
    source: str | None = None  # "model.py:12" where XLA's metadata has it
    bytes_16bit: int = 0  # of ``bytes``, those in bf16 or f16 arrays

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.count

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Collective:
        """The record ``dataclasses.asdict`` (and so ``Report.to_json``) wrote."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def read_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of XLA's optimized HLO text (any backend), in program order."""
    computations, entry = parse_module(hlo_text)
    walker = _CollectiveWalker(computations, entry)
    found: list[list[Collective]] = []
    walker.walk(entry, 1, found)
    return [c for group in found for c in group]


def link_factor(kind: str, devices: int) -> float:
    """Bytes a device sends over its link per byte of the collective, by the ring
    algorithm over ``devices``: all-reduce 2(n-1)/n, all-gather, reduce-scatter and
    all-to-all (n-1)/n, collective-permute 1."""
    n = max(1, devices)
    if kind == "collective-permute":
        return 1.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def _kind(op: str) -> str | None:
    if op in KINDS:
        return op
    if op.endswith("-start") and op[:-len("-start")] in KINDS:
        return op[:-len("-start")]
    return None


def group_size(attrs: str) -> int | None:
    """Devices per replica group, from any of XLA's three spellings of ``replica_groups``:
    ``{{0,1},{2,3}}``, ``[2,4]<=[8]`` (iota: 2 groups of 4) and
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (the named axes' sizes multiplied).
    None for ``{}`` (all devices) or no groups (a collective-permute)."""
    mesh = _MESH_GROUPS.search(attrs)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        axes = re.findall(r"'([^']+)'", mesh.group(2))
        size = 1
        for axis in axes:
            size *= sizes.get(axis, 1)
        return size
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if listed:
        return len([d for d in listed.group(1).split(",") if d.strip()])
    return None


def _member_names(op_name: str) -> list[str]:
    """The name stacks in one ``op_name``: a combined collective's ``prefix/(a:b)`` is
    ``prefix/a`` and ``prefix/b``."""
    segments = split_segments(op_name)
    if segments and segments[-1].startswith("(") and segments[-1].endswith(")"):
        prefix = "/".join(segments[:-1])
        parts = split_outside_parentheses(segments[-1][1:-1], ":")
        return [f"{prefix}/{p}" if prefix else p for p in parts]
    return [op_name] if op_name else []


def _scopes(op_name: str) -> tuple[str, ...]:
    """The user scopes ``op_name`` names, each member's of a combined one."""
    return tuple(dict.fromkeys(s for s in (parse_name(n).scope_path
                                           for n in _member_names(op_name)) if s))


class _CollectiveWalker(HloWalker):
    """The roofline's walk (``HloWalker``), a list of ``Collective`` per instruction."""

    def __init__(self, computations: dict[str, list[Instruction]], entry: str):
        super().__init__(computations)
        self.entry = entry
        self.done = {i.operands[0]: i for comp in computations.values() for i in comp
                     if i.op.endswith("-done") and i.operands}
        self.home = {i.name: name for name, comp in computations.items() for i in comp}
        self.walk_id = 0
        self.serial = 0
        self.seen: set[tuple] = set()  # fused collectives found, see _fused

    def walk(self, computation: str, count: int, out: list) -> None:
        outer, self.serial = self.walk_id, self.serial + 1
        self.walk_id = self.serial
        super().walk(computation, count, out)
        self.walk_id = outer

    @staticmethod
    def branch_weight(kernels: list[Any]) -> int:
        return sum(c.bytes_per_step for group in kernels for c in group)

    def kernel(self, inst: Instruction, count: int) -> list[Collective]:  # type: ignore[override]
        if _kind(inst.op):
            return [self.collective(inst, count)]
        if inst.op in ("fusion", "fusion-start"):
            return self._fused(inst.attr("calls") or "", count, 0)
        return []

    def _fused(self, computation: str, count: int, depth: int) -> list[Collective]:
        """The collectives inside a fusion. XLA:TPU writes one collective into several
        fusions (its start, the computation it overlaps, its done): a copy with the same
        channel, kind, name and shapes as one already found in this walk counts once.
        (Not at the top level: XLA:GPU reuses channel ids across collectives.)"""
        found: list[Collective] = []
        for inst in self.computations.get(computation, []):
            if _kind(inst.op):
                channel, op_name = _CHANNEL.search(inst.attrs), _OP_NAME.search(inst.attrs)
                key = (self.walk_id, inst.op, channel.group(1) if channel else inst.name,
                       op_name.group(1) if op_name else "", tuple(inst.arrays))
                if key not in self.seen:
                    self.seen.add(key)
                    found.append(self.collective(inst, count))
            elif inst.op == "fusion" and depth < 4:
                found.extend(self._fused(inst.attr("calls") or "", count, depth + 1))
        return found

    def collective(self, inst: Instruction, count: int) -> Collective:
        kind = _kind(inst.op) or ""
        operands = [self.defs[o] for o in inst.operands if o in self.defs]
        read = sum(o.bytes for o in operands)
        done = self.done.get(inst.name) if inst.op.endswith("-start") else None
        if done is not None:
            results = done.arrays
        elif inst.op.endswith("-start") and kind != "all-reduce":
            results = inst.arrays[len(operands):]  # (operands, results) without a done
        else:
            results = inst.arrays
        results = [a for a in results if a.dtype != "token"]
        written = sum(a.bytes for a in results)
        larger = results if written >= read else [a for o in operands for a in o.arrays]
        total = max(read, written)
        low = sum(a.bytes for a in larger if a.dtype in _LOW16)
        types = tuple(dict.fromkeys(a.dtype for a in larger))
        op_name = _OP_NAME.search(inst.attrs)
        name = op_name.group(1) if op_name else ""
        scopes = (_scopes(name) or self._reader_scopes(inst.name)
                  or self._producer_scopes(inst.operands))
        source = _SOURCE.search(inst.attrs)
        return Collective(
            kind=kind, element_types=types, bytes=total, count=count,
            group_size=None if kind == "collective-permute" else group_size(inst.attrs),
            name=inst.name, scopes=scopes,
            parameters=tuple(dict.fromkeys(p for p in map(self.parameter, inst.operands)
                                           if p)),
            op_name=name, source=f"{source.group(1)}:{source.group(2)}" if source else None,
            bytes_16bit=low)

    @functools.cached_property
    def readers(self) -> dict[str, list[Instruction]]:
        """Each instruction's readers, built when a collective without scopes asks."""
        readers: dict[str, list[Instruction]] = {}
        for comp in self.computations.values():
            for i in comp:
                for operand in dict.fromkeys(i.operands):
                    readers.setdefault(operand, []).append(i)
        return readers

    def _reader_scopes(self, name: str) -> tuple[str, ...]:
        """The user scopes of the instructions that read ``name``'s result, looking
        through what only passes it on (a ``-done``, ``get-tuple-element``, a convert, a
        fusion without metadata)."""
        return self._scopes_along([name], lambda n: self.readers.get(n, ()),
                                  lambda inst: [inst.name])

    def _producer_scopes(self, names: list[str]) -> tuple[str, ...]:
        """The user scopes of the instructions that made ``names``, looking back through
        what only passes a value on (XLA:GPU's gradient reduce-scatter has no metadata
        and feeds the optimizer's unscoped update: its operands come from the scoped
        backward dots)."""
        return self._scopes_along(names, lambda n: [self.defs[n]] if n in self.defs else (),
                                  lambda inst: inst.operands)

    @staticmethod
    def _scopes_along(start: list[str], step: Any, onward: Any) -> tuple[str, ...]:
        """The user scopes of the first scoped instructions met walking from ``start``
        (``step``: a value's instructions that way; ``onward``: where an instruction
        without scopes that only passes values on leads), six steps at most."""
        found: dict[str, None] = {}
        frontier, seen = list(start), set(start)
        for _ in range(6):
            passed_on = []
            for inst in (i for n in frontier for i in step(n)):
                op_name = _OP_NAME.search(inst.attrs)
                scopes = _scopes(op_name.group(1)) if op_name else ()
                if scopes:
                    found.update(dict.fromkeys(scopes))
                elif inst.op in _RESULT_THROUGH or (op_name is None and inst.op == "fusion"):
                    following = [n for n in onward(inst) if n not in seen]
                    seen.update(following)
                    passed_on.extend(following)
            frontier = passed_on
        return tuple(found)

    def parameter(self, name: str) -> str | None:
        """The step's argument ``name`` is a cast or copy of, by its metadata name."""
        for _ in range(8):
            inst = self.defs.get(name)
            if inst is None:
                return None
            if inst.op == "parameter":
                if self.home.get(name) != self.entry:
                    return None
                op_name = _OP_NAME.search(inst.attrs)
                return op_name.group(1) if op_name else f"parameter {inst.args}"
            live = [o for o in inst.operands
                    if (d := self.defs.get(o)) is not None and d.op != "constant"]
            if inst.op not in _PASS_THROUGH or len(live) != 1:
                return None
            name = live[0]
        return None
