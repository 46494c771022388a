"""``python -m harness.demo``: one conversation's images come back under new system
prompts, then in a new order; stock SGLang and sgl_mmkv answer side by side.

Serves the committed page-sized model (``models/fidelity-qwen2-vl-page``, a tiny
Qwen2-VL trained in-repo whose images are 224 x 224 pixels, 64 tokens each, and
whose answers depend on the order the images came in) with stock
``sglang.launch_server`` and then with ``sgl_mmkv.launch_server --mm-reuse
staleprobe --mm-refresh-budget auto`` at its default cost gate, one server at a
time. Each side first reads the images under one system prompt, then is asked the
question under ``--repeats`` other system prompts (same image order: stock reuses
no image KV, the prefix changed; sgl_mmkv reuses every image and its probe finds
them fresh), then once more with the images reversed (stale for this model: each
image would be probed and possibly refreshed whole, which bounds the request above a
full prefill, so the cost gate serves it as stock). It prints each answer, the
cached / reused / refreshed token counts and, from SGLang's own request timestamps
(``--enable-metrics`` on both sides, ``return_meta_info``), the median time to first
token and its two largest stages: the tokenizer's (image loading, processing and
hashing, the same work on both sides) and the prefill forward (what reuse shortens).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.fidelity_task import NEXT_QUESTIONS, Example, answer_of
from harness.meta_info import chat_with_meta, request_stages

DEFAULT_MODEL = Path("models/fidelity-qwen2-vl-page")  # from the repository root
FIRST_SYSTEM = "You are shown an album of pictures. Look at them carefully."
NEW_SYSTEMS = (
    "You answer questions about the images in few words.",
    "Answer briefly, looking at the pictures.",
    "You are a careful assistant for photo albums.",
    "Reply with the answer only.",
    "The user shows you pictures again; answer about them.",
)
REVERSED_SYSTEM = "You are shown the same pictures in another order."
# the project's safe setting (docs/fidelity.md "A budget that adapts"), default gate
NEXT_QUESTIONS_TEXT = frozenset(NEXT_QUESTIONS.values())
MMKV_FLAGS = ("--mm-reuse", "staleprobe", "--mm-refresh-budget", "auto", "--mm-report-reuse")


@dataclass(slots=True)
class Turn:
    """What one side answered to the question turn, and its stages in ms."""

    answer: str
    ttft_ms: float  # request received to first token, by the server's clock
    tokenizer_ms: float  # received to dispatched to the scheduler
    prefill_ms: float  # forward entry to prefill finished
    prompt_tokens: int
    cached_tokens: int
    reused_tokens: int = 0
    refreshed_tokens: int = 0
    declined_reuses: int = 0  # image matches the cost gate served as stock


def _ask(base_url: str, messages: list[dict]) -> Turn:
    """One greedy reply with SGLang's request timestamps (the reuse counts are filled
    in from the server's counters by the caller)."""
    reply = chat_with_meta(base_url, messages, max_tokens=8, timeout_s=600)
    stages = request_stages(reply.meta)
    return Turn(
        answer=reply.text,
        ttft_ms=stages["ttft"],
        tokenizer_ms=stages["tokenizer"],
        prefill_ms=stages["prefill_forward"],
        prompt_tokens=int(reply.meta["prompt_tokens"]),
        cached_tokens=int(reply.meta.get("cached_tokens") or 0),
    )


def _serve(
    module: str,
    model: Path,
    flags: tuple[str, ...],
    album: list[dict],
    questions: dict[str, list[list[dict]]],
) -> tuple[dict[str, list[Turn]], str]:
    """Serve ``album`` once, then every question; ``{kind: [Turn, ...]}`` and the
    server's command line. Each turn's reuse counts are its counter deltas."""
    from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess, mmkv_stats

    server = ServerProcess(module, model, [*CPU_SERVER_ARGS, "--enable-metrics", *flags])
    command = "python " + " ".join(server.command[1:])
    print(f"[demo] $ {command}", flush=True)
    turns: dict[str, list[Turn]] = {}
    with server:
        _ask(server.base_url, album)  # the album is read once
        for kind, asked in questions.items():
            for messages in asked:
                before = mmkv_stats(server.base_url).get("refresh", {})
                turn = _ask(server.base_url, messages)
                after = mmkv_stats(server.base_url).get("refresh", {})
                for key in ("reused_tokens", "refreshed_tokens", "declined_reuses"):
                    setattr(turn, key, after.get(key, 0) - before.get(key, 0))
                turns.setdefault(kind, []).append(turn)
    return turns, command


def _table(sides: list[tuple[str, dict[str, list[Turn]]]], expected: dict[str, str]) -> str:
    """One row per server and question kind: the answers, the first turn's token
    counts and the medians over that kind's turns; ``expected``: each kind's answer."""
    head = (
        "| question | server | answers | prompt tokens | cached | reused image | refreshed "
        "| declined by the gate | TTFT ms, median (min-max) | tokenizer ms | prefill forward ms |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    kinds = list(sides[0][1])
    for kind in kinds:
        for name, turns in sides:
            asked = turns[kind]
            right = sum(t.answer.lower().startswith(expected[kind].lower()) for t in asked)
            times = [t.ttft_ms for t in asked]
            first = asked[0]
            lines.append(
                f"| {kind} | {name} | {first.answer!r} ({right} of {len(asked)} right) "
                f"| {first.prompt_tokens} | {first.cached_tokens} | {first.reused_tokens} "
                f"| {first.refreshed_tokens} | {first.declined_reuses} "
                f"| {statistics.median(times):.0f} ({min(times):.0f}-{max(times):.0f}) "
                f"| {statistics.median(t.tokenizer_ms for t in asked):.0f} "
                f"| {statistics.median(t.prefill_ms for t in asked):.0f} |"
            )
    return "\n".join(lines)


def _reversed_answer(example: Example) -> str:
    """The answer once the images are reversed: a ``next`` question asks about the
    image after the dotted one, which the reversal changes."""
    images = example.images[::-1]
    dotted = next((i for i, image in enumerate(images) if image.marked), None)
    if example.question not in NEXT_QUESTIONS_TEXT or dotted is None:
        return example.answer
    if dotted + 1 == len(images):
        return "(none: the dotted image is last)"
    return answer_of(images[dotted + 1], example.qtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--example", type=int, default=3, help="test example index")
    parser.add_argument("--num-images", type=int, default=4)
    parser.add_argument(
        "--repeats", type=int, default=5, help=f"new system prompts (at most {len(NEW_SYSTEMS)})"
    )
    parser.add_argument(
        "--speed-queries", type=int, default=2, help="doc-QA questions per side (0: no part 2)"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/demo"))
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").exists():
        parser.error(
            f"no model at {args.model_path}: run from the repository root or pass --model-path"
        )
    if args.num_images < 2:
        parser.error("--num-images must be at least 2 (the question is about the image after one)")
    if not 1 <= args.repeats <= len(NEW_SYSTEMS):
        parser.error(f"--repeats must be 1 to {len(NEW_SYSTEMS)}, got {args.repeats}")

    from sgl_mmkv.cpu_support import prepare_cpu_process

    prepare_cpu_process()
    from harness.fidelity_task import chat_messages, make_example, model_image_side, model_style
    from sgl_mmkv.testing.images import image_part

    example = make_example(
        "test",
        args.example,
        num_images=args.num_images,
        style=model_style(args.model_path),
        image_side=model_image_side(args.model_path),
    )
    n = len(example.images)
    album = chat_messages(example, image_part, system=FIRST_SYSTEM)
    album[-1]["content"][-1] = {"type": "text", "text": "Remember these pictures."}
    reversed_order = list(range(n))[::-1]
    questions = {
        "new system prompt": [
            chat_messages(example, image_part, system=system)
            for system in NEW_SYSTEMS[: args.repeats]
        ],
        "images reversed": [
            chat_messages(example, image_part, system=REVERSED_SYSTEM, order=reversed_order)
        ],
    }
    print(f"[demo] {n} images, read once under one system prompt; then asked under")
    print(f"[demo] {args.repeats} other system prompts, then once with the images reversed:")
    expected = {"new system prompt": example.answer, "images reversed": _reversed_answer(example)}
    print(f"[demo] {example.question!r} (expected: {expected})")

    started = time.monotonic()
    stock, stock_cmd = _serve("sglang.launch_server", args.model_path, (), album, questions)
    mmkv, mmkv_cmd = _serve("sgl_mmkv.launch_server", args.model_path, MMKV_FLAGS, album, questions)
    print()
    print(_table([("stock SGLang", stock), ("sgl_mmkv staleprobe auto", mmkv)], expected))
    print()
    print(f"stock:    {stock_cmd}\nsgl_mmkv: {mmkv_cmd}")
    print(
        "[demo] Stock caches only the shared "
        "chat-template tokens; sgl_mmkv reuses every image's KV under a new prefix. Where "
        "the images come back in another order every one of them is probed and may need a "
        "whole refresh; that bound costs more than a full prefill, so the cost gate serves "
        "the request as stock."
    )
    if args.speed_queries > 0:
        from harness import demo_speed

        print(
            f"\n[demo] part 2: the speed-up where image prefill dominates (bench model, "
            f"random weights, {demo_speed.PAGES} pages of 256 tokens, one server at a time)"
        )
        demo_speed.run(args.out_dir, args.speed_queries)
        print(f"[demo] table, plot and JSON in {args.out_dir}")
    print(f"[demo] done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
