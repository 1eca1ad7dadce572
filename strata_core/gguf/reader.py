"""Open a GGUF file memory-mapped: metadata as plain Python values, tensors as zero-copy byte views.

Nothing here reads tensor data into RAM: ``TensorRef.data`` is a slice of the file's ``np.memmap``
(mapped copy-on-write, so torch can wrap it without a read-only warning; nothing ever writes to it).
Every problem with the file becomes a ``ModelFileError`` / ``UnsupportedError`` whose message names
the file and, where relevant, the tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.quant import SUPPORTED_TYPES

__all__ = ["GGUFFile", "TensorRef"]


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a GGUF file: name, block type, torch-order shape and its raw bytes (mmap view).

    ``shape`` is in torch order (GGUF stores ``ne`` reversed): ``ffn_gate_exps`` is
    ``(n_expert, n_ff_exp, n_embd)``. ``data`` is a 1-D ``np.memmap`` of ``uint8``.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    path: str = ""

    @property
    def nbytes(self) -> int:
        """Size of the raw bytes."""
        return int(self.data.nbytes)

    def raw(self) -> torch.Tensor:
        """All raw bytes as a 1-D uint8 tensor sharing memory with the mmap."""
        return torch.from_numpy(self.data)

    def expert_raw(self, expert: int) -> torch.Tensor:
        """Raw bytes of ``expert`` of a 3-D expert tensor (zero-copy uint8 slice)."""
        if len(self.shape) != 3:
            raise ModelFileError(f"{self.path}: tensor {self.name!r} has shape {self.shape}, "
                                 "expected a 3-D expert tensor")
        n_expert = self.shape[0]
        if not 0 <= expert < n_expert:
            raise IndexError(f"{self.path}: expert {expert} out of range for {self.name!r} "
                             f"({n_expert} experts)")
        per = self.nbytes // n_expert
        return torch.from_numpy(self.data[expert * per:(expert + 1) * per])


class _CheckedReader(GGUFReader):
    """``GGUFReader`` that checks each tensor's type and extent before gguf-py slices it."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        file_size = len(self.data)
        for field in fields:
            _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise UnsupportedError(f"{self._strata_path}: tensor {name!r} has unknown block type "
                                       f"id {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims.astype(np.int64)))
            start = int(start_offs + offset[0])
            end = start + n_elems * type_size // block
            if end > file_size:
                raise ModelFileError(f"{self._strata_path}: tensor {name!r} data runs past the end of "
                                     f"the file (needs bytes {start}..{end}, file has {file_size}); "
                                     "the file is truncated")
        super()._build_tensors(start_offs, fields)

    def __init__(self, path: str):
        self._strata_path = path
        super().__init__(path, mode="c")


def _field_value(field: Any) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool or list)."""
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.BOOL:
        return bool(value)
    if field.types and field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.BOOL:
        return [bool(v) for v in value]
    return value


@dataclass
class GGUFFile:
    """An opened GGUF file: ``metadata`` (plain values), ``architecture`` and ``tensors`` by name."""

    path: str
    metadata: dict[str, Any]
    architecture: str
    tensors: dict[str, TensorRef]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Parse the header and map the file; raises ModelFileError for a missing/foreign/broken file."""
        path = str(path)
        if not Path(path).is_file():
            raise ModelFileError(f"{path}: no such GGUF file")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
        try:
            reader = _CheckedReader(path)
        except (ModelFileError, UnsupportedError):
            raise
        except Exception as e:  # gguf-py raises ValueError/IndexError/KeyError/... on broken headers
            raise ModelFileError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from e

        metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue  # header pseudo-fields (version, counts)
            try:
                metadata[name] = _field_value(field)
            except Exception as e:
                raise ModelFileError(f"{path}: metadata key {name!r} is unreadable ({e})") from e
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{path}: metadata lacks 'general.architecture'")

        tensors: dict[str, TensorRef] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = reader.data[t.data_offset:t.data_offset + t.n_bytes]
            tensors[t.name] = TensorRef(t.name, GGMLQuantizationType(t.tensor_type), shape, data, path)
        return cls(path=path, metadata=metadata, architecture=arch, tensors=tensors)

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> TensorRef:
        """The tensor ``name``, checked for presence, a supported block type and (optionally) shape.

        ``shape`` is torch order; leading 1-dims are ignored on both sides, as llama.cpp does
        (``(1, H)`` matches ``(H,)``).
        """
        ref = self.tensors.get(name)
        if ref is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        if shape is not None and _squeeze_leading(ref.shape) != _squeeze_leading(shape):
            raise ModelFileError(f"{self.path}: tensor {name!r} has shape {ref.shape}, expected {tuple(shape)}")
        if ref.qtype not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{self.path}: tensor {name!r} uses block type {ref.qtype.name}, "
                                   "which Strata cannot dequantize")
        return ref


def _squeeze_leading(shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape
