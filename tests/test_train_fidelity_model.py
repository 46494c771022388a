"""The training script: answer-only labels, a real (short) run, continuing a run."""

from __future__ import annotations

import json
import random

import pytest
import torch

from harness.fidelity_task import make_example, model_style
from training.train_fidelity_model import collate, train


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    from sgl_mmkv.testing.make_tiny_model import build_untrained, save_checkpoint
    from training.train_fidelity_model import FIDELITY_SPEC

    model, tokenizer = build_untrained("qwen2_vl", FIDELITY_SPEC, 0)
    out = tmp_path_factory.mktemp("fidelity") / "m"
    return AutoProcessor.from_pretrained(
        save_checkpoint(model, tokenizer, "qwen2_vl", FIDELITY_SPEC, out)
    )


def test_labels_are_exactly_the_answer_tokens(processor):
    examples = [make_example("train", i) for i in range(6)]
    batch = collate(processor, examples, random.Random(0))
    for row, example in enumerate(examples):
        answer = batch["input_ids"][row][batch["labels"][row] != -100]
        assert processor.tokenizer.decode(answer) == example.answer + "<|im_end|>\n"


def test_follow_up_labels_are_the_answers_of_every_turn(processor):
    examples = [make_example("train", i) for i in range(6)]
    batch = collate(processor, examples, random.Random(0), follow_ups=3)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, example in enumerate(examples):
        labelled = batch["labels"][row] != -100
        answer_ids = batch["input_ids"][row][labelled]
        text = processor.tokenizer.decode(answer_ids)
        answers = text.split("<|im_end|>\n")
        assert len(answers) == 5 and answers[-1] == ""  # 4 answers, each closed
        assert answers[0] == example.answer
        assert int((answer_ids == end).sum()) == 4
        # every labelled run starts right after "<|im_start|>assistant\n"
        starts = labelled & ~torch.roll(labelled, 1)
        assert int(starts.sum()) == 4
        for pos in starts.nonzero().flatten().tolist():
            prefix = processor.tokenizer.decode(batch["input_ids"][row][pos - 8 : pos])
            assert prefix.endswith("<|im_start|>assistant\n")


def test_labels_follow_the_processor_at_64_tokens_per_image(processor):
    """At 224 pixels a side every image is 64 tokens: the answer labels still cover
    exactly the answers (the shift is counted in the processed row, not assumed)."""
    from copy import deepcopy

    from training.staleness_probes import set_image_side

    page = deepcopy(processor)
    set_image_side(page, 224)
    examples = [make_example("train", i, num_images=2 + i % 3) for i in range(4)]
    batch = collate(page, examples, random.Random(0), follow_ups=1)
    pad = page.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, example in enumerate(examples):
        assert int((batch["input_ids"][row] == pad).sum()) == 64 * len(example.images)
        answers = page.tokenizer.decode(batch["input_ids"][row][batch["labels"][row] != -100])
        assert answers.startswith(example.answer + "<|im_end|>\n")
        assert answers.count("<|im_end|>") == 2


@pytest.mark.slow  # a training run
def test_short_run_then_continue(tmp_path):
    first = train(
        tmp_path / "a", steps=3, batch_size=2, lr=1e-3, seed=0, log_every=1, num_validation=4
    )
    assert first["total_steps"] == 3 and len(first["phases"]) == 1
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in first["phases"][0]["history"])
    second = train(
        tmp_path / "b",
        steps=3,
        batch_size=2,
        lr=1e-3,
        seed=1,
        log_every=1,
        init_from=tmp_path / "a",
        num_validation=4,
    )
    assert second["total_steps"] == 6 and len(second["phases"]) == 2
    written = json.loads((tmp_path / "b" / "training.json").read_text())
    assert written["total_steps"] == 6
    assert [p["init_from"] for p in written["phases"]] == [None, str(tmp_path / "a")]
    assert (tmp_path / "b" / "model.safetensors").exists()


def test_text_control_batch_has_no_pixels_and_labels_the_answer(processor):
    examples = [make_example("train", i, style="marked") for i in range(6)]
    batch = collate(processor, examples, random.Random(0), as_text=True)
    assert "pixel_values" not in batch
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == image_pad).sum()) == 0
    for row, example in enumerate(examples):
        answer = batch["input_ids"][row][batch["labels"][row] != -100]
        assert processor.tokenizer.decode(answer) == example.answer + "<|im_end|>\n"


def test_marked_examples_take_no_keyed_follow_ups(processor):
    with pytest.raises(ValueError, match="follow-up"):
        collate(processor, [make_example("train", 0, style="marked")], random.Random(0), 2)


@pytest.mark.slow  # a training run
def test_style_and_vision_pretraining_are_recorded(tmp_path):
    record = train(
        tmp_path / "m",
        steps=2,
        batch_size=2,
        lr=1e-3,
        seed=0,
        log_every=1,
        num_validation=2,
        style="marked",
        vision_pretrain_steps=2,
    )
    assert record["style"] == "marked" and record["phases"][0]["style"] == "marked"
    pretrain = record["phases"][0]["vision_pretrain"]
    assert pretrain["steps"] == 2 and [h["step"] for h in pretrain["history"]] == [2]
    assert model_style(tmp_path / "m") == "marked"
    assert model_style(tmp_path) == "keyed"  # no training.json: the committed task
    (tmp_path / "training.json").write_text(json.dumps({"style": "labelled"}))
    with pytest.raises(ValueError, match="unknown style"):
        model_style(tmp_path)
