"""Filling the segment store with the new images of an extend batch.

Policy ``first`` copies the KV the request computed for the image; ``canonical``
recomputes each new image alone (after its ``<|vision_start|>``) in one pass
whose attention is local to each image, writing straight into store slots. An
image that cannot be computed alone in its extend (it starts at or crosses a chunk
boundary, sits in the cached prefix, or directly follows another image) is not
stored under ``canonical`` (counted in ``store.canonical_skipped``): a canonical
segment never holds a request's context. With scored eviction each new segment
carries the ranking of its tokens, and with ``--mm-compress-at fill`` it is
compressed at once. Each new segment keeps its image's vision-encoder output as the
forward's embedding build captured it (``refresh/segment_embeddings.py``), and a
segment reused without one (loaded from an entry that had none) gets it then.

At ``--tp-size`` > 1 the canonical pass runs the model's all-reduces, so every rank
runs it over the same images: the candidates come from the agreed plans, and one
MIN all-reduce of a flag per candidate (its store slots reserved) and a failure flag
keeps the images every rank reserved, or sends every rank to stock.
"""

from __future__ import annotations

import torch

from sgl_mmkv.refresh.attention_backend import GroupLocalAttentionBackend
from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.passes import run_pass
from sgl_mmkv.refresh.rank_agreement import PeerFailed, RankAgreement
from sgl_mmkv.segments.key import SegmentKey
from sgl_mmkv.segments.store import SegmentStore


class SegmentFiller:
    """Args:
    store: the segment store.
    counters: the executor's ``RefreshCounters`` (FLOPs).
    fill_policy: ``first`` or ``canonical``.
    compress_budget: compress each ranked segment to this budget as soon as it is
        stored (``--mm-compress-at fill``); None keeps it whole.
    agreement: the TP ranks' agreement (a no-op at TP 1).
    """

    def __init__(
        self,
        store: SegmentStore,
        counters,
        fill_policy: str = "first",
        compress_budget: float | None = None,
        agreement: RankAgreement | None = None,
    ) -> None:
        self.store = store
        self.counters = counters
        self.fill_policy = fill_policy
        self.compress_budget = compress_budget
        self.agreement = agreement or RankAgreement()

    def fill(
        self,
        ctx: ExtendContext,
        rankings: dict[SegmentKey, torch.Tensor] | None,
        error: BaseException | None = None,
    ) -> BaseException | None:
        """Store the batch's new images, each with its eviction ranking from
        ``rankings`` (content key -> ``(n,)``) when it has one. ``canonical`` needs
        the token before the image in this extend; an image without it is not
        stored (``store.canonical_skipped``).

        ``error``: this rank's failure earlier in the tail: nothing is stored, but the
        canonical pass's stage check still runs. Returns the error to carry on (that
        one, or this stage's own); raises :class:`PeerFailed` on every rank if any
        rank failed before the canonical pass."""
        rankings = rankings or {}
        canonical = [
            (plan, fill)
            for plan in ctx.plans
            for fill in plan.fills
            if self.fill_policy == "canonical" and fill.start > plan.prefix_len
        ]
        embeddings = {}
        if error is None:
            try:
                embeddings = ctx.embedding_slot.take_captured()
                for plan in ctx.plans:
                    for fill in plan.fills:
                        if self.fill_policy != "canonical":
                            self._copy_fill(ctx, plan, fill, rankings, embeddings.get(fill.key))
                        elif fill.start <= plan.prefix_len:
                            self.store.counters.canonical_skipped += 1
            except Exception as caught:
                error = caught
        if canonical:
            error = self._fill_canonical(ctx, canonical, rankings, embeddings, error)
        if error is not None:
            return error
        try:
            self._finish(embeddings, rankings)
        except Exception as caught:
            return caught
        return None

    def _finish(self, embeddings, rankings) -> None:
        """Embeddings for segments that had none (an older entry), compression at
        fill."""
        for key, rows in embeddings.items():
            segment = self.store.peek(key)
            if segment is not None and segment.embeddings is None:
                self.store.gain_embeddings(segment, rows)
        if self.compress_budget is not None:
            for key in rankings:
                segment = self.store.peek(key)
                if segment is not None:
                    self.store.compress(segment, self.compress_budget)
        fault_point("fill")

    def _copy_fill(self, ctx: ExtendContext, plan, fill, rankings, embeddings) -> None:
        """Store ``fill`` from the KV the request computed for it (policy ``first``),
        with its image's ``embeddings`` ``(rows, W)`` if captured."""
        pool_index = ctx.forward_batch.req_pool_indices[plan.index]
        row = ctx.model_runner.req_to_token_pool.req_to_token[pool_index]
        ranking = (rankings or {}).get(fill.key)
        src = row[fill.start : fill.end].to(torch.long)
        self.store.fill(fill.key, src, fill.positions, ranking, embeddings)

    def _fill_canonical(
        self, ctx: ExtendContext, fills, rankings, embeddings, error: BaseException | None
    ) -> BaseException | None:
        """One pass over ``[token before the image, image tokens]`` of every fill, each
        group attending to itself only, at the request's positions; the image rows'
        KV goes straight into fresh store slots. The request's own KV is untouched.
        Returns the error to carry on (raises :class:`PeerFailed` at TP > 1 if any
        rank failed before the pass)."""
        reserved: list = [None] * len(fills)
        if error is None:
            try:
                self._reserve(fills, rankings, embeddings, reserved)
            except Exception as caught:
                error = caught
        agreed = self.agreement.all_of([s is not None for s in reserved] + [error is None])
        if not agreed[-1]:
            self._discard(reserved)
            if self.agreement.active:
                raise PeerFailed("fill") from error
            return error
        for i, ok in enumerate(agreed[:-1]):
            if reserved[i] is not None and not ok:  # another rank could not reserve it
                self._discard([reserved[i]])
                reserved[i] = None
        pairs = zip(fills, reserved, strict=True)
        chosen = [(plan, fill, s) for (plan, fill), s in pairs if s is not None]
        if chosen:
            self._run_canonical(ctx, chosen)
        return None

    def _discard(self, segments) -> None:
        for segment in segments:
            if segment is not None:
                segment.pinned = False
                self.store.discard(segment.key)

    def _reserve(self, fills, rankings, embeddings, reserved: list) -> None:
        """Store slots for each of ``fills`` that can be computed alone (``reserved[i]``
        its pinned segment, None for one skipped or refused)."""
        grouped: set[tuple[int, int]] = set()  # (request, row) covered by a group
        for i, (plan, fill) in enumerate(fills):
            if (plan.index, fill.start - 1) in grouped:  # no token of its own before it
                self.store.counters.canonical_skipped += 1
                continue
            segment = self.store.reserve(
                fill.key, fill.end - fill.start, fill.positions, rankings.get(fill.key)
            )
            if segment is None:
                continue
            segment.pinned = True  # not evicted or compressed before its KV is written
            reserved[i] = segment  # discarded if anything fails before its KV is written
            if fill.key in embeddings:
                self.store.attach_embeddings(segment, embeddings[fill.key])
            grouped.update((plan.index, row) for row in range(fill.start - 1, fill.end))

    def _run_canonical(self, ctx: ExtendContext, chosen) -> None:
        """The canonical pass over ``chosen`` ``(plan, fill, reserved segment)``; at
        TP > 1 the ranks check its preparation before the pass's all-reduces."""
        segments = [segment for _, _, segment in chosen]
        prepared, error = None, None
        try:
            prepared = self._prepare_canonical(ctx, chosen)
        except Exception as caught:
            error = caught
        try:
            self.agreement.check(error, "fill")
            active, backend = prepared
            run_pass(ctx, active, backend=backend)
        except BaseException:
            self._discard(segments)
            raise
        finally:
            for segment in segments:
                segment.pinned = False
            ctx.embedding_slot.take_captured()  # the pass's own build, if any: taken above
        for segment in segments:  # its KV is complete now: on to the L3 storage, if any
            self.store.write_through(segment)

    def _prepare_canonical(self, ctx: ExtendContext, chosen):
        """``(active rows per request, group-local backend)`` of the canonical pass,
        its FLOPs counted."""
        extend_lens = ctx.forward_batch.extend_seq_lens_cpu
        group = [torch.full((int(n),), -1, dtype=torch.long) for n in extend_lens]
        slot = [torch.full((int(n),), -1, dtype=torch.long) for n in extend_lens]
        reserved = []
        for plan, fill, segment in chosen:
            lo, hi = fill.start - plan.prefix_len, fill.end - plan.prefix_len
            reserved.append(segment)
            group[plan.index][lo - 1 : hi] = len(reserved)
            slot[plan.index][lo:hi] = segment.slots.cpu()
        active = []
        for i, ids in enumerate(group):
            if ids[-1] < 0:  # every request keeps a last row for the logits processor
                ids[-1] = len(reserved) + 1 + i
            active.append(ids >= 0)
        ids = torch.cat([g[m] for g, m in zip(group, active, strict=True)])
        slots = torch.cat([s[m] for s, m in zip(slot, active, strict=True)])
        _, sizes = torch.unique_consecutive(ids, return_counts=True)
        rows = (slots >= 0).nonzero().flatten()
        backend = GroupLocalAttentionBackend(
            ctx.model_runner.token_to_kv_pool, sizes.tolist(), rows, slots[rows]
        )
        keys = int((sizes * (sizes + 1) // 2).sum())
        self.counters.executed_flops += ctx.shape.flops(int(ids.numel()), keys, len(group))
        return active, backend
