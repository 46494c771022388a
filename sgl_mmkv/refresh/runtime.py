"""What sgl_mmkv runs in this scheduler process, published once.

The radix cache (the composition root) builds the segment store, the refresh
executor, the row compactor and the embedding slot when SGLang builds the cache in
the scheduler process, and publishes them here as one :class:`MMKVRuntime`. Every
patch that runs in the scheduler reads it through :func:`current`, which fails
loudly if nothing was published (a patch running before the cache was built, or in
a process that has no cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sgl_mmkv.refresh.embedding_pass import EmbeddingSlot

if TYPE_CHECKING:
    from sgl_mmkv.refresh.executor import RefreshExecutor
    from sgl_mmkv.refresh.row_compaction import RowCompactor
    from sgl_mmkv.segments.store import SegmentStore


@dataclass(frozen=True, slots=True)
class MMKVRuntime:
    """Attributes:
    store: the segment store.
    executor: the refresh executor (``patches/eager_runner_execute_extend.py``).
    compactor: the row compactor, when rows shrink after their prefill
        (``patches/scheduler_run_batch.py``, ``patches/forward_batch_positions.py``).
    embedding_slot: the current refresh pass's embeddings
        (``patches/mm_embed_routine.py``).
    model_identity: the served model's identity (the storage fingerprint's part).
    metrics: the Prometheus gauges, with ``--enable-metrics``.
    """

    store: SegmentStore
    executor: RefreshExecutor
    compactor: RowCompactor | None
    embedding_slot: EmbeddingSlot
    model_identity: str
    metrics: object | None = None


_published: MMKVRuntime | None = None


def publish(runtime: MMKVRuntime) -> None:
    """Make ``runtime`` this process's; a second, different one is refused."""
    global _published
    if _published is not None and _published is not runtime:
        raise RuntimeError("sgl_mmkv's runtime is published once per scheduler process")
    _published = runtime


def current() -> MMKVRuntime:
    """This process's runtime; raises if none was published."""
    if _published is None:
        raise RuntimeError(
            "sgl_mmkv's runtime was read before its radix cache published it "
            "(a patch ran outside a scheduler with --radix-cache-backend sgl_mmkv)"
        )
    return _published
