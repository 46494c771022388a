"""sgl_mmkv's radix cache backend: a ``UnifiedRadixCache`` subclass.

Built by SGLang's cache registry (``--radix-cache-backend sgl_mmkv``) inside the
scheduler process. In ``exact`` mode it is the stock cache: the exact-prefix
match, insertion, locking and eviction all run SGLang's own code, so hits and
outputs equal stock SGLang's. Segment matching hooks in here in later modes.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_mmkv.config import MMKVConfig, active_config
from sgl_mmkv.segments.index import SegmentIndex

logger = logging.getLogger(__name__)

ACTIVE_LOG_PREFIX = "sgl_mmkv: radix cache active"


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
        super().__init__(params)
        self.mmkv_config: MMKVConfig = config
        self.segment_index = SegmentIndex()
        logger.info(
            "%s: class=%s mode=%s refresh_budget=%s pid=%d",
            ACTIVE_LOG_PREFIX,
            type(self).__name__,
            config.mm_reuse,
            config.mm_refresh_budget,
            os.getpid(),
        )

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Stock exact-prefix match, then the request's image items are classed
        (``SegmentIndex``); the match itself is returned unchanged."""
        result = super().match_prefix(params)
        if params.req is not None:
            counts = self.segment_index.observe(params.req, result.device_prefix_len)
            if counts is not None:
                logger.debug("sgl_mmkv: rid=%s image segments %s", params.req.rid, counts)
        return result

    def mmkv_stats(self) -> dict:
        """What ``/get_server_info`` shows under ``internal_states[i]["sgl_mmkv"]``."""
        return {
            "mode": self.mmkv_config.mm_reuse,
            "refresh_budget": self.mmkv_config.mm_refresh_budget,
            "segments": self.segment_index.counters.as_dict(),
        }


def build_mmkv_radix_cache(ctx: TreeCacheBuildContext) -> MMKVRadixCache:
    """Factory registered with ``register_radix_cache_backend``."""
    return create_unified_radix_cache(ctx, cache_class=MMKVRadixCache)
