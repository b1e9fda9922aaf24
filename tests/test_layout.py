"""The package's shape (issue #27): no import cycles inside mlxr, no file past MAX_LINES, no
package attribute shadowed by a submodule of the same name.

The import graph is read from the source (ast), with every import: module level, inside
functions, under `if TYPE_CHECKING`. An import hidden in a function to dodge a cycle is still
one: the two modules cannot be understood, or moved, apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450  # a file past this holds more than one concern: split it
LONG_FILES: set[str] = set()  # allowed exceptions, by path under the repository root (none)


def modules(pkg_dir: Path) -> dict[str, tuple[Path, str]]:
    """Dotted module name -> (file, the package its relative imports start from)."""
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = list(path.relative_to(pkg_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            out[".".join(parts)] = (path, ".".join(parts))
        else:
            out[".".join(parts)] = (path, ".".join(parts[:-1]))
    return out


def import_graph(pkg_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from p import m` counts as importing the
    submodule p.m where that is one; a name inside a module counts as the module)."""
    mods = modules(pkg_dir)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, package) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1]
                                    + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                o = owner(t)
                if o is not None and o != mod:
                    graph[mod].add(o)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    found = cycles(import_graph(ROOT / "mlxr"))
    assert found == [], "import cycles inside mlxr: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """A planted cycle through a function-level import and a TYPE_CHECKING import is found, and
    so is a relative `from . import m`; a one-way package is clean."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from p.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n")
    (pkg / "sub" / "c.py").write_text("from . import b\n")
    graph = import_graph(pkg)
    assert graph["p.a"] == {"p.sub.b"} and graph["p.sub.b"] == {"p.a"}
    assert graph["p.sub.c"] == {"p.sub.b"}
    assert cycles(graph) == [["p.a", "p.sub.b"]]
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert cycles(import_graph(pkg)) == []


def test_no_file_past_max_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "mlxr").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexpected = {p: n for p, n in long.items() if p not in LONG_FILES}
    assert unexpected == {}, f"files past {MAX_LINES} lines (split them by concern): {unexpected}"
    assert LONG_FILES <= set(long), f"exceptions no longer needed: {LONG_FILES - set(long)}"


def test_no_submodule_shadows_a_package_name():
    """Importing `p.x` sets the attribute `p.x` to the submodule: a function `x` that p's
    __init__ defines or imports (e.g. `mlxr.ops.attention`, the eager op) would be replaced by
    the module as soon as any kernel under it is imported."""
    clashes = []
    for init in sorted((ROOT / "mlxr").rglob("__init__.py")):
        subs = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"}
        subs |= {p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.ImportFrom) and not (node.level == 1 and not node.module):
                names = [a.asname or a.name for a in node.names]
            else:
                continue
            clashes += [f"{init.parent.relative_to(ROOT)}: {n}" for n in names if n in subs]
    assert clashes == [], f"names bound in a package and also its submodules: {clashes}"
