"""Synthetic qwen3next presets (``strata make-synthetic --preset qwen3-next-80b-a3b``): Qwen3-Next's
shapes (Gated DeltaNet layers with a gated full-attention layer every 4, 512 experts of which 10 are
routed, a sigmoid-gated shared expert, partial RoPE), tensors named and laid out as llama.cpp's
converter writes them. ``--layers`` makes a shorter model of the same widths; ``mtp_layers`` (``--mtp-layers``)
adds multi-token-prediction blocks after them, as llama.cpp writes Qwen3-Next's: a gated full-attention
layer with experts plus the ``nextn.*`` tensors (model/mtp.py), counted in ``block_count`` and
``nextn_predict_layers``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterator

import gguf
from gguf import GGMLQuantizationType as Q

from strata_core.model.preset import Preset

__all__ = ["QWEN3NEXT_PRESETS", "Qwen3NextPreset"]


@dataclass(frozen=True)
class Qwen3NextPreset:
    """The shapes of one qwen3next model (see ``strata_core.model.preset.Preset`` for the protocol)."""

    architecture: ClassVar[str] = "qwen3next"
    n_layers: int
    n_experts: int
    n_experts_used: int
    hidden: int
    expert_ffn: int
    shared_ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_head_dim: int
    vocab: int
    full_attention_interval: int = 4
    conv_kernel: int = 4
    context: int = 262144
    rope_theta: float = 10_000_000.0
    mtp_layers: int = 0

    def recurrent(self, layer: int) -> bool:
        """Whether ``layer`` is a Gated DeltaNet layer (llama.cpp's rule from the interval)."""
        return (layer + 1) % self.full_attention_interval != 0

    def tensors(self, expert_type: Q, dense_type: Q) -> Iterator[tuple[str, tuple[int, ...], Q, float]]:
        """(name, torch-order shape, block type, value scale) of every tensor, in file order; the
        decay ``ssm_a`` is about -1 (a negative scale: ``strata_core.tools.synthetic._value``)."""
        H = self.hidden
        yield "token_embd.weight", (self.vocab, H), dense_type, 1.0
        yield "output_norm.weight", (H,), Q.F32, 1.0
        yield "output.weight", (self.vocab, H), dense_type, 2 / math.sqrt(H)
        for i in range(self.n_layers):
            yield from self._layer(i, self.recurrent(i), expert_type, dense_type)
        for i in range(self.n_layers, self.n_layers + self.mtp_layers):  # the MTP blocks: full attention
            b = f"blk.{i}.nextn."
            yield b + "eh_proj.weight", (H, 2 * H), dense_type, 2 / math.sqrt(2 * H)
            yield b + "enorm.weight", (H,), Q.F32, 1.0
            yield b + "hnorm.weight", (H,), Q.F32, 1.0
            yield b + "shared_head_norm.weight", (H,), Q.F32, 1.0
            yield from self._layer(i, False, expert_type, dense_type)

    def _layer(self, i: int, recurrent: bool, expert_type: Q,
               dense_type: Q) -> Iterator[tuple[str, tuple[int, ...], Q, float]]:
        """The tensors of block ``i``: a Gated DeltaNet (``recurrent``) or gated attention layer and its experts."""
        p, H = self, self.hidden
        E, F, Fs = p.n_experts, p.expert_ffn, p.shared_ffn
        q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
        key, value = p.gdn_k_heads * p.gdn_head_dim, p.gdn_v_heads * p.gdn_head_dim
        conv = 2 * key + value
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (H,), Q.F32, 1.0
        if recurrent:
            yield b + "attn_qkv.weight", (conv, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_gate.weight", (value, H), dense_type, 2 / math.sqrt(H)
            yield b + "ssm_conv1d.weight", (conv, p.conv_kernel), Q.F32, 1 / math.sqrt(p.conv_kernel)
            yield b + "ssm_dt.bias", (p.gdn_v_heads,), Q.F32, 1.0
            yield b + "ssm_a", (p.gdn_v_heads,), Q.F32, -1.0
            yield b + "ssm_ba.weight", (2 * p.gdn_v_heads, H), dense_type, 1 / math.sqrt(H)
            yield b + "ssm_norm.weight", (p.gdn_head_dim,), Q.F32, 1.0
            yield b + "ssm_out.weight", (H, value), dense_type, 2 / math.sqrt(value)
        else:
            yield b + "attn_q.weight", (2 * q, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_k.weight", (kv, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_v.weight", (kv, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_output.weight", (H, q), dense_type, 2 / math.sqrt(q)
            yield b + "attn_q_norm.weight", (p.head_dim,), Q.F32, 1.0
            yield b + "attn_k_norm.weight", (p.head_dim,), Q.F32, 1.0
        yield b + "post_attention_norm.weight", (H,), Q.F32, 1.0
        yield b + "ffn_gate_inp.weight", (E, H), Q.F32, 4 / math.sqrt(H)
        yield b + "ffn_gate_inp_shexp.weight", (H,), Q.F32, 1.0
        yield b + "ffn_gate_shexp.weight", (Fs, H), dense_type, 2 / math.sqrt(H)
        yield b + "ffn_up_shexp.weight", (Fs, H), dense_type, 2 / math.sqrt(H)
        yield b + "ffn_down_shexp.weight", (H, Fs), dense_type, 2 / math.sqrt(Fs)
        yield b + "ffn_gate_exps.weight", (E, F, H), expert_type, 2 / math.sqrt(H)
        yield b + "ffn_up_exps.weight", (E, F, H), expert_type, 2 / math.sqrt(H)
        yield b + "ffn_down_exps.weight", (E, H, F), expert_type, 2 / math.sqrt(F)

    def add_metadata(self, w: gguf.GGUFWriter) -> None:
        """The keys of a qwen3moe preset of the same sizes, plus the shared expert, the partial RoPE and
        the Gated DeltaNet keys (the layer pattern by interval, no per-layer array) and the MTP blocks'
        count (in ``block_count`` too)."""
        p = self
        Preset(p.n_layers + p.mtp_layers, p.n_experts, p.n_experts_used, p.hidden, p.expert_ffn, p.n_heads,
               p.n_kv_heads, p.head_dim, p.vocab, context=p.context, rope_theta=p.rope_theta).add_metadata(w)
        w.add_rope_dimension_count(p.rope_dim)
        w.add_expert_shared_feed_forward_length(p.shared_ffn)
        w.add_ssm_conv_kernel(p.conv_kernel)
        w.add_ssm_state_size(p.gdn_head_dim)
        w.add_ssm_group_count(p.gdn_k_heads)
        w.add_ssm_time_step_rank(p.gdn_v_heads)
        w.add_ssm_inner_size(p.gdn_v_heads * p.gdn_head_dim)
        w.add_full_attention_interval(p.full_attention_interval)
        if p.mtp_layers:
            w.add_nextn_predict_layers(p.mtp_layers)


QWEN3NEXT_PRESETS: dict[str, Qwen3NextPreset] = {
    # Qwen3-Next-80B-A3B: 48 layers (use --layers for a shorter benchmark model)
    "qwen3-next-80b-a3b": Qwen3NextPreset(48, 512, 10, 2048, 512, 512, 16, 2, 256, 64, 16, 32, 128, 151936),
    "qwen3-next-tiny": Qwen3NextPreset(4, 16, 4, 256, 256, 128, 4, 2, 64, 16, 2, 4, 32, 512, context=4096),
}
