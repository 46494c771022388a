"""A tiny random-weight HF-format LLaVA (Pixtral vision tower, Qwen2 text model).

This is SGLang's ``LlavaForConditionalGeneration``: a 1-D RoPE language model whose
image features replace ``[IMG]`` tokens. The Pixtral processor lays an image out
as rows of ``[IMG]`` tokens, each row ended by ``[IMG_BREAK]`` and the last by
``[IMG_END]``; the whole block is fixed by the image's size.

Used by :mod:`sgl_mmkv.testing.make_tiny_model` (``--arch llava``); kept apart from
the Qwen builders there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sgl_mmkv.testing.tokenizer import SPECIAL_TOKENS, build_tokenizer, chatml_template

IMAGE_TOKENS: tuple[str, str, str] = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
PATCH_SIZE = 16
# 112 x 112 pixels -> 7 x 7 patches of 16 -> 7 rows of 7 [IMG] + 6 [IMG_BREAK] + [IMG_END].
IMAGE_EDGE = 112

# ChatML turns (the Qwen2 text model's convention) with one [IMG] per image part;
# the processor expands it to the image's rows.
LLAVA_CHAT_TEMPLATE = chatml_template("[IMG]")


def llava_tokenizer(seed: int, vocab_size: int):
    """The Qwen-style test tokenizer with the three Pixtral image tokens appended
    (ids ``vocab_size - 3 .. vocab_size - 1``) and the LLaVA chat template."""
    tokenizer = build_tokenizer(seed, vocab_size=vocab_size - len(IMAGE_TOKENS))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(IMAGE_TOKENS)},
        replace_extra_special_tokens=False,
    )
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


def build_llava_config(spec, tokenizer):
    """transformers' ``LlavaConfig`` at the sizes of ``spec`` (a ``TinyModelSpec``)."""
    from transformers import LlavaConfig, PixtralVisionConfig, Qwen2Config

    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    text = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        max_window_layers=spec.num_layers,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    text.architectures = ["Qwen2ForCausalLM"]
    vision = PixtralVisionConfig(
        hidden_size=spec.vision_width,
        intermediate_size=2 * spec.vision_width,
        num_hidden_layers=spec.vision_depth,
        num_attention_heads=spec.vision_heads,
        image_size=IMAGE_EDGE,
        patch_size=PATCH_SIZE,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[0]),
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def build_llava_untrained(spec, seed: int):
    """A random-weight tiny LLaVA and its tokenizer; the same seed gives the same weights."""
    from transformers import LlavaForConditionalGeneration

    tokenizer = llava_tokenizer(seed, spec.vocab_size)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab {spec.vocab_size}")
    torch.manual_seed(seed)
    config = build_llava_config(spec, tokenizer)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.do_sample = False
    return model, tokenizer


def _legacy_name(name: str) -> str:
    """The published LLaVA checkpoints' tensor names, which SGLang's loader expects:
    ``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``,
    ``multi_modal_projector.*`` (transformers 5 loads both layouts)."""
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model.") :]
    if name.startswith("model."):
        return name[len("model.") :]
    return name


def save_llava_checkpoint(model, tokenizer, out: str | Path) -> Path:
    """Write ``model`` (safetensors in the legacy LLaVA layout), its tokenizer and a
    Pixtral processor to ``out``."""
    from safetensors.torch import save_file
    from transformers import PixtralImageProcessor, PixtralProcessor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tensors = {_legacy_name(k): v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    image_processor = PixtralImageProcessor(
        size={"longest_edge": IMAGE_EDGE}, patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE}
    )
    processor = PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    _patch_llava_config_json(out / "config.json")
    return out


def _patch_llava_config_json(path: Path) -> None:
    """Sorted keys (byte-identical files for one seed) and the text model's
    ``rope_theta`` where SGLang 0.5.23 still reads it."""
    config = json.loads(path.read_text())
    config["text_config"].setdefault("rope_theta", 1000000.0)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
