"""docs/ARCHITECTURE.md's tables, and the flag tables of docs/usage.md and docs/design.md,
match the code: the floors are tests/test_layers.py's, every file of the package and
of the folders beside it is named, every file named exists, and every flag is listed
with its choices and default."""

from __future__ import annotations

import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from sgl_mmkv.config import MMKVConfig, flag_name
from tests.test_layers import FLOORS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sgl_mmkv"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
FLOOR_HEADER = "| floor | unit | what is in it |"
OUTSIDE_HEADER = "| folder | what is in it |"
FLAG_HEADER = "| flag | values | default | meaning |"
# Folders beside the package whose every file the outside table names.
LISTED_FOLDERS = ("harness/", "training/", "benchmarks/", "scripts/")
CODE = re.compile(r"`([^`]+)`")
FILE_NAME = re.compile(r"[\w.-]+\.(py|sh)")


def table(path: Path, header: str) -> list[list[str]]:
    """The rows of the first Markdown table under ``header``, cells stripped (an
    escaped ``\\|`` stays inside its cell)."""
    lines = path.read_text().splitlines()
    start = lines.index(header) + 2  # past the header and its |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return rows


def spans(cell: str) -> list[str]:
    """The `code` spans of a cell, in order."""
    return CODE.findall(cell)


def file_names(cell: str) -> set[str]:
    """The spans of a cell that are file names (``x.py``, ``x.sh``)."""
    return {name for name in spans(cell) if FILE_NAME.fullmatch(name)}


def repo_files(folder: str) -> set[Path]:
    """Files under ``folder`` that git tracks or would track (not ignored), on disk."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", folder],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {ROOT / name for name in listed if (ROOT / name).is_file()}


def package_units() -> set[str]:
    """The package's units as tests/test_layers.py counts them: folders holding Python
    files and modules at its root, without ``__init__`` and ``_``-prefixed ones."""
    units = set()
    for path in repo_files("sgl_mmkv"):
        if path.suffix != ".py":
            continue
        relative = path.relative_to(PACKAGE)
        unit = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        if not unit.startswith("_") and unit != "__init__":
            units.add(unit)
    return units


def floor_problems(doc: Path) -> list[str]:
    """What the floor table of ``doc`` gets wrong against FLOORS and the package."""
    problems = []
    rows = table(doc, FLOOR_HEADER)
    floors: list[list[str]] = []
    for floor, unit_cell, what in rows:
        paths = spans(unit_cell)
        problems += [f"floor {floor}: {p} is not in sgl_mmkv/" for p in paths if "/" not in p]
        units = [p.removeprefix("sgl_mmkv/").removesuffix("/").removesuffix(".py") for p in paths]
        floors.append(sorted(units))
        folders = [unit for unit in units if (PACKAGE / unit).is_dir()]
        modules = {f"{unit}.py" for unit in units if (PACKAGE / f"{unit}.py").is_file()}
        on_disk = {
            path.relative_to(PACKAGE / unit).as_posix()
            for unit in folders
            for path in repo_files(f"sgl_mmkv/{unit}")
            if path.suffix == ".py"
        }
        named = file_names(what)
        problems += [
            f"floor {floor}: {n} not named" for n in sorted(on_disk - named - {"__init__.py"})
        ]
        problems += [
            f"floor {floor}: {n} does not exist" for n in sorted(named - on_disk - modules)
        ]
    if [int(row[0]) for row in rows] != list(range(len(rows))):
        problems.append(f"floors numbered {[row[0] for row in rows]}")
    if floors != [sorted(units) for units in FLOORS]:
        problems.append(f"floors {floors} != tests/test_layers.py's {FLOORS}")
    named_units = {unit for units in floors for unit in units}
    problems += [f"unit {u} has no floor" for u in sorted(package_units() - named_units)]
    problems += [f"unit {u} does not exist" for u in sorted(named_units - package_units())]
    return problems


def outside_problems(doc: Path) -> list[str]:
    """What the table of folders outside the package gets wrong against the tree."""
    rows = {spans(folder)[0]: what for folder, what in table(doc, OUTSIDE_HEADER)}
    problems = [f"no row for {f}" for f in (*LISTED_FOLDERS, "models/", "tests/") if f not in rows]
    if problems:
        return problems
    for folder in LISTED_FOLDERS:
        on_disk = {p.name for p in repo_files(folder) if p.parent == ROOT / folder}
        on_disk = {name for name in on_disk if FILE_NAME.fullmatch(name)} - {"__init__.py"}
        named = file_names(rows[folder])
        problems += [f"{folder}{n} not named" for n in sorted(on_disk - named)]
        problems += [f"{folder}{n} does not exist" for n in sorted(named - on_disk)]
    committed = {p.relative_to(ROOT / "models").parts[0] for p in repo_files("models")}
    named = {name for name in spans(rows["models/"]) if re.fullmatch(r"[\w.-]+", name)}
    problems += [f"models/{m} not named" for m in sorted(committed - named)]
    problems += [f"models/{m} is not a committed model" for m in sorted(named - committed)]
    tests = [name for name in spans(rows["tests/"]) if name.endswith(".py")]
    problems += [f"{name} does not exist" for name in tests if not (ROOT / name).is_file()]
    return problems


def test_the_floor_table_has_the_layer_tests_floors_and_every_file():
    assert floor_problems(ARCHITECTURE) == []


def test_the_outside_table_names_every_file_and_model_and_only_real_ones():
    assert outside_problems(ARCHITECTURE) == []


def _tampered(tmp_path: Path, old: str, new: str) -> Path:
    text = ARCHITECTURE.read_text()
    assert text.count(old) == 1, old
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text(text.replace(old, new))
    return doc


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("`faults.py` (", "(", "floor 4: faults.py not named"),
        ("`row_kv.py`", "`row_kv.py`, `gone.py`", "floor 4: gone.py does not exist"),
        (", `sgl_mmkv/metrics.py`", "", "unit metrics has no floor"),
        (
            "| 6 | `sgl_mmkv/radix_cache.py`,",
            "| 6 | `sgl_mmkv/radix.py`,",
            "unit radix does not exist",
        ),
    ],
)
def test_the_floor_check_sees_drift(tmp_path, old, new, problem):
    assert problem in floor_problems(_tampered(tmp_path, old, new))


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("`stale_reuse.py` (", "(", "training/stale_reuse.py not named"),
        ("`demo.py` (", "`demo.py`, `gone.py` (", "harness/gone.py does not exist"),
        ("`fidelity-qwen2-vl-turns` (", "(", "models/fidelity-qwen2-vl-turns not named"),
    ],
)
def test_the_outside_check_sees_drift(tmp_path, old, new, problem):
    assert problem in outside_problems(_tampered(tmp_path, old, new))


def _shows_default(cell: str, default: object) -> bool:
    """A default column shows ``default``: ``off`` / ``on`` for a switch, ``none``
    for an empty value, a number equal to it, or the value itself in code."""
    if isinstance(default, bool):
        return cell == ("on" if default else "off")
    if default == "":
        return cell == "none"
    if isinstance(default, (int, float)):
        return len(spans(cell)) == 1 and float(spans(cell)[0]) == default
    return cell == f"`{default}`"


def flag_problems(doc: Path) -> list[str]:
    """What the flag table of ``doc`` gets wrong against MMKVConfig's fields."""
    rows = {spans(row[0])[0]: row for row in table(doc, FLAG_HEADER)}
    specs = {flag_name(spec.name): spec for spec in fields(MMKVConfig)}
    if list(rows) != list(specs):
        return [f"flags {list(rows)} != {list(specs)}"]
    problems = []
    for flag, (_, values, default, _) in rows.items():
        choices = specs[flag].metadata["choices"]
        if choices is not None and spans(values) != list(choices):
            problems.append(f"{flag}: values {spans(values)} != {list(choices)}")
        if not _shows_default(default, specs[flag].default):
            problems.append(f"{flag}: default {default} != {specs[flag].default!r}")
    return problems


@pytest.mark.parametrize("doc", ["docs/usage.md", "docs/design.md"])
def test_a_flag_table_lists_every_flag_with_its_choices_and_default(doc):
    assert flag_problems(ROOT / doc) == []


@pytest.mark.parametrize(
    "old, new, problem",
    [
        (", `random_keep` (control)", "", "--mm-evict: values"),
        (
            "| `--mm-kv-budget` | float in (0, 1] | `0.5` |",
            "| `--mm-kv-budget` | R | `0.25` |",
            "--mm-kv-budget: default",
        ),
        ("| `--mm-segment-storage-max-gib` |", "| `--mm-segment-storage-max` |", "flags ["),
    ],
)
def test_the_flag_check_sees_drift(tmp_path, old, new, problem):
    text = (ROOT / "docs/usage.md").read_text()
    assert text.count(old) == 1, old
    doc = tmp_path / "usage.md"
    doc.write_text(text.replace(old, new))
    assert any(p.startswith(problem) for p in flag_problems(doc))


def test_the_table_reader_keeps_escaped_pipes_in_their_cell(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"{OUTSIDE_HEADER}\n|---|---|\n| `x/` | `a.py`, `b\\|c` |\n\nafter\n")
    assert table(doc, OUTSIDE_HEADER) == [["`x/`", "`a.py`, `b\\|c`"]]
