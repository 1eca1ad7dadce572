"""The dense MoE forward over ``DenseWeights``; experts go through an ``ExpertRows``.

Pieces a topology composes: ``embed`` -> per layer ``attention`` then ``moe`` -> ``head``.
Each layer runs on the device of its input ``h`` with the weights placed there
(``DenseWeights.at``); the caller moves ``h`` between devices. Math follows llama.cpp's qwen2moe and
qwen3moe graphs (see qwen3moe.py, qwen2moe.py); ``registry.load_model`` builds a file's forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata_core.experts.rows import ExpertRows
from strata_core.model.head_split import HeadSplit
from strata_core.model.kernels import ForwardKernels
from strata_core.model.kvcache import KVCache
from strata_core.model.ops import (ATTN_BLOCK, apply_rope, dequantized_sdpa, masked_attention, norm_rope,
                                   packed_causal_attention, plain_inv_freq, rms_norm, rope_cos_sin, sdpa_attention)
from strata_core.model.packed import PackedKV
from strata_core.model.spec import ModelSpec
from strata_core.model.weights import DenseWeights
from strata_core.ops.cpu_kernels import (add_rms_norm_cpu, attention_cpu, cpu_kernels, linear_cpu, norm_rope_cpu,
                                        qkv_rope_cpu, route_cpu)
from strata_core.ops.matmul import batch_invariant, linear

__all__ = ["MoEModel"]

# llama.cpp clamps the top-k weight sum to the smallest normal f16 before dividing
_MIN_WEIGHT_SUM = 6.103515625e-5
#: the methods ``cpu_layer`` stands for: a subclass with its own takes ``attention`` and ``moe``
_CPU_LAYER_METHODS = ("attention", "attention_spans", "attention_out", "qkv_write", "qkv", "rope", "moe", "moe_out")


class MoEModel:
    """A Qwen-style MoE transformer: ``spec`` + ``weights`` (dense, float); stateless per call."""

    #: the layer's norm before the MoE block (llama.cpp's qwen3next and gpt-oss: "post_attention_norm.weight")
    ffn_norm = "ffn_norm.weight"

    #: whether a prompt chunk's attention can be split by heads with a peer (``attend`` and ``head_splits``)
    splits_heads = True

    def __init__(self, spec: ModelSpec, weights: DenseWeights, kernels: ForwardKernels = ForwardKernels()):
        self.spec = spec
        self.weights = weights
        #: the device kernels this forward runs (StrataSettings' kernel choices)
        self.kernels = kernels
        #: per layer, the split of its prompt chunks' attention heads with a peer (``attention_peer``, set by
        #: the engine from the placement; head_split.py)
        self.head_splits: dict[int, HeadSplit] = {}
        self._rope_freq: dict[torch.device, torch.Tensor] = {}  # a scaled RoPE's angles, made once per device
        self._plain_freq: dict[int, torch.Tensor] = {}  # plain RoPE's angles on the CPU by head dim (``_cpu_qkv``)

    def rope_tables(self, device: torch.device, dim: int) -> tuple[torch.Tensor | None, float]:
        """``(inv_freq [dim / 2], mscale)`` of the spec's RoPE scaling on ``device`` ((None, 1.0) for plain
        RoPE); made once per device, before any graph capture reads them."""
        scale = self.spec.rope_scale
        if scale is None:
            return None, 1.0
        if device not in self._rope_freq:
            self._rope_freq[device] = scale.inv_freq(dim, self.spec.rope_theta).to(device)
        return self._rope_freq[device], scale.mscale

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [T]`` -> hidden ``[T, H]`` on the embedding's device."""
        table = self.weights.globals["token_embd.weight"]  # [V, H]
        return table[tokens.to(table.device)]  # [T, H]

    def attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                  n_ctx: int | None = None, static: bool = False) -> torch.Tensor:
        """``h + attn(rms_norm(h))`` for ``h [T, H]`` at ``positions [T]``; writes K/V into ``kv``.

        Causal over every cached position ``<=`` the query's position. ``n_ctx`` is the number of
        positions visible after this chunk (its largest position + 1): callers that know it pass it
        with ``positions`` already on ``h``'s device, so a CUDA layer needs no host synchronisation.
        ``static`` (a decode window captured as a CUDA graph, graphs.py): attend over the whole KV
        capacity with the causal mask built on the device from ``positions``, as on the CPU, so no
        shape depends on the step; ``n_ctx`` is then ignored.

        Off the CPU the scores go through torch's fused attention (``sdpa_attention``: flash, cuDNN
        or memory-efficient kernels, no ``[heads, T, S]`` scores in memory), which needs the chunk's
        positions to be the last ``T`` of ``n_ctx`` (what prefill chunks and decode windows are);
        the CPU keeps the masked matmul over the whole cache (bit-identical logits).
        """
        return self.attention_spans(layer, h, positions.to(h.device), [(kv, 0, h.shape[0], n_ctx)], static)

    def attention_spans(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
                        spans: list[tuple[KVCache, int, int, int | None]], static: bool = False) -> torch.Tensor:
        """``attention`` of a prompt batch: rows ``[a, b)`` of ``h [T, H]`` (at ``positions [T]``, on ``h``'s
        device) are one session's chunk for each span ``(kv, a, b, n_ctx)``. The norm, the projections and
        RoPE run over every row at once (their rows do not depend on the others: ops/matmul.py on the
        CPU), the K/V writes and the attention per session."""
        w = self.weights.at(layer, h.device)
        x = rms_norm(h, w["attn_norm.weight"], self.spec.rms_norm_eps, self.kernels.fused_norms)  # [T, H]
        return h + self.attention_out(layer, x, positions, spans, static)

    def attention_out(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                      spans: list[tuple[KVCache, int, int, int | None]], static: bool = False) -> torch.Tensor:
        """The attention block's output ``[T, H]`` of normed ``x [T, H]`` (``attention_spans`` less its norm and
        residual add); writes the rows' K/V."""
        if len(spans) == 1 and spans[0][1] == 0 and spans[0][2] == x.shape[0]:  # one session's rows: no slices
            kv, _, _, n_ctx = spans[0]
            q = self.qkv_write(layer, x, positions, kv)  # [T, nh, D]
            attended = self.attend(layer, q, positions, kv, n_ctx, static)  # [T, nh*D]
        elif all(self._cpu_kv(layer, x, kv) for kv, *_ in spans):  # one product; a session's rows written by one call
            qkv, inv_freq, mscale = self._cpu_qkv_product(layer, x)
            parts = [self.attend(layer, self._cpu_rope_write(layer, qkv[a:b], inv_freq, mscale, positions[a:b], kv),
                                 positions[a:b], kv, n_ctx, static) for kv, a, b, n_ctx in spans]  # [b - a, nh*D] each
            attended = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            q, k, v = self.qkv(layer, x, positions)  # [T, nh, D], [T, nkv, D], [T, nkv, D]
            parts = []
            for kv, a, b, n_ctx in spans:
                kv.write(layer, positions[a:b], k=k[a:b], v=v[a:b])
                parts.append(self.attend(layer, q[a:b], positions[a:b], kv, n_ctx, static))  # [b - a, nh*D]
            attended = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._projected(layer, attended)

    def attention_packed(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
                         packed: PackedKV) -> torch.Tensor:
        """``attention_spans`` of sessions that start at position 0, packed end to end in ``h [T, H]``: every
        row's K/V written where ``packed`` says, then one causal attention of each session over its own rows
        (``packed_causal_attention``): a fixed sequence of device ops, what a CUDA graph of a prompt pass
        replays. Only for the plain attention of this class (``packs_prompts``)."""
        x = rms_norm(h, self.weights.at(layer, h.device)["attn_norm.weight"], self.spec.rms_norm_eps,
                     self.kernels.fused_norms)  # [T, H]
        q, k, v = self.qkv(layer, x, positions)  # [T, nh, D], [T, nkv, D], [T, nkv, D]
        packed.write(layer, k, v)
        return h + self._projected(layer, packed_causal_attention(q, k, v, packed.cu_seqlens, packed.max_len))

    @property
    def packs_prompts(self) -> bool:
        """Whether ``attention_packed`` computes this model's prompt attention: its attention is this class's
        (no model-specific attention, no heads split with a peer)."""
        cls = type(self)
        names = ("attention_spans", "attention_out", "attend", "qkv")
        return all(getattr(cls, name) is getattr(MoEModel, name) for name in names) and not self.head_splits

    def _projected(self, layer: int, attended: torch.Tensor) -> torch.Tensor:
        """The output projection (and its bias) of the heads' outputs ``attended [T, nh*D]``: ``[T, H]``."""
        w = self.weights.at(layer, attended.device)
        out = linear(attended, w["attn_output.weight"])  # [T, H]
        return out + w["attn_output.bias"] if "attn_output.bias" in w else out

    def qkv_write(self, layer: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """Queries ``[T, nh, D]`` of normed ``x [T, H]`` (``qkv``), its keys and values written into ``kv`` at
        ``positions``: on the CPU in float32 into a float32 cache, one call after the product
        (``strata::qkv_rope_cpu``, the same bits)."""
        if self._cpu_kv(layer, x, kv):
            return self._cpu_qkv_write(layer, x, positions, kv)
        q, k, v = self.qkv(layer, x, positions)  # [T, nh, D], [T, nkv, D], [T, nkv, D]
        kv.write(layer, positions, k=k, v=v)
        return q

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries ``[T, nh, D]``, keys and values ``[T, nkv, D]`` of normed ``x [T, H]``: the
        projections (and biases), the q/k norm and RoPE (``rope``) at ``positions`` (on x's device)."""
        if type(self).rope is MoEModel.rope and self._cpu_float(x):  # a model's own RoPE keeps its formulas
            return self._cpu_qkv(layer, x, positions)
        s, w = self.spec, self.weights.at(layer, x.device)
        T = x.shape[0]
        q = linear(x, w["attn_q.weight"])  # [T, nh*D]
        k = linear(x, w["attn_k.weight"])  # [T, nkv*D]
        v = linear(x, w["attn_v.weight"])  # [T, nkv*D]
        if s.has_attn_bias:
            q, k, v = q + w["attn_q.bias"], k + w["attn_k.bias"], v + w["attn_v.bias"]
        q = q.view(T, s.n_heads, s.head_dim)  # [T, nh, D]
        k = k.view(T, s.n_kv_heads, s.head_dim)  # [T, nkv, D]
        v = v.view(T, s.n_kv_heads, s.head_dim)  # [T, nkv, D]
        if s.has_qk_norm and x.device.type == "cpu":  # on CUDA fused with RoPE (``rope``)
            q = rms_norm(q, w["attn_q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(k, w["attn_k_norm.weight"], s.rms_norm_eps)
        q, k = self.rope(layer, q, k, positions)
        return q, k, v

    @staticmethod
    def _cpu_float(x: torch.Tensor) -> bool:
        """Whether ``x`` takes the CPU's float32 layer ops (``strata::norm_rope_cpu``, ``strata::route_cpu``;
        ops/cpu_kernels.py): float32 on the CPU with the CPU kernels loaded."""
        return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels()

    def _cpu_kv(self, layer: int, x: torch.Tensor, kv: KVCache) -> bool:
        """Whether ``qkv_write`` takes ``strata::qkv_rope_cpu``: this class's own ``qkv`` and ``rope`` on float32
        CPU rows, and a cache that stores ``layer``'s K/V as float32 rows (not quantized) by ``KVCache.write``
        (a cache class with a write of its own gets its write called)."""
        if (type(self).qkv is not MoEModel.qkv or type(self).rope is not MoEModel.rope or kv.kv_format is not None
                or type(kv).write is not KVCache.write):
            return False
        pools = kv.pool_rows(layer)
        return pools["k"].dtype == pools["v"].dtype == torch.float32 and self._cpu_float(x)

    def _cpu_qkv_product(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The CPU's float32 q/k/v rows ``[T, (nh + 2 nkv) D]`` of ``x`` (the three projections as one product,
        ``DenseWeights.qkv``: each output the bits of its own projection's) and RoPE's angles and scale."""
        D = self.spec.head_dim
        weight, bias, _ = self.weights.qkv(layer, x.device)
        qkv = linear_cpu(x, weight)  # [T, (nh + 2 nkv) D]
        if bias is not None:
            qkv = qkv + bias
        inv_freq, mscale = self.rope_tables(x.device, D)
        if inv_freq is None:
            inv_freq = self._plain_freq.get(D)
            if inv_freq is None:  # the angles ``rope_cos_sin`` computes, made once
                inv_freq = self._plain_freq[D] = plain_inv_freq(D, self.spec.rope_theta)  # [D/2]
        return qkv, inv_freq, mscale

    def _qk_norms(self, layer: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The q and k norms' weights of ``layer`` on ``device`` (None without them)."""
        if not self.spec.has_qk_norm:
            return None, None
        w = self.weights.at(layer, device)
        return w["attn_q_norm.weight"], w["attn_k_norm.weight"]

    def _cpu_qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``qkv`` on the CPU in float32: one product, q and k normed and rotated by one call each."""
        s = self.spec
        T, D = x.shape[0], s.head_dim
        qkv, inv_freq, mscale = self._cpu_qkv_product(layer, x)
        q_size, kv_size = s.n_heads * D, s.n_kv_heads * D
        q = qkv[:, :q_size].view(T, s.n_heads, D)  # [T, nh, D] (a view: the op reads it in place)
        k = qkv[:, q_size:q_size + kv_size].view(T, s.n_kv_heads, D)  # [T, nkv, D]
        v = qkv[:, q_size + kv_size:].view(T, s.n_kv_heads, D)  # [T, nkv, D]
        q_norm, k_norm = self._qk_norms(layer, x.device)
        eps = s.rms_norm_eps
        q = norm_rope_cpu(q, q_norm, eps, positions, inv_freq, mscale)  # [T, nh, D]
        k = norm_rope_cpu(k, k_norm, eps, positions, inv_freq, mscale)  # [T, nkv, D]
        return q, k, v

    def _cpu_qkv_write(self, layer: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """``qkv_write`` on the CPU in float32: one product, then one call norms and rotates q and k and writes
        k and v into the cache's pool rows (``_cpu_qkv`` and ``kv.write``'s bits)."""
        return self._cpu_rope_write(layer, *self._cpu_qkv_product(layer, x), positions, kv)

    def _cpu_rope_write(self, layer: int, qkv: torch.Tensor, inv_freq: torch.Tensor, mscale: float,
                        positions: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """Queries ``[T, nh, D]`` of one session's q/k/v rows ``qkv`` (``_cpu_qkv_product``'s) at ``positions``:
        q and k normed and rotated and k and v written into ``kv``'s pool rows by one ``strata::qkv_rope_cpu``."""
        s = self.spec
        keys, values, row_ids = kv.write_pools(layer)  # [blocks, block size, nkv, D] each, int64 row per position
        return qkv_rope_cpu(qkv, *self._qk_norms(layer, qkv.device), s.rms_norm_eps, positions, inv_freq, mscale,
                            s.n_heads, s.n_kv_heads, keys, values, row_ids, check_rows=False)  # the cache's rows

    def rope(self, layer: int, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``, ``k`` rotated at ``positions``; off the CPU the q/k norm and RoPE are fused per
        tensor (one kernel each on CUDA), on the CPU the norm was applied by ``qkv``."""
        s = self.spec
        inv_freq, mscale = self.rope_tables(q.device, s.head_dim)
        if q.device.type != "cpu":
            w = self.weights.at(layer, q.device)
            q = norm_rope(q, positions, s.rope_theta, w["attn_q_norm.weight"] if s.has_qk_norm else None,
                          s.rms_norm_eps, self.kernels.fused_norms, inv_freq, mscale)
            k = norm_rope(k, positions, s.rope_theta, w["attn_k_norm.weight"] if s.has_qk_norm else None,
                          s.rms_norm_eps, self.kernels.fused_norms, inv_freq, mscale)
            return q, k
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_theta, inv_freq, mscale)  # [T, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, kv: KVCache, n_ctx: int | None,
               static: bool) -> torch.Tensor:
        """``[T, nh*D]``: causal attention of ``q [T, nh, D]`` over the layer's cached K/V (see ``attention``);
        a prompt chunk's heads split with a peer where ``head_splits`` says so (equal output). A quantized
        cache (kvquant.py) takes the masked attention on every device, dequantizing a key block at a time,
        with every head on the layer's device; off the CPU a prompt chunk instead dequantizes the layer's
        visible rows for one fused attention (``dequantized_sdpa``) where they fit its bound."""
        if kv.kv_format is not None:
            keys, values = kv.read(layer, self.masked_context(q, positions, kv, n_ctx, static))  # QuantizedRows
            if q.device.type != "cpu" and self.kernels.device_sdpa and not static and q.shape[0] > 1:
                out = dequantized_sdpa(q, keys, values, positions)  # a prompt chunk: one fused attention
                if out is not None:
                    return out
            return masked_attention(q, keys, values, positions)
        split = self.head_splits.get(layer)
        if q.device.type != "cpu" and self.kernels.device_sdpa:  # flash / cuDNN / memory-efficient kernels
            if static:
                n_ctx = kv.max_tokens
            elif n_ctx is None:
                n_ctx = int(positions.max()) + 1
            keys, values = kv.read(layer, n_ctx)  # [S, nkv, D]

            def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
                return sdpa_attention(q, keys, values, positions, static)
        else:
            n = self.masked_context(q, positions, kv, n_ctx, static)
            if q.device.type == "cpu" and q.dtype == torch.float32 and (split is None or q.shape[0] == 1) \
                    and cpu_kernels():
                keys, values, rows = kv.paged(layer, n)  # the CPU kernel follows the row ids: no gather
                if keys.dtype == torch.float32:
                    return attention_cpu(q, keys, values, positions, rows=rows, check_rows=False)  # its own pool's
            keys, values = kv.read(layer, n)  # [S, nkv, D]
            attend = masked_attention
        if split is not None and q.shape[0] > 1 and not static:
            return split(q, keys, values, positions, attend)
        return attend(q, keys, values, positions)

    @staticmethod
    def masked_context(q: torch.Tensor, positions: torch.Tensor, kv: KVCache, n_ctx: int | None,
                       static: bool) -> int:
        """How many cached positions the masked attention reads: the whole cache in a static (captured)
        window; on the CPU ``n_ctx`` rounded up to whole ``ATTN_BLOCK`` s, so every key block a query
        sees has the shape it has in any chunk or batch (logits bit-identical across both), and the
        whole cache when ``n_ctx`` is not given (no host read); else ``n_ctx`` (read from ``positions``
        when not given)."""
        if static or (q.device.type == "cpu" and n_ctx is None):
            return kv.max_tokens
        if q.device.type == "cpu":
            return min(kv.max_tokens, -(-n_ctx // ATTN_BLOCK) * ATTN_BLOCK)
        return n_ctx if n_ctx is not None else int(positions.max()) + 1

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router for normed ``x [T, H]``: ``(expert_ids [T, k], weights [T, k])``.

        Softmax over all experts, top-k, optional renormalisation, optional scale.
        """
        s = self.spec
        logits = linear(x, self.weights.at(layer, x.device)["ffn_gate_inp.weight"])  # [T, E]
        if self._cpu_float(x):  # one call on the CPU (ops/cpu_kernels.py)
            return route_cpu(logits, s.n_experts_used, s.norm_topk_prob, s.expert_weights_scale, _MIN_WEIGHT_SUM)
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, s.n_experts_used, dim=-1)  # [T, k]
        return ids, self.finish_weights(weights).to(x.dtype)

    def finish_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weights ``[T, k]`` renormalised (``norm_topk_prob``, the sum clamped as
        llama.cpp clamps it) and scaled (``expert_weights_scale``)."""
        s = self.spec
        if s.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)
        if s.expert_weights_scale != 1.0:
            weights = weights * s.expert_weights_scale
        return weights

    def moe(self, layer: int, h: torch.Tensor, expert_rows: ExpertRows) -> torch.Tensor:
        """``h + moe(rms_norm(h))`` for ``h [T, H]``: routed experts via ``expert_rows`` (+ shared expert)."""
        s, w = self.spec, self.weights.at(layer, h.device)
        x = rms_norm(h, w[self.ffn_norm], s.rms_norm_eps, self.kernels.fused_norms)  # [T, H]
        return h + self.moe_out(layer, x, expert_rows)

    def moe_out(self, layer: int, x: torch.Tensor, expert_rows: ExpertRows) -> torch.Tensor:
        """The MoE block's output ``[T, H]`` of normed ``x [T, H]`` (``moe`` less its norm and residual add)."""
        s, w = self.spec, self.weights.at(layer, x.device)
        out = self._cpu_routed(layer, x, expert_rows, w["ffn_gate_inp.weight"])  # [T, H] or None
        if out is None:
            ids, weights = self.route(layer, x)  # [T, k], [T, k]
            out = expert_rows(layer, x, ids, weights)  # [T, H]
        if s.has_shared_expert:
            gate = batch_invariant(torch.sigmoid, linear(x, w["ffn_gate_inp_shexp.weight"][None, :]))  # [T, 1]
            ffn = (batch_invariant(F.silu, linear(x, w["ffn_gate_shexp.weight"]))
                   * linear(x, w["ffn_up_shexp.weight"]))  # [T, Fs]
            out = out + gate * linear(ffn, w["ffn_down_shexp.weight"])  # [T, H]
        return out

    def _cpu_routed(self, layer: int, x: torch.Tensor, expert_rows: ExpertRows,
                    router: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' output ``[T, H]`` of normed ``x`` in one call where ``expert_rows`` offers it
        (``routed_cpu``: a CPU cache holding the layer whole) and this class routes as ``route`` does on float32
        CPU rows (the same bits); else None, with nothing done."""
        routed = getattr(expert_rows, "routed_cpu", None)
        if routed is None or type(self).route is not MoEModel.route or not self._cpu_float(x):
            return None
        s = self.spec
        return routed(layer, x, router, s.n_experts_used, s.norm_topk_prob, s.expert_weights_scale, _MIN_WEIGHT_SUM)

    def takes_cpu_layer(self, layer: int, h: torch.Tensor, kv: KVCache) -> bool:
        """Whether ``cpu_layer`` runs ``layer`` of one session's rows ``h``: this class's own attention and MoE
        blocks on float32 CPU rows with float32 weights, into a float32 cache (``qkv_write``'s fused op)."""
        if not _own_layer_blocks(type(self)):
            return False
        norm = self.weights.at(layer, h.device)["attn_norm.weight"]
        return self._cpu_kv(layer, h, kv) and norm.dtype == torch.float32

    def cpu_layer(self, layer: int, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                  kv: KVCache, n_ctx: int | None, expert_rows: ExpertRows,
                  static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``moe(attention(h + delta))`` of one session's rows ``h [T, H]`` (``takes_cpu_layer``) as the residual
        stream and this layer's pending MoE output: their sum is the layer's output, and the add rides in the
        next layer's norm (``delta``: the previous layer's, or None). Each residual add and the norm after it
        are one call (``strata::add_rms_norm_cpu``): the bits of ``attention`` and ``moe``."""
        w, eps = self.weights.at(layer, h.device), self.spec.rms_norm_eps
        if delta is None:
            x = rms_norm(h, w["attn_norm.weight"], eps, self.kernels.fused_norms)  # [T, H]
        else:
            h, x = add_rms_norm_cpu(h, delta, w["attn_norm.weight"], eps)  # [T, H] each
        out = self.attention_out(layer, x, positions, [(kv, 0, h.shape[0], n_ctx)], static)  # [T, H]
        h, x = add_rms_norm_cpu(h, out, w[self.ffn_norm], eps)  # [T, H] each
        return h, self.moe_out(layer, x, expert_rows)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + output projection: ``h [T, H]`` -> float32 logits ``[T, V]``."""
        g = self.weights.globals
        x = rms_norm(h, g["output_norm.weight"], self.spec.rms_norm_eps, self.kernels.fused_norms)  # [T, H]
        return self.weights.product(x, "output.weight", batch_invariant=self.kernels.batch_invariant).float()  # [T, V]

    def forward(self, tokens: torch.Tensor, kv: KVCache, expert_rows: ExpertRows) -> torch.Tensor:
        """All layers on the CPU for ``tokens [T]`` appended after ``kv.n_tokens``; advances ``kv``;
        logits ``[T, V]`` (the reference forward the engine's placements are checked against)."""
        positions = torch.arange(kv.n_tokens, kv.n_tokens + tokens.shape[0])  # [T]
        kv.reserve(kv.n_tokens + tokens.shape[0])
        h = self.embed(tokens)  # [T, H]
        for layer in range(self.spec.n_layers):
            h = self.moe(layer, self.attention(layer, h, positions, kv), expert_rows)
        kv.advance(tokens.shape[0])
        return self.head(h)


@functools.cache  # asked every layer of a decode token
def _own_layer_blocks(cls: type[MoEModel]) -> bool:
    """Whether ``cls`` keeps ``MoEModel``'s attention and MoE blocks (``_CPU_LAYER_METHODS``), which
    ``MoEModel.cpu_layer`` stands for."""
    return all(getattr(cls, name) is getattr(MoEModel, name) for name in _CPU_LAYER_METHODS)
