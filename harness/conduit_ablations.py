"""CONDUIT with one part switched off: named sets of ``--mm-refresh-scorer-args``.

The fidelity benchmark runs each named ablation as a ``conduit`` server with those
knobs (``benchmarks/fidelity.py --conduit-ablations``), labelled ``conduit-<name>``.
Layer subsets are spelled ``layers_<i>_<j>...`` (model layer ids).
"""

from __future__ import annotations

import json

ABLATIONS: dict[str, dict[str, object]] = {
    "no_value_norm": {"use_value_norm": False},
    "no_amplification": {"amplification": 0.0},
    "last_text": {"query_span": "last_text"},
}
LAYERS_PREFIX = "layers_"
LABEL_PREFIX = "conduit-"


def ablation_knobs(name: str) -> dict[str, object]:
    """The scorer knobs of ablation ``name``.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name in ABLATIONS:
        return dict(ABLATIONS[name])
    ids = name.removeprefix(LAYERS_PREFIX).split("_")
    if name.startswith(LAYERS_PREFIX) and all(i.isdigit() for i in ids):
        return {"layers": [int(i) for i in ids]}
    raise ValueError(
        f"unknown CONDUIT ablation {name!r}; choose one of {', '.join(ABLATIONS)} "
        f"or {LAYERS_PREFIX}<i>_<j>..."
    )


def ablation_label(name: str) -> str:
    """The mode label of ablation ``name`` in tables, JSON and plots."""
    return LABEL_PREFIX + name


def scorer_args(name: str) -> str:
    """``--mm-refresh-scorer-args`` of ablation ``name``."""
    return json.dumps(ablation_knobs(name), sort_keys=True)
