"""A peer's decode rows taken in place of the home's (``strata::moe_decode``'s ``served`` rows, from
``strata::moe_decode_rows``): the combined output is bit for bit the one of a single device holding
every expert, on the CPU (the references) and on CUDA (the Triton kernels), for any split of the pairs.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.ops.gather import gather_experts
from strata_core.ops.moe import moe_decode, moe_decode_rows
from test_kernels import experts, op_args

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOKENS, TOPK, N_EXPERTS = 3, 4, 10


def _case(device: str, seed: int):
    """Experts 0-3 on the home, 4-7 on the peer, 8-9 in the arena only; ``x``, routing and weights."""
    hidden, ffn = (2048, 768) if device == "cuda" else (256, 64)
    packed, fmt = experts((T.Q4_K, T.Q4_K, T.Q6_K), hidden, ffn, N_EXPERTS, seed)
    gen = torch.Generator().manual_seed(seed)
    home = torch.zeros(5, packed.shape[1], dtype=torch.uint8)  # slot 4: the home's zero slot
    home[:4] = packed[:4]
    peer = torch.zeros(5, packed.shape[1], dtype=torch.uint8)  # slot 4: the peer's zero slot
    peer[:4] = packed[4:8]
    everything = packed.clone()  # a single device holding every expert in slot = expert
    expert = torch.randperm(N_EXPERTS, generator=gen)[:TOPK].repeat(TOKENS)  # [P]
    expert[::3] = torch.randint(0, N_EXPERTS, (expert[::3].numel(),), generator=gen)
    x = torch.randn(TOKENS, hidden, generator=gen)
    weights = torch.rand(TOKENS, TOPK, generator=gen)
    arena = packed.pin_memory() if device == "cuda" else packed
    return fmt, arena, home, peer, everything, expert, x, weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("prestaged", [False, True])
def test_peer_rows_in_place_give_the_single_device_output_bit_for_bit(device, dtype, seed, prestaged):
    """Also where the home staged its misses first (``gather_experts(skip_hits=True)``, read by pair
    with ``staged=True``), as it does while a peer computes."""
    fmt, arena, home, peer, everything, expert, x, weights = _case(device, seed)
    x, weights, expert = x.to(device, dtype), weights.to(device), expert.to(device)
    home, peer, everything = home.to(device), peer.to(device), everything.to(device)
    single = moe_decode(*op_args(x, everything, arena, expert, expert, TOPK, fmt)[:5], weights,
                        *op_args(x, everything, arena, expert, expert, TOPK, fmt)[5:])
    on_peer = (expert >= 4) & (expert < 8)
    peer_slot = torch.where(on_peer, expert - 4, 4)  # the pairs it does not serve: its zero slot
    rows = moe_decode_rows(*op_args(x, peer, arena, peer_slot, expert, TOPK, fmt))
    assert rows.dtype == torch.float32 and rows.shape == (TOKENS * TOPK, x.shape[1])
    home_slot = torch.where(expert < 4, expert, torch.where(on_peer, 4, -1))  # 8, 9: misses
    source = gather_experts(home, arena, home_slot, expert, fmt.total, True) if prestaged else arena
    got = moe_decode(*op_args(x, home, source, home_slot, expert, TOPK, fmt)[:5], weights,
                     *op_args(x, home, source, home_slot, expert, TOPK, fmt)[5:], served=on_peer, served_rows=rows,
                     staged=prestaged)
    assert torch.equal(got, single)


def test_opcheck_served_rows_and_decode_rows():
    fmt, arena, home, peer, everything, expert, x, weights = _case("cpu", 2)
    on_peer = (expert >= 4) & (expert < 8)
    args = op_args(x, peer, arena, torch.where(on_peer, expert - 4, 4), expert, TOPK, fmt)
    torch.library.opcheck(torch.ops.strata.moe_decode_rows.default, args)
    rows = moe_decode_rows(*args)
    home_args = op_args(x, home, arena, torch.where(expert < 4, expert, -1), expert, TOPK, fmt)
    torch.library.opcheck(torch.ops.strata.moe_decode.default, (*home_args[:5], weights, *home_args[5:]),
                          {"served": on_peer, "served_rows": rows})
    staged = gather_experts(home, arena, home_args[3], expert, fmt.total, True)
    torch.library.opcheck(torch.ops.strata.moe_decode.default, (*home_args[:2], staged, *home_args[3:5], weights,
                                                                *home_args[5:]), {"staged": True})
