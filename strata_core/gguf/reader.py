"""Open a GGUF file memory-mapped: metadata as plain Python values, tensors as zero-copy byte views.

Nothing here reads tensor data into RAM: ``TensorRef.data`` is a slice of the file's ``np.memmap``
(mapped copy-on-write, so torch can wrap it without a read-only warning; nothing ever writes to it).
Every problem with the file becomes a ``ModelFileError`` / ``UnsupportedError`` whose message names
the file and, where relevant, the tensor.
"""

from __future__ import annotations

import math
import os
import re
import struct
import sys
from collections.abc import Sequence
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


# smallest encoded size of a value of each type: bounds the counts a header may claim
_MIN_VALUE_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12} | {
    t: np.dtype(n).itemsize for t, n in GGUFReader.gguf_scalar_to_np.items()}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, at least one byte of value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
# The tensor count a header may declare: no supported architecture has more than ~30 tensors per
# layer (qwen3next, deepseek2 with its MTP layer), and no model more than a few hundred layers.
MAX_TENSORS_PER_LAYER = 64
MAX_GLOBAL_TENSORS = 64
MAX_LAYERS = 1024


class _CheckedReader(GGUFReader):
    """``GGUFReader`` that refuses what llama.cpp refuses before gguf-py acts on it.

    Every read must lie inside the file; a count (keys, tensors, array items) must fit in the bytes
    left; every tensor must have a known type, whole blocks, and start exactly where the aligned
    running layout puts it (so tensors neither overlap, wrap around nor leave the file).
    """

    def __init__(self, path: str) -> None:
        self._strata_path = path
        super().__init__(path, mode="c")

    def _broken(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self._strata_path}: {what}")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise self._broken(f"the header runs past the end of the file (needs byte {end}, file has "
                               f"{len(self.data)}); the file is truncated or corrupt")
        return super()._get(offset, dtype, count, override_order)

    def _check_count(self, count: int, min_bytes: int, offset: int, what: str) -> None:
        if int(count) * min_bytes > len(self.data) - int(offset):
            raise self._broken(f"the header claims {int(count)} {what}, more than the file could hold")

    def _build_fields(self, offs: int, count: int) -> int:  # type: ignore[override]
        self._check_count(count, _MIN_KV_BYTES, offs, "metadata keys")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list]:  # type: ignore[override]
        self._check_count(count, _MIN_TENSOR_INFO_BYTES, offs, "tensors")
        cap, why = self._tensor_cap()
        if int(count) > cap:
            raise self._broken(f"the header declares {int(count)} tensors, more than {why} can have ({cap}); "
                               "the file is corrupt")
        return self._parse_tensor_infos(int(offs), int(count))

    def _parse_tensor_infos(self, offs: int, count: int) -> tuple[int, list]:
        """The tensor infos in one pass, as compact tuples ``(info offset, name, dims, type id,
        data offset)`` (``dims`` in GGUF order) instead of gguf-py's ``ReaderField`` of numpy views
        per tensor (kilobytes each). Reads past the end fail as ``_get`` does."""
        host_little = sys.byteorder == "little"
        order = "<" if host_little == (self.byte_order == "I") else ">"
        u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        buf = memoryview(self.data)
        size = len(buf)

        def need(start: int, nbytes: int) -> None:
            end = start + nbytes
            if end > size:
                raise self._broken(f"the header runs past the end of the file (needs byte {end}, file has "
                                   f"{size}); the file is truncated or corrupt")

        infos = []
        for _ in range(count):
            start = offs
            need(offs, 8)
            (name_len,) = u64.unpack_from(buf, offs)
            offs += 8
            need(offs, name_len)
            name = bytes(buf[offs:offs + name_len]).decode("utf-8")  # strict, as gguf-py
            offs += name_len
            need(offs, 4)
            (n_dims,) = u32.unpack_from(buf, offs)
            offs += 4
            need(offs, 8 * n_dims)
            dims = struct.unpack_from(f"{order}{n_dims}Q", buf, offs)
            offs += 8 * n_dims
            need(offs, 4)
            (raw_type,) = u32.unpack_from(buf, offs)
            offs += 4
            need(offs, 8)
            (data_offset,) = u64.unpack_from(buf, offs)
            offs += 8
            infos.append((start, name, dims, raw_type, data_offset))
        return offs, infos

    def _scalar(self, key: str) -> Any:
        field = self.fields.get(key)
        if field is None or not field.types or field.types[0] in (GGUFValueType.ARRAY, GGUFValueType.STRING):
            return None
        return int(field.parts[field.data[0]][0])

    def _tensor_cap(self) -> tuple[int, str]:
        """The most tensors this file may hold, from the metadata read so far: per layer of
        ``{arch}.block_count`` (capped), or the split's ``split.tensors.count``. Checked before the
        table is built, so a header cannot make the parser walk millions of entries."""
        arch_field = self.fields.get("general.architecture")
        arch = bytes(arch_field.parts[-1]).decode("utf-8", "replace") if arch_field is not None else None
        layers = self._scalar(f"{arch}.block_count") if arch else None
        split_total = self._scalar("split.tensors.count")
        if layers is not None:
            n = min(max(layers, 0), MAX_LAYERS)
            cap, why = MAX_TENSORS_PER_LAYER * n + MAX_GLOBAL_TENSORS, f"a {arch} model of {layers} layers"
            if split_total is not None and split_total < cap:
                cap, why = split_total, f"the split model (split.tensors.count {split_total})"
            return cap, why
        if split_total is not None:
            return split_total, f"the split model (split.tensors.count {split_total})"
        return MAX_GLOBAL_TENSORS * 256, "a GGUF without a block count"

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:  # type: ignore[override]
        try:
            gtype = GGUFValueType(int(raw_type))
        except ValueError:
            raise self._broken(f"metadata value type {int(raw_type)} is unknown") from None
        if gtype == GGUFValueType.ARRAY:
            item = int(self._get(orig_offs, np.uint32)[0])
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            self._check_count(length, _MIN_VALUE_BYTES.get(item, 1), orig_offs + 12, "array items")
            if length and item == GGUFValueType.STRING:
                return self._string_array(orig_offs, length)
            if length and item in self.gguf_scalar_to_np:
                head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
                values = self._get(orig_offs + 12, self.gguf_scalar_to_np[GGUFValueType(item)], length)
                return 12 + int(values.nbytes), head + [values], [2], [gtype, GGUFValueType(item)]
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, offs: int, length: int) -> tuple[int, list, list, list]:
        """An array of ``length`` strings at ``offs`` in one pass (a vocabulary is 150K of them; gguf-py
        reads each with a few numpy calls): the parts ``contents()`` decodes, one view of the file's bytes
        per string."""
        order = "<" if (sys.byteorder == "little") == (self.byte_order == "I") else ">"
        u64 = struct.Struct(order + "Q")
        buf = memoryview(self.data)
        parts: list[Any] = [self._get(offs, np.uint32), self._get(offs + 4, np.uint64)]
        start, offs = offs, offs + 12
        for _ in range(length):
            if offs + 8 > len(buf):
                self._get(offs, np.uint64)  # raises the truncation error
            (n,) = u64.unpack_from(buf, offs)
            offs += 8
            if offs + n > len(buf):
                self._get(offs, np.uint8, n)
            parts.append(buf[offs:offs + n])
            offs += n
        return offs - start, parts, list(range(2, 2 + length)), [GGUFValueType.ARRAY, GGUFValueType.STRING]

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        """Check every tensor info (known type, whole blocks, data where the aligned running layout
        puts it and inside the file, a unique name) and keep the table compact: ``self.table`` holds
        ``(name, qtype, torch-order shape, absolute data offset, n_bytes)`` per tensor and
        ``self.tensors`` builds gguf-py's ``ReaderTensor`` only for the one asked for. The last tensor's
        data must end where the file does (within its alignment padding)."""
        expected = 0  # where the next tensor's data must start, relative to the data section
        align = int(self.alignment)
        start_offs = int(start_offs)
        size = len(self.data)
        table = []
        names: set[str] = set()
        duplicate = None
        for _start, name, dims, raw_type, offset in fields:
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise UnsupportedError(f"{self._strata_path}: tensor {name!r} has unknown block type "
                                       f"id {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = list(dims)
            if any(d <= 0 for d in shape) or (shape and shape[0] % block):
                raise self._broken(f"tensor {name!r} has shape {shape[::-1]}, which is not whole "
                                   f"{qtype.name} blocks of {block}")
            n_bytes = math.prod(shape) * type_size // block
            if offset != expected:
                raise self._broken(f"tensor {name!r} data starts at offset {offset}, expected "
                                   f"{expected} (tensors must follow each other, aligned to "
                                   f"{align} bytes); the file is corrupt")
            end = start_offs + expected + n_bytes
            if end > size:
                raise self._broken(f"tensor {name!r} data runs past the end of the file (needs bytes "
                                   f"{start_offs + expected}..{end}, file has {size}); "
                                   "the file is truncated")
            if duplicate is None and name in names:
                duplicate = name
            names.add(name)
            table.append((name, qtype, tuple(reversed(dims)), start_offs + expected, n_bytes))
            expected += -(-n_bytes // align) * align
        if table and size - end >= align:  # the data must end where the file does (bar the last padding)
            raise self._broken(f"the tensor data ends at byte {end}, {size - end} bytes before the end of the "
                               f"file: the header declares fewer tensors ({len(table)}) than the file holds, "
                               "or something was appended; the file is corrupt")
        if duplicate is not None:  # gguf-py's check, after the layout checks as before
            raise ValueError(f"Found duplicated tensor with name {duplicate}")
        self._info_offsets = np.fromiter((info[0] for info in fields), dtype=np.int64, count=len(fields))
        self.table = table
        self.tensors = _LazyTensors(self)  # type: ignore[assignment]

    def reader_tensor(self, index: int) -> Any:
        """gguf-py's ``ReaderTensor`` of tensor ``index``, built on demand from its info."""
        field = GGUFReader._get_tensor_info_field(self, int(self._info_offsets[index]))
        saved, self.tensors = self.tensors, []
        try:
            GGUFReader._build_tensors(self, self.data_offset, [field])
            return self.tensors[0]
        finally:
            self.tensors = saved


class _LazyTensors(Sequence):
    """``reader.tensors`` of a ``_CheckedReader``: a sequence building each ``ReaderTensor`` when read."""

    def __init__(self, reader: _CheckedReader) -> None:
        self._reader = reader

    def __len__(self) -> int:
        return len(self._reader.table)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError("tensor index out of range")
        return self._reader.reader_tensor(index % n)


def _field_value(field: Any) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool or list)."""
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.BOOL:
        return bool(value)
    if field.types and field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.BOOL:
        return [bool(v) for v in value]
    return value


def _open_reader(path: str) -> _CheckedReader:
    if not Path(path).is_file():
        raise ModelFileError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        return _CheckedReader(path)
    except (ModelFileError, UnsupportedError):
        raise
    except Exception as e:  # gguf-py raises ValueError/IndexError/KeyError/... on broken headers
        raise ModelFileError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from e


def _metadata(reader: _CheckedReader, path: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # header pseudo-fields (version, counts)
        try:
            metadata[name] = _field_value(field)
        except Exception as e:
            raise ModelFileError(f"{path}: metadata key {name!r} is unreadable ({e})") from e
    return metadata


def _tensors(reader: _CheckedReader, path: str) -> dict[str, TensorRef]:
    tensors: dict[str, TensorRef] = {}
    data = reader.data
    for name, qtype, shape, offset, n_bytes in reader.table:
        tensors[name] = TensorRef(name, qtype, shape, data[offset:offset + n_bytes], path)
    return tensors


_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str, metadata: dict[str, Any]) -> list[str]:
    """The files of a model split by llama.cpp's ``gguf-split`` (``M-00001-of-00003.gguf``, ...)
    given its first part, or ``[path]`` for a model in one file."""
    count, no = metadata.get("split.count", 1), metadata.get("split.no", 0)
    if not isinstance(count, int) or not isinstance(no, int) or count < 1 or not 0 <= no < count:
        raise ModelFileError(f"{path}: split.count {count!r} / split.no {no!r} are not a valid split")
    if count == 1:
        return [path]
    named = _SPLIT_NAME.match(path)
    if named is None:
        raise ModelFileError(f"{path}: part of a model split in {count} files, but the name does not end "
                             "in -NNNNN-of-NNNNN.gguf, so the other parts cannot be found")
    parts = [f"{named['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    if no != 0:
        raise ModelFileError(f"{path}: this is part {no + 1} of {count} of a split model; pass the first "
                             f"part, {parts[0]}")
    return parts


@dataclass
class GGUFFile:
    """An opened GGUF model: ``metadata`` (plain values), ``architecture``, ``tensors`` by name and
    the ``parts`` it is stored in (one file, or every file of a split model, each memory-mapped)."""

    path: str
    metadata: dict[str, Any]
    architecture: str
    tensors: dict[str, TensorRef]
    parts: tuple[str, ...] = ()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Parse the header(s) and map the file(s); raises ModelFileError for a missing, foreign or
        broken file, or a split model with a part missing or out of place.

        A split model is opened from its first part (``M-00001-of-00003.gguf``): the metadata is that
        part's, the tensors are those of every part.
        """
        path = str(path)
        reader = _open_reader(path)
        metadata = _metadata(reader, path)
        parts = split_parts(path, metadata)
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{path}: metadata lacks 'general.architecture'")
        tensors = _tensors(reader, path)
        for no, part in enumerate(parts[1:], 1):
            part_reader = _open_reader(part)
            part_meta = _metadata(part_reader, part)
            if (part_meta.get("split.no"), part_meta.get("split.count")) != (no, len(parts)):
                raise ModelFileError(f"{part}: expected part {no + 1} of {len(parts)} (split.no {no}), the file "
                                     f"says split.no {part_meta.get('split.no')!r} of {part_meta.get('split.count')!r}")
            for name, ref in _tensors(part_reader, part).items():
                if name in tensors:
                    raise ModelFileError(f"{part}: tensor {name!r} is also in {tensors[name].path}")
                tensors[name] = ref
        total = metadata.get("split.tensors.count", len(tensors))
        if total != len(tensors):
            raise ModelFileError(f"{path}: split.tensors.count is {total!r} but the {len(parts)} parts hold "
                                 f"{len(tensors)} tensors")
        return cls(path=path, metadata=metadata, architecture=arch, tensors=tensors, parts=tuple(parts))

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
