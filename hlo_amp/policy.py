"""Policy: which ops run in which precision, keyed by op kind and by scope.

A policy has a compute dtype and two rule tables. Op rules are keyed by StableHLO op
kind (``"dot_general"``, ``"convolution"``, ``"dot"``) or by a JAX primitive
(``jax.lax.dot_general_p``). Scope rules are keyed by a scope pattern matched against
whole segments of an op's ``jax.named_scope`` path, anywhere in it unless anchored
(``/head`` only from the outermost segment, ``head$`` only up to the innermost). Scope
rules beat op rules, the outermost matching scope wins (of two patterns matching from
the same segment, the one with more segments: ``c/a`` beats ``c``, anchors not counted;
of equal length, the one written first), and ``amp_stop`` keeps its inside as written
unless a rule matching inside it names the op.

String grammar (``Policy.parse``), comma separated, spaces ignored::

    SPEC    := ITEM ("," ITEM)*
    ITEM    := PRESET | "compute=" DTYPE | "backward=" ACTION | "f64=" BOOL
             | "only_if_faster=" BOOL | "propagate=" BOOL | "keep_f32_results=" BOOL
             | "fuse_attention=" BOOL | "scaling=" ("current" | "delayed")
             | "amax_history=" INT
             | "explicit_precision=" ("keep" | "ignore") | "reduce=" DTYPE
             | "first_matrix_op=" (ACTION | "none") | "last_matrix_op=" (ACTION | "none")
             | "op:" KIND "=" ACTION | "scope:" PATTERN "=" ACTION
    PRESET  := "bf16" | "f16" | "f32" | "mixed_bfloat16" | "mixed_float16" | "fp8"
               (only as the first item)
    KIND    := any StableHLO or CHLO op name ("dot_general", "exponential", "reduce", ...)
    ACTION  := "compute" | "keep" | DTYPE | FP8
    DTYPE   := "bfloat16" | "float16" | "float32" | "float64" (or bf16, f16, f32, f64)
    FP8     := "float8_e4m3fn" | "float8_e5m2" (or f8e4m3fn, e4m3fn, f8e5m2, e5m2)
    PATTERN := ["/"] GLOB ("/" GLOB)* ["$"]
               (a leading "/" matches from the outermost segment only, a trailing "$"
               up to the innermost only; GLOB: one segment's name or glob, "Block_*";
               it may hold "=" (the last "=" of the item starts the action), but no ","
               or space)

Example: ``"bf16,scope:head=float32,scope:/Block_*/attn=keep,op:convolution=keep"``.

``Policy(compute_dtype=..., scopes=...)`` without ``ops`` has the presets' op rules (dots
and convolutions compute); ``ops={}`` means none. Dots the program pinned to HIGHEST
precision or an explicit algorithm are kept unless a scope rule names them
(``explicit_precision=ignore`` turns that off).

Two modes: ``bf16``/``f16`` convert only the operands of matrix ops (f32 results, the
accurate mode); ``mixed_bfloat16``/``mixed_float16`` (``propagate=true``) also keep the
activations between matrix ops in 16 bit (the fast mode, passes/propagate/). Op rules
on other op kinds (``op:exponential=compute``, ``op:add=float32``) move that kind between
the propagation classes of ``op_classes.py``: ``compute`` (or the compute dtype) lets it
be painted, ``keep``/``float32`` keeps it f32; they need ``propagate=true``. There, on
GPU and TPU, every matrix op returns the 16-bit type, also where only f32 ops read it (a
weight gradient read by the optimizer, the logits read by the loss), as TensorFlow's
and PyTorch's AMP do; ``keep_f32_results=true`` keeps the accurate mode's f32 result
for those (+8% HBM bytes, +9.5% roofline time on benchmarks/' MLP step for H100).

``fuse_attention=false`` (passes/fused_attention/, docs/attention.md): leave softmax
attention as written; by default, on a GPU with cuDNN's flash attention, an attention
the policy computes in 16 bit runs as that fused kernel.

``reduce=float32|bfloat16`` (passes/comm_precision.py): the result type of the dots whose
contracting dimension is sharded, so of the all-reduce XLA's partitioner puts after them
(data-parallel weight gradients); not set, the mode's own (f32 in the accurate modes).

fp8 (passes/fp8.py): the action ``float8_e4m3fn`` quantises both operands of a
``dot_general`` to e4m3fn; ``float8_e5m2`` quantises the operand that carries the incoming
gradient of a backward dot to e5m2 and everything else to e4m3fn (Transformer Engine's
and Flax's HYBRID recipe; cuBLASLt has no e5m2 x e5m2 GEMM, so there is no all-e5m2
action). Both use per-tensor current scaling computed in the program. A dot that cannot
take XLA:GPU's fp8 GEMM form, and any convolution or ``stablehlo.dot``, computes in the
compute dtype instead, with the reason in the report. The ``fp8`` preset is
``mixed_bfloat16`` with ``op:dot_general=float8_e5m2``, convolutions in bf16
(``compute``) and ``first_matrix_op=compute,last_matrix_op=compute``: the first and the
last matrix op of the forward program (the embedding or stem, and the head), and their
backward dots, stay in the compute dtype. It is the fast mode by default: the
activations between matrix ops stay 16-bit as under ``mixed_bfloat16`` (the f32-critical
ops stay f32 there too), and fp8 appears only at the GEMM inputs, quantised from the
16-bit value; ``fp8,propagate=false`` is the accurate mode (bf16's f32 activations, fp8
quantised from f32). ``first_matrix_op``/``last_matrix_op`` name an action for
those two ops under any preset (``none`` removes the rule); scope rules and ``amp_stop``
beat them, they beat op rules: ``"fp8,scope:attn=bfloat16,last_matrix_op=none"``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hlo_amp.ir.op_classes import NOT_RETYPED
from hlo_amp.policy_terms import (
    AMP_STOP,
    COMPUTE,
    COMPUTE_DTYPES,
    DTYPE_BITS,
    DTYPE_TO_ELEMENT,
    DTYPES,
    FIRST_MATRIX_OP,
    FP8_ACTIONS,
    FP8_E5M2,
    FP8_LIKE,
    FP8_SHORT,
    FP8_TO_ELEMENT,
    KEEP,
    LAST_MATRIX_OP,
    OP_KINDS,
    canonical_action,
    canonical_dtype,
    canonical_op_kind,
    check_pattern,
    is_fp8,
    match_start,
    pattern_parts,
)

# The terms are re-exported: passes and users name them through hlo_amp.policy.
__all__ = [
    "AMP_STOP", "COMPUTE", "COMPUTE_DTYPES", "DTYPES", "DTYPE_BITS", "DTYPE_TO_ELEMENT",
    "EXPLICIT_PRECISION", "FIRST_MATRIX_OP", "FP8_ACTIONS", "FP8_E5M2", "FP8_OPS", "FP8_SHORT",
    "FP8_TO_ELEMENT", "KEEP", "LAST_MATRIX_OP", "OP_KINDS", "PRESETS", "PRESET_OPS", "SCALINGS",
    "Policy",
    "Rule", "amp_stop", "as_policy", "canonical_action", "canonical_dtype", "canonical_op_kind",
    "is_fp8", "match_start"
]

# The op rules of the 16-bit presets, and of a Policy built without ops.
PRESET_OPS = {kind: COMPUTE for kind in OP_KINDS}
EXPLICIT_PRECISION = ("keep", "ignore")
SCALINGS = ("current", "delayed")
MAX_AMAX_HISTORY = 65536  # steps; Transformer Engine's recipes keep 1024 at most
# The fp8 preset's op rules: dot_general in fp8 (e4m3fn, e5m2 gradients), the rest bf16.
# ragged_dot asks for fp8 too, so its decision says why it computes in bf16 instead.
FP8_OPS = {"dot_general": "float8_e5m2", "dot": COMPUTE, "convolution": COMPUTE,
           "ragged_dot": "float8_e5m2"}
PRESETS = ("bf16", "f16", "f32", "mixed_bfloat16", "mixed_float16", "fp8")
# A scope item of the string grammar ("scope:PATTERN=ACTION", spaces allowed).
_SCOPE_ITEM = re.compile(r"\s*scope\s*:")


@dataclass(frozen=True)
class Rule:
    """One decision: the action and the rule text that produced it."""

    action: str | None  # None: the op is not a candidate (left alone)
    rule: str  # e.g. "scope:attn", "op:dot_general", "amp_stop", "default"
    # Why the action is not the rule's own, for the report ("kept: the program asked
    # for HIGHEST precision"); None when it is.
    reason: str | None = None
    # The other rules that match the op and lost on precedence, in precedence order
    # (for the report; two decisions are equal whatever they outranked).
    outranked: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Policy:
    """Which ops compute in which precision; see the module docstring."""

    compute_dtype: str = "bfloat16"
    # None: the presets' op rules (dot, dot_general, convolution -> compute), so
    # Policy(compute_dtype=..., scopes=...) means what it says; {} means no op rules.
    ops: Mapping[str, str] | None = None
    scopes: Mapping[str, str] = field(default_factory=dict)
    backward: str | None = None
    include_f64: bool = False
    # Cost-aware: when compiling for a backend that would not run an op faster in the
    # compute dtype (XLA:CPU without native bf16, CPU convolutions), leave it as written;
    # an fp8 GEMM whose quantisation costs more than fp8 saves computes in the compute
    # dtype (Target.fp8_loses).
    only_if_faster: bool = False
    # The mixed_* modes: keep activations 16-bit between matrix ops (passes/propagate/).
    propagate: bool = False
    # mixed_* modes: a matrix op that only f32 ops read keeps an f32 result (a weight
    # gradient, the logits); False: it returns the 16-bit type, as TF/PyTorch AMP do.
    keep_f32_results: bool = False
    # On a GPU with cuDNN's flash attention, an attention computed in 16 bit runs as that
    # fused kernel (passes/fused_attention/); False: left as written.
    fuse_attention: bool = True
    # "keep": dots the program wrote with HIGHEST precision or an explicit algorithm stay
    # as written unless a scope rule names them; "ignore": treat them like any other.
    explicit_precision: str = "keep"
    # Actions for the first and the last matrix op of the forward program, outside a loop
    # (and their backward dots); None: no such rule. The fp8 preset keeps both in the
    # compute dtype.
    first_matrix_op: str | None = None
    last_matrix_op: str | None = None
    # The result type of the dots whose partial results are summed across devices (a
    # sharded contracting dimension: data-parallel weight gradients), so the type of
    # that all-reduce (passes/comm_precision.py): "float32", or the 16-bit compute dtype
    # (half the bytes). None: the mode's own (f32 in the accurate modes).
    reduce: str | None = None
    # fp8 scaling (passes/fp8.py, docs/fp8.md): "current" computes each operand's scale
    # from its own amax in the step; "delayed" from the largest amax of the last
    # ``amax_history`` steps, state the compiled function carries between calls.
    scaling: str = "current"
    amax_history: int = 1024  # Transformer Engine's DelayedScaling default

    def __post_init__(self) -> None:
        try:
            compute = canonical_dtype(self.compute_dtype, what="compute_dtype")
        except ValueError:
            compute = None
        if compute not in COMPUTE_DTYPES:
            hint = ""
            if isinstance(self.compute_dtype, str) and FP8_LIKE.match(
                    self.compute_dtype.strip().lower()):
                hint = (" (fp8 is an action, not a compute dtype: use the fp8 preset or "
                        "op:dot_general=float8_e4m3fn)")
            raise ValueError(
                f"Unsupported compute_dtype {self.compute_dtype!r}; accepted: "
                f"{', '.join(COMPUTE_DTYPES)}{hint}"
            )
        if self.ops is None:
            object.__setattr__(self, "ops", PRESET_OPS)
        if not isinstance(self.ops, Mapping):
            raise ValueError(  # noqa: TRY004
                f"ops must be a dict of op kind -> action, got {self.ops!r}"
            )
        if not isinstance(self.scopes, Mapping):
            raise ValueError(  # noqa: TRY004 - every policy error is a ValueError
                f"scopes must be a dict of pattern -> action, got {self.scopes!r}"
            )
        ops: dict[str, str] = {}
        named_by: dict[str, Any] = {}  # op kind -> the key that named it
        for key, action in self.ops.items():
            for kind in canonical_op_kind(key):
                if kind in named_by:  # the key written later won, unseen
                    raise ValueError(
                        f"op kind {kind} is given twice in ops ({named_by[kind]!r} and "
                        f"{key!r}); accepted: one action per op kind")
                named_by[kind] = key
                ops[kind] = canonical_action(action, where=f"op rule {kind!r}")
        scopes: dict[str, str] = {}
        for pattern, action in self.scopes.items():
            text = check_pattern(pattern)
            if text in scopes:  # two spellings of one pattern (" head " and "head"): the later won
                raise ValueError(f"scope pattern {text!r} is given twice in scopes; accepted: "
                                 f"one action per pattern")
            scopes[text] = canonical_action(action, where=f"scope rule {text!r}")
        # A flag is a bool: bool("false") is True, so {"propagate": "false"} was the
        # fast mode (the string form refuses such a value; so does this).
        for flag in ("propagate", "include_f64", "only_if_faster", "keep_f32_results",
                     "fuse_attention"):
            value = getattr(self, flag)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{flag}={value!r}; accepted: True, False (or in a "  # noqa: TRY004
                                 f"policy string: {flag}=true, {flag}=false)")
        propagate = bool(self.propagate)
        for kind, action in ops.items():
            if kind in OP_KINDS:
                continue
            if not propagate:
                raise ValueError(
                    f"Op rule {kind!r} applies to the propagation pass; add "
                    f"propagate=true or start from mixed_bfloat16/mixed_float16 "
                    f"(without it only {', '.join(OP_KINDS)} rules apply)"
                )
            if action not in (COMPUTE, KEEP, "float32", compute):
                raise ValueError(
                    f"Unsupported action {action!r} for op rule {kind!r}; accepted for "
                    f"ops other than {', '.join(OP_KINDS)}: compute (or {compute}), "
                    f"keep, float32"
                )
            if action in (COMPUTE, compute) and kind in NOT_RETYPED:
                raise ValueError(
                    f"Unsupported action {action!r} for op rule {kind!r}: {kind} cannot "
                    f"run in 16 bit ({NOT_RETYPED[kind]}); accepted for it: keep, float32"
                )
        if self.keep_f32_results and not propagate:
            raise ValueError(
                "keep_f32_results applies to the propagation pass; add propagate=true or "
                "start from mixed_bfloat16/mixed_float16 (the accurate modes bf16/f16 "
                "always keep f32 results)"
            )
        backward = None
        if self.backward is not None:
            backward = canonical_action(self.backward, where="backward")
        for name in (FIRST_MATRIX_OP, LAST_MATRIX_OP):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().lower() == "none":
                value = None
            if value is not None:
                value = canonical_action(value, where=name)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "ops", _FrozenDict(ops))
        object.__setattr__(self, "scopes", _OrderedFrozenDict(scopes))
        object.__setattr__(self, "backward", backward)
        object.__setattr__(self, "include_f64", bool(self.include_f64))
        object.__setattr__(self, "only_if_faster", bool(self.only_if_faster))
        object.__setattr__(self, "propagate", propagate)
        object.__setattr__(self, "keep_f32_results", bool(self.keep_f32_results))
        object.__setattr__(self, "fuse_attention", bool(self.fuse_attention))
        if self.reduce is not None:
            try:
                reduce = canonical_dtype(self.reduce, what="reduce")
            except ValueError:
                reduce = None
            if reduce not in ("float32", compute):
                raise ValueError(
                    f"Unsupported reduce {self.reduce!r}; accepted: float32, {compute} "
                    f"(the compute dtype), or None for the mode's own"
                )
            object.__setattr__(self, "reduce", reduce)
        if self.scaling not in SCALINGS:
            raise ValueError(f"Unknown scaling {self.scaling!r}; accepted: "
                             f"{', '.join(SCALINGS)}")
        history = self.amax_history
        if (isinstance(history, (bool, np.bool_))
                or not isinstance(history, (int, np.integer))
                or not 1 <= history <= MAX_AMAX_HISTORY):
            # A length past memory was taken, then failed at the first call (bad_alloc).
            raise ValueError(f"amax_history must be an int from 1 to {MAX_AMAX_HISTORY} (steps "
                             f"of amax kept for delayed scaling), got {history!r}")
        object.__setattr__(self, "amax_history", int(history))
        if self.scaling == "delayed" and not self.uses_fp8:
            raise ValueError("scaling=delayed applies to fp8 actions; start from the fp8 "
                             "preset or add op:dot_general=float8_e4m3fn")
        if self.amax_history != 1024 and self.scaling != "delayed":
            # Accepted and spelled out by to_string(), it did nothing.
            raise ValueError(f"amax_history={self.amax_history} applies to delayed scaling "
                             f"(the history's length); add scaling=delayed to an fp8 policy")
        if self.explicit_precision not in EXPLICIT_PRECISION:
            raise ValueError(
                f"Unknown explicit_precision {self.explicit_precision!r}; accepted: "
                f"{', '.join(EXPLICIT_PRECISION)}"
            )

    # ---- construction -------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> Policy:
        """The named preset: ``"bf16"``, ``"f16"``, ``"f32"`` (changes nothing),
        ``"mixed_bfloat16"`` or ``"mixed_float16"`` (also 16-bit activations), ``"fp8"``
        (dot_general in fp8, the first and last matrix ops and convolutions in bf16,
        16-bit activations as ``mixed_bfloat16``; ``fp8,propagate=false`` keeps them f32)."""
        if name == "fp8":
            return cls("bfloat16", ops=FP8_OPS, propagate=True, first_matrix_op=COMPUTE,
                       last_matrix_op=COMPUTE)
        if name == "mixed_bfloat16":
            return cls("bfloat16", ops=PRESET_OPS, propagate=True)
        if name == "mixed_float16":
            return cls("float16", ops=PRESET_OPS, propagate=True)
        if name == "bf16":
            return cls("bfloat16", ops=PRESET_OPS)
        if name == "f16":
            return cls("float16", ops=PRESET_OPS)
        if name == "f32":
            return cls("bfloat16", ops={})
        raise ValueError(f"Unknown preset {name!r}; accepted: {', '.join(PRESETS)}")

    @classmethod
    def parse(cls, spec: str) -> Policy:
        """Parse the string grammar of the module docstring."""
        if not isinstance(spec, str):
            raise ValueError(f"A policy string was expected, got {spec!r}")  # noqa: TRY004
        items = [item.strip() for item in spec.split(",") if item.strip()]
        if not items:
            raise ValueError(
                f"Empty policy {spec!r}; accepted: a preset ({', '.join(PRESETS)}) "
                f"followed by ',op:KIND=ACTION', ',scope:PATTERN=ACTION', ..."
            )
        base = cls.preset("bf16")
        if items[0] in PRESETS:
            base = cls.preset(items.pop(0))
        fields = base.to_dict()
        given: dict[str, str] = {}  # key -> value, as written in this spec
        op_keys: dict[str, str] = {}  # op kind -> the "op:..." key that named it
        for item in items:
            # A scope pattern may hold '=' (a scope named "lr=0.1"); its action never does.
            split = item.rpartition if _SCOPE_ITEM.match(item) else item.partition
            key, sep, value = split("=")
            key, value = key.strip(), value.strip()
            prefix, colon, rest = key.partition(":")
            if colon and prefix.strip() in ("op", "scope"):  # spaces ignored: "scope : head"
                key = f"{prefix.strip()}:{rest.strip()}"
            if not sep and item in PRESETS:
                raise ValueError(f"Preset {item!r} in {spec!r} must be the first item")
            if not sep and "=" not in item and ":" not in item:
                raise ValueError(
                    f"Unknown preset {item!r} in {spec!r}; accepted: a preset "
                    f"({', '.join(PRESETS)}) as the first item, then KEY=VALUE items"
                )
            if not sep or not value:
                raise ValueError(f"Malformed item {item!r} in {spec!r}; expected KEY=VALUE")
            if key in given:  # the last one won, unseen
                raise ValueError(f"{key} is given twice in {spec!r} ({given[key]!r} and "
                                 f"{value!r}); accepted: one value per key")
            given[key] = value
            if key.startswith("op:"):
                # Under the op kinds it names: a kind spelled two ways ("op:dot_general",
                # "op:stablehlo.dot_general") is a repeat too (the first one won, unseen).
                for kind in canonical_op_kind(key[3:]):
                    if kind in op_keys:
                        raise ValueError(
                            f"op kind {kind} is given twice in {spec!r} ({op_keys[kind]} "
                            f"and {key}); accepted: one action per op kind")
                    op_keys[kind] = key
                    fields["ops"][kind] = value
            elif key.startswith("scope:"):
                fields["scopes"][key[6:]] = value
            elif key in ("compute", "compute_dtype"):
                if "compute" in given and "compute_dtype" in given:
                    raise ValueError(f"compute is given twice in {spec!r} (as compute and "
                                     f"compute_dtype); accepted: one value per key")
                fields["compute_dtype"] = value
            elif key == "backward":
                fields["backward"] = value
            elif key == "explicit_precision":
                fields["explicit_precision"] = value.lower()
            elif key == "reduce":
                fields["reduce"] = value
            elif key == "scaling":
                fields["scaling"] = value.lower()
            elif key == "amax_history":
                if not (value.isascii() and value.isdigit()):  # "²" is a digit to Python
                    raise ValueError(f"Unknown value {value!r} for amax_history in {spec!r};"
                                     f" accepted: a positive integer")
                fields["amax_history"] = int(value)
            elif key in (FIRST_MATRIX_OP, LAST_MATRIX_OP):
                fields[key] = value  # "none" is read in __post_init__
            elif key in ("f64", "only_if_faster", "propagate", "keep_f32_results",
                         "fuse_attention"):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"Unknown value {value!r} for {key} in {spec!r}; "
                                     f"accepted: true, false (or 1, 0)")
                field_name = "include_f64" if key == "f64" else key
                fields[field_name] = value.lower() in ("true", "1")
            else:
                raise ValueError(
                    f"Unknown key {key!r} in {spec!r}; accepted: compute, backward, f64, "
                    f"only_if_faster, propagate, keep_f32_results, fuse_attention, "
                    f"explicit_precision, reduce, scaling, amax_history, "
                    f"first_matrix_op, last_matrix_op, op:KIND, scope:PATTERN (or a preset "
                    f"{', '.join(PRESETS)} first)"
                )
        return cls.from_dict(fields)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that ``from_dict`` turns back into an equal policy."""
        return {
            "compute_dtype": self.compute_dtype,
            "ops": dict(self.ops),
            "scopes": dict(self.scopes),
            "backward": self.backward,
            "include_f64": self.include_f64,
            "only_if_faster": self.only_if_faster,
            "propagate": self.propagate,
            "keep_f32_results": self.keep_f32_results,
            "fuse_attention": self.fuse_attention,
            "explicit_precision": self.explicit_precision,
            "first_matrix_op": self.first_matrix_op,
            "last_matrix_op": self.last_matrix_op,
            "reduce": self.reduce,
            "scaling": self.scaling,
            "amax_history": self.amax_history,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        allowed = ("compute_dtype", "ops", "scopes", "backward", "include_f64",
                   "only_if_faster", "propagate", "keep_f32_results", "fuse_attention",
                   "explicit_precision",
                   FIRST_MATRIX_OP, LAST_MATRIX_OP, "reduce", "scaling", "amax_history")
        if not isinstance(data, Mapping):
            raise ValueError(f"A policy dict was expected, got {data!r}")  # noqa: TRY004
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise ValueError(
                f"Unknown key {unknown[0]!r} in policy dict; accepted: {', '.join(allowed)}"
            )
        return cls(**dict(data))

    def to_string(self) -> str:
        """The string form; ``Policy.parse(p.to_string()) == p``."""
        # The first preset whose op rules this policy has; then only what differs from it
        # (the empty preset f32 always fits: it states every op rule, so it is exact).
        mixed = "mixed_float16" if self.compute_dtype == "float16" else "mixed_bfloat16"
        # The f16 preset by its name (it printed as "bf16,compute=float16").
        accurate = "f16" if self.compute_dtype == "float16" else "bf16"
        for name in ("fp8", mixed if self.propagate else accurate, "f32"):
            base = _preset(name)
            if all(self.ops.get(kind) == action for kind, action in base.ops.items()):
                break
        items = [name, f"compute={self.compute_dtype}"]
        items += [f"op:{k}={a}" for k, a in self.ops.items() if k not in base.ops]
        if self.propagate != base.propagate:
            items.append(f"propagate={'true' if self.propagate else 'false'}")
        for position in (FIRST_MATRIX_OP, LAST_MATRIX_OP):
            value = getattr(self, position)
            if value != getattr(base, position):
                items.append(f"{position}={value or 'none'}")
        items += [f"scope:{p}={a}" for p, a in self.scopes.items()]
        if self.backward is not None:
            items.append(f"backward={self.backward}")
        if self.include_f64:
            items.append("f64=true")
        if self.only_if_faster:
            items.append("only_if_faster=true")
        if self.keep_f32_results:
            items.append("keep_f32_results=true")
        if not self.fuse_attention:
            items.append("fuse_attention=false")
        if self.explicit_precision != "keep":
            items.append(f"explicit_precision={self.explicit_precision}")
        if self.reduce is not None:
            items.append(f"reduce={self.reduce}")
        if self.scaling != "current":
            items.append(f"scaling={self.scaling}")
        if self.amax_history != 1024:
            items.append(f"amax_history={self.amax_history}")
        return ",".join(items)

    def __str__(self) -> str:
        return self.to_string()

    # ---- decisions ----------------------------------------------------------------

    @property
    def actions(self) -> list[str | None]:
        """The action of every rule: op, scope, backward, first and last matrix op."""
        return [*self.ops.values(), *self.scopes.values(), self.backward,
                self.first_matrix_op, self.last_matrix_op]

    @property
    def may_fuse_attention(self) -> bool:
        """Whether some rule computes a ``dot_general`` in 16 bit (or fp8, whose
        attention runs in the 16-bit compute type): the fused-attention pass looks."""
        return self.compute_dtype in COMPUTE_DTYPES and any(
            a == COMPUTE or a in COMPUTE_DTYPES or is_fp8(a) for a in self.actions)

    @property
    def uses_fp8(self) -> bool:
        """Whether any rule of this policy has an fp8 action."""
        return any(is_fp8(a) for a in self.actions)

    def decide(self, scope: tuple[str, ...], op_kind: str, backward: bool,
               positions: tuple[str, ...] = (), pinned: str | None = None) -> Rule:
        """The action for an op of ``op_kind`` under ``scope``; see module docstring.

        ``positions`` holds ``"first_matrix_op"`` and/or ``"last_matrix_op"`` when the
        op is (or is a backward dot of) the first or last matrix op of the program.
        ``pinned`` says what the program asked for when it pinned the op's precision
        ("HIGHEST precision"): then only a scope rule changes it, unless
        ``explicit_precision=ignore``.
        """
        rule = self._matching_rule(scope, op_kind, backward, positions)
        if (pinned is not None and self.explicit_precision == "keep"
                and rule.action not in (None, KEEP) and not rule.rule.startswith("scope:")):
            return Rule(KEEP, rule.rule, f"kept: the program asked for {pinned}",
                        rule.outranked)
        return rule

    def _matching_rule(self, scope: tuple[str, ...], op_kind: str, backward: bool,
                       positions: tuple[str, ...]) -> Rule:
        """The rule that decides the op, by the precedence of the module docstring, with
        the other matching rules it outranks."""
        matching: list[Rule] = []
        if backward and self.backward is not None and AMP_STOP not in scope:
            matching.append(Rule(self.backward, "backward"))
        # The innermost amp_stop shields its inside; only rules matching inside it count.
        stop = len(scope) - 1 - scope[::-1].index(AMP_STOP) if AMP_STOP in scope else None
        scope_matches: list[tuple[int, int, str]] = []  # (start, -len, pattern)
        shielded: list[Rule] = []  # matched outside the amp_stop only: lost to it
        for pattern in self.scopes:
            start = match_start(pattern, scope)
            if start is None:
                continue
            parts = pattern_parts(pattern)[0]
            # A pattern whose match names the innermost amp_stop segment itself
            # ("amp_stop", "amp_stop/inner", "mlp/amp_stop") is written for its inside.
            names_stop = (stop is not None and AMP_STOP in parts
                          and start <= stop < start + len(parts))
            if stop is not None and start <= stop and not names_stop:
                # A later match may name the innermost amp_stop (one nested in another:
                # "amp_stop" on amp_stop/amp_stop): written for its inside too.
                inner = next((s for s in range(max(start + 1, stop - len(parts) + 1), stop + 1)
                              if match_start(pattern, scope, after=s - 1) == s),
                             None) if AMP_STOP in parts else None
                # amp_stop shields its inside from rules set outside it; the same
                # pattern may still match inside it (mlp/amp_stop/mlp).
                start = inner if inner is not None else match_start(pattern, scope, after=stop)
                if start is None:
                    shielded.append(Rule(self.scopes[pattern], f"scope:{pattern}"))
                    continue
            scope_matches.append((start, -len(parts), pattern))  # anchors are no parts
        # Stable: of two equal keys the pattern written first wins.
        for _start, _length, pattern in sorted(scope_matches, key=lambda key: key[:2]):
            matching.append(Rule(self.scopes[pattern], f"scope:{pattern}"))
        if stop is not None:
            matching.append(Rule(KEEP, AMP_STOP))
            matching.extend(shielded)
        for position in (FIRST_MATRIX_OP, LAST_MATRIX_OP):
            action = getattr(self, position)
            if position in positions and action is not None:
                matching.append(Rule(action, position))
        if op_kind in self.ops:
            matching.append(Rule(self.ops[op_kind], f"op:{op_kind}"))
        if not matching:
            return Rule(None, "default")
        return replace(matching[0],
                       outranked=tuple(r.rule for r in matching[1:]))

    def rule_names(self) -> list[str]:
        """Every rule as the report names it, to list the unused ones."""
        names = [f"op:{k}" for k in self.ops] + [f"scope:{p}" for p in self.scopes]
        if self.backward is not None:
            names.append("backward")
        names += [name for name in (FIRST_MATRIX_OP, LAST_MATRIX_OP)
                  if getattr(self, name) is not None]
        return names


@functools.cache
def _preset(name: str) -> Policy:
    """``Policy.preset(name)``, built once (``to_string`` compares against presets)."""
    return Policy.preset(name)


class _FrozenDict(dict):
    """A dict that refuses mutation, so a frozen Policy stays hashable and fixed."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Policy rule tables are read-only; build a new Policy")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self) -> tuple:
        # pickle and copy.deepcopy rebuild a dict subclass item by item (__setitem__):
        # build it whole instead.
        return (_FrozenDict, (dict(self),))


class _OrderedFrozenDict(_FrozenDict):
    """The scope rules: their order is part of what they decide (of two patterns that
    match alike, the one written first wins), so it is part of equality and the hash."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, dict) and list(self.items()) == list(other.items())

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple:
        return (_OrderedFrozenDict, (dict(self),))


def as_policy(policy: Policy | str | Mapping[str, Any] | None) -> Policy:
    """Accept a Policy, a preset or policy string, or a dict; None means "bf16"."""
    if policy is None:
        return Policy.preset("bf16")
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy.parse(policy)
    if isinstance(policy, Mapping):
        return Policy.from_dict(policy)
    raise ValueError(
        f"Unsupported policy {policy!r}; accepted: a Policy, a string such as "
        f"'bf16,scope:head=float32', or a dict with keys compute_dtype, ops, scopes"
    )


def amp_stop(fn: Any = None) -> Any:
    """A ``jax.named_scope("amp_stop")``: ops inside keep the program's precision.

    Use as ``with hlo_amp.amp_stop(): ...`` or as a decorator, ``@hlo_amp.amp_stop()``
    or ``@hlo_amp.amp_stop``.
    """
    import jax  # here, not at the top: hlo-amp-opt parses policies without jax

    scope = jax.named_scope(AMP_STOP)
    return scope if fn is None else scope(fn)
