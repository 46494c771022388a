"""The tiny-model builder: deterministic files in the real HF format, loadable by transformers."""

from __future__ import annotations

import hashlib

import pytest
import torch

from sgl_mmkv.testing.images import make_image
from sgl_mmkv.testing.make_tiny_model import main, make_tiny_model
from sgl_mmkv.testing.tokenizer import SPECIAL_TOKENS


def _digests(path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file()
    }


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = make_tiny_model("qwen2_vl", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen2_vl", tmp_path / "b", seed=3)
    c = make_tiny_model("qwen2_vl", tmp_path / "c", seed=4)
    assert _digests(a) == _digests(b)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_digests(a))
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]


def test_cli_writes_checkpoint(tmp_path, capsys):
    assert main(["--arch", "qwen2", "--out", str(tmp_path / "m"), "--seed", "1"]) == 0
    assert (tmp_path / "m" / "model.safetensors").stat().st_size > 100_000
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model("llama", tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["--arch", "llama", "--out", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vlm_loads_and_runs_with_its_processor(arch, model_dir, tiny_vlm, tiny_qwen25_vl):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm if arch == "qwen2_vl" else tiny_qwen25_vl
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[make_image(1), make_image(2)], return_tensors="pt")
    image_pad = SPECIAL_TOKENS.index("<|image_pad|>")
    # 112 x 112 -> 8 x 8 patches -> 2 x 2 merge -> 16 tokens per image.
    assert int((inputs["input_ids"] == image_pad).sum()) == 32
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 1024)
    assert torch.isfinite(logits).all()
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_text_model_generates_varied_tokens(tiny_llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llm)
    model = AutoModelForCausalLM.from_pretrained(tiny_llm).eval()
    ids = tokenizer("What colour is the circle?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    # initializer_range 0.3 keeps greedy decoding from collapsing into one token.
    assert len(set(out.tolist())) >= 3


def test_qwen3_vl_config_fields(tiny_qwen3_vl):
    import json

    config = json.loads((tiny_qwen3_vl / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["model_type"] == "qwen3_vl"
    vision, text = config["vision_config"], config["text_config"]
    assert vision["patch_size"] == 16
    assert vision["deepstack_visual_indexes"] == [0, 1]
    assert vision["out_hidden_size"] == text["hidden_size"] == 128
    assert text["head_dim"] == 32
    assert text["rope_scaling"] == {
        "rope_type": "default",
        "mrope_section": [4, 6, 6],
        "mrope_interleaved": True,
    }
    processor = json.loads((tiny_qwen3_vl / "processor_config.json").read_text())
    assert processor["processor_class"] == "Qwen3VLProcessor"
    assert processor["image_processor"]["patch_size"] == 16


def test_qwen3_vl_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    a = make_tiny_model("qwen3_vl", tmp_path / "a", seed=5)
    b = make_tiny_model("qwen3_vl", tmp_path / "b", seed=5)
    c = make_tiny_model("qwen3_vl", tmp_path / "c", seed=6)
    assert _digests(a) == _digests(b)
    weights, other = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    merger = "model.visual.deepstack_merger_list.1.linear_fc2.weight"
    assert merger in weights
    assert weights[merger].shape == (128, 256)  # 2 x 2 merge of width 64 -> hidden 128
    assert not torch.equal(weights[merger], other[merger])


def test_qwen3_vl_loads_and_runs_with_its_processor(tiny_qwen3_vl):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_qwen3_vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[make_image(1)], return_tensors="pt")
    # 112 x 112 -> 128 x 128 -> 8 x 8 patches of 16 -> 2 x 2 merge -> 16 tokens.
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert int((inputs["input_ids"] == SPECIAL_TOKENS.index("<|image_pad|>")).sum()) == 16
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 1024)
    assert torch.isfinite(logits).all()


def test_qwen3_vl_moe_writes_the_published_expert_layout(tiny_qwen3_vl_moe):
    """Fused experts on disk as the published Qwen3-VL MoE checkpoints hold them (the
    layout SGLang's loader transposes), and transformers reads back the built weights."""
    import json

    from safetensors.torch import load_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    from sgl_mmkv.testing.make_tiny_model import TinyModelSpec, build_untrained

    config = json.loads((tiny_qwen3_vl_moe / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    text = config["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"]) == (
        4,
        2,
        48,
    )
    weights = load_file(tiny_qwen3_vl_moe / "model.safetensors")
    prefix = "model.language_model.layers.1.mlp."
    assert weights[prefix + "experts.gate_up_proj"].shape == (4, 128, 96)  # (E, hidden, 2 I)
    assert weights[prefix + "experts.down_proj"].shape == (4, 48, 128)  # (E, I, hidden)
    assert weights[prefix + "gate.weight"].shape == (4, 128)
    built, _ = build_untrained("qwen3_vl_moe", TinyModelSpec(), seed=0)
    loaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_qwen3_vl_moe)
    for layer in range(2):
        want = built.model.language_model.layers[layer].mlp.experts
        got = loaded.model.language_model.layers[layer].mlp.experts
        assert torch.equal(want.gate_up_proj, got.gate_up_proj)
        assert torch.equal(want.down_proj, got.down_proj)
