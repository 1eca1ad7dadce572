"""``Preset``: the shapes of one qwen3moe-architecture model for ``strata make-synthetic`` (the base
of presets of architectures with the same tensors plus their own, e.g. gpt-oss); each architecture's
presets sit with it (qwen3moe.py, <arch>/preset.py), ``strata_core.tools.synthetic`` writes them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterator

import gguf
from gguf import GGMLQuantizationType as Q

__all__ = ["Preset", "TensorSpec"]

TensorSpec = tuple[str, tuple[int, ...], Q, float]  # (name, torch-order shape, block type, value scale)


@dataclass(frozen=True)
class Preset:
    """The shapes of one qwen3moe-architecture model (another architecture's preset is a class with
    the same ``architecture`` / ``n_layers`` / ``vocab`` / ``context`` / ``tensors`` / ``add_metadata``)."""

    architecture: ClassVar[str] = "qwen3moe"
    n_layers: int
    n_experts: int
    n_experts_used: int
    hidden: int
    expert_ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context: int = 40960
    rope_theta: float = 1_000_000.0

    def tensors(self, expert_type: Q, dense_type: Q) -> Iterator[TensorSpec]:
        """(name, torch-order shape, block type, value scale) of every tensor, in file order."""
        p, H = self, self.hidden
        yield from p.global_tensors(dense_type)
        for i in range(p.n_layers):
            b = f"blk.{i}."
            yield from p.attention_tensors(i, dense_type)
            yield b + "attn_q_norm.weight", (p.head_dim,), Q.F32, 1.0
            yield b + "attn_k_norm.weight", (p.head_dim,), Q.F32, 1.0
            yield b + "ffn_norm.weight", (H,), Q.F32, 1.0
            yield b + "ffn_gate_inp.weight", (p.n_experts, H), Q.F32, 4 / math.sqrt(H)
            yield from p.expert_tensors(i, expert_type)

    def global_tensors(self, dense_type: Q) -> Iterator[TensorSpec]:
        """The embedding, the final norm and the output matrix."""
        H = self.hidden
        yield "token_embd.weight", (self.vocab, H), dense_type, 1.0
        yield "output_norm.weight", (H,), Q.F32, 1.0
        yield "output.weight", (self.vocab, H), dense_type, 2 / math.sqrt(H)

    def attention_tensors(self, layer: int, dense_type: Q) -> Iterator[TensorSpec]:
        """Layer ``layer``'s attention norm and q/k/v/output matrices."""
        H, b = self.hidden, f"blk.{layer}."
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        yield b + "attn_norm.weight", (H,), Q.F32, 1.0
        yield b + "attn_q.weight", (q, H), dense_type, 2 / math.sqrt(H)
        yield b + "attn_k.weight", (kv, H), dense_type, 2 / math.sqrt(H)
        yield b + "attn_v.weight", (kv, H), dense_type, 2 / math.sqrt(H)
        yield b + "attn_output.weight", (H, q), dense_type, 2 / math.sqrt(q)

    def expert_tensors(self, layer: int, expert_type: Q) -> Iterator[TensorSpec]:
        """Layer ``layer``'s routed experts: gate, up and down."""
        H, F, E, b = self.hidden, self.expert_ffn, self.n_experts, f"blk.{layer}."
        yield b + "ffn_gate_exps.weight", (E, F, H), expert_type, 2 / math.sqrt(H)
        yield b + "ffn_up_exps.weight", (E, F, H), expert_type, 2 / math.sqrt(H)
        yield b + "ffn_down_exps.weight", (E, H, F), expert_type, 2 / math.sqrt(F)

    def add_metadata(self, w: gguf.GGUFWriter) -> None:
        """The architecture's hyper-parameter keys."""
        p = self
        w.add_block_count(p.n_layers)
        w.add_context_length(p.context)
        w.add_embedding_length(p.hidden)
        w.add_feed_forward_length(p.expert_ffn * p.n_experts_used)
        w.add_head_count(p.n_heads)
        w.add_head_count_kv(p.n_kv_heads)
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
        w.add_rope_freq_base(p.rope_theta)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(p.n_experts)
        w.add_expert_used_count(p.n_experts_used)
        w.add_expert_feed_forward_length(p.expert_ffn)
