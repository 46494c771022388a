"""Every tensor-parallel rank takes the same decision: a few collectives per forward.

At ``--tp-size`` N each rank holds ``H_kv / N`` KV heads, so a scorer's statistics,
a probe's deviation and CacheBlend's deviation are partial on each rank, and the
segment store, its L3 tier and a fault are each rank's own. Every pass runs the
model's all-reduces, so the ranks must run the same passes over the same tokens:
a pick made from one rank's heads, or a plan made from one rank's store, deadlocks
or (worse) sums partial results of different tokens.

:class:`RankAgreement` holds the collectives that make the ranks agree, over
SGLang's TP group (``get_tp_group()``):

- :meth:`RankAgreement.plans`: one int64 all-reduce (MIN) over the CPU group of
  ``[signature, -signature]`` per request and a failure flag; a request whose plan
  differs between ranks (an L3 hit on one, a miss or a missed deadline on another)
  reuses nothing on every rank;
- :meth:`RankAgreement.any_failed`: one int all-reduce (MAX) over the CPU group at a
  stage boundary (before each pass, and at the end): a failure on one rank makes
  every rank answer the batch as stock;
- :meth:`RankAgreement.sum`: one float32 SUM all-reduce over the device group (NCCL
  on CUDA, gloo on the CPU) of every request's statistic parts flattened into one
  tensor: each rank's parts over its own heads become the parts over every head
  (``scoring/head_parts.py``), the same on every rank;
- :meth:`RankAgreement.all_of`: one int64 all-reduce (MIN) over the CPU group of a
  flag per image: stored embeddings replace the (TP-sharded) vision tower only where
  every rank holds them.

None of them runs inside a layer loop. At TP 1 (or outside a server) every method
returns its input and runs no collective, so a single rank stays byte-identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

# A plan signature: a hash of host integers, kept positive and below 2**62 so that
# its negation fits in int64.
_SIGNATURE_MASK = (1 << 62) - 1


_shared: RankAgreement | None = None


class PeerFailed(RuntimeError):
    """Another tensor-parallel rank failed at this stage: this one answers as stock too."""


class RankAgreement:
    """Collectives over one tensor-parallel group.

    Args:
        cpu_group: the group's gloo process group (flags and plan signatures).
        device_group: its group on the KV pool's device (statistics); on the CPU
            the same gloo group may serve both.
        world_size: ranks in the group; 1: every method is a no-op.

    Attributes:
        collectives: collectives run since start (a counter, for the report).
        seconds: host wall time spent in them (on CUDA, NCCL's launches and the flags'
            waits; on the CPU, the whole exchange).
    """

    def __init__(self, cpu_group: Any = None, device_group: Any = None, world_size: int = 1):
        if world_size > 1 and (cpu_group is None or device_group is None):
            raise ValueError("a group of more than one rank needs its process groups")
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.world_size = world_size
        self.collectives = 0
        self.seconds = 0.0

    @classmethod
    def of_tp_group(cls) -> RankAgreement:
        """The agreement of SGLang's TP group in this process; a no-op one at TP 1 or
        where SGLang's parallel state is not initialized (unit tests, tools)."""
        try:
            from sglang.srt.distributed import get_tp_group

            group = get_tp_group()
        except Exception:
            return cls()
        if group is None or group.world_size <= 1:
            return cls()
        return cls(group.cpu_group, group.device_group, group.world_size)

    @classmethod
    def shared(cls) -> RankAgreement:
        """This process's agreement of SGLang's TP group, made once (the executor and
        the embedding build share it, so its :attr:`collectives` count both)."""
        global _shared
        if _shared is None or (_shared.world_size == 1 and cls.of_tp_group().active):
            _shared = cls.of_tp_group()
        return _shared

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def any_failed(self, failed: bool) -> bool:
        """Whether any rank reports ``failed``: one MAX all-reduce of one int over
        the CPU group (no device sync)."""
        if not self.active:
            return failed
        flag = torch.tensor([int(failed)], dtype=torch.int64)
        self._all_reduce(flag, dist.ReduceOp.MAX, self.cpu_group)
        return bool(flag.item())

    def check(self, error: BaseException | None, stage: str) -> None:
        """A stage boundary: raise on every rank if any rank failed. At TP 1 raise
        ``error`` itself; at TP > 1 raise :class:`PeerFailed` on every rank (chained to
        this rank's own ``error`` where it failed), so that every rank leaves the stage
        through the same handler."""
        if not self.active:
            if error is not None:
                raise error
            return
        if self.any_failed(error is not None):
            reason = stage if error is None else f"{stage}: {error!r}"
            raise PeerFailed(reason) from error

    def plans(
        self, signatures: list[int] | None, size: int, failed: bool
    ) -> tuple[list[bool], bool]:
        """Which requests' plans are the same on every rank, and whether any rank
        failed; one MIN all-reduce of ``(2 * size + 1,)`` int64 over the CPU group.

        Args:
            signatures: per request of the batch, :func:`plan_signature` of this
                rank's plan; None when this rank failed to plan.
            size: requests in the batch (the same on every rank).
            failed: this rank failed to plan.
        """
        if not self.active:
            return [True] * size, failed
        values = torch.zeros(2 * size + 1, dtype=torch.int64)
        if signatures is not None and not failed:
            sig = torch.tensor(signatures, dtype=torch.int64)
            values[:size], values[size : 2 * size] = sig, -sig
        values[-1] = -int(failed)
        self._all_reduce(values, dist.ReduceOp.MIN, self.cpu_group)
        lowest, highest = values[:size], -values[size : 2 * size]
        return (lowest == highest).tolist(), bool(values[-1] < 0)

    def all_of(self, flags: list[bool]) -> list[bool]:
        """Per entry, whether ``flags[i]`` holds on every rank: one MIN all-reduce of
        ``(len(flags),)`` int64 over the CPU group (``flags`` as they are at TP 1)."""
        if not self.active or not flags:
            return flags
        values = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        self._all_reduce(values, dist.ReduceOp.MIN, self.cpu_group)
        return [bool(v) for v in values.tolist()]

    def sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of ``tensors`` (any shapes, one device) summed over the ranks: one SUM
        all-reduce of them flattened into one float32 tensor over the device group.
        Returns float32 tensors of the same shapes. A rank's additive parts of a
        statistic over its own heads (a scorer's ``layer_parts`` or
        ``deviation_parts``) become the parts over every head, which the scorer
        finishes into the statistic one rank holding every head computes."""
        if not self.active or not tensors:
            return tensors
        flat = torch.cat([t.float().reshape(-1) for t in tensors])
        self._all_reduce(flat, dist.ReduceOp.SUM, self.device_group)
        out, at = [], 0
        for t in tensors:
            out.append(flat[at : at + t.numel()].view(t.shape))
            at += t.numel()
        return out

    def _all_reduce(self, tensor: torch.Tensor, op: Any, group: Any) -> None:
        started = time.perf_counter()
        self.collectives += 1
        dist.all_reduce(tensor, op=op, group=group)
        self.seconds += time.perf_counter() - started


def summed_inputs(
    agreement: RankAgreement, inputs: dict[int, Any], finish: dict[str, Callable]
) -> dict[int, Any]:
    """At TP > 1, every request's statistics named in ``finish`` (attributes of its
    :class:`~sgl_mmkv.scoring.ScoringInputs`: this rank's ``(L, P, ..., N)`` parts over
    its KV heads) summed over the ranks in one all-reduce and finished by
    ``finish[name]``: the statistics of every head, as TP 1 computes them. At TP 1
    ``inputs`` themselves. Every rank must hold the same requests and fields (agreed
    plans)."""
    if not agreement.active:
        return inputs
    where = [(i, n) for i in sorted(inputs) for n in finish if getattr(inputs[i], n) is not None]
    sums = agreement.sum([getattr(inputs[i], n) for i, n in where])
    out = dict(inputs)
    for (i, name), parts in zip(where, sums, strict=True):
        if parts.shape[0]:  # no layer reduced: (0, N_v), nothing to finish
            out[i] = replace(out[i], **{name: finish[name](parts)})
    return out


def tp_position() -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this process in SGLang's TP group; ``(1, 0)`` where
    SGLang's parallel state is not initialized."""
    try:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        return int(group.world_size), int(group.rank_in_group)
    except Exception:
        return 1, 0


def plan_signature(plan: Any, with_fills: bool = False) -> int:
    """A host integer that is equal on two ranks exactly when their plans of one
    request run the same tokens: its reused spans (row range, delta, reused
    positions) and whether it has holes. ``plan``: a
    :class:`~sgl_mmkv.refresh.plan.RequestPlan`. ``with_fills``: its new images too,
    where they shape a collective (an eviction ranking's rows and its all-reduce, a
    canonical fill's pass); a copy fill alone runs none, so ranks may store
    different images without running apart."""
    spans = tuple(
        (s.start, s.end, s.delta, hash(tuple(s.reused_positions().tolist()))) for s in plan.spans
    )
    fills = tuple((f.start, f.end) for f in plan.fills) if with_fills else ()
    return hash((plan.prefix_len, plan.seq_len, spans, plan.holes, fills)) & _SIGNATURE_MASK
