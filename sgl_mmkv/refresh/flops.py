"""Exact prefill FLOPs of a decoder from its config and the positions it computes.

A matmul of ``(m, k) @ (k, n)`` counts ``2 * m * k * n`` FLOPs. Per decoder layer a
token costs its q/k/v/o projections and the gated MLP (three matrices); a query at
row position ``p`` attends causally to ``p + 1`` keys (``QK^T`` and ``PV``). Each
forward pass adds one LM-head row per request (the logits SGLang computes).
Norms, rotary, softmax and the vision encoder are left out: elementwise work,
and the encoder runs identically (or is cached) with and without reuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The sizes of a decoder that fix its FLOPs."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        """From a Hugging Face (text) config object or its ``config.json`` dict."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        text = get("text_config")
        if text is not None and get("num_hidden_layers") is None:
            return cls.from_config(text)
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", heads) or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            vocab_size=int(get("vocab_size")),
        )

    @property
    def linear_flops_per_token(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size
        return 2 * self.num_layers * per_layer

    def attention_flops(self, num_keys: int) -> int:
        """FLOPs of queries that together attend to ``num_keys`` keys, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * num_keys

    def pass_flops(self, positions: torch.Tensor | Iterable[int]) -> int:
        """One request's share of a forward pass computing the rows at ``positions``.

        Args:
            positions: ``(n,)`` row positions of the computed tokens.
        """
        positions = torch.as_tensor(positions, dtype=torch.long)
        n = int(positions.numel())
        if n == 0:
            return 0
        return self.flops(n, int(positions.sum()) + n, logits_rows=1)

    def flops(self, num_tokens: int, num_keys: int, logits_rows: int) -> int:
        """``num_tokens`` computed rows attending to ``num_keys`` keys in all, plus
        ``logits_rows`` rows of the LM head."""
        return (
            num_tokens * self.linear_flops_per_token
            + self.attention_flops(num_keys)
            + logits_rows * 2 * self.hidden_size * self.vocab_size
        )

    def extend_flops(self, prefix_len: int, seq_len: int) -> int:
        """Full prefill of rows ``prefix_len .. seq_len - 1`` (what stock computes);
        equal to ``pass_flops(range(prefix_len, seq_len))``, in closed form."""
        n = seq_len - prefix_len
        if n <= 0:
            return 0
        keys = n * (prefix_len + seq_len + 1) // 2  # sum of (p + 1) over the rows
        return self.flops(n, keys, logits_rows=1)
