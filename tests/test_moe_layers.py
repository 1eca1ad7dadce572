"""Which layers have routed experts (``ModelSpec.moe_layers``): the fill orders, the profile and the
routing counters cover only those, so a model with leading dense-FFN layers (deepseek2) never asks
for a dense layer's experts."""

from __future__ import annotations

import torch

from strata_core.experts.profile import UsageCounter, UsageProfile, default_order


def test_default_order_covers_only_the_given_layers():
    assert default_order(3, 2, range(1, 3)) == [(1, 0), (2, 0), (1, 1), (2, 1)]
    assert default_order(2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_profile_rank_keeps_only_the_given_layers():
    counts = torch.tensor([[0, 0], [3, 1], [0, 5]])
    profile = UsageProfile(counts, 4)
    assert profile.rank(layers=range(1, 3)) == [(2, 1), (1, 0), (1, 1), (2, 0)]
    assert profile.rank(only_used=True, layers=[1]) == [(1, 0), (1, 1)]
    assert (0, 0) in profile.rank()  # without layers: every entry, as before


def test_usage_counter_counts_tokens_at_the_first_moe_layer():
    counter = UsageCounter(3, 4, torch.device("cpu"), first_layer=1)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])  # [T=3, k=2]
    counter.add(1, ids)
    counter.add(2, ids)
    assert counter.tokens == 3  # once per token, though layer 0 (dense) never routes
    assert counter.counts[0].sum() == 0 and counter.counts[1].tolist() == [1, 2, 2, 1]
