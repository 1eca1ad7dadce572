"""``KVCache``: one sequence's per-layer session state, paged in blocks of its device slots' pools.

Each layer keeps the named tensors its ``ModelSpec.layer_state`` declares: *rows* (``per_token``:
row i = position i; K and V, an MLA latent) and *recurrent state* (a fixed shape updated in place; a
linear-attention layer's convolution and ssm state). Rows live in the blocks of the device slot's
``BlockPool`` (kvpool.py): the cache holds a *block table* per slot (int32 block ids; on the slot's
device as a fixed ``[max_blocks]`` tensor whose unused entries name the null block, so its address
never changes and a CUDA graph or a fused kernel reads it in place) and grows block by block
(``reserve``), shrinks by whole blocks (``truncate``), and returns its blocks on ``release``; nothing
is reallocated. Recurrent state is not paged: each cache owns its tensors.

A cache may hold only some layers; the layers of one cache may sit on different device slots. Each
layer has a *home* slot (where compute reads and writes it now), or is *away* on another rank's.
Moving layers to another slot, another rank or host memory (hand-offs, snapshots, restores) is
kvtransfer.py's: it works on this cache's block tables and state directly (``_tables``, ``_state``,
``_parked``, ``_left``, ``_place_layer``, ``_store`` ...), as a method here would. Compute
writes rows at the positions it computes, into blocks ``reserve`` made ready before (no allocation, no host work inside a layer);
the caller commits them with ``advance`` once every layer has run, so ``n_tokens`` is the number of
positions all layers hold. Recurrent state cannot be rewound in general: ``truncate`` to a shorter
non-zero length is refused for a cache that holds any (``can_truncate``), except inside the decode
window just run when ``keep_steps`` asked for it: then the state after each of the window's rows was
kept (``keep_step``), and ``truncate`` to any of those positions puts that state back (a speculative
window's rejected drafts cut off a Gated DeltaNet layer exactly as off attention K/V).

Prefix sharing (kvpool.py has the rule): ``share`` makes an empty cache hold the published full
blocks a prompt starts with (held by other sessions, or cached since their last holder freed them),
``publish`` publishes the cache's own full blocks; a cache with recurrent state neither shares nor
publishes (its state at a block boundary is not kept).

``read(layer, n)`` gathers positions ``[0, n)`` into contiguous tensors (the eager and prompt
attention, the CPU reference); the fused decode kernels read the pools through the block tables; a
*stand-in* (``stand_in``) holds no blocks and reads another session's through row ids it is given.

Quantized KV (the pools' ``kv_type``, kvquant.py): the layout holds each per-token row as codes and
scales; ``write`` quantizes, ``read`` gives ``QuantizedRows`` (codes and scales gathered, dequantized
by the attention a key block at a time), and everything else (hand-offs, snapshots, restores,
block copies) moves the stored codes and scales as they are.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from strata_core.model.kvpool import NULL_BLOCK, KVPoolFull, KVPools, PrefixEntry, blocks_for
from strata_core.model.kvquant import SCALE, QuantizedRows, quantize, stored_layout
from strata_core.model.spec import StateTensor
from strata_core.runtime.devices import to_device

__all__ = ["DEFAULT_BLOCK", "KVCache", "StateTensor"]

LayerTensors = dict[str, torch.Tensor]

#: tokens per block of a cache made without an engine's pools (the engine's: ``--kv-block``)
DEFAULT_BLOCK = 16


def _give_back(pools: KVPools, tables: dict[int, list[int]]) -> None:
    """Return every block of ``tables`` to ``pools`` (a cache released, or dropped unreleased)."""
    for slot, table in tables.items():
        pools.free(slot, table)
    tables.clear()


def _clone(named: LayerTensors) -> LayerTensors:
    return {name: t.clone() for name, t in named.items()}


def _on(device: torch.device, values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A small host list on ``device`` without making the host wait (pinned, non-blocking on CUDA)."""
    return to_device(torch.tensor(list(values), dtype=dtype), device)


class KVCache:
    """Per-layer named state for the layers in ``layers`` (``layout``: layer -> name -> StateTensor),
    for up to ``max_tokens`` positions.

    :param pools: the engine's block pools (kvpool.py); None: pools of its own, sized for this one
        cache, with blocks of ``block_size`` tokens, storing rows as ``kv_type`` says (kvquant.py).
    """

    def __init__(self, layers: range, max_tokens: int, layout: Mapping[int, Mapping[str, StateTensor]],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 homes: dict[int, tuple[int, torch.device]] | None = None, pools: KVPools | None = None,
                 block_size: int = DEFAULT_BLOCK, kv_type: str = "auto"):
        self.layers = layers
        self.max_tokens = max_tokens
        self.n_tokens = 0
        self.pools = pools if pools is not None else KVPools.for_tokens(max_tokens, block_size, dtype, max_tokens,
                                                                        kv_type)
        #: the quantized format of the rows (None: float rows, read as tensors)
        self.kv_format = self.pools.kv_format
        self._spec_layout = {i: dict(layout[i]) for i in layers}  # what the pools are given (they store it their way)
        self._layout = {i: stored_layout(layout[i], self.pools.kv_type, f"layer {i}: ") for i in layers}
        self._dtype = dtype
        self.can_truncate = all(t.per_token for i in layers for t in self._layout[i].values())
        self.block_size = self.pools.block_size
        self.max_blocks = blocks_for(max_tokens, self.block_size)
        self.released = False
        #: bumped whenever a layer's pool or block table changes (a move, a release): what caches of their
        #: addresses check (fused_decode.kv_tables); growing and truncating refill the tables in place
        self.version = 0
        homes = homes or {i: (0, torch.device(device)) for i in layers}
        self.home = {i: homes[i][0] for i in layers}  # layer -> device slot holding it now
        #: layer -> another rank's device slot holding it now (kvtransfer ``leave``; not in ``home`` meanwhile)
        self.away: dict[int, int] = {}
        self._tables: dict[int, list[int]] = {}  # slot -> block ids (host)
        self._device_tables: dict[int, torch.Tensor] = {}  # slot -> int32 [max_blocks] on the slot's device
        #: slot -> int64 [max_blocks * block_size]: each position's row in the slot's pool, kept with the device
        #: table (a layer's read is a slice of it, a write one index: no per-layer arithmetic on the table)
        self._row_ids: dict[int, torch.Tensor] = {}
        self._chain: list[PrefixEntry] = []  # index entries of the leading full blocks (shared or published)
        self._state: dict[int, LayerTensors] = {}  # layer -> its recurrent state (on its home)
        self._parked: dict[tuple[int, int], LayerTensors] = {}  # (layer, slot) -> recurrent state left there
        #: (layer, slot) -> positions whose rows a hand-off (kvtransfer ``move``, ``leave``) left there still hold:
        #: those after go stale while the layer computes elsewhere (what ``publish`` may offer of that slot)
        self._left: dict[tuple[int, int], int] = {}
        #: per recurrent layer, its state at positions ``_steps_from``, ``_steps_from + 1``, ... of the decode
        #: window in progress (``keep_steps``); what ``truncate`` rewinds to; cleared when a phase reserves
        self._steps: dict[int, list[LayerTensors]] = {}
        self._steps_from: int | None = None
        # a cache dropped without ``release`` still gives its blocks back
        self._give_back = weakref.finalize(self, _give_back, self.pools, self._tables)
        for i in layers:
            slot, where = homes[i]
            self._place_layer(i, slot, where)
            self._state[i] = self._new_state(i, where)

    @classmethod
    def for_spec(cls, spec, max_tokens: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, layers: range | None = None,
                 homes: dict[int, tuple[int, torch.device]] | None = None, pools: KVPools | None = None,
                 block_size: int = DEFAULT_BLOCK, kv_type: str = "auto") -> KVCache:
        """A cache for ``spec`` (a ModelSpec: ``layer_state`` gives each layer's tensors) holding
        ``layers`` (all if None), each layer on its ``homes`` entry (device slot, torch device) if
        given, else on ``device`` as slot 0; in ``pools`` (None: its own, of ``block_size`` blocks
        storing ``kv_type`` rows)."""
        layers = layers if layers is not None else range(spec.n_layers)
        return cls(layers, max_tokens, {i: spec.layer_state(i) for i in layers}, device, dtype, homes, pools,
                   block_size, kv_type)

    # --- storage ---------------------------------------------------------------------------------

    def _place_layer(self, layer: int, slot: int, device: torch.device | str) -> None:
        """Make ``slot``'s pool hold ``layer``'s rows and this cache hold a table there."""
        self.pools.pool(slot, device).add_layer(layer, self._spec_layout[layer])
        self._table(slot)

    def _table(self, slot: int) -> list[int]:
        if slot not in self._tables:
            self._tables[slot] = []
            self._device_tables[slot] = torch.full((self.max_blocks,), NULL_BLOCK, dtype=torch.int32,
                                                    device=self.pools.pools[slot].device)
            self._row_ids[slot] = torch.empty(self.max_blocks * self.block_size, dtype=torch.int64,
                                              device=self.pools.pools[slot].device)
            self._refresh_rows(slot, 0, self.max_blocks)
        return self._tables[slot]

    def _refresh_rows(self, slot: int, start: int, stop: int) -> None:
        """Recompute the row ids of blocks ``[start, stop)`` of ``slot`` from its device table."""
        table = self._device_tables[slot][start:stop].long()
        lanes = torch.arange(self.block_size, device=table.device)
        self._row_ids[slot].view(self.max_blocks, self.block_size)[start:stop] = table[:, None] * self.block_size + lanes

    def _new_state(self, layer: int, device: torch.device | str) -> LayerTensors:
        return {name: torch.zeros(t.shape, device=device, dtype=t.dtype or self._dtype)
                for name, t in self._layout[layer].items() if not t.per_token}

    def _upload(self, slot: int, start: int) -> None:
        """Copy the host table of ``slot`` from block ``start`` on into its device table."""
        ids = self._tables[slot][start:]
        if ids:
            device_table = self._device_tables[slot]
            device_table[start:start + len(ids)].copy_(_on(device_table.device, ids, torch.int32), non_blocking=True)
            self._refresh_rows(slot, start, start + len(ids))

    def _home_slots(self) -> list[int]:
        return sorted(set(self.home.values()))

    def _rows(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s pool tensor ``name`` on its home, as rows ``[n_blocks * block_size, *shape]``."""
        rows = self.pools.pools[self.home[layer]].rows[layer][name]
        return rows.view(-1, *rows.shape[2:])

    def _flat(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """int64 row ids in ``slot``'s pool of ``positions`` (on the device table's device: no host work)."""
        rows = self._row_ids[slot]
        return rows.index_select(0, positions.to(rows.device))

    # --- compute's view --------------------------------------------------------------------------

    def write(self, layer: int, positions: torch.Tensor, **rows: torch.Tensor) -> None:
        """Store each named row tensor ``[T, ...]`` at ``positions [T]`` of ``layer`` (``k=..., v=...``),
        quantized where the pools store codes and scales; the positions' blocks were made ready by ``reserve``."""
        if self.kv_format is not None:
            stored = {}
            for name, value in rows.items():
                if name + SCALE in self._layout[layer]:
                    stored[name], stored[name + SCALE] = quantize(value, self.kv_format)
                else:
                    stored[name] = value
            rows = stored
        self._store(layer, positions, rows)

    def _store(self, layer: int, positions: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
        """Write stored tensors (rows, or codes and scales) ``[T, ...]`` at ``positions [T]`` as they are."""
        flat = self._flat(self.home[layer], positions)
        for name, value in rows.items():
            target = self._rows(layer, name)
            target.index_copy_(0, flat, value.to(target.dtype))  # one op (an index put costs several a call)

    def read(self, layer: int, n: int, *names: str) -> tuple[torch.Tensor | QuantizedRows, ...]:
        """Positions ``[0, n)`` of ``layer``'s rows ``names`` (default ``"k", "v"``), gathered from its
        blocks into contiguous tensors ``[n, ...]`` (positions without a block read as zeros); a quantized
        row as ``QuantizedRows`` (its codes and scales gathered, not dequantized)."""
        names = names or ("k", "v")
        if self.kv_format is None:
            return self._gather(layer, n, names)
        out = []
        for name in names:
            if name + SCALE in self._layout[layer]:
                out.append(QuantizedRows(*self._gather(layer, n, (name, name + SCALE))))
            else:
                out.extend(self._gather(layer, n, (name,)))
        return tuple(out)

    def paged(self, layer: int, n: int, *names: str) -> tuple[torch.Tensor, ...]:
        """``layer``'s stored tensors ``names`` (default ``"k", "v"``) as the pool's rows ``[n_blocks * block_size,
        ...]``, read in place, then the int64 row ids ``[n]`` of positions ``[0, n)`` in them (a position without
        a block: a row of the null block): what ``read`` gathers, for a kernel that follows the ids itself."""
        names = names or ("k", "v")
        return (*(self._rows(layer, name) for name in names), self._row_ids[self.home[layer]][:n])

    def write_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer``'s key and value pools ``[n_blocks, block_size, ...]`` on its home slot as they are stored, and
        the int64 row id in them of every position ``[max_blocks * block_size]``: what a kernel that writes a
        position's rows in place reads (no view made: a decode token asks every layer)."""
        home = self.home[layer]
        rows = self.pools.pools[home].rows[layer]
        return rows["k"], rows["v"], self._row_ids[home]

    def _gather(self, layer: int, n: int, names: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """Positions ``[0, n)`` of ``layer``'s stored tensors ``names``, as they are stored."""
        flat = self._row_ids[self.home[layer]][:n]
        return tuple(self._rows(layer, name).index_select(0, flat) for name in names)

    def committed(self, layer: int, tensors: LayerTensors | None = None) -> LayerTensors:
        """What ``layer`` holds now: its committed rows (gathered) and its
        whole recurrent state (of ``tensors``, e.g. a parked set, instead of the live ones if given)."""
        if tensors is None:
            names = [name for name, t in self._layout[layer].items() if t.per_token]
            rows = dict(zip(names, self._gather(layer, self.n_tokens, names))) if names else {}
            return {**rows, **self._state[layer]}
        return {name: t[:self.n_tokens] if self._layout[layer][name].per_token else t for name, t in tensors.items()}

    def block_table(self, layer: int) -> torch.Tensor:
        """int32 ``[max_blocks]`` block ids of ``layer``'s home slot, on its device (a fixed tensor,
        refilled in place as the cache grows; unused entries name the null block)."""
        return self._device_tables[self.home[layer]]

    def pool_rows(self, layer: int) -> LayerTensors:
        """``layer``'s pool tensors on its home slot, by name: ``[n_blocks, block_size, *shape]``."""
        return self.pools.pools[self.home[layer]].rows[layer]

    def state(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s recurrent state ``name`` (compute updates it in place)."""
        return self._state[layer][name]

    def recurrent(self, layer: int) -> LayerTensors:
        """``layer``'s fixed-size recurrent state tensors by name (none for a layer of rows only)."""
        return dict(self._state.get(layer, {}))

    def stand_in(self, layers: range) -> KVCache:
        """An empty cache of ``layers`` at the same homes over the same pools, holding no blocks: what a decode
        graph reads in place of any session of this layout (runtime/stand_ins.py), through the row ids it is
        given (``follow``); its recurrent state tensors are its own."""
        homes = {i: (self.home[i], self.pools.pools[self.home[i]].device) for i in layers}
        return KVCache(layers, self.max_tokens, {i: self._spec_layout[i] for i in layers}, dtype=self._dtype,
                       homes=homes, pools=self.pools)

    def follow(self, slot: int, row_ids: torch.Tensor) -> None:
        """Reach ``slot``'s pool through ``row_ids`` (int64 ``[max_blocks * block_size]``: each position's row,
        filled by the caller) in place of this cache's own: a stand-in's reads and writes land in the blocks
        of the session whose table gave them."""
        self._row_ids[slot] = row_ids

    # --- length ----------------------------------------------------------------------------------

    def reserve(self, n: int) -> None:
        """Make the blocks of positions ``[0, n)`` ready on every home slot, so compute may write up to
        position ``n - 1``; the block holding position ``n_tokens`` is made private first where it is
        shared or published (copy-on-write). KVPoolFull, with nothing taken, when a pool is short."""
        if n > self.max_tokens:
            raise ValueError(f"KV cache overflow: {n} > {self.max_tokens} tokens")
        self._drop_steps()  # a new phase: the states kept for the last window's positions no longer follow
        want = blocks_for(n, self.block_size)
        partial = self.n_tokens // self.block_size if self.n_tokens % self.block_size else None
        needs = {}
        for slot in {*self._home_slots(), *(self._tables if partial is not None else ())}:
            table, pool = self._table(slot), self.pools.pools[slot]
            need = max(0, want - len(table)) if slot in self.home.values() else 0
            if partial is not None and partial < len(table) and pool.refs[table[partial]] > 1:
                need += 1
            if need > pool.n_free:
                raise KVPoolFull(f"the KV pool of device slot {slot} is full: {need} more blocks of "
                                 f"{self.block_size} tokens needed, {pool.n_free} of {pool.n_blocks - 1} free "
                                 "(--kv-pool-tokens sets its size)")
            needs[slot] = need
        for slot in needs:
            if partial is not None and partial < len(self._tables[slot]):
                self._make_private(slot, partial)
            if slot in self.home.values():
                self._extend(slot, want)

    def _extend(self, slot: int, n_blocks: int) -> None:
        """Grow ``slot``'s table to ``n_blocks`` blocks (KVPoolFull when its pool is short)."""
        table = self._tables[slot]
        if n_blocks > len(table):
            start = len(table)
            table.extend(self.pools.allocate(slot, n_blocks - start))
            self._upload(slot, start)

    def _make_private(self, slot: int, j: int) -> None:
        """Block ``j`` of ``slot``'s table writable by this cache: unpublished where only it holds the
        block, else replaced by a copy (copy-on-write)."""
        table, pool = self._tables[slot], self.pools.pools[slot]
        block = table[j]
        if pool.writable(block):
            return
        if pool.refs[block] == 1:
            self.pools.unpublish(pool.published[block])
            return
        (copy,) = self.pools.allocate(slot, 1)
        pool.copy_block(block, copy)
        self.pools.free(slot, [block])
        table[j] = copy
        self._upload(slot, j)

    def advance(self, n: int) -> None:
        """Commit ``n`` more positions (after every layer has written them)."""
        if self.n_tokens + n > self.max_tokens:
            raise ValueError(f"KV cache overflow: {self.n_tokens} + {n} > {self.max_tokens} tokens")
        self.n_tokens += n

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n``: the blocks past the new length go back to their pools (a block
        kept partly is written again only after ``reserve`` made it private). ``truncate(0)`` also
        zeroes recurrent state; a shorter non-zero length is a ValueError when recurrent state is held,
        unless the decode window just run kept its state at ``n`` (``keep_steps``)."""
        if n >= self.n_tokens:
            return
        if n == 0:
            self._drop_steps()
            for named in self._state.values():
                for tensor in named.values():
                    tensor.zero_()
        elif not self.can_truncate:
            self._rewind_state(n)
        self.n_tokens = n
        self._left = {key: min(kept, n) for key, kept in self._left.items()}  # what follows is another sequence's
        self.trim()

    def keep_steps(self) -> None:
        """Keep the recurrent state after each row of the decode window about to run (``keep_step``), so
        that ``truncate`` may cut the window back to any of its rows (its first row, the request's own
        token, always stays: the state before the window is not kept); nothing for a cache without
        recurrent state. The states kept are dropped when the next phase reserves positions."""
        self._steps = {i: [] for i, named in self._state.items() if named}
        self._steps_from = self.n_tokens if self._steps else None

    @property
    def keeps_steps(self) -> bool:
        """Whether ``keep_steps`` is keeping the recurrent state of the window in progress."""
        return self._steps_from is not None

    def keep_step(self, layer: int, states: LayerTensors | None = None) -> None:
        """Keep ``layer``'s recurrent state after one more row of the window (``keep_steps``): ``states`` (by
        name, tensors nobody writes to after) where the compute has them, else a copy of the live state."""
        steps = self._steps.get(layer)
        if steps is not None:
            steps.append(dict(states) if states is not None else _clone(self._state[layer]))

    def _rewind_state(self, n: int) -> None:
        """Put back each recurrent layer's state kept after the window's row at position ``n - 1``
        (``keep_steps``)."""
        row = n - 1 - (self._steps_from if self._steps_from is not None else n)
        if row < 0 or any(len(steps) <= row for steps in self._steps.values()):
            raise ValueError(f"cannot rewind recurrent state from {self.n_tokens} to {n} positions")
        for layer, steps in self._steps.items():
            for name, kept in steps[row].items():
                self._state[layer][name].copy_(kept)
            del steps[row + 1:]

    def _drop_steps(self) -> None:
        self._steps, self._steps_from = {}, None

    def trim(self) -> None:
        """Give back the blocks past ``n_tokens`` (reserved for a phase that did not commit them)."""
        keep = blocks_for(self.n_tokens, self.block_size)
        del self._chain[self.n_tokens // self.block_size:]
        for slot, table in self._tables.items():
            if len(table) > keep:
                self.pools.free(slot, table[keep:])
                self._device_tables[slot][keep:len(table)] = NULL_BLOCK
                self._refresh_rows(slot, keep, len(table))
                del table[keep:]

    def release(self) -> None:
        """Give every block back and drop the recurrent state; the cache is empty and unusable after
        (a cache dropped without it gives its blocks back when it is collected)."""
        self.n_tokens = 0
        self._give_back()
        self._device_tables.clear()
        self._row_ids.clear()
        self._chain.clear()
        self._state.clear()
        self._parked.clear()
        self._left.clear()
        self._drop_steps()
        self.released = True
        self.version += 1

    def blocks(self, slot: int) -> list[int]:
        """The block ids this cache holds on ``slot`` (its table), in position order."""
        return list(self._tables.get(slot, ()))

    # --- prefix sharing --------------------------------------------------------------------------

    def share(self, tokens: Sequence[int]) -> int:
        """Hold the published full blocks ``tokens`` starts with (no copy, no recompute), for an empty
        cache without recurrent state; returns the positions now held (a multiple of the block size)."""
        if self.n_tokens or not self.can_truncate or any(self._tables.values()):
            return 0
        bs, homes = self.block_size, set(self.home.values())
        entries: list[PrefixEntry] = []
        parent = None
        for j in range(len(tokens) // bs):
            entry = self.pools.lookup(parent, tuple(tokens[j * bs:(j + 1) * bs]))
            if entry is None or not homes <= entry.blocks.keys():
                break
            entries.append(entry)
            parent = entry
        for entry in entries:
            for slot, block in entry.blocks.items():
                self.pools.pools[slot].hold(block)
                self._table(slot).append(block)
        for slot in self._tables:
            self._upload(slot, 0)
        self._chain = entries
        self.n_tokens = len(entries) * bs
        return self.n_tokens

    def publish(self, tokens: Sequence[int]) -> int:
        """Publish this cache's committed full blocks so other sessions can share them (and so they stay
        cached once released: kvpool.py); ``tokens``: the ids of its positions (a negative id, a token not
        known on the host yet, ends what is published). Returns how many leading blocks are published now. A block is published with each slot's
        block that holds the rows of every layer kept there, and only while every home slot's does (a
        hand-off leaves rows behind that go stale once the layer computes elsewhere)."""
        if not self.can_truncate:
            return len(self._chain)
        bs = self.block_size
        valid = {slot: self._valid(slot) for slot in self._tables}
        homes = self._home_slots()
        for j in range(len(self._chain), min(len(tokens), self.n_tokens) // bs):
            end = (j + 1) * bs
            blocks = {slot: table[j] for slot, table in self._tables.items() if len(table) > j and valid[slot] >= end}
            ids = tuple(tokens[j * bs:end])
            if any(slot not in blocks for slot in homes) or min(ids) < 0:
                break
            parent = self._chain[-1] if self._chain else None
            self._chain.append(self.pools.publish(parent, ids, blocks))
        return len(self._chain)

    def _valid(self, slot: int) -> int:
        """Positions whose rows ``slot``'s blocks hold for every layer kept there."""
        return min((kept for (_, s), kept in self._left.items() if s == slot), default=self.n_tokens)
