"""``DenseWeights``: every non-expert weight, dequantized to float once at load, movable per layer."""

from __future__ import annotations

import torch

from strata_core.gguf.arch import get_architecture
from strata_core.quant import dequantize
from strata_core.gguf.reader import GGUFFile
from strata_core.gguf.spec import ModelSpec

__all__ = ["DenseWeights"]


class DenseWeights:
    """Dense weights by short name.

    ``globals`` holds ``token_embd.weight``, ``output_norm.weight`` and ``output.weight`` (the
    latter aliases ``token_embd.weight`` for tied embeddings). ``layers[i]`` holds layer i's tensors
    under their names without the ``blk.{i}.`` prefix, e.g. ``layers[3]["attn_q.weight"]``.
    """

    def __init__(self, globals_: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]]):
        self.globals = globals_
        self.layers = layers

    @classmethod
    def load(cls, gguf_file: GGUFFile, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> "DenseWeights":
        """Dequantize the dense tensors of ``gguf_file`` to ``dtype`` on the CPU (a copy, not the mmap)."""
        arch = get_architecture(spec.architecture, gguf_file.path)

        def load_one(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            ref = gguf_file.tensor(name, shape)
            return dequantize(ref.raw(), ref.qtype, ref.shape).reshape(shape).to(dtype).clone()

        globals_ = {n: load_one(n, s) for n, s in arch.global_tensors(spec).items()}
        if spec.tied_embeddings:
            globals_["output.weight"] = globals_["token_embd.weight"]
        layers = []
        for i in range(spec.n_layers):
            prefix = f"blk.{i}."
            layers.append({n.removeprefix(prefix): load_one(n, s) for n, s in arch.layer_tensors(spec, i).items()})
        return cls(globals_, layers)

    def to(self, device: torch.device | str, layers: range | None = None,
           embed: bool | None = None, head: bool | None = None) -> "DenseWeights":
        """Move (in place) ``layers`` (all if None) and optionally the embedding / head to ``device``.

        ``embed`` / ``head`` default to True when ``layers`` is None, else False. Returns self.
        """
        whole = layers is None
        for i in range(len(self.layers)) if whole else layers:
            self.layers[i] = {n: t.to(device) for n, t in self.layers[i].items()}
        if embed if embed is not None else whole:
            self.globals["token_embd.weight"] = self.globals["token_embd.weight"].to(device)
        if head if head is not None else whole:
            self.globals["output_norm.weight"] = self.globals["output_norm.weight"].to(device)
            self.globals["output.weight"] = self.globals["output.weight"].to(device)
        return self

    def device_of(self, layer: int) -> torch.device:
        """The device holding ``layer``'s weights."""
        return self.layers[layer]["attn_norm.weight"].device
