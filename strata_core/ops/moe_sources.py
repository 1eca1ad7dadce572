"""Where the CUDA MoE launches of :mod:`strata_core.ops.moe` read each pair's weights, shared by both
designs' launchers (:mod:`strata_core.ops.moe_triton`, :mod:`strata_core.ops.moe_grouped`)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from strata_core.ops.gather import gather_experts
from strata_core.ops.moe import stages_misses

__all__ = ["Sources", "aligned16", "or_unread", "weight_sources"]


class Sources(NamedTuple):
    """A layer's weight sources for ``_pair_base``: ``args`` = (slot ``[P]``, expert ``[P]``, slots base,
    slot stride, miss base, miss stride), the bases as integer addresses; ``staged``: the misses are
    read by pair (``BY_PAIR``); ``miss``: the tensor at the miss base, held until the launches are
    enqueued (its memory must not be reused before they run)."""

    args: tuple
    staged: bool
    miss: Tensor


def weight_sources(slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, nbytes: int, by_pair: bool = False,
                   direct_misses: bool = False) -> Sources:
    """The sources of pairs ``slot`` / ``expert [P]``: a resident pair's slot of ``slots``; a miss in
    ``arena [E, nbytes]``: in place (a device arena, or ``direct_misses``: zero-copy), else copied first
    into a device row per pair (``gather_experts(skip_hits=True)``); ``by_pair``: ``arena`` holds those
    rows already (``[P, nbytes]``)."""
    staged = by_pair or stages_misses(slots, arena, direct_misses)
    miss = gather_experts(slots, arena, slot, expert, nbytes, True) if staged and not by_pair else arena
    return Sources((slot, expert, slots.data_ptr(), slots.stride(0), miss.data_ptr(), miss.stride(0)), staged, miss)


def aligned16(args: tuple, offset: int, row_bytes: int) -> bool:
    """Whether every row of the matrix at byte ``offset`` of a packed expert (``row_bytes`` a row) starts
    at a multiple of 16 bytes in all the sources ``args`` (``Sources.args``): 16-byte loads can read it."""
    return all(v % 16 == 0 for v in (offset, row_bytes, *args[2:]))


def or_unread(tensor: Tensor | None, dummy: Tensor) -> Tensor:
    """``tensor`` made contiguous on ``dummy``'s device, or ``dummy`` for a kernel pointer argument that
    is not read."""
    return dummy if tensor is None else tensor.to(dummy.device).contiguous()
