"""The composition root of a refresh mode: this scheduler's runtime, built once.

:func:`assemble_runtime` builds the segment store (with its L3 storage), the
refresh scorer, the eviction ranker and row compactor of a scored ``--mm-evict``,
and the refresh executor, from the config and the radix cache SGLang just built;
``radix_cache.build_mmkv_radix_cache`` attaches the result to the cache and
publishes it (``refresh/runtime.py``) for the patches.
"""

from __future__ import annotations

import logging
from typing import Any

from sgl_mmkv.config import ConfigError, MMKVConfig
from sgl_mmkv.refresh.embedding_pass import EmbeddingSlot
from sgl_mmkv.refresh.executor import RefreshExecutor
from sgl_mmkv.refresh.kv_scales import read_scales
from sgl_mmkv.refresh.rank_agreement import RankAgreement, tp_position
from sgl_mmkv.refresh.ranker import VisualRanker, extend_image_spans, fill_spans
from sgl_mmkv.refresh.row_compaction import RowCompactor
from sgl_mmkv.refresh.runtime import MMKVRuntime
from sgl_mmkv.scoring import make_eviction_scorer, make_refresh_scorer
from sgl_mmkv.segments.storage import GIB
from sgl_mmkv.segments.store import SegmentStore
from sgl_mmkv.support import check_pool_dtype

logger = logging.getLogger(__name__)


def assemble_runtime(
    config: MMKVConfig,
    cache: Any,
    identity: str,
    embeds: tuple[int, str] = (0, ""),
    model: Any = None,
) -> MMKVRuntime:
    """This process's runtime for ``config`` over the pools of ``cache`` (the
    ``MMKVRadixCache`` SGLang just built); ``identity`` is the served model's and
    ``embeds`` its vision encoder's output layout (the storage fingerprint's parts);
    ``model`` the loaded model, whose attention layers hold an fp8 pool's scales
    (None: scales of 1)."""
    shrinking = config.compresses_at_decode or config.reuses_with_holes
    if cache.page_size != 1 and shrinking:  # check_server_args refuses it first
        raise ConfigError(
            f"--mm-reuse {config.mm_reuse} with rows that shrink after prefill needs "
            f"--page-size 1 (got {cache.page_size})"
        )
    allocator = cache.token_to_kv_pool_allocator
    kv_pool = allocator.get_kvcache()
    check_pool_dtype(f"--mm-reuse {config.mm_reuse}", kv_pool)
    compress = config.mm_kv_budget if config.uses_scored_eviction else None
    store = SegmentStore(
        allocator,
        kv_pool,
        compress,
        _storage(config, kv_pool, identity, embeds, read_scales(model, kv_pool).digest()),
        embeddings_max_bytes=int(config.mm_embeddings_max_gib * GIB),
    )
    ranker, compactor = None, None
    if config.uses_scored_eviction:
        if config.compresses_at_decode or config.reuses_with_holes:
            decode_budget = config.mm_kv_budget if config.compresses_at_decode else None
            compactor = RowCompactor(
                decode_budget, config.reuses_with_holes, RankAgreement.shared()
            )
        spans_of = extend_image_spans if config.compresses_at_decode else fill_spans
        scorer = make_eviction_scorer(config.mm_evict)
        ranker = VisualRanker(scorer, config.mm_kv_budget, spans_of, RankAgreement.shared())
    slot = EmbeddingSlot()
    kernel_ok = prove_refresh_kernel(kv_pool)
    executor = RefreshExecutor.from_config(
        config,
        store,
        make_refresh_scorer(config.mm_reuse, **config.refresh_scorer_knobs()),
        ranker,
        compactor,
        on_forward=cache.publish_metrics,
        embedding_slot=slot,
    )
    executor.counters.kernel_reference = int(not kernel_ok)
    return MMKVRuntime(store, executor, compactor, slot, identity, cache.metrics)


def prove_refresh_kernel(kv_pool) -> bool:
    """On a device whose refresh passes would run the Triton kernel, check it against
    the reference once (:func:`~sgl_mmkv.kernels.self_check.check_refresh_kernel`).
    A mismatch or a Python error serves every refresh pass with the reference SDPA
    path instead (exact, slower; logged once and counted in ``/metrics`` as
    ``refresh_kernel_reference``) rather than refusing the start: reuse stays right
    and on. A fault that leaves the device unusable raises, and the start fails.
    Returns False when it fell back."""
    import os

    import torch

    from sgl_mmkv.kernels.refresh_attention import KERNEL_ENV, default_kernel
    from sgl_mmkv.kernels.self_check import check_refresh_kernel

    k0 = kv_pool.get_key_buffer(0)
    if default_kernel(k0.device) != "triton":
        return True
    v0 = kv_pool.get_value_buffer(0)
    try:
        reason = check_refresh_kernel(k0.device, k0.dtype, k0.shape[1], k0.shape[2], v0.shape[2])
    except getattr(torch, "AcceleratorError", ()):  # the device is unusable: no start
        raise
    except Exception as error:
        first = (str(error).splitlines() or [""])[0]
        reason = f"the Triton refresh kernel failed ({error.__class__.__name__}: {first})"
    if reason is None:
        logger.info("sgl_mmkv: the Triton refresh kernel matches the reference on %s", k0.device)
        return True
    os.environ[KERNEL_ENV] = "sdpa"
    logger.warning("sgl_mmkv: %s; refresh passes use the reference SDPA path", reason)
    return False


def _storage(config: MMKVConfig, kv_pool, identity: str, embeds: tuple[int, str], kv_scales: str):
    """The L3 segment storage of ``--mm-segment-storage``, or None; ``kv_scales``: the
    digest of an fp8 pool's scales (the fingerprint's)."""
    if not config.uses_segment_storage:
        return None
    from sgl_mmkv.segments.storage import KVFingerprint, StorageLimits, open_storage

    storage = open_storage(
        config.mm_segment_storage,
        KVFingerprint.of_pool(
            kv_pool, identity, config.mm_segment_fill, embeds, kv_scales, tp_position()
        ),
        config.mm_segment_storage_dir or None,
        config.storage_extra_config(),
        StorageLimits.of_config(config),
    )
    logger.info(
        "sgl_mmkv: segment storage %s dir=%r fingerprint=%s",
        config.mm_segment_storage,
        config.mm_segment_storage_dir,
        storage.fingerprint,
    )
    return storage
