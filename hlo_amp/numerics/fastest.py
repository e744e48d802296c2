"""``autopolicy(..., target=...)``: the policy a device runs fastest, in the roofline's
model of its compiled step, whose error measured here stays within a budget.

Per scope at ``depth`` (``attribute``'s groups) the levels are f32, the base policy's
compute dtype (bf16 or f16) and, where the target runs fp8 GEMMs and the scope has a dot
that takes the fp8 form, fp8 (``float8_e5m2``: e4m3fn forward, e5m2 gradients). Each
candidate policy has two costs: an XLA compile here (its error, against f32 or f64) and a
deviceless compile for the target (its roofline step time, hlo_amp/targets/roofline.py).

The search is greedy and bounded:

1. Each scope alone, every other named scope f32: one run per level below f32 (its error
   added) and one deviceless compile per level (its modelled time saved against every
   scope f32). That is ``2 * levels`` compiles per scope.
2. From every named scope f32, take moves (a scope one or two levels down) in the order
   of time saved per unit of error added, both as phase 1 measured them alone; each move
   is confirmed by running the policy it leads to. A move whose run breaks the budget is
   undone, and that scope goes no lower. A move that saves no modelled time is never
   taken: it could only add error.
3. The policy the moves end at is compiled for the target (its own step time, not the
   sum of phase 1's savings), and so are the baselines (f32, the base policy everywhere,
   fp8 everywhere it is eligible, and the base policy everywhere but the scopes whose
   16-bit run alone broke the budget); of those within the budget the fastest is
   returned. The last one catches what single moves miss: where each scope alone saves
   nothing (a convert costs what its dot gains) but all of them together do, as on a
   TPU, whose f32 dots run as bf16 passes.

Going down from f32 keeps every confirmed state within the budget, so running out of
``max_compiles`` returns a valid policy; starting from the fastest and going up would
return an over-budget one. Errors are max-over-outputs, not sums, so phase 1's
predictions only order the moves; phase 2's runs decide.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import jax

from hlo_amp.ir.shardings import partition_count
from hlo_amp.numerics.attribute import TOP_LEVEL, _groups, _pattern, with_scopes
from hlo_amp.numerics.measure import DELAYED_NOTE, Session
from hlo_amp.numerics.render import json_number, short
from hlo_amp.policy import SCALINGS, Policy
from hlo_amp.policy_terms import FP8_ACTIONS, OP_KINDS
from hlo_amp.report import Report, text_table
from hlo_amp.runtime.compile import compile as amp_compile
from hlo_amp.runtime.compile import rewrite_lowered
from hlo_amp.runtime.deviceless import compile_lowered, lower_for_target
from hlo_amp.targets import Target, device_target, refuse_policy_on_device
from hlo_amp.targets.roofline import estimate

F32, COMPUTE, FP8 = "float32", "compute", "float8_e5m2"
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", FP8: "fp8"}
DEFAULT_MAX_COMPILES = 120
SEARCH = ("greedy from f32: scopes moved down (f32 -> 16-bit -> fp8) by modelled time "
          "saved per unit of error added, each move confirmed by a run")


@dataclass(frozen=True)
class ScopeChoice:
    """One scope's row of the table."""

    scope: str
    ops: int
    flops: int
    fp8_dots: int  # dots of the scope that take the fp8 GEMM form on the target
    levels: tuple[str, ...]  # the levels searched ("f32", "bf16", "fp8")
    choice: str  # the level chosen
    error: float  # the error with only this scope at its choice (others f32)
    saved_seconds: float  # modelled step time saved by it alone, against every scope f32
    why: str = ""  # why it stopped there


@dataclass(frozen=True)
class Baseline:
    """A policy the chosen one is compared with."""

    name: str
    policy: str
    error: float
    step_seconds: float
    met: bool


@dataclass(frozen=True)
class Move:
    """One step of the greedy search: a scope moved down, confirmed by a run."""

    scope: str
    to: str
    predicted_saving: float
    error: float  # the measured error of the policy with the move
    kept: bool


@dataclass
class TargetAutoPolicy:
    """What ``autopolicy(..., target=...)`` chose, and how."""

    policy: Policy
    target: str  # the device: "H100"
    budget: float
    error: float  # the chosen policy's measured error
    met: bool
    step_seconds: float  # the chosen policy's modelled step time on the target
    scopes: list[ScopeChoice]
    baselines: list[Baseline]
    moves: list[Move]
    reference: str
    compiles: int  # XLA compiles here (runs) and for the target, together
    target_compiles: int
    seconds: float
    search: str = SEARCH
    notes: list[str] = field(default_factory=list)

    @property
    def f32_scopes(self) -> list[str]:
        return [row.scope for row in self.scopes if row.choice == "f32"]

    @property
    def choices(self) -> dict[str, str]:
        """Scope -> the level chosen ("f32", "bf16", "f16", "fp8")."""
        return {row.scope: row.choice for row in self.scopes}

    def to_dict(self) -> dict[str, Any]:
        return json_number({
            "policy": self.policy.to_string(), "target": self.target,
            "budget": self.budget, "error": self.error, "met": self.met,
            "step_seconds": self.step_seconds, "reference": self.reference,
            "scopes": [asdict(row) for row in self.scopes],
            "baselines": [asdict(row) for row in self.baselines],
            "moves": [asdict(row) for row in self.moves], "compiles": self.compiles,
            "target_compiles": self.target_compiles, "seconds": self.seconds,
            "search": self.search, "notes": self.notes,
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        lines = [(f"autopolicy for {self.target}: budget {self.budget:g} (error = max over "
                 f"outputs, against {self.reference}, measured on this machine); step time "
                 f"= roofline of the step compiled for {self.target}")]
        rows = [(row.scope, row.ops, "/".join(row.levels), row.choice, short(row.error),
                 _us(row.saved_seconds), row.why) for row in self.scopes]
        lines += text_table(("scope", "ops", "searched", "choice", "error alone",
                             "time saved alone", "why"), rows)
        lines.append("")
        rows = [(b.name, short(b.error), _us(b.step_seconds),
                 f"{b.step_seconds / self.step_seconds:.3f}x" if self.step_seconds else "-",
                 "yes" if b.met else "no") for b in self.baselines]
        lines += text_table(("policy", "error", "step (model)", "vs chosen", "within"), rows)
        state = "within" if self.met else "NOT within"
        lines.append(f"chosen (error {short(self.error)}, {state} budget; step "
                     f"{_us(self.step_seconds)} modelled): {self.policy.to_string()}")
        lines.append(f"search: {self.search}; {self.compiles} XLA compile(s) "
                     f"({self.target_compiles} for {self.target}), {self.seconds:.1f} s")
        lines += self.notes
        return "\n".join(lines)


def _us(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e6:.4g} us"


class _TargetModel:
    """``fn`` lowered once for the target; per policy a rewrite, a deviceless compile and
    its roofline step time (cached by policy string, and the compile by the rewritten
    module: policies written apart that rewrite alike, such as a search's state of every
    scope at bf16 and the bf16 baseline, compile once)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, device: Target) -> None:
        self.device = device
        self.fn, self.args = fn, args
        self.lowered = lower_for_target(jax.jit(fn), args, {}, device)
        self.seconds: dict[str, float] = {}
        self.module_seconds: dict[bytes, float] = {}  # by the rewritten module's digest
        self.compiles = 0

    def report(self, policy: Policy) -> Report:
        """The pass's report for the target, without compiling."""
        return rewrite_lowered(self.lowered, policy, self.device)[1]

    def step_seconds(self, policy: Policy) -> float:
        key = policy.to_string()
        if key not in self.seconds:
            if policy.uses_fp8 and policy.scaling == "delayed":
                # The step as it runs under delayed scaling: the amax history in and
                # out (runtime/fp8_state.py), each scale read from it, not from this
                # step's amax. jax.jit's lowering carries no history, and the fp8 pass
                # would price current scaling for it.
                lowered = amp_compile(self.fn, policy).lower_for(self.device, *self.args)
                module, options = lowered.as_text(), None
            else:
                lowered = rewrite_lowered(self.lowered, policy, self.device)[0]
                module, options = lowered.as_text(), self.device.compiler_options or None
            digest = hashlib.sha256(module.encode()).digest()
            if digest not in self.module_seconds:
                text = compile_lowered(lowered, options).as_text()
                self.compiles += 1
                self.module_seconds[digest] = estimate(text, self.device).roofline_seconds
            self.seconds[key] = self.module_seconds[digest]
        return self.seconds[key]


class _Progress:
    """One stderr line, rewritten in place: compiles spent of the bound, and what now."""

    def __init__(self, enabled: bool, device: str, bound: int) -> None:
        self.enabled, self.device, self.bound = enabled, device, bound
        self.width = 0

    def show(self, spent: int, what: str) -> None:
        if not self.enabled:
            return
        line = f"autopolicy {self.device}: {spent}/{self.bound} compiles, {what}"
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = len(line)

    def close(self) -> None:
        if self.enabled and self.width:
            sys.stderr.write("\n")
            sys.stderr.flush()


def check_target(target: Any) -> Target:
    """The device for ``target``, which must have the peaks the roofline needs."""
    try:
        device = device_target(target)
    except TypeError as error:
        raise ValueError(str(error)) from None
    if not device.peak_flops or not device.hbm_bytes_per_second:
        raise ValueError(f"target={target!r} has no published peaks or HBM bandwidth, and "
                         "autopolicy's step time is the roofline of them; accepted: a "
                         "named GPU or TPU (h100, h200, a100, tpu-v5e, ...)")
    return device


def fp8_refusal(device: Target) -> str | None:
    """Why ``device`` gets no fp8 level, or None where its GEMMs run fp8."""
    why = device.refusal(set(FP8_ACTIONS))
    if why:
        return why
    if "f8" not in device.peak_flops:
        return f"{device.device or device.name} has no fp8 matrix peak (no fp8 GEMM)"
    return None


def check_max_compiles(value: Any) -> int:
    # numbers.Integral: a NumPy integer too, as depth and budget take them
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"Invalid max_compiles {value!r}; accepted: an int >= 1")
    return int(value)


def target_autopolicy(fn: Callable[..., Any], args: tuple, *, budget: float, depth: Any,
                      base: Policy, reference: str, atol: float, target: Any,
                      max_compiles: Any, progress: bool,
                      target_fn: Callable[..., Any] | None = None,
                      fp8_scaling: str | None = None) -> TargetAutoPolicy:
    """The search in this module's docstring; arguments already checked but target.
    ``target_fn``: what to compile for the target where it is not ``fn`` (the CLI's
    module, exported once per platform). ``fp8_scaling``: the scaling of every policy
    with fp8 the search prices (docs/fp8.md; None: the base's); under "delayed" the step
    is compiled with its amax history."""
    fp8_scaling = resolve_fp8_scaling(fp8_scaling, base)
    device = check_target(target)
    max_compiles = check_max_compiles(max_compiles)
    refuse_policy_on_device(base, device)  # f16 on a TPU: refused before any compile
    start = time.perf_counter()
    session = Session(fn, args, "autopolicy")  # hlo_amp.compile's fn, statics bound
    # Groups from the program as written here, unfused: a scope holding an attention
    # alone is searched too (at f32 the target leaves it unfused).
    groups = _groups(session.report(base), depth)  # a bad depth fails here
    patterns = {g: p for g in groups if (p := _pattern(g, int(depth))) is not None}
    named = list(patterns)
    no_fp8 = fp8_refusal(device)
    model = _TargetModel(target_fn or session.fn, session.args, device)
    # The runs compute the target's program: attention fused as there (with the
    # reference kernel), so an fp8 scope measures the 16-bit attention the target runs,
    # not attention matmuls in fp8; none where the target's program is partitioned (a
    # mesh: the pass leaves attention unfused there).
    if partition_count(model.lowered.compiler_ir("stablehlo")) <= 1:
        session.fused_as = device
    low = SHORT.get(base.compute_dtype, base.compute_dtype)
    names = {F32: "f32", COMPUTE: low, FP8: "fp8"}

    fp8_dots: dict[str, int] = {g: 0 for g in groups}
    if no_fp8 is None and named:
        every_fp8 = with_scopes(base, dict.fromkeys(patterns.values(), FP8))
        for group, decisions in _groups(model.report(every_fp8), depth).items():
            fp8_dots[group] = sum(1 for d in decisions if d.fp8)
    levels = {g: (F32, COMPUTE, FP8) if fp8_dots.get(g) else (F32, COMPUTE) for g in named}

    # A base that does not compute its dots in 16 bit (fp8, f32): the compute level is
    # a rule of its own (without one, a scope "at bf16" ran the base's fp8 or f32).
    explicit = base.ops.get("dot_general") != COMPUTE

    def policy_of(state: Mapping[str, str]) -> Policy:
        rules = {patterns[g]: a for g, a in state.items() if a != COMPUTE or explicit}
        return with_scaling(with_scopes(base, rules), fp8_scaling)

    # Phase 1 plus the final compiles (the chosen policy and three baselines, each run
    # and compiled for the target) must fit the bound; phase 2 gets what is left.
    singles = sum(len(v) - 1 for v in levels.values())
    needed = 2 + 2 * singles + _FINAL
    if max_compiles < needed:
        raise ValueError(
            f"Invalid max_compiles {max_compiles}: measuring each of the {len(named)} "
            f"scope(s) at depth {depth} once and the baselines takes {needed}; accepted: "
            f"an int >= {needed}, or a smaller depth")
    bar = _Progress(progress, device.device or device.name, max_compiles)

    def spent() -> int:
        return session.compiles + model.compiles

    def error(policy: Policy, what: str) -> float:
        bar.show(spent(), what)
        return session.error(policy, reference, atol)

    def seconds(policy: Policy, what: str) -> float:
        bar.show(spent(), what)
        return model.step_seconds(policy)

    try:
        all_f32 = {g: F32 for g in named}
        start_error = error(policy_of(all_f32), "every scope f32")
        start_time = seconds(policy_of(all_f32), f"every scope f32 on {device.device}")
        alone_error: dict[tuple[str, str], float] = {}
        saved: dict[tuple[str, str], float] = {}
        for g in named:
            alone_error[(g, F32)], saved[(g, F32)] = start_error, 0.0
            for level in levels[g][1:]:
                state = {**all_f32, g: level}
                alone_error[(g, level)] = error(policy_of(state), f"{g} {names[level]}")
                saved[(g, level)] = start_time - seconds(
                    policy_of(state), f"{g} {names[level]} on {device.device}")

        state = dict(all_f32)
        floor = {g: len(levels[g]) for g in named}  # levels at or past it are refused
        why: dict[str, str] = {}
        moves: list[Move] = []
        current = start_error
        cut = False
        while True:
            candidates = []
            for g in named:
                here = levels[g].index(state[g])
                for i in range(here + 1, floor[g]):
                    level = levels[g][i]
                    gain = saved[(g, level)] - saved[(g, state[g])]
                    if gain <= 0:
                        continue
                    added = alone_error[(g, level)] - alone_error[(g, state[g])]
                    ratio = math.inf if added <= 0 else gain / added
                    candidates.append((ratio, gain, g, level, i))
            if not candidates:
                break
            if spent() >= max_compiles - _FINAL:  # what step 3 needs is kept for it
                cut = True
                break
            ratio, gain, g, level, i = max(candidates, key=lambda c: (c[0], c[1]))
            trial = {**state, g: level}
            measured = error(policy_of(trial), f"trying {g} {names[level]}")
            kept = measured <= budget
            moves.append(Move(g, names[level], gain, measured, kept))
            if kept:
                state, current = trial, measured
            else:
                floor[g] = i
                why[g] = f"{names[level]} breaks the budget ({short(measured)})"
        notes_bound = [(f"note: stopped at max_compiles={max_compiles} with {len(candidates)} "
                       "move(s) not tried")] if cut else []

        chosen = policy_of(state)
        chosen_time = seconds(chosen, f"the chosen policy on {device.device}")
        baselines = []
        f32_policy = Policy.preset("f32")
        baseline_states = {}
        for name, policy, level in _baselines(base, low, no_fp8, f32_policy, fp8_scaling):
            e = error(policy, name)
            t = seconds(policy, f"{name} on {device.device}")
            baselines.append(Baseline(name, policy.to_string(), e, t, e <= budget))
            baseline_states[name] = {g: level if level in levels[g] else COMPUTE
                                     for g in named}
        over = sorted(g for g in named if alone_error[(g, COMPUTE)] > budget)
        if over and len(over) < len(named):
            name = f"{low} everywhere but {', '.join(over)} (over budget alone)"
            but = {g: F32 if g in over else COMPUTE for g in named}
            e = error(policy_of(but), name)
            t = seconds(policy_of(but), f"{name} on {device.device}")
            baselines.append(Baseline(name, policy_of(but).to_string(), e, t, e <= budget))
            baseline_states[name] = but
    finally:
        bar.close()

    notes = list(notes_bound)
    # Where the moves ended over the budget (ops no scope rule names), a baseline within
    # it is returned however fast: an over-budget policy was returned beside one that met.
    over_budget = current > budget
    faster = [b for b in baselines
              if b.met and (over_budget or b.step_seconds < chosen_time)]
    top_level = "stay at the base policy's precision"
    returned_baseline = None
    if faster:
        best = min(faster, key=lambda b: b.step_seconds)
        notes.append(f"note: the baseline {best.name!r} is within budget and "
                     + ("where the moves ended is not" if over_budget else
                        "modelled faster than where the moves ended")
                     + "; it is the one returned")
        chosen, chosen_time, current = Policy.parse(best.policy), best.step_seconds, best.error
        state = baseline_states[best.name]
        top_level = f"run as the returned baseline {best.name!r} runs every matrix op"
        returned_baseline = best.name
    floor = session.f32_floor_note(budget, reference, atol) if start_error > budget else None
    if floor is not None:
        notes.append(floor)
    elif start_error > budget:
        notes.append(f"note: with every named scope f32 the error is {short(start_error)}, "
                     f"over budget {budget:g}: ops outside named scopes, or the policy's "
                     "activations, still run in low precision")
    if not groups:  # as autopolicy without a target says it (this said nothing)
        notes.append("note: fn has no dot_general or convolution op: no policy changes "
                     "it, and each runs fn as written")
    if TOP_LEVEL in groups or "" in groups:
        notes.append(f"note: matrix ops outside any named scope {top_level} (no scope rule "
                     "can name them)")
    unnamable = [g for g in groups if g not in patterns and g not in (TOP_LEVEL, "")]
    if unnamable:  # as attribute says it (the search's table left them out unmentioned)
        notes.append(f"note: {', '.join(repr(g) for g in unnamable)}: no scope rule can "
                     f"name these ops (a scope name with whitespace or ','), so they "
                     f"{top_level}")
    if no_fp8:
        notes.append(f"note: fp8 not searched on {device.device}: {no_fp8}")
    elif named and not any(fp8_dots.values()):
        notes.append("note: fp8 not searched: no dot of a named scope takes the fp8 GEMM "
                     "form (m, k and n >= 16, one free and one contracting dimension)")
    # (also where a baseline returned fp8 for dots outside any named scope: h73)
    if (chosen.uses_fp8 and chosen.scaling == "delayed"
            and not any(d.fp8 for d in model.report(chosen).decisions)):
        # No dot of it is fp8: the history would make the step stateful for nothing (it
        # could not run under jax.jit; hunt h106).
        chosen = with_scaling(chosen, "current")
        notes.append("note: no dot of the chosen policy is fp8, so it is returned without "
                     "scaling=delayed (a step with an amax history cannot run under "
                     "jax.jit)")
    if no_fp8 is None and (any(fp8_dots.values()) or chosen.uses_fp8):
        notes.append("note: fp8 errors are measured on this machine, whose fp8 dots "
                     "dequantise to f32 (scales rounded to f32, not bf16 as on a GPU)")
    if chosen.uses_fp8 and chosen.scaling == "delayed":  # as autopolicy without a target
        notes.append(DELAYED_NOTE)
    notes += session.reference_notes(reference)
    rows = []
    for g in named:
        level = state[g]
        rows.append(ScopeChoice(
            g, len(groups[g]), sum(d.flops or 0 for d in groups[g]), fp8_dots.get(g, 0),
            tuple(names[v] for v in levels[g]), names[level],
            alone_error.get((g, level), math.nan),
            saved.get((g, level), math.nan),
            # The search's reason describes where its moves ended, not a baseline's level.
            f"set by the returned baseline {returned_baseline!r}" if returned_baseline
            else why.get(g, _why_not(g, levels, saved))))
    return TargetAutoPolicy(
        chosen, device.device or device.name, budget, current, current <= budget,
        chosen_time, rows, baselines, moves, reference, spent(), model.compiles,
        time.perf_counter() - start, notes=notes)


# Compiles kept for step 3: the chosen policy and four baselines, each run here and
# compiled for the target.
_FINAL = 10


def _why_not(group: str, levels: Mapping[str, tuple[str, ...]],
             saved: Mapping[tuple[str, str], float]) -> str:
    lower = [lv for lv in levels[group][1:] if saved.get((group, lv), 0) <= 0]
    if lower and len(lower) == len(levels[group]) - 1:
        return "no lower level is modelled faster"
    return ""


def _baselines(base: Policy, low: str, no_fp8: str | None, f32_policy: Policy,
               fp8_scaling: str = "current") -> list[tuple[str, Policy, str]]:
    """(name, policy, the level it gives a scope that has it)."""
    # A base whose dots are not 16-bit (fp8, f32): its op rules compute every kind.
    everywhere = base if base.ops.get("dot_general") == COMPUTE else _fp8_fields_if_fp8(
        {**base.to_dict(), "ops": {**base.ops, **dict.fromkeys(OP_KINDS, COMPUTE)}})
    out = [("f32 everywhere", f32_policy, F32), (f"{low} everywhere", everywhere, COMPUTE)]
    if no_fp8 is None:
        ops = {**base.ops, "dot_general": FP8}
        out.append(("fp8 everywhere eligible", with_scaling(
            Policy.from_dict({**base.to_dict(), "ops": ops}), fp8_scaling), FP8))
    return out


def _fp8_fields_if_fp8(fields: dict[str, Any]) -> Policy:
    """The policy of ``fields``, without its fp8 scaling fields when it has no fp8 action
    left (a delayed-scaling base's bf16 baseline: Policy refused scaling=delayed there,
    after the search had run)."""
    plain = Policy.from_dict({k: v for k, v in fields.items()
                              if k not in ("scaling", "amax_history")})
    return Policy.from_dict(fields) if plain.uses_fp8 else plain


def check_fp8_scaling(value: Any) -> str | None:
    """``value`` if it is a scaling or None (the base policy's)."""
    if value is not None and value not in SCALINGS:
        raise ValueError(f"Invalid fp8_scaling {value!r}; accepted: "
                         f"{', '.join(map(repr, SCALINGS))}")
    return value


def resolve_fp8_scaling(fp8_scaling: str | None, base: Policy) -> str:
    """The scaling the search prices fp8 with: ``fp8_scaling``, else the base's (an fp8
    base with scaling=delayed was priced, and returned, with current scaling: hunt
    h106); a delayed base asked for current scaling is refused, as one line."""
    if fp8_scaling is None:
        return base.scaling if base.uses_fp8 else "current"
    if base.uses_fp8 and base.scaling == "delayed" and fp8_scaling != "delayed":
        raise ValueError(f"base {base.to_string()!r} has scaling=delayed and "
                         f"fp8_scaling={fp8_scaling!r} asks for another: give one of them")
    return fp8_scaling


def with_scaling(policy: Policy, fp8_scaling: str) -> Policy:
    """``policy`` with fp8 scaling ``fp8_scaling`` where it has fp8 actions (a policy
    without them takes no scaling)."""
    if not policy.uses_fp8 or policy.scaling == fp8_scaling:
        return policy
    fields = {**policy.to_dict(), "scaling": fp8_scaling}
    if fp8_scaling != "delayed":  # a history's length is delayed scaling's alone
        fields.pop("amax_history", None)
    return Policy.from_dict(fields)
