"""Where a server's processes spend a trace, sampled by py-spy.

:class:`Sampler` runs ``py-spy record --format raw --nonblocking`` (``pip install
py-spy``) on a server's scheduler process and on its HTTP process (the tokenizer
manager: chat templates, image preprocessing) while a block of client work runs.
py-spy leaves out threads that wait, so a sample is a moment a thread ran Python or
native code. :func:`scheduler_split` puts each scheduler sample in one part:

- ``decode``: the decode forward (SGLang's ``EagerRunner._execute_decode``);
- ``vision``: the vision encoder inside an extend (``get_image_feature``);
- ``extend``: the rest of the extend forward: stock's language model, sgl_mmkv's
  scoring and refresh passes and segment copies;
- ``scheduler``: the scheduler's own work between forwards (batching, the radix
  cache, segment lookup, result processing).

py-spy slows the processes it samples by a few per cent; both sides pay it.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import psutil

PARTS = ("decode", "vision", "extend", "scheduler")
# part -> frame names (substrings of py-spy's "function (file:line)"); first part wins.
_PART_FRAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("decode", ("_execute_decode",)),
    ("vision", ("get_image_feature", "get_video_feature", "VisionTransformer")),
    ("extend", ("_execute_extend", "RefreshExecutor.")),
)


def scheduler_pid(launcher_pid: int) -> int:
    """The pid of the scheduler process under a server's launcher process."""
    for child in psutil.Process(launcher_pid).children(recursive=True):
        if "scheduler" in child.name() or "scheduler" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError("no scheduler process under the server")


def samples(raw: Path) -> list[tuple[str, int]]:
    """``[(stack, count)]`` of py-spy's raw (collapsed) output; empty if none."""
    out = []
    text = raw.read_text(errors="replace") if raw.exists() else ""
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack, int(count)))
    return out


def part_of(stack: str) -> str:
    """The part of :data:`PARTS` a scheduler stack (``;``-joined frames) was sampled in."""
    for part, needles in _PART_FRAMES:
        if any(needle in stack for needle in needles):
            return part
    return "scheduler"


def scheduler_split(raw: Path, rate: int) -> dict[str, float]:
    """Seconds of each part of :data:`PARTS` in a scheduler's raw py-spy output
    sampled at ``rate`` per second."""
    seconds = collections.Counter({part: 0.0 for part in PARTS})
    for stack, count in samples(raw):
        seconds[part_of(stack)] += count / rate
    return {part: round(seconds[part], 3) for part in PARTS}


def busy_seconds(raw: Path, rate: int) -> float:
    """Thread-seconds a process ran (every sampled stack), from its raw py-spy output."""
    return round(sum(count for _, count in samples(raw)) / rate, 3)


class Sampler:
    """``with Sampler(launcher_pid, rate, out_prefix) as s: ...`` samples the server's
    scheduler and HTTP processes over the block; then ``s.result()`` is
    ``{"wall_s", "scheduler_s": {part: s}, "http_busy_s"}``. Raw files are
    ``<out_prefix>-scheduler.spy`` and ``-http.spy`` (py-spy's collapsed stacks)."""

    def __init__(self, launcher_pid: int, rate: int, out_prefix: Path) -> None:
        self.rate = rate
        self.targets = {
            "scheduler": scheduler_pid(launcher_pid),
            "http": launcher_pid,
        }
        self.raw = {name: Path(f"{out_prefix}-{name}.spy") for name in self.targets}
        self._spies: list[subprocess.Popen] = []
        self._wall = 0.0

    def __enter__(self) -> Sampler:
        for name, pid in self.targets.items():
            self.raw[name].parent.mkdir(parents=True, exist_ok=True)
            command = ["py-spy", "record", "--pid", str(pid), "--rate", str(self.rate)]
            command += ["--format", "raw", "--nonblocking", "-o", str(self.raw[name])]
            spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._spies.append(spy)
        time.sleep(1.0)  # attached
        self._started = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._wall = time.perf_counter() - self._started
        for spy in self._spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for spy in self._spies:
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()

    def result(self) -> dict:
        return {
            "rate": self.rate,
            "wall_s": round(self._wall, 3),
            "scheduler_s": scheduler_split(self.raw["scheduler"], self.rate),
            "http_busy_s": busy_seconds(self.raw["http"], self.rate),
        }
