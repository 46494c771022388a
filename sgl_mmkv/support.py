"""What sgl_mmkv's refresh path supports, checked before the server serves.

The refresh executor re-positions reused KV by rotating keys (a RoPE whose angle
is linear in position), runs its own attention over one request row at a time,
copies KV token by token, and runs sub-batches on one device. Everything outside
that is refused here, with one line naming the flag or the model and what is
missing, instead of crashing in the scheduler or answering wrongly later.

The checks read SGLang's effective configuration, never the raw flags or files:
the server args as SGLang resolves them (``--config`` files, abbreviated flags and
SGLang's own defaults included), the resolved CUDA-graph configuration (from
``--cuda-graph-config`` as well as the per-phase flags), and the model's Hugging
Face config after ``--json-model-override-args``. The launcher runs them early
(exit 2, :func:`effective_settings`); the scheduler runs them again where the
cache is built (``build_mmkv_radix_cache``), so every way in is checked.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from sgl_mmkv.config import RADIX_CACHE_BACKEND_NAME, ConfigError, MMKVConfig

SGLANG_VERSION = "0.5.23"
# Model classes whose rotary, attention and KV pool the refresh path reproduces exactly.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "Qwen2-VL (M-RoPE)",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL (M-RoPE)",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL (interleaved M-RoPE, DeepStack)",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL MoE (interleaved M-RoPE, DeepStack, MoE MLP)",
    "LlavaForConditionalGeneration": "LLaVA, HF format (1-D RoPE)",
}
# Of those, the ones with M-RoPE: decode-time compression shortens a request's row
# and moves its decode positions by M-RoPE's per-request offset, which 1-D RoPE lacks.
MROPE_ARCHITECTURES = frozenset(
    {
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
    }
)
UNSCALED_ROPE_TYPES = (None, "default", "mrope")
# Rotary variants whose angle is linear in position, so a rotation by the position
# delta re-positions a reused key exactly (refresh/rotary.py derives the rates from
# the model's own cache and checks it; tests/test_rotary_variants.py covers each).
LINEAR_ROPE_TYPES = (*UNSCALED_ROPE_TYPES, "linear", "dynamic", "yarn", "llama3")
# --kv-cache-dtype values whose pool holds plain floating-point KV (no scales). With
# "auto" a checkpoint may still declare fp8 KV: check_effective and the pool check in
# assembly.py read what it declares and what SGLang built.
PLAIN_KV_DTYPES = ("auto", "bf16", "bfloat16", "float16", "float32")
# fp8 KV with one K and one V scale per layer (SGLang's MHATokenToKVPool): segment
# copies rotate it in float32 (the scale commutes with the rotation), refresh and
# scoring attention descale it (kernels/kv_dtype.py). Block-scaled values (mxfp8,
# nvfp4, fp4_mx_block16) keep per-token / per-block scales beside the pool: refused.
FP8_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")
# Attention backends that store and read fp8 KV without the layer's scales: the
# refresh path applies them, so the two would disagree on every scale but 1.
UNSCALED_KV_BACKENDS = ("torch_native",)


def check_sglang_version() -> None:
    """sgl_mmkv's patches target one SGLang release."""
    import importlib.metadata as md

    found = md.version("sglang")
    if found != SGLANG_VERSION:
        raise ConfigError(
            f"sgl_mmkv's patches are written against sglang {SGLANG_VERSION}, found {found}"
        )


def check_startup(config: MMKVConfig, args: Any, hf_config: dict) -> None:
    """Every start-up check of ``config`` against SGLang's effective configuration
    (``args`` and ``hf_config`` as in :func:`check_effective`)."""
    if config.uses_mmkv_cache:
        check_sglang_version()
    check_effective(config, args, hf_config)


def effective_settings(server_args: Any) -> tuple[Any, dict]:
    """SGLang's effective configuration: (its resolved view of ``server_args``, the
    model's Hugging Face config after ``--json-model-override-args`` as a dict).

    A record not resolved yet (the launcher's) is resolved on a copy, so the record
    ``run_server`` receives stays as stock leaves it; the same resolution then runs
    in ``run_server`` and gives the same result.
    """
    from sglang.srt.arg_groups.overrides import model_config_of, resolved_view

    if not getattr(server_args, "_resolution_finished", False):
        server_args = copy.deepcopy(server_args)
        server_args.resolve_once()
    return resolved_view(server_args), model_config_of(server_args).hf_config.to_dict()


def graph_backend(graphs: Any, phase: str) -> str | None:
    """The CUDA-graph backend of ``phase`` (``prefill`` / ``decode``) in SGLang's
    resolved ``cuda_graph_config`` (a ``CudaGraphConfig``, or its dict form)."""
    settings = graphs.get(phase) if isinstance(graphs, dict) else getattr(graphs, phase, None)
    if isinstance(settings, dict):
        return settings.get("backend")
    return getattr(settings, "backend", None)


def check_server_args(config: MMKVConfig, args: Any) -> None:
    """Raise :class:`ConfigError` for the first server setting ``config`` cannot run
    with. ``args``: SGLang's server args, as parsed (the launcher checks the flags
    asked for before SGLang resolves anything) or resolved (:func:`check_effective`).
    """
    if config.uses_mmkv_cache:
        if args.disable_radix_cache:
            raise ConfigError(
                f"--disable-radix-cache: --mm-reuse {config.mm_reuse} needs the radix cache"
            )
        if args.radix_cache_backend not in (None, RADIX_CACHE_BACKEND_NAME):
            raise ConfigError(
                f"--radix-cache-backend {args.radix_cache_backend}: --mm-reuse "
                f"{config.mm_reuse} runs sgl_mmkv's radix cache"
            )
    if not config.uses_refresh:
        return
    mode = f"--mm-reuse {config.mm_reuse}"
    shrinking = config.compresses_at_decode or config.reuses_with_holes
    refusals = [
        (
            args.enable_dp_attention,
            "--enable-dp-attention: attention-DP ranks share the MLP's collectives, so ranks "
            "running different numbers of refresh passes would deadlock in them",
        ),
        (
            args.dp_size > 1,
            f"--dp-size {args.dp_size}: each data-parallel rank keeps its own segment store and "
            "SGLang's DP controller spreads requests without looking at images; run one instance "
            "per rank behind SGLang's router and sgl_mmkv's gateway (docs/deployment.md)",
        ),
        (
            args.pp_size > 1,
            f"--pp-size {args.pp_size}: a refresh pass runs every layer in one process, a "
            "pipeline stage holds only its own layers",
        ),
        (
            args.disaggregation_mode not in (None, "null"),
            f"--disaggregation-mode {args.disaggregation_mode}: the segment store and "
            "refresh passes live in one instance, PD KV transfer does not carry them",
        ),
        (
            args.speculative_algorithm is not None,
            f"--speculative-algorithm "
            f"{args.speculative_algorithm}: verify and draft extends are not refresh batches",
        ),
        (
            bool(args.enable_lora or args.lora_paths),
            "--enable-lora / --lora-paths: refresh sub-batches do not re-prepare LoRA metadata",
        ),
        (
            args.enable_mixed_chunk and shrinking,
            "--enable-mixed-chunk with rows that shrink after prefill (--mm-compress-at decode, "
            "or reuse with holes: set --mm-compressed-reuse recompute): mixed batches re-derive "
            "positions a shrunk row lacks",
        ),
        (
            args.kv_cache_dtype not in (*PLAIN_KV_DTYPES, *FP8_KV_DTYPES),
            f"--kv-cache-dtype {args.kv_cache_dtype}: its KV keeps per-token / per-block "
            "scales, and segment copies and refresh attention apply one scale per layer "
            f"(supported: {', '.join(FP8_KV_DTYPES)} and plain KV)",
        ),
        (
            args.kv_cache_dtype in FP8_KV_DTYPES and _unscaled_backend(args),
            f"--kv-cache-dtype {args.kv_cache_dtype} with the {_unscaled_backend(args)} "
            "attention backend: it stores and reads fp8 KV without the layers' scales, "
            "which the refresh path applies; use a backend that applies them (triton, "
            "flashinfer, fa3; intel_amx on the CPU)",
        ),
        (
            bool(getattr(args, "is_embedding", False)),
            "--is-embedding: an embedding pooled over reused image KV differs from stock's, "
            "and fidelity is measured on generated answers only (use --mm-reuse exact or off)",
        ),
        (
            args.page_size not in (None, 1) and shrinking,
            f"page size {args.page_size} (--page-size, or forced by the attention backend "
            f"{_attention_backends(args)}) with rows that shrink after prefill "
            "(--mm-compress-at decode, or reuse with holes: --mm-compressed-reuse holes, the "
            "default with a scored --mm-evict): a shrunk row frees single slots, SGLang's "
            "paged allocator whole pages; set --mm-compressed-reuse recompute and "
            "--mm-compress-at pressure or fill, or pass --page-size 1 with a backend that "
            "allows it (torch_native, triton, flashinfer)",
        ),
        *_tier_refusals(args),
    ]
    _refuse_first(mode, refusals)


def _unscaled_backend(args: Any) -> str | None:
    """The first attention backend of ``args`` that ignores fp8 KV scales, or None."""
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        name = getattr(args, field, None)
        if name in UNSCALED_KV_BACKENDS:
            return name
    return None


def _attention_backends(args: Any) -> str:
    names = {
        getattr(args, field, None)
        for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    }
    return " / ".join(sorted(str(n) for n in names if n)) or "default"


def _tier_refusals(args: Any) -> list[tuple[bool, str]]:
    """Switches that copy the radix tree's rows out of this instance (HiCache, LMCache,
    FlexKV, SGLang's external cache linker) or turn every batch into one that reuses
    nothing (full hidden states): refused, never silently wrong or silently off."""
    exports = (
        "rows built from refreshed (approximate) image KV would leave this instance "
        "under prefix keys an exact instance trusts"
    )
    # SGLang resolves the two switches to mode "full"; mode "last" sets the first one.
    mode = getattr(args, "return_hidden_states_mode", None)
    switches = getattr(args, "enable_return_hidden_states", False) or getattr(
        args, "enable_return_aux_hidden_states", False
    )
    hidden = mode == "full" or (mode is None and bool(switches))
    return [
        (
            bool(getattr(args, "enable_hierarchical_cache", False)),
            f"--enable-hierarchical-cache (HiCache): {exports}; keep HiCache on exact "
            "instances and share images through --mm-segment-storage (docs/deployment.md)",
        ),
        (
            bool(getattr(args, "enable_lmcache", False)),
            f"--enable-lmcache: SGLang ignores it with sgl_mmkv's radix cache, and {exports}",
        ),
        (
            bool(getattr(args, "enable_flexkv", False)),
            f"--enable-flexkv: SGLang ignores it with sgl_mmkv's radix cache, and {exports}",
        ),
        (
            bool(getattr(args, "enable_unified_cache_external_linker", False)),
            f"--enable-unified-cache-external-linker: {exports}",
        ),
        (
            hidden,
            "--enable-return-hidden-states (every prompt row's hidden states): every "
            "batch would need all rows computed, so nothing would be reused; serve hidden "
            "states from a --mm-reuse exact or off instance",
        ),
    ]


def _refuse_first(mode: str, refusals: list[tuple[bool, str]]) -> None:
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"{mode} cannot run with {reason}")


def check_effective(config: MMKVConfig, args: Any, hf_config: dict) -> None:
    """:func:`check_server_args` on SGLang's resolved args, then its resolved CUDA
    graphs and the model.

    Args:
        args: SGLang's resolved server args (:func:`effective_settings`; in the
            scheduler ``resolved_view(get_server_args())``).
        hf_config: the model's Hugging Face config after SGLang's overrides.
    """
    check_server_args(config, args)
    if not config.uses_refresh:
        return
    mode = f"--mm-reuse {config.mm_reuse}"
    prefill = graph_backend(args.cuda_graph_config, "prefill")
    decode = graph_backend(args.cuda_graph_config, "decode")
    shrinking = config.compresses_at_decode or config.reuses_with_holes
    refusals = [
        (
            prefill not in (None, "disabled"),
            f"prefill CUDA graphs (SGLang resolved the prefill backend to {prefill!r}, "
            "from --cuda-graph-backend-prefill or --cuda-graph-config): they bypass the "
            "refresh executor; set the prefill backend to disabled",
        ),
        (
            shrinking and decode not in (None, "disabled"),
            f"decode CUDA graphs (SGLang resolved the decode backend to {decode!r}) "
            "with rows that shrink after prefill: replay over shrunk rows is untested; add "
            "--disable-decode-cuda-graph, or use --mm-compress-at pressure or fill and "
            "--mm-compressed-reuse recompute",
        ),
    ]
    _refuse_first(mode, refusals)
    declared = checkpoint_kv_quantization(hf_config)
    if declared is not None and args.kv_cache_dtype == "auto" and _unscaled_backend(args):
        raise ConfigError(
            f"{mode} cannot run with the checkpoint's fp8 KV ({declared}, taken by "
            f"--kv-cache-dtype auto) on the {_unscaled_backend(args)} attention backend: "
            "it ignores the checkpoint's KV scales, which the refresh path applies; use "
            "a backend that applies them, or pass --kv-cache-dtype bf16"
        )
    check_model(mode, hf_config, config.compresses_at_decode)
    check_tp_heads(mode, args.tp_size, hf_config)
    if config.scored_layers is not None:
        check_scored_layers(config.scored_layers, hf_config)
    if config.uses_segment_storage:
        check_storage_backend(config.mm_segment_storage)


def check_tp_heads(mode: str, tp_size: int, hf_config: dict) -> None:
    """Refuse a TP size that does not divide the model's KV heads: each rank must hold
    whole heads of its own for its statistics to average into the model's."""
    text = hf_config.get("text_config") or hf_config
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    if tp_size > 1 and heads and heads % tp_size:
        raise ConfigError(
            f"{mode} cannot run with --tp-size {tp_size}: the model's {heads} KV heads "
            "do not divide into whole heads per rank"
        )


def checkpoint_kv_quantization(hf_config: dict) -> str | None:
    """What a checkpoint's quantization config declares for its KV cache
    (``kv_cache_scheme`` of compressed-tensors, ``kv_cache_quant_algo`` of ModelOpt and
    others), as SGLang's ``configure_kv_cache_dtype`` reads it with ``auto``; None if
    nothing."""
    for scope in (hf_config, hf_config.get("text_config") or {}):
        quant = scope.get("quantization_config")
        if not isinstance(quant, dict):
            continue
        scheme = quant.get("kv_cache_scheme")
        if isinstance(scheme, dict) and scheme:
            return f"kv_cache_scheme {json.dumps(scheme, sort_keys=True)}"
        algo = quant.get("kv_cache_quant_algo")
        if isinstance(algo, str) and algo:
            return f"kv_cache_quant_algo {algo}"
    return None


def check_pool_dtype(mode: str, kv_pool: Any) -> None:
    """Refuse a KV pool SGLang made with other than plain floating-point KV or fp8 KV
    with one scale per layer, whatever the flag said (``kv_pool.dtype`` is the pool's
    KV dtype; its buffers may store fp8 as bytes, ``get_key_buffer`` views them as
    fp8). A pool with scale buffers beside the KV (``k_scale_buffer``: mxfp8, fp4)
    or a KV quantization method (``is_quantized_kv_cache``) keeps per-token /
    per-block scales, which the refresh path does not apply."""
    import torch

    plain = (torch.bfloat16, torch.float16, torch.float32)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)
    dtypes = {getattr(kv_pool, "dtype", None), kv_pool.get_key_buffer(0).dtype}
    dtypes.discard(None)
    odd = sorted(str(d) for d in dtypes if d not in (*plain, *fp8))
    blocks = getattr(kv_pool, "k_scale_buffer", None) is not None or bool(
        getattr(kv_pool, "is_quantized_kv_cache", False)
    )
    if odd or blocks:
        named = " / ".join(odd or sorted(str(d) for d in dtypes))
        raise ConfigError(
            f"{mode} cannot run with a {named} KV pool ({type(kv_pool).__name__}, from "
            "--kv-cache-dtype or the checkpoint's KV quantization) that keeps per-token / "
            "per-block scales: segment copies and refresh attention apply one scale per "
            "layer (fp8_e4m3, fp8_e5m2); pass one of those or --kv-cache-dtype bf16"
        )


def check_storage_backend(name: str) -> None:
    """``name`` must be a backend of SGLang's ``StorageBackendFactory``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    known = sorted(StorageBackendFactory._registry)
    if name not in known:
        raise ConfigError(
            f"--mm-segment-storage {name!r} is unknown; choose none or one of "
            f"SGLang's storage backends: {', '.join(known)}"
        )


def _model_config(model_path: str) -> dict:
    """The model's Hugging Face config: ``config.json`` of a local directory, else what
    transformers resolves for ``model_path`` (a hub id in the local cache)."""
    path = Path(model_path) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path).to_dict()
    except Exception as exc:
        raise ConfigError(
            f"cannot read the config of {model_path} ({exc.__class__.__name__}): refresh "
            "modes check the model's architecture and rotary before starting"
        ) from exc


def _hf_config(model: dict | str) -> dict:
    return model if isinstance(model, dict) else _model_config(model)


def check_scored_layers(layers: tuple[int, ...], model: dict | str) -> None:
    """Refuse scorer ``layers`` the model does not have.

    Args:
        model: the model's Hugging Face config (a dict), or a path to read it from.
    """
    config = _hf_config(model)
    num_layers = (config.get("text_config") or config).get("num_hidden_layers")
    if num_layers is not None and max(layers) >= num_layers:
        raise ConfigError(
            f"--mm-refresh-scorer-args layers {list(layers)}: the model has {num_layers} "
            f"layers (ids 0-{num_layers - 1})"
        )


def rope_type(config: dict) -> str | None:
    """The rotary variant of a Hugging Face config (``rope_parameters`` in transformers
    5, ``rope_scaling`` before), for the text model when there is one."""
    for scope in (config.get("text_config") or {}, config):
        for field in ("rope_parameters", "rope_scaling"):
            params = scope.get(field)
            if isinstance(params, dict):
                kind = params.get("rope_type") or params.get("type")
                if kind not in UNSCALED_ROPE_TYPES:
                    return kind
    return None


def check_model(mode: str, model: dict | str, compresses_at_decode: bool = False) -> None:
    """Refuse a model whose class, rotary or attention the refresh path does not
    reproduce exactly, or that ``--mm-compress-at decode`` cannot shorten.

    Args:
        model: the model's Hugging Face config (a dict, after SGLang's overrides), or
            a path to read ``config.json`` from.
    """
    config = _hf_config(model)
    architectures = config.get("architectures") or ["unknown"]
    name = architectures[0]
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ConfigError(
            f"{mode} does not support {name} (supported: {supported}); use --mm-reuse exact or off"
        )
    if compresses_at_decode and name not in MROPE_ARCHITECTURES:
        raise ConfigError(
            f"--mm-compress-at decode does not support {name}: a shortened row keeps its "
            "decode positions through M-RoPE's per-request offset, which 1-D RoPE lacks"
        )
    kind = rope_type(config)
    if kind not in LINEAR_ROPE_TYPES:
        supported = ", ".join(k for k in LINEAR_ROPE_TYPES if k not in UNSCALED_ROPE_TYPES)
        raise ConfigError(
            f"{mode} does not support {name} with {kind} rotary scaling: its angle is not "
            f"linear in position, so a rotation cannot re-position reused keys "
            f"(supported scalings: {supported})"
        )
    text = config.get("text_config") or config
    if text.get("use_sliding_window"):
        raise ConfigError(f"{mode} does not support {name} with a sliding window")
