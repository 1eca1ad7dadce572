"""A prompt chunk's attention split by heads between its device and a peer (``LayerPlacement.attention_peer``).

In a long prompt the attention of a chunk grows with the context while its experts do not, and it runs
on the layer's device alone: in a 32K prompt it is most of the layer when a peer tier serves the
experts, with the peer idle. A :class:`HeadSplit` gives the peer the last ``peer_kv_heads`` kv heads
and the query heads that read them: their queries, keys and values go over in one copy, the peer
attends on a side stream while the home attends over its own heads, and the peer's heads come back to
be joined in head order. Each head is computed by the same kernel on the same inputs whichever device
runs it (attention is independent per head), so the output equals the unsplit attention's, bit for
bit. One exception is guarded: on CUDA, FlashAttention splits the keys of a launch with few (head,
query block) programs across thread blocks (split-KV, a heuristic on their number against the SMs),
which changes the order of its sums; a chunk is split only when each part has ``SPLIT_KV_BLOCKS`` such
programs a SM, where the heuristic keeps the keys whole (``splits``). Short chunks, where the
attention is cheap anyway, stay whole, and so does a prompt's first chunk (no more keys than queries):
its attention is a small part of the layer, and there the host, which the split costs a few launches,
bounds the layer (see BENCHMARKS.md).

On CUDA only events order the work (the side streams wait for the home's queries, the home for the
peer's heads); on the CPU the same code runs in order. Decode steps (one token) are not split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata_core.runtime.devices import device_scope
from strata_core.experts.peer import packed_copy

__all__ = ["SPLIT_KV_BLOCKS", "HeadSplit"]

#: (head, 64-query block) programs a SM of each part below which a CUDA chunk stays whole: FlashAttention 2
#: splits the keys when a launch has fewer than 0.8 x 2 x SMs of them (``num_splits_heuristic``).
SPLIT_KV_BLOCKS = 2

#: ``attend(q [T, nh', D], keys [S, nkv', D], values [S, nkv', D], positions [T]) -> [T, nh' * D]`` on one device.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class HeadSplit:
    """The attention heads of a prompt chunk on ``home``, the last ``peer_kv_heads`` kv heads' share on ``peer``.

    :param home: the device the layer runs on.
    :param peer: the device that takes a share of its prompt attention.
    :param peer_kv_heads: kv heads the peer attends over (their query heads with them).
    """

    def __init__(self, home: torch.device, peer: torch.device, peer_kv_heads: int):
        self.home, self.peer, self.peer_kv_heads = home, peer, peer_kv_heads
        cuda = home.type == "cuda" and peer.type == "cuda"
        self._home_stream = torch.cuda.Stream(home) if cuda else None
        self._peer_stream = torch.cuda.Stream(peer) if cuda else None
        self._sms = min(torch.cuda.get_device_properties(d).multi_processor_count for d in (home, peer)) if cuda else 0

    def splits(self, n_tokens: int, n_keys: int, n_heads: int, n_kv_heads: int) -> bool:
        """Whether a chunk of ``n_tokens`` queries over ``n_keys`` keys is split: when it reads more keys than
        it has queries (not a prompt's first chunk) and, on CUDA, each part has ``SPLIT_KV_BLOCKS``
        (head, 64-query block) programs a SM, so that no part's keys are split."""
        heads = min(n_heads // n_kv_heads * self.peer_kv_heads, n_heads - n_heads // n_kv_heads * self.peer_kv_heads)
        return n_keys > n_tokens and (self._sms == 0 or heads * -(-n_tokens // 64) >= SPLIT_KV_BLOCKS * self._sms)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 attend: Attend) -> torch.Tensor:
        """``[T, nh * D]``: ``attend`` over every head of ``q [T, nh, D]`` (``keys``, ``values`` ``[S, nkv, D]``),
        the peer's share computed there at the same time."""
        nh, nkv = q.shape[1], keys.shape[1]
        if not self.splits(q.shape[0], keys.shape[0], nh, nkv):
            return attend(q, keys, values, positions)
        kept = nkv - self.peer_kv_heads  # kv heads attended here
        split = kept * (nh // nkv)  # query heads attended here
        theirs = (q[:, split:], keys[:, kept:], values[:, kept:], positions)
        if self._peer_stream is None:
            with device_scope(self.peer):
                there = attend(*(packed_copy(theirs, self.peer) if self.peer != self.home else theirs))
            mine = attend(q[:, :split], keys[:, :kept], values[:, :kept], positions)
            return torch.cat((mine, there.to(self.home)), dim=1)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.home))  # the queries, keys and values are written
        self._home_stream.wait_event(ready)
        self._peer_stream.wait_event(ready)
        with torch.cuda.stream(self._home_stream), torch.cuda.stream(self._peer_stream):
            sent = packed_copy(theirs, self.peer) if self.peer != self.home else theirs  # on the home's side stream
            with torch.cuda.device(self.peer):
                there = attend(*sent).to(self.home)  # computed, then copied back, on the peer's side stream
        mine = attend(q[:, :split], keys[:, :kept], values[:, :kept], positions)
        for side in (self._home_stream, self._peer_stream):  # both: with peer == home only the peer's has the work
            done = torch.cuda.Event()
            done.record(side)
            torch.cuda.current_stream(self.home).wait_event(done)
        return torch.cat((mine, there), dim=1)
