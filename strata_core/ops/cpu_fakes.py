"""The fake (meta) kernels of the CPU ops of csrc/ (ops/cpu_kernels.py): each op's output shapes and dtypes
without computing, so the ops trace (torch.compile, fake tensors) like the CUDA ones. ``register_fakes``
registers them once the extension has defined the ops."""

from __future__ import annotations

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from torch import Tensor

__all__ = ["register_fakes"]


def register_fakes() -> None:
    """Register every CPU op's fake kernel (after the extension that defines the ops is loaded)."""
    torch.library.register_fake("strata::qlinear_grouped")(_qlinear_fake)
    torch.library.register_fake("strata::qlinear_slots")(_slots_fake)
    torch.library.register_fake("strata::attention_cpu")(_attention_fake)
    torch.library.register_fake("strata::linear_cpu")(_linear_fake)
    torch.library.register_fake("strata::dequantize_blocks")(_blocks_fake)
    torch.library.register_fake("strata::silu_mul_cpu")(_silu_mul_fake)
    torch.library.register_fake("strata::slot_ffn_cpu")(_slot_ffn_fake)
    torch.library.register_fake("strata::rms_norm_cpu")(_rms_norm_fake)
    torch.library.register_fake("strata::norm_rope_cpu")(_norm_rope_fake)
    torch.library.register_fake("strata::route_cpu")(_route_fake)
    torch.library.register_fake("strata::combine_cpu")(_combine_fake)
    torch.library.register_fake("strata::add_rms_norm_cpu")(_add_rms_norm_fake)
    torch.library.register_fake("strata::qkv_rope_cpu")(_qkv_rope_fake)
    torch.library.register_fake("strata::route_slot_ffn_cpu")(_route_slot_ffn_fake)


def _qlinear_fake(x: Tensor, weights: list[Tensor], counts: list[int], qtype: int, out: int) -> Tensor:
    return x.new_empty((x.shape[0], out), dtype=torch.float32)


def _slots_fake(x: Tensor, rep: int, buffer: Tensor, slot: Tensor, offsets: list[int], qtype: int,
                out: int) -> Tensor:
    return x.new_empty((slot.shape[0], len(offsets) * out), dtype=torch.float32)


def _attention_fake(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int,
                    sinks: Tensor | None, rows: Tensor | None = None) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def _linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _silu_mul_fake(g: Tensor, u: Tensor) -> Tensor:
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def _slot_ffn_fake(x: Tensor, rep: int, buffer: Tensor, slot: Tensor, offsets: list[int], qtypes: list[int],
                   ffn_dim: int) -> Tensor:
    return x.new_empty((slot.shape[0], x.shape[1]), dtype=torch.float32)


def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _norm_rope_fake(x: Tensor, weight: Tensor | None, eps: float, positions: Tensor, inv_freq: Tensor,
                    mscale: float) -> Tensor:
    return x.new_empty(x.shape)


def _route_fake(logits: Tensor, k: int, norm: bool, scale: float, min_sum: float) -> tuple[Tensor, Tensor]:
    return logits.new_empty((logits.shape[0], k), dtype=torch.long), logits.new_empty((logits.shape[0], k))


def _combine_fake(rows: Tensor, weights: Tensor, residual: Tensor | None) -> Tensor:
    return rows.new_empty((rows.shape[0], rows.shape[2]))


def _add_rms_norm_fake(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(h, memory_format=torch.contiguous_format),
            torch.empty_like(h, memory_format=torch.contiguous_format))


def _qkv_rope_fake(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float, positions: Tensor,
                   inv_freq: Tensor, mscale: float, n_heads: int, n_kv_heads: int, keys: Tensor, values: Tensor,
                   row_ids: Tensor) -> Tensor:
    return qkv.new_empty((qkv.shape[0], n_heads, qkv.shape[1] // (n_heads + 2 * n_kv_heads)))


def _route_slot_ffn_fake(x: Tensor, router: Tensor, k: int, norm: bool, scale: float, min_sum: float, slots: Tensor,
                         counts: Tensor, buffer: Tensor, offsets: list[int], qtypes: list[int],
                         ffn_dim: int) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty((x.shape[0], k), dtype=torch.long)


def _blocks_fake(raw: Tensor, qtype: int, dtype: torch.dtype | None = None) -> Tensor:
    values, size = GGML_QUANT_SIZES[T(int(qtype))]
    return raw.new_empty((raw.numel() // size * values,), dtype=dtype or torch.float32)
