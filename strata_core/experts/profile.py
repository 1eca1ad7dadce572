"""Expert usage profiles: how often each (layer, expert) is routed to, and the fill order they give.

File format (JSON, written by ``strata profile``)::

    {"format": "strata-expert-profile", "version": 1, "model": "<file name>",
     "n_layers": L, "n_experts": E, "tokens": N, "counts": [[c_00, c_01, ...], ...]}

``counts[l][e]`` is the number of (token, top-k) routings of layer ``l`` to expert ``e``.

Fill order (``rank``): by count, highest first; ties broken by (layer, expert) ascending.
Default order without a profile (``default_order``): round-robin over layers by expert id,
``(0,0), (1,0), ..., (L-1,0), (0,1), ...`` so every layer gets the same share of the cache.
Both orders cover only the layers given (a model's MoE layers: a dense-FFN layer has no experts).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from strata_core.errors import ConfigError

__all__ = ["UsageCounter", "UsageProfile", "default_order", "PROFILE_FORMAT"]

PROFILE_FORMAT = "strata-expert-profile"
PROFILE_VERSION = 1


@dataclass
class UsageProfile:
    """Routing counts ``[n_layers, n_experts]`` (int64) over ``tokens`` prompt tokens."""

    counts: torch.Tensor
    tokens: int = 0
    model: str = ""

    @classmethod
    def empty(cls, n_layers: int, n_experts: int, model: str = "") -> "UsageProfile":
        return cls(torch.zeros((n_layers, n_experts), dtype=torch.int64), 0, model)

    def rank(self, only_used: bool = False, layers: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """(layer, expert) by count descending, ties by (layer, expert); ``only_used`` drops zeros;
        ``layers`` (all if None) keeps only those layers' entries."""
        n_layers, n_experts = self.counts.shape
        flat = self.counts.flatten()  # [L*E], index = layer * E + expert
        # stable sort of -count keeps index order among ties
        order = torch.sort(-flat, stable=True).indices
        if only_used:
            order = order[flat[order] > 0]
        if layers is not None:
            keep = torch.zeros(n_layers, dtype=torch.bool)
            keep[list(layers)] = True
            order = order[keep[order // n_experts]]
        return [(int(i) // n_experts, int(i) % n_experts) for i in order]

    def save(self, path: str | os.PathLike[str]) -> None:
        n_layers, n_experts = self.counts.shape
        doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": self.model,
               "n_layers": n_layers, "n_experts": n_experts, "tokens": self.tokens,
               "counts": self.counts.tolist()}
        with open(path, "w") as f:
            json.dump(doc, f)

    @classmethod
    def load(cls, path: str | os.PathLike[str], n_layers: int, n_experts: int) -> "UsageProfile":
        """Read a profile and check it matches the model's shape; ConfigError names what is wrong."""
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--expert-profile {path}: cannot read ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ConfigError(f"--expert-profile {path}: not a Strata expert profile")
        counts = torch.tensor(doc.get("counts", []), dtype=torch.int64)
        if tuple(counts.shape) != (n_layers, n_experts):
            raise ConfigError(f"--expert-profile {path}: counts are {tuple(counts.shape)}, the model "
                              f"has {n_layers} layers x {n_experts} experts")
        if bool((counts < 0).any()):
            raise ConfigError(f"--expert-profile {path}: negative counts")
        return cls(counts, int(doc.get("tokens", 0)), str(doc.get("model", "")))


class UsageCounter:
    """Routing counts accumulated on the computing device (no host read until ``profile()``)."""

    def __init__(self, n_layers: int, n_experts: int, device: torch.device, first_layer: int = 0):
        self.counts = torch.zeros((n_layers, n_experts), dtype=torch.int64, device=device)  # [L, E]
        self.tokens = 0
        self.first_layer = first_layer  # the first MoE layer: its routings count the tokens
        self._ones: dict[int, torch.Tensor] = {}  # ``count``'s addends of one, by pair count

    def add(self, layer: int, expert_ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """Count the routings ``expert_ids [T, k]`` of ``layer`` (only the first ``live`` pairs where given: int64
        ``[1]`` on the device, the rest pad a graphed pass); returns their counts ``[E]`` on the device (no host
        read; a CUDA ``bincount`` would read three times)."""
        flat = expert_ids.reshape(-1)  # [T*k]
        ones = torch.ones_like(flat) if live is None else (torch.arange(flat.numel(), device=flat.device) < live).long()
        counted = self.counts.new_zeros(self.counts.shape[1]).index_add_(0, flat, ones.to(self.counts.dtype))  # [E]
        self.row(layer, expert_ids.shape[0]).add_(counted)
        return counted

    def count(self, layer: int, flat: torch.Tensor, n_tokens: int) -> None:
        """Count the routings ``flat [T*k]`` of ``n_tokens`` tokens of ``layer`` in place (``add`` without
        its per-call counts: one op)."""
        ones = self._ones.get(flat.numel())
        if ones is None or ones.device != flat.device or ones.dtype != flat.dtype:
            ones = self._ones[flat.numel()] = torch.ones_like(flat)  # made once per pair count (read only)
        self.row(layer, n_tokens).index_add_(0, flat, ones)

    def row(self, layer: int, n_tokens: int) -> torch.Tensor:
        """The counts ``[E]`` of ``layer``, for the caller to add the routings of ``n_tokens`` tokens to
        (in place, on the device)."""
        if layer == self.first_layer:
            self.tokens += n_tokens
        return self.counts[layer]

    def profile(self, model: str = "") -> UsageProfile:
        return UsageProfile(self.counts.to("cpu", copy=True), self.tokens, model)


def default_order(n_layers: int, n_experts: int, layers: Iterable[int] | None = None) -> list[tuple[int, int]]:
    """The fill order without a profile: round-robin over ``layers`` (all if None) by expert id."""
    layers = list(range(n_layers) if layers is None else layers)
    return [(layer, expert) for expert in range(n_experts) for layer in layers]
