"""The synthetic multi-image task: deterministic, split-separated, well-posed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from harness.fidelity import kl_from_top_logprobs, leading_image, scenario_requests
from harness.fidelity_task import (
    BACKGROUNDS,
    COLOURS,
    MAX_IMAGES,
    NEXT_QUESTIONS,
    QUESTION_TYPES,
    answer_of,
    chat_messages,
    describe,
    make_example,
    make_split,
    model_max_images,
    model_split,
    model_style,
    score,
)
from sgl_mmkv.testing.images import image_part


def test_same_index_same_example_and_pixels():
    a, b = make_example("test", 7), make_example("test", 7)
    assert a == b
    assert [im.render().tobytes() for im in a.images] == [im.render().tobytes() for im in b.images]
    assert make_example("test", 8) != a


def test_splits_do_not_overlap():
    uids = {
        split: {e.uid() for e in make_split(split, 300)}
        for split in ("train", "validation", "test")
    }
    assert not uids["train"] & uids["test"]
    assert not uids["validation"] & uids["test"]
    assert not uids["train"] & uids["validation"]


def test_covers_every_question_type_and_image_count():
    examples = make_split("test", 400)
    assert {e.qtype for e in examples} == set(QUESTION_TYPES)
    assert {len(e.images) for e in examples} == set(range(1, MAX_IMAGES + 1))


@pytest.mark.parametrize("qtype", QUESTION_TYPES)
def test_answer_follows_from_the_named_image(qtype):
    for i in range(60):
        e = make_example("validation", i, qtype=qtype, num_images=1 + i % 8)
        colours = [im.colour for im in e.images]
        backgrounds = [im.background for im in e.images]
        assert len(set(colours)) == len(colours)  # a colour names exactly one shape
        assert len(set(backgrounds)) == len(backgrounds)  # and a background one image
        target = e.images[e.target]
        background = BACKGROUNDS[target.background][0]
        expected = {"colour": target.colour, "which": background, "kind": target.kind}
        assert e.answer == expected[qtype]
        assert (background if qtype == "colour" else target.colour) in e.question


def test_shape_pixels_sit_in_the_stated_quadrant():
    e = make_example("test", 3, num_images=1)
    image = e.images[0]
    pixels = image.render().load()
    col = ("left", "right").index(image.quadrant.split()[1])
    row = ("top", "bottom").index(image.quadrant.split()[0])
    centre = (col * 56 + 28, row * 56 + 36)  # low in the cell: inside triangles too
    background = image.render().getpixel((0 if col else 111, 0 if row else 111))
    assert pixels[centre] != background


def test_reordering_keeps_the_question():
    e = make_example("test", 11, num_images=4)
    shuffled = chat_messages(e, image_part, order=[3, 2, 1, 0])[1]["content"]
    assert shuffled[-1]["text"] == e.question
    assert [p["text"] for p in shuffled if p["type"] == "text"][0] == "Image 1: "


def test_scenarios_share_the_final_prompt_and_differ_in_warmup():
    e = make_example("test", 5, num_images=3)
    canonical = scenario_requests(e, "repeat")[1]
    for scenario in ("changed_prefix", "reordered"):
        warmups, final = scenario_requests(e, scenario)
        assert final == canonical
        assert warmups[0] != canonical
    warmups, conversation = scenario_requests(e, "multi_turn")
    assert conversation[: len(warmups[0])] == warmups[0]
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user"]


def test_score_is_exact_match():
    assert score(" Red.", "red")
    assert not score("red circle", "red")


def test_kl_of_identical_distributions_is_zero_and_grows_with_change():
    p = {"a": -0.1, "b": -2.5, "c": -4.0}
    assert kl_from_top_logprobs(p, p) == pytest.approx(0.0, abs=1e-12)
    q = {"a": -1.0, "b": -0.6, "c": -4.0}
    far = {"b": -0.01, "c": -5.0}
    assert 0 < kl_from_top_logprobs(p, q) < kl_from_top_logprobs(p, far)


def test_marked_style_keeps_images_and_target_and_marks_only_the_target():
    for i in range(40):
        keyed = make_example("validation", i)
        marked = make_example("validation", i, style="marked")
        assert marked.target == keyed.target and marked.qtype == keyed.qtype
        assert [im.marked for im in marked.images] == [
            j == keyed.target for j in range(len(keyed.images))
        ]
        for j, (a, b) in enumerate(zip(keyed.images, marked.images, strict=True)):
            assert a.key() == b.key()[:5]
            same = a.render().tobytes() == b.render().tobytes()
            assert same == (j != keyed.target)  # the dot changes only the target's pixels
        target = marked.images[marked.target]
        expected = {
            "colour": target.colour,
            "which": BACKGROUNDS[target.background][0],
            "kind": target.kind,
        }
        assert marked.answer == expected[marked.qtype]
        assert "dot" in marked.question


def test_the_dot_sits_on_the_shape():
    images = [make_example("test", i, num_images=1, style="marked").images[0] for i in range(12)]
    assert {image.kind for image in images} == {"circle", "square", "triangle"}
    for image in images:
        plain, dotted = replace(image, marked=False).render(), image.render()
        changed = [
            (x, y)
            for x in range(112)
            for y in range(112)
            if plain.getpixel((x, y)) != dotted.getpixel((x, y))
        ]
        assert 100 < len(changed) < 250  # a disc of radius 7
        shape_colour = dict(COLOURS)[image.colour]
        assert all(plain.getpixel(p) == shape_colour for p in changed), image.kind


def test_next_style_dots_the_image_before_the_target():
    counts = set()
    for i in range(60):
        e = make_example("validation", i, style="next", max_images=4)
        counts.add(len(e.images))
        assert [im.marked for im in e.images] == [j == e.target - 1 for j in range(len(e.images))]
        assert e.question == NEXT_QUESTIONS[e.qtype]
        assert e.answer == answer_of(e.images[e.target], e.qtype)
    assert counts == {2, 3, 4}
    with pytest.raises(ValueError, match="need 2 to 8 images"):
        make_example("test", 0, num_images=1, style="next")


def test_existing_styles_draw_the_same_examples_as_before_the_image_range():
    for i in range(20):
        assert make_example("test", i, style="marked", max_images=MAX_IMAGES) == make_example(
            "test", i, style="marked"
        )


def test_a_checkpoint_record_names_its_style_and_image_range(tmp_path):
    record = {"style": "staleness-next", "config": {"max_images": 3}}
    (tmp_path / "training.json").write_text(json.dumps(record))
    assert (model_style(tmp_path), model_max_images(tmp_path)) == ("next", 3)
    examples = model_split(tmp_path, "test", 30)
    assert {len(e.images) for e in examples} == {2, 3}
    assert all(e.question in NEXT_QUESTIONS.values() for e in examples)
    assert model_max_images(tmp_path / "absent") == MAX_IMAGES


def test_image_prefix_warms_up_after_one_more_dotted_image():
    e = make_example("test", 7, num_images=3, style="next")
    (warm,), final = scenario_requests(e, "image_prefix")
    assert final == scenario_requests(e, "repeat")[1]
    images = [p for p in warm[1]["content"] if p["type"] == "image_url"]
    assert len(images) == 4
    lead = leading_image(e)
    assert lead.marked and lead.colour not in {im.colour for im in e.images}
    assert lead.background not in {im.background for im in e.images}
    assert images[0] == image_part(lead.render())
    assert images[1:] == [image_part(im.render()) for im in e.images]


def test_turn_reordered_shows_the_images_again_in_a_second_turn():
    """Turn 1 (the warm-up, an exact prefix of the probe) shows the images reversed;
    turn 2 is the canonical user message, so its images are reused from turn 1."""
    e = make_example("test", 9, num_images=3, style="next")
    (warm,), final = scenario_requests(e, "turn_reordered")
    canonical = scenario_requests(e, "repeat")[1]
    assert final[:2] == warm and final[3] == canonical[1]
    assert [m["role"] for m in final] == ["system", "user", "assistant", "user"]
    assert warm[1]["content"][-1]["text"] == "Remember these."
    shown = [p for p in warm[1]["content"] if p["type"] == "image_url"]
    assert shown == [image_part(im.render()) for im in reversed(e.images)]


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="unknown style"):
        make_example("test", 0, style="labelled")


def test_text_control_describes_each_image_in_place_of_its_pixels():
    e = make_example("test", 11, num_images=3, style="marked")
    content = chat_messages(e, image_part, as_text=True)[1]["content"]
    assert all(part["type"] == "text" for part in content)
    texts = [part["text"] for part in content]
    for image in e.images:
        assert describe(image) in texts
    assert describe(e.images[e.target]).endswith(
        f"with a dot on {BACKGROUNDS[e.images[e.target].background][0]}"
    )


def test_concurrent_chunks_never_hold_one_example_twice():
    from harness.fidelity import _chunks

    examples = make_split("test", 5)
    jobs = [(e, s) for s in ("reordered", "image_prefix") for e in examples]
    chunks = _chunks(jobs, 4)
    assert [job for chunk in chunks for job in chunk] == jobs
    assert [len(c) for c in chunks] == [4, 4, 2]
    for chunk in chunks:
        assert len({id(e) for e, _ in chunk}) == len(chunk)
    assert _chunks(jobs[:3], 1) == [[job] for job in jobs[:3]]
    two = [(e, s) for s in ("reordered", "image_prefix") for e in examples[:2]]
    assert [len(c) for c in _chunks(two, 4)] == [2, 2]  # example 0 would repeat


def test_fidelity_pool_holds_a_chunk_of_warm_ups_and_probes(tmp_path):
    """16 tokens per image at 112 x 112 and 64 at 224 x 224 (one per 28 x 28 pixels);
    the pool grows with the images a chunk holds and never drops under 4096."""
    from pathlib import Path

    from harness.fidelity_task import fidelity_pool_tokens, model_image_side, model_image_tokens

    root = Path(__file__).resolve().parent.parent / "models"
    assert model_image_tokens(root / "fidelity-qwen2-vl-next") == 16
    assert fidelity_pool_tokens(root / "fidelity-qwen2-vl-next", 1) == 4096
    # next: 4 images at most -> 8 probes x (3 x 4 x 16 + 512) = 5632
    assert fidelity_pool_tokens(root / "fidelity-qwen2-vl-next", 8) == 5632
    page = tmp_path / "page"
    page.mkdir()
    config = json.loads((root / "fidelity-qwen2-vl-next" / "processor_config.json").read_text())
    config["image_processor"]["size"] = {"longest_edge": 224 * 224, "shortest_edge": 224 * 224}
    (page / "processor_config.json").write_text(json.dumps(config))
    (page / "training.json").write_text(json.dumps({"config": {"max_images": 8}}))
    assert model_image_tokens(page) == 64
    assert model_image_side(page) == 224
    assert model_image_side(root / "fidelity-qwen2-vl-next") == 112
    assert fidelity_pool_tokens(page, 8) == 8 * (3 * 8 * 64 + 512)


def test_images_are_sent_at_the_size_asked_for_and_keep_their_content():
    """At 224 pixels a side an image is its 112-pixel drawing resized (what the
    page-sized model's processor did in training); the example is otherwise the same."""
    from PIL import Image

    small = make_example("test", 5, style="next")
    page = make_example("test", 5, style="next", image_side=224)
    assert [im.key() for im in page.images] == [im.key() for im in small.images]
    assert (page.question, page.answer) == (small.question, small.answer)
    drawn = small.images[0].render()
    sent = page.images[0].render()
    assert drawn.size == (112, 112) and sent.size == (224, 224)
    assert sent.tobytes() == drawn.resize((224, 224), Image.Resampling.BICUBIC).tobytes()
    assert leading_image(page).render().size == (224, 224)


def test_a_processor_with_a_size_range_keeps_the_task_size(tmp_path):
    """Only a fixed processor size (min == max) sets the image side; a range (the
    tiny models' default 56^2..224^2) keeps a 112-pixel image at 112, 16 tokens."""
    import json

    from harness.fidelity_task import model_image_side, model_image_tokens

    config = {"image_processor": {"size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224},
                                  "patch_size": 14, "merge_size": 2}}  # fmt: skip
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    assert (model_image_side(tmp_path), model_image_tokens(tmp_path)) == (112, 16)


def test_images_sent_at_224_are_what_the_processor_trained_the_page_model_on():
    """The page model was trained on 112-pixel drawings its processor resized to 224;
    served, it gets 224-pixel images: the pixel values reaching the tower are equal."""
    from pathlib import Path

    import torch
    from transformers import AutoProcessor

    from training.staleness_probes import set_image_side

    root = Path(__file__).resolve().parent.parent / "models"
    trained = AutoProcessor.from_pretrained(root / "fidelity-qwen2-vl-next")
    set_image_side(trained, 224)
    served = AutoProcessor.from_pretrained(root / "fidelity-qwen2-vl-page")
    for image in make_example("test", 11, num_images=3, style="next").images:
        a = trained.image_processor(images=[image.render()], return_tensors="pt")
        big = replace(image, side=224).render()
        b = served.image_processor(images=[big], return_tensors="pt")
        assert a["image_grid_thw"].tolist() == b["image_grid_thw"].tolist() == [[1, 16, 16]]
        assert torch.allclose(a["pixel_values"], b["pixel_values"], atol=1e-5)


def test_the_demo_expects_the_answer_the_reversal_gives():
    """A ``next`` question asks about the image after the dotted one: reversed, that
    is the image before it; a dotted first image leaves none after it."""
    from harness.demo import _reversed_answer

    example = make_example("test", 3, num_images=4, style="next")
    dotted = next(i for i, im in enumerate(example.images) if im.marked)
    assert example.answer == answer_of(example.images[dotted + 1], example.qtype)
    if dotted > 0:
        assert _reversed_answer(example) == answer_of(example.images[dotted - 1], example.qtype)
    first_dotted = next(
        e for i in range(50)
        if (e := make_example("test", i, num_images=3, style="next")).images[0].marked
    )  # fmt: skip
    assert _reversed_answer(first_dotted).startswith("(none")
    marked = make_example("test", 3, num_images=4, style="marked")
    assert _reversed_answer(marked) == marked.answer


def test_the_demo_table_gives_each_sides_medians_and_right_answers():
    from harness.demo import Turn, _table

    def turn(answer: str, ttft: float, tokenizer: float, prefill: float) -> Turn:
        return Turn(answer, ttft, tokenizer, prefill, 324, 5, reused_tokens=256)

    stock = {"q": [turn("red", 90, 60, 30), turn("blue", 80, 50, 28), turn("red", 99, 70, 31)]}
    mmkv = {"q": [turn("red", 70, 55, 12), turn("red", 75, 60, 14), turn("red", 60, 45, 10)]}
    rows = _table([("stock", stock), ("mmkv", mmkv)], {"q": "red"}).splitlines()
    assert rows[0].endswith("| TTFT ms, median (min-max) | tokenizer ms | prefill forward ms |")
    assert (
        rows[2]
        == "| q | stock | 'red' (2 of 3 right) | 324 | 5 | 256 | 0 | 0 | 90 (80-99) | 60 | 30 |"
    )
    assert (
        rows[3]
        == "| q | mmkv | 'red' (3 of 3 right) | 324 | 5 | 256 | 0 | 0 | 70 (60-75) | 55 | 12 |"
    )


def test_the_demo_speed_table_gives_speed_ups_and_equal_tokens(tmp_path):
    from harness.demo_speed import SpeedSide, plot, queries, table

    stock = SpeedSide("stock", "s", [2000.0, 2200.0, 2100.0], ["a", "b", "c"])
    fast = SpeedSide("conduit 0.1", "m", [600.0, 700.0, 650.0], ["a", "x", "c"], 6144, 612)
    exact = SpeedSide("conduit 1.0", "m", [2400.0], ["a"], 6144, 6144)  # asked once
    rows = table([stock, fast, exact]).splitlines()
    assert rows[2] == "| stock | 2,100 (2,000-2,200) | 1.00x | 0 | 0 | 3 of 3 |"
    assert rows[3] == "| conduit 0.1 | 650 (600-700) | 3.23x | 6,144 | 612 | 2 of 3 |"
    assert rows[4] == "| conduit 1.0 | 2,400 (2,400-2,400) | 0.88x | 6,144 | 6,144 | 1 of 1 |"
    plot([stock, fast, exact], tmp_path / "bars.png")
    assert (tmp_path / "bars.png").stat().st_size > 1000
    asked = queries(3)
    systems = {m[0]["content"] for m in asked}
    pages = [tuple(p["image_url"]["url"] for p in m[1]["content"][:-1]) for m in asked]
    assert len(systems) == 3 and len(set(pages)) == 3  # new prefixes, new page orders
    assert all(len(set(p)) == 8 for p in pages) and len({frozenset(p) for p in pages}) == 1
