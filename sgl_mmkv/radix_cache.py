"""sgl_mmkv's radix cache backend: a ``UnifiedRadixCache`` subclass.

Built by SGLang's cache registry (``--radix-cache-backend sgl_mmkv``) inside the
scheduler process. In ``exact`` mode it is the stock cache: the exact-prefix
match, insertion, locking and eviction all run SGLang's own code, so hits and
outputs equal stock SGLang's.

In a scorer mode (``conduit``, ``full``, ...) it also owns the segment store and
the refresh executor of this process. The store's slots count as evictable
(``evictable_size``) and are freed by ``evict_for_alloc`` once the tree alone
cannot cover an allocation; ``reset`` (``flush_cache``) drops them with the pool.
"""

from __future__ import annotations

import hashlib
import logging
import os

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_mmkv.config import MMKVConfig, active_config
from sgl_mmkv.metrics import MMKVMetrics, metrics_enabled
from sgl_mmkv.segments.index import SegmentIndex
from sgl_mmkv.segments.key import tag_namespace
from sgl_mmkv.segments.store import SegmentStore

logger = logging.getLogger(__name__)

ACTIVE_LOG_PREFIX = "sgl_mmkv: radix cache active"
# The model's identity for the L3 storage fingerprint, recorded by the factory
# (build_mmkv_radix_cache) from SGLang's ModelConfig before the cache is built.
_model_identity: str = "unknown"


class MMKVRadixCache(UnifiedRadixCache):
    """SGLang's unified radix cache plus sgl_mmkv's modality-aware reuse.

    Invariant: every KV slot in the tree has exactly one owner (the tree), as in
    stock; nothing here frees or inserts slots beyond what the base class does.
    """

    def __init__(self, params: CacheInitParams) -> None:
        config = active_config()
        if config is None or not config.uses_mmkv_cache:
            raise RuntimeError(
                "--radix-cache-backend sgl_mmkv needs sgl_mmkv's config: start the server "
                "with `python -m sgl_mmkv.launch_server --mm-reuse exact ...`"
            )
        self.segment_store: SegmentStore | None = None  # read by reset() in super().__init__
        self.refresh_executor = None
        self.row_compactor = None  # read by the run_batch patch
        super().__init__(params)
        self.mmkv_config: MMKVConfig = config
        self.segment_index = SegmentIndex()
        self.metrics = MMKVMetrics() if metrics_enabled() else None
        if config.uses_refresh:
            self._start_refresh(config)
        logger.info(
            "%s: class=%s mode=%s refresh_budget=%s pid=%d file=%s",
            ACTIVE_LOG_PREFIX,
            type(self).__name__,
            config.mm_reuse,
            config.mm_refresh_budget,
            os.getpid(),
            __file__,
        )

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Stock exact-prefix match, then the request's namespace is recorded on its
        multimodal inputs (the segment store's lookups and fills use it) and its image
        items are classed (``SegmentIndex``); the match itself is returned unchanged."""
        result = super().match_prefix(params)
        if params.req is not None:
            try:
                tag_namespace(params.req)
                counts = self.segment_index.observe(params.req, result.device_prefix_len)
                if counts is not None:
                    logger.debug("sgl_mmkv: rid=%s image segments %s", params.req.rid, counts)
                self.publish_metrics()
            except Exception as error:  # an untagged request reuses nothing: stock
                logger.warning("sgl_mmkv: match bookkeeping failed (%r)", error)
        return result

    def _start_refresh(self, config: MMKVConfig) -> None:
        from sgl_mmkv.refresh.executor import RefreshExecutor
        from sgl_mmkv.refresh.runtime import set_active_executor
        from sgl_mmkv.scoring import make_refresh_scorer

        if self.page_size != 1:
            raise RuntimeError(
                f"--mm-reuse {config.mm_reuse} needs --page-size 1 (got {self.page_size})"
            )
        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        compress = config.mm_kv_budget if config.uses_scored_eviction else None
        storage = None
        if config.uses_segment_storage:
            from sgl_mmkv.segments.storage import KVFingerprint, open_storage

            storage = open_storage(
                config.mm_segment_storage,
                KVFingerprint.of_pool(kv_pool, _model_identity),
                config.mm_segment_storage_dir or None,
                config.storage_extra_config(),
            )
            logger.info(
                "sgl_mmkv: segment storage %s dir=%r fingerprint=%s",
                config.mm_segment_storage,
                config.mm_segment_storage_dir,
                storage.fingerprint,
            )
        self.segment_store = SegmentStore(
            self.token_to_kv_pool_allocator, kv_pool, compress, storage
        )
        ranker = None
        if config.uses_scored_eviction:
            from sgl_mmkv.refresh import ranker as ranking
            from sgl_mmkv.scoring import make_eviction_scorer

            spans_of = ranking.fill_spans
            if config.compresses_at_decode or config.reuses_with_holes:
                from sgl_mmkv.refresh.row_compaction import RowCompactor

                decode_budget = config.mm_kv_budget if config.compresses_at_decode else None
                self.row_compactor = RowCompactor(decode_budget, holes=config.reuses_with_holes)
            if config.compresses_at_decode:
                spans_of = ranking.extend_image_spans
            ranker = ranking.VisualRanker(
                make_eviction_scorer(config.mm_evict), config.mm_kv_budget, spans_of
            )
        self.refresh_executor = RefreshExecutor(
            self.segment_store,
            make_refresh_scorer(config.mm_reuse, **config.refresh_scorer_knobs()),
            config.mm_refresh_budget,
            fill_policy=config.mm_segment_fill,
            gate=config.mm_reuse_gate,
            ranker=ranker,
            compress_on_fill=config.mm_compress_at == "fill",
            row_compactor=self.row_compactor,
            report_reuse=config.mm_report_reuse,
            on_forward=self.publish_metrics,
        )
        set_active_executor(self.refresh_executor)

    # -- the store in SGLang's accounting ------------------------------------------------

    def evictable_size(self) -> int:
        store = self.segment_store.num_tokens if self.segment_store is not None else 0
        return super().evictable_size() + store

    def full_evictable_size(self) -> int:
        store = self.segment_store.num_tokens if self.segment_store is not None else 0
        return super().full_evictable_size() + store

    def evict_for_alloc(self, params: EvictParams, **kwargs) -> EvictResult:
        """Room for ``params.num_tokens`` slots: see :meth:`_evict_with_segments`."""
        return self._evict_with_segments(super().evict_for_alloc, params, **kwargs)

    def evict(self, params: EvictParams) -> EvictResult:
        return self._evict_with_segments(super().evict, params)

    def _evict_with_segments(self, stock_evict, params: EvictParams, **kwargs) -> EvictResult:
        """Stock eviction of tree leaves, then compression of scored segments
        (``--mm-evict`` scorer), then whole segments by LRU for what is still short.

        The tree goes first: its rows serve exact-prefix repeats only, while a
        segment serves its image under any prefix (and a leaf holding an image is a
        second copy of a stored segment)."""
        store = self.segment_store
        if store is None:
            return stock_evict(params, **kwargs)
        allocator = self.token_to_kv_pool_allocator
        target = allocator.available_size() + params.num_tokens
        result = stock_evict(params, **kwargs)
        shortfall = target - allocator.available_size()
        if shortfall > 0:
            result.num_tokens_evicted += store.compress_for(shortfall)
        shortfall = target - allocator.available_size()
        if shortfall > 0:
            result.num_tokens_evicted += store.evict_lru(shortfall)
        return result

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if self.row_compactor is not None:
            try:
                self.row_compactor.restore(req)
            except Exception as error:
                logger.warning("sgl_mmkv: restoring rid=%s failed (%r)", req.rid, error)

    def reset(self) -> None:
        if self.segment_store is not None:
            # flush_cache clears the allocator right after resetting the cache.
            self.segment_store.clear(free_slots=False)
        if getattr(self, "segment_index", None) is not None:
            self.segment_index.forget_contents()
        super().reset()

    def counter_groups(self) -> dict[str, dict[str, int | float]]:
        """Every server-wide counter set, by group (what metrics and server info show)."""
        groups = {"segments": self.segment_index.counters.as_dict()}
        if self.segment_store is not None:
            groups["store"] = self.segment_store.stats()
            if self.segment_store.storage is not None:
                groups["storage"] = self.segment_store.storage.counters.as_dict()
            groups["refresh"] = self.refresh_executor.counters.as_dict()
        if self.row_compactor is not None:
            groups["row_compaction"] = self.row_compactor.counters.as_dict()
        return groups

    def publish_metrics(self) -> None:
        """Counters to Prometheus (``--enable-metrics``); a no-op otherwise."""
        if self.metrics is not None:
            self.metrics.publish(self.counter_groups())

    def mmkv_stats(self) -> dict:
        """What ``/get_server_info`` shows under ``internal_states[i]["sgl_mmkv"]``."""
        stats = {
            "mode": self.mmkv_config.mm_reuse,
            "refresh_budget": self.mmkv_config.mm_refresh_budget,
            "evict": self.mmkv_config.mm_evict,
            "kv_budget": self.mmkv_config.mm_kv_budget,
            **self.counter_groups(),
        }
        if self.refresh_executor is not None:
            stats["refresh_scorer"] = repr(self.refresh_executor.scorer)
        if self.segment_store is not None:
            stats["pool"] = self.pool_ledger()
        return stats

    def pool_ledger(self) -> dict[str, int | bool]:
        """Where every KV slot is: free, in the tree (``tree_protected`` of it locked by
        running requests), in the segment store, or held by running requests outside
        the tree (``in_use``); ``free_unique`` is False after a double free."""
        allocator = self.token_to_kv_pool_allocator
        free = allocator.get_all_free_pages() if hasattr(allocator, "get_all_free_pages") else None
        available = allocator.available_size()
        tree = super().evictable_size() + super().protected_size()
        store = self.segment_store.num_tokens if self.segment_store is not None else 0
        return {
            "size": int(allocator.size),
            "available": int(available),
            "tree": int(tree),
            "tree_protected": int(super().protected_size()),
            "store": int(store),
            "in_use": int(allocator.size - available - tree - store),
            "free_unique": bool(free is None or free.unique().numel() == free.numel()),
        }


def build_mmkv_radix_cache(ctx: TreeCacheBuildContext) -> MMKVRadixCache:
    """Factory registered with ``register_radix_cache_backend``."""
    config = active_config()
    if config is not None and config.compresses_at_decode and not ctx.model_config.model_is_mrope:
        raise RuntimeError(
            "--mm-compress-at decode shortens each request's row and moves its decode "
            "positions by M-RoPE's per-request offset; "
            f"{ctx.model_config.hf_config.architectures} has no M-RoPE (use a Qwen2-VL-style model)"
        )
    global _model_identity
    _model_identity = model_identity(ctx.model_config)
    return create_unified_radix_cache(ctx, cache_class=MMKVRadixCache)


def model_identity(model_config) -> str:
    """``path@revision#<sha256 of the HF config>[:16]``: what must match for two servers
    to share stored segments (with the KV dtype and layout, ``KVFingerprint``)."""
    try:
        text = model_config.hf_config.to_json_string()
    except Exception:  # a config transformers cannot serialise: the path alone
        text = ""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{model_config.model_path}@{getattr(model_config, 'revision', None)}#{digest}"
