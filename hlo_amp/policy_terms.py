"""The terms a policy is written in: dtypes, actions, op kinds and scope patterns.

Each has a canonical spelling (``canonical_dtype``, ``canonical_action``,
``canonical_op_kind``) and the error message that lists what is accepted; a scope
pattern matches whole segments of a name stack (``match_start``). ``hlo_amp.policy``
builds its rule tables from these and re-exports them.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import Any

from hlo_amp.ir.op_classes import op_names

COMPUTE = "compute"
KEEP = "keep"
AMP_STOP = "amp_stop"

# Canonical dtype names and the spellings accepted for each.
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "half": "float16",
    "float32": "float32", "f32": "float32", "float": "float32",
    "float64": "float64", "f64": "float64", "double": "float64",
}
DTYPES = ("bfloat16", "float16", "float32", "float64")
COMPUTE_DTYPES = ("bfloat16", "float16")
# fp8 actions (passes/fp8.py), their StableHLO element types, and the spellings accepted.
FP8_TO_ELEMENT = {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}
FP8_ACTIONS = tuple(FP8_TO_ELEMENT)
FP8_E5M2 = "float8_e5m2"  # the action whose gradient operand is e5m2
# Element type -> the format's short name in reasons and notes ("e4m3fn").
FP8_SHORT = {e: a.removeprefix("float8_") for a, e in FP8_TO_ELEMENT.items()}
_FP8_ALIASES = {
    "float8_e4m3fn": "float8_e4m3fn", "f8e4m3fn": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "f8e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
}
# Other fp8 formats (ml_dtypes and MLIR have several): named so the error says "fp8".
FP8_LIKE = re.compile(r"^(float8|fp8|f8|e\dm\d)")
# Policy dtype name -> StableHLO element-type spelling.
DTYPE_TO_ELEMENT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}
# Bit width of each float dtype, used to tell "wider than the compute dtype".
DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32, "float64": 64}

# ragged_dot: jax.lax.ragged_dot's grouped matmul (a mixture of experts), which jax
# lowers for GPU and TPU as chlo.ragged_dot (on CPU as dense dot_generals).
OP_KINDS = ("dot_general", "dot", "convolution", "ragged_dot")
# JAX primitives mapped to the StableHLO op kinds they lower to.
_PRIMITIVE_KINDS = {
    "dot_general": ("dot_general", "dot"),
    "conv_general_dilated": ("convolution",),
    "ragged_dot_general": ("ragged_dot",),
}

# Positional rules: the first and the last matrix op of the forward program.
FIRST_MATRIX_OP = "first_matrix_op"
LAST_MATRIX_OP = "last_matrix_op"


def _dtype_key(name: Any) -> str:
    """``name`` (str, numpy or jnp dtype, jnp.float8_e4m3fn...) as a lower-case string."""
    key = name
    if name is None or name in (float, int, complex, bool):
        # None is no dtype (jnp.dtype(None) is float64); Python's float means what the
        # string "float" does, not jnp.dtype(float)'s float64.
        key = repr(name) if name is None else name.__name__
    elif not isinstance(name, str):  # a dtype object: from the Python API, where jax is loaded
        import jax

        try:
            key = jax.numpy.dtype(name).name
        except TypeError:
            key = repr(name)
    return str(key).strip().lower()


def canonical_dtype(name: Any, *, what: str = "dtype") -> str:
    """Return the canonical float dtype name for ``name`` (str, numpy or jnp dtype)."""
    canon = _DTYPE_ALIASES.get(_dtype_key(name))
    if canon is None:
        raise ValueError(
            f"Unknown {what} {name!r}; accepted: {', '.join(DTYPES)} "
            f"(or bf16, f16, f32, f64)"
        )
    return canon


def canonical_action(action: Any, *, where: str) -> str:
    """Return ``"compute"``, ``"keep"``, a canonical dtype name or an fp8 action."""
    if isinstance(action, str) and action.strip().lower() in (COMPUTE, KEEP):
        return action.strip().lower()
    text = _dtype_key(action)
    if text in _FP8_ALIASES:
        return _FP8_ALIASES[text]
    if FP8_LIKE.match(text):
        raise ValueError(
            f"Unknown fp8 format {action!r} for {where}; accepted fp8 actions: "
            f"{', '.join(FP8_ACTIONS)} (the two formats XLA:GPU's cuBLASLt fp8 GEMM "
            f"takes); other actions: compute, keep, {', '.join(DTYPES)}"
        )
    try:
        return canonical_dtype(action)
    except ValueError:
        raise ValueError(
            f"Unknown action {action!r} for {where}; accepted: compute, keep, "
            f"{', '.join(DTYPES)}, {', '.join(FP8_ACTIONS)}"
        ) from None


def is_fp8(action: str | None) -> bool:
    """Whether ``action`` is an fp8 action (``float8_e4m3fn`` or ``float8_e5m2``)."""
    return action in FP8_ACTIONS


def canonical_op_kind(kind: Any) -> tuple[str, ...]:
    """Map an op-rule key (a StableHLO op kind or a JAX primitive) to op kinds."""
    if hasattr(kind, "bind") and isinstance(getattr(kind, "name", None), str):
        name = kind.name  # a JAX primitive such as jax.lax.dot_general_p
        if name in _PRIMITIVE_KINDS:
            return _PRIMITIVE_KINDS[name]
        raise ValueError(
            f"Unsupported primitive {name!r} in op rules; accepted primitives: "
            f"{', '.join(p + '_p' for p in _PRIMITIVE_KINDS)}"
        )
    if isinstance(kind, str):
        text = kind.strip().removeprefix("stablehlo.").removeprefix("chlo.")
        if text in OP_KINDS or text in op_names():
            return (text,)
        # A primitive spelt as the message below lists it ("jax.lax.dot_general_p"): it
        # was refused in the message naming it as accepted.
        primitive = text.removeprefix("jax.").removeprefix("lax.").removesuffix("_p")
        if primitive in _PRIMITIVE_KINDS:
            return _PRIMITIVE_KINDS[primitive]
    raise ValueError(
        f"Unknown op kind {kind!r}; accepted: {', '.join(OP_KINDS)}, "
        f"jax.lax.dot_general_p, jax.lax.conv_general_dilated_p, "
        f"jax.lax.ragged_dot_general_p, or with propagate=true "
        f"any StableHLO or CHLO op name ({', '.join(sorted(op_names() - set(OP_KINDS)))})"
    )


# No ',': the string grammar separates items with it, and a name-stack segment holding
# one is an einsum's spec (ir/sites.py), never a scope.
_PATTERN_OK = re.compile(r"^/?[^/\s,]+(/[^/\s,]+)*$")


def check_pattern(pattern: Any) -> str:
    """``pattern`` stripped, or a ValueError naming what a scope pattern may be."""
    text = pattern.strip() if isinstance(pattern, str) else ""
    if not _PATTERN_OK.match(text.removesuffix("$")):
        raise ValueError(
            f"Malformed scope pattern {pattern!r}; accepted: one or more non-empty "
            f"segments separated by '/', each a name or a glob like 'Block_*', "
            f"optionally anchored by a leading '/' at the outermost segment ('/head') "
            f"and/or a trailing '$' at the innermost ('head$', '/head$'); no spaces or ','"
        )
    if not _classes_closed(text):
        raise ValueError(f"Malformed scope pattern {pattern!r}: unbalanced '[' in glob; "
                         f"accepted: a glob's character class in [...] ('Block_[01]'), or "
                         f"'[$]' for a literal '$'")
    return text


def _classes_closed(text: str) -> bool:
    """Whether every '[' that opens a glob class has its ']' (as fnmatch reads them: a
    ']' first in the class is a member; a lone ']' is literal). Counting brackets took
    'a]b[' and refused 'a[[b]]'."""
    at = 0
    while at < len(text):
        if text[at] != "[":
            at += 1
            continue
        start = at + 1
        start += text.startswith("!", start)
        start += text.startswith("]", start)
        close = text.find("]", start)
        if close < 0:
            return False
        at = close + 1
    return True


@functools.lru_cache(maxsize=4096)
def pattern_parts(pattern: str) -> tuple[tuple[str, ...], bool, bool]:
    """A checked pattern's globs, whether it is anchored at the outermost segment
    (leading '/') and whether at the innermost (trailing '$')."""
    first, last = pattern.startswith("/"), pattern.endswith("$")
    body = pattern.removesuffix("$").removeprefix("/")
    return tuple(body.split("/")), first, last


def match_start(pattern: str, scope: tuple[str, ...], after: int = -1) -> int | None:
    """Index of the outermost scope segment (past ``after``) where ``pattern`` matches,
    else None.

    A pattern of k '/'-separated parts matches k consecutive whole segments, each
    part matched as a glob against one segment ("attn" never matches "attn_norm");
    a leading '/' lets it match only from the first segment, a trailing '$' only up
    to the last.
    """
    parts, first, last = pattern_parts(pattern)
    k = len(parts)
    for start in range(after + 1, len(scope) - k + 1):
        if (first and start != 0) or (last and start != len(scope) - k):
            continue
        if all(fnmatch.fnmatchcase(scope[start + i], parts[i]) for i in range(k)):
            return start
    return None
