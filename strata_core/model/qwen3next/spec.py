"""``Qwen3NextSpec``: Qwen3-Next's numbers (the layer pattern, partial RoPE, the Gated DeltaNet
shapes), the state each layer keeps and its tensors; see architecture.py for how llama.cpp reads
them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_core.model.spec import ModelSpec, Shape, StateTensor

__all__ = ["Qwen3NextSpec"]


@dataclass(frozen=True)
class Qwen3NextSpec(ModelSpec):
    """``ModelSpec`` plus the layer pattern, the partial RoPE and the Gated DeltaNet shapes."""

    recurrent: tuple[bool, ...]  # per layer: a Gated DeltaNet layer (else gated full attention)
    rope_dim: int  # RoPE rotates the first rope_dim dims of each head
    conv_kernel: int  # the causal convolution's width (its state holds conv_kernel - 1 inputs)
    gdn_k_heads: int  # key (and query) heads of a Gated DeltaNet layer
    gdn_v_heads: int  # value heads (a multiple of gdn_k_heads)
    gdn_head_dim: int  # key head dim == value head dim
    mtp_layers: int  # trailing multi-token-prediction blocks (not in n_layers; --spec mtp drafts with the first)

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_k_heads * self.gdn_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_v_heads * self.gdn_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def layer_state(self, layer: int) -> dict[str, StateTensor]:
        """A Gated DeltaNet layer keeps its conv state ``[conv_kernel - 1, conv_dim]`` and its ssm state
        ``[v_heads, head_dim, head_dim]`` (float32, fixed size, updated in place); a full-attention
        layer K/V rows."""
        if not self.recurrent[layer]:
            return super().layer_state(layer)
        return {"conv": StateTensor((self.conv_kernel - 1, self.conv_dim), per_token=False, dtype=torch.float32),
                "ssm": StateTensor((self.gdn_v_heads, self.gdn_head_dim, self.gdn_head_dim), per_token=False,
                                   dtype=torch.float32)}

    def layer_tensors(self, layer: int) -> dict[str, Shape]:
        """``post_attention_norm`` before the MoE; a gated attention layer's ``attn_q`` is twice the
        query size (query + gate); a Gated DeltaNet layer has no attention tensors but its own."""
        H, p = self.hidden_size, f"blk.{layer}."
        out = super().layer_tensors(layer)
        del out[p + "ffn_norm.weight"]
        out[p + "post_attention_norm.weight"] = (H,)
        if not self.recurrent[layer]:
            out[p + "attn_q.weight"] = (2 * self.q_size, H)
            return out
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                     "attn_q_norm.weight", "attn_k_norm.weight"):
            del out[p + name]
        return out | {
            p + "attn_qkv.weight": (self.conv_dim, H),
            p + "attn_gate.weight": (self.gdn_value_dim, H),
            p + "ssm_conv1d.weight": (self.conv_dim, self.conv_kernel),
            p + "ssm_dt.bias": (self.gdn_v_heads,),
            p + "ssm_a": (self.gdn_v_heads,),
            p + "ssm_ba.weight": (2 * self.gdn_v_heads, H),
            p + "ssm_norm.weight": (self.gdn_head_dim,),
            p + "ssm_out.weight": (H, self.gdn_value_dim),
        }

    def info_lines(self) -> list[str]:
        """The architecture-specific line of ``strata info`` (the state sizes are on its KV line)."""
        full = [i for i, r in enumerate(self.recurrent) if not r]
        mtp = f"; {self.mtp_layers} MTP block(s) (--spec mtp drafts with them)" if self.mtp_layers else ""
        return [f"Gated DeltaNet on {self.n_layers - len(full)} of {self.n_layers} layers ({self.gdn_k_heads} key / "
                f"{self.gdn_v_heads} value heads of {self.gdn_head_dim}, conv {self.conv_kernel}), gated full "
                f"attention on layers {', '.join(map(str, full)) or 'none'}; RoPE on {self.rope_dim} of "
                f"{self.head_dim} head dims{mtp}"]
