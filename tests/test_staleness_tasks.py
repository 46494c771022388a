"""training/staleness_tasks.py: each variant's answer follows from its stated rule."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.fidelity_task import BACKGROUNDS, answer_of
from training.staleness_tasks import (
    REPEAT_QUESTION,
    VARIANT_NAMES,
    make_stale_example,
    stale_messages,
)


def _part(_image) -> dict:
    return {"type": "image"}


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_deterministic_and_split_separated(variant):
    a = make_stale_example(variant, "validation", 3, 4)
    assert a == make_stale_example(variant, "validation", 3, 4)
    assert a != make_stale_example(variant, "test", 3, 4)
    assert len(a.images) == 4


def test_repeat_answers_the_later_copy():
    answers = Counter()
    later_slots = Counter()
    for i in range(300):
        e = make_stale_example("repeat", "validation", i, 2 + i % 7)
        colours = [im.colour for im in e.images]
        duplicated = [c for c, k in Counter(colours).items() if k > 1]
        assert len(duplicated) == 1 and colours.count(duplicated[0]) == 2  # exactly one pair
        later = max(j for j, c in enumerate(colours) if c == duplicated[0])
        assert e.answer == BACKGROUNDS[e.images[later].background][0]
        assert len({im.background for im in e.images}) == len(e.images)  # answer is unique
        assert e.question == REPEAT_QUESTION and not e.question_first
        answers[e.answer] += 1
        later_slots[later] += 1
    assert len(answers) == 8 and max(answers.values()) < 60  # all backgrounds, none dominant
    assert set(later_slots) == set(range(1, 8))  # the repeat is never the first image


def test_count_counts_the_named_colour():
    counts = Counter()
    for i in range(400):
        e = make_stale_example("count", "validation", i, 4)
        named = e.question.removeprefix("How many shapes are ").removesuffix("?")
        assert e.answer == str(sum(im.colour == named for im in e.images))
        others = [im.colour for im in e.images if im.colour != named]
        assert len(set(others)) == len(others)
        assert e.other_question != e.question and e.question_first
        counts[e.answer] += 1
    assert set(counts) == {"0", "1", "2", "3"}
    assert min(counts.values()) > 60  # roughly uniform over 0..3 (4 images)


def test_qfirst_asks_before_the_images_about_one_image():
    for i in range(100):
        e = make_stale_example("qfirst", "validation", i, 4)
        content = stale_messages(e, _part)[1]["content"]
        assert content[0]["text"] == e.question + "\n"  # the question comes first
        assert content[-1]["text"] == "\n"  # and is not repeated after the images
        targets = [
            j
            for j, im in enumerate(e.images)
            if im.colour in e.question or BACKGROUNDS[im.background][0] in e.question
        ]
        assert len(targets) == 1
        qtype = (
            "which"
            if "Which background" in e.question
            else "kind"
            if "What shape" in e.question
            else "colour"
        )
        assert e.answer == answer_of(e.images[targets[0]], qtype)
        assert e.other_question != e.question


def test_override_question_and_order():
    e = make_stale_example("qfirst", "validation", 0, 3)
    content = stale_messages(e, _part, order=[2, 1, 0], question="Q?")[1]["content"]
    assert content[0]["text"] == "Q?\n"
    assert sum(part["type"] == "image" for part in content) == 3
    with pytest.raises(ValueError):
        stale_messages(e, _part, order=[0, 0, 1])
    with pytest.raises(ValueError):
        make_stale_example("nope", "validation", 0, 2)


def test_next_answers_about_the_image_after_the_dot():
    answers, dotted_slots = Counter(), Counter()
    for i in range(300):
        e = make_stale_example("next", "validation", i, 2 + i % 7)
        dotted = [j for j, im in enumerate(e.images) if im.marked]
        assert len(dotted) == 1 and dotted[0] < len(e.images) - 1
        after = e.images[dotted[0] + 1]
        qtype = {"What colour": "colour", "Which backg": "which", "What shape ": "kind"}
        assert e.answer == answer_of(after, qtype[e.question[:11]])
        answers[qtype[e.question[:11]]] += 1
        dotted_slots[dotted[0]] += 1
    assert min(answers.values()) > 70  # the three question types, roughly equally
    assert set(dotted_slots) == set(range(7))
