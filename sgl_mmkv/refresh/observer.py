"""What an eviction scorer needs from a prefill, taken while the forward runs.

:class:`PrefillObserver` keeps, per layer and per observed request, the global
mean / std of the attention input (after ``input_layernorm``) and either the
queries of chosen rows (RoPE applied, as the attention backend receives them) or,
with :class:`~sgl_mmkv.refresh.layer_statistics.LayerStatistics`, only the
scorer's per-layer statistic: right after each layer's attention, those queries
and the request's row, read in place from the pool, are reduced and dropped. It
wraps whichever attention backend runs the pass (:class:`ObservingBackend`) and
puts forward pre-hooks on the decoder's attention modules, so the stock extend and
the refresh passes are observed alike. :class:`QueryProjector` computes a layer's
queries for arbitrary inputs with the model's own ``qkv_proj`` and RoPE
(MM-ShiftKV's proxies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from sglang.srt.layers.radix_attention import RadixAttention

from sgl_mmkv.refresh.kv_scales import layer_scales
from sgl_mmkv.refresh.layer_statistics import LayerStatistics
from sgl_mmkv.refresh.row_kv import row_slots


def decoder_attention_modules(model) -> list[torch.nn.Module]:
    """The decoder's attention modules (``qkv_proj``, ``rotary_emb``, ``attn``), by layer."""
    modules = {}
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, RadixAttention) and hasattr(module, "qkv_proj"):
            modules[attn.layer_id] = module
    if not modules:
        raise NotImplementedError(f"{type(model).__name__}: no decoder attention modules found")
    return [modules[i] for i in sorted(modules)]


@dataclass
class PrefillObserver:
    """Observations of one pass, for the requests in ``rows``.

    Everything observed stays on the device of the forward, and observing never waits
    for it: the hooks run inside every layer.

    Attributes:
        rows: request index in the pass -> ``(m,)`` int64 rows within that
            request's tokens of the pass whose queries are kept.
        queries: request -> layer -> ``(m, H_q, d)`` in the forward's dtype (empty
            with ``statistics``).
        hidden_stats: request -> layer -> ``(mean, std, hidden_size)`` of the
            request's attention input in the pass, mean and std 0-dim float32.
        statistics: optional; each layer's queries and row reduced to the scorer's
            statistic after the layer's attention instead of kept (``rows[i]`` in
            the order of its ``query_positions``).
    """

    rows: dict[int, torch.Tensor]
    queries: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    hidden_stats: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, int]]] = field(
        default_factory=dict
    )
    statistics: LayerStatistics | None = None
    # (request, device) -> rows moved there, once for every layer
    _rows_on: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)
    # request -> the current layer's queries, until its attention ran (statistics)
    _pending: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # request -> the pool slots of its row (without holes), read once for every layer
    _slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def _spans(self, forward_batch) -> Iterator[tuple[int, int]]:
        """``(request, first token of the request in the pass)`` of the observed ones."""
        start = 0
        for i, n in enumerate(forward_batch.extend_seq_lens_cpu):
            if i in self.rows:
                yield i, start
            start += int(n)

    def _device_rows(self, i: int, start: int, device: torch.device) -> torch.Tensor:
        """``rows[i] + start`` on ``device``, moved there once."""
        key = (i, device)
        if key not in self._rows_on:
            self._rows_on[key] = self.rows[i].to(device) + start
        return self._rows_on[key]

    def observe_queries(self, q: torch.Tensor, layer, forward_batch) -> None:
        if self.statistics is not None and not self.statistics.reduces(layer.layer_id):
            return
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        for i, start in self._spans(forward_batch):
            queries = q_[self._device_rows(i, start, q.device)].detach()
            if self.statistics is None:
                self.queries.setdefault(i, {})[layer.layer_id] = queries
            else:
                self._pending[i] = queries

    def observe_attention(self, layer, forward_batch, backend) -> None:
        """After ``layer``'s attention (its K and V in ``backend``'s pool): the
        pending queries and each request's row reduced to the layer's statistics."""
        if self.statistics is None or not self._pending:
            return
        pool = backend.token_to_kv_pool
        k_buffer = pool.get_key_buffer(layer.layer_id)
        v_buffer = pool.get_value_buffer(layer.layer_id)
        scales = layer_scales(layer, pool)
        for i, queries in self._pending.items():
            if i not in self._slots:
                kept = self.statistics.rows[i].kept
                self._slots[i] = row_slots(backend.req_to_token_pool, forward_batch, i, kept)
            stats = self.hidden_stats.get(i, {}).get(layer.layer_id)
            self.statistics.reduce(
                i, layer.layer_id, queries, k_buffer, v_buffer, self._slots[i], stats, scales
            )
        self._pending.clear()

    def observe_hidden(self, layer_id: int, hidden: torch.Tensor, forward_batch) -> None:
        counts = forward_batch.extend_seq_lens_cpu
        for i, start in self._spans(forward_batch):
            x = hidden[start : start + int(counts[i])].detach().float()
            stats = (x.mean(), x.std(), int(x.shape[-1]))
            self.hidden_stats.setdefault(i, {})[layer_id] = stats

    @contextmanager
    def hooks(self, model) -> Iterator[None]:
        """Forward pre-hooks on the decoder's attention modules while the pass runs."""
        if self.statistics is not None and self.statistics.project_queries is None:
            self.statistics.project_queries = QueryProjector(model)
        handles = []
        for module in decoder_attention_modules(model):
            layer_id = module.attn.layer_id

            def hook(_module, args, kwargs, layer_id=layer_id):
                hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
                batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
                if hidden is not None and batch is not None:
                    self.observe_hidden(layer_id, hidden, batch)

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class ObservingBackend:
    """An attention backend that hands each layer's queries to an observer, runs
    ``inner`` unchanged, then lets the observer read the layer's KV (everything else
    is ``inner``'s; SGLang's backends keep their pools as ``token_to_kv_pool`` and
    ``req_to_token_pool``)."""

    def __init__(self, inner, observer: PrefillObserver) -> None:
        self._inner = inner
        self._observer = observer

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        self._observer.observe_queries(q, layer, forward_batch)
        out = self._inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        self._observer.observe_attention(layer, forward_batch, self._inner)
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextmanager
def observing(observer: PrefillObserver | None, model, backend) -> Iterator:
    """``backend`` wrapped to hand its queries to ``observer``, with the observer's
    attention-input hooks on ``model`` while the context lasts; ``backend`` itself
    when there is no observer."""
    if observer is None:
        yield backend
        return
    with observer.hooks(model):
        yield ObservingBackend(backend, observer)


class QueryProjector:
    """``project(layer, x, positions) -> (S, H_q, d)`` float32 on the model's device:
    the layer's ``q_proj`` of ``x`` ``(S, D)``, RoPE at text positions ``positions``
    ``(S,)`` (for M-RoPE models all three sections share the text position)."""

    def __init__(self, model) -> None:
        self.modules = decoder_attention_modules(model)

    def __call__(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        module = self.modules[layer]
        weight = module.qkv_proj.weight
        qkv, _ = module.qkv_proj(x.to(weight.device, weight.dtype))
        q, k, _ = qkv.split([module.q_size, module.kv_size, module.kv_size], dim=-1)
        q, _ = module.rotary_emb(positions.to(weight.device), q.contiguous(), k.contiguous())
        return q.reshape(x.shape[0], module.num_heads, module.head_dim).float()
