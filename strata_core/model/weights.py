"""``DenseWeights``: every non-expert weight, dequantized to float once at load, placed per layer.

A layer may be placed on several devices (a prompt placement computing it on one device, a decode
placement on another); each device holds its own copy.

Where the GGUF stores a dense matrix as Q8_0, a device may also hold it repacked for
``strata::q8_linear`` (:class:`~strata_core.ops.dense_q8.Q8Matrix`, ~half the bytes of bf16): the
decode products read those (model/fused_decode.py: a decode token reads every dense weight once, so
fewer bytes are a faster step), everything else the float copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.errors import ConfigError
from strata_core.ops.dense_q8 import Q8Matrix, q8_bytes, q8_linear, repack_q8_0
from strata_core.ops.matmul import invariant_rows, linear
from strata_core.gguf.reader import GGUFFile, TensorRef
from strata_core.model.spec import ModelSpec
from strata_core.quant import dequantize

__all__ = ["QKV_NAMES", "DenseWeights", "Q8Sources", "dense_product", "load_dense", "q8_sources"]

#: the attention projections ``DenseWeights.qkv`` fuses into one matrix, in its row order
QKV_NAMES = ("attn_q", "attn_k", "attn_v")

#: Q8_0 matrices by (layer, name); layer None: a global tensor (``output.weight``)
Q8Sources = dict[tuple[int | None, str], TensorRef]

#: Most rows of x a product reads from a Q8_0 copy (``strata::q8_linear``: the gemv kernel for one row,
#: the rows kernel, which reads each W tile once for 16 rows, from two), more the float copy (cuBLAS).
#: Two rows or more read the copy only for a matrix of at least :data:`Q8_ROWS_MIN_VALUES` values.
#: Measured with tools/gemv_bench.py in CUDA graphs on an H100 (BENCHMARKS.md, "Dense decode products"):
#: the rows kernel beats cuBLAS's bf16 product on the head [151936, 2048] by 1.33-1.48x from 2 to 16 rows
#: and loses at 32 (two x tiles); on QKV, the attention output and the router it ties or loses from two
#: rows on, so those keep cuBLAS.
Q8_MAX_ROWS = 16
#: Fewest values of a matrix whose products of 2 to :data:`Q8_MAX_ROWS` rows read its Q8_0 copy
Q8_ROWS_MIN_VALUES = 1 << 26


def reads_q8(rows: int, q8: Q8Matrix) -> bool:
    """Whether a product of ``rows`` rows of x reads ``q8`` rather than the float copy (the rule above:
    shapes alone, so a captured decode window always takes the same kernels)."""
    return rows == 1 or (1 < rows <= Q8_MAX_ROWS and q8.codes.numel() >= Q8_ROWS_MIN_VALUES)


def dense_product(x: torch.Tensor, weight: torch.Tensor, q8: Q8Matrix | None,
                  batch_invariant: bool = False) -> torch.Tensor:
    """``x [..., in] @ weight.T``: from ``q8`` (the same matrix's Q8_0 copy, ``strata::q8_linear``) for
    the row counts :func:`reads_q8` gives it, else from ``weight`` (``linear``). ``batch_invariant``: each
    row's result is the same whatever the other rows (on CUDA the float copy, rows padded:
    ``invariant_rows``; on the CPU ``linear`` is so already)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if batch_invariant and x.device.type == "cuda" and rows:
        with invariant_rows():
            return linear(x, weight)
    if q8 is not None and rows and reads_q8(rows, q8):
        out = q8_linear(x.reshape(rows, x.shape[-1]), q8.codes, q8.scales)  # [rows, out]
        return out.reshape(*x.shape[:-1], q8.shape[0])
    return linear(x, weight)


def q8_sources(gguf_file: GGUFFile, spec: ModelSpec, layer_names: Iterable[str],
               global_names: Iterable[str]) -> Q8Sources:
    """The tensors of ``layer_names`` (in every layer) and ``global_names`` that ``gguf_file`` stores as
    2-D Q8_0 matrices (a tied ``output.weight``: ``token_embd.weight``'s blocks)."""
    found: Q8Sources = {}
    wanted = [(None, n, n, spec.global_tensors()) for n in global_names]
    wanted += [(i, n, f"blk.{i}.{n}", spec.layer_tensors(i)) for i in range(spec.n_layers) for n in layer_names]
    for layer, name, full, tensors in wanted:
        if name == "output.weight" and spec.tied_embeddings:
            full = "token_embd.weight"
        if full in tensors and len(tensors[full]) == 2:
            ref = gguf_file.tensor(full, tensors[full])
            if ref.qtype == T.Q8_0:
                found[(layer, name)] = ref
    return found


def load_dense(gguf_file: GGUFFile, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``name`` of ``gguf_file`` (checked to be ``shape``) dequantized to ``dtype`` on the CPU, a copy
    (not a view of the mapped file)."""
    ref = gguf_file.tensor(name, shape)
    raw = ref.raw()
    values = dequantize(raw, ref.qtype, ref.shape, dtype).reshape(shape)
    # a float tensor in the file's type may come back as a view of the mapped file: copied then
    return values.clone() if values.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr() else values


class DenseWeights:
    """Dense weights by short name.

    ``globals`` holds ``token_embd.weight``, ``output_norm.weight`` and ``output.weight`` (the
    latter aliases ``token_embd.weight`` for tied embeddings). ``at(i, device)`` holds layer i's
    tensors on ``device`` under their names without the ``blk.{i}.`` prefix, e.g.
    ``at(3, "cpu")["attn_q.weight"]``. Loaded weights sit on the CPU until ``place``d.
    """

    def __init__(self, globals_: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor] | None]):
        self.globals = globals_
        self.n_layers = len(layers)
        cpu = torch.device("cpu")
        self._copies: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {
            (i, cpu): tensors for i, tensors in enumerate(layers) if tensors is not None}  # None: another rank's
        #: repacked Q8_0 copies by (layer or None for the globals, device) -> name -> matrix
        self._q8: dict[tuple[int | None, torch.device], dict[str, Q8Matrix]] = {}
        #: the fused q/k/v projections by (layer, device): ``qkv``
        self._qkv: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor | None, Q8Matrix | None]] = {}

    @classmethod
    def load(cls, gguf_file: GGUFFile, spec: ModelSpec, dtype: torch.dtype = torch.float32,
             layers: set[int] | None = None, with_globals: bool = True) -> "DenseWeights":
        """Dequantize the dense tensors of ``gguf_file`` to ``dtype`` on the CPU (a copy, not the mmap):
        ``layers`` (None: every layer) and, ``with_globals``, the embedding, output norm and head (the
        others are another rank's, not loaded)."""
        def load_one(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return load_dense(gguf_file, name, shape, dtype)

        globals_ = {n: load_one(n, s) for n, s in spec.global_tensors().items()} if with_globals else {}
        if spec.tied_embeddings and with_globals:
            globals_["output.weight"] = globals_["token_embd.weight"]
        loaded: list[dict[str, torch.Tensor] | None] = []
        for i in range(spec.n_layers):
            prefix = f"blk.{i}."
            loaded.append({n.removeprefix(prefix): load_one(n, s) for n, s in spec.layer_tensors(i).items()}
                          if layers is None or i in layers else None)
        return cls(globals_, loaded)

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

    def _q8_targets(self, sources: Q8Sources, where: Iterable[tuple[int | None, torch.device]]
                    ) -> list[tuple[int | None, str, torch.device]]:
        """``(layer, name, device)`` of each source whose ``(layer, device)`` is in ``where`` (layer None:
        the globals, on the head's device) and whose layer is placed there."""
        where = {(layer, torch.device(d)) for layer, d in where}
        head = self.globals["output.weight"].device if "output.weight" in self.globals else None
        return [(layer, name, d) for (layer, name) in sources for (at, d) in sorted(where, key=str)
                if at == layer and ((layer is None and d == head) or (layer, d) in self._copies)]

    def q8_bytes(self, sources: Q8Sources, where: Iterable[tuple[int | None, torch.device]]) -> dict[torch.device, int]:
        """Bytes :meth:`place_q8` would put on each device (devices given nothing: absent)."""
        sizes: dict[torch.device, int] = {}
        for layer, name, device in self._q8_targets(sources, where):
            sizes[device] = sizes.get(device, 0) + q8_bytes(sources[(layer, name)].shape)
        return sizes

    def place_q8(self, sources: Q8Sources, where: Iterable[tuple[int | None, torch.device]]) -> "DenseWeights":
        """Repack each of ``sources`` onto the devices ``where`` names for its layer (``(layer, device)``
        pairs; layer None: the globals, on the head's device), once; :meth:`q8_at` finds them. Returns self."""
        for layer, name, device in self._q8_targets(sources, where):
            mats = self._q8.setdefault((layer, device), {})
            if name not in mats:
                ref = sources[(layer, name)]
                mats[name] = repack_q8_0(ref.raw().to(device), ref.shape)
        return self

    def qkv(self, layer: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None, Q8Matrix | None]:
        """Layer ``layer``'s q, k and v projections on ``device`` as one ``[(nh + 2 nkv) D, H]`` matrix (and
        bias, and its Q8_0 copy where the layer has one there): built once per (layer, device), the three
        weights (and copies) then become views of it (no second copy). One product of it gives each
        output the bits of its own projection's product (each output one dot product)."""
        device = torch.device(device)
        key = (layer, device)
        if key not in self._qkv:
            w = self.at(layer, device)
            fused = {}
            for part in ("weight", "bias"):
                names = [f"{n}.{part}" for n in QKV_NAMES]
                if names[0] in w:
                    fused[part] = torch.cat([w[n] for n in names])
                    for name, view in zip(names, fused[part].split([w[n].shape[0] for n in names])):
                        w[name] = view
            q8 = self.q8_at(layer, device)
            names = [f"{n}.weight" for n in QKV_NAMES]
            if all(n in q8 for n in names):
                fused["q8"] = Q8Matrix.cat([q8[n] for n in names])
                for name, view in zip(names, fused["q8"].split([q8[n].shape[0] for n in names])):
                    q8[name] = view
            self._qkv[key] = (fused["weight"], fused.get("bias"), fused.get("q8"))
        return self._qkv[key]

    def q8_at(self, layer: int | None, device: torch.device | str) -> dict[str, Q8Matrix]:
        """Layer ``layer``'s (None: the globals') Q8_0 copies on ``device`` by name (empty if none)."""
        return self._q8.get((layer, torch.device(device)), {})

    def product(self, x: torch.Tensor, name: str, layer: int | None = None,
                batch_invariant: bool = False) -> torch.Tensor:
        """``x [..., in] @ W.T`` for layer ``layer``'s (None: the global) weight ``name`` on x's device
        (:func:`dense_product`: its Q8_0 copy there for few rows, else the float copy)."""
        weight = self.globals[name] if layer is None else self.at(layer, x.device)[name]
        return dense_product(x, weight, self.q8_at(layer, x.device).get(name), batch_invariant)
