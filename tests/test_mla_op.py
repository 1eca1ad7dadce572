"""``strata::mla_attention`` (strata_core/ops/mla.py): the CPU reference against per-head softmax
attention, its fake, opcheck. The Triton kernel is compared with this reference in
tests/test_deepseek2_cuda.py (on CUDA, or on the CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from strata_core.ops.mla import mla_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(nh: int, T: int, C: int, R: int, S: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(nh, T, C, generator=gen, dtype=torch.float64),
            torch.randn(T, nh, R, generator=gen, dtype=torch.float64).transpose(0, 1),
            torch.randn(S, C, generator=gen, dtype=torch.float64),
            torch.randn(S, R, generator=gen, dtype=torch.float64))


def test_mla_attention_is_each_heads_causal_softmax_over_the_shared_latent():
    nh, C, R, S = 3, 16, 8, 12
    q_lat, q_rope, latent, rope = _inputs(nh, 3, C, R, S, 0)
    positions = torch.tensor([0, 5, 20])  # row 2 sees every row of the cache (S = 12 < 21)
    out = mla_attention(q_lat, q_rope, latent, rope, positions, 0.3)
    assert out.shape == (nh, 3, C) and out.dtype == latent.dtype
    for t, p in enumerate(positions.tolist()):
        n = min(p + 1, S)
        for h in range(nh):
            scores = 0.3 * (latent[:n] @ q_lat[h, t] + rope[:n] @ q_rope[h, t])  # [n]
            torch.testing.assert_close(out[h, t], torch.softmax(scores, 0) @ latent[:n])
    assert torch.equal(out[:, 0], latent[0].expand(nh, C))  # one visible row: that row
    torch.library.opcheck(torch.ops.strata.mla_attention.default,
                          (*_inputs(2, 2, C, R, S, 1), torch.tensor([3, 11]), 0.5))
