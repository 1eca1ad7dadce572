"""Paged KV: per device slot a pool of fixed-size blocks, and the index of the prefix blocks sessions share.

A *block* holds ``block_size`` consecutive positions of a sequence. A device slot's ``BlockPool``
keeps, per layer and per-token state name (K and V rows, an MLA latent and rope key: what
``ModelSpec.layer_state`` declares), one tensor ``[n_blocks, block_size, *shape]``; a block id
indexes all of them at once, so one session's *block table* (int32 block ids, position ``p`` in
block ``table[p // block_size]`` at row ``p % block_size``) serves every layer the session keeps on
that slot. Block 0 is the *null block*: never handed out, all zeros, what the unused entries of a
device block table point at (a read over the whole capacity then sees zeros there, as a fresh
contiguous cache did). Recurrent state (Gated DeltaNet) is not paged: it stays per session
(kvcache.py).

Sharing (``KVPools``): a *full* block of committed positions is *published* under the chained hash
of the token ids of every block up to and including it (``hash((parent, tokens))``; a hit is checked
against the stored tokens and the parent entry, so a hash collision cannot share wrong rows). A new
session whose prompt starts with published blocks takes them by reference (``BlockPool.refs``): no
copy, no recompute. The rule: **only full, immutable blocks are shared, and a block that is shared
or published is never written.** Compute only writes positions at or past a session's length, so
a shared block is written only after a ``truncate`` into it; the next ``KVCache.reserve`` then makes
that block private first (copy-on-write when another session holds it too, else it is merely
unpublished).

Cached free blocks (as vLLM's and SGLang's prefix caches): a block its last holder frees returns to
the free list, but a published one keeps its index entry and rows there, on an LRU list of *cached*
blocks. A later session whose prompt starts with that content takes it back (``hold``: no copy, no
recompute), as it shares a block another session holds. An allocation takes never-published free
blocks first, then *evicts* the least recently freed cached block (its index entry goes). A table's
blocks are freed from its last, so that a sequence's tail is evicted before its head. Each pool
counts the cached blocks taken back (``hits``) and evicted (``evictions``).

Sizing (``StrataSettings.kv_block`` and ``kv_pool_tokens``): ``kv_block`` tokens a block (default
16); a pool of ``kv_pool_tokens`` tokens per device slot, by default ``parallel x max_context`` (what
``parallel`` contiguous sessions held before; sessions now take only the blocks they use, and
shared prefixes once), rounded up to whole blocks, plus the null block.

Storage (``StrataSettings.kv_type``, kvquant.py): the rows in the compute dtype (``auto``), as
bfloat16, or quantized as codes plus scales, each of them one more pool tensor of the layer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from strata_core.errors import BudgetError, RequestError
from strata_core.model.kvquant import kv_format, stored_layout
from strata_core.model.spec import StateTensor

__all__ = ["BlockPool", "KVPoolFull", "KVPools", "PrefixEntry", "blocks_for"]

log = logging.getLogger(__name__)

NULL_BLOCK = 0
#: blocks a pool keeps beyond its sessions' tokens for the padding session of padded decode windows
PADDING_BLOCKS = 1
_ROOT = 0x5EED  # the parent key of a sequence's first block


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return -(-tokens // block_size)


class KVPoolFull(RequestError):
    """A device slot's KV pool has fewer free blocks than a request needs now."""


@dataclass(eq=False)
class PrefixEntry:
    """One published full block: its tokens, the entry of the block before it, its block id per slot."""

    key: int
    parent: PrefixEntry | None
    tokens: tuple[int, ...]
    blocks: dict[int, int] = field(default_factory=dict)  # device slot -> block id


class BlockPool:
    """The blocks of one device slot: storage per (layer, per-token state name), free list, refcounts."""

    def __init__(self, slot: int, device: torch.device, n_blocks: int, block_size: int, dtype: torch.dtype,
                 kv_type: str = "auto"):
        if n_blocks < 2:
            raise BudgetError(f"a KV pool needs at least one block besides the null block, got {n_blocks}")
        self.slot, self.device, self.n_blocks, self.block_size, self.dtype = slot, device, n_blocks, block_size, dtype
        self.kv_type = kv_type
        self.rows: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [n_blocks, block_size, *shape]
        self.refs = [0] * n_blocks
        self.published: dict[int, PrefixEntry] = {}  # block id -> its index entry
        self._free = list(range(n_blocks - 1, NULL_BLOCK, -1))  # unpublished free blocks; pop(): the lowest id first
        #: free blocks still published (a later prompt may take them back), least recently freed first
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.hits = 0  # cached blocks taken back by a session sharing their content
        self.evictions = 0  # cached blocks handed out for other content

    def add_layer(self, layer: int, layout: Mapping[str, StateTensor]) -> None:
        """Storage for ``layer``'s per-token state as ``kv_type`` stores it (once; a layer already held is
        left as it is)."""
        if layer in self.rows:
            return
        layout = stored_layout(layout, self.kv_type, f"layer {layer}: ")
        self.rows[layer] = {name: torch.zeros((self.n_blocks, self.block_size, *t.shape), device=self.device,
                                              dtype=t.dtype or self.dtype)
                            for name, t in layout.items() if t.per_token}

    @property
    def n_free(self) -> int:
        """Blocks that can be handed out now (cached ones included)."""
        return len(self._free) + len(self.cached)

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool's storage."""
        return sum(t.numel() * t.element_size() for named in self.rows.values() for t in named.values())

    def allocate(self, n: int) -> tuple[list[int], list[PrefixEntry]]:
        """``n`` free blocks, each held once: unpublished ones first, then the least recently freed cached
        ones; with the index entries of the cached blocks taken (evicted: the caller drops them from the
        index). KVPoolFull (nothing taken) when fewer are free."""
        if n > self.n_free:
            raise KVPoolFull(f"the KV pool of device slot {self.slot} is full: {n} more blocks of {self.block_size} "
                             f"tokens needed, {self.n_free} of {self.n_blocks - 1} free (--kv-pool-tokens sets "
                             "its size)")
        ids = [self._free.pop() for _ in range(min(n, len(self._free)))]
        evicted = []
        while len(ids) < n:
            block, _ = self.cached.popitem(last=False)
            evicted.append(self.published.pop(block))
            ids.append(block)
        self.evictions += len(evicted)
        for i in ids:
            self.refs[i] = 1
        return ids, evicted

    def hold(self, block: int) -> None:
        """One more holder of ``block`` (a session sharing it; a cached block is taken back)."""
        if self.refs[block] == 0:
            del self.cached[block]
            self.hits += 1
        self.refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one hold of each of ``blocks`` (in position order), the last first; a block held no more
        is free: cached (most recently freed) where it is published, else unpublished."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.published:
                    self.cached[block] = None
                else:
                    self._free.append(block)

    def forget(self, block: int) -> None:
        """``block`` is no longer published: if it is cached, it becomes an unpublished free block."""
        self.published.pop(block, None)
        if block in self.cached:
            del self.cached[block]
            self._free.append(block)

    def writable(self, block: int) -> bool:
        """Whether a holder may write ``block`` in place: held once and not published."""
        return self.refs[block] == 1 and block not in self.published

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's rows of block ``src`` into block ``dst`` (on the device, no host wait)."""
        for named in self.rows.values():
            for tensor in named.values():
                tensor[dst].copy_(tensor[src])


class KVPools:
    """The block pools of one engine (one per device slot) and the index of published prefix blocks."""

    def __init__(self, block_size: int, n_blocks: int, dtype: torch.dtype, kv_type: str = "auto"):
        if block_size < 1:
            raise BudgetError(f"a KV block holds at least one token, got {block_size}")
        self.block_size, self.n_blocks, self.dtype = block_size, n_blocks, dtype
        #: how the pools store rows (``--kv-type``) and its quantized format (None: float rows)
        self.kv_type, self.kv_format = kv_type, kv_format(kv_type)
        self.pools: dict[int, BlockPool] = {}
        self.index: dict[int, PrefixEntry] = {}  # chained hash -> entry

    @property
    def session_tokens(self) -> int:
        """Positions each pool holds for sessions (its blocks but the null block and the padding block)."""
        return (self.n_blocks - 1 - PADDING_BLOCKS) * self.block_size

    @classmethod
    def for_tokens(cls, tokens: int, block_size: int, dtype: torch.dtype, max_tokens: int,
                   kv_type: str = "auto") -> KVPools:
        """Pools of ``tokens`` positions each (whole blocks), plus the null block and the block of the
        decode graphs' padding session (runtime/buckets.py), so that ``tokens`` stay for the sessions;
        BudgetError naming both numbers when that is fewer than one session of ``max_tokens``."""
        if tokens < max_tokens:
            raise BudgetError(f"a KV pool of {tokens} tokens (--kv-pool-tokens) cannot hold one session of "
                              f"{max_tokens} tokens (--max-context); give it at least {max_tokens}")
        return cls(block_size, blocks_for(tokens, block_size) + 1 + PADDING_BLOCKS, dtype, kv_type)

    def pool(self, slot: int, device: torch.device | str) -> BlockPool:
        """Device slot ``slot``'s pool (made on first use, on ``device``)."""
        if slot not in self.pools:
            self.pools[slot] = BlockPool(slot, torch.device(device), self.n_blocks, self.block_size, self.dtype,
                                         self.kv_type)
        return self.pools[slot]

    def log_sizes(self, devices: Mapping[int, object]) -> None:
        """Say each pool's size (blocks, tokens, layers, bytes)."""
        for slot, pool in sorted(self.pools.items()):
            log.info("KV pool of %s: %d blocks of %d tokens (%d tokens, the null and padding blocks aside) for %d "
                     "layers: %.3f GiB%s", devices[slot], self.session_tokens // pool.block_size, pool.block_size,
                     self.session_tokens, len(pool.rows), pool.nbytes / 2 ** 30,
                     "" if self.kv_type == "auto" else f" (--kv-type {self.kv_type})")

    # --- the prefix index -------------------------------------------------------------------------

    @staticmethod
    def key(parent: PrefixEntry | None, tokens: tuple[int, ...]) -> int:
        """The chained hash of a block of ``tokens`` after the block of ``parent`` (None: the first)."""
        return hash((_ROOT if parent is None else parent.key, tokens))

    def lookup(self, parent: PrefixEntry | None, tokens: tuple[int, ...]) -> PrefixEntry | None:
        """The published block of ``tokens`` after ``parent``'s, or None."""
        entry = self.index.get(self.key(parent, tokens))
        if entry is None or entry.parent is not parent or entry.tokens != tokens:
            return None
        return entry

    def publish(self, parent: PrefixEntry | None, tokens: tuple[int, ...], blocks: dict[int, int]) -> PrefixEntry:
        """Publish the full block of ``tokens`` after ``parent``'s, held in ``blocks`` (slot -> block id);
        where that content is published already, the entry there (the blocks stay private)."""
        found = self.lookup(parent, tokens)
        if found is not None:
            return found
        entry = PrefixEntry(self.key(parent, tokens), parent, tokens, dict(blocks))
        older = self.index.get(entry.key)
        if older is not None and self._reachable(older):  # a hash collision with other content: the older keeps it
            return entry
        if older is not None:  # left behind when an entry before it was evicted: no lookup can reach it
            self.unpublish(older)
        self.index[entry.key] = entry
        for slot, block in blocks.items():
            self.pools[slot].published[block] = entry
        return entry

    def _reachable(self, entry: PrefixEntry) -> bool:
        """Whether ``entry``'s parent is still indexed (its own parent is checked when it is published again)."""
        return entry.parent is None or self.index.get(entry.parent.key) is entry.parent

    def unpublish(self, entry: PrefixEntry) -> None:
        """Take ``entry`` out of the index (its blocks stay with their holders; cached ones are plain free
        blocks now)."""
        if self.index.get(entry.key) is entry:
            del self.index[entry.key]
        for slot, block in entry.blocks.items():
            pool = self.pools[slot]
            if pool.published.get(block) is entry:
                pool.forget(block)

    def allocate(self, slot: int, n: int) -> list[int]:
        """``n`` free blocks of ``slot``, each held once; the cached blocks this evicts leave the index.
        KVPoolFull (nothing taken) when fewer are free."""
        blocks, evicted = self.pools[slot].allocate(n)
        for entry in evicted:
            self.unpublish(entry)
        return blocks

    def free(self, slot: int, blocks: list[int]) -> None:
        """Drop one hold of each of ``blocks`` of ``slot`` (a table's, in position order); freed published
        blocks stay indexed, cached."""
        self.pools[slot].free(blocks)

    def counters(self) -> dict[str, int]:
        """Over every pool: cached blocks taken back (``hits``), evicted (``evictions``), and held now (``cached``)."""
        pools = self.pools.values()
        return {"hits": sum(p.hits for p in pools), "evictions": sum(p.evictions for p in pools),
                "cached": sum(len(p.cached) for p in pools)}

    def used(self, slot: int) -> int:
        """Blocks of ``slot`` held now."""
        pool = self.pools[slot]
        return pool.n_blocks - 1 - pool.n_free

    def __repr__(self) -> str:
        return (f"KVPools(block_size={self.block_size}, n_blocks={self.n_blocks}, slots={sorted(self.pools)}, "
                f"published={len(self.index)}, cached={self.counters()['cached']})")

