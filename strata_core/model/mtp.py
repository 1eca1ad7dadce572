"""``MtpHead``: a GGUF's multi-token-prediction (MTP, llama.cpp's ``nextn``) block, run as a drafter.

llama.cpp's converter writes a model's MTP blocks after its layers (``{arch}.nextn_predict_layers`` of
them, counted in ``block_count``). The first, ``blk.{n_layers}``, holds a whole decoder layer (attention
with a KV of its own, routed and shared experts) and the ``nextn.*`` tensors: ``enorm`` and ``hnorm``
(RMSNorms of a token's embedding and of the main model's hidden state), ``eh_proj [H, 2H]`` (the two
concatenated, the embedding first, projected back to H), ``shared_head_norm`` (the norm before the output
head) and, optionally, ``embed_tokens`` and ``shared_head_head`` (else the main model's embedding and
output head). For position t it reads the main model's last hidden state ``h_t`` (the last layer's
output, before the output norm) and the token at t + 1::

    x = eh_proj([enorm(embed(token[t + 1])), hnorm(h_t)]);  x = layer(x);  logits = head(shared_head_norm(x))

which predict the token at t + 2; its output ``x`` stands in for ``h_{t+1}`` to draft t + 3 from a drafted
t + 2, and so on (one block chained, as DeepSeek-V3's and Qwen3-Next's MTP blocks serve several drafts).
The layer is the architecture's own forward over a one-layer spec whose layer 0 is the block
(``Architecture.mtp_block_spec``), so its attention is the architecture's; its routed experts are
held whole on the head's device (``BlockExperts``: on CUDA through the fused decode MoE op, else the CPU
block kernels).
"""

from __future__ import annotations

from pathlib import Path

import torch

from strata_core.errors import ConfigError
from strata_core.experts.arena import ExpertFormat
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.experts.gather import fused_decode
from strata_core.experts.rows import DequantExpertRows, ExpertRows
from strata_core.experts.weights import ExpertBlocks
from strata_core.gguf.reader import GGUFFile
from strata_core.model.kvcache import KVCache
from strata_core.model.kvpool import KVPools
from strata_core.model.ops import rms_norm
from strata_core.model.registry import get_architecture
from strata_core.model.spec import ModelSpec
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights, load_dense
from strata_core.ops.matmul import linear

__all__ = ["BlockExperts", "MtpHead", "mtp_block_spec"]


def mtp_block_spec(path: str | Path, spec: ModelSpec) -> ModelSpec:
    """The one-layer spec of ``spec``'s first MTP block; ConfigError naming the file when it has none that
    Strata runs (``--spec mtp`` needs one)."""
    block = get_architecture(spec.architecture).mtp_block_spec(spec)
    if block is None:
        raise ConfigError(f"{path}: this {spec.architecture} model has no next-token-prediction layers (no "
                          f"{spec.architecture}.nextn_predict_layers, no blk.N.nextn.* tensors), so --spec mtp "
                          "cannot draft with it: use a GGUF converted with its MTP block (Qwen3-Next: llama.cpp's "
                          "convert_hf_to_gguf.py without --no-mtp), or --spec ngram")
    return block


class BlockExperts:
    """The MTP block's routed experts (``ExpertRows``, from the tensors of its layer 0). On a CUDA device they
    are packed ``[E, total]`` as the arena packs an expert (gate | up | down) and computed by the fused decode
    MoE op, every expert resident (a pair's slot is its expert): no host read, a few launches a layer. Elsewhere
    the raw gate, up and down tensors ``[E, bytes]`` are read per expert without a copy
    (``DequantExpertRows``: the CPU block kernels)."""

    def __init__(self, gguf_file: GGUFFile, block: ModelSpec, layer: int, device: torch.device) -> None:
        refs = [gguf_file.tensor(name.replace("blk.0.", f"blk.{layer}.", 1), shape)
                for name, shape in block.expert_tensors(0).items()]
        raw = [ref.raw().view(ref.shape[0], -1) for ref in refs]  # [E, bytes] each, mapped
        self.format = ExpertFormat(tuple(ref.qtype for ref in refs), tuple(tuple(ref.shape[1:]) for ref in refs),
                                   tuple(r.shape[1] for r in raw))  # type: ignore[arg-type]
        self._packed: torch.Tensor | None = None
        if device.type == "cuda":
            self._packed = torch.empty((raw[0].shape[0], self.format.total), dtype=torch.uint8, device=device)
            for part, tensor in zip(self.format.split(self._packed), raw):
                part.copy_(tensor)
            self._raw = list(self.format.split(self._packed))
        else:
            self._raw = [r.to(device) for r in raw]
        self._reference = DequantExpertRows(self)  # type: ignore[arg-type]

    def blocks(self, layer: int, expert: int) -> ExpertBlocks:
        """Expert ``expert``'s raw blocks (``layer`` is the one-layer model's 0)."""
        gate, up, down = (raw[expert] for raw in self._raw)
        return ExpertBlocks(gate, up, down, self.format.qtypes, self.format.shapes)

    def __call__(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 ffn: ExpertFFN = SILU) -> torch.Tensor:
        """The routed output ``[T, H]`` of ``hidden [T, H]`` (``ExpertRows``)."""
        if self._packed is None:
            return self._reference(layer, hidden, expert_ids, weights, ffn)
        pairs = expert_ids.reshape(-1)  # [T*k]: every expert resident, in the slot of its own id
        return fused_decode(hidden, self._packed, self._packed, pairs, pairs, weights, self.format, ffn)


class MtpHead:
    """The first MTP block of a model on one device: ``forward`` drafts, ``new_cache`` makes a session's KV
    for it (in pools of its own, as large as the engine's)."""

    def __init__(self, model: MoEModel, nextn: dict[str, torch.Tensor], experts: ExpertRows,
                 pools: KVPools, max_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.nextn = nextn
        self.experts = experts
        self.pools = pools
        self.max_tokens = max_tokens
        self.device = device
        self.dtype = dtype

    @classmethod
    def load(cls, gguf_file: GGUFFile, spec: ModelSpec, main: MoEModel, pools: KVPools, max_tokens: int,
             device: torch.device, dtype: torch.dtype) -> MtpHead:
        """The first MTP block of ``gguf_file`` (whose main model is ``spec`` / ``main``) on ``device`` in
        ``dtype``, its sessions' KV in ``pools`` (``max_tokens`` positions each); ConfigError when the
        file has none (``mtp_block_spec``)."""
        block = mtp_block_spec(gguf_file.path, spec)
        at = spec.n_layers  # the MTP blocks follow the main model's layers
        H, prefix = spec.hidden_size, f"blk.{at}."

        def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return load_dense(gguf_file, prefix + name, shape, dtype)

        layer = {name.removeprefix("blk.0."): tensor(name.removeprefix("blk.0."), shape)
                 for name, shape in block.layer_tensors(0).items()}
        nextn = {name: tensor(f"nextn.{name}.weight", shape).to(device)
                 for name, shape in (("eh_proj", (H, 2 * H)), ("enorm", (H,)), ("hnorm", (H,)))}
        shared = main.weights.globals  # the main model's embedding and head, unless the block has its own

        def own_or_main(name: str, main_name: str) -> torch.Tensor:
            if prefix + name in gguf_file.tensors:
                return tensor(name, (spec.vocab_size, H))
            return shared[main_name]

        globals_ = {"token_embd.weight": own_or_main("nextn.embed_tokens.weight", "token_embd.weight"),
                    "output_norm.weight": tensor("nextn.shared_head_norm.weight", (H,)),
                    "output.weight": own_or_main("nextn.shared_head_head.weight", "output.weight")}
        dense = DenseWeights(globals_, [layer]).place({0: {device}}, device)
        model = get_architecture(spec.architecture).forward(block, dense, main.kernels)
        pools.pool(0, device).add_layer(0, block.layer_state(0))
        experts = BlockExperts(gguf_file, block, at, device)
        return cls(model, nextn, experts, pools, max_tokens, device, dtype)

    def new_cache(self) -> KVCache:
        """An empty KV cache of the block for one session."""
        return KVCache.for_spec(self.model.spec, self.max_tokens, device=self.device, dtype=self.dtype,
                                pools=self.pools)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over ``hidden [T, H]`` (the main model's rows at ``positions [T]``, consecutive, on the
        host) and ``tokens [T]`` (each the token after its row's): float32 logits ``[1, V]`` of the token
        after the last (the only one a draft reads: a prompt's rows fed at once would otherwise take a head
        product each) and the block's output ``[T, H]`` (the hidden state a chained draft reads). Writes the
        rows' K/V into ``kv`` (reserved by the caller; committed by it too)."""
        w, eps, m = self.nextn, self.model.spec.rms_norm_eps, self.model
        hidden = hidden.to(self.device, self.dtype)
        e = m.embed(tokens.to(self.device))  # [T, H]
        x = linear(torch.cat((rms_norm(e, w["enorm"], eps), rms_norm(hidden, w["hnorm"], eps)), dim=-1),
                   w["eh_proj"])  # [T, H]
        n_ctx = int(positions[-1]) + 1
        x = m.moe(0, m.attention(0, x, positions.to(self.device), kv, n_ctx), self.experts)  # [T, H]
        return m.head(x[-1:]), x

