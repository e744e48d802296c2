"""Parse an op's location into a Site: scope path, transforms, direction, op kind.

JAX writes the name stack into each op's ``NameLoc``, e.g.
``jit(step)/transpose(jvp(Block_0))/attn/dot_general``. A transform wraps only the
first segment after it (``jvp(Block_0)``), possibly nested (``transpose(jvp())``). Ops
inside private functions carry names relative to the function; the caller's call-site
name is the prefix (see ``join_names``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from jaxlib.mlir import ir

from hlo_amp.ir.op_classes import short_name

# Transforms JAX writes as wrappers around a name-stack segment.
TRANSFORMS = frozenset({
    "jvp", "transpose", "vmap", "pmap", "remat", "checkpoint", "custom_jvp",
    "custom_vjp", "xmap", "shard_map", "linearize", "vjp", "grad", "batch",
})
BACKWARD_TRANSFORMS = frozenset({"transpose"})
# The segment jax writes over remat's recomputed forward in the backward pass.
RECOMPUTED = "rematted_computation"
# Segments JAX itself writes for control flow and calls; not user scopes.
STRUCTURAL = frozenset({
    "scan", "closed_call", "core_call", "checkpoint",
    "rematted_computation", "remat", "remat2", "pjit", "jit", "shard_map", "cond_branch",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "call", "remat_opt", "fori_loop",
    # jax 0.11 writes it before a scan body's scopes ("eval_jaxpr/cell"; seen with jax
    # 0.11.2 on the lent H100 machine, 2026-11-26).
    "eval_jaxpr",
})
# "body" and "cond" are JAX's only right after "while" ("while/body", "while/cond"),
# and "cond" or "switch" right before a branch ("cond/branch_0_fun"), "while" right
# before "body" or "cond", a branch ("branch_1", "branch1_fun") right after "cond" or
# "switch" (or ending in "_fun"); elsewhere they are user scopes: a Linen list
# attribute ``self.branch = [...]`` names its modules branch_0, branch_1, a Switch
# Transformer's router may be "switch".
# ("body_pred": the cond's second lowering inside a batched while's body, under vmap.)
_LOOP_PARTS = frozenset({"body", "cond", "body_pred"})
_BRANCH_RE = re.compile(r"^branch_?\d+(_fun)?$")
_BRANCH_FUN_RE = re.compile(r"^branch_?\d+_fun$")
_SWITCHES = frozenset({"cond", "switch"})
_STRUCTURAL_RE = re.compile(
    r"^(jit|pjit|checkpoint|remat|custom_jvp_call|custom_vjp_call)\(.*\)$")
# A NameLoc prints as loc("name") or loc("name"(child)); a FileLineColLoc as
# loc("file":line:col), which is no name.
_NAME_RE = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"(?=[()])')
_FILE_RE = re.compile(r'"((?:[^"\\]|\\.)+)":(\d+)(?::(\d+))?')


@dataclass(frozen=True)
class Site:
    """Where an op sits in the user's program."""

    scope: tuple[str, ...]  # user scopes, outermost first ("Block_0", "attn", "query")
    transforms: tuple[str, ...]  # outermost first, e.g. ("transpose", "jvp")
    backward: bool  # inside a transpose(...): the op belongs to the backward pass
    op_kind: str  # "dot_general", "convolution", ...
    source: str | None = None  # "file.py:12" of the user's line, if the location has it
    name: str = ""  # the full name-stack string the site was parsed from
    einsum: str | None = None  # the einsum spec segment, if any
    recomputed: bool = False  # in remat's recomputed forward (inside the backward pass)

    @property
    def gradient_pass(self) -> bool:
        """Whether the op computes backward values: a backward op that is not remat's
        recomputed forward (that one recomputes the forward's values, so the rules that
        decided the forward decide it too)."""
        return self.backward and not self.recomputed

    @property
    def direction(self) -> str:
        """"forward", "backward", or "recomputed" (remat's forward, recomputed in the
        backward pass)."""
        return "recomputed" if self.recomputed else "backward" if self.backward else "forward"

    @property
    def scope_path(self) -> str:
        return "/".join(self.scope)


def location_name(location: object) -> str:
    """The name-stack string of an MLIR location (``""`` when it has none)."""
    if isinstance(location, ir.NameLoc):  # prints as loc("name"...)
        name = location.name_str
        if _plain(name):
            return name
    elif isinstance(location, _NAMELESS):  # prints as loc(unknown), loc("file":...), ...
        return ""
    return _name_of_text(str(location))


def location_source(location: object) -> str | None:
    """``file:line`` of the first file location inside ``location``, if any."""
    return location_parts(location)[1]


def location_parts(location: object) -> tuple[str, str | None]:
    """``(location_name, location_source)`` of an MLIR location or its printed form.

    Both are defined on the printed form, ``loc("name"(callsite(...)))``, but printing
    JAX's locations (whole call-site chains, ~10 us each) is the slow part, so an
    ``ir.Location`` is read from its tree where that gives the same strings: a name
    and file names that print as they are (printable ASCII without quotes or
    backslashes, which MLIR would escape). Anything else is printed and parsed.
    """
    if isinstance(location, ir.Location):
        found = _parts_from_tree(location)
        if found is not None:
            return found
    text = str(location)
    return _name_of_text(text), _source_of_text(text)


_UNSURE = object()  # a location the tree reading leaves to the printed form
_NAMELESS = (ir.UnknownLoc, ir.FileLineColLoc, ir.CallSiteLoc, ir.FusedLoc)


def _plain(text: str) -> bool:
    """Whether ``text`` prints unescaped and cannot start a ``"file":line`` match."""
    return (text.isascii() and text.isprintable() and '"' not in text
            and "\\" not in text and not text.startswith(":"))


def _parts_from_tree(location: ir.Location) -> tuple[str, str | None] | None:
    name = ""
    child: ir.Location = location
    if isinstance(location, ir.NameLoc):  # prints as loc("name") or loc("name"(child))
        name = location.name_str
        if not _plain(name):
            return None
        child = location.child_loc
    source = _first_file(child, 0, skip_packages=True)
    if source is None:  # every frame is in an installed package: the innermost one
        source = _first_file(child, 0, skip_packages=False)
    if source is _UNSURE:
        return None
    return name, source  # type: ignore[return-value]


def _in_package(filename: str) -> bool:
    """Whether ``filename`` is in an installed package (Flax's Dense, not the user's model)."""
    return "/site-packages/" in filename or "/dist-packages/" in filename


def _first_file(location: ir.Location, depth: int, skip_packages: bool) -> object:
    """``file:line`` of the first file location in print order (callee before caller,
    fused locations in order), past installed packages' files if ``skip_packages``;
    None when there is none; _UNSURE when only the printed form tells."""
    if depth > 64:
        return _UNSURE
    if isinstance(location, ir.FileLineColLoc):
        filename = location.filename
        if not filename or not _plain(filename):
            return _UNSURE
        if skip_packages and _in_package(filename):
            return None
        return f"{filename}:{location.start_line}"
    if isinstance(location, ir.NameLoc):
        if not _plain(location.name_str):
            return _UNSURE
        return _first_file(location.child_loc, depth + 1, skip_packages)
    if isinstance(location, ir.CallSiteLoc):
        found = _first_file(location.callee, depth + 1, skip_packages)
        if found is not None:
            return found
        return _first_file(location.caller, depth + 1, skip_packages)
    if isinstance(location, ir.FusedLoc):
        if location.metadata is not None:
            return _UNSURE
        for inner in location.locations:
            found = _first_file(inner, depth + 1, skip_packages)
            if found is not None:
                return found
        return None
    if isinstance(location, ir.UnknownLoc):
        return None
    return _UNSURE


# The printed form is parsed with these, cached per string.
_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2}|.)")


def unescape(quoted: str) -> str:
    """An MLIR string literal's text as written: the printer escapes every byte that
    is not printable ASCII as ``\\XX`` (so "café" prints as ``caf\\C3\\A9``), and quotes
    and backslashes. UnicodeDecodeError where the bytes are not UTF-8."""
    if "\\" not in quoted:
        return quoted
    raw = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if len(m.group(1)) == 2
                      else {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), quoted)
    return raw.encode("latin-1").decode("utf-8")


@functools.lru_cache(maxsize=4096)
def _name_of_text(text: str) -> str:
    match = _NAME_RE.match(text)
    if not match:
        return ""
    return unescape(match.group(1))


@functools.lru_cache(maxsize=4096)
def _source_of_text(text: str) -> str | None:
    matches = list(_FILE_RE.finditer(text))
    if not matches:
        return None
    match = next((m for m in matches if not _in_package(m.group(1))), matches[0])
    return f"{match.group(1)}:{match.group(2)}"


def split_segments(name: str) -> list[str]:
    """Split a name stack on '/' outside parentheses ("jvp(a/b)" stays one piece)."""
    return split_outside_parentheses(name, "/")


def split_outside_parentheses(text: str, separator: str) -> list[str]:
    """The non-empty pieces of ``text`` between ``separator``s outside parentheses."""
    if "(" not in text:  # no parentheses: every separator splits
        return [s for s in text.split(separator) if s != ""]
    pieces, depth, current = [], 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        if char == separator and depth == 0:
            pieces.append("".join(current))
            current = []
        else:
            current.append(char)
    pieces.append("".join(current))
    return [s for s in pieces if s != ""]


def unwrap(segment: str) -> tuple[list[str], str]:
    """``transpose(jvp(Block_0))`` -> (["transpose", "jvp"], "Block_0")."""
    transforms: list[str] = []
    while True:
        match = re.match(r"^([A-Za-z_][\w]*)\((.*)\)$", segment)
        if not match or match.group(1) not in TRANSFORMS:
            return transforms, segment
        transforms.append(match.group(1))
        segment = match.group(2)


def _is_structural(segment: str) -> bool:
    return segment in STRUCTURAL or bool(_STRUCTURAL_RE.match(segment))


def _reenters(wrappers: list[str], earlier: list[str]) -> bool:
    """Whether a segment wrapped in ``wrappers`` is remat's re-entry into one wrapped in
    ``earlier``: ``earlier`` less some runs of transforms, each ending in a transpose
    (the backward pass's own: ``transpose(jvp(M))/jvp(M)``,
    ``vmap(transpose(jvp(M)))/vmap(jvp(M))`` under per-example gradients,
    ``vmap(jvp(vmap(transpose(jvp(M)))))/vmap(jvp(jvp(M)))`` under a Hessian, whose
    jacrev batches the transposed pass). An inner vmap in an outer scope of the same
    name (``vmap(jvp(X))/vmap(X)``) drops no transpose: no re-entry."""

    def rest_from(i: int, j: int) -> bool:  # earlier[i:] less runs gives wrappers[j:]
        if j == len(wrappers):
            return i == len(earlier) or earlier[-1] in BACKWARD_TRANSFORMS
        # keep earlier[i] as wrappers[j], or drop a run earlier[i:k + 1] ending in one
        if i < len(earlier) and earlier[i] == wrappers[j] and rest_from(i + 1, j + 1):
            return True
        return any(earlier[k] in BACKWARD_TRANSFORMS and rest_from(k + 1, j)
                   for k in range(i, len(earlier)))

    return len(wrappers) < len(earlier) and rest_from(0, 0)


def _is_einsum_spec(segment: str) -> bool:
    return "->" in segment or "," in segment


@functools.lru_cache(maxsize=4096)
def parse_name(name: str, op_kind: str | None = None) -> Site:
    """Parse a full name stack; the last segment is the op kind unless given.

    Cached per (name, op_kind): a Site is immutable, and a module repeats name stacks.
    """
    segments = split_segments(name)
    # The last segment is the op's own primitive name (dot_general,
    # conv_general_dilated, ...); any transforms wrapped around it still count.
    last_wrappers: list[str] = []
    if segments:
        last_wrappers, last = unwrap(segments.pop())
        if op_kind is None:
            op_kind = last
    op_kind = op_kind or ""
    scope: list[str] = []
    transforms: list[str] = []
    einsum = None
    parts: list[str] = []  # every name-stack part, transforms unwrapped, in order
    # (wrappers, inner, len(parts) before it) of each segment with transforms
    wrapped: list[tuple[list[str], str, int]] = []
    for segment in segments:
        wrappers, inner = unwrap(segment)
        transforms.extend(wrappers)
        # remat under grad re-enters the scope it was called in with fewer transforms:
        # transpose(jvp(Block_0))/jvp(Block_0)/... is one Block_0, not two, and
        # transpose(jvp(enc))/l0/jvp(enc)/l0/checkpoint one enc/l0: the parts from the
        # first entry on are the ones the re-entry names again.
        if wrappers:
            for earlier, earlier_inner, start in reversed(wrapped):
                # Under an outer vmap or jvp the re-entry keeps the outer transforms:
                # vmap(transpose(jvp(M)))/vmap(jvp(M)) (per-example gradients),
                # jvp(transpose(jvp(M)))/jvp(jvp(M)) (a Hessian-vector product).
                if earlier_inner == inner and _reenters(wrappers, earlier):
                    del parts[start:]
                    break
            wrapped.append((wrappers, inner, len(parts)))
        # The inner part of a wrapper can itself hold '/'-separated scopes.
        for part in split_segments(inner):
            part_wrappers, part = unwrap(part)
            transforms.extend(part_wrappers)
            parts.append(part)
    for i, part in enumerate(parts):
        before = parts[i - 1] if i else ""
        after = parts[i + 1] if i + 1 < len(parts) else ""
        if not part or _is_structural(part):
            continue
        if part in _LOOP_PARTS and before == "while":
            continue
        if part == "while" and after in _LOOP_PARTS:
            continue
        if part in _SWITCHES and _BRANCH_RE.match(after):
            continue
        if _BRANCH_FUN_RE.match(part) or (_BRANCH_RE.match(part) and before in _SWITCHES):
            continue
        if _is_einsum_spec(part):
            einsum = part
            continue
        scope.append(part)
    transforms.extend(last_wrappers)
    return Site(
        scope=tuple(scope),
        transforms=tuple(transforms),
        backward=any(t in BACKWARD_TRANSFORMS for t in transforms),
        op_kind=op_kind,
        name=name,
        einsum=einsum,
        recomputed=RECOMPUTED in parts,
    )


def join_names(prefix: str, name: str) -> str:
    """The name of an op inside a function called at a site named ``prefix``."""
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}/{name}"


def call_prefix(call_name: str) -> str:
    """The call-site name minus its last segment (the callee's own name)."""
    segments = split_segments(call_name)
    if segments:
        wrappers, _inner = unwrap(segments[-1])
        if wrappers:  # jvp(jit(f)): keep the transforms, drop the callee name
            segments[-1] = "".join(f"{w}(" for w in wrappers) + ")" * len(wrappers)
        else:
            segments.pop()
    return "/".join(segments)


def in_backward_pass(op: object) -> bool:
    """Whether ``op``'s own location names it a backward op (``transpose(...)`` in its
    name stack; the callers' prefix of an op in a private function is not read)."""
    operation = op.operation
    return parse_name(location_name(operation.location), short_name(operation.name)).backward


def site_of(op_location: object, op_kind: str, prefix: str = "") -> Site:
    """The Site of an op from its location and its function's call-site prefix."""
    name, source = location_parts(op_location)
    return _site(join_names(prefix, name), op_kind, source)


@functools.lru_cache(maxsize=4096)
def _site(name: str, op_kind: str, source: str | None) -> Site:
    return dataclasses.replace(parse_name(name, op_kind), source=source)


def operand_precisions(op: object) -> list[str] | None:
    """The precision config's entries, one per operand ([] when it has none); None when
    the op names an explicit dot algorithm instead."""
    attributes = op.operation.attributes
    if "algorithm" in attributes:
        return None
    if "precision_config" not in attributes:
        return []
    return [str(entry) for entry in ir.ArrayAttr(attributes["precision_config"])]


def asks_for_precision(op: object) -> str | None:
    """What the program asked for when it pinned this op's precision, else None:
    HIGHEST on an operand, or an explicit dot algorithm. XLA computes a dot at its
    operands' highest precision (f32, no TF32, where one asks for HIGHEST): jax writes
    ``(HIGHEST, DEFAULT)`` where the other operand is exact in any precision
    (``conv_general_dilated_patches``' one-hot filter, behind ``toeplitz``), and under
    a rule for both operands such a copy of the data came out rounded to bf16."""
    entries = operand_precisions(op)
    if entries is None:
        return "an explicit dot algorithm"
    if any("HIGHEST" in entry for entry in entries):
        return "HIGHEST precision"
    return None
