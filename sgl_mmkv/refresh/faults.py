"""Named points of the refresh path where a test can make it fail on purpose.

A server started with ``SGL_MMKV_FAULT_FILE=<path>`` reads that file at each point
and raises :class:`InjectedFault` where the file names the point; without the
variable (every real deployment) a point costs one environment lookup. The tests
use it to prove that a failure anywhere in our path falls back to stock. The file
may name one tensor-parallel rank as ``<stage>@<rank>`` (``copy@1``): only that
rank's scheduler fails there, the others must follow it to stock
(``rank_agreement.py``).
"""

from __future__ import annotations

import os

from sgl_mmkv.refresh.rank_agreement import tp_position

FAULT_FILE_ENV = "SGL_MMKV_FAULT_FILE"
STAGES = (
    "plan",
    "copy",
    "scoring",
    "selection",
    "refresh",
    "ranking",
    "fill",
    "row_compaction",
)


class InjectedFault(RuntimeError):
    """A failure asked for through :data:`FAULT_FILE_ENV`."""


def fault_point(stage: str) -> None:
    """Raise :class:`InjectedFault` if the fault file names ``stage``."""
    path = os.environ.get(FAULT_FILE_ENV)
    if path is None:
        return
    try:
        with open(path) as f:
            wanted = f.read().strip()
    except OSError:
        return
    name, _, rank = wanted.partition("@")
    if name == stage and (not rank or int(rank) == tp_position()[1]):
        raise InjectedFault(f"fault injected at {wanted}")
