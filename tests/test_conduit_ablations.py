"""The named CONDUIT ablations are valid scorer knobs, each switching one part off."""

from __future__ import annotations

import pytest

from harness.conduit_ablations import (
    ABLATIONS,
    ablation_knobs,
    ablation_label,
    scorer_args,
)
from sgl_mmkv.config import MMKVConfig
from sgl_mmkv.scoring import make_refresh_scorer


@pytest.mark.parametrize("name", [*ABLATIONS, "layers_0_1", "layers_3"])
def test_each_ablation_is_a_conduit_config_that_differs_from_the_default(name):
    config = MMKVConfig(mm_reuse="conduit", mm_refresh_scorer_args=scorer_args(name))
    scorer = make_refresh_scorer("conduit", **config.refresh_scorer_knobs())
    assert scorer != make_refresh_scorer("conduit")
    assert ablation_label(name) == f"conduit-{name}"


def test_layer_subsets_are_parsed_and_unknown_names_refused():
    assert ablation_knobs("layers_2_3") == {"layers": [2, 3]}
    assert ablation_knobs("no_amplification") == {"amplification": 0.0}
    for bad in ("layers_", "layers_a", "no_attention"):
        with pytest.raises(ValueError, match=f"unknown CONDUIT ablation '{bad}'"):
            ablation_knobs(bad)
