"""The package's layers import downwards only, and its folders form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sgl_mmkv"

# Bottom first: a unit may import only from units on its own floor or below.
# (A unit is a subpackage folder or a module at the package root.)
FLOORS: tuple[tuple[str, ...], ...] = (
    ("kernels", "counters"),
    ("scoring",),
    ("config", "cpu_support", "metrics", "support"),
    ("segments",),
    ("refresh",),
    ("patches",),
    ("radix_cache",),
    ("plugin", "launch_server", "frontend", "routing"),
    ("testing",),
    ("benchmarking", "demo"),
)
FLOOR_OF = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def unit_of(module: str) -> str | None:
    """``sgl_mmkv.refresh.plan`` -> ``refresh``; None for modules outside the package."""
    parts = module.split(".")
    if parts[0] != "sgl_mmkv" or len(parts) < 2:
        return None
    return parts[1]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def unit_graph() -> dict[str, set[str]]:
    """Folder-level import graph of the package: unit -> units it imports."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0].startswith("_"):
            continue  # _cpu_shim: a stand-in for another package, imports nothing of ours
        unit = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        if unit == "__init__":
            continue
        targets = {unit_of(m) for m in imports_of(path)}
        graph.setdefault(unit, set()).update(t for t in targets if t and t != unit)
    return graph


def test_every_unit_has_a_floor():
    assert set(unit_graph()) <= set(FLOOR_OF), set(unit_graph()) - set(FLOOR_OF)


def test_no_unit_imports_from_a_floor_above():
    upward = [
        f"{unit} (floor {FLOOR_OF[unit]}) -> {target} (floor {FLOOR_OF[target]})"
        for unit, targets in unit_graph().items()
        for target in targets
        if FLOOR_OF[target] > FLOOR_OF[unit]
    ]
    assert upward == []


def test_the_folder_graph_has_no_cycle():
    graph = unit_graph()
    done: set[str] = set()

    def visit(unit: str, path: tuple[str, ...]) -> None:
        assert unit not in path, f"import cycle: {' -> '.join((*path, unit))}"
        if unit in done:
            return
        for target in sorted(graph.get(unit, ())):
            visit(target, (*path, unit))
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, ())


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from sgl_mmkv.refresh.plan import RequestPlan\nimport sgl_mmkv.kernels\n")
    assert {unit_of(m) for m in imports_of(module)} >= {"refresh", "kernels"}
