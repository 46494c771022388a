"""``make serve`` then ``make ask``: the committed model, served as ``make serve``
serves it, answers the task's question right under two system prompts, and the
second request reuses both images' KV although its prefix changed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from harness import ask
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def _serve_flags() -> tuple[str, list[str]]:
    """The model and the flags of the Makefile's ``serve`` recipe, but its port."""
    makefile = (ROOT / "Makefile").read_text()
    model = re.search(r"^MODEL \?= (\S+)$", makefile, re.M).group(1)
    words = shlex.split(re.search(r"-m sgl_mmkv\.launch_server (.+)$", makefile, re.M).group(1))
    flags, skip = [], False
    for word in words:
        if skip or word in ("--model-path", "--port"):
            skip = not skip and word.startswith("--")  # skip the flag's value next
            continue
        flags.append(word)
    return model, flags


def test_make_ask_shows_a_right_answer_and_a_reuse(tmp_path, capsys):
    model, flags = _serve_flags()
    # The test's CPU memory bounds too: at SGLang's defaults the pool takes most of
    # the machine's memory, which another worker's server then runs out of.
    args = [*CPU_SERVER_ARGS, *flags]
    with ServerProcess("sgl_mmkv.launch_server", ROOT / model, args, tmp_path / "s.log") as s:
        port = s.base_url.rsplit(":", 1)[1]
        assert ask.main(["--port", port, "--model-path", str(ROOT / model)]) == 0
    out = capsys.readouterr().out
    assert "[ask] 2 of 2 answers right" in out
    reused = int(re.search(r"image tokens reused under the new prefix (\d+)", out).group(1))
    assert reused > 0
