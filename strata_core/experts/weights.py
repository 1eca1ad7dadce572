"""``ExpertWeights``: the raw gate/up/down blocks of every (layer, expert), zero-copy from the mmap."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from strata_core.gguf.reader import GGUFFile, TensorRef
from strata_core.model.spec import ModelSpec

__all__ = ["ExpertBlocks", "ExpertWeights"]


@dataclass(frozen=True)
class ExpertBlocks:
    """One expert's raw blocks: ``gate``/``up`` hold ``[F, H]``, ``down`` holds ``[H, F]`` (uint8)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType]
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return self.gate.numel() + self.up.numel() + self.down.numel()


class ExpertWeights:
    """Expert tensors of a GGUF file, per layer as (gate, up, down) TensorRefs (none for a layer
    outside ``spec.moe_layers``)."""

    def __init__(self, gguf_file: GGUFFile, spec: ModelSpec):
        self.spec = spec
        self.layers: list[tuple[TensorRef, ...]] = []
        for layer in range(spec.n_layers):
            refs = tuple(gguf_file.tensor(n, s) for n, s in spec.expert_tensors(layer).items())
            self.layers.append(refs)

    def blocks(self, layer: int, expert: int) -> ExpertBlocks:
        """Raw blocks of (layer, expert): views into the mmap, no copy."""
        if not self.layers[layer]:
            raise ValueError(f"layer {layer} has no routed experts (a dense-FFN layer)")
        gate, up, down = self.layers[layer]
        return ExpertBlocks(
            gate=gate.expert_raw(expert), up=up.expert_raw(expert), down=down.expert_raw(expert),
            qtypes=(gate.qtype, up.qtype, down.qtype),
            shapes=(gate.shape[1:], up.shape[1:], down.shape[1:]),  # type: ignore[arg-type]
        )

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert's gate+up+down blocks in ``layer``."""
        return sum(ref.nbytes // ref.shape[0] for ref in self.layers[layer])
