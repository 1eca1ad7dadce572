"""``GptOssSpec``: gpt-oss's numbers (sliding window, YaRN RoPE) and tensors (attention biases and
sinks, ``post_attention_norm``, the biased router, per-expert biases); see architecture.py for how
llama.cpp reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_core.model.rope import scaled_inv_freq, yarn_get_mscale
from strata_core.model.spec import ModelSpec, Shape

__all__ = ["GptOssSpec"]


@dataclass(frozen=True)
class GptOssSpec(ModelSpec):
    """``ModelSpec`` plus gpt-oss's sliding window and RoPE scaling."""

    sliding_window: int  # tokens a sliding layer's query sees (itself included)
    swa_layers: tuple[bool, ...]  # per layer: sliding-window attention
    rope_theta_swa: float  # RoPE base of the sliding layers
    rope_scaling: str  # "none", "linear" or "yarn"
    rope_factor: float  # context scaling factor (1.0 = none)
    rope_orig_ctx: int  # YaRN's original context length
    rope_attn_factor: float  # rope.scaling.attn_factor

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a full-attention layer."""
        return self.sliding_window if self.swa_layers[layer] else None

    @property
    def rope_mscale(self) -> float:
        """What cos and sin are multiplied by (llama.cpp's effective ``mscale``)."""
        if self.rope_scaling != "yarn":
            return self.rope_attn_factor
        return self.rope_attn_factor * yarn_get_mscale(self.rope_factor)

    def rope_inv_freq(self, layer: int) -> torch.Tensor:
        """``[head_dim / 2]`` float32 angle per position of each rotated pair of ``layer`` (llama.cpp's
        YaRN with its fixed betas)."""
        base = self.rope_theta_swa if self.swa_layers[layer] else self.rope_theta
        return scaled_inv_freq(self.head_dim, base, self.rope_scaling, self.rope_factor, self.rope_orig_ctx)

    def layer_tensors(self, layer: int) -> dict[str, Shape]:
        """Attention with biases and sinks, ``post_attention_norm``, the biased router and the
        per-expert biases (small dense tensors placed with the layer, indexed by expert id)."""
        H, E, F, p = self.hidden_size, self.n_experts, self.expert_ffn_size, f"blk.{layer}."
        out = super().layer_tensors(layer)
        del out[p + "ffn_norm.weight"]
        return out | {
            p + "post_attention_norm.weight": (H,),
            p + "attn_output.bias": (H,),
            p + "attn_sinks.weight": (self.n_heads,),
            p + "ffn_gate_inp.bias": (E,),
            p + "ffn_gate_exps.bias": (E, F),
            p + "ffn_up_exps.bias": (E, F),
            p + "ffn_down_exps.bias": (E, H),
        }

    def info_lines(self) -> list[str]:
        """The architecture-specific lines of ``strata info``."""
        sliding = [i for i, s in enumerate(self.swa_layers) if s]
        rope = (f"RoPE {self.rope_scaling} x{self.rope_factor:g} (original context {self.rope_orig_ctx})"
                if self.rope_scaling != "none" else "RoPE unscaled")
        return [f"sliding window: {self.sliding_window} tokens on {len(sliding)} of {self.n_layers} layers "
                f"({_layer_ranges(sliding)}), the others full attention; attention sinks; {rope}"]


def _layer_ranges(layers: list[int]) -> str:
    """``[0, 2, 4, 6]`` -> ``"0, 2, ..., 6"``; a short list as it is."""
    if len(layers) > 4 and all(b - a == layers[1] - layers[0] for a, b in zip(layers, layers[1:])):
        return f"{layers[0]}, {layers[1]}, ..., {layers[-1]}"
    return ", ".join(map(str, layers)) or "none"
