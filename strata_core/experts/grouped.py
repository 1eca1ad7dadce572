"""Grouped prefill: one layer's routed experts as a few large device ops instead of a loop per expert.

``CachedExpertRows`` takes this path for a prefill chunk on a CUDA device (``grouped``; tests force
it on the CPU). The layer's distinct routed experts (ascending, as ``group_by_expert`` gives them)
are cut into *expert groups* of at most ``GROUP_EXPERTS`` consecutive experts (``expert_groups``),
which bounds the dequantized weights alive at once. For each group:

1. its packed bytes ``[g, slot_bytes]``: misses streamed into a buffer of the staging ring
   (transfer.py: ``StagingRing.run_batches``, copy stream and events, the next group's copies
   overlapping this group's compute), resident experts copied from the cache slots into their rows
   of that buffer (a group with no miss: one index_select from the slots);
2. ``dequantize_experts``: ONE ``dequantize`` call each for gate, up and down of the whole group
   (``[g, bytes] -> [g, out, in]``) in the compute dtype (on CUDA the Triton dequantizer writes
   bf16 directly from the strided gate/up/down views; the CPU reference casts its float32);
3. ``grouped_ffn``: the group's (token, j) pairs, sorted by expert, through the SiLU-gated FFN as
   grouped products: ``torch._grouped_mm`` (bf16 on CUDA, offsets = cumulative counts) or, for
   other dtypes and devices, a batched product over the pairs padded to the group's largest count.

``grouped_rows`` runs these steps for a layer's distinct experts on one device (``CachedExpertRows``
for its own, a computing peer's lane for the peer's; ``pairs_of`` picks their pairs).

The rows are not bit-identical to the reference ``expert_ffn`` (different product shapes, and in
bf16 the weights are rounded to bf16); they agree within float tolerance (tests/test_grouped_prefill.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from strata_core.devices import to_device

from strata_core.experts.arena import ExpertFormat
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.quant import dequantize

if TYPE_CHECKING:
    from strata_core.experts.cache import ExpertCache
    from strata_core.experts.transfer import StagingRing

__all__ = ["GROUP_EXPERTS", "ExpertGroup", "workspace_bytes", "dequantize_experts", "expert_groups", "grouped_ffn",
           "grouped_rows", "padded_index", "pairs_of"]

#: Most experts whose weights are dequantized at once (bounds the peak memory of a layer).
GROUP_EXPERTS = 32


def workspace_bytes(slot_bytes: int, expert_ffn: int, hidden: int, ring_depth: int = 2) -> int:
    """Device memory the grouped prefill path takes beside the cache: a staging ring of
    ``ring_depth`` groups of packed experts, and one group's gate/up/down dequantized (float32
    intermediates plus the compute-dtype copy, counted as 8 bytes a weight)."""
    return ring_depth * GROUP_EXPERTS * slot_bytes + GROUP_EXPERTS * 3 * expert_ffn * hidden * 8


class ExpertGroup(NamedTuple):
    """Experts ``[first, last)`` of a layer's distinct routed experts, and their sorted pairs ``[start, end)``."""

    first: int
    last: int
    start: int
    end: int


def expert_groups(counts: list[int], limit: int = GROUP_EXPERTS, rows: int = 0) -> list[ExpertGroup]:
    """Cut the distinct experts (``counts[i]`` pairs routed to the i-th) into groups of ``<= limit``
    experts and, where ``rows > 0``, ``<= rows`` pairs (a group has one expert at least)."""
    groups, first, start = [], 0, 0
    while first < len(counts):
        last, end = first + 1, start + counts[first]
        while last < len(counts) and last - first < limit and (rows <= 0 or end + counts[last] - start <= rows):
            end += counts[last]
            last += 1
        groups.append(ExpertGroup(first, last, start, end))
        first, start = last, end
    return groups


def dequantize_experts(packed: torch.Tensor, fmt: ExpertFormat,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) weights ``[g, out, in]`` in ``dtype`` of ``packed [g, >= total]`` experts."""
    g = packed.shape[0]
    return tuple(dequantize(raw, qtype, (g, *shape), dtype)  # type: ignore[return-value]
                 for raw, qtype, shape in zip(fmt.split(packed), fmt.qtypes, fmt.shapes))


def padded_index(counts: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """``[n]`` row of each sorted pair in a ``[G * width]`` layout padded per expert, computed on the
    device without a host read (``counts [G]``, ``n == counts.sum()``, ``width >= counts.max()``)."""
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                    output_size=n)  # [n]
    starts = counts.cumsum(0) - counts  # [G]
    return group * width + torch.arange(n, device=counts.device) - starts[group]  # [n]


def _use_grouped_mm(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` applies: bf16 on a CUDA device of compute capability >= 9.0,
    every row length a multiple of 8 elements (16-byte strides)."""
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and all(w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0 for w in weights))


def grouped_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                counts: torch.Tensor, max_count: int, grouped_mm: bool | None = None,
                ffn: ExpertFFN = SILU, experts: torch.Tensor | None = None) -> torch.Tensor:
    """``down_e(silu(gate_e x) * up_e x)`` for every pair (or as ``ffn`` says): rows ``[n, H]``.

    :param x: ``[n, H]`` the pairs' inputs, sorted by expert (expert e owns ``counts[e]`` rows)
    :param gate: ``[G, F, H]``; ``up``: ``[G, F, H]``; ``down``: ``[G, H, F]`` (same dtype as ``x``)
    :param counts: ``[G]`` pairs per expert, on the device, all > 0
    :param max_count: ``max(counts)`` (known on the host)
    :param grouped_mm: force ``torch._grouped_mm`` on or off (default: where it applies)
    :param ffn: the activation and expert biases; ``experts [G]`` (on the device) the group's expert
        ids, which index the biases (needed when ``ffn`` has biases)
    """
    if grouped_mm if grouped_mm is not None else _use_grouped_mm(x, gate, up, down):
        offs = counts.cumsum(0).to(torch.int32)  # [G] end row of each expert
        ids = experts if experts is None else torch.repeat_interleave(experts, counts, output_size=x.shape[0])  # [n]

        def product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)  # [n, out]

        return ffn.post(product(ffn.hidden(product(x, gate), product(x, up), ids), down), ids)
    G, H = counts.numel(), x.shape[-1]
    ids = experts if experts is None else experts[:, None]  # [G, 1]: a bias row per expert
    rows = padded_index(counts, max_count, x.shape[0])  # [n]
    xp = x.new_zeros(G * max_count, H).index_copy_(0, rows, x).view(G, max_count, H)  # [G, M, H]
    h = ffn.hidden(xp @ gate.transpose(1, 2), xp @ up.transpose(1, 2), ids)  # [G, M, F]
    return ffn.post(h @ down.transpose(1, 2), ids).reshape(G * max_count, H)[rows]  # [n, H]


def pairs_of(order: torch.Tensor, sizes: list[int], chosen: list[int]) -> torch.Tensor:
    """The entries of ``order`` (pairs sorted by expert, ``sizes[i]`` for the i-th distinct expert) of
    the distinct experts ``chosen`` (ascending), in order; the index is built on the host."""
    n = torch.tensor(sizes, dtype=torch.long)  # [G]
    starts = (n.cumsum(0) - n)[chosen]  # [C]
    picked = n[chosen]  # [C]
    index = torch.repeat_interleave(starts - (picked.cumsum(0) - picked), picked) + torch.arange(int(picked.sum()))
    return order[to_device(index, order.device)]


def grouped_rows(layer: int, fmt: ExpertFormat, x: torch.Tensor, k: int, order: torch.Tensor, ids: list[int],
                 sizes: list[int], holder: list[tuple[ExpertCache, int] | None], own: ExpertCache | None,
                 ring: StagingRing, store: Callable[[slice, torch.Tensor], None], group_experts: int,
                 group_rows: int = 0, ffn: ExpertFFN = SILU) -> tuple[int, int]:
    """The grouped prefill of the distinct experts ``ids`` (ascending, ``sizes[i]`` pairs each) on
    ``x``'s device: ``order [sum(sizes)]`` (on that device) are their pairs sorted by expert, pair p
    being token ``p // k`` of ``x [T, H]``. Per group of at most ``group_experts`` experts (and
    ``group_rows`` pairs, where > 0; a group has one expert at least): resident experts by one
    index_select from ``own``'s slots, a peer's (``holder``) read across, misses (``holder`` None)
    through ``ring``; then ``store(slice of order, rows)``; ``ffn`` the experts' activation and biases.
    Returns (misses, experts read across)."""
    device = x.device
    experts = to_device(torch.tensor(ids, dtype=torch.long), device)  # [n] (long also when empty)
    slot = own.table.mirror[layer][experts] if own is not None else None  # [n]
    counts = to_device(torch.tensor(sizes, dtype=torch.long), device)  # [n]
    expert_ids = None if ffn.plain else experts  # [n]: index the biases
    groups = expert_groups(sizes, group_experts, group_rows)
    misses = [[(i - g.first, ids[i]) for i in range(g.first, g.last) if holder[i] is None] for g in groups]
    from_peers = [[(i - g.first, *holder[i]) for i in range(g.first, g.last)
                   if holder[i] is not None and holder[i][0] is not own] for g in groups]

    def consume(j: int, staged: torch.Tensor) -> None:  # staged [R, B]: group j's misses in their rows
        g = groups[j]
        packed = staged[:g.last - g.first]  # [g, B]
        hits = [i - g.first for i in range(g.first, g.last) if holder[i] is not None and holder[i][0] is own]
        if len(hits) == g.last - g.first:  # every expert resident: one index_select from the own slots
            packed = own.slots.index_select(0, slot[g.first:g.last])
        elif hits:  # the resident ones copied into their rows beside the misses (only their bytes move)
            rows = to_device(torch.tensor(hits, dtype=torch.long), device)  # [h]
            packed.index_copy_(0, rows, own.slots.index_select(0, slot[g.first:g.last][rows]))
        for cache in {id(c): c for _, c, _ in from_peers[j]}.values():  # read across the peer link, one copy a peer
            rows, slots = zip(*((row, slot_id) for row, c, slot_id in from_peers[j] if c is cache))
            across = cache.slots.index_select(0, to_device(torch.tensor(slots, dtype=torch.long), cache.device))
            packed.index_copy_(0, to_device(torch.tensor(rows, dtype=torch.long), device), across.to(device))
        weights = dequantize_experts(packed, fmt, x.dtype)
        at = slice(g.start, g.end)
        store(at, grouped_ffn(x[order[at] // k], *weights, counts[g.first:g.last], max(sizes[g.first:g.last]),
                              ffn=ffn, experts=None if expert_ids is None else expert_ids[g.first:g.last]))

    ring.run_batches(layer, misses, consume)
    return sum(map(len, misses)), sum(map(len, from_peers))
