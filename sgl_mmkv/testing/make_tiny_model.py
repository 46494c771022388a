"""Build tiny random-weight Qwen2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), LLaVA models.

    python -m sgl_mmkv.testing.make_tiny_model --arch qwen2_vl --out DIR [--seed N]

The output directory is a real Hugging Face checkpoint (config, safetensors
weights, tokenizer with chat template, image / video processor and processor
configs) that SGLang loads like any hub model. The same seed gives byte-identical
files. No network access is ever made.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_mmkv.testing.tokenizer import SPECIAL_TOKENS, build_tokenizer

QWEN_ARCHS = ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Qwen3-VL's two text stacks (dense, MoE) share the vision tower, processor and rotary.
QWEN3_VL_ARCHS = ("qwen3_vl", "qwen3_vl_moe")
# HF-format LLaVA (Pixtral vision, Qwen2 text, 1-D RoPE): built by testing/tiny_llava.py.
LLAVA_ARCH = "llava"
ARCHS = (*QWEN_ARCHS, LLAVA_ARCH)
# Qwen3-VL cuts 16-pixel patches (Qwen2-VL and Qwen2.5-VL: 14).
PATCH_SIZE = {"qwen3_vl": 16, "qwen3_vl_moe": 16}


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Sizes of a tiny model. ``mrope_section`` must sum to ``head_dim // 2``."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vision_depth: int = 2
    vision_width: int = 64
    vision_heads: int = 4
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    max_position_embeddings: int = 4096
    initializer_range: float = 0.3
    # 112 x 112 pixels -> 8 x 8 patches of 14 -> 16 tokens after the 2 x 2 merge
    # (Qwen3-VL: resized to 128 x 128 -> 8 x 8 patches of 16 -> 16 tokens).
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224


# Large enough that prefill compute dominates on a CPU (issue 6): ~110 M decoder
# parameters, 448 x 448 images -> 32 x 32 patches -> 256 tokens. Random weights.
BENCH_SPEC = TinyModelSpec(
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    mrope_section=(8, 12, 12),
    max_position_embeddings=32768,
    initializer_range=0.02,
    max_pixels=448 * 448,
)
PRESETS = {"tiny": TinyModelSpec(), "bench": BENCH_SPEC}


def _token_ids() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def _text_config(spec: TinyModelSpec, mrope: bool) -> dict:
    ids = _token_ids()
    config = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "initializer_range": spec.initializer_range,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "float32",
    }
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if mrope:
        rope["mrope_section"] = list(spec.mrope_section)
    config["rope_parameters"] = rope
    return config


def _vision_config(spec: TinyModelSpec, arch: str) -> dict:
    common = {
        "depth": spec.vision_depth,
        "num_heads": spec.vision_heads,
        "in_channels": 3,
        # transformers writes in_channels; sglang's qwen2_vl reads in_chans.
        "in_chans": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": 0.02,
    }
    if arch in QWEN3_VL_ARCHS:
        return {
            **common,
            "patch_size": PATCH_SIZE[arch],
            "hidden_size": spec.vision_width,
            "intermediate_size": 2 * spec.vision_width,
            "out_hidden_size": spec.hidden_size,
            "hidden_act": "gelu_pytorch_tanh",
            # A learned 16 x 16 grid of position embeddings, interpolated per image.
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": deepstack_visual_indexes(spec),
        }
    if arch == "qwen2_vl":
        return {
            **common,
            "embed_dim": spec.vision_width,
            "hidden_size": spec.hidden_size,
            "mlp_ratio": 2,
            "hidden_act": "quick_gelu",
        }
    return {
        **common,
        "hidden_size": spec.vision_width,
        "intermediate_size": 2 * spec.vision_width,
        "out_hidden_size": spec.hidden_size,
        "hidden_act": "silu",
        "window_size": 112,
        "fullatt_block_indexes": [spec.vision_depth - 1],
        "tokens_per_second": 2,
    }


def deepstack_visual_indexes(spec: TinyModelSpec) -> list[int]:
    """Qwen3-VL's DeepStack: the vision layers whose merged features are added to the
    image tokens' hidden states after decoder layers ``0 .. n - 1``. Tiny: every vision
    layer, at most one per decoder layer."""
    return list(range(min(spec.vision_depth, spec.num_layers)))


def build_config(arch: str, spec: TinyModelSpec):
    """Return the transformers config object of ``arch`` at the sizes of ``spec``."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2Config,
        Qwen2VLConfig,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
    )

    if arch == "qwen2":
        config = Qwen2Config(**_text_config(spec, mrope=False))
        config.architectures = ["Qwen2ForCausalLM"]
        return config
    ids = _token_ids()
    cls = {
        "qwen2_vl": Qwen2VLConfig,
        "qwen2_5_vl": Qwen2_5_VLConfig,
        "qwen3_vl": Qwen3VLConfig,
        "qwen3_vl_moe": Qwen3VLMoeConfig,
    }[arch]
    text = _text_config(spec, mrope=True)
    if arch in QWEN3_VL_ARCHS:
        text["head_dim"] = spec.hidden_size // spec.num_heads
        text["rope_parameters"]["mrope_interleaved"] = True
    if arch == "qwen3_vl_moe":
        text.update(MOE_TEXT_CONFIG)
    config = cls(
        text_config=text,
        vision_config=_vision_config(spec, arch),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = [ARCHITECTURES[arch]]
    return config


ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
# A sparse MLP in every decoder layer (as Qwen3-VL-30B-A3B): 4 experts of which 2 route
# each token, renormalised. transformers 5 names the count num_local_experts and SGLang
# reads num_experts: the published checkpoints write num_experts, so config.json does.
MOE_TEXT_CONFIG = {
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def _model_class(arch: str):
    import transformers

    return {
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
    }[arch]


def _save_processor(arch: str, out: Path, tokenizer, spec: TinyModelSpec) -> None:
    import transformers

    patch_size = PATCH_SIZE.get(arch, 14)
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
    )
    if arch in QWEN3_VL_ARCHS:
        video_processor = transformers.Qwen3VLVideoProcessor(
            size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
            patch_size=patch_size,
        )
    else:
        video_processor = transformers.Qwen2VLVideoProcessor(
            min_pixels=spec.min_pixels, max_pixels=spec.max_pixels
        )
    processor_cls = {
        "qwen2_vl": transformers.Qwen2VLProcessor,
        "qwen2_5_vl": transformers.Qwen2_5_VLProcessor,
        "qwen3_vl": transformers.Qwen3VLProcessor,
        "qwen3_vl_moe": transformers.Qwen3VLProcessor,
    }[arch]
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(out)


def _patch_config_json(path: Path, arch: str, spec: TinyModelSpec) -> None:
    """Write the legacy keys sglang 0.5.23 still reads beside transformers' own."""
    config = json.loads(path.read_text())
    if arch != "qwen2":
        rope_scaling = {"type": "mrope", "mrope_section": list(spec.mrope_section)}
        if arch in QWEN3_VL_ARCHS:
            # As in the published Qwen3-VL checkpoints: t, h, w frequencies interleaved.
            rope_scaling = {
                "rope_type": "default",
                "mrope_section": list(spec.mrope_section),
                "mrope_interleaved": True,
            }
        config["rope_scaling"] = rope_scaling
        config["text_config"]["rope_scaling"] = rope_scaling
        config["vision_config"]["in_chans"] = 3
        # Top-level text sizes as in the published Qwen2-VL checkpoints.
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
        ):
            if key in config["text_config"]:
                config.setdefault(key, config["text_config"][key])
        config.setdefault("rope_theta", 1000000.0)
    if arch == "qwen3_vl_moe":
        for key, value in MOE_TEXT_CONFIG.items():
            config["text_config"].setdefault(key, value)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_untrained(arch: str, spec: TinyModelSpec, seed: int):
    """A random-weight model of ``arch`` and its freshly trained tokenizer."""
    if arch not in QWEN_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    tokenizer = build_tokenizer(seed, vocab_size=spec.vocab_size)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab {spec.vocab_size}")
    torch.manual_seed(seed)
    model = _model_class(arch)(build_config(arch, spec)).to(torch.float32).eval()
    model.generation_config.do_sample = False
    return model, tokenizer


def save_checkpoint(model, tokenizer, arch: str, spec: TinyModelSpec, out: str | Path) -> Path:
    """Write ``model`` with its tokenizer and processor as an SGLang-loadable checkpoint."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if arch == "qwen3_vl_moe":
        _write_published_expert_layout(out)
    tokenizer.save_pretrained(out)
    if arch != "qwen2":
        _save_processor(arch, out, tokenizer, spec)
    _patch_config_json(out / "config.json", arch, spec)
    return out


def _write_published_expert_layout(out: Path) -> None:
    """Rewrite the fused expert weights as the published Qwen3-VL MoE checkpoints hold
    them (``gate_up_proj (E, hidden, 2 * inter)``, ``down_proj (E, inter, hidden)``),
    the layout SGLang's loader transposes; transformers 5 saves them ``(E, out, in)``."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in tensors:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = tensors[name].transpose(-1, -2).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})


def make_tiny_model(
    arch: str, out: str | Path, seed: int = 0, spec: TinyModelSpec | None = None
) -> Path:
    """Write a tiny random-weight checkpoint of ``arch`` to ``out`` and return its path."""
    spec = spec or TinyModelSpec()
    if arch == LLAVA_ARCH:
        from sgl_mmkv.testing.tiny_llava import build_llava_untrained, save_llava_checkpoint

        return save_llava_checkpoint(*build_llava_untrained(spec, seed), out)
    model, tokenizer = build_untrained(arch, spec, seed)
    return save_checkpoint(model, tokenizer, arch, spec, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="tiny: 2 layers, hidden 128 (tests); bench: 8 layers, hidden 1024, "
        "256 tokens per 448 x 448 image (throughput benchmark)",
    )
    args = parser.parse_args(argv)
    path = make_tiny_model(args.arch, args.out, seed=args.seed, spec=PRESETS[args.preset])
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
