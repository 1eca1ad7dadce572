"""Corrupting a GGUF file for the fuzzing tests: integer header slots, header bytes, metadata values,
truncation. Every function takes the file's bytes and returns the corrupted bytes."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType


@dataclass(frozen=True)
class Layout:
    """Where things are in a valid GGUF: integer slots of the header, its end, and each key's record."""

    slots: tuple[tuple[int, int], ...]  # (offset, size) of every integer of the header
    tensor_slots: tuple[tuple[int, int], ...]  # the dims, type and offset of every tensor info
    header_end: int  # start of the (aligned) data section
    keys: dict[str, tuple[int, int]]  # key -> (start, end) of its record
    alignment: int


def layout(path: Path) -> Layout:
    """Parse a valid file once and note the byte positions the corruptions aim at."""
    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    slots: list[tuple[int, int]] = []
    keys: dict[str, tuple[int, int]] = {}
    for field in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        for part in field.parts:
            if part.dtype.kind in "ui" and part.dtype.itemsize > 1:
                start = part.ctypes.data - base
                slots += [(start + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(min(part.size, 64))]
    tensor_slots = []
    for t in reader.tensors:
        for part in t.field.parts[3:]:  # dims, type, offset
            start = part.ctypes.data - base
            tensor_slots += [(start + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(part.size)]
    for name, field in reader.fields.items():
        if not name.startswith("GGUF."):
            keys[name] = (field.offset, max(p.ctypes.data - base + p.nbytes for p in field.parts))
    return Layout(tuple(slots), tuple(tensor_slots), int(reader.data_offset), keys, int(reader.alignment))


def set_int(data: bytes, slot: tuple[int, int], value: int) -> bytes:
    """Write ``value`` (wrapped to the slot's width) little-endian into an integer slot."""
    offset, size = slot
    raw = (value % (1 << (8 * size))).to_bytes(size, "little")
    return data[:offset] + raw + data[offset + size :]


def set_bytes(data: bytes, changes: list[tuple[int, int]]) -> bytes:
    """Overwrite single bytes: (offset, value) pairs."""
    out = bytearray(data)
    for offset, value in changes:
        out[offset % len(out)] = value
    return bytes(out)


def _pack(value: Any) -> bytes:
    """A GGUF value: its type id and encoding."""
    if isinstance(value, bool):
        return struct.pack("<I?", GGUFValueType.BOOL, value)
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return struct.pack("<Ii", GGUFValueType.INT32, value)
        if value < 0:
            return struct.pack("<Iq", GGUFValueType.INT64, value)
        return struct.pack("<IQ", GGUFValueType.UINT64, value)
    if isinstance(value, float):
        return struct.pack("<If", GGUFValueType.FLOAT32, value)
    if isinstance(value, str):
        raw = value.encode()
        return struct.pack("<IQ", GGUFValueType.STRING, len(raw)) + raw
    if isinstance(value, list):
        items = [_pack(v) for v in value]
        item_type = struct.unpack("<I", items[0][:4])[0] if items else GGUFValueType.INT32
        return struct.pack("<IIQ", GGUFValueType.ARRAY, item_type, len(items)) + b"".join(i[4:] for i in items)
    raise TypeError(value)


def set_metadata(data: bytes, where: Layout, key: str, value: Any | None, as_key: str | None = None) -> bytes:
    """Replace ``key``'s record by ``as_key`` (default: the same key) = ``value`` (``None`` drops the
    key), keeping the data section aligned."""
    start, end = where.keys[key]
    name = (as_key or key).encode()
    record = b"" if value is None else struct.pack("<Q", len(name)) + name + _pack(value)
    kv_count = struct.unpack("<Q", data[16:24])[0] - (value is None)
    infos_end = max(offset + size for offset, size in where.slots)  # a tensor info ends with its offset
    header = data[:16] + struct.pack("<Q", kv_count) + data[24:start] + record + data[end:infos_end]
    return header + b"\0" * ((-len(header)) % where.alignment) + data[where.header_end :]


def truncate(data: bytes, length: int) -> bytes:
    """The first ``length`` bytes."""
    return data[:length]


def tensor_slot(path: Path, index: int, part: str) -> tuple[int, int]:
    """The integer slot of tensor ``index``'s ``part``: "type" or "offset"."""
    reader = GGUFReader(path)
    array = reader.tensors[index].field.parts[{"type": 4, "offset": 5}[part]]
    return array.ctypes.data - reader.data.ctypes.data, array.dtype.itemsize


def array_length_slot(path: Path, key: str) -> tuple[int, int]:
    """The integer slot holding the length of the array value of ``key``."""
    reader = GGUFReader(path)
    array = reader.fields[key].parts[4]  # key length, key, value type, item type, length, items...
    return array.ctypes.data - reader.data.ctypes.data, array.dtype.itemsize
