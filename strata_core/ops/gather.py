"""``strata::gather_experts``: the packed bytes of every routed (token, j) pair, from wherever they are.

``gather_experts(slots, arena, slot, expert, nbytes, skip_hits=False) -> [P, nbytes]`` uint8: row p is
``slots[slot[p], :nbytes]`` when ``slot[p] >= 0`` (the expert is resident in a device cache slot),
else ``arena[expert[p]]`` (the layer's packed experts in the pinned host arena). With ``skip_hits``
the rows of resident pairs are left unwritten (the CUDA kernel neither reads nor writes them): the
staging of a decode layer's misses, which ``strata::moe_decode`` reads by pair (``staged=True``).

On CUDA a Triton kernel reads both sources by address: the slot tensor in VRAM and the pinned arena
zero-copy over the host link (on 64-bit Linux with unified addressing, memory from torch's pinned
allocator, ``cudaHostAlloc``, is device-accessible at its host address). The kernel computes each
pair's source address on the device,
``where(slot >= 0, slots_base + slot * slot_stride, arena_base + expert * arena_stride)``, so the host
never reads the routing: one launch per layer, no synchronisation. Bytes move in the widest word
(8/4/2/1 bytes) that divides every size, stride and base address.

The CPU kernel is the reference: the same gather with plain indexing. Without Triton (CPU-only
installs) the op is a plain custom op with that reference kernel only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata_core.ops.qdecode import on_device

__all__ = ["HAS_TRITON", "gather_experts", "pair_bookkeeping_cuda", "peer_pairs_cuda"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: no Triton, the reference is the only kernel
    triton = None

HAS_TRITON = triton is not None

#: Words per Triton program (one program copies one chunk of one pair).
_BLOCK = 2048
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _reference(slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, nbytes: int,
               skip_hits: bool = False) -> Tensor:
    """CPU kernel: ``slots [S, B]``, ``arena [E, nbytes]``, ``slot``/``expert [P]`` -> ``[P, nbytes]``
    (every row written, ``skip_hits`` or not)."""
    from_arena = arena[expert]  # [P, nbytes]
    if slots.shape[0] == 0:
        return from_arena
    from_slots = slots[slot.clamp_min(0), :nbytes]  # [P, nbytes]
    return torch.where((slot >= 0)[:, None], from_slots, from_arena)


def _fake(slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, nbytes: int, skip_hits: bool = False) -> Tensor:
    return slots.new_empty((slot.shape[0], nbytes))


if HAS_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _gather_kernel(out_ptr, slot_ptr, expert_ptr, slots_base, slot_stride, arena_base, arena_stride,
                       n_words, BLOCK: tl.constexpr, SKIP_HITS: tl.constexpr = False):
        """Program (p, c): words ``[c*BLOCK, (c+1)*BLOCK)`` of pair p. Bases and strides are in bytes.
        ``SKIP_HITS``: pairs with a slot are neither read nor written (strata::moe_pair_rows stages
        only the misses)."""
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        s = tl.load(slot_ptr + pair).to(tl.int64)
        e = tl.load(expert_ptr + pair).to(tl.int64)
        src = tl.where(s >= 0, s * slot_stride + slots_base, e * arena_stride + arena_base)  # a byte address
        src_ptr = src.to(tl.pointer_type(out_ptr.dtype.element_ty))
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        if SKIP_HITS:
            mask = mask & (s < 0)
        words = tl.load(src_ptr + offs, mask=mask)
        tl.store(out_ptr + pair.to(tl.int64) * n_words + offs, words, mask=mask)

    @triton_op("strata::gather_experts", mutates_args=())
    def gather_experts(slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, nbytes: int,
                       skip_hits: bool = False) -> Tensor:
        """``[P, nbytes]`` uint8 on ``slots.device``: see the module docstring."""
        slot, expert = slot.contiguous(), expert.contiguous()  # [P] each
        P = slot.shape[0]
        out = torch.empty((P, nbytes), dtype=torch.uint8, device=slots.device)  # [P, nbytes]
        slot_stride, arena_stride = slots.stride(0), arena.stride(0)
        sizes = (nbytes, slot_stride, arena_stride, slots.data_ptr(), arena.data_ptr())
        word = next(w for w in _WORDS if all(v % w == 0 for v in sizes))
        n_words = nbytes // word
        if P:
            grid = (P, triton.cdiv(n_words, _BLOCK))
            with on_device(slots.device):  # Triton launches on the current device
                wrap_triton(_gather_kernel)[grid](out.view(_WORDS[word]), slot, expert, slots.data_ptr(),
                                                  slot_stride, arena.data_ptr(), arena_stride, n_words,
                                                  BLOCK=_BLOCK, SKIP_HITS=skip_hits, num_warps=8)
        return out

    gather_experts.register_kernel("cpu")(_reference)

    @triton.jit
    def _bookkeeping_kernel(expert_ptr, resident_ptr, slot_ptr, usage_ptr, counters_ptr, live_ptr, P, nbytes,
                            LOOKUP: tl.constexpr, USAGE: tl.constexpr, COUNT: tl.constexpr, LIVE: tl.constexpr,
                            BLOCK: tl.constexpr):
        """One program over the P pairs. ``LOOKUP``: ``slot = resident[expert]`` (else ``slot`` is read);
        ``USAGE``: ``usage[expert] += 1``; ``COUNT``: ``counters [4] +=`` hits, distinct routed experts
        resident / missed (at their first pair), missed pairs * nbytes; with ``LIVE`` only the first
        ``live_ptr[0]`` pairs are counted (a padded window's rows follow them)."""
        p = tl.arange(0, BLOCK)
        keep = p < P
        e = tl.load(expert_ptr + p, mask=keep, other=0)
        r = tl.load(resident_ptr + e, mask=keep, other=-1)
        if LOOKUP:
            s = r
            tl.store(slot_ptr + p, s, mask=keep)
        else:
            s = tl.load(slot_ptr + p, mask=keep, other=0)
        if LIVE:
            keep = keep & (p < tl.load(live_ptr))
        if USAGE:
            tl.atomic_add(usage_ptr + e, tl.full([BLOCK], 1, tl.int64), mask=keep)
        if COUNT:
            e = tl.where(keep, e, -1)
            earlier = tl.zeros([BLOCK], dtype=tl.int32)  # pairs q < p routed to the same expert
            for q0 in range(0, P, 16):  # 16 pairs q at a time against all p
                q = q0 + tl.arange(0, 16)
                eq = tl.load(expert_ptr + q, mask=q < P, other=-2)
                earlier += tl.sum(((e[:, None] == eq[None, :]) & (q[None, :] < p[:, None])).to(tl.int32), axis=1)
            first = keep & (earlier == 0)
            hit = keep & (s >= 0)
            tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + tl.sum(hit.to(tl.int64), axis=0))
            tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + tl.sum((first & (r >= 0)).to(tl.int64), axis=0))
            tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + tl.sum((first & (s < 0)).to(tl.int64), axis=0))
            tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tl.sum((keep & (s < 0)).to(tl.int64), axis=0) * nbytes)

    def pair_bookkeeping_cuda(expert: Tensor, resident: Tensor, slot: Tensor | None = None,
                              usage: Tensor | None = None, counters: Tensor | None = None, nbytes: int = 0,
                              live: Tensor | None = None) -> Tensor:
        """A decode layer's bookkeeping of its pairs ``expert [P]`` in one launch; returns ``slot [P]``.

        Without ``slot`` each pair's is looked up in the layer's residency row ``resident [E]``
        (``resident[expert]``); ``usage [E]`` int64 gets each routing added; ``counters`` int64 ``[4]``
        gets the decode gather's telemetry (experts/gather.py ``GATHER_COUNTS``) added: hits, distinct
        experts resident / missed (all pairs of an expert have its slot, so each counts at its first
        pair), missed pairs * ``nbytes``; ``live`` (int64 ``[1]``): only its first pairs are counted.
        In place, stream-ordered (no host read)."""
        expert = expert.contiguous()
        P = expert.shape[0]
        lookup = slot is None
        if lookup:
            slot = torch.empty(P, dtype=resident.dtype, device=expert.device)
        if P:
            with on_device(expert.device):  # Triton launches on the current device
                _bookkeeping_kernel[(1,)](expert, resident, slot.contiguous(), usage if usage is not None else expert,
                                          counters if counters is not None else expert,
                                          live if live is not None else expert, P, nbytes,
                                          LOOKUP=lookup, USAGE=usage is not None, COUNT=counters is not None,
                                          LIVE=live is not None, BLOCK=max(16, triton.next_power_of_2(P)),
                                          num_warps=4)
        return slot
    @triton.jit
    def _peer_pairs_kernel(expert_ptr, taken_ptr, held_ptr, peer_slot_ptr, mine_ptr, taken_out_ptr, counters_ptr,
                           P, layer, threshold, zero_slot, nbytes, COUNT: tl.constexpr, BLOCK: tl.constexpr):
        """One program over the P pairs: a computing peer's share of a decode layer (``peer_pairs_cuda``)."""
        p = tl.arange(0, BLOCK)
        keep = p < P
        e = tl.load(expert_ptr + p, mask=keep, other=0).to(tl.int64)
        free = keep & (tl.load(taken_ptr + p, mask=keep, other=1) == 0)
        held = tl.load(held_ptr + e, mask=keep, other=-1)
        streamed = free & (held < 0) & ((e * 7919 + layer * 104729) % 1000 < threshold)
        mine = (free & (held >= 0)) | streamed
        tl.store(peer_slot_ptr + p, tl.where(mine, held, zero_slot), mask=keep)
        tl.store(mine_ptr + p, mine.to(tl.uint8), mask=keep)
        tl.store(taken_out_ptr + p, (~free | mine).to(tl.uint8), mask=keep)
        if COUNT:
            e = tl.where(keep, e, -1)
            earlier = tl.zeros([BLOCK], dtype=tl.int32)  # pairs q < p routed to the same expert
            for q0 in range(0, P, 16):  # (whether a pair is the peer's depends on its expert alone)
                q = q0 + tl.arange(0, 16)
                eq = tl.load(expert_ptr + q, mask=q < P, other=-2)
                earlier += tl.sum(((e[:, None] == eq[None, :]) & (q[None, :] < p[:, None])).to(tl.int32), axis=1)
            first = mine & (earlier == 0)
            tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + tl.sum(first.to(tl.int64), axis=0))
            tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + tl.sum(streamed.to(tl.int64), axis=0) * nbytes)

    def peer_pairs_cuda(expert: Tensor, taken: Tensor, held: Tensor, zero_slot: int, layer: int, threshold: int,
                        counters: Tensor | None, nbytes: int) -> tuple[Tensor, Tensor, Tensor]:
        """A computing peer's share of a decode layer's pairs ``expert [P]`` in one launch (the torch
        ops of ``strata_core.experts.gather.peer_pairs``, which documents the arguments); returns
        (peer_slot, mine, taken after) ``[P]``."""
        expert = expert.contiguous()
        P = expert.shape[0]
        peer_slot = torch.empty(P, dtype=held.dtype, device=expert.device)
        mine = torch.empty(P, dtype=torch.bool, device=expert.device)
        after = torch.empty(P, dtype=torch.bool, device=expert.device)
        if P:
            with on_device(expert.device):
                _peer_pairs_kernel[(1,)](expert, taken.contiguous().view(torch.uint8), held, peer_slot,
                                         mine.view(torch.uint8), after.view(torch.uint8),
                                         counters if counters is not None else expert, P, layer, threshold,
                                         zero_slot, nbytes, COUNT=counters is not None,
                                         BLOCK=max(16, triton.next_power_of_2(P)), num_warps=4)
        return peer_slot, mine, after
else:
    gather_experts = torch.library.custom_op("strata::gather_experts", _reference, mutates_args=())

    def pair_bookkeeping_cuda(expert: Tensor, resident: Tensor, slot: Tensor | None = None,
                              usage: Tensor | None = None, counters: Tensor | None = None, nbytes: int = 0,
                              live: Tensor | None = None) -> Tensor:
        raise RuntimeError("pair_bookkeeping_cuda needs Triton")

    def peer_pairs_cuda(expert: Tensor, taken: Tensor, held: Tensor, zero_slot: int, layer: int, threshold: int,
                        counters: Tensor | None, nbytes: int) -> tuple[Tensor, Tensor, Tensor]:
        raise RuntimeError("peer_pairs_cuda needs Triton")

gather_experts.register_fake(_fake)
