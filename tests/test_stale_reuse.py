"""training/stale_reuse.py: the torch simulation of plain reuse is exact where it must be."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from training.stale_reuse import (
    KVSplicer,
    _local_part,
    _per_image,
    answer_correct,
    context_image_kv,
    encode,
    record_image_kv,
)
from training.staleness_probes import training_batch
from training.staleness_tasks import make_stale_example, stale_messages

MODEL = Path(__file__).resolve().parent.parent / "models" / "fidelity-qwen2-vl-marked"


@pytest.fixture(scope="module")
def model_and_processor():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    return model, AutoProcessor.from_pretrained(MODEL)


def _target(processor, example):
    images: list = []
    return encode(processor, stale_messages(example, _local_part(images)), images, example.answer)


def _spliced_logits(model, splicer, encoded, image_kv):
    splicer.positions = encoded.image_positions()
    splicer.replace = [
        {n: torch.cat([im[layer][n] for im in image_kv]) for n in ("k", "v")}
        for layer in range(len(image_kv[0]))
    ]
    try:
        with torch.no_grad():
            return model(**encoded.inputs).logits
    finally:
        splicer.positions, splicer.replace = None, None


def test_own_kv_spliced_back_changes_nothing(model_and_processor):
    model, processor = model_and_processor
    example = make_stale_example("next", "validation", 0, 3)
    target = _target(processor, example)
    assert len(target.image_positions()) == 3 * 16
    splicer = KVSplicer(model)
    try:
        own = _per_image(record_image_kv(model, splicer, target), 3)
        with torch.no_grad():
            reference = model(**target.inputs).logits
        assert torch.equal(_spliced_logits(model, splicer, target, own), reference)
        reordered = context_image_kv(model, processor, splicer, example, "reordered")
        for i in range(3):  # layer 0 sees only the image's own embedding: context-free
            assert torch.equal(reordered[i][0]["k"], own[i][0]["k"])
        # the middle image keeps its slot when 3 images are reversed; the others move
        assert not torch.equal(reordered[0][2]["k"], own[0][2]["k"])
        assert answer_correct(model, splicer, target) == answer_correct(model, splicer, target, own)
    finally:
        splicer.close()
    assert all(not module._forward_hooks for module in model.modules())


def test_training_labels_are_the_answer(model_and_processor):
    _, processor = model_and_processor
    examples = [make_stale_example("repeat", "train", i, 2 + i) for i in range(3)]
    batch = training_batch(processor, examples, random.Random(0))
    for row, example in enumerate(examples):
        ids = batch["input_ids"][row][batch["labels"][row] != -100]
        assert processor.tokenizer.decode(ids) == example.answer + "<|im_end|>\n"
