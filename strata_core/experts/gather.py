"""The decode gather: one layer's expert rows found from the residency table, with no host read.

Inside a decode window (``CachedExpertRows.gather``) a layer's rows are computed per routed
(token, j) pair, P = T*k pairs, in a fixed number of device ops whatever the routing:

1. ``slot = table.mirror[layer][expert_ids]`` on the device (-1 = miss);
2. ``strata::gather_experts`` copies every pair's packed expert into ``[P, total]``: resident pairs
   from the cache's slots, missed pairs zero-copy from the layer's pinned arena buffer;
3. ``pair_ffn`` dequantizes the gathered gate/up/down blocks of all pairs at once
   (``[P, bytes] -> [P, out, in]``) and runs the SiLU-gated FFN per pair as batched products.

On CUDA, steps 2-3 are one op instead (``fused_rows``: ``strata::moe_pair_rows``, ops/moe.py):
Triton kernels that decode the quantized blocks in registers straight from the slots (misses
staged over the link by the gather kernel) and never write a dequantized weight; its rows agree
with the reference within float tolerance, not bit for bit (the CPU keeps steps 2-3).

Exactness: every product goes through ``strata_core.ops.matmul.matmul``, which on the CPU pads the
one row of a pair to a 16-row tile, the gemm path the reference's grouped product of the same
expert takes; each output row then has the same bits as in the reference (``DequantExpertRows``),
and the dtype casts follow ``expert_ffn`` step by step.

Telemetry (``count_pairs``) is counted per layer on the device and read only in
``ExpertTelemetry.snapshot()``: pairs that hit, distinct (layer, expert) resident / read over the
link (as the host path counts them), and bytes read over the link, ``missed pairs * total`` (each
missed pair reads its own copy: the gather does not deduplicate, which would need a host read).
"""

from __future__ import annotations

import torch

from strata_core.experts.arena import ExpertFormat
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.experts.grouped import dequantize_experts, grouped_ffn
from strata_core.ops.gather import HAS_TRITON, gather_experts, pair_bookkeeping_cuda, peer_pairs_cuda
from strata_core.ops.moe import (ffn_args, moe_decode, moe_decode_rows, moe_pair_rows, pair_ffn_reference,
                                  stages_misses)

__all__ = ["GATHER_COUNTS", "PROMPT_GATHER_COUNTS", "count_pairs", "fused_decode", "fused_decode_rows", "fused_rows", "lookup_slots", "pair_ffn",
           "pair_ffn_grouped", "peer_pairs", "stage_misses", "PEER_COUNTS"]

#: The telemetry counters ``count_pairs`` adds, in order (a decode window's misses are read over the link).
GATHER_COUNTS = ("expert_hits", "experts_resident", "experts_pcie", "bytes_streamed")
#: The same counters for a prompt chunk (its misses count as streamed, as the grouped prefill counts them).
PROMPT_GATHER_COUNTS = ("expert_hits", "experts_resident", "experts_streamed", "bytes_streamed")
#: The telemetry counters ``peer_pairs`` adds, in order.
PEER_COUNTS = ("experts_peer", "bytes_streamed")


def pair_ffn(x: torch.Tensor, packed: torch.Tensor, fmt: ExpertFormat, ffn: ExpertFFN = SILU,
             expert: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[P, H]``: pair p's expert (packed bytes ``packed[p]``, ``[P, >= total]``) on ``x[p]`` (``[P, H]``),
    ``down(silu(gate x) * up x)``, or as ``ffn`` says with the biases of ``expert [P]``."""
    return pair_ffn_reference(x, *fmt.split(packed), fmt.qtypes, fmt.shapes, ffn, expert)


def pair_ffn_grouped(x: torch.Tensor, packed: torch.Tensor, fmt: ExpertFormat, ffn: ExpertFFN,
                     expert: torch.Tensor) -> torch.Tensor:
    """``pair_ffn``'s rows as the grouped prefill computes them (a GPU's path for experts the fused
    kernel does not serve, gpt-oss's): every pair's blocks dequantized at once in ``x``'s dtype
    (``dequantize_experts``: Triton on CUDA), then ``grouped_ffn`` with one row per pair. Within
    float tolerance of ``pair_ffn``; no host read."""
    ones = torch.ones_like(expert)  # [P]: each pair its own group of one row
    return grouped_ffn(x, *dequantize_experts(packed, fmt, x.dtype), ones, 1, ffn=ffn, experts=expert)


def _format_args(fmt: ExpertFormat) -> tuple[list[int], list[int], list[int]]:
    """The ``qtypes``, flat ``shapes`` and ``nbytes`` arguments of the MoE ops for experts of ``fmt``."""
    return [int(q) for q in fmt.qtypes], [n for shape in fmt.shapes for n in shape], list(fmt.nbytes)


def fused_rows(hidden: torch.Tensor, slots: torch.Tensor, arena: torch.Tensor, slot: torch.Tensor,
               expert: torch.Tensor, fmt: ExpertFormat, ffn: ExpertFFN = SILU,
               direct_misses: bool = False) -> torch.Tensor:
    """Rows ``[P, H]`` of the pairs (``slot``/``expert [P]``, token ``p // k`` of ``hidden [T, H]``) through
    ``strata::moe_pair_rows``: the weights read from ``slots`` or the layer's ``arena [E, total]`` (a host
    arena's misses zero-copy where ``direct_misses``, else staged first); ``ffn``'s biases and activation
    applied in the kernels."""
    k = slot.shape[0] // hidden.shape[0]
    return moe_pair_rows(hidden, slots, arena, slot, expert, k, *_format_args(fmt), **ffn_args(ffn),
                         direct_misses=direct_misses)


def fused_decode(hidden: torch.Tensor, slots: torch.Tensor, arena: torch.Tensor, slot: torch.Tensor,
                 expert: torch.Tensor, weights: torch.Tensor, fmt: ExpertFormat, ffn: ExpertFFN = SILU,
                 served: torch.Tensor | None = None, served_rows: torch.Tensor | None = None,
                 staged: torch.Tensor | None = None, direct_misses: bool = False) -> torch.Tensor:
    """The routed output ``[T, H]`` of the pairs of :func:`fused_rows` combined with ``weights [T, k]``
    (``combine_rows``) through ``strata::moe_decode``: on CUDA the down launch sums the rows; the pairs
    flagged in ``served [P]`` take their float32 rows from ``served_rows [P, H]`` (:func:`fused_decode_rows`
    on a peer); the misses are read from ``staged`` (:func:`stage_misses`) where given, else ``arena``
    (zero-copy where ``direct_misses``)."""
    return moe_decode(hidden, slots, arena if staged is None else staged, slot, expert, weights, weights.shape[1],
                      *_format_args(fmt), **ffn_args(ffn), served=served, served_rows=served_rows,
                      staged=staged is not None, direct_misses=direct_misses)


def stage_misses(slots: torch.Tensor, arena: torch.Tensor, slot: torch.Tensor, expert: torch.Tensor,
                 fmt: ExpertFormat, direct_misses: bool = False) -> torch.Tensor | None:
    """The missed pairs' experts (``slot < 0``) copied from a host ``arena`` into a row per pair on
    ``slots``' device, ``[P, total]`` (the hits' rows unwritten), as :func:`fused_decode` would stage
    them itself: done first, the copy can overlap other work (a peer's rows). None where the kernels
    read the arena in place (a device arena, or ``direct_misses``)."""
    if not stages_misses(slots, arena, direct_misses):
        return None
    return gather_experts(slots, arena, slot, expert, fmt.total, True)


def fused_decode_rows(hidden: torch.Tensor, slots: torch.Tensor, arena: torch.Tensor, slot: torch.Tensor,
                      expert: torch.Tensor, fmt: ExpertFormat, ffn: ExpertFFN = SILU,
                      direct_misses: bool = False) -> torch.Tensor:
    """Float32 rows ``[P, H]`` of the pairs of :func:`fused_rows` exactly as :func:`fused_decode` computes
    them before it combines them (``strata::moe_decode_rows``)."""
    k = slot.shape[0] // hidden.shape[0]
    return moe_decode_rows(hidden, slots, arena, slot, expert, k, *_format_args(fmt), **ffn_args(ffn),
                           direct_misses=direct_misses)


def lookup_slots(expert: torch.Tensor, resident: torch.Tensor, usage: torch.Tensor,
                 counters: torch.Tensor | None = None, nbytes: int = 0,
                 live: torch.Tensor | None = None) -> torch.Tensor:
    """The slot ``[P]`` of each pair's expert (``expert [P]``; ``resident [E]`` is the layer's row of the
    residency mirror, -1 = miss), each routing added to ``usage [E]`` (int64, in place) and, with
    ``counters``, the pairs' :func:`count_pairs` too. ``live`` (int64 ``[1]`` on the device, or None:
    every pair): only the first ``live`` pairs are counted, the rest are a padded window's rows. On
    CUDA one launch (``strata_core.ops.gather.pair_bookkeeping_cuda``) where torch takes five."""
    if expert.device.type == "cuda" and HAS_TRITON:
        return pair_bookkeeping_cuda(expert, resident, usage=usage, counters=counters, nbytes=nbytes, live=live)
    slot = resident[expert]  # [P]
    usage.index_add_(0, expert, _live_mask(expert, live).to(usage.dtype))
    if counters is not None:
        count_pairs(slot, expert, resident, counters, nbytes, live)
    return slot


def _live_mask(expert: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``[P]`` bool: which pairs count (the first ``live``, all without it)."""
    index = torch.arange(expert.shape[0], device=expert.device)
    return index < (expert.shape[0] if live is None else live.to(expert.device))


def count_pairs(slot: torch.Tensor, expert: torch.Tensor, resident: torch.Tensor, counters: torch.Tensor,
                nbytes: int, live: torch.Tensor | None = None) -> None:
    """Add the ``GATHER_COUNTS`` of one layer's pairs to ``counters`` (int64 ``[4]`` on the device, in place):
    pairs that hit, distinct experts resident in the own cache, distinct experts missed, missed bytes.

    :param slot: ``[P]`` slot of each pair's expert, -1 = miss (a peer's pairs point at a zero slot: they
        are neither resident nor missed)
    :param expert: ``[P]`` expert of each pair
    :param resident: ``[E]`` the layer's row of the residency mirror
    :param nbytes: packed bytes of one expert of the layer
    :param live: int64 ``[1]``: only the first ``live`` pairs count (None: all)

    On CUDA one Triton launch (``pair_bookkeeping_cuda``) instead of a dozen small torch kernels;
    the same integers.
    """
    if slot.device.type == "cuda" and HAS_TRITON:
        pair_bookkeeping_cuda(expert, resident, slot=slot, counters=counters, nbytes=nbytes, live=live)
        return
    counted = _live_mask(expert, live)  # [P]
    hit = (slot >= 0) & counted  # [P]
    routed = torch.zeros_like(resident, dtype=torch.bool).index_fill_(0, expert[counted], True)  # [E]
    missed = torch.zeros_like(routed).index_fill_(0, expert[counted & ~hit], True)  # [E]
    counters.add_(torch.stack([hit.sum(), (routed & (resident >= 0)).sum(), missed.sum(),
                               (counted & ~hit).sum() * nbytes]))


def peer_pairs(expert: torch.Tensor, taken: torch.Tensor, held: torch.Tensor, zero_slot: int, layer: int,
               frac: float, counters: torch.Tensor | None = None,
               nbytes: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A peer's share of a decode layer's pairs ``expert [P]``, on their device, no host read.

    The peer serves the pairs no earlier source serves (``taken [P]`` False) whose expert it holds
    (``held [E]``: the layer's row of its mirror, as read on this device) and, of those that missed
    everywhere, the ones whose expert falls in a deterministic share ``frac`` of the experts (spread
    over ids and layers), which a computing peer streams over its own host link (0 for a peer read
    across). Returns ``peer_slot [P]`` (its
    slot; -1 for a streamed pair; ``zero_slot`` for a pair it does not serve), ``mine [P]`` and
    ``taken | mine``. ``counters`` (int64 ``[2]``, ``PEER_COUNTS``): the distinct experts the peer
    serves and the bytes it streams (``nbytes`` an expert) are added. On CUDA one launch
    (``peer_pairs_cuda``) where torch takes a dozen; the same integers."""
    threshold = round(frac * 1000)
    if expert.device.type == "cuda" and HAS_TRITON:
        return peer_pairs_cuda(expert, taken, held, zero_slot, layer, threshold, counters, nbytes)
    slot = held[expert]  # [P]
    free = ~taken
    streamed = free & (slot < 0) & ((expert * 7919 + layer * 104729) % 1000 < threshold)
    mine = (free & (slot >= 0)) | streamed
    if counters is not None:
        distinct = torch.zeros(held.shape, dtype=torch.bool, device=expert.device).scatter_(0, expert, mine)  # [E]
        counters.add_(torch.stack([distinct.sum(), streamed.sum() * nbytes]))
    return torch.where(mine, slot, zero_slot), mine, taken | mine
