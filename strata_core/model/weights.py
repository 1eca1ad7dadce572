"""``DenseWeights``: every non-expert weight, dequantized to float once at load, placed per layer.

A layer may be placed on several devices (a prompt placement computing it on one device, a decode
placement on another); each device holds its own copy.
"""

from __future__ import annotations

import torch

from strata_core.errors import ConfigError
from strata_core.gguf.arch import get_architecture
from strata_core.quant import dequantize
from strata_core.gguf.reader import GGUFFile
from strata_core.gguf.spec import ModelSpec

__all__ = ["DenseWeights"]


class DenseWeights:
    """Dense weights by short name.

    ``globals`` holds ``token_embd.weight``, ``output_norm.weight`` and ``output.weight`` (the
    latter aliases ``token_embd.weight`` for tied embeddings). ``at(i, device)`` holds layer i's
    tensors on ``device`` under their names without the ``blk.{i}.`` prefix, e.g.
    ``at(3, "cpu")["attn_q.weight"]``. Loaded weights sit on the CPU until ``place``d.
    """

    def __init__(self, globals_: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]]):
        self.globals = globals_
        self.n_layers = len(layers)
        cpu = torch.device("cpu")
        self._copies: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {
            (i, cpu): tensors for i, tensors in enumerate(layers)}

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

    def at(self, layer: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors on ``device`` (placed there by ``place``)."""
        try:
            return self._copies[(layer, torch.device(device))]
        except KeyError:
            raise ConfigError(f"layer {layer}'s dense weights are not placed on {device}") from None

    def place(self, placements: dict[int, set[torch.device]], globals_device: torch.device | str) -> "DenseWeights":
        """Put a copy of each layer on each of its devices (``placements``: layer -> devices) and the
        embedding and head on ``globals_device``; copies no longer needed are freed. Returns self."""
        cpu = torch.device("cpu")
        for layer, devices in placements.items():
            host = self._copies[(layer, cpu)]
            for device in devices:
                self._copies.setdefault((layer, torch.device(device)), {n: t.to(device) for n, t in host.items()})
            if cpu not in {torch.device(d) for d in devices}:
                del self._copies[(layer, cpu)]
        moved: dict[int, torch.Tensor] = {}  # tied embeddings stay one tensor
        for name, tensor in self.globals.items():
            self.globals[name] = moved.setdefault(id(tensor), tensor.to(globals_device))
        return self
