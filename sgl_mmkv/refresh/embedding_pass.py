"""Input embeddings shared by the passes of one refresh forward.

A refresh sub-batch holds only its active tokens, but multimodal embedding must
see the whole extend to place image features. The full batch's embeddings are
built once (SGLang's ``prepare_mm_inputs``, vision encoder and its cache
included) and each pass takes its active rows. SGLang's eager runner copies the
ForwardBatch before the model sees it, so the pass travels in this module's
state (scheduler thread) rather than as a batch attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class EmbeddingPass:
    """``full_batch``: the stock extend batch; ``index``: ``(n_active,)`` rows of it
    that the current pass computes; ``embeds``: ``(n_extend, hidden)`` once built;
    ``seconds``: wall time building them (vision encoder or its cache)."""

    full_batch: object
    stock_backend: object = None
    index: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    embeds: torch.Tensor | None = None
    seconds: float = 0.0


_current: EmbeddingPass | None = None


@contextmanager
def embedding_pass(state: EmbeddingPass) -> Iterator[EmbeddingPass]:
    global _current
    previous, _current = _current, state
    try:
        yield state
    finally:
        _current = previous


def current_embedding_pass() -> EmbeddingPass | None:
    return _current
