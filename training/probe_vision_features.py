"""Linear probes on a fidelity model's image tokens: what the decoder is given to read.

    python -m training.probe_vision_features --model-path models/fidelity-qwen2-vl

Encodes single training-split images with the model's vision tower and merger
(the decoder's input, 16 tokens per image), then fits a softmax probe (80 / 20
split) per attribute on: the mean of the 16 tokens, all 16 tokens concatenated,
one token inside the shape's quadrant, and one token of the diagonally opposite
(background-only) quadrant. High accuracy on the shape's own token for both the
shape colour and the background says one token binds the two, so a question
naming one can retrieve the other in one attention hop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from harness.fidelity_task import ShapeImage, make_example
from training.pretrain_vision import attribute_labels, merged_tokens

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "fidelity-qwen2-vl"
GRID = torch.arange(16).reshape(4, 4)  # merged 4 x 4 token grid of a 112 x 112 image
QUADRANT_TOKENS = (
    GRID[:2, :2].flatten(),
    GRID[:2, 2:].flatten(),
    GRID[2:, :2].flatten(),
    GRID[2:, 2:].flatten(),
)
# The first token of each quadrant, indexed like QUADRANTS; quadrant q's diagonal is 3 - q.
QUADRANT_TOKENS_FIRST = torch.stack([t[0] for t in QUADRANT_TOKENS])


@torch.no_grad()
def image_tokens(model_path: Path, images: list[ShapeImage], batch: int = 100) -> torch.Tensor:
    """``(N, 16, hidden)`` float32 decoder-input tokens of each image."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_path).eval()
    processor = AutoProcessor.from_pretrained(model_path)
    chunks = [
        merged_tokens(model, processor, images[start : start + batch]).float()
        for start in range(0, len(images), batch)
    ]
    tokens = torch.cat(chunks)
    if tokens.shape[1] != GRID.numel():
        raise ValueError(
            f"{model_path} gives {tokens.shape[1]} tokens per image; the quadrant probes "
            f"assume the 4 x 4 grid of a 112-pixel image ({GRID.numel()} tokens)"
        )
    return tokens


def probe_accuracy(features: torch.Tensor, labels: torch.Tensor, steps: int = 400) -> float:
    """Held-out accuracy of a softmax probe on ``features`` ``(N, d)``."""
    train = int(0.8 * len(labels))
    mean, std = features[:train].mean(0), features[:train].std(0) + 1e-6
    x = (features - mean) / std
    classes = int(labels.max()) + 1
    weight = torch.zeros(x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=1e-2)
    for _ in range(steps):
        logits = x[:train] @ weight + bias
        loss = (
            torch.nn.functional.cross_entropy(logits, labels[:train]) + 1e-3 * weight.square().sum()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    predicted = (x[train:] @ weight + bias).argmax(1)
    return float((predicted == labels[train:]).float().mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--num-images", type=int, default=1500)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    images = [make_example("train", i, num_images=1).images[0] for i in range(args.num_images)]
    tokens = image_tokens(args.model_path, images)
    by_attribute = attribute_labels(images)
    labels = {
        "shape colour": by_attribute["colour"],
        **{name: by_attribute[name] for name in ("background", "kind", "quadrant")},
    }
    quadrant = labels["quadrant"]
    views = {
        "mean of 16 tokens": tokens.mean(1),
        "all 16 tokens": tokens.reshape(len(images), -1),
        "a shape token": tokens[torch.arange(len(images)), QUADRANT_TOKENS_FIRST[quadrant]],
        "a far background token": tokens[
            torch.arange(len(images)), QUADRANT_TOKENS_FIRST[3 - quadrant]
        ],
    }
    print(f"{'features':<24}" + "".join(f"{name:>14}" for name in labels))
    for view, features in views.items():
        row = "".join(f"{probe_accuracy(features, y):>14.3f}" for y in labels.values())
        print(f"{view:<24}{row}")
    held_out = int(0.8 * len(images))
    chance = [
        float(torch.bincount(y[held_out:]).max()) / (len(y) - held_out) for y in labels.values()
    ]
    print(f"{'chance (majority)':<24}" + "".join(f"{c:>14.3f}" for c in chance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
