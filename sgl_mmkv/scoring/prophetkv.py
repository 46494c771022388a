"""ProphetKV (arXiv 2602.02579): CONDUIT's attention mass alone, layer-averaged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sgl_mmkv.scoring.conduit import ConduitScorer


@dataclass
class ProphetKVScorer(ConduitScorer):
    """ProphetKV: CONDUIT without value-norm weighting and without image amplification
    (the same knobs; these two default off)."""

    name: ClassVar[str] = "prophetkv"
    summary: ClassVar[str] = "ProphetKV: refresh the tokens with the most attention mass"
    amplification: float = 0.0
    use_value_norm: bool = False
