"""sgl_mmkv's radix cache backend: a ``UnifiedRadixCache`` subclass.

Built by SGLang's cache registry (``--radix-cache-backend sgl_mmkv``) inside the
scheduler process. In ``exact`` mode it is the stock cache: the exact-prefix
match, insertion, locking and eviction all run SGLang's own code, so hits and
outputs equal stock SGLang's.

In a scorer mode (``conduit``, ``full``, ...) the factory also assembles this
process's runtime (``assembly.py``: segment store, refresh executor, row
compactor), attaches it to the cache and publishes it for the patches. The store's
slots count as evictable (``evictable_size``) and are freed by ``evict_for_alloc``
once the tree alone cannot cover an allocation; ``reset`` (``flush_cache``) drops
them with the pool.
"""

from __future__ import annotations

import dataclasses
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

from sgl_mmkv.assembly import assemble_runtime
from sgl_mmkv.config import ConfigError, MMKVConfig, active_config
from sgl_mmkv.metrics import MMKVMetrics, metrics_enabled
from sgl_mmkv.refresh.runtime import MMKVRuntime, publish
from sgl_mmkv.segments.fingerprint import embedding_layout, model_identity
from sgl_mmkv.segments.index import SegmentIndex
from sgl_mmkv.segments.key import item_key, item_span, request_namespace, tag_namespace
from sgl_mmkv.segments.store import SegmentStore
from sgl_mmkv.support import check_startup

logger = logging.getLogger(__name__)

ACTIVE_LOG_PREFIX = "sgl_mmkv: radix cache active"


class MMKVRadixCache(UnifiedRadixCache):
    """SGLang's unified radix cache plus sgl_mmkv's modality-aware reuse.

    Invariant: every KV slot in the tree has exactly one owner (the tree), as in
    stock; nothing here frees or inserts slots beyond what the base class does.
    """

    def __init__(self, params: CacheInitParams) -> None:
        config = _config_or_refuse()
        self.segment_store: SegmentStore | None = None  # read by reset() in super().__init__
        self.refresh_executor = None
        self.row_compactor = None
        super().__init__(params)
        self.mmkv_config: MMKVConfig = config
        self.segment_index = SegmentIndex()
        self.metrics = MMKVMetrics(config.mm_report_reuse) if metrics_enabled() else None
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
        items are classed (``SegmentIndex``).

        With ``--mm-segment-fill canonical`` a match that ends inside a new image, or
        right at its start, is matched again one token before the image: the
        canonical fill computes a new image alone after its own preceding token
        (``<|vision_start|>``), which must be in the extend. It costs the request
        that one token; otherwise the match is returned unchanged."""
        result = super().match_prefix(params)
        cut = self._canonical_cut(params, result.device_prefix_len)
        if cut is not None:
            result = super().match_prefix(dataclasses.replace(params, key=params.key[:cut]))
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

    def _canonical_cut(self, params: MatchPrefixParams, matched: int) -> int | None:
        """The shorter key length for a canonical fill (see :meth:`match_prefix`)."""
        config, store, req = self.mmkv_config, self.segment_store, params.req
        if req is None or store is None or config.mm_segment_fill != "canonical" or not matched:
            return None
        try:
            namespace = request_namespace(req)
            cuts = []
            for item in getattr(req.multimodal_inputs, "mm_items", None) or []:
                span = item_span(item)
                if span is None or not span[0] - 1 < matched < span[1]:
                    continue
                if item_key(item, namespace, span[1] - span[0]) not in store:
                    cuts.append(span[0] - 1)
            return min(cuts) if cuts else None
        except Exception as error:  # the stock match stands
            logger.warning("sgl_mmkv: canonical match cut failed (%r)", error)
            return None

    def attach(self, runtime: MMKVRuntime) -> None:
        """Serve with ``runtime``'s segment store, executor and row compactor (a
        refresh mode; ``build_mmkv_radix_cache`` assembles and publishes it)."""
        self.segment_store = runtime.store
        self.refresh_executor = runtime.executor
        self.row_compactor = runtime.compactor

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
        """Counters to Prometheus (``--enable-metrics``; only the coarse ones without
        ``--mm-report-reuse``, see :mod:`sgl_mmkv.metrics`); a no-op otherwise."""
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


def _config_or_refuse() -> MMKVConfig:
    config = active_config()
    if config is None or not config.uses_mmkv_cache:
        raise ConfigError(
            "--radix-cache-backend sgl_mmkv needs sgl_mmkv's config: start the server "
            "with `python -m sgl_mmkv.launch_server --mm-reuse exact ...`"
        )
    return config


def build_mmkv_radix_cache(ctx: TreeCacheBuildContext) -> MMKVRadixCache:
    """Factory registered with ``register_radix_cache_backend``: every way of starting
    a server with this backend comes here, so it runs sgl_mmkv's start-up checks on
    SGLang's effective configuration (the resolved server args, the HF config after
    overrides) and stops the scheduler with the one-line reason of a refusal."""
    config = _config_or_refuse()
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.runtime_context import get_server_args

    args, hf_config = resolved_view(get_server_args()), ctx.model_config.hf_config.to_dict()
    try:
        check_startup(config, args, hf_config)
    except ConfigError as refusal:
        raise ConfigError(f"sgl_mmkv refuses to start: {refusal}") from None
    cache = create_unified_radix_cache(ctx, cache_class=MMKVRadixCache)
    if config.uses_refresh:
        model = ctx.model_config
        runner = getattr(ctx.tp_worker, "model_runner", None)
        runtime = assemble_runtime(
            config,
            cache,
            model_identity(model),
            embedding_layout(model),
            getattr(runner, "model", None),
        )
        cache.attach(runtime)
        publish(runtime)
    return cache
