"""Quantized KV rows (``--kv-type``): how the paged pools store per-token state, and how attention reads it.

``auto`` (the default) stores the rows in the compute dtype, as ever; ``bf16`` stores them as
bfloat16. The quantized types store each per-token row (K, V, an MLA latent or rope key) as codes
of one byte a value plus a scale per group of values, in two pool tensors: ``name`` (the codes, the
row's shape) and ``name + "_scale"`` (the row's shape with its last dim replaced by its groups):

- ``q8_0``: int8 codes, a float16 scale per 32 values, as GGML's Q8_0 (``d = absmax / 127``,
  ``q = round(x / d)`` half away from zero); a row narrower than 32 values is one group; a wider row
  must be a multiple of 32;
- ``int8``: int8 codes, one float32 scale per row (a kv head's vector): symmetric absmax;
- ``fp8``: float8 e4m3 codes (where torch has ``float8_e4m3fn``), one float32 scale per row, the
  absmax mapped to 448; the pool keeps their bytes as uint8 (every device gathers and scatters
  those), viewed as float8 when they are dequantized.

Because the scales are pool tensors like the codes, everything that moves rows moves both: block
copies (copy-on-write), hand-offs, snapshots and restores (the conversation cache) copy codes and
scales exactly, and prefix-shared blocks share both. ``KVCache.write`` quantizes; ``KVCache.read``
hands attention a :class:`QuantizedRows` (the gathered codes and scales), which the attention
dequantizes one key block at a time (``QuantizedRows.rows``): no dequantized copy of the cache.

Tolerance (tests/test_kv_quant.py): a dequantized value is within half a step (``absmax / 127`` of its
group; q8_0 adds its float16 scale's rounding) of the original for int8 and q8_0, within 1/16 of its
magnitude (plus a 2^-9 step near zero) for fp8. Attention over quantized rows equals the float
attention over their dequantized values (GQA bit for bit on the CPU; MLA's blocked softmax within
1e-4). Logits (``LOGIT_TOLERANCE``: per position the largest logit difference over the largest
logit's magnitude, against the unquantized KV) measured on the tiny test models (qwen3moe, gpt-oss,
qwen3next, deepseek2; a 97-token prompt in two chunks and two decode steps): bf16 median <= 0.004,
p90 <= 0.008; q8_0 and int8 median <= 0.014, p90 <= 0.038; fp8 median <= 0.069, p90 <= 0.37. A
few positions differ more with any of them, bf16 included (deepseek2's bf16 up to 0.48): a near
tie of the router picks another expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from strata_core.errors import ConfigError
from strata_core.model.spec import StateTensor

__all__ = ["KV_TYPES", "LOGIT_TOLERANCE", "KVFormat", "QuantizedRows", "dequantize", "kv_format", "quantize",
           "stored_layout", "token_bytes"]

#: the values of ``--kv-type``
KV_TYPES = ("auto", "bf16", "q8_0", "int8", "fp8")

#: How far the tiny test models' logits with a quantized KV may be from the unquantized KV's: per position the
#: largest logit difference over the largest logit's magnitude; its median and 90th percentile over the
#: positions of a prompt and decode steps for q8_0 and int8, its median for fp8 (tests/test_kv_quant.py).
LOGIT_TOLERANCE = {"median": 0.025, "p90": 0.06, "fp8": 0.1}

#: the suffix of a quantized row's scale tensor in the pool
SCALE = "_scale"

FP8 = getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True)
class KVFormat:
    """One quantized KV type: the codes' dtype, values per scale (0: the whole row), the scales' dtype,
    the largest code magnitude, and the dtype the pool keeps the codes' bytes in."""

    name: str
    codes: torch.dtype
    group: int
    scale: torch.dtype
    qmax: float
    storage: torch.dtype = torch.int8

    def groups(self, width: int, where: str = "") -> int:
        """Scales per row of ``width`` values; ConfigError where a row cannot be split in groups."""
        if self.group == 0 or width <= self.group:
            return 1
        if width % self.group:
            raise ConfigError(f"--kv-type {self.name} needs rows of at most {self.group} values or a multiple of "
                              f"{self.group}: {where or 'a row'} has {width}")
        return width // self.group


_FORMATS = {"q8_0": KVFormat("q8_0", torch.int8, 32, torch.float16, 127.0),
            "int8": KVFormat("int8", torch.int8, 0, torch.float32, 127.0)}
if FP8 is not None:
    _FORMATS["fp8"] = KVFormat("fp8", FP8, 0, torch.float32, 448.0, torch.uint8)


def kv_format(kv_type: str) -> KVFormat | None:
    """The quantized format of ``kv_type`` (None for ``auto`` and ``bf16``); ConfigError naming the
    valid types for an unknown one, or fp8 where torch has no float8_e4m3fn."""
    if kv_type not in KV_TYPES:
        raise ConfigError(f"unknown --kv-type {kv_type!r}: one of {', '.join(KV_TYPES)}")
    if kv_type in ("auto", "bf16"):
        return None
    if kv_type not in _FORMATS:
        raise ConfigError(f"--kv-type {kv_type}: this torch ({torch.__version__}) has no float8_e4m3fn")
    return _FORMATS[kv_type]


def stored_layout(layout: Mapping[str, StateTensor], kv_type: str, where: str = "") -> dict[str, StateTensor]:
    """What a pool stores for a layer's state ``layout`` under ``kv_type``: ``auto`` the layout itself;
    ``bf16`` its per-token rows as bfloat16; a quantized type each per-token row as codes (``name``)
    and scales (``name + "_scale"``). Recurrent state is never changed."""
    fmt = kv_format(kv_type)
    if kv_type == "auto":
        return dict(layout)
    out: dict[str, StateTensor] = {}
    for name, t in layout.items():
        if not t.per_token or (t.dtype is not None and not t.dtype.is_floating_point):
            out[name] = t
        elif fmt is None:
            out[name] = StateTensor(t.shape, True, torch.bfloat16)
        else:
            groups = fmt.groups(t.shape[-1], f"{where}{name} {list(t.shape)}")
            out[name] = StateTensor(t.shape, True, fmt.storage)
            out[name + SCALE] = StateTensor((*t.shape[:-1], groups), True, fmt.scale)
    return out


def token_bytes(layout: Mapping[str, StateTensor], kv_type: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a token of the per-token rows of ``layout`` takes under ``kv_type`` (``auto``: ``dtype``)."""
    return sum(t.nbytes(1, dtype) for t in stored_layout(layout, kv_type).values() if t.per_token)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (what GGML's quantizers call): halves away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``x``'s shape, in ``fmt.storage``) and scales (``[..., groups]``, ``fmt.scale``) of rows ``x [..., W]``."""
    *lead, width = x.shape
    groups = fmt.groups(width)
    blocks = x.float().reshape(*lead, groups, width // groups)  # [..., G, g]
    d = blocks.abs().amax(-1) / fmt.qmax  # [..., G]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = blocks * inv[..., None]
    if fmt.codes == torch.int8:
        codes = _round_half_away(scaled).clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-fmt.qmax, fmt.qmax).to(fmt.codes).view(fmt.storage)
    return codes.reshape(*lead, width), d.to(fmt.scale)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``[..., W]`` in ``dtype`` of ``codes [..., W]`` (int8, or fp8's bytes as uint8) and ``scales [..., G]``
    (float32 products)."""
    if codes.dtype == torch.uint8:
        codes = codes.view(FP8)
    *lead, width = codes.shape
    groups = scales.shape[-1]
    values = codes.float().reshape(*lead, groups, width // groups) * scales.float()[..., None]
    return values.reshape(*lead, width).to(dtype)


@dataclass(frozen=True)
class QuantizedRows:
    """Gathered quantized rows as attention receives them: ``codes [S, *shape]`` and ``scales [S, *shape[:-1],
    G]``. Indexing on the leading dims slices both; ``rows`` dequantizes a range of positions only."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def __getitem__(self, index) -> QuantizedRows:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) >= self.codes.dim() or any(i is Ellipsis or i is None for i in index):
            raise IndexError("QuantizedRows index the leading dims only (not a row's values)")
        return QuantizedRows(self.codes[index], self.scales[index])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedRows:
        return QuantizedRows(self.codes.to(device, non_blocking=non_blocking),
                             self.scales.to(device, non_blocking=non_blocking))

    def rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions ``[start, stop)`` dequantized to ``dtype``: ``[stop - start, *shape]``."""
        return dequantize(self.codes[start:stop], self.scales[start:stop], dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

