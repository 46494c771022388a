"""Measure the trained fidelity model: full-prefill accuracy through a real SGLang
server, and where its attention to images goes.

    python -m training.evaluate_fidelity_model --model-path models/fidelity-qwen2-vl

Writes ``accuracy.json`` beside the checkpoint: test-split exact-match accuracy
(overall, per question type, per image count), the accuracy on the fixed subset
the test suite re-checks, and the attention report (share of the last prompt
token's attention on the named image against that image's share of the visual
tokens). With ``--staleness``, also the accuracy of plain reuse (refresh budget 0)
in each reuse scenario, through ``python -m sgl_mmkv.launch_server --mm-reuse reuse``:
how much stale image KV costs this model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from harness.fidelity_task import (
    Example,
    chat_messages,
    fidelity_pool_tokens,
    model_split,
    score,
)
from sgl_mmkv.testing.images import image_part

SUBSET_SIZE = 32  # test[0:32], re-checked by tests/test_fidelity_model.py


def full_prefill_answers(base_url: str, examples: list[Example], max_tokens: int = 6) -> list[str]:
    """Greedy answers, each served cold (radix cache flushed first)."""
    from harness.fidelity import FidelityClient

    client = FidelityClient(base_url, max_tokens=max_tokens)
    answers = []
    for example in examples:
        client.flush()
        answers.append(client.chat(chat_messages(example, image_part)).text)
    return answers


def accuracy_report(examples: list[Example], answers: list[str]) -> dict:
    by_type: dict[str, list[bool]] = defaultdict(list)
    by_count: dict[int, list[bool]] = defaultdict(list)
    hits = []
    for example, answer in zip(examples, answers, strict=True):
        ok = score(answer, example.answer)
        hits.append(ok)
        by_type[example.qtype].append(ok)
        by_count[len(example.images)].append(ok)
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return {
        "n": len(hits),
        "accuracy": mean(hits),
        "subset_accuracy": mean(hits[:SUBSET_SIZE]),
        "per_qtype": {k: mean(v) for k, v in sorted(by_type.items())},
        "per_num_images": {k: mean(v) for k, v in sorted(by_count.items())},
    }


@torch.no_grad()
def attention_report(model_path: str, examples: list[Example]) -> dict:
    """Mean share of the last prompt token's attention (all layers and heads, over
    visual tokens only) that lands on the named image, against the share that
    image has of the visual tokens (what uniform attention would give)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    model = AutoModelForImageTextToText.from_pretrained(
        model_path, attn_implementation="eager"
    ).eval()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    shares, uniform = [], []
    for example in examples:
        if len(example.images) < 2:
            continue
        messages = chat_messages(example, lambda _im: {"type": "image"})
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        images = [im.render() for im in example.images]
        inputs = processor(text=[text], images=images, return_tensors="pt")
        out = model(**inputs, output_attentions=True)
        is_image = inputs["input_ids"][0] == pad
        image_index = (
            torch.cumsum(
                (
                    inputs["input_ids"][0]
                    == processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
                ).long(),
                dim=0,
            )
            - 1
        )
        target = is_image & (image_index == example.target)
        last = torch.stack([a[0, :, -1] for a in out.attentions])  # (layers, heads, seq)
        on_images = last[..., is_image].sum(-1)
        shares.append((last[..., target].sum(-1) / on_images).mean().item())
        uniform.append(target.sum().item() / is_image.sum().item())
    return {
        "n": len(shares),
        "named_image_attention_share": round(sum(shares) / len(shares), 4),
        "uniform_share": round(sum(uniform) / len(uniform), 4),
    }


STALE_SCENARIOS = ("reordered", "image_prefix", "turn_reordered", "changed_prefix", "multi_turn")


def staleness_report(
    model_path: Path,
    examples: list[Example],
    scenarios: tuple[str, ...] = STALE_SCENARIOS,
    concurrency: int = 8,
) -> dict[str, dict[str, float]]:
    """Per reuse scenario: full-prefill accuracy and the accuracy of plain reuse (refresh
    budget 0) through an sgl_mmkv server, on ``examples`` and on the test subset."""
    from harness.fidelity import FidelityClient, PromptLayout, measure
    from harness.fidelity_summary import summarise
    from sgl_mmkv.testing.server import ServerProcess, cpu_server_args

    pool = fidelity_pool_tokens(model_path, concurrency)
    flags = ["--mm-reuse", "reuse", *cpu_server_args(pool)]
    with ServerProcess("sgl_mmkv.launch_server", model_path, flags) as server:
        client, layout = FidelityClient(server.base_url), PromptLayout(str(model_path))
        records = measure(client, layout, examples, scenarios, concurrency=concurrency)
    subset = {e.uid() for e in examples[:SUBSET_SIZE]}
    report = {}
    for summary in summarise("reuse", records, 0.0):
        mine = [r for r in records if r.scenario == summary.scenario and r.uid in subset]
        report[summary.scenario] = {
            "full": round(summary.full_prefill_accuracy, 4),
            "reuse": round(summary.accuracy, 4),
            "reuse_95ci": summary.accuracy_ci,
            "subset_full": round(sum(r.reference_correct for r in mine) / len(mine), 4),
            "subset_reuse": round(sum(r.probe_correct for r in mine) / len(mine), 4),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--num-examples", type=int, default=200)
    parser.add_argument(
        "--staleness",
        action="store_true",
        help="also measure plain reuse (budget 0) per reuse scenario through sgl_mmkv",
    )
    args = parser.parse_args(argv)

    from sgl_mmkv.cpu_support import prepare_cpu_process
    from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess

    prepare_cpu_process()
    examples = model_split(args.model_path, "test", args.num_examples)
    with ServerProcess("sglang.launch_server", args.model_path, CPU_SERVER_ARGS) as server:
        answers = full_prefill_answers(server.base_url, examples)
    report = {
        "served_by": "python -m sglang.launch_server (stock), full prefill, greedy",
        "split": f"test[0:{args.num_examples}]",
        "subset": f"test[0:{SUBSET_SIZE}]",
        **accuracy_report(examples, answers),
        "attention": attention_report(str(args.model_path), examples[:64]),
    }
    if args.staleness:
        report["staleness"] = staleness_report(args.model_path, examples)
    (args.model_path / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
