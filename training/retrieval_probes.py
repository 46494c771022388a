"""Learning curves of the fidelity task's variants: which part of retrieval fails to train.

    python -m training.retrieval_probes --out-dir training/results/retrieval-probes

Trains the fidelity model (``FIDELITY_SPEC``, random init, same seed) from scratch
once per variant, with an image-count curriculum up to ``--max-images``, and
records teacher-forced validation accuracy on prompts of exactly ``--max-images``
images every ``--eval-every`` steps:

- ``keyed``: the committed task ("What colour is the shape on the navy
  background?"): the question's words pick the image;
- ``keyed-text``: the same prompts with each image written as text ("a red
  circle on navy"): no vision tower, so a failure here is the decoder's;
- ``marked``: the target image's shape carries a dot and the question asks about
  "the dotted shape": the image is picked by what it shows, whatever the words;
- ``kind``: keyed, shape-kind questions only; with ``--max-images 1`` it asks
  whether the vision tower learns shapes at all (no retrieval involved).

``no-retrieval chance`` is what a model that reads every image but cannot pick
one would score: the mean over validation prompts of 1 / (distinct candidate
answers in the prompt). Variants run in ``--jobs`` processes of one thread each.
Writes ``retrieval_probes.json``, ``retrieval_probes.md`` and ``retrieval_probes.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.fidelity_task import Example, answer_of, make_example
from sgl_mmkv.testing.make_tiny_model import build_untrained, save_checkpoint
from training.pretrain_vision import pretrain_vision
from training.train_fidelity_model import (
    FIDELITY_SPEC,
    answer_accuracy,
    collate,
    draw_examples,
    image_cap,
    make_optimizer,
    training_step,
)


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of posing the task: its question style, images as pixels or text, and
    optionally a single question type."""

    style: str
    as_text: bool
    qtype: str | None = None


VARIANTS = {
    "keyed": Variant("keyed", as_text=False),
    "keyed-text": Variant("keyed", as_text=True),
    "marked": Variant("marked", as_text=False),
    "kind": Variant("keyed", as_text=False, qtype="kind"),
}


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    steps: int
    batch_size: int
    lr: float
    curriculum_steps: int
    max_images: int
    eval_every: int
    num_validation: int
    seed: int
    vision_pretrain_steps: int = 0


def validation_set(variant: Variant, config: ProbeConfig) -> list[Example]:
    return [
        make_example(
            "validation",
            i,
            num_images=config.max_images,
            qtype=variant.qtype,
            style=variant.style,
        )
        for i in range(config.num_validation)
    ]


def no_retrieval_chance(examples: list[Example]) -> float:
    """Mean of 1 / (distinct values of the asked attribute among the prompt's images)."""

    distinct = [len({answer_of(image, e.qtype) for image in e.images}) for e in examples]
    return sum(1 / n for n in distinct) / len(examples)


def run_probe(name: str, config: ProbeConfig) -> dict:
    """Train one variant from scratch; its learning curve and timing."""
    from transformers import AutoProcessor

    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    variant = VARIANTS[name]
    model, tokenizer = build_untrained("qwen2_vl", FIDELITY_SPEC, config.seed)
    with tempfile.TemporaryDirectory() as staging:
        save_checkpoint(model, tokenizer, "qwen2_vl", FIDELITY_SPEC, Path(staging))
        processor = AutoProcessor.from_pretrained(staging)
    validation = validation_set(variant, config)
    vision_pretrain = None
    if config.vision_pretrain_steps > 0:
        vision_pretrain = pretrain_vision(
            model, processor, config.vision_pretrain_steps, seed=config.seed
        )
    optimizer, schedule = make_optimizer(model, config.lr, config.steps)
    rng = random.Random(config.seed)
    model.train()
    started = time.monotonic()
    curve = []
    for step in range(1, config.steps + 1):
        cap = min(config.max_images, image_cap(step, config.curriculum_steps))
        examples = draw_examples(rng, config.batch_size, cap, variant.style, variant.qtype)
        batch = collate(processor, examples, rng, as_text=variant.as_text)
        loss = training_step(model, batch, optimizer, schedule)
        if step % config.eval_every == 0 or step == config.steps:
            accuracy = answer_accuracy(model, processor, validation, as_text=variant.as_text)
            curve.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "val_acc": round(accuracy, 4),
                    "s": round(time.monotonic() - started),
                }
            )
            print(json.dumps({"variant": name, **curve[-1]}), flush=True)
    return {
        "variant": name,
        "style": variant.style,
        "as_text": variant.as_text,
        "qtype": variant.qtype,
        "vision_pretrain": vision_pretrain,
        "no_retrieval_chance": round(no_retrieval_chance(validation), 4),
        "final_val_acc": curve[-1]["val_acc"],
        "best_val_acc": max(point["val_acc"] for point in curve),
        "train_seconds": curve[-1]["s"],
        "curve": curve,
    }


def _run(args: tuple[str, ProbeConfig]) -> dict:
    return run_probe(*args)


def markdown(results: list[dict], config: ProbeConfig) -> str:
    steps = sorted({p["step"] for r in results for p in r["curve"]})
    marks = sorted(set(steps[:: max(1, len(steps) // 6)]) | {steps[-1]})
    head = " | ".join(f"step {m}" for m in marks)
    lines = [
        f"Teacher-forced validation accuracy on {config.num_validation} prompts of "
        f"{config.max_images} images (batch {config.batch_size}, lr {config.lr}, "
        f"curriculum {config.curriculum_steps} steps per image, "
        f"{config.vision_pretrain_steps} vision pretraining steps).",
        "",
        f"| variant | no-retrieval chance | {head} | best | seconds |",
        "|---|---|" + "---|" * len(marks) + "---|---|",
    ]
    for r in results:
        by_step = {p["step"]: p["val_acc"] for p in r["curve"]}
        cells = " | ".join(f"{by_step[m]:.3f}" if m in by_step else "" for m in marks)
        lines.append(
            f"| {r['variant']} | {r['no_retrieval_chance']:.3f} | {cells} | "
            f"{r['best_val_acc']:.3f} | {r['train_seconds']} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], config: ProbeConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        line = ax.plot(
            [p["step"] for p in r["curve"]], [p["val_acc"] for p in r["curve"]], label=r["variant"]
        )
        ax.axhline(r["no_retrieval_chance"], ls=":", color=line[0].get_color(), lw=1)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"validation accuracy ({config.max_images} images)")
    ax.set_ylim(0, 1)
    ax.set_title("Retrieval probes (dotted: no-retrieval chance)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="keyed,keyed-text,marked")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--curriculum-steps", type=int, default=300, help="steps per extra image")
    parser.add_argument("--max-images", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--num-validation", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vision-pretrain-steps", type=int, default=0, help="attribute pretraining first"
    )
    parser.add_argument("--jobs", type=int, default=2, help="variants trained at once")
    parser.add_argument("--out-dir", type=Path, default=Path("retrieval-probes"))
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if not 1 <= args.max_images <= 8:
        parser.error("--max-images must be in [1, 8]")
    config = ProbeConfig(
        args.steps,
        args.batch_size,
        args.lr,
        args.curriculum_steps,
        args.max_images,
        args.eval_every,
        args.num_validation,
        args.seed,
        args.vision_pretrain_steps,
    )
    context = multiprocessing.get_context("spawn")
    with context.Pool(max(1, min(args.jobs, len(names)))) as pool:
        results = pool.map(_run, [(name, config) for name in names])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(results, config)
    (args.out_dir / "retrieval_probes.json").write_text(
        json.dumps({"config": asdict(config), "results": results}, indent=2) + "\n"
    )
    (args.out_dir / "retrieval_probes.md").write_text(table)
    plot(results, config, args.out_dir / "retrieval_probes.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
