"""Grouped prefill: one layer's routed experts as a few large device ops instead of a loop per expert.

``CachedExpertRows`` takes this path for a prefill chunk on a CUDA device (``grouped``; tests force
it on the CPU). The layer's distinct routed experts (ascending, as ``group_by_expert`` gives them)
are cut into *expert groups* of at most ``group_size`` consecutive experts (``expert_groups``),
which bounds the dequantized weights alive at once. For each group:

1. its packed bytes ``[g, slot_bytes]``: misses streamed into a buffer of the staging ring
   (transfer.py: ``StagingRing.run_batches``, copy stream and events, the next group's copies
   overlapping this group's compute), resident experts copied from the cache slots into their rows
   of that buffer (a group with no miss: one index_select from the slots);
2. ``dequantize_experts``: ONE ``dequantize`` call each for gate, up and down of the whole group
   (``[g, bytes] -> [g, out, in]``) in the compute dtype (on CUDA the Triton dequantizer writes
   bf16 directly from the strided gate/up/down views; the CPU reference casts its float32);
3. ``grouped_ffn``: the group's (token, j) pairs, sorted by expert, through the SiLU-gated FFN as
   grouped products: ``torch._grouped_mm`` (bf16 on CUDA, offsets = cumulative counts, on the device)
   or, for other dtypes and devices, a batched product over the pairs padded to the group's largest
   count.

``grouped_rows`` runs these steps for a layer's distinct experts on one device (``CachedExpertRows``
for its own, a computing peer's lane for the peer's: each a span of the layer's pairs sorted by
(device, expert)). The spans' bounds are on the device: a group's inputs are gathered into a buffer of
an upper bound of its pairs and its rows put back at its span (ops/spans.py), so a planned layer,
whose groups are cut before the routing is known, is enqueued without a host read.

The rows are not bit-identical to the reference ``expert_ffn`` (different product shapes, and in
bf16 the weights are rounded to bf16); they agree within float tolerance (tests/test_grouped_prefill.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from strata_core.runtime.devices import to_device

from strata_core.experts.arena import ExpertFormat
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.ops.dequant import dequantize_cuda
from strata_core.ops.spans import gather_span, scatter_span
from strata_core.quant import dequantize

if TYPE_CHECKING:
    from strata_core.experts.cache import ExpertCache
    from strata_core.experts.transfer import StagingRing

__all__ = ["GROUP_EXPERTS", "GROUP_WEIGHT_BYTES", "ExpertGroup", "GroupPlan", "group_size", "workspace_bytes",
           "dequantize_experts", "expert_groups", "fused_gate_up", "grouped_ffn", "grouped_rows", "miss_batches",
           "padded_index"]

#: Most experts of one group (fewer make more launches a layer: the host's cost of a prompt).
GROUP_EXPERTS = 64

#: Most compute-dtype (bf16) weight bytes of one group's experts: it bounds the memory of a layer's
#: dequantized weights (larger experts, fewer a group; ``group_size``).
GROUP_WEIGHT_BYTES = 640 << 20


def group_size(expert_ffn: int, hidden: int) -> int:
    """Experts of one group for experts of ``3 * expert_ffn * hidden`` weights: ``GROUP_EXPERTS``, fewer
    where their bf16 weights would pass ``GROUP_WEIGHT_BYTES`` (8 at least)."""
    return max(8, min(GROUP_EXPERTS, GROUP_WEIGHT_BYTES // (3 * expert_ffn * hidden * 2)))


def workspace_bytes(slot_bytes: int, expert_ffn: int, hidden: int, ring_depth: int = 2) -> int:
    """Device memory the grouped prefill path takes beside the cache: a staging ring of
    ``ring_depth`` groups of packed experts, and one group's gate/up/down dequantized (float32
    intermediates plus the compute-dtype copy, counted as 8 bytes a weight)."""
    group = group_size(expert_ffn, hidden)
    return ring_depth * group * slot_bytes + group * 3 * expert_ffn * hidden * 8


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
    """(gate, up, down) weights ``[g, out, in]`` in ``dtype`` of ``packed [g, >= total]`` experts.

    On CUDA the Triton dequantizer is called directly (the custom op's dispatch costs tens of
    microseconds of host time a call, and a prompt makes hundreds), and gate and up of one block type
    are one launch: then they are the halves of one ``[g, 2 * out, in]`` tensor (``fused_gate_up``)."""
    g = packed.shape[0]
    (gate_t, up_t, down_t), (gate_s, up_s, down_s) = fmt.qtypes, fmt.shapes
    if packed.device.type == "cuda" and gate_t == up_t and gate_s == up_s:
        both = _dequantize_fast(packed[:, :fmt.nbytes[0] + fmt.nbytes[1]], gate_t, (g, 2 * gate_s[0], gate_s[1]), dtype)
        down = _dequantize_fast(fmt.split(packed)[2], down_t, (g, *down_s), dtype)
        return both[:, :gate_s[0]], both[:, gate_s[0]:], down
    return tuple(_dequantize_fast(raw, qtype, (g, *shape), dtype)  # type: ignore[return-value]
                 for raw, qtype, shape in zip(fmt.split(packed), fmt.qtypes, fmt.shapes))


def _dequantize_fast(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``dequantize``, through the Triton launcher directly on CUDA where the format has a kernel."""
    out = dequantize_cuda(raw, qtype, shape, dtype) if raw.device.type == "cuda" else None
    return out if out is not None else dequantize(raw, qtype, shape, dtype)


def fused_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The ``[G, 2F, H]`` tensor whose halves are ``gate`` and ``up`` (``[G, F, H]`` each), or None
    when they are not (``dequantize_experts`` makes them so on CUDA: one product computes both)."""
    G, F, H = gate.shape
    if up.shape != gate.shape or gate.stride() != (2 * F * H, H, 1) or up.stride() != gate.stride() \
            or up.data_ptr() != gate.data_ptr() + F * H * gate.element_size():
        return None
    return gate.as_strided((G, 2 * F, H), gate.stride())


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
                counts: torch.Tensor, max_count: int | None = None, grouped_mm: bool | None = None,
                ffn: ExpertFFN = SILU, experts: torch.Tensor | None = None) -> torch.Tensor:
    """``down_e(silu(gate_e x) * up_e x)`` for every pair (or as ``ffn`` says): rows ``[N, H]``.

    :param x: ``[N, H]`` the pairs' inputs, sorted by expert (expert e owns ``counts[e]`` rows), then
        spare rows (``N >= counts.sum()``: a buffer sized before the counts were known), whose output
        rows are unspecified
    :param gate: ``[G, F, H]``; ``up``: ``[G, F, H]``; ``down``: ``[G, H, F]`` (same dtype as ``x``)
    :param counts: ``[G]`` pairs per expert, on the device (zero for an expert no pair routes to)
    :param max_count: ``max(counts)`` where the host knows it (else the padded product reads it)
    :param grouped_mm: force ``torch._grouped_mm`` on or off (default: where it applies)
    :param ffn: the activation and expert biases; ``experts [G]`` (on the device) the group's expert
        ids, which index the biases (needed when ``ffn`` has biases)
    """
    N = x.shape[0]
    if grouped_mm if grouped_mm is not None else _use_grouped_mm(x, gate, up, down):
        offs = counts.cumsum(0).to(torch.int32)  # [G] end row of each expert; rows past the last: no group
        ids = experts if experts is None else torch.repeat_interleave(  # [N]: the spare rows take expert 0's bias
            torch.cat((experts, experts[:1])), torch.cat((counts, N - offs[-1:].long())), output_size=N)

        def product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)  # [N, out]

        both = fused_gate_up(gate, up)  # [G, 2F, H]: gate and up in one product
        if both is not None:
            gu, F = product(x, both), gate.shape[1]  # [N, 2F]
            return ffn.post(product(ffn.hidden(gu[:, :F], gu[:, F:], ids), down), ids)
        return ffn.post(product(ffn.hidden(product(x, gate), product(x, up), ids), down), ids)
    G, H = counts.numel(), x.shape[-1]
    n = int(counts.sum())  # the padded product needs the counts on the host
    max_count = int(counts.max()) if max_count is None else max_count
    ids = experts if experts is None else experts[:, None]  # [G, 1]: a bias row per expert
    rows = padded_index(counts, max_count, n)  # [n]
    xp = x.new_zeros(G * max_count, H).index_copy_(0, rows, x[:n]).view(G, max_count, H)  # [G, M, H]
    h = ffn.hidden(xp @ gate.transpose(1, 2), xp @ up.transpose(1, 2), ids)  # [G, M, F]
    out = ffn.post(h @ down.transpose(1, 2), ids).reshape(G * max_count, H)[rows]  # [n, H]
    return out if n == N else torch.cat((out, out.new_zeros(N - n, H)))


def miss_batches(groups: list[ExpertGroup], ids: list[int],
                 holder: list[tuple[ExpertCache, int] | None]) -> list[list[tuple[int, int]]]:
    """Per group, the ``(row, expert)`` of its experts that no cache holds (``holder`` None): what the
    staging ring streams into that group's buffer."""
    return [[(i - g.first, ids[i]) for i in range(g.first, g.last) if holder[i] is None] for g in groups]


class GroupPlan:
    """How ``grouped_rows`` runs the distinct experts ``ids`` of one layer on ``device`` (ordered by source:
    those of one cache consecutive, misses last; ``holder`` where each is found): their groups of at most
    ``group_experts`` experts, and where ``sizes`` (pairs per expert) are known, of at most ``group_rows``
    pairs (where > 0); without them every expert is taken as routed and the plan follows from the
    residency alone (a planned layer: ``CachedExpertRows`` keeps it while the residency holds).

    :ivar groups: the ``ExpertGroup`` s; ``misses`` their ``miss_batches`` (what the staging ring streams)
    :ivar caches: the caches holding some of ``ids``; ``held[p][j]``: cache p's experts of group j
        (consecutive), read through ``slot_index[p][j]`` (their slots, on that cache's device)
    :ivar experts: ``ids`` on ``device`` (they index the experts' biases)
    """

    def __init__(self, ids: list[int], holder: list[tuple[ExpertCache, int] | None], device: torch.device,
                 group_experts: int, sizes: list[int] | None = None, group_rows: int = 0):
        self.sizes = sizes
        self.groups = expert_groups(sizes if sizes is not None else [1] * len(ids), group_experts,
                                    group_rows if sizes is not None else 0)
        self.misses = miss_batches(self.groups, ids, holder)
        self.caches = list({id(h[0]): h[0] for h in holder if h is not None}.values())  # in the order of ids
        self.held = [[[i for i in range(g.first, g.last) if holder[i] is not None and holder[i][0] is cache]
                      for g in self.groups] for cache in self.caches]
        slots = [[[holder[i][1] for i in experts] for experts in per_group] for per_group in self.held]
        local = [p for p, cache in enumerate(self.caches) if cache.device == device]
        # the layer's integers in one copy to each device: experts and the slots read of each cache
        self.experts, *index = _on_device([ids] + [part for p in local for part in slots[p]], device)
        n = len(self.groups)
        self.slot_index = {p: index[i * n:(i + 1) * n] for i, p in enumerate(local)}
        self.slot_index.update({p: _on_device(slots[p], cache.device) for p, cache in enumerate(self.caches)
                                if p not in self.slot_index})

    def n_missed(self) -> int:
        """Experts streamed from the arena."""
        return sum(map(len, self.misses))


def grouped_rows(layer: int, fmt: ExpertFormat, x: torch.Tensor, k: int, order: torch.Tensor, bounds: torch.Tensor,
                 plan: GroupPlan, own: ExpertCache | None, ring: StagingRing, out: torch.Tensor,
                 ffn: ExpertFFN = SILU) -> None:
    """The grouped prefill of ``plan``'s experts on ``x``'s device. ``order [P]`` is the layer's pairs sorted
    (pair p is token ``p // k`` of ``x [T, H]``) and ``bounds [len(ids) + 1]`` cumulative counts: the i-th
    expert's pairs are ``order[bounds[i]:bounds[i + 1]]`` (both on ``x``'s device); each pair's row is
    written to ``out [P, H]`` at its place in ``order``. Nothing here waits for the host to know the
    counts: a group's inputs are gathered into a buffer of its pairs (where ``plan.sizes`` are known) or
    of ``min(P, experts * T)`` rows. Per group: the experts of each cache holding some (``own``'s, a
    peer's read across) by one gather into their consecutive rows of the group's buffer, misses
    through ``ring``; ``ffn`` the experts' activation and biases."""
    device, sizes, caches, held = x.device, plan.sizes, plan.caches, plan.held
    expert_ids = None if ffn.plain else plan.experts  # [n]: index the biases
    token = order // k  # [P]: the token of each sorted pair
    counts = bounds[1:] - bounds[:-1]  # [n] pairs per expert
    T = x.shape[0]

    def consume(j: int, staged: torch.Tensor | None) -> None:  # staged [R, B]: group j's misses in their rows
        g = plan.groups[j]
        n = g.last - g.first
        if caches and caches[0] is own and len(held[0][j]) == n:  # every expert resident: one gather of the slots
            packed = own.slots.index_select(0, plan.slot_index[0][j])
        else:  # the staged misses (none: a buffer of its own), before them each cache's experts' rows
            packed = staged[:n] if staged is not None else ring.buffers.new_empty((n, ring.buffers.shape[2]))  # [g, B]
            for p, cache in enumerate(caches):
                if held[p][j]:
                    rows = packed[held[p][j][0] - g.first:held[p][j][-1] + 1 - g.first]  # [h, B]
                    if cache.device == device:
                        torch.index_select(cache.slots, 0, plan.slot_index[p][j], out=rows)
                    else:  # read across the peer link: one copy
                        rows.copy_(cache.slots.index_select(0, plan.slot_index[p][j]))
        weights = dequantize_experts(packed, fmt, x.dtype)
        start, end = bounds[g.first], bounds[g.last]  # on the device
        cap = g.end - g.start if sizes is not None else min(token.numel(), n * T)
        rows = grouped_ffn(gather_span(x, token, start, end, cap), *weights, counts[g.first:g.last],
                           max(sizes[g.first:g.last]) if sizes is not None else None, ffn=ffn,
                           experts=None if expert_ids is None else expert_ids[g.first:g.last])
        scatter_span(out, rows, start, end)

    ring.run_batches(layer, plan.misses, consume)


def _on_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The integer lists as long tensors on ``device`` through one copy (views of one buffer)."""
    flat = [v for values in lists for v in values]
    return list(to_device(torch.tensor(flat, dtype=torch.long), device).split([len(v) for v in lists]))
