"""``make ask`` (``python -m harness.ask``): ask the server ``make serve`` started a
question its model answers, under two system prompts, and show the reuse.

The committed model answers questions about pictures of coloured shapes. This
sends two of its task's images with the task's question, first under one system
prompt, then under another. Stock SGLang reuses nothing of the second request but
the shared chat-template tokens (its prefix changed before the images); sgl_mmkv
reuses both images' KV. It prints each answer beside the expected one, the prompt
tokens, the tokens SGLang's radix cache matched, and the second request's reuse
facts (``meta_info["sgl_mmkv"]``, which ``make serve`` turns on with
``--mm-report-reuse``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.fidelity_task import chat_messages, make_example, model_image_side, model_style
from harness.meta_info import chat_with_meta

SYSTEMS = (
    "You answer questions about the images in few words.",
    "You are a careful assistant. Look at the pictures and reply briefly.",
)


def reuse_facts(meta: dict) -> dict:
    """The request's sgl_mmkv facts summed over its entries (one per prefill chunk)."""
    total: dict = {}
    for entry in meta.get("sgl_mmkv") or []:
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model-path", type=Path, default=Path("models/fidelity-qwen2-vl-marked"))
    parser.add_argument("--example", type=int, default=1, help="test example index")
    args = parser.parse_args(argv)
    from sgl_mmkv.testing.images import image_part

    example = make_example(
        "test",
        args.example,
        num_images=2,
        style=model_style(args.model_path),
        image_side=model_image_side(args.model_path),
    )
    base_url = f"http://{args.host}:{args.port}"
    print(f"[ask] two images and the question {example.question!r}")
    print(f"[ask] expected answer: {example.answer!r}")
    right = 0
    for turn, system in enumerate(SYSTEMS, start=1):
        messages = chat_messages(example, image_part, system=system)
        try:
            reply = chat_with_meta(base_url, messages, max_tokens=8, timeout_s=300)
        except OSError as error:
            print(f"[ask] no server at {base_url} ({error.__class__.__name__}): run `make serve`")
            return 1
        facts = reuse_facts(reply.meta)
        right += reply.text.lower().startswith(example.answer.lower())
        print(
            f"[ask] {turn}. system {system!r}\n"
            f"       answer {reply.text!r}; prompt tokens {reply.meta.get('prompt_tokens')}, "
            f"matched by the radix cache {reply.meta.get('cached_tokens', 0)}"
        )
        if turn == 2:
            if not facts:
                print("       (no reuse facts: start the server with --mm-report-reuse)")
            else:
                print(
                    f"       image tokens reused under the new prefix "
                    f"{facts.get('reused_tokens', 0)}, refreshed "
                    f"{facts.get('refreshed_tokens', 0)} (stock SGLang: 0 reused)"
                )
    print(f"[ask] {right} of {len(SYSTEMS)} answers right")
    return 0 if right == len(SYSTEMS) else 2


if __name__ == "__main__":
    sys.exit(main())
