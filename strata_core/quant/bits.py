"""Bit-level helpers shared by the block formats.

Every helper is plain torch, vectorised over all blocks at once, and device-generic. Block bytes
arrive as a ``[n_blocks, type_size]`` uint8 tensor; fields are split off with :func:`fields` and
decoded with the helpers below. Integer codes are turned into float32 only where the reference
(gguf-py, float32 arithmetic) does, so results stay bit-identical to it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fields(blocks: Tensor, *sizes: int) -> tuple[Tensor, ...]:
    """Split ``[n, type_size]`` block bytes into consecutive byte fields of the given widths."""
    return torch.split(blocks, sizes, dim=1)


def reinterpret(field: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n, m]`` bytes -> ``[n, m // dtype.itemsize]`` of ``dtype`` (little-endian host).

    A view where the bytes are contiguous and aligned, else a view of an aligned copy.
    """
    if not field.is_contiguous() or field.storage_offset() % dtype.itemsize:
        field = field.clone(memory_format=torch.contiguous_format)
    return field.view(dtype)


def fp16(field: Tensor) -> Tensor:
    """``[n, 2k]`` little-endian fp16 bytes -> ``[n, k]`` float32."""
    return reinterpret(field, torch.float16).float()


def fp16_from_bits(bits: Tensor) -> Tensor:
    """Integer tensor of fp16 bit patterns (0..65535) -> float32 of the same shape."""
    signed = bits - ((bits >> 15) << 16)  # two's complement int16 range
    return signed.to(torch.int16).view(torch.float16).float()


def le_uint(field: Tensor, width: int) -> Tensor:
    """``[n, m]`` bytes -> ``[n, m // width]`` int64: little-endian unsigned ints of ``width`` bytes."""
    signed = reinterpret(field, _INT_OF_WIDTH[width])  # [n, m // width]
    return signed.long() & ((1 << (8 * width)) - 1)


def unpack(field: Tensor, bits: int, group: int) -> Tensor:
    """``[n, m]`` uint8 -> ``[n, m * 8 // bits]`` uint8 codes of ``bits`` bits each.

    Each run of ``group`` bytes yields ``8 // bits`` runs of ``group`` codes: first the lowest
    ``bits`` bits of every byte of the run, then the next ``bits``, and so on (the ggml layout).
    ``group=1`` walks every byte from its low bits up.
    """
    n, m = field.shape
    mask = (1 << bits) - 1
    runs = field.reshape(n, m // group, 1, group)  # [n, runs, 1, group]
    # one shift per code position: a broadcast shift is many times slower on the CPU
    codes = [(runs >> shift) & mask for shift in range(0, 8, bits)]  # per_byte x [n, runs, 1, group]
    return torch.cat(codes, dim=2).reshape(n, m * 8 // bits)


def shift_fields(words: Tensor, shifts: tuple[int, ...], mask: int) -> Tensor:
    """``[n, k]`` ints -> ``[n, k * len(shifts)]``: ``(word >> s) & mask`` for each shift, word-major."""
    n, k = words.shape
    parts = [(words >> shift) & mask for shift in shifts]  # len(shifts) x [n, k]
    return torch.stack(parts, dim=-1).reshape(n, k * len(shifts))


def lookup(table: Tensor, codes: Tensor) -> Tensor:
    """``table[codes]`` for a 1-D table and integer codes of any dtype: ``[..]`` -> ``[..]``."""
    return table.index_select(0, codes.reshape(-1).int()).reshape(codes.shape)  # faster than table[codes]


def packed_rows(table: np.ndarray, device: torch.device) -> Tensor:
    """``[N, w]`` table of int8-range values (w = 1, 2, 4 or 8) -> ``[N]`` ints packing each row.

    Looking rows up as single integers (:func:`lookup_rows`) is several times faster on the CPU
    than gathering rows of floats.
    """
    rows = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int8))  # [N, w]
    return rows.view(_INT_OF_WIDTH[rows.shape[1]]).reshape(rows.shape[0]).to(device)


def lookup_rows(packed: Tensor, codes: Tensor) -> Tensor:
    """Rows of a :func:`packed_rows` table: ``[..]`` codes -> ``[.., w]`` int8."""
    rows = packed.index_select(0, codes.reshape(-1).int())  # [codes.numel()] packed rows
    return rows.view(torch.int8).reshape(*codes.shape, packed.element_size())


def grouped(scales: Tensor, values: Tensor) -> Tensor:
    """``[n, g]`` scales times ``[n, g * k]`` values, each scale applying to its run of ``k`` values."""
    n, g = scales.shape
    runs = values.reshape(n, g, values.shape[1] // g)  # [n, g, k]
    return (scales.unsqueeze(-1) * runs).reshape(values.shape)


def grouped_affine(scales: Tensor, mins: Tensor, values: Tensor) -> Tensor:
    """``scale * value - min`` per run, as :func:`grouped` (the K-quant ``d * q - m`` order)."""
    n, g = scales.shape
    runs = values.reshape(n, g, values.shape[1] // g)  # [n, g, k]
    return (scales.unsqueeze(-1) * runs - mins.unsqueeze(-1)).reshape(values.shape)
