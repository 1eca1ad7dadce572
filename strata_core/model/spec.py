"""``ModelSpec``: the numbers the forward needs and the tensors they imply (llama.cpp's names and
torch-order shapes); an architecture's reader (``Architecture.spec_from_metadata``) builds it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from strata_core.model.rope import RopeScaling

__all__ = ["ModelSpec", "Shape", "StateTensor"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class StateTensor:
    """One named tensor of a layer's session state (what ``KVCache`` allocates, hands off and snapshots).

    ``per_token``: a ``[max_tokens, *shape]`` tensor whose row i belongs to position i (K, V, an MLA
    latent); otherwise a fixed-size recurrent state of ``shape`` that compute updates in place (a
    linear-attention layer's convolution or ssm state), which cannot be rewound to an earlier position.
    """

    shape: tuple[int, ...]
    per_token: bool = True
    dtype: torch.dtype | None = None  # None: the cache's dtype

    def nbytes(self, max_tokens: int, dtype: torch.dtype) -> int:
        """Bytes of the tensor in a cache of ``max_tokens`` positions with compute dtype ``dtype``."""
        item = torch.empty((), dtype=self.dtype or dtype).element_size()
        return math.prod(self.shape) * item * (max_tokens if self.per_token else 1)


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of one MoE model, as llama.cpp interprets its GGUF file.

    Every layer is an attention block followed by an FFN block: routed experts in ``moe_layers``
    (every layer here; an architecture with dense-FFN layers narrows it), a dense FFN elsewhere.
    """

    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn_size: int
    shared_expert_ffn_size: int  # 0 if the model has no shared expert
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    norm_topk_prob: bool  # renormalise the top-k router weights to sum to 1
    expert_weights_scale: float  # multiplies the routed weights (1.0 = none)
    has_qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE
    has_attn_bias: bool  # q/k/v projections carry biases
    tied_embeddings: bool  # no output.weight: the head reuses token_embd
    #: the RoPE scaling the forward applies (None: plain RoPE); gpt-oss and deepseek2 keep their own fields
    rope_scale: RopeScaling | None = field(default=None, kw_only=True)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_ffn_size > 0

    @property
    def moe_layers(self) -> range:
        """The layers with routed experts (what the arena, caches, profile and placements cover)."""
        return range(self.n_layers)

    def info_lines(self) -> list[str]:
        """The architecture-specific lines of ``strata info`` (the RoPE scaling, if any)."""
        return [self.rope_scale.describe()] if self.rope_scale is not None else []

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_state(self, layer: int) -> dict[str, StateTensor]:
        """The session state ``layer`` keeps, by name: here K and V rows of ``[n_kv_heads, head_dim]``.

        An architecture with other state (a latent KV, a recurrent state) overrides this in its
        ModelSpec subclass; the cache, hand-offs, snapshots and memory plan follow it.
        """
        row = StateTensor((self.n_kv_heads, self.head_dim))
        return {"k": row, "v": row}

    @property
    def rewindable(self) -> bool:
        """Whether a session's state can be cut back to any earlier position (no recurrent state)."""
        return all(t.per_token for layer in range(self.n_layers) for t in self.layer_state(layer).values())

    def state_bytes(self, max_tokens: int, dtype: torch.dtype) -> int:
        """Bytes of one session's state over every layer for ``max_tokens`` positions."""
        return sum(t.nbytes(max_tokens, dtype) for layer in range(self.n_layers)
                   for t in self.layer_state(layer).values())


    # -- tensors (an architecture with other tensors overrides these in its ModelSpec subclass) ---
    def global_tensors(self) -> dict[str, Shape]:
        """Non-layer tensors the forward reads: name -> torch-order shape."""
        out = {"token_embd.weight": (self.vocab_size, self.hidden_size),
               "output_norm.weight": (self.hidden_size,)}
        if not self.tied_embeddings:
            out["output.weight"] = (self.vocab_size, self.hidden_size)
        return out

    def layer_tensors(self, layer: int) -> dict[str, Shape]:
        """Dense tensors of ``layer`` (attention, norms, router, shared expert): name -> shape."""
        H, p = self.hidden_size, f"blk.{layer}."
        out = {
            p + "attn_norm.weight": (H,),
            p + "attn_q.weight": (self.q_size, H),
            p + "attn_k.weight": (self.kv_size, H),
            p + "attn_v.weight": (self.kv_size, H),
            p + "attn_output.weight": (H, self.q_size),
            p + "ffn_norm.weight": (H,),
            p + "ffn_gate_inp.weight": (self.n_experts, H),
        }
        if self.has_attn_bias:
            out |= {p + "attn_q.bias": (self.q_size,), p + "attn_k.bias": (self.kv_size,),
                    p + "attn_v.bias": (self.kv_size,)}
        if self.has_qk_norm:
            out |= {p + "attn_q_norm.weight": (self.head_dim,), p + "attn_k_norm.weight": (self.head_dim,)}
        if self.has_shared_expert:
            F = self.shared_expert_ffn_size
            out |= {p + "ffn_gate_inp_shexp.weight": (H,), p + "ffn_gate_shexp.weight": (F, H),
                    p + "ffn_up_shexp.weight": (F, H), p + "ffn_down_shexp.weight": (H, F)}
        return out

    def expert_tensors(self, layer: int) -> dict[str, Shape]:
        """The routed-expert tensors of ``layer`` in (gate, up, down) order: name -> shape; none for a
        layer outside ``moe_layers``."""
        if layer not in self.moe_layers:
            return {}
        E, F, H, p = self.n_experts, self.expert_ffn_size, self.hidden_size, f"blk.{layer}."
        return {p + "ffn_gate_exps.weight": (E, F, H), p + "ffn_up_exps.weight": (E, F, H),
                p + "ffn_down_exps.weight": (E, H, F)}
