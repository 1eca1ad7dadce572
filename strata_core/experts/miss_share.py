"""``MissShare``: how a device slot's misses divide between the host link and the CPU, and the CPU's part of them.

A decode layer's misses go over the host link (a ``--pcie-frac`` share, fixed in ``split`` or learned per
layer by ``auto``, split_auto.py) or are computed on the CPU from the arena where they lie, on the CPU pool's
worker thread when the device is a GPU (so the GPU works on its share meanwhile). A prompt chunk of at most
``cpu_prompt_tokens`` tokens (measured at load, prompt_split.py) divides its misses as the same device slot's
decode divides the layer's (``follow``); longer chunks stream every miss. Which side computes a miss never
changes its rows: each is computed once, by the arithmetic every expert path shares.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import torch

from strata_core.ops.cpu_kernels import has_cpu_kernel  # before experts.cpu_ffn, which the ops package imports
from strata_core.experts.cpu_ffn import cpu_experts_ffn
from strata_core.experts.ffn import ExpertFFN
from strata_core.experts.rows import expert_ffn
from strata_core.experts.split import MissSplit

if TYPE_CHECKING:
    from strata_core.experts.arena import Arena
    from strata_core.experts.chain import Chain
    from strata_core.experts.split_auto import AutoSplit

__all__ = ["MissShare", "segments"]


class MissShare:
    """The link / CPU division of one device slot's misses in one phase (``chains``: its layers' sources).

    ``split``: the fixed ``--pcie-frac`` share; ``auto``: the per-layer split ``--pcie-frac auto`` learns, in
    place of ``split``, timed as the misses are computed; ``cpu_pool``: the worker computing the CPU's part
    (None: computed on the calling thread, a CPU device's own)."""

    def __init__(self, chains: dict[int, Chain], arena: Arena, split: MissSplit, cpu_pool: Executor | None = None,
                 auto: AutoSplit | None = None):
        self.chains, self.arena, self.split, self.cpu_pool, self.auto = chains, arena, split, cpu_pool, auto
        #: a prompt chunk of at most this many tokens divides its misses as ``_decode`` divides the layer's (0: never)
        self.cpu_prompt_tokens = 0
        self._decode: MissShare | None = None  # the same device slot's decode share, which prompt chunks follow

    def follow(self, tokens: int, decode: MissShare) -> None:
        """Let prompt chunks of at most ``tokens`` tokens divide their misses as ``decode`` (the same device
        slot's decode share) divides them, at the layers it divides."""
        self.cpu_prompt_tokens, self._decode = tokens, decode

    def miss_split(self, layer: int) -> MissSplit | None:
        """The split of ``layer``'s decode misses between the host link and the CPU: learned per layer
        (``auto``) or fixed (``split``); None where this device does not compute the layer or its chain
        lacks one of the two."""
        chain = self.chains.get(layer)
        if chain is None or not (chain.link and chain.cpu):
            return None
        return self.split if self.auto is None else self.auto.split(layer)

    def split_now(self, layer: int, n_tokens: int, decoding: bool) -> MissSplit | None:
        """The split of ``layer``'s misses of ``n_tokens`` tokens now, None where they all go over the link: a
        decode window's by ``miss_split``; a prompt chunk of at most ``cpu_prompt_tokens`` tokens by the same
        device slot's decode split of the layer."""
        if decoding:
            return self.miss_split(layer)
        if self._decode is None or n_tokens > self.cpu_prompt_tokens:
            return None
        return self._decode.miss_split(layer)

    def link_share(self, layer: int, n_missed: int, n_tokens: int, decoding: bool) -> int:
        """How many of ``layer``'s ``n_missed`` misses (of ``n_tokens`` tokens) go over the host link (the rest
        to the CPU)."""
        chain = self.chains[layer]
        if not chain.cpu:
            return n_missed
        if not chain.link:
            return 0
        split = self.split_now(layer, n_tokens, decoding)
        return n_missed if split is None else split.take(n_missed)

    def submit(self, layer: int, experts: list[int], groups: dict[int, tuple[int, int]], order: torch.Tensor,
               k: int, hidden: torch.Tensor, ffn: ExpertFFN, decoding: bool) -> list[tuple[torch.Tensor, Future]]:
        """Start the CPU rows of ``experts`` (``groups``: each one's span of the layer's pairs ``order``, token
        ``pair // k`` of ``hidden``) from the arena, read in place; returns (pairs, future rows) per expert, or
        one entry for them all where the CPU kernels cover the formats (one call a layer)."""
        fmt = self.arena.formats[layer]
        if experts and has_cpu_kernel(fmt.qtypes, fmt.shapes):
            pairs, counts = segments(experts, groups, order)
            parts = [self.arena.parts(layer, e) for e in experts]
            job = self._timed(layer, len(experts), cpu_experts_ffn, decoding)
            return [(pairs, self._on_cpu(job, hidden[pairs // k].cpu(), parts, counts, fmt.qtypes, fmt.shapes, ffn,
                                         experts))]
        jobs = []
        for expert in experts:
            pairs = order[groups[expert][0]:groups[expert][1]]  # [n]
            job = self._timed(layer, 1, expert_ffn, decoding)
            jobs.append((pairs, self._on_cpu(job, hidden[pairs // k].cpu(), *self.arena.parts(layer, expert),
                                             fmt.qtypes, fmt.shapes, ffn, expert)))
        return jobs

    def _timed(self, layer: int, n_experts: int, fn: Callable[..., torch.Tensor],
               decoding: bool) -> Callable[..., torch.Tensor]:
        """``fn`` as the CPU share of ``layer``'s decode misses: timed for ``--pcie-frac auto`` while it learns."""
        return self.auto.cpu_job(layer, n_experts, fn) if self.auto is not None and decoding else fn

    def _on_cpu(self, fn: Callable[..., torch.Tensor], *args) -> Future:
        """``fn(*args)`` on the CPU pool's worker (a GPU device), else now."""
        if self.cpu_pool is not None:
            return self.cpu_pool.submit(fn, *args)
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


def segments(experts: list[int], groups: dict[int, tuple[int, int]],
             order: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The pairs of ``experts`` (their spans ``groups`` of ``order``) one after another, and how many each."""
    pairs = torch.cat([order[groups[e][0]:groups[e][1]] for e in experts])  # [n]
    return pairs, [groups[e][1] - groups[e][0] for e in experts]
