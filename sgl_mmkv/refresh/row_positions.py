"""Where a request's positions live once holes have shortened its row.

A row that dropped ``d`` hole slots after its prefill (:mod:`row_compaction`) is
``d`` shorter than its sequence. M-RoPE models move their per-request offset; for
1-D RoPE models the request carries :data:`POSITION_OFFSET` and
``patches/forward_batch_positions.py`` adds it to each of its decode positions.
"""

from __future__ import annotations

from typing import Any

import torch

# Attribute of a ``Req``: how far its row is shorter than its sequence.
POSITION_OFFSET = "sgl_mmkv_position_offset"


def position_offset(req: Any) -> int:
    """How far ``req``'s row is shorter than its sequence (0 unless holes left it)."""
    return getattr(req, POSITION_OFFSET, 0)


def positions_after_holes(positions: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Decode ``positions`` ``(B,)`` (one token per request) with request ``i``'s moved
    up by ``offsets[i]``."""
    return positions + torch.tensor(offsets, dtype=positions.dtype, device=positions.device)
