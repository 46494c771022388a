"""Input embeddings shared by the passes of one refresh forward.

A refresh sub-batch holds only its active tokens, but multimodal embedding must
see the whole extend to place image features. The full batch's embeddings are
built once (SGLang's ``prepare_mm_inputs``, vision encoder and its cache
included) and each pass takes its active rows, of the input embeddings and of
every per-token input the language model also takes (Qwen3-VL's DeepStack
features, ``input_deepstack_embeds``). SGLang's eager runner copies the
ForwardBatch before the model sees it, so the pass travels in the process's
:class:`EmbeddingSlot` (one, on the published runtime) rather than as a batch
attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sgl_mmkv.segments.key import SegmentKey


@dataclass
class EmbeddingPass:
    """``full_batch``: the stock extend batch; ``index``: ``(n_active,)`` rows of it
    that the current pass computes; ``embeds``: ``(n_extend, hidden)`` once built;
    ``token_inputs``: the other language-model inputs ``prepare_mm_inputs`` made,
    by keyword, each ``(n_extend, ...)`` (DeepStack: ``(n_extend, hidden * k)``);
    ``seconds``: wall time building them (vision encoder or its cache)."""

    full_batch: object
    stock_backend: object = None
    index: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    embeds: torch.Tensor | None = None
    seconds: float = 0.0
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def active_inputs(self) -> dict[str, torch.Tensor]:
        """``token_inputs`` at this pass's rows: each ``(n_active, ...)``."""
        return {name: rows[self.index] for name, rows in self.token_inputs.items()}


class EmbeddingSlot:
    """The embedding pass of the refresh pass running now in this process, if any
    (``patches/mm_embed_routine.py`` reads it; the scheduler runs one forward at a
    time), and ``captured``: the vision encoder's output per image of the last
    embedding build, segment key -> ``(rows, W)`` (``refresh/segment_embeddings.py``),
    for the segments the forward fills (``refresh/fill.py`` takes it)."""

    def __init__(self) -> None:
        self.current: EmbeddingPass | None = None
        self.captured: dict[SegmentKey, torch.Tensor] = {}

    def take_captured(self) -> dict[SegmentKey, torch.Tensor]:
        """``captured``, emptied."""
        captured, self.captured = self.captured, {}
        return captured

    @contextmanager
    def using(self, state: EmbeddingPass) -> Iterator[EmbeddingPass]:
        """``state`` is the current pass while the block runs."""
        previous, self.current = self.current, state
        try:
            yield state
        finally:
            self.current = previous
