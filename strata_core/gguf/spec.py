"""``ModelSpec``: the numbers the forward needs, read from GGUF metadata by the file's architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata_core.text.vocab import check_tokenizer_metadata

__all__ = ["ModelSpec", "StateTensor", "load_model_spec"]


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

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_ffn_size > 0

    @property
    def moe_layers(self) -> range:
        """The layers with routed experts (what the arena, caches, profile and placements cover)."""
        return range(self.n_layers)

    def info_lines(self) -> list[str]:
        """The architecture-specific lines of ``strata info`` (none here)."""
        return []

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


def load_model_spec(gguf_file) -> ModelSpec:
    """The ``ModelSpec`` of an opened ``GGUFFile``; validates every tensor the forward will read.

    Raises UnsupportedError for an unknown architecture, ModelFileError for missing or ill-typed
    keys, missing or misshapen tensors, and broken tokenizer keys.
    """
    # imported here: the architecture modules build ModelSpec, so they import this module
    from strata_core.gguf.arch import get_architecture

    arch = get_architecture(gguf_file.architecture, gguf_file.path)
    spec = arch.spec_from_metadata(gguf_file.metadata, gguf_file.tensors, gguf_file.path)
    arch.validate(gguf_file, spec)
    check_tokenizer_metadata(gguf_file.metadata, gguf_file.path, spec.vocab_size)
    return spec
