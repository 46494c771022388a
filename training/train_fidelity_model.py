"""Train the tiny Qwen2-VL on the synthetic multi-image task (CPU, or a GPU).

    python -m training.train_fidelity_model --out models/fidelity-qwen2-vl-marked \
        --style marked --vision-pretrain-steps 300 --steps 3000 --lr 1e-3 \
        --curriculum-steps 300 --follow-ups 0

(the recipe of the committed 95.5 % model, 30 min on 2 cores). The keyed style's
recipe (``models/fidelity-qwen2-vl``, 35.5 %) is in its ``training.json``.

On a GPU (``--device cuda``) the batches are drawn and rendered by ``--workers``
data-loader processes, each with its own seeded stream.

The result is a normal checkpoint directory (see make_tiny_model) plus
``training.json`` with the recipe and the validation accuracy reached.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from harness.fidelity_task import (
    MAX_IMAGES,
    QUESTION_STYLES,
    QUESTION_TYPES,
    SYSTEM_PROMPT,
    Example,
    ask,
    chat_messages,
    make_example,
)
from sgl_mmkv.testing.make_tiny_model import TinyModelSpec, build_untrained, save_checkpoint
from training.pretrain_vision import pretrain_vision

FIDELITY_SPEC = TinyModelSpec(
    hidden_size=192,
    intermediate_size=512,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    vision_depth=2,
    vision_width=96,
    vision_heads=4,
    initializer_range=0.02,
    max_pixels=112 * 112,
    min_pixels=112 * 112,
)
ALT_SYSTEM_PROMPTS = (
    SYSTEM_PROMPT,
    "You are a helpful assistant.",
    "Look carefully at every picture before you answer.",
)
PREAMBLES = (None, None, "Here are some pictures.", "I took these photos today.")


def _local_image_part(_image) -> dict:
    return {"type": "image"}


def render_training_text(
    processor, example: Example, rng: random.Random, follow_ups: int = 0, as_text: bool = False
) -> tuple[str, list[tuple[int, int]], list]:
    """(full text, answer spans, images in prompt order) for one example.

    The conversation is the example's question and answer, then ``follow_ups`` more
    user questions about the same images, each with its answer: one image encoding
    buys several retrieval targets. Each span is ``(start, end)`` in characters of
    the full text: an answer plus its closing ``<|im_end|>\n``. ``as_text`` writes
    each image as its description (the text-only control; no images returned)."""
    if follow_ups and any(image.marked for image in example.images):
        raise ValueError("follow-up questions are keyed; a marked example has one target")
    order = list(range(len(example.images)))
    if rng.random() < 0.5:
        rng.shuffle(order)
    messages = chat_messages(
        example,
        _local_image_part,
        system=rng.choice(ALT_SYSTEM_PROMPTS),
        preamble=rng.choice(PREAMBLES),
        order=order,
        as_text=as_text,
    )
    answers = [example.answer]
    for _ in range(follow_ups):
        question, answer = ask(
            example.images, rng.randrange(len(example.images)), rng.choice(QUESTION_TYPES)
        )
        messages += [
            {"role": "assistant", "content": answers[-1]},
            {"role": "user", "content": question},
        ]
        answers.append(answer)
    spans, full = [], ""
    for turn, answer in enumerate(answers):
        prompt = processor.apply_chat_template(messages[: 2 + 2 * turn], add_generation_prompt=True)
        if not prompt.startswith(full):
            raise AssertionError("chat template is not prefix-stable across turns")
        full = prompt + answer + "<|im_end|>\n"
        spans.append((len(prompt), len(full)))
    images = [] if as_text else [example.images[i].render() for i in order]
    return full, spans, images


def collate(
    processor,
    examples: list[Example],
    rng: random.Random,
    follow_ups: int = 0,
    as_text: bool = False,
) -> dict:
    """A padded batch whose labels are the answer tokens (each with its closing
    ``<|im_end|>\n``) only. The byte-level pre-tokenizer splits at the newline that
    ends each prompt, so a prefix of the text tokenizes to a prefix of the tokens;
    every image's one pad expands to the processor's tokens per image before the answers
    (counted in the processed row, so any image size labels right)."""
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    fulls, images, row_spans, row_images = [], [], [], []
    for example in examples:
        full, spans, ims = render_training_text(processor, example, rng, follow_ups, as_text)
        fulls.append(full)
        images.extend(ims)
        row_images.append(len(ims))
        row_spans.append(
            [
                (len(tokenizer(full[:start])["input_ids"]), len(tokenizer(full[:end])["input_ids"]))
                for start, end in spans
            ]
        )
    batch = processor(text=fulls, images=images or None, return_tensors="pt", padding=True)
    labels = torch.full_like(batch["input_ids"], -100)
    for row, spans in enumerate(row_spans):
        shift = int((batch["input_ids"][row] == pad).sum()) - row_images[row]
        for start, end in spans:
            first, last = start + shift, end + shift
            labels[row, first:last] = batch["input_ids"][row, first:last]
        if spans[-1][1] + shift != int(batch["attention_mask"][row].sum()):
            raise AssertionError("answer spans do not end at the row's last token")
    batch["labels"] = labels
    return batch


class TrainingBatches(torch.utils.data.IterableDataset):
    """Endless collated training batches, for data-loader workers: worker ``w`` of
    ``W`` draws from ``Random(seed * 1000 + w)`` and counts its ``i``-th batch as
    step ``i * W + w`` for the image-count curriculum."""

    def __init__(
        self,
        processor,
        batch_size: int,
        seed: int,
        curriculum_steps: int,
        follow_ups: int,
        style: str = "keyed",
    ) -> None:
        self.processor = processor
        self.batch_size = batch_size
        self.seed = seed
        self.curriculum_steps = curriculum_steps
        self.follow_ups = follow_ups
        self.style = style

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = random.Random(self.seed * 1000 + worker)
        step = worker
        while True:
            step += workers
            cap = image_cap(step, self.curriculum_steps)
            examples = draw_examples(rng, self.batch_size, cap, self.style)
            yield collate(self.processor, examples, rng, self.follow_ups)


def image_cap(step: int, curriculum_steps: int) -> int:
    """Most images per training prompt at ``step`` (the curriculum)."""
    if curriculum_steps <= 0:
        return MAX_IMAGES
    return min(MAX_IMAGES, 1 + step // curriculum_steps)


def draw_examples(
    rng: random.Random,
    batch_size: int,
    cap: int,
    style: str = "keyed",
    qtype: str | None = None,
) -> list[Example]:
    """``batch_size`` training examples of 1 to ``cap`` images (``qtype``: one question type)."""
    return [
        make_example("train", rng.randrange(10**9), rng.randint(1, cap), qtype=qtype, style=style)
        for _ in range(batch_size)
    ]


def make_optimizer(model, lr: float, steps: int):
    """AdamW (weight decay 0.01) under a one-cycle schedule of ``steps`` steps, over
    the parameters that train (a frozen vision tower's are left out)."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=steps, pct_start=min(0.3, max(0.05, 2.5 / steps))
    )
    return optimizer, schedule


def training_step(model, batch, optimizer, schedule) -> torch.Tensor:
    """One optimiser step on ``batch`` (gradients clipped to norm 1); returns the loss."""
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return loss.detach()


@torch.no_grad()
def answer_accuracy(
    model, processor, examples: list[Example], batch_size: int = 16, as_text: bool = False
) -> float:
    """Teacher-forced exact match: every answer token is the argmax (fast proxy)."""
    model.eval()
    rng = random.Random(0)
    correct = 0
    for start in range(0, len(examples), batch_size):
        batch = collate(processor, examples[start : start + batch_size], rng, as_text=as_text)
        batch = batch.to(model.device)
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1]
        target = labels[:, 1:]
        mask = target != -100
        hit = (logits.argmax(-1) == target) | ~mask
        correct += int(hit.all(dim=1).sum())
    model.train()
    return correct / len(examples)


def train(
    out: Path,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log_every: int = 50,
    init_from: Path | None = None,
    num_validation: int = 128,
    curriculum_steps: int = 0,
    follow_ups: int = 0,
    device: str = "cpu",
    workers: int = 0,
    style: str = "keyed",
    vision_pretrain_steps: int = 0,
) -> dict:
    """Train from random weights, or continue from the checkpoint ``init_from``.

    With ``curriculum_steps`` > 0 the image count is capped at
    ``1 + step // curriculum_steps`` (up to 8), so retrieval is learned on short
    prompts first. ``follow_ups`` extra questions per training row (validation
    asks one). ``style`` is the question style (``fidelity_task.QUESTION_STYLES``;
    recorded in ``training.json``, where the evaluation reads it).
    ``vision_pretrain_steps`` > 0 first trains the vision tower alone on the
    images' attributes (:mod:`training.pretrain_vision`). ``workers`` > 0
    draws batches in that many data-loader processes (:class:`TrainingBatches`); 0
    draws them in this process from ``seed``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    earlier: list[dict] = []
    spec = FIDELITY_SPEC
    if init_from is not None:
        model = AutoModelForImageTextToText.from_pretrained(init_from).to(torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(init_from)
        record_path = Path(init_from) / "training.json"
        if record_path.exists():
            record = json.loads(record_path.read_text())
            earlier = record.get("phases", [])
            # the checkpoint's own sizes (its image side above all), not the default's
            known = {f.name for f in fields(TinyModelSpec)}
            sizes = {k: v for k, v in record.get("spec", {}).items() if k in known}
            spec = replace(FIDELITY_SPEC, **sizes)
            spec = replace(spec, mrope_section=tuple(spec.mrope_section))
    else:
        model, tokenizer = build_untrained("qwen2_vl", FIDELITY_SPEC, seed)
    staging = save_checkpoint(model, tokenizer, "qwen2_vl", spec, out)
    processor = AutoProcessor.from_pretrained(staging)
    validation = [make_example("validation", i, style=style) for i in range(num_validation)]

    model.to(device)
    vision_pretrain = None
    if vision_pretrain_steps > 0:
        vision_pretrain = pretrain_vision(model, processor, vision_pretrain_steps, seed=seed)
    batches = None
    if workers > 0:
        loader = torch.utils.data.DataLoader(
            TrainingBatches(processor, batch_size, seed, curriculum_steps, follow_ups, style),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=4,
        )
        batches = iter(loader)
    optimizer, schedule = make_optimizer(model, lr, steps)
    model.train()
    started = time.monotonic()
    history = []
    for step in range(1, steps + 1):
        if batches is None:
            examples = draw_examples(rng, batch_size, image_cap(step, curriculum_steps), style)
            batch = collate(processor, examples, rng, follow_ups)
        else:
            batch = next(batches)
        loss = training_step(model, batch.to(device), optimizer, schedule)
        if step % log_every == 0 or step == steps:
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "s": round(time.monotonic() - started),
            }
            if step % (log_every * 4) == 0 or step == steps:
                entry["val_acc"] = answer_accuracy(model, processor, validation)
            history.append(entry)
            print(json.dumps(entry), flush=True)
    model.eval()
    model.to("cpu")
    save_checkpoint(model, tokenizer, "qwen2_vl", spec, out)
    phase = {
        "init_from": str(init_from) if init_from else None,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "curriculum_steps": curriculum_steps,
        "follow_ups": follow_ups,
        "style": style,
        "vision_pretrain": vision_pretrain,
        "device": device,
        "workers": workers,
        "train_seconds": round(time.monotonic() - started),
        "validation_teacher_forced_accuracy": history[-1].get("val_acc"),
        "history": history,
    }
    phases = [*earlier, phase]
    record = {
        "arch": "qwen2_vl",
        "spec": asdict(spec),
        "style": style,
        "total_steps": sum(p["steps"] for p in phases),
        "total_train_seconds": sum(p["train_seconds"] for p in phases),
        "validation_teacher_forced_accuracy": phase["validation_teacher_forced_accuracy"],
        "phases": phases,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--init-from", type=Path, help="continue from this checkpoint")
    parser.add_argument("--curriculum-steps", type=int, default=0, help="steps per extra image")
    parser.add_argument(
        "--follow-ups", type=int, default=3, help="extra questions per training row"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--workers", type=int, default=0, help="data-loader processes")
    parser.add_argument(
        "--style", choices=QUESTION_STYLES, default="keyed", help="how questions pick the image"
    )
    parser.add_argument(
        "--vision-pretrain-steps", type=int, default=0, help="attribute pretraining of the tower"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    record = train(
        args.out,
        args.steps,
        args.batch_size,
        args.lr,
        args.seed,
        args.log_every,
        args.init_from,
        curriculum_steps=args.curriculum_steps,
        follow_ups=args.follow_ups,
        style=args.style,
        vision_pretrain_steps=args.vision_pretrain_steps,
        device=args.device,
        workers=args.workers,
    )
    print(f"validation accuracy {record['validation_teacher_forced_accuracy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
