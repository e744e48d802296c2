"""Report: one Decision per candidate op, rendered as a table, JSON and a summary."""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Op-kind column order in summaries.
_KIND_ORDER = ("dot_general", "dot", "convolution", "ragged_dot")
# Where an op's FLOPs go in ``Report.flops_by_scope`` and ``Report.plot``.
PRECISIONS = ("16-bit or narrower", "f32 by policy", "f32: XLA upcast it")
# Prefixes of the float element types 16 bits wide or narrower (bf16, f16, the fp8, fp6
# and fp4 formats), in MLIR's spelling ("f8E4M3FN") and XLA's ("f8e4m3fn").
# bf16, f16 and the fp8/fp6/fp4 families (MLIR's f8E4M3FN, XLA's f8e4m3fn): a prefix
# alone took f64 for an fp6 type.
_NARROW_FLOAT = re.compile(r"^(bf16|f16|f[468][eE])")
# Integers 16 bits wide or narrower (MLIR's i8, si8, ui4; XLA's s8, u8): an int8 GEMM
# the program wrote is narrow too, not "f32 by policy".
_NARROW_INTEGER = re.compile(r"^(i|si|ui|s|u)(1|2|4|8|16)$")


@dataclass(frozen=True)
class Decision:
    """What the pass decided for one candidate op, and why."""

    function: str  # the func.func holding the op (after specialisation)
    op_kind: str  # "dot_general", "dot", "convolution", "ragged_dot"
    scope: str  # "Block_0/attn/query"; "" at top level
    direction: str  # "forward", "backward" or "recomputed" (remat's recomputed forward)
    operands_before: tuple[str, ...]  # element types, e.g. ("f32", "f32")
    operands_after: tuple[str, ...]
    result_before: str
    result_after: str  # the element type the op computes its result in
    action: str | None  # "compute", "keep", a dtype name; None when no rule applies
    rule: str  # "scope:attn", "op:dot_general", "amp_stop", "backward", "default"
    changed: bool  # whether the pass rewrote the op
    reason: str  # why it was (not) changed, in words
    # Estimated multiply-add FLOPs (2 per MAC) per call of the program: one run's times
    # ``runs``; None if a shape is dynamic.
    flops: int | None
    shape: str = ""  # result shape, e.g. "256x2048"
    # Times the op runs per call of the program: the trip counts of the while loops
    # around it (scan, fori_loop) times its function's call sites; a loop whose trip
    # count cannot be read counts once, and the op's notes say so.
    runs: int = 1
    location: str = ""  # the op's name-stack string
    source: str | None = None  # "file.py:12"
    # An f32 op left f32 because the target runs it as one pass of this 16-bit type itself
    # ("bf16": XLA:TPU's dots at DEFAULT precision); None for every other op.
    runs_as: str | None = None
    kept_by_xla: bool | None = None  # filled in after XLA compiles, when checked
    xla_form: str | None = None  # how XLA runs it, e.g. "cuBLAS bf16×bf16", when checked
    notes: tuple[str, ...] = ()

    @property
    def fp8(self) -> bool:
        """Whether the op's operands end up in an fp8 type."""
        return any(t.startswith("f8") for t in self.operands_after)

    @property
    def low_precision(self) -> bool:
        """Whether the op's operands end up 16 bits wide or narrower."""
        return bool(self.operands_after) and all(map(narrow_operand, self.operands_after))


@dataclass(frozen=True)
class AttentionSite:
    """One softmax attention the fused-attention pass found, and whether it now runs as
    a fused kernel (passes/fused_attention/)."""

    function: str
    scope: str  # the scores' matmul's scope path
    direction: str  # "forward", "forward and backward" or "backward"
    fused: bool
    reason: str  # why not, when not fused
    kernel: str = ""  # "cuDNN flash" when fused
    dtype: str = ""  # the kernel's 16-bit type
    shapes: str = ""  # "q 8x2048x32x64, k/v 8x2048x8x64 (BTNH)"
    mask: str = ""  # "none", or "+" of "causal", "constant" (a bias), "mask" (the program's)
    location: str = ""  # the scores' matmul's name stack, without the op
    source: str | None = None
    # The name the fused kernel's forward ops carry (its backward's: + "_backward"); XLA
    # puts the names of the calls it inlines in front of it.
    kernel_name: str = ""
    # After XLA compiled the step: whether its optimized HLO runs the kernel's custom
    # calls for this site; None before (or for a site not fused).
    kept_by_xla: bool | None = None
    # A fused site's matmul FLOPs per call, as the program's matmuls it replaces had
    # them (they are no decisions any more); 0 for a site not fused, whose matmuls are.
    flops: int = 0


def is_narrow(element_type: str) -> bool:
    """Whether ``element_type`` (MLIR's spelling or XLA's HLO text) is a float 16 bits
    wide or narrower."""
    return _NARROW_FLOAT.match(element_type) is not None


def narrow_operand(element_type: str) -> bool:
    """Whether a matrix op's operand of ``element_type`` is 16 bits wide or narrower, a
    float or an integer: "low precision" for a Decision (XLA's verdict, which matches
    float types, reads ``is_narrow``)."""
    return is_narrow(element_type) or _NARROW_INTEGER.match(element_type) is not None


@dataclass
class Report:
    """Every decision of one pass run, plus the policy's rules that matched nothing."""

    policy: str = ""
    decisions: list[Decision] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)  # every rule of the policy
    notes: list[str] = field(default_factory=list)
    xla_checked: bool = False
    # Converted ops XLA's HLO could not decide, counted by why (targets/kept_by_xla.py).
    unknown_to_xla: dict[str, int] = field(default_factory=dict)
    xla_target: str | None = None  # the backend family XLA compiled for ("cpu", "gpu")
    # Why the fp8 GEMMs XLA kept gain no speed there (Target.fp8_kept_note); "" if they do.
    xla_fp8_note: str = ""
    xla_device: str | None = None  # "H100", "TPU v5e": compiled without the device
    # scaling=delayed: the amax history columns the fp8 pass asked for (one per
    # quantised tensor, one per iteration for a tensor in a scan); the state
    # hlo_amp.compile carries has this many.
    fp8_state_columns: int = 0
    # The propagation pass (mixed_* modes): {"ops": {kind: {"painted": n, "f32": {why: n}}},
    # "functions": [{function, bytes_before, low_bytes_before, bytes_after,
    # low_bytes_after}], "clones": n}; None when it did not run.
    propagation: dict[str, Any] | None = None
    rules_used: set[str] = field(default_factory=set)  # rules that matched non-matrix ops
    # Rules that matched an op but lost on precedence there: rule -> the rule that won.
    rules_outranked: dict[str, str] = field(default_factory=dict)
    # The compiled step's collectives (targets/collectives.py ``Collective``), read from
    # XLA's optimized HLO by AmpCompiled.report(); empty before XLA compiles or unsharded.
    collectives: list[Any] = field(default_factory=list)
    # Every softmax attention found, fused or not (passes/fused_attention/).
    attention: list[AttentionSite] = field(default_factory=list)
    # False where the passes run left out insert_converts, which decides matrix ops
    # (hlo-amp-opt --pass ...): no decision then says nothing of the ops there are.
    matrix_ops_decided: bool = True

    def name_parsed_buffer(self, source_name: str) -> None:
        """Write ``source_name`` for the ``-`` that jaxlib's bindings name a parsed text
        buffer in its ops' locations (``-:7`` becomes ``in.mlir:7``)."""
        def named(source: str | None) -> str | None:
            return f"{source_name}{source[1:]}" if source and source.startswith("-:") else source

        self.decisions = [replace(d, source=named(d.source)) for d in self.decisions]
        self.attention = [replace(a, source=named(a.source)) for a in self.attention]
        self.notes = [named(n) for n in self.notes]  # an op's note without a decision

    def add(self, decision: Decision) -> int:
        """Append ``decision``; its index, which the pass marks its op with."""
        self.decisions.append(decision)
        return len(self.decisions) - 1

    def note(self, text: str, decision: int | None = None, location: str = "") -> None:
        """Attach a later pass's note to decision number ``decision`` (its op's mark,
        ``hlo_amp.ir.modules.decision_of``), once however many copies of the op note it.
        An op without one (a module another run rewrote) notes the report, under
        ``location``."""
        if decision is not None and 0 <= decision < len(self.decisions):
            found = self.decisions[decision]
            if text not in found.notes:
                self.decisions[decision] = replace(found, notes=found.notes + (text,))
            return
        self.notes.append(f"{location}: {text}" if location else text)

    @property
    def unused_rules(self) -> list[str]:
        # Op rules of a preset name every op kind; a module without convs is normal,
        # and so is one without a stem or head matrix op outside a loop (a scanned
        # decoder whose embedding is a gather: first_matrix_op, last_matrix_op); so only
        # scope and backward rules are reported as unused.
        used = {d.rule for d in self.decisions} | self.rules_used
        return [r for r in self.rules if r not in used and not r.startswith("op:")
                and r not in ("first_matrix_op", "last_matrix_op")]

    def note_outranked(self, winner: str, losers: Sequence[str]) -> None:
        """Note the rules that matched an op and lost on precedence to ``winner``."""
        for loser in losers:
            self.rules_outranked.setdefault(loser, winner)

    def unused_rule_lines(self) -> list[str]:
        """The unused rules in words: those that matched no op, and those that matched
        ops but lost on precedence on each (with a rule that won)."""
        unmatched = [r for r in self.unused_rules if r not in self.rules_outranked]
        outranked = [f"{r} (by {self.rules_outranked[r]})" for r in self.unused_rules
                     if r in self.rules_outranked]
        lines = []
        if unmatched:
            lines.append("matched no op: " + ", ".join(unmatched))
        if outranked:
            lines.append("matched ops but lost on precedence on each: " + ", ".join(outranked))
        return lines

    # ---- rendering ------------------------------------------------------------------

    def summary(self) -> str:
        """One line: converted counts per op kind, FLOPs share, XLA's verdict."""
        kinds = [k for k in _KIND_ORDER if any(d.op_kind == k for d in self.decisions)]
        kinds += sorted({d.op_kind for d in self.decisions} - set(kinds))
        if not kinds:
            if not self.matrix_ops_decided:
                line = "no matrix-op decisions: the passes run leave out hlo-amp-insert-converts"
            elif any(a.fused for a in self.attention):
                # Its matmuls run in the fused kernels' 16-bit type.
                line = ("no dot or convolution ops outside fused attention; 100% of FLOPs in "
                        "16-bit or narrower")
            else:
                line = "no dot or convolution ops found"
            if self.attention:
                line += "; " + self.attention_clause()
            return line + ("; " + self.collectives_clause() if self.collectives else "")
        parts = []
        for kind in kinds:
            of_kind = [d for d in self.decisions if d.op_kind == kind]
            fp8 = sum(d.fp8 for d in of_kind)
            parts.append(f"{sum(d.low_precision for d in of_kind)}/{len(of_kind)} {kind}"
                         + (f" ({fp8} fp8)" if fp8 else ""))
        # A fused attention's matmuls run in its 16-bit type inside the kernel.
        fused = sum(a.flops for a in self.attention if a.fused)
        total = sum(d.flops or 0 for d in self.decisions) + fused
        low = sum(d.flops or 0 for d in self.decisions if d.low_precision) + fused
        share = f"{100.0 * low / total:.0f}%" if total else "n/a"
        line = f"low precision: {', '.join(parts)}; {share} of FLOPs in 16-bit or narrower"
        unknown = sum(d.flops is None for d in self.decisions)
        if unknown:  # a dynamic shape: the share leaves them out
            line += f" ({unknown} {'op' if unknown == 1 else 'ops'} of unknown FLOPs left out)"
        left = [d for d in self.decisions if d.runs_as]
        if left:
            types = "/".join(dict.fromkeys(d.runs_as or "" for d in left))
            left_flops = sum(d.flops or 0 for d in left)
            line += (f"; {len(left)} f32 {'op' if len(left) == 1 else 'ops'} left to XLA's "
                     f"own {types} pass"
                     + (f" ({100.0 * left_flops / total:.0f}% of FLOPs)" if total else ""))
        converted = [d for d in self.decisions if d.changed]
        line = f"converted {len(converted)}/{len(self.decisions)} ops; " + line
        if self.xla_checked:
            checked = [d for d in self.decisions if d.kept_by_xla is not None]
            kept = sum(bool(d.kept_by_xla) for d in checked)
            where = f" ({self.xla_device}, compiled without a device)" if self.xla_device else ""
            line += f"; kept by XLA{where}: {kept}/{len(checked)}"
            unknown = sum(self.unknown_to_xla.values())
            if unknown:
                why = "; ".join(self.unknown_to_xla)
                line += f" ({unknown} unknown: {why})"
            fp8 = [d for d in checked if d.fp8]
            if fp8 or any(d.fp8 and d.changed for d in self.decisions):
                line += f"; fp8 GEMMs kept by XLA: {sum(bool(d.kept_by_xla) for d in fp8)}"
                line += f"/{len(fp8)}"
                if self.xla_fp8_note:
                    line += f" ({self.xla_fp8_note})"
        if self.propagation is not None:
            line += "; " + self.activations_clause()
        if self.attention:
            line += "; " + self.attention_clause()
        if self.collectives:
            line += "; " + self.collectives_clause()
        return line

    def attention_clause(self) -> str:
        """``attention: 16 of 16 sites fused (cuDNN flash)``, with XLA's verdict once
        compiled (each site's reason: ``attention_lines``)."""
        fused = [a for a in self.attention if a.fused]
        kernels = ", ".join(dict.fromkeys(a.kernel for a in fused))
        line = (f"attention: {len(fused)} of {len(self.attention)} sites fused"
                + (f" ({kernels})" if kernels else ""))
        checked = [a for a in fused if a.kept_by_xla is not None]
        if checked:
            line += f", kept by XLA: {sum(bool(a.kept_by_xla) for a in checked)}/{len(checked)}"
        return line

    def attention_lines(self) -> list[str]:
        """One line per attention site: scope, direction, shapes, mask, fused or why not."""
        if not self.attention:
            return []
        lines = ["attention sites:"]
        for a in self.attention:
            what = (f"fused ({a.kernel}, {a.dtype})" if a.fused else f"not fused: {a.reason}")
            lines.append(f"  {a.function} {a.scope or '-'} [{a.direction}] {a.shapes or '-'}"
                         f" mask {a.mask or '-'}: {what}")
        return lines

    def collectives_clause(self) -> str:
        """``collectives: 41 per step, 468 MiB per device, 62% of bytes in 16-bit`` (bytes
        per device and step; 16-bit: bf16 and f16 arrays)."""
        count = sum(c.count for c in self.collectives)
        total = sum(c.bytes * c.count for c in self.collectives)
        low = sum(c.bytes_16bit * c.count for c in self.collectives)
        share = f"{100.0 * low / total:.0f}%" if total else "n/a"
        return (f"collectives: {count} per step, {_mib(total)} per device, {share} of bytes "
                f"in 16-bit")

    def collective_lines(self) -> list[str]:
        """Per kind of collective: executions, bytes per device and step, element types."""
        if not self.collectives:
            return []
        lines = ["collectives per kind (per device and step; each one in to_json()):"]
        for kind in dict.fromkeys(c.kind for c in self.collectives):
            of_kind = [c for c in self.collectives if c.kind == kind]
            types = ", ".join(dict.fromkeys(t for c in of_kind for t in c.element_types))
            lines.append(f"  {kind}: {sum(c.count for c in of_kind)}, "
                         f"{_mib(sum(c.bytes * c.count for c in of_kind))} ({types})")
        return lines

    def activations_clause(self) -> str:
        """``activations: 71% of intermediate bytes in 16-bit (was 0%)``, as the
        propagation left them (before fp8's quantisation and CPU relayout copies)."""
        rows = (self.propagation or {}).get("functions", [])
        after = sum(r["bytes_after"] for r in rows)
        before = sum(r["bytes_before"] for r in rows)
        share = 100.0 * sum(r["low_bytes_after"] for r in rows) / after if after else 0.0
        was = 100.0 * sum(r["low_bytes_before"] for r in rows) / before if before else 0.0
        return f"activations: {share:.0f}% of intermediate bytes in 16-bit (was {was:.0f}%)"

    def propagation_lines(self) -> list[str]:
        """Per op kind: painted, and the f32 rest by reason; per function: bytes."""
        if self.propagation is None:
            return []
        lines = ["propagated ops (painted 16-bit; left f32 and why):"]
        for kind, row in self.propagation["ops"].items():
            rest = ", ".join(f"{n} {why}" for why, n in sorted(row["f32"].items(),
                                                               key=lambda item: -item[1]))
            lines.append(f"  {kind}: {row['painted']} painted" + (f"; f32: {rest}" if rest
                                                                    else ""))
        lines.append("intermediate bytes in 16-bit, per function (before -> after):")
        unchanged = 0
        for row in self.propagation["functions"]:
            if row["low_bytes_after"] == row["low_bytes_before"]:
                unchanged += bool(row["bytes_after"])
            elif row["bytes_after"]:
                lines.append(f"  {row['function']}: {_size(row['low_bytes_before'])} of "
                             f"{_size(row['bytes_before'])} -> {_size(row['low_bytes_after'])}"
                             f" of {_size(row['bytes_after'])}")
        if unchanged:
            lines.append(f"  ({unchanged} more function(s) unchanged)")
        if self.propagation.get("clones"):
            lines.append(f"  ({self.propagation['clones']} private function(s) cloned per "
                         f"painting)")
        return lines

    def flops_by_scope(self, depth: int = 1) -> dict[str, dict[str, int]]:
        """FLOPs per scope (its first ``depth`` segments) split by precision, biggest first.

        Each value maps ``PRECISIONS`` to FLOPs: the ops in 16 bit or narrower, the ops the
        policy left or put in f32, and the converted ops XLA computes in f32 anyway.
        """
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be a whole number >= 1 (scope segments); got "
                             f"{depth!r}")
        table: dict[str, dict[str, int]] = {}
        for d in self.decisions:
            scope = "/".join(d.scope.split("/")[:depth]) if d.scope else "(top level)"
            if not d.low_precision:
                precision = PRECISIONS[1]
            else:
                precision = PRECISIONS[2] if d.kept_by_xla is False else PRECISIONS[0]
            row = table.setdefault(scope, dict.fromkeys(PRECISIONS, 0))
            row[precision] += d.flops or 0
        for site in self.attention:  # a fused kernel's matmuls, in its 16-bit type
            if site.fused and site.flops:
                scope = "/".join(site.scope.split("/")[:depth]) if site.scope else "(top level)"
                row = table.setdefault(scope, dict.fromkeys(PRECISIONS, 0))
                row[PRECISIONS[0] if site.kept_by_xla is not False else PRECISIONS[2]] += site.flops
        return dict(sorted(table.items(), key=lambda item: -sum(item[1].values())))

    def plot(self, path: Any, depth: int = 1, top: int = 25) -> Any:
        """Write a PNG bar chart of ``flops_by_scope(depth)`` (the ``top`` biggest scopes)."""
        if not isinstance(top, numbers.Integral) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a whole number >= 1 (the scopes drawn as bars of "
                             f"their own); got {top!r}")
        rows = self.flops_by_scope(depth)
        figure_type = matplotlib_figure("Report.plot")
        names = list(rows)[:top]
        if len(rows) > top:  # the long tail as one bar, so the total stays honest
            tail = f"({len(rows) - top} more)"
            rows[tail] = {p: sum(rows[n][p] for n in list(rows)[top:]) for p in PRECISIONS}
            names.append(tail)
        figure = figure_type(figsize=(8, 1.2 + 0.3 * len(names)))
        axes = figure.add_subplot()
        biggest = max((sum(rows[n].values()) for n in names), default=0)
        scale, unit = next(((f, u) for f, u in ((1e12, "TFLOP"), (1e9, "GFLOP"),
                                                 (1e6, "MFLOP")) if biggest >= f), (1e3, "kFLOP"))
        left = [0.0] * len(names)
        for precision, colour in zip(PRECISIONS, ("tab:green", "tab:gray", "tab:red")):
            widths = [rows[n][precision] / scale for n in names]
            axes.barh(names, widths, left=left, color=colour, label=precision)
            left = [a + b for a, b in zip(left, widths)]
        axes.set_xlim(0, 1.05 * biggest / scale or 1)
        axes.invert_yaxis()  # biggest scope on top
        axes.set_xlabel(f"{unit} per call")
        axes.set_title(f"{self.policy}: FLOPs per scope (depth {depth})", fontsize=10)
        # Below the axis label, in a band of its own (under the axes it covered the
        # label of a chart of few scopes), as Attribution.plot's.
        figure.legend(*axes.get_legend_handles_labels(), loc="lower center", ncol=3,
                      fontsize=8, frameon=False)
        figure.tight_layout(rect=(0, 0.35 / figure.get_figheight(), 1, 1))
        figure.savefig(path, dpi=110)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "summary": self.summary(),
            "decisions": [asdict(d) for d in self.decisions],
            "unused_rules": self.unused_rules,
            "notes": list(self.notes),
            "unknown_to_xla": dict(self.unknown_to_xla),
            "xla_checked": self.xla_checked,
            "xla_target": self.xla_target,
            "xla_device": self.xla_device,
            "xla_fp8_note": self.xla_fp8_note,
            "fp8_state_columns": self.fp8_state_columns,
            "propagation": self.propagation,
            "collectives": [asdict(c) for c in self.collectives],
            "attention": [asdict(a) for a in self.attention],
            "rules_outranked": dict(self.rules_outranked),
            "matrix_ops_decided": self.matrix_ops_decided,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        header = ("function", "op", "scope", "line", "dir", "shape", "before", "after",
                  "action", "rule", "why", "GFLOP")
        rows = [header]
        for d in self.decisions:
            rows.append((
                d.function, d.op_kind, d.scope or "-", _short_source(d.source),
                d.direction[:3], d.shape,
                "x".join(d.operands_before) + "->" + d.result_before,
                "x".join(d.operands_after) + "->" + d.result_after,
                d.action or "-", d.rule, d.reason + _xla_mark(d),
                ("?" if d.flops is None else f"{d.flops / 1e9:.3f}")
                + (f" ({d.runs}x)" if d.runs != 1 else ""),
            ))
        lines = text_table(header, rows[1:])
        lines.append("")
        lines.append(f"policy: {self.policy}")
        lines.append(self.summary())
        lines.extend(f"unused rules: {line}" for line in self.unused_rule_lines())
        lines.extend(self.propagation_lines())
        lines.extend(self.attention_lines())
        lines.extend(self.collective_lines())
        lines.extend(self.notes)
        lines.extend(self.op_note_lines())
        return "\n".join(lines)

    def op_note_lines(self) -> list[str]:
        """Later passes' notes on single ops, counted by what they say (details in JSON)."""
        counts: dict[str, int] = {}
        for d in self.decisions:
            for note in d.notes:
                head = note.split(" (", 1)[0]
                counts[head] = counts.get(head, 0) + 1
        return [f"{n} op(s): {head} (per op in to_json())" for head, n in counts.items()]


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    if count < 1024 ** 2:
        return f"{count / 1024:.1f} KiB"
    return f"{count / 1024 ** 2:.1f} MiB"


def _mib(count: int) -> str:
    mib = count / 1024 ** 2
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Left-aligned columns under a header and a rule of dashes, one line per row."""
    cells = [tuple(map(str, header))] + [tuple(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def matplotlib_figure(what: str) -> Any:
    """A ``Figure`` class drawing with the Agg canvas: no pyplot, so the caller's
    backend is left alone. matplotlib is optional; without it, one ImportError."""
    try:
        import matplotlib  # noqa: F401  (first: a missing package fails here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"{what} needs matplotlib: pip install matplotlib (or the "
                          f"examples extra, pip install 'hlo_amp[examples]')") from None

    def figure(**options: Any) -> Any:
        made = Figure(**options)
        FigureCanvasAgg(made)
        return made

    return figure


def _short_source(source: str | None) -> str:
    """``model.py:12`` of a full ``/path/to/model.py:12``; ``-`` when unknown."""
    return source.rsplit("/", 1)[-1] if source else "-"


def _xla_mark(decision: Decision) -> str:
    if decision.kept_by_xla is None:
        return ""
    if decision.kept_by_xla:
        return ""
    return f" (XLA upcast it: {decision.xla_form})" if decision.xla_form else " (XLA upcast it)"
