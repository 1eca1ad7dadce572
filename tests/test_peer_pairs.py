"""``peer_pairs``: a computing peer's share of a decode layer's pairs, against a loop over the pairs
(the CPU's torch ops) and, on CUDA, the one-launch kernel against the torch ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.experts.gather import peer_pairs

ZERO = 999  # the peer's zero slot


def _case(seed: int, n_pairs: int):
    gen = torch.Generator().manual_seed(seed)
    n_experts = 16
    expert = torch.randint(0, n_experts, (n_pairs,), generator=gen)
    home = torch.where(torch.rand(n_experts, generator=gen) < 0.3, torch.arange(n_experts), -1)
    held = torch.where((torch.rand(n_experts, generator=gen) < 0.4) & (home < 0), torch.arange(n_experts) + 100, -1)
    return expert, home[expert] >= 0, held.to(torch.int32)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_pairs=st.integers(1, 40), layer=st.integers(0, 60),
       frac=st.sampled_from([0.0, 0.35, 0.5, 1.0]))
def test_the_peer_serves_what_it_holds_and_its_share_of_the_misses(seed, n_pairs, layer, frac):
    expert, taken, held = _case(seed, n_pairs)
    counters = torch.zeros(2, dtype=torch.int64)
    peer_slot, mine, after = peer_pairs(expert, taken, held, ZERO, layer, frac, counters, nbytes=10)
    in_share = [(e * 7919 + layer * 104729) % 1000 < round(frac * 1000) for e in expert.tolist()]
    want_slot, want_mine, streamed = [], [], 0
    for e, t, share in zip(expert.tolist(), taken.tolist(), in_share):
        h = int(held[e])
        serves = not t and (h >= 0 or share)
        streamed += serves and h < 0
        want_mine.append(serves)
        want_slot.append(h if serves else ZERO)
    assert peer_slot.tolist() == want_slot and mine.tolist() == want_mine
    assert after.tolist() == [t or m for t, m in zip(taken.tolist(), want_mine)]
    assert counters.tolist() == [len({e for e, m in zip(expert.tolist(), want_mine) if m}), streamed * 10]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("seed", range(8))
def test_the_cuda_launch_gives_the_torch_ops_integers(seed):
    expert, taken, held = _case(seed, 8 * (1 + seed % 4))
    frac, layer = [0.0, 0.35, 0.5, 1.0][seed % 4], 3 * seed
    want = torch.zeros(2, dtype=torch.int64)
    expected = peer_pairs(expert, taken, held, ZERO, layer, frac, want, 77)
    got_counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    got = peer_pairs(expert.cuda(), taken.cuda(), held.cuda(), ZERO, layer, frac, got_counts, 77)
    for g, w in zip(got, expected):
        assert torch.equal(g.cpu(), w)
    assert torch.equal(got_counts.cpu(), want)
