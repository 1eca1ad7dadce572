"""``CachedExpertRows``: the ``ExpertRows`` of one device slot in one phase, reading each expert
from the first source of its layer's chain that holds it (the placement's expert sources).

For one MoE layer the routed (token, k) pairs are grouped by expert exactly as the reference
``DequantExpertRows`` groups them, and every group goes through the same ``expert_ffn`` on the same
bytes, whichever source holds them:

* resident: the device's cache slot;
* a peer's cache: its slot's bytes read across (the peer link) and computed here, or (a peer with
  a lane, experts/peer.py) the inputs sent over and the rows computed on the peer;
* prefill miss: streamed from the arena through the double-buffered ``StagingRing``; a computing
  peer's ``stream`` share of them over the peer's own host link, computed there;
* decode miss: a ``--pcie-frac`` share (with ``auto`` learned per layer, split_auto.py) read over the
  host link (the ring again), the rest computed on the CPU from the arena where it lies (on a worker
  thread when the device is a GPU): the slot's ``MissShare`` (miss_share.py) divides them;
* a miss of a prompt chunk of at most ``cpu_prompt_tokens`` tokens (``MissShare.follow``, measured at
  load: prompt_split.py): split as the same device's decode splits its misses of the layer, so the chunk
  takes the decode's loop below rather than the grouped prefill.

On the CPU the block kernels (experts/cpu_ffn.py) compute the rows where they cover the layer's formats:
a CPU device whose own cache holds every expert of a layer (and no peer serves it) reads them
in their slots, two kernel calls for the layer (``cpu_slot_ffn``); otherwise its resident experts of a
layer in one call, the CPU share of its misses in another; each row has the bits the per-expert
``expert_ffn`` gives it, so every mix of sources combines to the same output.

``combine_rows`` then sums the rows in one fixed order, so the output is bit-identical to the
reference for any cache content, split and chunking. The host reads the layer's distinct experts
once per layer (``group_by_expert``); nothing waits on the host per expert.

With ``gather`` set (the backend sets it on CUDA when every arena layer is pinned and
``--pcie-frac`` is 1; tests force it on the CPU), a decode window takes the decode gather instead
(gather.py): the routed pairs' experts are found from the device mirror of the residency table,
read from the slots or zero-copy from the pinned arena, and computed per pair, so the host never
reads the routing and nothing synchronises per layer. So does a prompt chunk of at most
``GATHER_PROMPT_TOKENS`` tokens, at a layer without peers whose experts are all resident (a short
chat turn: the grouped prefill costs nearly the same for one token as for hundreds). A peer's pairs take the same kernel: a
computing peer's on the peer (its side stream, enqueued first), a read-across peer's here from its
bytes copied over; this device points those pairs at its zero slot, and the rows are merged by pair
(on CUDA ``moe_decode`` takes the peers' float32 rows in place of its own and combines them all).
Which pairs a peer serves is one launch on CUDA (``peer_pairs``, reading a replica of the peer's
residency mirror on this device); the activations, slots and experts go over in one copy
(``PeerLane.send``), and this device stages its own misses over its link before it waits for the
peer's rows (``stage_misses``): each cross-device step costs latency on the layer's path.

With ``grouped`` set (the default on CUDA; tests force it on the CPU), a prefill chunk whose misses all
stream takes the grouped prefill instead of the loop per expert (grouped_prefill.py, over grouped.py): per
group of at most ``group_experts`` experts, one index_select from the slots, the misses through the staging ring, one
``dequantize`` per matrix and grouped products; the experts of a computing peer (and its share of the
misses) are cut into the peer's own groups and computed there at the same time (enqueued first, waiting
only for the routing). The layer's pairs are sorted once, by device and then by expert in source order
(prompt_plan.py), so each device's pairs and rows are one span, and the rows, left in that order, are
combined by ``combine_sorted`` (ops/combine.py). A chunk of ``PREFETCH_PAIRS`` pairs an expert or more
is planned: every expert is taken as routed, so the groups follow from the residency and their spans
stay on the device (ops/spans.py); the host reads the routing once, after the layer's groups are
enqueued, from a copy made as it was counted (so the read does not wait for the groups), and only the
peers' rows coming back wait for that read. Before that read the next layer's first groups of misses
are prefetched, as that plan will cut them, so they cross the link during its attention. Its rows agree
with the reference within float tolerance, not bit for bit, which is why the CPU (the bit-exact
reference) keeps the loop.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from strata_core.runtime.devices import device_scope
from strata_core.experts.chain import Chain
from strata_core.experts.cpu_ffn import cpu_experts_ffn, cpu_slot_ffn, takes_cpu_kernels
from strata_core.ops.cpu_kernels import has_cpu_kernel, route_slot_ffn_cpu
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.experts.gather import (GATHER_COUNTS, PEER_COUNTS, PROMPT_GATHER_COUNTS, count_pairs, fused_decode,
                                       fused_decode_rows, fused_rows, lookup_slots, pair_ffn, pair_ffn_grouped,
                                       peer_pairs, stage_misses)
from strata_core.experts.grouped import group_size
from strata_core.experts.grouped_prefill import GroupedPrefill
from strata_core.experts.profile import UsageCounter
from strata_core.experts.prompt_plan import PromptPlanner, peer_shares
from strata_core.experts.rows import expert_ffn, group_by_expert
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.experts.transfer import StagingRing
from strata_core.experts.miss_share import MissShare, segments
from strata_core.ops.combine import combine_rows, combine_sorted, in_pair_order
from strata_core.ops.gather import gather_experts

if TYPE_CHECKING:
    from strata_core.experts.arena import ExpertFormat
    from strata_core.experts.cache import ExpertCache

__all__ = ["CachedExpertRows"]
#: a prompt chunk of at most this many tokens may take the decode gather (see ``_takes_gather``)
GATHER_PROMPT_TOKENS = 64


class CachedExpertRows(GroupedPrefill):
    """Expert rows on ``ring``'s device: each layer's ``chains[layer]`` says where experts are found.

    ``fused_expert_ffn``: the fused CUDA kernels compute experts with biases / swiglu_oai too (gpt-oss);
    off, those take ``pair_ffn_grouped`` (a dequantize and a grouped product per layer) on CUDA.
    ``miss_read``: the fused kernels read a miss in the pinned arena from a device row it is copied to
    first ("staged") or zero-copy over the host link ("direct"). Both are StrataSettings fields.
    ``share``: how its misses divide between the host link and the CPU (miss_share.py)."""

    def __init__(self, chains: dict[int, Chain], ring: StagingRing, usage: UsageCounter, telemetry: ExpertTelemetry,
                 share: MissShare, name: str = "", fused_expert_ffn: bool = True, miss_read: str = "staged"):
        if miss_read not in ("staged", "direct"):
            raise ValueError(f"CachedExpertRows: miss_read {miss_read!r} is not 'staged' or 'direct'")
        self.chains, self.ring, self.usage, self.telemetry, self.share = chains, ring, usage, telemetry, share
        self.fused_expert_ffn = fused_expert_ffn
        self.direct_misses = miss_read == "direct"
        self.arena = ring.copier.arena
        self.device = ring.copier.device
        self.name = name or str(self.device)
        self.decoding = False  # set by the backend inside a decode window
        #: int64 ``[1]`` on the device: how many leading pairs of a decode window or prompt pass are real (the
        #: runner sets it around one padded to its graph's bucket); the padded pairs are computed, not counted,
        #: and a prompt pass plans every layer from the residency, reading nothing on the host
        self.live_pairs: torch.Tensor | None = None
        self.gather = False  # decode windows take the decode gather (set by the backend)
        self.grouped = self.device.type == "cuda"  # prefill chunks take the grouped prefill
        self.group_experts = min(group_size(*fmt.shapes[0]) for fmt in self.arena.formats if fmt is not None)
        self._group_ring: StagingRing | None = None
        self.planner = PromptPlanner(self.device, self.arena.n_experts)  # planned prompt layers' plans
        #: per layer, whether the own cache held it whole and its slots (int64 ``[E]``), as of a table version
        self._whole: dict[int, tuple[object, int, bool, torch.Tensor]] = {}
        #: per layer, whether the CPU kernels cover its expert formats (fixed for the arena's life)
        self._kernel_layers: dict[int, bool] = {}

    def __call__(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor, ffn: ExpertFFN = SILU) -> torch.Tensor:
        chain = self.chains[layer]
        if (hidden.device.type == "cuda" and self._takes_gather(layer, chain, hidden.shape[0])
                and (ffn.plain or self.fused_expert_ffn)):  # one op: rows combined in its down launch (moe_decode)
            return self._gathered(layer, hidden, expert_ids, chain, ffn, weights)
        if self._takes_grouped(layer, chain, hidden.shape[0]):  # combined from the order the rows were computed in
            return combine_sorted(*self._grouped(layer, hidden, expert_ids, chain, ffn), weights)  # [T, H]
        return combine_rows(self.rows(layer, hidden, expert_ids, ffn), weights)  # [T, H]

    def rows(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
             ffn: ExpertFFN = SILU) -> torch.Tensor:
        """``[T, k, H]``: row (t, j) is expert ``expert_ids[t, j]`` applied to token t (an FFN as
        ``ffn`` says: its activation, the biases on this device)."""
        chain = self.chains[layer]
        if self._takes_gather(layer, chain, hidden.shape[0]):
            return self._gathered(layer, hidden, expert_ids, chain, ffn)
        T, k = expert_ids.shape
        if self._takes_grouped(layer, chain, T):
            return in_pair_order(*self._grouped(layer, hidden, expert_ids, chain, ffn)).view(T, k, -1)
        if self._takes_slots(layer, chain, hidden):
            return self._slot_rows(layer, hidden, expert_ids, chain, ffn).view(T, k, -1)
        self._count_routing(layer, expert_ids, chain)
        fmt = self.arena.formats[layer]
        order, experts, counts = group_by_expert(expert_ids)
        out = hidden.new_zeros(T * k, hidden.shape[-1])  # [T*k, H]
        ends = counts.cumsum(0).tolist()  # the host read of this layer
        groups = {e: (end - n, end) for e, n, end in zip(experts.tolist(), counts.tolist(), ends)}
        found = dict(zip(groups, chain.holders(layer, list(groups))))
        resident = [(e, where) for e, where in found.items() if where is not None]
        missed = [e for e, where in found.items() if where is None]

        def run(expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
            start, end = groups[expert]
            pairs = order[start:end]  # [n]
            x = hidden[pairs // k].to(gate.device)  # [n, H] (over to a peer computing its rows)
            with device_scope(gate.device):
                rows = expert_ffn(x, gate, up, down, fmt.qtypes, fmt.shapes, ffn, expert)
            out[pairs] = rows.to(self.device, out.dtype)

        n_link = self.share.link_share(layer, len(missed), T, self.decoding)
        link, away = peer_shares(missed[:n_link], chain) if not self.decoding else (missed[:n_link], [])
        overlapped = self.share.cpu_pool is not None  # the CPU's part on its worker, beside this device's
        with self.telemetry.compute(self.device) if not overlapped else nullcontext():
            on_cpu = self.share.submit(layer, missed[n_link:], groups, order, k, hidden, ffn, self.decoding)
        chain.wait(layer, self.device)
        batched = takes_cpu_kernels(hidden, fmt.qtypes, fmt.shapes)  # a CPU device: its own experts in one kernel call
        with self.telemetry.compute(self.device):
            here = []
            for expert, (cache, slot) in resident:  # a peer's bytes come across, or its rows come back
                parts = cache.parts(layer, slot)
                if chain.computes(cache):
                    run(expert, *parts)
                elif batched and cache.device.type == "cpu":
                    here.append((expert, parts))
                else:
                    run(expert, *(p.to(self.device) for p in parts))
            if here:
                self._cpu_batch(here, groups, order, k, hidden, fmt, ffn, out)
            auto = self.share.auto if self.decoding else None
            with auto.link(layer, len(link), self.device) if auto is not None else nullcontext():
                self.ring.run(layer, link, lambda e, packed: run(e, *fmt.split(packed)))
            for lane, streamed in away:  # over the peer's own host link, computed there
                lane.ring().run(layer, streamed, lambda e, packed: run(e, *fmt.split(packed)))
        for pairs, rows in on_cpu:
            out[pairs] = rows.result().to(self.device, out.dtype)
        n_peer = sum(1 for _, (cache, _) in resident if cache is not chain.own)
        self.telemetry.add_expert_bytes(len(groups) * sum(fmt.nbytes))
        self.telemetry.count(self.name, {"resident": len(resident) - n_peer, "peer": n_peer,
                                         "pcie" if self.decoding else "streamed": len(link),
                                         "cpu": len(missed) - n_link})
        for lane, streamed in away:
            self.telemetry.count(lane.name, {"streamed": len(streamed)})
        return out.view(T, k, -1)

    def _takes_gather(self, layer: int, chain: Chain, n_tokens: int) -> bool:
        """Whether ``layer`` (of ``chain``) takes the decode gather now: in a decode window; and for a
        prompt chunk of at most ``GATHER_PROMPT_TOKENS`` tokens, without peers, when the own cache holds
        every expert of the layer (per pair and no host read, where the grouped prefill's cost is
        near-fixed per layer however few the tokens; a miss would be read once per pair, not per expert)."""
        if not self.gather or chain.own is None:
            return False
        if self.decoding:
            return True
        return n_tokens <= GATHER_PROMPT_TOKENS and not chain.peers and bool(chain.own.table.host[layer].ge(0).all())

    def _takes_slots(self, layer: int, chain: Chain, hidden: torch.Tensor) -> bool:
        """Whether ``layer`` takes the slot rows (``_slot_rows``): ``hidden`` and the own cache on the CPU, the
        cache holding every expert of the layer (no miss whatever the routing), no peers, formats the CPU
        kernels cover."""
        own = chain.own
        if own is None or own.device.type != "cpu" or chain.peers or hidden.device.type != "cpu":
            return False
        covered = self._kernel_layers.get(layer)
        if covered is None:  # asked once a layer
            fmt = self.arena.formats[layer]
            covered = self._kernel_layers[layer] = has_cpu_kernel(fmt.qtypes, fmt.shapes)
        return covered and self._held_whole(layer, own)[0]

    def holds_every_expert(self, layer: int) -> bool:
        """Whether ``layer``'s own cache holds every one of its experts and no peer is in its chain (nothing
        streams, nothing goes across)."""
        chain = self.chains.get(layer)
        return chain is not None and chain.own is not None and not chain.peers and self._held_whole(layer, chain.own)[0]

    def _held_whole(self, layer: int, own: ExpertCache) -> tuple[bool, torch.Tensor]:
        """Whether ``own`` holds every expert of ``layer``, and the layer's slots (int64 ``[E]``, -1 where not
        resident): read from the host table once per version of it (a decode token asks every layer)."""
        table = own.table
        cached = self._whole.get(layer)
        if cached is None or cached[0] is not table or cached[1] != table.version:
            row = table.host[layer]
            cached = (table, table.version, bool(row.ge(0).all()), row.long())
            self._whole[layer] = cached
        return cached[2], cached[3]

    def _slot_rows(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, chain: Chain,
                   ffn: ExpertFFN) -> torch.Tensor:
        """Rows ``[T*k, H]`` in pair order of a layer the own CPU cache holds whole: the experts read in their
        slots (``cpu_slot_ffn``: one kernel call a layer, or two), each row with the bits the per-expert loop
        gives it. Every pair is a hit: counted on the host."""
        fmt = self.arena.formats[layer]
        flat = expert_ids.reshape(-1)  # [P]
        slot, experts = held_slots(self._held_whole(layer, chain.own)[1], flat)  # [P] int64, P host ints
        self.usage.count(layer, flat, expert_ids.shape[0])
        with self.telemetry.compute(self.device):
            rows = cpu_slot_ffn(hidden, expert_ids.shape[1], chain.own.padded, slot, fmt, ffn,
                                None if ffn.plain else flat)  # [P, H]
        self._served_whole(fmt, experts)
        return rows

    def routed_cpu(self, layer: int, hidden: torch.Tensor, router: torch.Tensor, k: int, norm: bool, scale: float,
                   min_sum: float) -> torch.Tensor | None:
        """The routed output ``[T, H]`` of normed float32 ``hidden [T, H]``, from the router's weight ``router [E, H]``
        on, in one call (``strata::route_slot_ffn_cpu``: the router's product, ``route_cpu`` with these arguments,
        the slot rows of ``_slot_rows`` with its usage count, ``combine_rows``; the same bits); None, with nothing
        done, where the layer does not take the slot rows or its experts are not plain SiLU in float32."""
        chain, T = self.chains[layer], hidden.shape[0]
        if (hidden.dtype != torch.float32 or router.dtype != torch.float32 or self._takes_gather(layer, chain, T)
                or self._takes_grouped(layer, chain, T) or not self._takes_slots(layer, chain, hidden)):
            return None
        fmt, slots = self.arena.formats[layer], self._held_whole(layer, chain.own)[1]  # slots: int64 [E]
        g_bytes, u_bytes, _ = fmt.nbytes
        with self.telemetry.compute(self.device):
            out, ids = route_slot_ffn_cpu(hidden, router, k, norm, scale, min_sum, slots, self.usage.row(layer, T),
                                          chain.own.padded, (0, g_bytes, g_bytes + u_bytes), fmt.qtypes,
                                          fmt.shapes[0][0], check_slots=False)  # [T, H], [T, k]: a layer held whole
        self._served_whole(fmt, routed_experts(ids))
        return out

    def _served_whole(self, fmt: ExpertFormat, experts: list[int]) -> None:
        """The telemetry of a layer held whole that served pairs of ``experts`` (every pair a hit, each expert
        read once)."""
        n = len(set(experts))
        self.telemetry.add_hits(len(experts), len(experts))
        self.telemetry.add_expert_bytes(n * fmt.total)
        self.telemetry.count(self.name, {"resident": n, "peer": 0, "pcie" if self.decoding else "streamed": 0,
                                         "cpu": 0})

    def _takes_grouped(self, layer: int, chain: Chain, n_tokens: int) -> bool:
        """Whether ``layer`` (of ``chain``) takes the grouped prefill now: a prompt chunk of ``n_tokens`` tokens
        whose misses all stream (none split with the CPU)."""
        return (self.grouped and not self.decoding and chain.link
                and self.share.split_now(layer, n_tokens, decoding=False) is None)

    def _count_routing(self, layer: int, expert_ids: torch.Tensor, chain: Chain) -> torch.Tensor:
        """Add a layer's routing to the usage profile and the hit telemetry (device ops, no host read);
        returns the pairs per expert ``[E]`` on the device."""
        counted = self.usage.add(layer, expert_ids, self.live_pairs)  # [E]
        if chain.own is not None:
            self.telemetry.add_routing(expert_ids.numel(), (counted * (chain.own.table.mirror[layer] >= 0)).sum())
        else:
            self.telemetry.routed += expert_ids.numel()
        return counted

    def _gathered(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, chain: Chain, ffn: ExpertFFN,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, k, H]`` through the decode gather: a fixed sequence of device ops, no host read; with
        ``weights`` (CUDA) the combined ``[T, H]`` instead. The pairs' slots, the usage counts and the
        telemetry are one launch on CUDA (``lookup_slots``) when no peer serves the layer.

        The own cache and the pinned arena serve each pair, except the pairs a peer of the chain
        holds: a computing peer's are computed there (enqueued first, on its side stream), a read-across
        peer's bytes come over and are computed here; this device points them at its zero slot. With
        ``weights`` the peers' rows are float32 rows of ``strata::moe_decode_rows`` (the arithmetic of
        ``moe_decode`` before it combines) that the home's ``moe_decode`` takes in place of its own
        for those pairs, so the combination, and the output, are bit for bit ``single``'s."""
        T, k = expert_ids.shape
        own = chain.own
        fmt, resident = self.arena.formats[layer], own.table.mirror[layer]  # resident [E]
        arena = self.arena.layer_buffer(layer)
        expert = expert_ids.reshape(-1)  # [P], P = T*k
        counters = self.telemetry.accumulator(GATHER_COUNTS if self.decoding else PROMPT_GATHER_COUNTS, expert.device)
        usage = self.usage.row(layer, T)
        slot = lookup_slots(expert, resident, usage, None if chain.peers else counters, fmt.total,
                            self.live_pairs)  # [P], -1 = miss
        taken = slot >= 0 if chain.peers else None
        served: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pairs a peer serves [P], their rows [P, H])
        rows_of = self._pair_rows if weights is None else self._decode_rows  # rows to merge, or to combine
        peer_counts = self.telemetry.accumulator(PEER_COUNTS, expert.device) if chain.peers else None
        for cache in chain.peers:
            lane = chain.lane(cache)
            held = cache.table.mirror_on(self.device)[layer]  # [E]: the peer's residency, read here
            if lane is not None:  # activations go over, rows come back
                frac = lane.split.frac  # the share of the misses it streams over its own host link
                with lane.enqueue():
                    lane.hold(taken)  # replaced below while the side stream may still read it
                    peer_slot, mine, taken = peer_pairs(expert, taken, held, cache.zero_slot, layer, frac,
                                                        peer_counts, fmt.total)  # on a side stream of this device
                    lane.hand_over()  # this stream reads ``mine`` and ``taken`` before it joins the lane
                    cache.wait_layer(layer, lane.device)
                    x, slot_there, expert_there = lane.send(hidden, peer_slot, expert)  # one copy to the peer
                    rows = rows_of(x, cache.padded, arena, slot_there, expert_there, fmt, ffn)
                    served.append((mine, rows.to(self.device)))
            else:  # the peer's bytes come across the peer link
                peer_slot, mine, taken = peer_pairs(expert, taken, held, cache.zero_slot, layer, 0.0, peer_counts,
                                                    fmt.total)
                cache.wait_layer(layer, cache.device)
                packed = cache.padded.index_select(0, peer_slot.to(cache.device))
                across = torch.arange(expert.numel(), device=self.device)  # pair p reads row p
                served.append((mine, rows_of(hidden, packed.to(self.device), arena, across, expert, fmt, ffn)))
        if chain.peers:
            slot = torch.where(taken & (slot < 0), own.zero_slot, slot)  # the peers' pairs: a zero row here
            count_pairs(slot, expert, resident, counters, fmt.total, self.live_pairs)
        self.telemetry.routed += T * k
        own.wait_layer(layer, self.device)
        staged = None  # with weights: this device's misses staged over its link while the peers compute
        if weights is None:
            rows = self._pair_rows(hidden, own.padded, arena, slot, expert, fmt, ffn)  # [P, H]
        elif chain.lanes:
            with self.telemetry.timed("copy", self.device):
                staged = stage_misses(own.padded, arena, slot, expert, fmt, self.direct_misses)
        for lane in chain.lanes:
            lane.join()
        by_peer, peer_rows = None, None  # [P], [P, H]: the pairs the peers serve and their rows
        for mine, theirs in served:
            by_peer = mine if by_peer is None else by_peer | mine
            peer_rows = theirs if peer_rows is None else torch.where(mine[:, None], theirs, peer_rows)
        if weights is not None:
            with self.telemetry.compute(self.device):
                return fused_decode(hidden, own.padded, arena, slot, expert, weights, fmt, ffn, by_peer,
                                    peer_rows, staged, self.direct_misses)  # [T, H]
        if by_peer is not None:
            rows = torch.where(by_peer[:, None], peer_rows, rows)
        return rows.view(T, k, -1)

    def _pair_rows(self, hidden: torch.Tensor, slots: torch.Tensor, arena: torch.Tensor, slot: torch.Tensor,
                   expert: torch.Tensor, fmt, ffn: ExpertFFN = SILU) -> torch.Tensor:
        """Rows ``[P, H]`` of the pairs (``slot``/``expert [P]``, token ``p // k``) on ``hidden``'s device, each
        read from ``slots[slot[p]]`` or, where ``slot[p] < 0``, ``arena[expert[p]]``: on CUDA the fused op
        (biased / swiglu_oai experts too, unless ``fused_expert_ffn`` is off: then ``pair_ffn_grouped``), on the
        CPU ``pair_ffn`` (the bit-exact reference)."""
        T = hidden.shape[0]
        device = hidden.device
        if device.type == "cuda" and (ffn.plain or self.fused_expert_ffn):  # one fused op: FFN from the blocks
            with self.telemetry.compute(device):
                return fused_rows(hidden, slots, arena, slot, expert, fmt, ffn, self.direct_misses)
        with self.telemetry.timed("copy", device):
            packed = gather_experts(slots, arena, slot, expert, fmt.total)  # [P, total]
        with self.telemetry.compute(device):
            x = hidden[:, None, :].expand(T, slot.shape[0] // T, hidden.shape[-1]).reshape(slot.shape[0], -1)
            return (pair_ffn_grouped if device.type == "cuda" else pair_ffn)(x, packed, fmt, ffn, expert)  # [P, H]

    def _decode_rows(self, hidden: torch.Tensor, slots: torch.Tensor, arena: torch.Tensor, slot: torch.Tensor,
                     expert: torch.Tensor, fmt, ffn: ExpertFFN = SILU) -> torch.Tensor:
        """Float32 rows ``[P, H]`` of the pairs as ``fused_decode`` computes them before it combines them
        (``strata::moe_decode_rows``), on ``hidden``'s device: a peer's share of a CUDA decode layer."""
        with self.telemetry.compute(hidden.device):
            return fused_decode_rows(hidden, slots, arena, slot, expert, fmt, ffn, self.direct_misses)

    def _cpu_batch(self, experts: list[tuple[int, tuple[torch.Tensor, ...]]], groups: dict[int, tuple[int, int]],
                   order: torch.Tensor, k: int, hidden: torch.Tensor, fmt: ExpertFormat, ffn: ExpertFFN,
                   out: torch.Tensor) -> None:
        """The rows of ``experts`` ((id, raw gate/up/down) each, on the CPU) through one call of the CPU
        kernels, written to ``out`` at their pairs."""
        pairs, counts = segments([e for e, _ in experts], groups, order)
        rows = cpu_experts_ffn(hidden[pairs // k], [parts for _, parts in experts], counts, fmt.qtypes, fmt.shapes,
                               ffn, [e for e, _ in experts])  # [n, H]
        out[pairs] = rows.to(out.dtype)

def held_slots(slots: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The slots ``slots[experts]`` (int64 ``[P]``; ``slots``: a layer's int64 slot per expert ``[E]``) of a
    layer's pairs ``experts [P]``, and the pairs' experts read on the host: the slot rows' one host read
    of the layer's routing."""
    return slots.index_select(0, experts), experts.tolist()  # one gather (an index op costs several)


def routed_experts(ids: torch.Tensor) -> list[int]:
    """The experts of a layer's pairs ``ids [T, k]`` read on the host: the routed slot rows' one host read of the
    layer's routing (``CachedExpertRows.routed_cpu``)."""
    return [e for row in ids.tolist() for e in row]  # no view op: this runs right after the layer's experts

