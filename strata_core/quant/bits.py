"""Bit-level helpers shared by the block formats.

Every helper is plain torch, vectorised over all blocks at once, and device-generic. Block bytes
arrive as a ``[n_blocks, type_size]`` uint8 tensor; fields are split off with :func:`fields` and
decoded with the helpers below. Integer codes are turned into float32 only where the reference
(gguf-py, float32 arithmetic) does, so results stay bit-identical to it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fields(blocks: Tensor, *sizes: int) -> tuple[Tensor, ...]:
    """Split ``[n, type_size]`` block bytes into consecutive byte fields of the given widths."""
    return torch.split(blocks, sizes, dim=1)


def fp16(field: Tensor) -> Tensor:
    """``[n, 2k]`` little-endian fp16 bytes -> ``[n, k]`` float32."""
    return field.contiguous().view(torch.float16).float()


def fp16_from_bits(bits: Tensor) -> Tensor:
    """Integer tensor of fp16 bit patterns (0..65535) -> float32 of the same shape."""
    signed = bits - ((bits >> 15) << 16)  # two's complement int16 range
    return signed.to(torch.int16).view(torch.float16).float()


def le_uint(field: Tensor, width: int) -> Tensor:
    """``[n, m]`` bytes -> ``[n, m // width]`` int64: little-endian unsigned ints of ``width`` bytes."""
    n, m = field.shape
    words = field.reshape(n, m // width, width).long()  # [n, k, width]
    shifts = torch.arange(0, 8 * width, 8, device=field.device)  # [width]
    return (words << shifts).sum(-1)  # [n, k]


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
    offsets = torch.tensor(shifts, dtype=words.dtype, device=words.device)  # [len(shifts)]
    return ((words.unsqueeze(-1) >> offsets) & mask).reshape(n, k * len(shifts))


def lookup(table: Tensor, codes: Tensor) -> Tensor:
    """``table[codes]`` for integer codes of any dtype: ``[..]`` -> ``[.., *table.shape[1:]]``."""
    rows = table.index_select(0, codes.reshape(-1).int())  # [codes.numel(), *row]; faster than table[codes]
    return rows.reshape(*codes.shape, *table.shape[1:])


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


def signs_from_bits(field: Tensor) -> Tensor:
    """``[n, m]`` sign-bit bytes -> ``[n, 8 m]`` float32 of +1 (bit clear) / -1 (bit set), low bit first."""
    return 1.0 - 2.0 * unpack(field, 1, 1).float()
