"""training/staleness_probes.py: the deepened model starts as the trained one; the table's gap."""

from __future__ import annotations

from pathlib import Path

import torch

from training.staleness_probes import deepen, markdown

MODEL = Path(__file__).resolve().parent.parent / "models" / "fidelity-qwen2-vl-marked"


def test_deepen_preserves_the_function():
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    deep = deepen(model, 8).eval()
    assert deep.config.text_config.num_hidden_layers == 8
    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, deep(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5)
    layers = deep.model.language_model.layers
    assert torch.equal(
        layers[1].mlp.down_proj.weight, torch.zeros_like(layers[1].mlp.down_proj.weight)
    )
    assert torch.equal(
        layers[2].self_attn.q_proj.weight,
        model.model.language_model.layers[1].self_attn.q_proj.weight,
    )


def test_gap_is_full_minus_worst_context():
    point = {"step": 800, "loss": 0.02, "full": 0.875, "prefix": 0.875, "reordered": 0.109,
             "alone": 0.344, "s": 667}  # fmt: skip
    config = {"init": "committed", "layers": 4, "eval_images": 4, "num_validation": 64}
    table = markdown({"next": {"config": config, "curve": [point]}})
    assert (
        "| next | committed | 4 | 64 | 800 | 0.020 | 0.875 | 0.875 | 0.109 | 0.344 | +0.766 | 667 |"
        in table
    )
