"""No import circles anywhere in the repository: no module imports one that imports it back,
directly or through others, even lazily (imports inside functions count) and even for type
checking only (``if TYPE_CHECKING:`` blocks count too). A scan of every import with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "lyanna",
    "gateway",
    "client",
    "remote_engine",
    "services",
    "training",
    "bench",
    "loadtests",
    "deploy",
    "tests",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repository_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if ".venv" not in path.parts
    }


def package_of(name: str, path: Path) -> str:
    """The package that relative imports in module ``name`` (file ``path``) start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The repository module that ``import name`` runs last (its longest known prefix)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[tuple[str, int]]:
    """Every repository module that module ``name`` imports, with the line of the import."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(name, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from pkg import name`` imports the submodule pkg.name when there is one
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in known else source)
        for target in targets:
            module = resolve(target, known)
            if module is not None:  # a module importing itself is a loop too
                found.add((module, node.lineno))
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[int]]]:
    known = repository_modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    lines: dict[tuple[str, str], list[int]] = {}
    for name, path in known.items():
        for target, line in imports_of(name, path, known):
            graph[name].add(target)
            lines.setdefault((name, target), []).append(line)
    return graph, lines


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; returns every component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    return [
        component
        for component in strongly_connected(graph)
        if len(component) > 1 or component[0] in graph[component[0]]
    ]


def describe(component: list[str], graph, lines) -> str:
    members = set(component)
    edges = [
        f"    {source} -> {target} (line {', '.join(map(str, sorted(lines[(source, target)])))})"
        for source in component
        for target in sorted(graph[source] & members)
    ]
    return "circle of " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_the_scan_finds_a_planted_circle() -> None:
    """The detector itself: a three-module circle and a self-loop are found, a chain is not."""
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},
        "d": set(),
        "e": {"e"},
        "f": {"d"},
    }
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e"]]


def test_the_scan_resolves_relative_and_submodule_imports(tmp_path: Path) -> None:
    """``from . import x`` and ``from pkg import submodule`` point at the submodule, lazy
    imports inside functions and ``TYPE_CHECKING`` blocks count, plain names point at the
    package."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.c import Thing\n"
        "def f():\n"
        "    from pkg import VALUE, d\n"
    )
    known = {
        "pkg": package / "__init__.py",
        **{f"pkg.{m}": package / f"{m}.py" for m in "abcd"},
    }
    found = {target for target, _ in imports_of("pkg.a", package / "a.py", known)}
    assert found == {"pkg", "pkg.b", "pkg.c", "pkg.d"}


def test_no_import_circles_in_the_repository() -> None:
    graph, lines = import_graph()
    assert len(graph) > 200  # the scan saw the repository
    assert any(graph.values())  # and its imports
    found = circles(graph)
    assert not found, "\n" + "\n".join(describe(c, graph, lines) for c in found)
