"""The arena: every expert's gate/up/down blocks in host memory, and how one expert is packed.

``--arena mmap`` addresses the experts as zero-copy views of the memory-mapped GGUF. ``--arena
pinned`` copies them, layer by layer, into page-locked buffers (host_region.py: filled, then registered
with CUDA) laid out ``[n_experts, packed]``
(gate|up|down back to back, one DMA per expert) until ``--pin-limit-gib`` is reached. A pinned
layer is one contiguous buffer, so expert e of it starts at ``base + e * total``: a device kernel
can address any expert of the layer from the base pointer and the stride alone (the decode gather,
see gather.py). The layers past the cap stay mmap views and are moved through pinned staging
buffers (see transfer.py). Every buffer is allocated first, then filled by a pool of threads (fill.py),
then registered; the log says the fill rate and the time of each step.
Without an accelerator the "pinned" copy is ordinary RAM (page-locking needs a device driver).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from tqdm import tqdm

from strata_core.experts.fill import FillReport, configure_pinned_allocator, default_threads, fill_packed
from strata_core.experts.host_region import HostRegion, transparent_huge_pages
from strata_core.experts.weights import ExpertBlocks, ExpertWeights
from strata_core.runtime.numa import interleave, placement_nodes

__all__ = ["Arena", "ExpertFormat", "GIB", "can_pin"]

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class ExpertFormat:
    """How one layer's experts are stored: block types, shapes and byte sizes of gate/up/down."""

    qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType]
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    nbytes: tuple[int, int, int]

    @classmethod
    def of(cls, blocks: ExpertBlocks) -> "ExpertFormat":
        return cls(blocks.qtypes, blocks.shapes, (blocks.gate.numel(), blocks.up.numel(), blocks.down.numel()))

    @property
    def total(self) -> int:
        """Bytes of one packed expert (gate|up|down)."""
        return sum(self.nbytes)

    def split(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (gate, up, down) of packed uint8 bytes along the last dim: ``[..., >= total]``
        (one expert, or ``[P, total]`` gathered experts) -> ``[..., g]``, ``[..., u]``, ``[..., d]``."""
        g, u, d = self.nbytes
        return packed[..., :g], packed[..., g:g + u], packed[..., g + u:g + u + d]


def can_pin() -> bool:
    """Whether page-locked host memory is available (an accelerator driver is loaded)."""
    return torch.cuda.is_available()


class Arena:
    """Host addresses of every (layer, expert): mmap views, or pinned packed copies up to a cap."""

    def __init__(self, weights: ExpertWeights, n_layers: int, n_experts: int, mode: str = "mmap",
                 pin_limit_bytes: int | None = None, progress: Callable[[float], None] | None = None,
                 layers: Collection[int] | None = None):
        """``layers``: the layers this process computes or caches (None: every layer); only they are
        pinned (another rank holds the rest)."""
        self.weights = weights
        self.n_layers, self.n_experts = n_layers, n_experts
        self.moe_layers = weights.spec.moe_layers  # the layers with experts; the others' formats are None
        self._own = [layer for layer in self.moe_layers if layers is None or layer in layers]
        self.formats: list[ExpertFormat | None] = [
            ExpertFormat.of(weights.blocks(layer, 0)) if layer in self.moe_layers else None for layer in range(n_layers)]
        moe_formats = [f for f in self.formats if f is not None]
        self.slot_bytes = max(f.total for f in moe_formats)  # one slot fits any layer's expert
        self.total_bytes = sum(f.total for f in moe_formats) * n_experts
        self._packed: list[torch.Tensor | None] = [None] * n_layers  # [E, packed] per pinned layer
        self._regions: list[HostRegion] = []  # the page-locked memory of the pinned layers (with an accelerator)
        if mode == "pinned":
            self._pin(pin_limit_bytes, progress or (lambda fraction: None))
        log.info("arena: %s, %.2f GiB of experts (%d layers x %d), %.2f GiB pinned", mode,
                 self.total_bytes / GIB, len(self.moe_layers), n_experts, self.pinned_bytes / GIB)

    def _pin(self, limit: int | None, progress: Callable[[float], None]) -> None:
        pin = can_pin()
        if not pin:
            log.info("arena: no accelerator, the pinned arena is ordinary RAM")
        budget = self.total_bytes if limit is None else limit
        layers = []  # the leading layers that fit the budget
        for layer in self._own:
            size = self.formats[layer].total * self.n_experts
            if size > budget:
                log.info("arena: pin limit reached at layer %d; layers %d.. stream through staging", layer, layer)
                break
            layers.append(layer)
            budget -= size
        if not layers:
            return
        if pin:
            configure_pinned_allocator()
        nbytes = sum(self.formats[layer].total * self.n_experts for layer in layers)
        start = time.perf_counter()
        for layer in layers:  # every buffer before the copy
            shape = (self.n_experts, self.formats[layer].total)
            if pin:  # page-locked once filled: the fill's threads fault its (huge) pages in
                self._regions.append(HostRegion(shape[0] * shape[1]))
                self._packed[layer] = self._regions[-1].tensor.view(shape)
            else:  # ordinary RAM the CPU computes from: its pages over every node, before the fill
                self._packed[layer] = torch.empty(shape, dtype=torch.uint8)
                interleave(self._packed[layer], placement_nodes(), f"arena layer {layer}")
        allocate_s = time.perf_counter() - start
        done = [0]
        with tqdm(total=nbytes, unit="B", unit_scale=True, desc="pinning experts", leave=False,
                  disable=self.total_bytes < GIB) as bar:

            def filled(n: int) -> None:
                done[0] += n
                bar.update(n)
                progress(done[0] / nbytes)

            threads = default_threads()
            copy_s = fill_packed([run for layer in layers for run in self._runs(layer)], threads, filled)
        log.info(FillReport(nbytes, threads, allocate_s, copy_s, self._register(layers) if pin else None).message())

    def _register(self, layers: list[int]) -> float:
        """Page-lock the filled regions of ``layers``; where CUDA refuses, copy each layer into a buffer of
        torch's pinned allocator instead (logged). Returns the seconds it took."""
        start = time.perf_counter()
        try:
            for region in self._regions:
                region.register()
            if self._regions:
                log.info("arena: %d buffers page-locked once filled (transparent huge pages: %s)", len(self._regions),
                         transparent_huge_pages() if all(r.huge_pages for r in self._regions) else "not asked")
        except RuntimeError as err:
            log.warning("arena: %s; the layers are copied into torch's pinned buffers instead", err)
            for layer, region in zip(layers, self._regions):
                region.close()
                self._packed[layer] = self._packed[layer].pin_memory()
            self._regions.clear()
        return time.perf_counter() - start

    def _runs(self, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The copies that fill ``layer``'s packed buffer: per part (gate, up, down), the layer's
        ``[E, part bytes]`` tensor of the file onto its column range of ``[E, total]``."""
        buf = self._packed[layer].numpy()
        return [(dst, ref.data.reshape(self.n_experts, -1))
                for dst, ref in zip(self.formats[layer].split(buf), self.weights.layers[layer])]

    @property
    def pinned_bytes(self) -> int:
        return sum(p.numel() for p in self._packed if p is not None)

    @property
    def all_pinned(self) -> bool:
        """Whether every MoE layer of this process is a pinned packed buffer (what the decode gather needs)."""
        return all(self._packed[layer] is not None for layer in self._own)

    def layer_buffer(self, layer: int) -> torch.Tensor | None:
        """The pinned packed experts ``[n_experts, total]`` of ``layer`` (contiguous), or None if not pinned."""
        return self._packed[layer]

    def packed(self, layer: int, expert: int) -> torch.Tensor | None:
        """The pinned packed bytes ``[total]`` of (layer, expert), or None if that layer is not pinned."""
        buf = self._packed[layer]
        return None if buf is None else buf[expert]

    def parts(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host (gate, up, down) uint8 blocks of (layer, expert): pinned views or mmap views."""
        buf = self._packed[layer]
        if buf is not None:
            return self.formats[layer].split(buf[expert])
        b = self.weights.blocks(layer, expert)
        return b.gate, b.up, b.down

    def pack_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        """Copy (layer, expert) packed into ``dst`` (a host or device uint8 buffer, blocking)."""
        for part, src in zip(self.formats[layer].split(dst), self.parts(layer, expert)):
            part.copy_(src)
