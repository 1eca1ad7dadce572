"""``KVCache``: one sequence's per-layer session state, preallocated for ``max_tokens`` positions.

Each layer keeps the named tensors its ``ModelSpec.layer_state`` declares: *rows* (``per_token``:
``[max_tokens, ...]``, row i = position i; K and V, an MLA latent) and *recurrent state* (a fixed
shape updated in place; a linear-attention layer's convolution and ssm state).

A cache may hold only some layers; the layers of one cache may sit on different device slots. Each
layer has a *home* slot (where compute reads and writes it now); a hand-off (``move``) copies the
committed rows and the whole recurrent state to another slot and parks the old tensors there for the
way back, so a session that goes back and forth between a prompt and a decode placement allocates
each tensor once. Compute writes rows at the positions it computes (and updates recurrent state);
the caller commits them with ``advance`` once every layer has run, so ``n_tokens`` is the number of
positions all layers hold. Recurrent state cannot be rewound: ``truncate`` to a shorter non-zero
length is refused for a cache that holds any (``can_truncate``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from strata_core.model.spec import StateTensor

__all__ = ["KVCache", "KVSnapshot", "StateTensor"]

LayerTensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class KVSnapshot:
    """A host copy of the first ``n_tokens`` rows (and the recurrent state) of some layers."""

    n_tokens: int
    tensors: dict[int, LayerTensors]  # layer -> name -> rows [n_tokens, ...] or the whole state

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.numel() * t.element_size() for named in self.tensors.values() for t in named.values())


class KVCache:
    """Per-layer named state tensors for the layers in ``layers`` (``layout``: layer -> name -> StateTensor)."""

    def __init__(self, layers: range, max_tokens: int, layout: Mapping[int, Mapping[str, StateTensor]],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 homes: dict[int, tuple[int, torch.device]] | None = None):
        self.layers = layers
        self.max_tokens = max_tokens
        self.n_tokens = 0
        self._layout = {i: dict(layout[i]) for i in layers}
        self._dtype = dtype
        self.can_truncate = all(t.per_token for i in layers for t in self._layout[i].values())
        homes = homes or {i: (0, torch.device(device)) for i in layers}
        self.home = {i: homes[i][0] for i in layers}  # layer -> device slot holding it now
        self.tensors: dict[int, LayerTensors] = {i: self._new(i, homes[i][1]) for i in layers}
        self._parked: dict[tuple[int, int], LayerTensors] = {}  # (layer, slot) -> tensors left there
        #: bumped whenever ``tensors`` changes (a move, a release): what caches of their addresses check
        self.version = 0

    def _new(self, layer: int, device: torch.device | str) -> LayerTensors:
        return {name: torch.zeros((self.max_tokens, *t.shape) if t.per_token else t.shape,
                                  device=device, dtype=t.dtype or self._dtype)
                for name, t in self._layout[layer].items()}

    def _committed(self, layer: int, name: str, tensor: torch.Tensor, n: int) -> torch.Tensor:
        """What holds information of ``tensor``: its first ``n`` rows, or all of a recurrent state."""
        return tensor[:n] if self._layout[layer][name].per_token else tensor

    @classmethod
    def for_spec(cls, spec, max_tokens: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, layers: range | None = None,
                 homes: dict[int, tuple[int, torch.device]] | None = None) -> "KVCache":
        """A cache for ``spec`` (a ModelSpec: ``layer_state`` gives each layer's tensors) holding
        ``layers`` (all if None), each layer on its ``homes`` entry (device slot, torch device) if
        given, else on ``device`` as slot 0."""
        layers = layers if layers is not None else range(spec.n_layers)
        return cls(layers, max_tokens, {i: spec.layer_state(i) for i in layers}, device, dtype, homes)

    def write(self, layer: int, positions: torch.Tensor, **rows: torch.Tensor) -> None:
        """Store each named row tensor ``[T, ...]`` at ``positions [T]`` of ``layer`` (``k=..., v=...``)."""
        for name, value in rows.items():
            target = self.tensors[layer][name]
            target[positions] = value.to(target.dtype)

    def read(self, layer: int, n: int, *names: str) -> tuple[torch.Tensor, ...]:
        """Views of positions ``[0, n)`` of ``layer``'s rows ``names`` (default ``"k", "v"``)."""
        named = self.tensors[layer]
        return tuple(named[name][:n] for name in (names or ("k", "v")))

    def state(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s recurrent state ``name`` (compute updates it in place)."""
        return self.tensors[layer][name]

    def recurrent(self, layer: int) -> LayerTensors:
        """``layer``'s fixed-size recurrent state tensors by name (none for a layer of rows only)."""
        return {name: t for name, t in self.tensors[layer].items() if not self._layout[layer][name].per_token}

    def advance(self, n: int) -> None:
        """Commit ``n`` more positions (after every layer has written them)."""
        if self.n_tokens + n > self.max_tokens:
            raise ValueError(f"KV cache overflow: {self.n_tokens} + {n} > {self.max_tokens} tokens")
        self.n_tokens += n

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (rows are overwritten by the next write). ``truncate(0)`` also
        zeroes recurrent state; a shorter non-zero length is a ValueError when recurrent state is held."""
        if n >= self.n_tokens:
            return
        if n == 0:
            for i in self.layers:
                for name, tensor in self.tensors[i].items():
                    if not self._layout[i][name].per_token:
                        tensor.zero_()
        elif not self.can_truncate:
            raise ValueError(f"cannot rewind recurrent state from {self.n_tokens} to {n} positions")
        self.n_tokens = n

    def release(self) -> None:
        """Drop the tensors (their memory returns to the allocator); the cache is empty after."""
        self.n_tokens = 0
        self.tensors.clear()
        self._parked.clear()
        self.version += 1

    def move(self, layers: range, slot: int, device: torch.device | str) -> None:
        """Hand-off: make device slot ``slot`` (on ``device``) the home of ``layers``, copying the
        committed rows and the recurrent state device to device (no host round trip); the old
        tensors are parked."""
        n = self.n_tokens
        for i in layers:
            if self.home[i] == slot:
                continue
            self._parked[(i, self.home[i])] = self.tensors[i]
            moved = self._parked.pop((i, slot), None) or self._new(i, device)
            for name, source in self.tensors[i].items():
                self._committed(i, name, moved[name], n).copy_(self._committed(i, name, source, n),
                                                               non_blocking=True)
            self.tensors[i], self.home[i] = moved, slot
            self.version += 1

    def parked(self, layer: int, slot: int) -> LayerTensors | None:
        """The tensors of ``layer`` left on ``slot`` by a hand-off (what ``STRATA_DBG_HANDOFF`` compares)."""
        return self._parked.get((layer, slot))

    def committed(self, layer: int, tensors: LayerTensors | None = None) -> LayerTensors:
        """Views of what ``layer`` holds now: its committed rows and its whole recurrent state (of
        ``tensors``, e.g. a parked set, instead of the live ones if given)."""
        named = self.tensors[layer] if tensors is None else tensors
        return {name: self._committed(layer, name, t, self.n_tokens) for name, t in named.items()}

    def snapshot(self, layers: range | None = None) -> KVSnapshot:
        """Copy the committed rows and the recurrent state of ``layers`` (all if None) to host memory."""
        return KVSnapshot(self.n_tokens, {i: {name: t.to("cpu", copy=True) for name, t in self.committed(i).items()}
                                          for i in (self.layers if layers is None else layers)})

    def restore(self, snap: KVSnapshot) -> None:
        """Load a snapshot's rows and state back (onto each layer's current device) and its ``n_tokens``."""
        self.n_tokens = snap.n_tokens
        for i, named in snap.tensors.items():
            for name, target in self.committed(i).items():
                target.copy_(named[name])
