"""The package's layout rules, read from the import statements with ``ast``: no import
cycle among hlo_amp's modules; ``hlo_amp/targets/`` imports nothing from ``passes/`` or
``runtime/``; ``hlo_amp/passes/`` reads ``targets/`` and never ``runtime/``; no module
outside ``targets/`` compares a target name ("cpu", "gpu", "tpu") itself (docs/design.md,
"Where each thing lives").

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a cycle
hidden in a function is still a cycle in the design."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hlo_amp"
TARGET_NAMES = {"cpu", "gpu", "tpu"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The hlo_amp modules ``path`` imports (``from hlo_amp.x import y`` counts as
    ``hlo_amp.x.y`` where that is a module, else as ``hlo_amp.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hlo_amp")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "hlo_amp":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other)):
                return found
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_targets_import_neither_passes_nor_runtime():
    graph = _graph()
    targets = [n for n in graph if _under(n, "hlo_amp.targets")]
    assert targets
    bad = {n: sorted(i for i in graph[n] if _under(i, "hlo_amp.passes")
                     or _under(i, "hlo_amp.runtime")) for n in targets}
    assert not any(bad.values()), bad


def test_passes_read_targets_never_runtime():
    graph = _graph()
    passes = [n for n in graph if _under(n, "hlo_amp.passes")]
    assert any(_under(i, "hlo_amp.targets") for n in passes for i in graph[n])
    bad = {n: sorted(i for i in graph[n] if _under(i, "hlo_amp.runtime")) for n in passes}
    assert not any(bad.values()), bad


# Modules outside targets/ that compare a platform name for another reason than a target
# fact: what JAX_PLATFORMS asked for (both).
PLATFORM_CONFIG = {"quiet_stderr.py", "deviceless.py"}


def test_only_targets_compare_target_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "targets" or path.name in PLATFORM_CONFIG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                for leaf in ast.walk(side):
                    if isinstance(leaf, ast.Constant) and leaf.value in TARGET_NAMES:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_only_targets_branch_on_a_device_family_class():
    """What differs between GPUs and TPUs is a method of their targets (their topology
    and mesh among them): no module outside targets/ asks ``isinstance(x, GpuTarget)``
    or ``TpuTarget``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "targets":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance" and len(node.args) == 2):
                names = {leaf.id if isinstance(leaf, ast.Name) else leaf.attr
                         for leaf in ast.walk(node.args[1])
                         if isinstance(leaf, (ast.Name, ast.Attribute))}
                if names & {"GpuTarget", "TpuTarget"}:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_the_rules_see_a_cycle():
    # The checker itself: a made-up cycle is found, a chain is not.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
