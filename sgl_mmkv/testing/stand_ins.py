"""Stand-ins for SGLang's KV pool, extend batch and model runner, with the
attributes the refresh path reads; for unit tests and ``benchmarks/scoring_memory.py``
(no model, no server)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class StandInPool:
    """``token_to_kv_pool``: per layer ``(slots, H_kv, D)`` K and V, drawn from
    ``generator`` (K of every layer, then V)."""

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        generator: torch.Generator,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        size = (slots, kv_heads, head_dim)
        draw = lambda: torch.randn(size, generator=generator, dtype=dtype, device=device)  # noqa: E731
        self.k = [draw() for _ in range(layers)]
        self.v = [draw() for _ in range(layers)]

    @property
    def layer_num(self) -> int:
        return len(self.k)

    def set_kv_buffer(self, layer, loc, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` / ``v`` (``(N, H_kv * D)`` or ``(N, H_kv, D)``) at ``loc.loc``."""
        self.k[layer.layer_id][loc.loc] = k.view(-1, *self.k[0].shape[1:])
        self.v[layer.layer_id][loc.loc] = v.view(-1, *self.v[0].shape[1:])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]


def _no() -> bool:
    return False


def extend_batch(
    seq_lens: list[int],
    extend_lens: list[int],
    req_pool_indices: list[int],
    out_cache_loc: torch.Tensor,
) -> SimpleNamespace:
    """A ``ForwardBatch`` of one extend without logprobs, on ``out_cache_loc``'s
    device: requests in pool rows ``req_pool_indices``, of ``seq_lens`` tokens of which
    the last ``extend_lens`` are computed; ``out_cache_loc`` ``(sum(extend_lens),)``
    their KV slots; ids and positions ``0..N-1``."""
    device = out_cache_loc.device
    n = out_cache_loc.numel()
    return SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=_no, is_decode=_no, is_mixed=_no),
        seq_lens_cpu=torch.tensor(seq_lens),
        seq_lens=torch.tensor(seq_lens, device=device),
        req_pool_indices=torch.tensor(req_pool_indices, device=device),
        out_cache_loc=out_cache_loc,
        input_ids=torch.arange(n, device=device),
        positions=torch.arange(n, device=device),
        mrope_positions=None,
        extend_seq_lens=torch.tensor(extend_lens, device=device),
        extend_seq_lens_cpu=list(extend_lens),
        extend_logprob_start_lens_cpu=None,
        return_logprob=False,
        input_embeds=None,
        forward_metadata_ready=False,
        mark_forward_metadata_ready=lambda: None,
        moe_num_token_non_padded=None,
    )


def model_runner(pool: StandInPool, req_to_token: torch.Tensor) -> SimpleNamespace:
    """A ``ModelRunner`` with ``pool`` and the ``(rows, max_len)`` ``req_to_token`` table."""
    return SimpleNamespace(
        token_to_kv_pool=pool,
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        model=None,
        attn_backend=None,
    )
