"""Moving a ``KVCache``'s layers (kvcache.py) elsewhere: to another device slot, another rank, host memory.

A hand-off within a process (``move``) copies the committed rows of the moved layers into the
session's blocks on the other slot (one table per slot serves every layer the session keeps there)
and the recurrent state into tensors parked there for the way back; the blocks left on the old slot
stay the session's, so going back and forth between a prompt and a decode placement allocates each
block once (``parked``: what a hand-off left behind, which ``STRATA_DBG_HANDOFF`` compares). Across
processes (ranks) a hand-off is ``leave`` (host copies of the layers' rows and state; the layers are
*away* until they come back) on the sending side and ``arrive`` (written into this cache's blocks) on
the receiving one.

``snapshot`` copies the committed rows and recurrent state to host memory (the conversation cache
keeps these, ``leave`` sends one); ``restore`` writes one back. Quantized rows travel as stored
(codes and scales), never dequantized.

These work on the cache's storage directly (its block tables, pools, recurrent and parked state, the
positions a hand-off left behind: the underscore members kvcache.py documents), as the cache's own
methods would; prefix sharing stays in kvcache.py, where the block tables it holds and publishes are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_core.model.kvcache import KVCache, LayerTensors, _on
from strata_core.model.kvpool import blocks_for

__all__ = ["KVSnapshot", "arrive", "leave", "move", "parked", "restore", "snapshot"]


@dataclass(frozen=True)
class KVSnapshot:
    """A host copy of the first ``n_tokens`` rows (and the recurrent state) of some layers. From a
    CUDA cache the copies are still in flight until ``ready`` (one event per device) has passed:
    ``wait()`` before reading them."""

    n_tokens: int
    tensors: dict[int, LayerTensors]  # layer -> name -> rows [n_tokens, ...] or the whole state
    ready: tuple[torch.cuda.Event, ...] = ()

    def wait(self) -> None:
        """Block until every copy to the host has landed."""
        for event in self.ready:
            event.synchronize()

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.numel() * t.element_size() for named in self.tensors.values() for t in named.values())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``: from a CUDA device into pinned memory by a copy that does not wait."""
    if t.device.type != "cuda":
        return t.to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


# --- hand-off --------------------------------------------------------------------------------------


def move(kv: KVCache, layers: range, slot: int, device: torch.device | str) -> None:
    """Hand-off: make device slot ``slot`` (on ``device``) the home of ``layers`` of ``kv``, copying the
    committed rows into the cache's blocks there (blocks shared there hold them already) and the
    recurrent state, device to device (no host round trip); what is left behind stays for the way back."""
    nb = blocks_for(kv.n_tokens, kv.block_size)
    for i in layers:
        src = kv.home[i]
        if src == slot:
            continue
        kv._place_layer(i, slot, device)
        kv._extend(slot, len(kv._tables[src]))
        pool = kv.pools.pools[slot]
        pairs = [(s, d) for s, d in zip(kv._tables[src][:nb], kv._tables[slot][:nb]) if pool.writable(d)]
        if pairs:
            source_rows = kv.pools.pools[src].rows[i]
            at_src = _on(kv.pools.pools[src].device, [s for s, _ in pairs], torch.int64)
            at_dst = _on(pool.device, [d for _, d in pairs], torch.int64)
            for name, rows in pool.rows[i].items():
                rows[at_dst] = source_rows[name][at_src].to(pool.device, non_blocking=True)
        kv._parked[(i, src)] = kv._state[i]
        moved = kv._parked.pop((i, slot), None) or kv._new_state(i, device)
        for name, source in kv._state[i].items():
            moved[name].copy_(source, non_blocking=True)
        kv._state[i], kv.home[i] = moved, slot
        kv._left[(i, src)] = kv.n_tokens
        kv._left.pop((i, slot), None)
        kv.version += 1


def leave(kv: KVCache, layers: range, slot: int) -> KVSnapshot:
    """Hand-off to another process: host copies of the committed rows and recurrent state of
    ``layers`` of ``kv`` (landed), after which the layers are *away* at device slot ``slot`` (another
    rank's): no compute here reads them until :func:`arrive` brings them back. Their blocks here stay
    the cache's (their rows go stale)."""
    _check_here(kv, layers)
    snap = snapshot(kv, layers)
    snap.wait()
    for i in layers:
        kv._left[(i, kv.home[i])] = kv.n_tokens
        del kv._state[i], kv.home[i]
        kv.away[i] = slot
    kv._steps = {i: steps for i, steps in kv._steps.items() if i in kv._state}
    kv.version += 1
    return snap


def arrive(kv: KVCache, snap: KVSnapshot, slot: int, device: torch.device | str) -> None:
    """Hand-off from another process: make ``slot`` (on ``device``) the home of the snapshot's
    layers (away, or at home there) in ``kv`` and write their rows and state. Where the cache keeps
    other layers at home the snapshot must hold as many positions as they do; where it keeps none it
    takes the snapshot's length (as :func:`restore`)."""
    layers = sorted(snap.tensors)
    wrong = [i for i in layers if i not in kv.layers or kv.home.get(i, slot) != slot]
    if wrong:
        raise ValueError(f"cannot receive layer {wrong[0]} on slot {slot}: it is not this cache's or is at home "
                         f"on slot {kv.home.get(wrong[0])}")
    staying = kv.home.keys() - set(layers)
    if staying and snap.n_tokens != kv.n_tokens:
        raise ValueError(f"the rows received hold {snap.n_tokens} positions, this cache {kv.n_tokens}")
    for i in layers:
        if i not in kv.home:
            kv._place_layer(i, slot, device)
            kv._state[i] = kv._new_state(i, device)
            kv.home[i] = slot
        kv.away.pop(i, None)
        kv._left.pop((i, slot), None)  # its rows are all written here below
    kv.version += 1
    if not staying:
        restore(kv, snap)
        return
    kv._extend(slot, blocks_for(kv.n_tokens, kv.block_size))
    positions = torch.arange(kv.n_tokens, device=kv._device_tables[slot].device)
    for i in layers:
        named = snap.tensors[i]
        rows = {name: t.to(positions.device) for name, t in named.items() if kv._layout[i][name].per_token}
        if rows:
            kv._store(i, positions, rows)
        for name, t in named.items():
            if not kv._layout[i][name].per_token:
                kv._state[i][name].copy_(t)


def _check_here(kv: KVCache, layers: range) -> None:
    """ValueError when a layer of ``layers`` is away (its state is another process's now)."""
    away = [i for i in layers if i in kv.away]
    if away:
        raise ValueError(f"layer {away[0]}'s state is on another rank's device slot {kv.away[away[0]]}")


def parked(kv: KVCache, layer: int, slot: int) -> LayerTensors | None:
    """What a hand-off left of ``layer`` of ``kv`` on ``slot``: its committed rows gathered from the
    blocks there and its parked recurrent state (what ``STRATA_DBG_HANDOFF`` compares), or None."""
    if (layer, slot) not in kv._left:
        return None
    flat = kv._row_ids[slot][:kv.n_tokens]
    rows = {name: t.view(-1, *t.shape[2:]).index_select(0, flat)
            for name, t in kv.pools.pools[slot].rows[layer].items()}
    return {**rows, **kv._parked.get((layer, slot), {})}


# --- host copies -----------------------------------------------------------------------------------


def snapshot(kv: KVCache, layers: range | None = None) -> KVSnapshot:
    """Copy the committed rows and the recurrent state of ``layers`` of ``kv`` (all if None) to host
    memory: from a CUDA device into pinned memory without waiting (each copy follows the work queued
    before it on the device's stream; the snapshot's events say when they have landed)."""
    layers = kv.layers if layers is None else layers
    _check_here(kv, layers)
    committed = {i: kv.committed(i) for i in layers}
    tensors = {i: {name: _to_host(t) for name, t in named.items()} for i, named in committed.items()}
    ready = []
    for device in {t.device for named in committed.values() for t in named.values() if t.device.type == "cuda"}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    return KVSnapshot(kv.n_tokens, tensors, tuple(ready))


def restore(kv: KVCache, snap: KVSnapshot, keep: int = 0) -> None:
    """Load a snapshot's rows and state back into ``kv`` (onto each layer's home) and its ``n_tokens``.
    The first ``keep`` positions the cache holds already are the snapshot's (a shared prefix): they
    stay and are not written."""
    if not 0 <= keep <= min(kv.n_tokens, snap.n_tokens):
        raise ValueError(f"cannot keep {keep} positions of a cache of {kv.n_tokens} restoring {snap.n_tokens}")
    snap.wait()  # its copies may have been queued on another device's stream
    if keep == 0:
        kv.truncate(0)
    kv.truncate(keep)
    kv.reserve(snap.n_tokens)
    for i, named in snap.tensors.items():
        device = kv._device_tables[kv.home[i]].device
        rows = {name: t[keep:].to(device) for name, t in named.items() if kv._layout[i][name].per_token}
        if rows:
            kv._store(i, torch.arange(keep, snap.n_tokens, device=device), rows)
        for name, t in named.items():
            if not kv._layout[i][name].per_token:
                kv._state[i][name].copy_(t)
    kv.n_tokens = snap.n_tokens
