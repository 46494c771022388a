"""The second part of ``make demo``: the speed-up where image prefill dominates.

The committed trained model is too small for reuse to save time (its forward is
mostly fixed cost). Real VLMs spend their prefill on image tokens; so does the
benchmarks' random-weight Qwen2-VL (``make_tiny_model --preset bench``: 8 layers,
1024 wide, 256 tokens a 448 x 448 page), whose answers mean nothing but whose time
does. Each side serves it alone, reads one 8-page document once, then is asked about
it ``--speed-queries`` times (the exact side once), each time under a new system
prompt with the pages in a new order (doc-QA). Sides, one server at a time: stock
SGLang at its defaults, sgl_mmkv ``conduit`` at its default budget 0.1, and
``conduit`` at budget 1.0 with the gate off (every reused token recomputed: its
tokens must equal stock's, which shows the reuse path is exact; it is not faster).
TTFT is SGLang's own (request received to first token, ``--enable-metrics``).
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.meta_info import chat_with_meta, request_stages
from harness.servers import CPU_SHARED_ARGS, STOCK, bench_model, build_side
from harness.workloads import _system, _user

PAGES = 8
IMAGE_SIZE = 448  # 256 tokens a page on the bench model
SEED = 7_100
QUESTION = "What do these pages say?"
# (name, mode, budget, extra flags, questions: None = all, or how many); the exact
# side shows equal tokens on one question (it is slower than stock, not the point).
SIDES = (
    ("stock SGLang", STOCK, 0.1, (), None),
    ("sgl_mmkv conduit 0.1", "conduit", 0.1, (), None),
    ("sgl_mmkv conduit 1.0, gate off", "conduit", 1.0, ("--mm-reuse-gate", "always"), 1),
)


@dataclass(slots=True)
class SpeedSide:
    """One side's figures: TTFT per query (ms), the tokens it answered, its reuse."""

    name: str
    command: str
    ttft_ms: list[float]
    answers: list[str]
    reused_tokens: int = 0
    refreshed_tokens: int = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttft_ms)


def doc_messages(system: str, order: list[int]) -> list[dict]:
    return [_system(system), _user(QUESTION, [SEED + p for p in order], IMAGE_SIZE)]


def queries(count: int) -> list[list[dict]]:
    """``count`` doc-QA questions: each a new system prompt, the pages reordered."""
    rng = random.Random(SEED)
    out = []
    for i in range(count):
        order = rng.sample(range(PAGES), PAGES)
        out.append(doc_messages(f"Question {i}: answer from the document. Ticket {i:04d}.", order))
    return out


def run_side(
    name: str, mode: str, budget: float, extra: tuple, asked: int | None, log_dir: Path, count: int
) -> SpeedSide:
    shared = [*CPU_SHARED_ARGS.split(), "--enable-metrics", *extra]
    side = build_side(mode, bench_model(), shared, log_dir, budget, log_suffix=f"-{budget}")
    command = "python " + " ".join(side.process.command[1:])
    print(f"[demo] $ {command}", flush=True)
    ttft, answers = [], []
    with side.process:
        chat_with_meta(side.base_url, doc_messages("Read this document.", list(range(PAGES))), 1)
        before = side.mmkv_stats().get("refresh", {})
        for messages in queries(count)[:asked]:
            reply = chat_with_meta(side.base_url, messages, max_tokens=4)
            ttft.append(request_stages(reply.meta)["ttft"])
            answers.append(reply.text)
        after = side.mmkv_stats().get("refresh", {})
    reused = after.get("reused_tokens", 0) - before.get("reused_tokens", 0)
    refreshed = after.get("refreshed_tokens", 0) - before.get("refreshed_tokens", 0)
    return SpeedSide(name, command, ttft, answers, reused, refreshed)


def table(sides: list[SpeedSide]) -> str:
    stock = sides[0]
    lines = [
        "| server | TTFT ms, median (min-max) | speed-up | reused image tokens "
        "| refreshed | tokens equal to stock's |",
        "|---|---|---|---|---|---|",
    ]
    for side in sides:
        equal = sum(a == b for a, b in zip(side.answers, stock.answers, strict=False))
        lines.append(
            f"| {side.name} | {side.median_ms:,.0f} ({min(side.ttft_ms):,.0f}-"
            f"{max(side.ttft_ms):,.0f}) | {stock.median_ms / side.median_ms:.2f}x "
            f"| {side.reused_tokens:,} | {side.refreshed_tokens:,} "
            f"| {equal} of {len(side.answers)} |"
        )
    return "\n".join(lines)


def plot(sides: list[SpeedSide], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 2.8))
    names = [s.name for s in sides][::-1]
    seconds = [s.median_ms / 1e3 for s in sides][::-1]
    ax.barh(names, seconds, color=["#4c72b0", "#55a868", "#c44e52"][: len(sides)][::-1])
    for y, value in enumerate(seconds):
        ax.text(value, y, f" {value:.2f} s", va="center")
    ax.set_xlabel(f"median TTFT (s), doc-QA over {PAGES} pages of 256 tokens")
    ax.set_xlim(0, max(seconds) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, count: int) -> list[SpeedSide]:
    """Every side, one at a time; the table, a TTFT bar plot and JSON in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sides = [run_side(*spec, out_dir, count) for spec in SIDES]
    text = table(sides)
    (out_dir / "demo_speed.md").write_text(text + "\n")
    (out_dir / "demo_speed.json").write_text(json.dumps([asdict(s) for s in sides], indent=1))
    plot(sides, out_dir / "demo_speed.png")
    print(text)
    return sides
