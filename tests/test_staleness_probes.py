"""training/staleness_probes.py: the deepened model starts as the trained one; the table's gap."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_second_turn_prompts_label_only_the_answer_and_keep_old_recipes():
    """With ``turn_fraction`` 1 every prompt is a second turn after the same images in
    another order, and the labels are still exactly the answer; with 0 the batch and
    the random stream are what they were before the option existed."""
    import random

    from transformers import AutoProcessor

    from training.staleness_probes import training_batch
    from training.staleness_tasks import make_stale_example
    from training.train_fidelity_model import ALT_SYSTEM_PROMPTS, PREAMBLES

    processor = AutoProcessor.from_pretrained(MODEL)
    examples = [make_stale_example("next", "train", i, 3) for i in range(2)]
    batch = training_batch(processor, examples, random.Random(0), turn_fraction=1.0)
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, example in enumerate(examples):
        ids = batch["input_ids"][row]
        labelled = ids[batch["labels"][row] != -100]
        assert processor.tokenizer.decode(labelled) == example.answer + "<|im_end|>\n"
        text = processor.tokenizer.decode(ids[batch["attention_mask"][row].bool()])
        assert text.count("Remember these.") == 1 and text.count("<|im_start|>user") == 2
        assert int((ids == image_pad).sum()) == 2 * 3 * 16  # both turns' images
    rng, replay = random.Random(1), random.Random(1)
    plain = training_batch(processor, examples, rng)
    for _ in examples:
        replay.choice(ALT_SYSTEM_PROMPTS), replay.choice(PREAMBLES)
    assert rng.random() == replay.random()
    assert "Remember these." not in processor.tokenizer.decode(plain["input_ids"][0])


def test_page_sized_images_are_64_tokens_and_labels_stay_the_answer():
    """At ``--image-side 224`` every image is (224 / 28) ** 2 = 64 tokens; the training
    labels and the teacher-forced prompt length follow the processor, not a constant."""
    import random

    from transformers import AutoProcessor

    from training.stale_reuse import encode
    from training.staleness_probes import set_image_side, training_batch
    from training.staleness_tasks import make_stale_example, stale_messages

    processor = AutoProcessor.from_pretrained(MODEL)
    set_image_side(processor, 224)
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    examples = [make_stale_example("next", "train", i, 2 + 2 * i) for i in range(2)]
    batch = training_batch(processor, examples, random.Random(0))
    for row, example in enumerate(examples):
        ids = batch["input_ids"][row]
        assert int((ids == image_pad).sum()) == 64 * len(example.images)
        labelled = ids[batch["labels"][row] != -100]
        assert processor.tokenizer.decode(labelled) == example.answer + "<|im_end|>\n"
    images: list = []

    def part(image) -> dict:
        images.append(image)
        return {"type": "image"}

    encoded = encode(processor, stale_messages(examples[1], part), images, examples[1].answer)
    ids = encoded.inputs["input_ids"][0]
    assert len(encoded.image_positions()) == 64 * 4
    assert processor.tokenizer.decode(ids[encoded.prompt_tokens :]) == (
        examples[1].answer + "<|im_end|>\n"
    )


def _config(**changes):
    from dataclasses import replace

    from training.staleness_probes import ProbeConfig

    base = ProbeConfig("next", 1, 4, 1e-3, 2, 3, 2, 1, 2, 0, "committed", 4)
    return replace(base, **changes)


def test_kind_fraction_draws_kind_questions_and_zero_replays_old_recipes():
    import random

    from harness.fidelity_task import KINDS
    from training.staleness_probes import draw_training_example
    from training.staleness_tasks import make_stale_example

    rng, replay = random.Random(5), random.Random(5)
    for _ in range(20):  # kind_fraction 0: exactly the draws the old loop made
        index, images = replay.randrange(10**9), replay.randint(2, 3)
        expected = make_stale_example("next", "train", index, images)
        assert draw_training_example(_config(), rng) == expected
    rng = random.Random(0)
    answers = [draw_training_example(_config(kind_fraction=1.0), rng).answer for _ in range(30)]
    assert all(answer in KINDS for answer in answers)
    rng = random.Random(1)
    half = [draw_training_example(_config(kind_fraction=0.5), rng).answer for _ in range(300)]
    share = sum(answer in KINDS for answer in half) / len(half)
    assert 0.55 < share < 0.78  # 0.5 + 0.5 / 3 = 0.67
    assert _config(kind_fraction=0.5, freeze_vision=True).name == "next-kind0.5-frozen"
    assert _config().name == "next"  # old probes keep their names
    with pytest.raises(ValueError, match="count never asks a shape kind"):
        _config(variant="count", kind_fraction=1.0)
    with pytest.raises(ValueError, match="a share, from 0 to 1"):
        _config(kind_fraction=1.5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "next,count", "--kind-fraction", "0.5"], "--kind-fraction: count never"),
        (["--variants", "next", "--kind-fraction", "-0.1"], "--kind-fraction is a share"),
    ],
)
def test_the_command_line_refuses_a_kind_fraction_its_probes_cannot_use(argv, message, capsys):
    from training.staleness_probes import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_freeze_vision_trains_the_decoder_only(tmp_path):
    from transformers import AutoModelForImageTextToText

    from training.staleness_probes import run_probe

    before = AutoModelForImageTextToText.from_pretrained(MODEL).state_dict()
    run_probe(_config(freeze_vision=True, num_validation=1), MODEL, save=tmp_path / "m")
    after = AutoModelForImageTextToText.from_pretrained(tmp_path / "m").state_dict()
    vision = [k for k in before if "visual" in k]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in before if "visual" not in k)


def _record(steps: int, seconds: int, **extra) -> dict:
    config = {"steps": steps, "variant": "next"}
    return {"spec": {"side": steps}, "config": config, "curve": [{"s": seconds}], **extra}


def test_append_phase_keeps_every_phase_and_sums_them():
    from training.staleness_probes import append_phase

    first = _record(100, 10, init_from="a", total_train_seconds=10, vision_pretrain={"k": 1})
    second = append_phase(first, _record(50, 5, total_train_seconds=5), "b", "cmd 2")
    assert [p["config"]["steps"] for p in second["phases"]] == [100, 50]
    assert [p.get("command") for p in second["phases"]] == [None, "cmd 2"]
    assert second["phases"][1]["init_from"] == "b"
    assert (second["total_steps"], second["total_train_seconds"]) == (150, 15)
    assert second["config"]["steps"] == 50 and second["spec"] == {"side": 50}
    assert second["vision_pretrain"] == {"k": 1}  # the tower of phase 1, still the model's
    pretrained = _record(20, 2, total_train_seconds=2, vision_pretrain={"k": 3})
    third = append_phase(second, pretrained, "c", "cmd 3")
    assert len(third["phases"]) == 3 and third["phases"][:2] == second["phases"]
    assert (third["total_steps"], third["vision_pretrain"]) == (170, {"k": 3})


def test_append_to_trains_on_and_appends_the_run(tmp_path, monkeypatch):
    import json
    from dataclasses import asdict

    import training.staleness_probes as probes

    spec = asdict(probes.saved_spec(_config(layers=4)))
    model = tmp_path / "model"
    model.mkdir()
    first = _record(100, 10, total_train_seconds=10, name="old")
    (model / "training.json").write_text(json.dumps({**first, "spec": spec}))
    (model / "model.safetensors").write_text("old weights")
    started_from = []

    def fake_run_probe(config, checkpoint, save, *args):
        started_from.append(checkpoint)
        point = {"step": 3, "loss": 1.0, "s": 7, "full": 0.5}
        point.update({c: 0.5 for c in probes.CONTEXTS})
        result = {"name": config.name, "config": asdict(config), "curve": [point]}
        latest = {"spec": spec, "style": "staleness-next", **result, "total_train_seconds": 7}
        (save / "training.json").write_text(json.dumps(latest))
        (save / "model.safetensors").write_text("new weights")
        return result

    monkeypatch.setattr(probes, "run_probe", fake_run_probe)
    argv = ["--variants", "next", "--steps", "3", "--append-to", str(model)]
    argv += ["--out-dir", str(tmp_path / "out")]
    assert probes.main(argv) == 0
    assert started_from == [model]  # from the model itself
    record = json.loads((model / "training.json").read_text())
    assert [p["config"]["steps"] for p in record["phases"]] == [100, 3]
    assert record["phases"][1]["init_from"] == str(model)
    assert record["phases"][1]["command"].endswith(f"--append-to {model} --out-dir {tmp_path}/out")
    assert (record["total_steps"], record["total_train_seconds"]) == (103, 17)
    assert record["name"] == "next" and record["config"]["steps"] == 3
    assert (model / "model.safetensors").read_text() == "new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]  # no staging left

    refused = [
        ["--save", str(tmp_path / "other")],
        ["--checkpoint", str(tmp_path / "elsewhere")],
        ["--init", "scratch"],
        ["--image-side", "224"],  # the model was saved at 112 pixels
    ]
    for extra in refused:
        with pytest.raises(SystemExit):
            probes.main([*argv, *extra])
    (model / "training.json").write_text(json.dumps({"spec": spec, "steps": 5}))
    with pytest.raises(SystemExit):  # not a record of this script
        probes.main(argv)
    assert len(started_from) == 1
