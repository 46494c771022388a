"""A ForwardBatch restricted to the active tokens of each request.

The refresh executor runs SGLang's own extend path (model, logits processor,
sampling) on a copy of the batch whose per-token fields keep only the active
tokens; per-request fields (``seq_lens``, ``req_pool_indices``, ...) stay, so each
request's row is still read in full by :class:`RefreshAttentionBackend`.
"""

from __future__ import annotations

import copy

import torch


def active_token_index(forward_batch, active_masks: list[torch.Tensor]) -> torch.Tensor:
    """``(n_active,)`` int64 indices into the batch's flattened extend tokens.

    Args:
        active_masks: per request ``(extend_len_i,)`` bool, True for active tokens.
    """
    starts = torch.tensor([0, *forward_batch.extend_seq_lens_cpu]).cumsum(0)[:-1]
    parts = [int(s) + m.nonzero().flatten() for s, m in zip(starts, active_masks, strict=True)]
    return torch.cat(parts).to(forward_batch.input_ids.device)


def needs_every_row(forward_batch, i: int) -> bool:
    """Whether request ``i`` asks input logprobs of more prompt rows than its last, so
    a pass whose output is returned must compute all of its extend rows."""
    starts = forward_batch.extend_logprob_start_lens_cpu
    if not forward_batch.return_logprob or starts is None:
        return False
    return forward_batch.extend_seq_lens_cpu[i] - starts[i] > 1


def active_sub_batch(
    forward_batch, active_masks: list[torch.Tensor], *, stock_attention: bool = False
):
    """Shallow copy of ``forward_batch`` with only the active tokens as queries.

    Returns ``(sub_batch, index)``; ``index`` as :func:`active_token_index`.
    A request's logprob window is clipped to its active rows, so the logits
    processor always gets a valid window; a pass whose output is returned keeps
    every row of the requests that :func:`needs_every_row`.

    The sub-batch runs under an attention backend of ours in the
    ``forward_context`` (:mod:`sgl_mmkv.refresh.attention_backend`), which plans for
    itself. So it is marked planned: SGLang's eager extend then skips
    ``model_runner.attn_backend.init_forward_metadata``, a stock plan of the
    sub-batch that nothing would read. ``stock_attention=True`` leaves it unplanned
    for a pass that runs under the stock backend.
    """
    index = active_token_index(forward_batch, active_masks)
    sub = copy.copy(forward_batch)
    sub.input_ids = forward_batch.input_ids[index]
    if forward_batch.positions is not None:
        sub.positions = forward_batch.positions[index]
    if forward_batch.mrope_positions is not None:
        sub.mrope_positions = forward_batch.mrope_positions[:, index]
    sub.out_cache_loc = forward_batch.out_cache_loc[index]
    counts = [int(m.sum()) for m in active_masks]
    device = forward_batch.extend_seq_lens.device
    sub.extend_seq_lens = torch.tensor(counts, dtype=forward_batch.extend_seq_lens.dtype).to(device)
    sub.extend_seq_lens_cpu = counts
    sub.extend_start_loc = torch.tensor([0, *counts[:-1]], dtype=torch.long).cumsum(0).to(device)
    sub.extend_num_tokens = sum(counts)
    if forward_batch.extend_logprob_start_lens_cpu is not None:
        sub.extend_logprob_start_lens_cpu = [
            max(0, n - (ext - start))
            for n, ext, start in zip(
                counts,
                forward_batch.extend_seq_lens_cpu,
                forward_batch.extend_logprob_start_lens_cpu,
                strict=True,
            )
        ]
    sub.input_embeds = None
    sub.forward_metadata_ready = False
    if not stock_attention:
        sub.mark_forward_metadata_ready()
    return sub, index
