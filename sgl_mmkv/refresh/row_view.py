"""A request's row seen without its holes.

A reused compressed segment leaves holes in the row (``RequestPlan.hole_mask``):
positions whose slots hold no KV. Every reader of the row during the extend (the
attention of each pass, the scorers' and rankers' KV) reads it through a
:class:`RowView`: the row compacted to the positions that hold KV, in order, so the
causal order of what is left is kept and the holes are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_mmkv.refresh.plan import RequestPlan


@dataclass(frozen=True, slots=True)
class RowView:
    """Attributes:
    kept: ``(m,)`` int64 sorted row positions that hold KV (``m <= seq_len``).
    index: ``(seq_len,)`` int64 position of each row position in the compacted row
        (``-1`` at a hole).
    """

    kept: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, plan: RequestPlan) -> RowView | None:
        """The view of ``plan``'s row, or None when it has no holes."""
        holes = plan.hole_mask()
        if not bool(holes.any()):
            return None
        present = torch.ones(plan.seq_len, dtype=torch.bool)
        present[plan.prefix_len :] = ~holes
        kept = present.nonzero().flatten()
        index = torch.full((plan.seq_len,), -1, dtype=torch.long)
        index[kept] = torch.arange(kept.numel())
        return cls(kept, index)

    def compact(self, positions: torch.Tensor) -> torch.Tensor:
        """``(n,)`` compacted indices of row ``positions`` (none of them a hole)."""
        out = self.index[positions.cpu()]
        if bool((out < 0).any()):
            raise ValueError("a row position inside a hole was read")
        return out.to(positions.device)

    def expand(self, indices: torch.Tensor) -> torch.Tensor:
        """``(n,)`` row positions of compacted ``indices``."""
        return self.kept[indices.cpu()].to(indices.device)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The compacted ``[start, end)`` of the kept tokens of row span ``[start, end)``."""
        inside = self.index[start:end]
        inside = inside[inside >= 0]
        if inside.numel() == 0:
            first = int(self.index[:start].ge(0).sum())
            return first, first
        return int(inside[0]), int(inside[-1]) + 1

    def rows(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Per layer ``(seq_len, ...)`` row tensors restricted to the kept positions
        (the kept positions moved to the tensors' device once, for every layer)."""
        if not tensors:
            return ()
        kept = self.kept.to(tensors[0].device)
        return tuple(t[kept] for t in tensors)
