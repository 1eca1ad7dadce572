"""Synthetic deepseek2 presets (``strata make-synthetic --preset deepseek-v3-small``): DeepSeek-V3's
shapes (MLA, a leading dense layer, 256 routed experts in 8 groups, a shared expert, YaRN x40) with
fewer layers, written as llama.cpp's converter names and lays out the tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterator

import gguf
from gguf import GGMLQuantizationType as Q

from strata_core.model.preset import Preset, TensorSpec

__all__ = ["DeepseekPreset", "DEEPSEEK_PRESETS"]


@dataclass(frozen=True)
class DeepseekPreset(Preset):
    """The shapes of one deepseek2 model: ``Preset``'s widths (``head_dim`` = nope + rope, one kv head:
    the latent) plus MLA's ranks, the dense lead, expert groups and YaRN."""

    architecture: ClassVar[str] = "deepseek2"
    rope_theta: float = 10000.0
    n_dense: int = 1  # leading dense-FFN layers
    groups: int = 8
    groups_used: int = 4
    dense_ffn: int = 18432
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    v_dim: int = 128
    rope_factor: float = 40.0
    rope_orig_ctx: int = 4096
    n_shared: int = 1

    def tensors(self, expert_type: Q, dense_type: Q) -> Iterator[TensorSpec]:
        """(name, torch-order shape, block type, value scale) of every tensor, in file order."""
        p, H = self, self.hidden
        Fs, nh, C, nope = p.expert_ffn * p.n_shared, p.n_heads, p.kv_lora, p.head_dim - p.rope
        yield from p.global_tensors(dense_type)
        for i in range(p.n_layers):
            b = f"blk.{i}."
            yield b + "attn_norm.weight", (H,), Q.F32, 1.0
            yield b + "attn_q_a.weight", (p.q_lora, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_q_a_norm.weight", (p.q_lora,), Q.F32, 1.0
            yield b + "attn_q_b.weight", (nh * p.head_dim, p.q_lora), dense_type, 2 / math.sqrt(p.q_lora)
            yield b + "attn_kv_a_mqa.weight", (C + p.rope, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_kv_a_norm.weight", (C,), Q.F32, 1.0
            yield b + "attn_k_b.weight", (nh, C, nope), dense_type, 2 / math.sqrt(nope)
            yield b + "attn_v_b.weight", (nh, p.v_dim, C), dense_type, 2 / math.sqrt(C)
            yield b + "attn_output.weight", (H, nh * p.v_dim), dense_type, 2 / math.sqrt(nh * p.v_dim)
            yield b + "ffn_norm.weight", (H,), Q.F32, 1.0
            if i < p.n_dense:
                yield b + "ffn_gate.weight", (p.dense_ffn, H), dense_type, 2 / math.sqrt(H)
                yield b + "ffn_up.weight", (p.dense_ffn, H), dense_type, 2 / math.sqrt(H)
                yield b + "ffn_down.weight", (H, p.dense_ffn), dense_type, 2 / math.sqrt(p.dense_ffn)
                continue
            yield b + "ffn_gate_inp.weight", (p.n_experts, H), Q.F32, 4 / math.sqrt(H)
            yield b + "exp_probs_b.bias", (p.n_experts,), Q.F32, 1.0
            yield from p.expert_tensors(i, expert_type)
            yield b + "ffn_gate_shexp.weight", (Fs, H), dense_type, 2 / math.sqrt(H)
            yield b + "ffn_up_shexp.weight", (Fs, H), dense_type, 2 / math.sqrt(H)
            yield b + "ffn_down_shexp.weight", (H, Fs), dense_type, 2 / math.sqrt(Fs)

    def add_metadata(self, w: gguf.GGUFWriter) -> None:
        """The deepseek2 keys llama.cpp's converter writes for a DeepSeek-V3 config."""
        p = self
        w.add_block_count(p.n_layers)
        w.add_context_length(p.context)
        w.add_embedding_length(p.hidden)
        w.add_feed_forward_length(p.dense_ffn)
        w.add_head_count(p.n_heads)
        w.add_head_count_kv(1)
        w.add_key_length(p.kv_lora + p.rope)
        w.add_value_length(p.kv_lora)
        w.add_key_length_mla(p.head_dim)
        w.add_value_length_mla(p.v_dim)
        w.add_rope_dimension_count(p.rope)
        w.add_rope_freq_base(p.rope_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.rope_factor)
        w.add_rope_scaling_orig_ctx_len(p.rope_orig_ctx)
        w.add_rope_scaling_yarn_log_mul(0.1 * 1.0)  # mscale_all_dim 1.0, as the converter stores it
        w.add_layer_norm_rms_eps(1e-6)
        w.add_leading_dense_block_count(p.n_dense)
        w.add_vocab_size(p.vocab)
        w.add_q_lora_rank(p.q_lora)
        w.add_kv_lora_rank(p.kv_lora)
        w.add_expert_count(p.n_experts)
        w.add_expert_used_count(p.n_experts_used)
        w.add_expert_group_count(p.groups)
        w.add_expert_group_used_count(p.groups_used)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_feed_forward_length(p.expert_ffn)
        w.add_expert_shared_count(p.n_shared)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)


DEEPSEEK_PRESETS: dict[str, DeepseekPreset] = {
    # DeepSeek-V3/R1 widths; 4 of its 61 layers (1 of its 3 dense ones + 3 MoE: ~22 GB with Q4_K experts)
    "deepseek-v3-small": DeepseekPreset(n_layers=4, n_experts=256, n_experts_used=8, hidden=7168, expert_ffn=2048,
                                        n_heads=128, n_kv_heads=1, head_dim=192, vocab=129280, context=163840),
    # the same structure with every row a multiple of 256 (K-quant experts) at test size
    "deepseek-tiny": DeepseekPreset(n_layers=2, n_experts=8, n_experts_used=2, hidden=256, expert_ffn=256, n_heads=2,
                                    n_kv_heads=1, head_dim=64, vocab=512, context=2048, groups=4, groups_used=2,
                                    dense_ffn=256, q_lora=64, kv_lora=64, rope=32, v_dim=32, rope_factor=4.0,
                                    rope_orig_ctx=512),
}
