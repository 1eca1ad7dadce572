"""``KVCache``: one sequence's per-layer K/V, preallocated for ``max_tokens``, slot i = position i.

A cache may hold only some layers; the layers of one cache may sit on different device slots. Each
layer has a *home* slot (where compute reads and writes it now); a hand-off (``move``) copies the
committed rows to another slot and parks the old tensors there for the way back, so a session that
goes back and forth between a prompt and a decode placement allocates each tensor once.
``attention`` writes K/V at the token positions it computes; the caller commits them with
``advance`` once every layer has run, so ``n_tokens`` is the number of positions all layers hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVCache", "KVSnapshot"]


@dataclass(frozen=True)
class KVSnapshot:
    """A host copy of the first ``n_tokens`` K/V rows of some layers (for a conversation cache)."""

    n_tokens: int
    k: dict[int, torch.Tensor]  # layer -> [n_tokens, n_kv_heads, head_dim]
    v: dict[int, torch.Tensor]


class KVCache:
    """Per-layer K/V tensors ``[max_tokens, n_kv_heads, head_dim]`` for the layers in ``layers``."""

    def __init__(self, layers: range, max_tokens: int, n_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 homes: dict[int, tuple[int, torch.device]] | None = None):
        self.layers = layers
        self.max_tokens = max_tokens
        self.n_tokens = 0
        self._shape, self._dtype = (max_tokens, n_kv_heads, head_dim), dtype
        homes = homes or {i: (0, torch.device(device)) for i in layers}
        self.home = {i: homes[i][0] for i in layers}  # layer -> device slot holding it now
        self.k = {i: self._new(homes[i][1]) for i in layers}
        self.v = {i: self._new(homes[i][1]) for i in layers}
        self._parked: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, slot) -> (k, v)

    def _new(self, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self._shape, device=device, dtype=self._dtype)

    @classmethod
    def for_spec(cls, spec, max_tokens: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, layers: range | None = None,
                 homes: dict[int, tuple[int, torch.device]] | None = None) -> "KVCache":
        """A cache for ``spec`` (a ModelSpec) holding ``layers`` (all if None), each layer on its
        ``homes`` entry (device slot, torch device) if given, else on ``device`` as slot 0."""
        return cls(layers if layers is not None else range(spec.n_layers), max_tokens,
                   spec.n_kv_heads, spec.head_dim, device, dtype, homes)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [T, n_kv_heads, head_dim]`` at ``positions [T]`` of ``layer``."""
        self.k[layer][positions] = k.to(self.k[layer].dtype)
        self.v[layer][positions] = v.to(self.v[layer].dtype)

    def read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of positions ``[0, n)`` of ``layer``: ``(k, v)`` each ``[n, n_kv_heads, head_dim]``."""
        return self.k[layer][:n], self.v[layer][:n]

    def advance(self, n: int) -> None:
        """Commit ``n`` more positions (after every layer has written them)."""
        if self.n_tokens + n > self.max_tokens:
            raise ValueError(f"KV cache overflow: {self.n_tokens} + {n} > {self.max_tokens} tokens")
        self.n_tokens += n

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (rows are overwritten by the next write)."""
        self.n_tokens = min(self.n_tokens, n)

    def release(self) -> None:
        """Drop the K/V tensors (their memory returns to the allocator); the cache is empty after."""
        self.n_tokens = 0
        self.k.clear()
        self.v.clear()
        self._parked.clear()

    def move(self, layers: range, slot: int, device: torch.device | str) -> None:
        """Hand-off: make device slot ``slot`` (on ``device``) the home of ``layers``, copying the
        committed rows device to device (no host round trip); the old tensors are parked."""
        n = self.n_tokens
        for i in layers:
            if self.home[i] == slot:
                continue
            self._parked[(i, self.home[i])] = (self.k[i], self.v[i])
            k, v = self._parked.pop((i, slot), None) or (self._new(device), self._new(device))
            k[:n].copy_(self.k[i][:n], non_blocking=True)
            v[:n].copy_(self.v[i][:n], non_blocking=True)
            self.k[i], self.v[i], self.home[i] = k, v, slot

    def parked(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tensors of ``layer`` left on ``slot`` by a hand-off (what ``STRATA_DBG_HANDOFF`` compares)."""
        return self._parked.get((layer, slot))

    def snapshot(self, layers: range | None = None) -> KVSnapshot:
        """Copy the committed rows of ``layers`` (all if None) to host memory."""
        n, ls = self.n_tokens, self.layers if layers is None else layers
        return KVSnapshot(n, {i: self.k[i][:n].to("cpu", copy=True) for i in ls},
                          {i: self.v[i][:n].to("cpu", copy=True) for i in ls})

    def restore(self, snap: KVSnapshot) -> None:
        """Load a snapshot's rows back (onto each layer's current device) and its ``n_tokens``."""
        n = snap.n_tokens
        for i in snap.k:
            self.k[i][:n].copy_(snap.k[i])
            self.v[i][:n].copy_(snap.v[i])
        self.n_tokens = n
