"""Run ``sgl_mmkv.launch_server.main`` on several argument lists in one process.

Reads a JSON list of argument lists on stdin and writes, for each, the launcher's
return code and what it printed to stderr, as JSON to the file named by the first
argument (SGLang may print to stdout). A list the launcher does
not refuse gets return code ``None``: SGLang's ``run_server`` is replaced so that
nothing starts. Importing SGLang is most of a refused start-up's cost, so
``tests/test_refusals.py`` sends its cases through one process per sgl_mmkv
configuration instead of one process per case. Every list in a call must resolve to
the same sgl_mmkv configuration: SGLang loads plugins (and with them the patches a
configuration registers) once per process.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


class NotRefused(Exception):
    """The launcher reached ``run_server``."""


def _not_started(server_args) -> None:
    raise NotRefused


def main() -> int:
    import sglang.launch_server

    from sgl_mmkv import launch_server

    cases: list[list[str]] = json.load(sys.stdin)
    configs = set()
    for argv in cases:
        with contextlib.suppress(launch_server.ConfigError):
            configs.add(repr(launch_server.resolve_args(argv)[0]))
    if len(configs) > 1:
        raise SystemExit(f"one sgl_mmkv configuration per call, got {len(configs)}")
    sglang.launch_server.run_server = _not_started
    results = []
    for argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = launch_server.main(argv)
            except NotRefused:
                code = None
        results.append({"returncode": code, "stderr": err.getvalue()})
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
