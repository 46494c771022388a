"""A refresh pass's language-model inputs are the full extend's, at its active rows;
Qwen3-VL, whose DeepStack inputs need that, is on the refresh allow-list."""

from __future__ import annotations

import torch

from sgl_mmkv.refresh.embedding_pass import EmbeddingPass


def test_active_inputs_gathers_every_token_input_at_the_pass_rows():
    embeds = torch.arange(12.0).reshape(6, 2)
    deepstack = torch.arange(24.0).reshape(6, 4)  # (n_extend, hidden * 2 DeepStack layers)
    state = EmbeddingPass(full_batch=None, embeds=embeds)
    state.token_inputs = {"input_deepstack_embeds": deepstack}
    state.index = torch.tensor([1, 4, 5])
    rows = state.active_inputs()
    assert list(rows) == ["input_deepstack_embeds"]
    assert torch.equal(rows["input_deepstack_embeds"], deepstack[[1, 4, 5]])
    assert rows["input_deepstack_embeds"].shape == (3, 4)


def test_no_token_inputs_for_a_model_without_deepstack():
    state = EmbeddingPass(full_batch=None, embeds=torch.zeros(3, 2))
    state.index = torch.tensor([0, 2])
    assert state.active_inputs() == {}


def test_qwen3_vl_passes_the_refresh_allow_list(tiny_qwen3_vl):
    import json

    from sgl_mmkv.support import check_model, rope_type

    check_model("--mm-reuse conduit", str(tiny_qwen3_vl))  # raises ConfigError if refused
    # Interleaved M-RoPE is a plain rotary: no scaling for re-positioning to miss.
    assert rope_type(json.loads((tiny_qwen3_vl / "config.json").read_text())) is None
