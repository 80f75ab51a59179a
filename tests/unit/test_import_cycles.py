"""No import circles between the modules of ``refcache``, type-level ones included.

Every module is parsed with ``ast`` (nothing is imported, so this runs without torch or an engine) and every
import statement counts wherever it stands: at module level, under ``if TYPE_CHECKING:``, in a ``try``, or
inside a function (a deferred import only hides a circle from the interpreter, not from a reader). ``from x
import y`` is an edge to the module ``x.y`` when there is one, else to ``x``; relative imports are resolved
against the importing module's package; importing a package's module is an edge to the package as well (its
``__init__`` runs first), unless the importer is inside that package. A circle is reported as the modules on it, in import order.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name -> file (a package's name -> its __init__)."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    # Importing ``a.b.c`` runs the ``__init__`` of ``a.b`` (and of ``a``) first, unless the importer is inside
    # that package already (its package was initialised before it): an edge to each such package too.
    for target in list(targets):
        parts = target.split(".")
        for end in range(1, len(parts)):
            parent = ".".join(parts[:end])
            if not (name == parent or name.startswith(parent + ".")):
                targets.add(parent)
    return {target for target in targets if target in known and target != name}


def graph(root: Path, package: str) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle per strongly connected component of more than one module (Tarjan's SCCs, then a
    breadth-first search from the component's first module back to itself), each as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: no recursion limit on a deep graph
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    found = []
    for component in components:
        inside, start = set(component), component[0]
        parent: dict[str, str] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in edges[node]:
                path = [start]
                while node != start:
                    path.append(node)
                    node = parent[node]
                found.append([start, *reversed(path[1:]), start])
                break
            for child in sorted(edges[node] & inside):
                if child not in parent and child != start:
                    parent[child] = node
                    queue.append(child)
    return found


def test_refcache_has_no_import_circle() -> None:
    found = cycles(graph(ROOT, "refcache"))
    assert not found, "import circles (break each; type-level ones too):\n" + "\n".join(
        " -> ".join(circle) for circle in found
    )


def test_the_detector_names_a_planted_circle(tmp_path: Path) -> None:
    """A tiny package with a type-level circle (c -> d under TYPE_CHECKING, d -> c at run time), a relative
    one through a function (a -> b -> a) and a ``from pkg import module`` edge: each is named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .a import thing\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import d\n",
        "sub/__init__.py": "",
        "sub/d.py": "import pkg.c\n",
        "e.py": "import pkg.a\nfrom pkg.sub.d import x\n",  # imports into circles, on none
    }
    for name, text in files.items():
        (pkg / name).write_text(text, encoding="utf-8")
    edges = graph(tmp_path, "pkg")
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"}
    assert edges["pkg.c"] == {"pkg.sub", "pkg.sub.d"}  # pkg.sub's __init__ runs first
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub.d", "pkg.c"]]
    (pkg / "b.py").write_text("", encoding="utf-8")
    (pkg / "sub/d.py").write_text("", encoding="utf-8")
    assert cycles(graph(tmp_path, "pkg")) == []


def test_a_circle_through_a_package_init_is_named(tmp_path: Path) -> None:
    """``pkg.top`` imports ``pkg.sub.low``, so ``pkg.sub``'s ``__init__`` runs first; it imports
    ``pkg.sub.mid``, which imports ``pkg.top``: a circle no single import statement shows (the one
    refcache.family once had through refcache.hicache). A module importing a sibling in its own package adds
    no edge to that package."""
    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    files = {
        "pkg/__init__.py": "",
        "pkg/top.py": "from pkg.sub.low import x\n",
        "pkg/sub/__init__.py": "from pkg.sub.mid import y\n",
        "pkg/sub/mid.py": "import pkg.top\nfrom pkg.sub.low import x\n",
        "pkg/sub/low.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    edges = graph(tmp_path, "pkg")
    assert edges["pkg.top"] == {"pkg.sub", "pkg.sub.low"} and "pkg.sub" not in edges["pkg.sub.mid"]
    assert cycles(edges) == [["pkg.sub", "pkg.sub.mid", "pkg.top", "pkg.sub"]]


def test_a_longer_circle_is_named_in_import_order() -> None:
    edges = {"x": {"y"}, "y": {"z"}, "z": {"x", "w"}, "w": set()}
    assert cycles(edges) == [["x", "y", "z", "x"]]
