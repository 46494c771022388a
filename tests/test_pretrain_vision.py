"""Vision pretraining: the tower learns the images' attributes; the language model is untouched."""

from __future__ import annotations

import random

import pytest
import torch

from training.pretrain_vision import (
    ATTRIBUTES,
    AttributeHeads,
    attribute_labels,
    draw_images,
    merged_tokens,
    pretrain_vision,
)


@pytest.fixture(scope="module")
def model_and_processor(tmp_path_factory):
    from transformers import AutoProcessor

    from sgl_mmkv.testing.make_tiny_model import build_untrained, save_checkpoint
    from training.train_fidelity_model import FIDELITY_SPEC

    torch.manual_seed(0)
    model, tokenizer = build_untrained("qwen2_vl", FIDELITY_SPEC, 0)
    out = tmp_path_factory.mktemp("vision") / "m"
    processor = AutoProcessor.from_pretrained(
        save_checkpoint(model, tokenizer, "qwen2_vl", FIDELITY_SPEC, out)
    )
    return model, processor


def test_labels_and_shapes(model_and_processor):
    model, processor = model_and_processor
    images = draw_images(random.Random(0), 6)
    labels = attribute_labels(images)
    assert set(labels) == set(ATTRIBUTES)
    for name, classes in ATTRIBUTES.items():
        assert labels[name].shape == (6,) and int(labels[name].max()) < classes
    tokens = merged_tokens(model, processor, images)
    assert tokens.shape == (6, 16, model.config.text_config.hidden_size)
    logits = AttributeHeads(tokens.shape[-1])(tokens)
    assert {name: tuple(t.shape) for name, t in logits.items()} == {
        name: (6, classes) for name, classes in ATTRIBUTES.items()
    }
    marked = sum(int(im.marked) for im in draw_images(random.Random(1), 200))
    assert 70 < marked < 130  # half of the images carry the dot


def test_attention_reader_reads_one_weighted_mean_per_attribute():
    """The ``attention`` reader: logits are the head applied to a softmax-weighted mean
    of the image's tokens under the attribute's query; equal tokens read as that token."""
    torch.manual_seed(0)
    heads = AttributeHeads(8, tokens_per_image=4, reader="attention")
    tokens = torch.randn(3, 4, 8)
    logits = heads(tokens)
    for index, (name, head) in enumerate(heads.heads.items()):
        weights = (tokens @ heads.queries[index] / 8**0.5).softmax(-1)  # (3, 4)
        expected = head((weights[..., None] * tokens).sum(1))
        torch.testing.assert_close(logits[name], expected)
        assert logits[name].shape == (3, ATTRIBUTES[name])
    same = torch.randn(1, 1, 8).expand(2, 4, 8)
    for name, head in heads.heads.items():
        torch.testing.assert_close(heads(same)[name], head(same[:, 0]))
    with pytest.raises(ValueError, match="unknown reader"):
        AttributeHeads(8, reader="mean")


@pytest.mark.slow  # a training run
def test_short_pretraining_learns_attributes_and_leaves_the_decoder(model_and_processor):
    model, processor = model_and_processor
    decoder = {n: p.detach().clone() for n, p in model.named_parameters() if "visual" not in n}
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if "visual" in n}
    record = pretrain_vision(model, processor, steps=40, num_validation=100, log_every=20)
    accuracy = record["validation_accuracy"]
    assert [h["step"] for h in record["history"]] == [20, 40]
    # chance: background 1/8, quadrant 1/4; both are read off within 40 steps
    assert accuracy["background"] >= 0.9 and accuracy["quadrant"] >= 0.9
    assert accuracy["colour"] > 0.3  # chance 1/8
    for name, before in decoder.items():
        assert torch.equal(dict(model.named_parameters())[name], before), name
    moved = [
        n for n, p in model.named_parameters() if "visual" in n and not torch.equal(p, vision[n])
    ]
    assert len(moved) == len(vision)
