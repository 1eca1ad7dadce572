"""Synthetic gpt-oss presets (``strata make-synthetic --preset gpt-oss-120b``): gpt-oss's shapes
(hidden 2880, 64 query / 8 KV heads of 64, a sliding window of 128 on every other layer, attention
sinks, biases, YaRN x32 over 4096 positions, MXFP4 experts by default: 2880 is not a multiple of a
K-quant's 256-block), tensors named and laid out as llama.cpp's converter writes them.
``--layers`` makes a shorter model of the same widths (gpt-oss-120b's 36 layers are ~61 GiB of MXFP4
experts; ``--layers 8`` writes ~14 GiB)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterator

import gguf
from gguf import GGMLQuantizationType as Q

__all__ = ["GPT_OSS_PRESETS", "GptOssPreset"]


@dataclass(frozen=True)
class GptOssPreset:
    """The shapes of one gpt-oss model (see ``strata_core.synthetic.Preset`` for the protocol)."""

    architecture: ClassVar[str] = "gpt-oss"
    expert_type: ClassVar[Q] = Q.MXFP4  # the block type of the experts unless one is asked for
    n_layers: int
    n_experts: int
    n_experts_used: int
    hidden: int = 2880
    expert_ffn: int = 2880
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    sliding_window: int = 128
    context: int = 131072
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    rope_orig_ctx: int = 4096

    def tensors(self, expert_type: Q, dense_type: Q) -> Iterator[tuple[str, tuple[int, ...], Q, float]]:
        """(name, torch-order shape, block type, value scale) of every tensor, in file order; 1-D
        tensors (norms, biases, sinks) are about 1, the experts' biases about 0."""
        p, H = self, self.hidden
        E, F = p.n_experts, p.expert_ffn
        q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
        yield "token_embd.weight", (p.vocab, H), dense_type, 1.0
        yield "output_norm.weight", (H,), Q.F32, 1.0
        yield "output.weight", (p.vocab, H), dense_type, 2 / math.sqrt(H)
        for i in range(p.n_layers):
            b = f"blk.{i}."
            yield b + "attn_norm.weight", (H,), Q.F32, 1.0
            yield b + "attn_q.weight", (q, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_q.bias", (q,), Q.F32, 0.1
            yield b + "attn_k.weight", (kv, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_k.bias", (kv,), Q.F32, 0.1
            yield b + "attn_v.weight", (kv, H), dense_type, 2 / math.sqrt(H)
            yield b + "attn_v.bias", (kv,), Q.F32, 0.1
            yield b + "attn_output.weight", (H, q), dense_type, 2 / math.sqrt(q)
            yield b + "attn_output.bias", (H,), Q.F32, 0.1
            yield b + "attn_sinks.weight", (p.n_heads,), Q.F32, 1.0
            yield b + "post_attention_norm.weight", (H,), Q.F32, 1.0
            yield b + "ffn_gate_inp.weight", (E, H), Q.F32, 4 / math.sqrt(H)
            yield b + "ffn_gate_inp.bias", (E,), Q.F32, 0.1
            yield b + "ffn_gate_exps.weight", (E, F, H), expert_type, 2 / math.sqrt(H)
            yield b + "ffn_gate_exps.bias", (E, F), Q.F32, 0.1
            yield b + "ffn_up_exps.weight", (E, F, H), expert_type, 2 / math.sqrt(H)
            yield b + "ffn_up_exps.bias", (E, F), Q.F32, 0.1
            yield b + "ffn_down_exps.weight", (E, H, F), expert_type, 2 / math.sqrt(F)
            yield b + "ffn_down_exps.bias", (E, H), Q.F32, 0.1

    def add_metadata(self, w: gguf.GGUFWriter) -> None:
        """The architecture's hyper-parameter keys (as llama.cpp's converter writes gpt-oss's)."""
        p = self
        w.add_block_count(p.n_layers)
        w.add_context_length(p.context)
        w.add_embedding_length(p.hidden)
        w.add_feed_forward_length(p.expert_ffn)
        w.add_head_count(p.n_heads)
        w.add_head_count_kv(p.n_kv_heads)
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
        w.add_rope_freq_base(p.rope_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.rope_factor)
        w.add_rope_scaling_orig_ctx_len(p.rope_orig_ctx)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_sliding_window(p.sliding_window)
        w.add_expert_count(p.n_experts)
        w.add_expert_used_count(p.n_experts_used)
        w.add_expert_feed_forward_length(p.expert_ffn)


GPT_OSS_PRESETS: dict[str, GptOssPreset] = {
    "gpt-oss-120b": GptOssPreset(36, 128, 4),  # --layers 8 for a benchmark model that builds in seconds
    "gpt-oss-20b": GptOssPreset(24, 32, 4),
    "gpt-oss-tiny": GptOssPreset(2, 16, 4, hidden=256, expert_ffn=256, n_heads=4, n_kv_heads=2, vocab=512,
                                 sliding_window=8, context=4096),
}
