"""Supervised pretraining of the tiny Qwen2-VL's vision tower on the task's image attributes.

Trained only through the language model's answers, the tiny vision tower never
learns shape kinds: a 600-step run with one image per prompt and only "What shape
is ...?" questions answers the majority kind every time
(``python -m training.retrieval_probes --variants kind --max-images 1``). The same
tower with a linear head per attribute on its merged tokens learns kinds in about a
hundred steps. Real VLMs start from a pretrained vision encoder too; this stage
gives the tiny one what it must see before the language model learns to ask.

The heads read the ``(16, hidden)`` merged tokens of one image, flattened, so the
quadrant is decodable; they are discarded afterwards (the checkpoint is a plain
Qwen2-VL).
"""

from __future__ import annotations

import random
import time

import torch

from harness.fidelity_task import (
    BACKGROUNDS,
    COLOURS,
    KINDS,
    QUADRANTS,
    ShapeImage,
    make_example,
)

ATTRIBUTES: dict[str, int] = {
    "colour": len(COLOURS),
    "background": len(BACKGROUNDS),
    "kind": len(KINDS),
    "quadrant": len(QUADRANTS),
    "marked": 2,
}


def attribute_labels(images: list[ShapeImage]) -> dict[str, torch.Tensor]:
    """``{attribute: (N,) class indices}`` of ``images``."""
    colours = [name for name, _ in COLOURS]
    return {
        "colour": torch.tensor([colours.index(im.colour) for im in images]),
        "background": torch.tensor([im.background for im in images]),
        "kind": torch.tensor([KINDS.index(im.kind) for im in images]),
        "quadrant": torch.tensor([QUADRANTS.index(im.quadrant) for im in images]),
        "marked": torch.tensor([int(im.marked) for im in images]),
    }


SINGLE_IMAGE_STYLES = ("keyed", "marked")  # styles that can ask about one image


def draw_images(rng: random.Random, count: int, split: str = "train") -> list[ShapeImage]:
    """``count`` single images of ``split``, half of them marked."""
    return [
        make_example(
            split, rng.randrange(10**9), num_images=1, style=rng.choice(SINGLE_IMAGE_STYLES)
        ).images[0]
        for _ in range(count)
    ]


HEAD_READERS = ("flat", "attention")


class AttributeHeads(torch.nn.Module):
    """One linear classifier per attribute over an image's merged tokens, read
    ``flat`` (all tokens concatenated: an attribute may be spread over positions) or by
    ``attention`` (a learned query per attribute, softmax over the image's tokens, then
    the weighted mean: one attention head's reading, which is what the decoder can do;
    at 64 tokens per image a flat probe reads shape kinds the decoder never learns to)."""

    def __init__(self, hidden_size: int, tokens_per_image: int = 16, reader: str = "flat") -> None:
        super().__init__()
        if reader not in HEAD_READERS:
            raise ValueError(f"unknown reader {reader!r}; choose from {', '.join(HEAD_READERS)}")
        self.reader = reader
        width = hidden_size if reader == "attention" else tokens_per_image * hidden_size
        self.heads = torch.nn.ModuleDict(
            {name: torch.nn.Linear(width, classes) for name, classes in ATTRIBUTES.items()}
        )
        if reader == "attention":
            self.queries = torch.nn.Parameter(torch.randn(len(ATTRIBUTES), hidden_size) * 0.02)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``tokens``: ``(N, tokens_per_image, hidden)`` -> ``{attribute: (N, classes)}``."""
        if self.reader == "flat":
            flat = tokens.flatten(1)
            return {name: head(flat) for name, head in self.heads.items()}
        scale = tokens.shape[-1] ** -0.5
        weights = torch.einsum("nth,ah->nat", tokens, self.queries).mul(scale).softmax(-1)
        read = torch.einsum("nat,nth->nah", weights, tokens)  # (N, attributes, hidden)
        return {name: head(read[:, i]) for i, (name, head) in enumerate(self.heads.items())}


def merged_tokens(model, processor, images: list[ShapeImage]) -> torch.Tensor:
    """``(N, tokens per image, hidden)``: the vision tower's merged tokens (the decoder's
    image input; every image the processor's fixed size)."""
    encoded = processor.image_processor(images=[im.render() for im in images], return_tensors="pt")
    device = next(model.parameters()).device
    out = model.model.visual(
        encoded["pixel_values"].to(device), grid_thw=encoded["image_grid_thw"].to(device)
    )
    tokens = out.pooler_output if hasattr(out, "pooler_output") else out
    return tokens.reshape(len(images), -1, tokens.shape[-1])


@torch.no_grad()
def attribute_accuracy(model, processor, heads: AttributeHeads, images: list[ShapeImage]) -> dict:
    """Held-out accuracy per attribute."""
    logits = heads(merged_tokens(model, processor, images))
    labels = attribute_labels(images)
    return {
        name: round(float((logits[name].argmax(-1).cpu() == labels[name]).float().mean()), 4)
        for name in ATTRIBUTES
    }


def pretrain_vision(
    model,
    processor,
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    num_validation: int = 200,
    log_every: int = 50,
    reader: str = "flat",
) -> dict:
    """Train ``model``'s vision tower (and merger) with :class:`AttributeHeads` reading
    its tokens by ``reader`` for ``steps`` steps of ``batch_size`` single images; the
    language model is untouched. Returns the recipe and the held-out accuracy per
    attribute along the way."""
    rng = random.Random(seed * 7919 + 1)
    device = next(model.parameters()).device
    validation = draw_images(random.Random(seed * 7919 + 2), num_validation, split="validation")
    with torch.no_grad():
        tokens_per_image = merged_tokens(model, processor, validation[:1]).shape[1]
    heads = AttributeHeads(model.config.text_config.hidden_size, tokens_per_image, reader)
    heads = heads.to(device)
    visual = model.model.visual
    optimizer = torch.optim.AdamW(
        [*visual.parameters(), *heads.parameters()], lr=lr, weight_decay=0.01
    )
    visual.train()
    started = time.monotonic()
    history = []
    for step in range(1, steps + 1):
        images = draw_images(rng, batch_size)
        logits = heads(merged_tokens(model, processor, images))
        labels = attribute_labels(images)
        loss = sum(
            torch.nn.functional.cross_entropy(logits[name], labels[name].to(device))
            for name in ATTRIBUTES
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % log_every == 0 or step == steps:
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "val": attribute_accuracy(model, processor, heads, validation),
                "s": round(time.monotonic() - started),
            }
            history.append(entry)
            print({"vision_pretrain": entry}, flush=True)
    return {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "tokens_per_image": tokens_per_image,
        "reader": reader,
        "seconds": round(time.monotonic() - started),
        "validation_accuracy": history[-1]["val"] if history else None,
        "history": history,
    }
