"""The package's layers import downwards only, and its folders form no cycle; the
top-level packages beside it (the harness, training) import it, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sgl_mmkv"

# Bottom first: a unit may import only from units on its own floor or below.
# (A unit is a subpackage folder or a module at the package root.)
FLOORS: tuple[tuple[str, ...], ...] = (
    ("kernels", "counters"),
    ("scoring",),
    ("config", "cpu_support", "metrics", "support"),
    ("segments",),
    ("refresh",),
    ("patches",),
    ("radix_cache", "assembly"),
    ("plugin", "launch_server", "frontend", "routing", "gateway"),
    ("testing",),
)
FLOOR_OF = {unit: level for level, units in enumerate(FLOORS) for unit in units}
# The repository's top-level packages, bottom first: each imports only from itself
# and those before it. sgl_mmkv is what the wheel ships; harness/ and training/ are not.
TOP_LEVEL: tuple[str, ...] = ("sgl_mmkv", "harness", "training")


def unit_of(module: str) -> str | None:
    """``sgl_mmkv.refresh.plan`` -> ``refresh``; None for modules outside the package."""
    parts = module.split(".")
    if parts[0] != "sgl_mmkv" or len(parts) < 2:
        return None
    return parts[1]


def package_of(path: Path) -> str:
    """The package a module file is in: ``sgl_mmkv/refresh/plan.py`` and
    ``sgl_mmkv/refresh/__init__.py`` -> ``sgl_mmkv.refresh``."""
    return ".".join(path.resolve().relative_to(ROOT).parts[:-1])


def imports_of(path: Path, package: str | None = None) -> set[str]:
    """Every module ``path`` imports (and ``module.name`` for each ``from`` import),
    relative imports resolved against ``package`` (by default the file's own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = (package if package is not None else package_of(path)).split(".")
                assert node.level <= len(parts), f"{path}: import beyond the top package"
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
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


def test_top_level_packages_import_only_those_below_them():
    upward = []
    for level, name in enumerate(TOP_LEVEL):
        for path in (ROOT / name).rglob("*.py"):
            tops = {module.split(".")[0] for module in imports_of(path)}
            above = tops & set(TOP_LEVEL[level + 1 :])
            upward += [f"{path.relative_to(ROOT)} -> {top}" for top in sorted(above)]
    assert upward == []


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from sgl_mmkv.refresh.plan import RequestPlan\nimport sgl_mmkv.kernels\n")
    assert {unit_of(m) for m in imports_of(module)} >= {"refresh", "kernels"}


def test_the_checker_resolves_relative_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from . import plan\nfrom ..segments.store import SegmentStore\nfrom .. import x\n"
    )
    found = imports_of(module, package="sgl_mmkv.refresh")
    assert {"sgl_mmkv.refresh.plan", "sgl_mmkv.segments.store", "sgl_mmkv.x"} <= found
    assert {unit_of(m) for m in found} - {None} == {"refresh", "segments", "x"}
    assert package_of(PACKAGE / "refresh" / "plan.py") == "sgl_mmkv.refresh"
    assert package_of(PACKAGE / "refresh" / "__init__.py") == "sgl_mmkv.refresh"
