"""A scorer's knobs: the fields of its dataclass, set from a JSON object.

``--mm-refresh-scorer-args '{"use_value_norm": false}'`` reaches the ``--mm-reuse``
scorer through :func:`parse_knobs`: an unknown name, or a value whose JSON type does
not match the knob's default, is refused before the server starts. A knob's range
is the scorer's own check (its ``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import json

from sgl_mmkv.scoring.base import TokenScorer


def scorer_knobs(cls: type[TokenScorer]) -> dict[str, object]:
    """Knob name -> default, for every init field of ``cls`` (empty if it has none)."""
    if not dataclasses.is_dataclass(cls):
        return {}
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.init and f.default is not dataclasses.MISSING
    }


def _same_kind(value: object, default: object) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    return True  # None or a sequence: the scorer checks it


def json_object(text: str) -> dict:
    """``text`` parsed as a JSON object.

    Raises:
        ValueError: "is not JSON: ..." or "must be a JSON object, got ...".
    """
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    return value


def parse_knobs(cls: type[TokenScorer], text: str) -> dict[str, object]:
    """``text`` (a JSON object, or empty) as keyword arguments of ``cls``.

    Raises:
        ValueError: not a JSON object, an unknown knob, or a value of another kind
            than the knob's default; the message names the knobs ``cls`` has.
    """
    if not text:
        return {}
    values = json_object(text)
    knobs = scorer_knobs(cls)
    listed = ", ".join(knobs) or "none"
    for name, value in values.items():
        if name not in knobs:
            raise ValueError(f"{cls.name} has no knob {name!r} (its knobs: {listed})")
        if not _same_kind(value, knobs[name]):
            raise ValueError(
                f"{cls.name} knob {name!r} takes a value like {knobs[name]!r}, got {value!r}"
            )
    return values
