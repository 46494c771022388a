"""The tiny LLaVA builder (``--arch llava``): deterministic files in the HF format,
loadable by transformers with its Pixtral processor."""

from __future__ import annotations

import hashlib

import torch

from sgl_mmkv.testing.images import make_image
from sgl_mmkv.testing.make_tiny_model import TinyModelSpec, main, make_tiny_model
from sgl_mmkv.testing.tiny_llava import IMAGE_TOKENS, build_llava_untrained

ROWS = 7  # 112 px / 16 px patches


def _digests(path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file()
    }


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = make_tiny_model("llava", tmp_path / "a", seed=3)
    assert main(["--arch", "llava", "--out", str(tmp_path / "b"), "--seed", "3"]) == 0
    c = make_tiny_model("llava", tmp_path / "c", seed=4)
    digests = _digests(a)
    assert digests == _digests(tmp_path / "b")
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= set(
        digests
    )
    assert digests["model.safetensors"] != _digests(c)["model.safetensors"]


def test_checkpoint_uses_the_legacy_llava_tensor_names(tmp_path):
    from safetensors import safe_open

    path = make_tiny_model("llava", tmp_path / "m", seed=0)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        prefixes = {k.split(".")[0] for k in f.keys()}
        assert "language_model.lm_head.weight" in f.keys()
    assert prefixes == {"language_model", "vision_tower", "multi_modal_projector"}


def test_loads_and_runs_with_its_processor(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = make_tiny_model("llava", tmp_path / "m", seed=0)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    built, _ = build_llava_untrained(TinyModelSpec(), seed=0)
    for name, tensor in built.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text.count("[IMG]") == 1 and text.startswith("<|im_start|>system\n")
    logits = []
    for seed in (1, 2):
        inputs = processor(text=[text], images=[make_image(seed)], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        img, brk, end = processor.tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
        assert (ids.count(img), ids.count(brk), ids.count(end)) == (ROWS * ROWS, ROWS - 1, 1)
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert logits[0].shape == (1024,)
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # the image reaches the text model
