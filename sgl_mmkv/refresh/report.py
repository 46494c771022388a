"""What a refresh forward reports: server-wide counters, and per request on request.

Counters are always kept (``/get_server_info`` and ``/metrics`` show them to the
operator). Per-request reuse facts (a log line, ``meta_info["sgl_mmkv"]``) tell a
caller whether another client sent an image, so they are given only with
``--mm-report-reuse``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sgl_mmkv.counters import Counters
from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.embedding_pass import EmbeddingPass

logger = logging.getLogger(__name__)

META_INFO_KEY = "sgl_mmkv"


@dataclass(slots=True)
class RefreshCounters(Counters):
    """Server-wide token counts of refresh forwards."""

    refresh_forwards: int = 0
    reused_tokens: int = 0
    hole_tokens: int = 0  # dropped tokens of reused compressed segments left out
    refreshed_tokens: int = 0
    declined_reuses: int = 0
    stock_batches: int = 0  # batches with reuse run as stock (every row's outputs asked)
    fallbacks: int = 0  # forwards our path failed, served again by the stock extend
    # --tp-size > 1: requests whose plans differed between ranks (reused nothing), and
    # the collectives run to make the ranks agree (rank_agreement.py)
    rank_disagreements: int = 0
    rank_collectives: int = 0
    rank_seconds: float = 0.0
    # 1: the Triton refresh kernel failed its start-up check; the SDPA path serves
    kernel_reference: int = 0
    skipped_refresh_passes: int = 0  # last rows alone to run: the scoring pass's output stood
    recomputed_tokens: int = 0
    executed_flops: int = 0
    full_prefill_flops: int = 0
    seconds: float = 0.0
    ranking_seconds: float = 0.0
    # wall time by phase of refresh forwards (host clock: on CUDA without a
    # synchronize they time the launches); embedding build is its own phase
    plan_seconds: float = 0.0
    copy_seconds: float = 0.0
    embedding_seconds: float = 0.0
    scoring_seconds: float = 0.0
    refresh_seconds: float = 0.0
    fill_seconds: float = 0.0


@contextmanager
def phase(counters: RefreshCounters, name: str, embeddings: EmbeddingPass) -> Iterator[None]:
    """Add the block's wall time to counter ``{name}_seconds``, less the time it spent
    building ``embeddings`` (counted in ``embedding_seconds`` instead)."""
    started, embedded = time.perf_counter(), embeddings.seconds
    try:
        yield
    finally:
        built = embeddings.seconds - embedded
        counters.embedding_seconds += built
        field = f"{name}_seconds"
        elapsed = time.perf_counter() - started - built
        setattr(counters, field, getattr(counters, field) + elapsed)


class ReuseReporter:
    """Args:
    method: the ``--mm-reuse`` method's name.
    counters: the executor's counters.
    per_request: ``--mm-report-reuse``.
    on_forward: called after every extend's counters are updated (metrics).
    """

    def __init__(
        self,
        method: str,
        counters: RefreshCounters,
        per_request: bool = False,
        on_forward: Callable[[], None] | None = None,
    ) -> None:
        self.method = method
        self.counters = counters
        self.per_request = per_request
        self.on_forward = on_forward
        # rid -> (facts so far, segment keys, row end) of the last reported forward's
        # requests: SGLang keeps only a request's last prefill chunk's customized_info,
        # so a chunked request's facts are carried into its next chunk's (the extend
        # that starts where the last one ended; a prefill again after a retraction
        # starts anew)
        self._carried: dict[str, tuple[dict, frozenset, int]] = {}

    def report(
        self,
        ctx: ExtendContext,
        selected: list[torch.Tensor] | None,
        out,
        seconds: float,
    ) -> None:
        """Count one extend forward (``selected``: None when nothing was reused)."""
        c = self.counters
        if selected is not None:
            c.refresh_forwards += 1
            c.seconds += seconds
        infos, carried = [], {}
        rids = getattr(ctx.forward_batch, "rids", None) or [None] * len(ctx.plans)
        for i, plan in enumerate(ctx.plans):
            reused = plan.reused_tokens
            holes = int(plan.hole_mask().sum())
            refreshed = 0 if selected is None else int(selected[i].numel())
            recomputed = plan.extend_len - reused - holes + refreshed
            c.reused_tokens += reused
            c.hole_tokens += holes
            c.refreshed_tokens += refreshed
            c.recomputed_tokens += recomputed
            counts = {
                "reused_tokens": reused,
                "hole_tokens": holes,
                "refreshed_tokens": refreshed,
                "recomputed_tokens": recomputed,
            }
            if plan.spans and self.per_request:
                chunk = {"method": self.method, "reused_segments": len(plan.spans), **counts}
                logger.info("sgl_mmkv: rid=%s %s", rids[i] if rids[i] else i, chunk)
            before, keys, end = self._carried.get(rids[i], ({}, frozenset(), -1))
            if end != plan.prefix_len:
                before, keys = {}, frozenset()
            keys = keys | {span.segment.key for span in plan.spans}
            info = {"method": self.method, "reused_segments": len(keys)}
            info |= {k: v + before.get(k, 0) for k, v in counts.items()}
            infos.append(info)
            if self.per_request and rids[i] is not None:
                carried[rids[i]] = (info, keys, plan.seq_len)
        self._carried = carried
        if self.on_forward is not None:
            self.on_forward()
        logits_output = getattr(out, "logits_output", out)
        if self.per_request and hasattr(logits_output, "customized_info"):
            extra = dict(logits_output.customized_info or {})
            extra[META_INFO_KEY] = infos
            logits_output.customized_info = extra
