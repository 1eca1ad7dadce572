"""Usage profiles: JSON round trip, rank order, the default order, bad files."""

from __future__ import annotations

import json

import pytest
import torch

from strata_core.errors import ConfigError
from strata_core.experts.profile import UsageCounter, UsageProfile, default_order


def test_round_trip_and_rank(tmp_path):
    counts = torch.tensor([[0, 5, 2], [5, 0, 9]])
    UsageProfile(counts, tokens=7, model="m.gguf").save(tmp_path / "p.json")
    loaded = UsageProfile.load(tmp_path / "p.json", 2, 3)
    assert torch.equal(loaded.counts, counts) and loaded.tokens == 7 and loaded.model == "m.gguf"
    # by count descending, ties by (layer, expert)
    assert loaded.rank() == [(1, 2), (0, 1), (1, 0), (0, 2), (0, 0), (1, 1)]
    assert loaded.rank(only_used=True) == [(1, 2), (0, 1), (1, 0), (0, 2)]


def test_default_order_is_round_robin_over_layers():
    assert default_order(2, 3) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_counter_counts_routings():
    counter = UsageCounter(2, 4, torch.device("cpu"))
    counter.add(0, torch.tensor([[1, 2], [1, 3]]))
    counter.add(1, torch.tensor([[0, 0]]))
    profile = counter.profile()
    assert profile.counts.tolist() == [[0, 2, 1, 1], [2, 0, 0, 0]]
    assert profile.tokens == 2


@pytest.mark.parametrize("doc, message", [
    ({"format": "other"}, "not a Strata expert profile"),
    ({"format": "strata-expert-profile", "counts": [[1, 2]]}, r"counts are \(1, 2\)"),
    ({"format": "strata-expert-profile", "counts": [[1, -2, 0], [0, 0, 0]]}, "negative"),
])
def test_bad_profiles_are_config_errors(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        UsageProfile.load(path, 2, 3)
    with pytest.raises(ConfigError, match="cannot read"):
        UsageProfile.load(tmp_path / "missing.json", 2, 3)
