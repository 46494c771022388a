"""What a user gets from ``pip install .``: the wheel holds exactly the package tree
(no harness), every third-party module it imports is declared, every module imports
from a non-editable install, and a refresh-mode server starts from it and reuses an
image under a new prefix."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import requests
from packaging.requirements import Requirement

from sgl_mmkv.cpu_support import CPU_ENV_DEFAULTS
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def _package_files() -> set[str]:
    """Every Python file of the package tree that git tracks or would track (not
    ignored) and that is on disk: what the wheel must hold."""
    command = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "sgl_mmkv"]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return {n for n in listed.stdout.split() if n.endswith(".py") and (ROOT / n).is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*command, "-q", "-w", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("sgl_mmkv-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed non-editable into a target dir, put first on the path."""
    target = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
    done = subprocess.run([*command, str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(wheel: Path) -> set[str]:
    """The wheel's Requires-Dist without a marker, plus the ``gpu`` extra's (sglang,
    the host) and the ``mooncake`` extra's (the optional store client), normalized;
    the ``test`` and ``bench`` extras do not count."""
    archive = zipfile.ZipFile(wheel)
    metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    declared = set()
    for line in archive.read(metadata).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in ("gpu", "mooncake")):
                declared.add(_normalized(requirement.name))
    return declared


def undeclared_imports(sources: dict[str, str], declared: set[str]) -> dict[str, set[str]]:
    """Per module (name -> source), the third-party top-level modules it imports
    whose distribution is not ``declared`` (or that no installed distribution has)."""
    distributions = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for name, source in sources.items():
        tops = set()
        for node in ast.walk(ast.parse(source, filename=name)):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        for top in tops - set(sys.stdlib_module_names) - {"sgl_mmkv"}:
            if not {_normalized(d) for d in distributions.get(top, [])} & declared:
                found.setdefault(name, set()).add(top)
    return found


def _env(target: Path) -> dict[str, str]:
    """An environment that sees the installed wheel and not this checkout: the target
    alone on PYTHONPATH (the editable install's finder runs after the path's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(CPU_ENV_DEFAULTS)
    env["PYTHONPATH"] = str(target)
    return env


def test_the_wheel_holds_exactly_the_package_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    python_files = {n for n in names if n.endswith(".py")}
    assert python_files == _package_files()
    assert "sgl_mmkv/_cpu_shim/sgl_kernel/__init__.py" in names
    outside = {n for n in names if not n.startswith(("sgl_mmkv/", "sgl_mmkv-"))}
    assert outside == set()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[sglang.srt.plugins]" in text and "sgl_mmkv.plugin:load" in text


def test_the_wheel_holds_no_harness_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    harness = subprocess.run(
        ["git", "ls-files", "harness"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "harness/demo.py" in harness and "harness/fidelity_task.py" in harness
    moved = {f"sgl_mmkv/{n.removeprefix('harness/')}" for n in harness} - {"sgl_mmkv/__init__.py"}
    assert names & {*harness, *moved} == set()
    assert not any(n.startswith(("harness/", "sgl_mmkv/benchmarking/")) for n in names)


def test_no_shipped_module_imports_an_undeclared_package(wheel):
    archive = zipfile.ZipFile(wheel)
    sources = {n: archive.read(n).decode() for n in archive.namelist() if n.endswith(".py")}
    declared = declared_distributions(wheel)
    assert {"torch", "transformers", "sglang", "psutil", "requests", "aiohttp"} <= declared
    assert not declared & {"pytest", "openai", "matplotlib", "datasets"}
    assert undeclared_imports(sources, declared) == {}


def test_the_import_check_sees_an_undeclared_package():
    sources = {
        "a.py": "import aiohttp\nimport json\nfrom PIL import Image\nfrom . import b\n",
        "b.py": "from sgl_mmkv.config import MMKVConfig\nimport no_such_module_anywhere\n",
    }
    found = undeclared_imports(sources, declared={"pillow"})
    assert found == {"a.py": {"aiohttp"}, "b.py": {"no_such_module_anywhere"}}


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    script = (
        "import importlib, pkgutil, sgl_mmkv\n"
        "from sgl_mmkv.cpu_support import prepare_cpu_process\n"
        "prepare_cpu_process()\n"
        "for m in pkgutil.walk_packages(sgl_mmkv.__path__, 'sgl_mmkv.'):\n"
        "    print(m.name, importlib.import_module(m.name).__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    expected = {
        name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for name in _package_files()
        if "_cpu_shim" not in name and name != "sgl_mmkv/__init__.py"
    }
    assert set(imported) == expected
    assert all(path.startswith(f"{installed}/sgl_mmkv/") for path in imported.values())


def test_a_conduit_server_starts_from_the_wheel_and_reuses(installed, tiny_vlm, tmp_path):
    args = [*CPU_SERVER_ARGS, "--mm-reuse", "conduit", "--mm-reuse-gate", "always", REPORT_REUSE]
    server = ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_vlm,
        args,
        log_path=tmp_path / "wheel_server.log",
        env=_env(installed),
        cwd=tmp_path,
    )
    image = make_image(31)
    with server:
        metas = []
        for system in ("First system prompt.", "A different system prompt."):
            body = {
                "model": "default",
                "messages": [
                    {"role": "system", "content": system},
                    user_message("Describe.", [image]),
                ],
                "max_tokens": 2,
                "temperature": 0,
                "return_meta_info": True,
            }
            r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            metas.append(r.json()["choices"][0]["meta_info"]["sgl_mmkv"][0])
        log = server.log_text()
    assert metas[0]["reused_segments"] == 0
    assert metas[1]["reused_segments"] == 1 and metas[1]["reused_tokens"] == 16
    assert f"file={installed}/sgl_mmkv/radix_cache.py" in log
