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

from strata_core.model.preset import Preset, TensorSpec

__all__ = ["GPT_OSS_PRESETS", "GptOssPreset"]


@dataclass(frozen=True)
class GptOssPreset(Preset):
    """The shapes of one gpt-oss model: ``Preset``'s fields with gpt-oss-120b's widths as defaults,
    the sliding window and the YaRN scaling."""

    architecture: ClassVar[str] = "gpt-oss"
    expert_type: ClassVar[Q] = Q.MXFP4  # the block type of the experts unless one is asked for
    hidden: int = 2880
    expert_ffn: int = 2880
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    context: int = 131072
    rope_theta: float = 150000.0
    sliding_window: int = 128
    rope_factor: float = 32.0
    rope_orig_ctx: int = 4096

    def tensors(self, expert_type: Q, dense_type: Q) -> Iterator[TensorSpec]:
        """(name, torch-order shape, block type, value scale) of every tensor, in file order; 1-D
        tensors (norms, biases, sinks) are about 1, the experts' biases about 0."""
        p, H = self, self.hidden
        E, F = p.n_experts, p.expert_ffn
        yield from p.global_tensors(dense_type)
        for i in range(p.n_layers):
            b = f"blk.{i}."
            yield from p.attention_tensors(i, dense_type)
            for name, size in (("attn_q", p.n_heads * p.head_dim), ("attn_k", p.n_kv_heads * p.head_dim),
                               ("attn_v", p.n_kv_heads * p.head_dim), ("attn_output", H)):
                yield b + name + ".bias", (size,), Q.F32, 0.1
            yield b + "attn_sinks.weight", (p.n_heads,), Q.F32, 1.0
            yield b + "post_attention_norm.weight", (H,), Q.F32, 1.0
            yield b + "ffn_gate_inp.weight", (E, H), Q.F32, 4 / math.sqrt(H)
            yield b + "ffn_gate_inp.bias", (E,), Q.F32, 0.1
            yield from p.expert_tensors(i, expert_type)
            for name, size in (("ffn_gate_exps", F), ("ffn_up_exps", F), ("ffn_down_exps", H)):
                yield b + name + ".bias", (E, size), Q.F32, 0.1

    def add_metadata(self, w: gguf.GGUFWriter) -> None:
        """``Preset``'s keys plus the sliding window and YaRN (as llama.cpp's converter writes gpt-oss's)."""
        super().add_metadata(w)
        w.add_sliding_window(self.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(self.rope_factor)
        w.add_rope_scaling_orig_ctx_len(self.rope_orig_ctx)


GPT_OSS_PRESETS: dict[str, GptOssPreset] = {
    "gpt-oss-120b": GptOssPreset(36, 128, 4),  # --layers 8 for a benchmark model that builds in seconds
    "gpt-oss-20b": GptOssPreset(24, 32, 4),
    "gpt-oss-tiny": GptOssPreset(2, 16, 4, hidden=256, expert_ffn=256, n_heads=4, n_kv_heads=2, vocab=512,
                                 sliding_window=8, context=4096),
}
