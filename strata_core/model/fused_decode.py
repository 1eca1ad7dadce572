"""A decode window's layer as few fused launches: the CUDA path of the runner's decode loop.

The eager layer loop runs ~35 kernels a layer for one token (norms, three projections, RoPE, the
KV index writes, the attention mask, the router's softmax / top-k / renormalisation, the rows and
their combination, residual adds, the concatenation of the sessions). Here a layer of a window of
B sessions is

    add_rms_norm -> QKV (one product) -> rope_kv_write -> decode_attention -> output product
    -> add_rms_norm -> router product -> route_topk -> expert rows (strata::moe_decode on CUDA)

with every session in one launch each (the ``strata::`` ops of strata_core/ops/decode.py); the
residual adds ride in the next norm, and the last one closes the segment. The sessions' paged KV
(model/kvpool.py) is reached through an address table (``kv_tables``: ``[layers, B, 3]`` int64 on the
device: each layer's key and value pool and each session's device block table), which a CUDA graph
of the window keeps as a static buffer refilled before each replay (graphs.py), so a new session
does not capture again; a session's block table is a fixed device tensor its cache refills in
place as it grows, so a graph reads its new blocks too.

Where the GGUF stores them as Q8_0, the QKV, attention output and router products (and the head)
read repacked Q8_0 copies of their weights (``strata::q8_linear``: 1.06 bytes a value where the bf16
copy is 2), built once per (layer, device) at load by :func:`place_q8_copies` and counted
with the dense part before the expert cache is sized; the float copies stay for prompts and the eager
paths.

A quantized KV (``--kv-type q8_0`` or ``int8``) goes through the ``strata::`` ops of
strata_core/ops/decode_q.py instead, whose address tables also name the pools' scales (``[layers, B, 5]``).

Applies to the plain Qwen-style ``MoEModel`` (no shared expert, no output bias) with a head dim
the kernels serve and a KV they read; anything else takes the eager layer (``why_not_fused`` says why). On the CPU the
same ops run their references, which is how CI checks this path against the eager loop.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

from strata_core.config import StrataSettings
from strata_core.experts.rows import ExpertRows
from strata_core.experts.sizing import GIB, check_dense_budget
from strata_core.gguf.reader import GGUFFile
from strata_core.model.ops import rms_norm
from strata_core.model.transformer import _MIN_WEIGHT_SUM, MoEModel  # llama.cpp's top-k weight sum clamp
from strata_core.model.weights import QKV_NAMES, dense_product, q8_sources
from strata_core.ops.decode import (INVARIANT_SPLITS, add_rms_norm, decode_attention, fused_decode_supported,
                                    rope_kv_write, route_topk)
from strata_core.ops.decode_q import decode_attention_q, fused_quantized_supported, rope_kv_write_q
from strata_core.ops.dense_q8 import Q8Matrix
from strata_core.plugin.placement import DeviceSlot, Placement
from strata_core.runtime.session import Session

__all__ = ["decode_layer", "kv_tables", "place_q8_copies", "why_not_fused"]

log = logging.getLogger(__name__)

#: The layer weights and globals whose Q8_0 copies the fused path reads.
Q8_LAYER_NAMES = (*(f"{n}.weight" for n in QKV_NAMES), "attn_output.weight", "ffn_gate_inp.weight")
Q8_GLOBAL_NAMES = ("output.weight",)


def why_not_fused(model, device: torch.device) -> str | None:
    """Why ``model``'s decode layers on ``device`` cannot take the fused path, or None when they can."""
    s = model.spec
    if device.type != "cuda":
        return f"the decode runs on {device}, not a CUDA device"
    if type(model) is not MoEModel:
        return f"the {s.architecture} forward has layers of its own"
    if s.has_shared_expert:
        return "the model has a shared expert"
    if not fused_decode_supported(s.head_dim):
        return f"no fused kernels for head dim {s.head_dim} (or no Triton)"
    kv_type = model.kernels.kv_type
    if kv_type != "auto" and not fused_quantized_supported(kv_type, s.head_dim, device):
        return f"the fused kernels do not read the {kv_type} rows of the KV cache (--kv-type)"
    return None


def _layer_pools(sessions: Sequence[Session], layer: int) -> tuple[torch.Tensor, ...]:
    """``layer``'s key and value pools (``[n_blocks, block_size, n_kv_heads, D]``), one for every session
    of a window (their layer lives on one device slot), and their scales where the KV is quantized."""
    pools = [session.kv.pool_rows(layer) for session in sessions]
    if any(p["k"] is not pools[0]["k"] for p in pools):
        raise ValueError(f"the sessions of a decode window keep layer {layer} on different device slots")
    return tuple(pools[0][name] for name in _POOL_NAMES if name in pools[0])


#: a layer's pool tensors in the order of the address tables (the scales only where the KV is quantized)
_POOL_NAMES = ("k", "v", "k_scale", "v_scale")


def _block_tables(sessions: Sequence[Session], layer: int) -> torch.Tensor:
    """int32 ``[B, max_blocks]``: each session's block table of ``layer``'s device slot."""
    return torch.stack([session.kv.block_table(layer) for session in sessions])


def kv_tables(sessions: Sequence[Session], layers: range) -> torch.Tensor:
    """int64 ``[len(layers), B, 3]`` on the host (``[..., 5]`` with a quantized KV: the key and value scales
    after them): per layer and session the addresses of the layer's key
    and value pools and of the session's block table on that device slot: what the fused kernels read
    to reach the paged KV (each session's rows built once per version of its cache: a window of B
    sessions costs B lookups; a block table is refilled in place, so growing keeps its version)."""
    return torch.stack([_addresses(session.kv, layers) for session in sessions], dim=1)


_ADDRESSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KVCache -> (version, {layers: [L, 3]})


def _addresses(kv, layers: range) -> torch.Tensor:
    """int64 ``[len(layers), 3]``: ``kv``'s key pool, value pool and block table addresses of ``layers`` (and
    the key and value scales', ``[len(layers), 5]``, where the KV is quantized)."""
    version, tables = _ADDRESSES.get(kv, (None, {}))
    if version != kv.version:
        tables = {}
        _ADDRESSES[kv] = (kv.version, tables)
    if layers not in tables:
        rows = [[kv.pool_rows(i)["k"].data_ptr(), kv.pool_rows(i)["v"].data_ptr(), kv.block_table(i).data_ptr()]
                + [kv.pool_rows(i)[name].data_ptr() for name in _POOL_NAMES[2:] if name in kv.pool_rows(i)]
                for i in layers]
        tables[layers] = torch.tensor(rows, dtype=torch.int64).view(len(layers), -1)
    return tables[layers]


def place_q8_copies(model, gguf_file: GGUFFile, settings: StrataSettings, placement: Placement,
                    slots: dict[int, DeviceSlot], dense_bytes: dict[torch.device, int]) -> dict[torch.device, int]:
    """Put Q8_0 copies of the decode products' weights (:data:`Q8_LAYER_NAMES` where ``gguf_file`` stores
    them as Q8_0) on the CUDA device computing each layer in the decode placement, if its layers take
    the fused path, and of the head (:data:`Q8_GLOBAL_NAMES`) on the main device if it does; first
    checks that they fit with the dense part (``dense_bytes``: BudgetError before any copy); logs their
    bytes. Returns ``dense_bytes`` plus those bytes: what the expert cache's sizing must leave.
    Nothing when ``--dense-q8`` is off."""
    if not settings.dense_q8:
        return dense_bytes
    where = {(layer, slots[p.device].device) for layer, p in enumerate(placement.layers("decode")) if p.device in slots}
    if placement.main in slots:
        where.add((None, slots[placement.main].device))
    where = {(layer, d) for layer, d in where if why_not_fused(model, d) is None}
    sources = q8_sources(gguf_file, model.spec, Q8_LAYER_NAMES, Q8_GLOBAL_NAMES) if where else {}
    extra = model.weights.q8_bytes(sources, where)
    if not extra:
        return dense_bytes
    total = {d: dense_bytes.get(d, 0) + extra.get(d, 0) for d in {*dense_bytes, *extra}}
    check_dense_budget(settings, total)
    model.weights.place_q8(sources, where)
    for device, n in sorted(extra.items(), key=lambda item: str(item[0])):
        log.info("%s: Q8_0 copies of the dense decode products (strata::q8_linear): %.2f GiB (%d bytes)",
                 device, n / GIB, n)
    return total


def decode_layer(model, layer: int, hidden: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                 sessions: Sequence[Session], rows: ExpertRows,
                 table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a decode window: ``hidden [B, H]`` plus the previous layer's pending ``delta``
    (its expert rows, or None before the first layer; the residual add rides in this layer's norm)
    for one token of each of ``sessions`` at ``positions [B]``; writes their K/V. Returns the residual
    stream and this layer's pending rows: the layer's output is their sum. ``table`` (this layer's
    ``kv_tables`` row on the device, or None: each op builds its own) is how the kernels reach the caches."""
    s = model.spec
    eps = s.rms_norm_eps
    w = model.weights.at(layer, hidden.device)
    if delta is None:
        x = rms_norm(hidden, w["attn_norm.weight"], eps, model.kernels.fused_norms)
    else:
        hidden, x = add_rms_norm(hidden, delta, w["attn_norm.weight"], eps)
    weight, bias, q8 = model.weights.qkv(layer, hidden.device)
    invariant = model.kernels.batch_invariant
    qkv = dense_product(x, weight, q8, invariant)  # [B, (nh + 2 nkv) D]
    if bias is not None:
        qkv = qkv + bias
    pools = _layer_pools(sessions, layer)  # keys, values (and their scales: a quantized KV)
    # the CPU references read the block tables; CUDA kernels given ``table`` read it instead
    blocks = _block_tables(sessions, layer) if table is None or hidden.device.type != "cuda" else None
    write, attend = (rope_kv_write, decode_attention) if len(pools) == 2 else (rope_kv_write_q, decode_attention_q)
    q = write(qkv, positions, w.get("attn_q_norm.weight") if s.has_qk_norm else None,
              w.get("attn_k_norm.weight") if s.has_qk_norm else None, s.rope_theta, eps, s.n_heads,
              s.n_kv_heads, *pools, blocks, table, *model.rope_tables(hidden.device, s.head_dim))  # [B, nh, D]
    out = attend(q, positions, *pools, blocks, table, INVARIANT_SPLITS if invariant else 0)  # [B, nh D]
    hidden, x = add_rms_norm(hidden, model.weights.product(out, "attn_output.weight", layer, invariant),
                             w["ffn_norm.weight"], eps)
    logits = model.weights.product(x, "ffn_gate_inp.weight", layer, invariant)  # [B, E]
    ids, weights = route_topk(logits, s.n_experts_used, s.norm_topk_prob, s.expert_weights_scale,
                              _MIN_WEIGHT_SUM)
    return hidden, rows(layer, x, ids, weights)  # [B, H] (float32 weights: the CUDA kernel reads them so)
