"""lightdist's modules stand in layers: none reaches back to itself through what it imports, and the packages with one
entry point are entered through it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).parents[1]
# plugins/ and models/ ship as lightdist.plugins and lightdist.models
SHIPPED_AS = {"lightdist": "lightdist", "plugins": "lightdist.plugins", "models": "lightdist.models"}
ENTERED_BY_INIT = ("lightdist.parallel.context", "lightdist.parallel.tensor")


def _module_files() -> dict[str, Path]:
    modules = {}
    for folder, package in SHIPPED_AS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            modules[".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The lightdist modules ``path`` imports anywhere: at the top, for type hints only, or inside a function."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightdist"):
            imported |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("lightdist")}
    return imported & modules.keys()


def _import_graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {module: _imports(path, modules) - {module} for module, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each module's shortest way back to itself through its imports, where it has one."""
    circles = []
    for start in sorted(graph):
        paths, seen = [[start]], {start}
        while paths and not any(path[-1] == start and len(path) > 1 for path in paths):
            paths = [
                [*path, nxt] for path in paths for nxt in sorted(graph[path[-1]]) if nxt == start or nxt not in seen
            ]
            seen |= {path[-1] for path in paths}
        circles += [path for path in paths if path[-1] == start and len(path) > 1][:1]
    return circles


def test_no_module_imports_its_way_back_to_itself() -> None:
    circles = _circles(_import_graph())
    assert circles == [], "import circles:\n" + "\n".join(" -> ".join(circle) for circle in circles)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]


def test_packages_with_one_entry_point_are_entered_through_it() -> None:
    inside = [
        f"{module} imports {target}"
        for module, targets in _import_graph().items()
        for target in targets
        for package in ENTERED_BY_INIT
        if target.startswith(f"{package}.") and not module.startswith(f"{package}.") and module != package
    ]
    assert inside == []
