"""labkit imports only downward: the layer order below, and no import cycles.

Every ``import`` in labkit's source (at module level or inside a function: a deferred
import is still a dependency) is read with ``ast``, without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "labkit"

# Lower rank = further down. A module may import its own rank only inside its own package
# (siblings), and any lower rank. The first matching prefix gives a module's rank.
LAYERS = [
    (0, ["labkit.core", "labkit.widgets"]),
    (1, ["labkit.emulator"]),
    (2, ["labkit.backend"]),
    (3, ["labkit.capture", "labkit.inspect"]),
    (4, ["labkit.guards"]),
    (5, ["labkit.timeline", "labkit.bridge"]),
    (6, ["labkit.pipeline", "labkit.full_step", "labkit.decode", "labkit.compiled"]),
    (7, ["labkit.piecewise", "labkit.speculative", "labkit.tp"]),
    (8, ["labkit.checks", "labkit.bench", "labkit.doctor", "labkit.exercises", "labkit.demo",
         "labkit.colab"]),
    (9, ["labkit.__main__"]),
]

# Edges still to remove (issue #13). This list only shrinks: an entry that no longer
# exists fails the test too, so it cannot go stale.
KNOWN: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, mod: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "labkit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "labkit":
                continue
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)   # `from labkit import x`
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = {d for d in _imports(path, mod) if d in files and d != mod and d != "labkit"}
        graph[mod] = deps
    return graph


def _rank(mod: str) -> int | None:
    for rank, prefixes in LAYERS:
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return rank
    return None


def _package(mod: str) -> str:
    for _, prefixes in LAYERS:
        for p in prefixes:
            if mod == p or mod.startswith(p + "."):
                return p
    return mod


GRAPH = _graph()


def test_every_module_has_a_layer():
    missing = sorted(m for m in GRAPH if m != "labkit" and _rank(m) is None)
    assert not missing, f"add these modules to LAYERS in tests/test_layers.py: {missing}"


def _violations() -> set[tuple[str, str]]:
    bad = set()
    for mod, deps in GRAPH.items():
        r = _rank(mod)
        if r is None:
            continue
        for dep in deps:
            rd = _rank(dep)
            if rd is None:
                continue
            if rd > r or (rd == r and _package(dep) != _package(mod)):
                bad.add((mod, dep))
    return bad


def _emulator_reach() -> set[tuple[str, str]]:
    """Above the backend, code talks to the emulator through ``B`` (``B.is_emulated``,
    ``B.is_current_stream_capturing()``, ...), not by importing its parts."""
    return {(mod, dep) for mod, deps in GRAPH.items() for dep in deps
            if dep.startswith("labkit.emulator") and (_rank(mod) or 0) > 2}


def test_imports_only_go_down():
    bad = (_violations() | _emulator_reach()) - KNOWN
    assert not bad, "upward or sideways imports:\n" + "\n".join(
        f"  {a} imports {b}" for a, b in sorted(bad))


def _cycles() -> list[list[str]]:
    # Tarjan's strongly connected components; a component of more than one module is a cycle.
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def _cycle_edges() -> set[tuple[str, str]]:
    edges = set()
    for comp in _cycles():
        members = set(comp)
        edges.update((a, b) for a in comp for b in GRAPH[a] if b in members)
    return edges


def test_no_import_cycles():
    bad = _cycle_edges() - KNOWN
    assert not bad, "import cycles (a package's __init__ re-exporting a submodule that " \
        "imports the package back counts too):\n" + "\n".join(
            f"  {a} imports {b}" for a, b in sorted(bad))


def test_known_list_is_current():
    stale = KNOWN - (_violations() | _emulator_reach() | _cycle_edges())
    assert not stale, f"these edges are gone: remove them from KNOWN: {sorted(stale)}"


@pytest.mark.parametrize("mod", sorted(m for m in GRAPH if m.startswith("labkit.core")))
def test_core_imports_only_core(mod):
    outside = sorted(d for d in GRAPH[mod] if not d.startswith("labkit.core"))
    assert not outside, f"{mod} is in the shared layer but imports {outside}"


def _private_imports() -> set[tuple[str, str]]:
    """``(module, name)`` for every private name (``_x``, or any name from a private module)
    a module imports from another package."""
    out = set()
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "labkit" or _package(source) == _package(mod):
                continue
            private_module = any(p.startswith("_") and not p.startswith("__")
                                 for p in source.split("."))
            out.update((mod, f"{source}.{a.name}") for a in node.names
                       if private_module or (a.name.startswith("_")
                                             and not a.name.startswith("__")))
    return out


def test_no_private_name_is_imported_across_packages():
    """A name another package needs is public in its home (issue #31)."""
    bad = _private_imports()
    assert not bad, "private names imported from another package (make them public):\n" + \
        "\n".join(f"  {a} imports {b}" for a, b in sorted(bad))
