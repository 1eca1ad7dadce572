"""Small numerical building blocks of the forward (float32 math, HF-identical formulas)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from strata_core.model.kvquant import QuantizedRows
from strata_core.ops.cpu_kernels import attention_cpu, cpu_kernels, rms_norm_cpu
from strata_core.ops.dense import norm_rope_cuda, rms_norm_cuda
from strata_core.ops.matmul import matmul

__all__ = ["apply_rope", "masked_attention", "norm_rope", "packed_causal_attention", "rms_norm", "rope_cos_sin",
           "sdpa_attention"]

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, returned in ``x``'s dtype.

    On CUDA with ``fused`` (``ForwardKernels.fused_norms``) one Triton kernel (``strata_core.ops.dense``)
    computes the same formula; on the CPU in float32 ``strata::rms_norm_cpu`` (one call, each row's sum
    in a fixed order: ops/cpu_kernels.py) where the CPU kernels are loaded; otherwise the torch formula."""
    if x.device.type == "cuda" and fused and rms_norm_cuda is not None:
        return rms_norm_cuda(x, weight, eps)
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and cpu_kernels():
        return rms_norm_cpu(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def plain_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[head_dim / 2]`` float32: plain RoPE's angle per position of each rotated pair,
    ``theta ** (-2i / head_dim)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
                 mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """NEOX-style RoPE tables ``cos, sin [T, head_dim]`` for ``positions [T]`` (float32).

    ``inv_freq [head_dim / 2]`` replaces the plain ``theta ** (-2i / head_dim)`` angles (a scaled
    RoPE, e.g. YaRN); ``mscale`` multiplies both tables (YaRN's attention factor)."""
    if inv_freq is None:
        inv_freq = plain_inv_freq(head_dim, theta, positions.device)  # [D/2]
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, D]
    if mscale != 1.0:
        return emb.cos() * mscale, emb.sin() * mscale
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by halves (NEOX / HF ``rotate_half``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, D]
    return x * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, weight: torch.Tensor | None,
              eps: float, fused: bool = True, inv_freq: torch.Tensor | None = None,
              mscale: float = 1.0) -> torch.Tensor:
    """``x [T, heads, D]``: RMSNorm per head with ``weight`` (if given), then RoPE at ``positions [T]``
    (``inv_freq`` and ``mscale``: a scaled RoPE, as ``rope_cos_sin`` takes them).

    On CUDA with ``fused`` (``ForwardKernels.fused_norms``) one kernel, plain or scaled RoPE; otherwise
    (head dims whose half is not a power of two) the torch formulas: ``rms_norm``, ``rope_cos_sin`` and
    ``apply_rope``, exactly as the CPU path runs them.
    """
    half = x.shape[-1] // 2
    if x.device.type == "cuda" and fused and norm_rope_cuda is not None and half & (half - 1) == 0:
        return norm_rope_cuda(x, positions, theta, weight, eps, inv_freq, mscale)
    if weight is not None:
        x = rms_norm(x, weight, eps, fused)
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, inv_freq, mscale)  # [T, D]
    return apply_rope(x, cos, sin)


#: keys a block of the CPU's masked attention (``masked_attention``): the blocks past a chunk's last query are skipped
ATTN_BLOCK = 256


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention as masked products over the ``S`` cached positions: ``[T, nh*D]``.

    :param q: ``[T, nh, D]`` queries (RoPE applied); ``keys``/``values``: ``[S, nkv, D]``
    :param positions: ``[T]`` the queries' positions; key ``s`` is visible when ``s <= position``
        (and ``position - s < window`` when a window is given: llama.cpp's standard sliding window)
    :param sinks: ``[nh]`` a learned logit per head joining each softmax's denominator only
        (gpt-oss's attention sinks)

    The ``rep = nh / nkv`` query heads sharing a kv head are stacked as rows of one product with it
    (``[nkv, rep * T, D]``), so the keys and values are read as they are, never repeated per head.
    On the CPU the keys go in fixed blocks of ``ATTN_BLOCK`` positions merged by an online softmax:
    a block no key of which a row sees adds exactly nothing to that row (its scale is exp(0) = 1, its
    terms exp(-inf) = 0), so every row's logits are bit-identical however many keys past its own
    position are given (the chunk, the batch, the capacity: what the CPU path relies on), and a
    caller may give only the blocks up to its last query (``MoEModel.masked_context``). Elsewhere one product over all S, with no host read (a
    captured decode window runs it).

    Quantized keys and values (``QuantizedRows``, kvquant.py) take the blocked form off the CPU kernel,
    each key block dequantized to ``q``'s dtype as it is read (never the whole cache at once).

    On the CPU in float32 with the CPU kernels loaded, ``strata::attention_cpu`` computes it instead
    (ops/cpu_kernels.py): each row's arithmetic fixed by its own query and visible keys, so the rows do
    not depend on the chunk, the batch or the capacity either; quantized rows are dequantized for it.
    """
    T, nh, D = q.shape
    S, nkv = keys.shape[0], keys.shape[1]
    rep = nh // nkv
    if q.device.type == "cpu" and q.dtype == torch.float32 and cpu_kernels():
        if isinstance(keys, QuantizedRows):  # the kernel reads float rows: the layer's rows dequantized for the call
            keys, values = keys.rows(0, S, torch.float32), values.rows(0, S, torch.float32)
        return attention_cpu(q, keys.float(), values.float(), positions, window, sinks)
    if isinstance(keys, QuantizedRows):
        return _quantized_attention(q, keys, values, positions, window, sinks)
    keys = keys.to(q.dtype).transpose(0, 1)  # [nkv, S, D]
    values = values.to(q.dtype).transpose(0, 1)  # [nkv, S, D]
    rows = q.reshape(T, nkv, rep, D).permute(1, 2, 0, 3).reshape(nkv, rep * T, D)  # row r*T + t: head kv*rep + r
    row_positions = positions.repeat(rep)  # [rep*T]
    sink = None if sinks is None else sinks.float().view(nkv, rep, 1, 1).expand(nkv, rep, T, 1).reshape(nkv, rep * T, 1)
    if q.device.type == "cpu":
        out = _blocked_attention(rows, keys, values, row_positions, window, sink)
    else:
        scores = _masked_scores(rows, keys, row_positions, 0, window)  # [nkv, rep*T, S]
        if sink is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S]
        out = matmul(probs.to(q.dtype), values)  # [nkv, rep*T, D]
    return out.to(q.dtype).view(nkv, rep, T, D).permute(2, 0, 1, 3).reshape(T, nh * D)  # [T, nh*D]


def _masked_scores(rows: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, first: int,
                   window: int | None) -> torch.Tensor:
    """float32 scores ``[nkv, R, S']`` of ``rows [nkv, R, D]`` (at ``positions [R]``) against ``keys [nkv, S', D]``
    (positions ``first..``), -inf where a key is not visible."""
    scores = matmul(rows, keys.transpose(1, 2)) * rows.shape[-1] ** -0.5
    offset = positions[:, None] - torch.arange(first, first + keys.shape[1], device=rows.device)[None, :]  # [R, S']
    visible = offset >= 0 if window is None else (offset >= 0) & (offset < window)
    return scores.masked_fill(~visible, float("-inf")).float()


def _blocked_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       window: int | None, sink: torch.Tensor | None) -> torch.Tensor:
    """``masked_attention``'s CPU form: float32 ``[nkv, R, D]``, the key blocks of ``ATTN_BLOCK`` merged by an
    online softmax (the caller reads the keys only up to the blocks its queries see: ``masked_context``)."""
    return _online_softmax(rows, keys.shape[1], lambda first: (keys[:, first:first + ATTN_BLOCK],
                                                               values[:, first:first + ATTN_BLOCK]),
                           positions, window, sink)


#: most bytes of one layer's keys and values (in the compute dtype) a prompt chunk dequantizes at once for
#: the fused attention (``dequantized_sdpa``): 256K positions of Qwen3-30B-A3B's 4 kv heads of 128 in bf16
#: take 512 MiB; past it the blocked form runs
PROMPT_DEQUANT_BYTES = 1 << 30


def dequantized_sdpa(q: torch.Tensor, keys: QuantizedRows, values: QuantizedRows,
                     positions: torch.Tensor) -> torch.Tensor | None:
    """``sdpa_attention`` of a prompt chunk ``q [T, nh, D]`` (the last T of the S positions) over quantized
    rows: the layer's S keys and values dequantized to ``q``'s dtype for the call (transient, one layer at
    a time), then one fused attention (flash on CUDA), where the blocked form would make ~15 launches a
    block of ``ATTN_BLOCK`` keys (a 128K context: 512 blocks a layer a chunk). None where the dequantized
    rows would pass ``PROMPT_DEQUANT_BYTES``."""
    S, nkv, D = keys.shape
    if 2 * S * nkv * D * q.element_size() > PROMPT_DEQUANT_BYTES:
        return None
    return sdpa_attention(q, keys.rows(0, S, q.dtype), values.rows(0, S, q.dtype), positions)


def _quantized_attention(q: torch.Tensor, keys: QuantizedRows, values: QuantizedRows, positions: torch.Tensor,
                         window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``masked_attention`` over quantized rows: the blocked form, each block of ``ATTN_BLOCK`` keys and
    values dequantized to ``q``'s dtype when the online softmax reaches it: ``[T, nh*D]``."""
    T, nh, D = q.shape
    S, nkv = keys.shape[0], keys.shape[1]
    rep = nh // nkv
    rows = q.reshape(T, nkv, rep, D).permute(1, 2, 0, 3).reshape(nkv, rep * T, D)  # row r*T + t: head kv*rep + r
    row_positions = positions.repeat(rep)  # [rep*T]
    sink = None if sinks is None else sinks.float().view(nkv, rep, 1, 1).expand(nkv, rep, T, 1).reshape(nkv, rep * T, 1)

    def block(first: int) -> tuple[torch.Tensor, torch.Tensor]:
        last = min(S, first + ATTN_BLOCK)
        return (keys.rows(first, last, q.dtype).transpose(0, 1),  # [nkv, b, D]
                values.rows(first, last, q.dtype).transpose(0, 1))

    out = _online_softmax(rows, S, block, row_positions, window, sink)  # [nkv, rep*T, D]
    return out.to(q.dtype).view(nkv, rep, T, D).permute(2, 0, 1, 3).reshape(T, nh * D)  # [T, nh*D]


def _online_softmax(rows: torch.Tensor, S: int, block, positions: torch.Tensor, window: int | None,
                    sink: torch.Tensor | None) -> torch.Tensor:
    """Float32 ``[nkv, R, D]``: the attention of ``rows [nkv, R, D]`` over ``S`` keys given by ``block(first)
    -> (keys, values) [nkv, b, D]`` for the blocks of ``ATTN_BLOCK`` starting at ``first``, merged by an
    online softmax; ``sink [nkv, R, 1]`` joins the denominator only."""
    top = total = acc = None
    for first in range(0, S, ATTN_BLOCK):
        keys, values = block(first)
        scores = _masked_scores(rows, keys, positions, first, window)  # [nkv, R, b]
        block_top = scores.amax(dim=-1, keepdim=True)  # [nkv, R, 1]
        new_top = block_top if top is None else torch.maximum(top, block_top)
        shift = new_top.nan_to_num(0.0, 0.0, 0.0)  # a row that sees no key yet: every term exp(-inf) = 0
        weights = torch.exp(scores - shift)  # [nkv, R, b]
        part = matmul(weights.to(rows.dtype), values).float()  # [nkv, R, D]
        if top is None:
            total, acc = weights.sum(dim=-1, keepdim=True), part
        else:
            scale = torch.exp(top - shift)  # [nkv, R, 1]
            total, acc = total * scale + weights.sum(dim=-1, keepdim=True), acc * scale + part
        top = new_top
    if sink is not None:
        total = total + torch.exp(sink - top.nan_to_num(0.0, 0.0, 0.0))
    return acc / total


def sdpa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   static: bool = False) -> torch.Tensor:
    """Causal GQA attention through ``F.scaled_dot_product_attention``: ``[T, nh*D]``.

    :param q: ``[T, nh, D]`` queries (RoPE applied), in the compute dtype
    :param keys: ``[S, nkv, D]`` the cache's first S positions (``values`` the same)
    :param positions: ``[T]`` the queries' positions on the device; read only when ``static``
    :param static: mask built on the device from ``positions`` over all S (a captured decode window);
        otherwise the queries are the last T of the S positions (lower-right causal, no mask tensor)

    One query per kv-group row: with T == 1 the ``nh / nkv`` query heads sharing a kv head are
    folded into the query length (``[1, nkv, rep, D]``), so any SDPA backend serves GQA decode
    without repeating the keys; prompts use ``enable_gqa`` with a causal mask (flash on CUDA bf16).
    """
    T, nh, D = q.shape
    S, nkv = keys.shape[0], keys.shape[1]
    rep = nh // nkv
    k = keys.to(q.dtype).transpose(0, 1)[None]  # [1, nkv, S, D]
    v = values.to(q.dtype).transpose(0, 1)[None]  # [1, nkv, S, D]
    if T == 1:
        qf = q.view(nkv, rep, D)[None]  # [1, nkv, rep, D]
        mask = None
        if static:
            mask = (torch.arange(S, device=q.device) <= positions[0]).view(1, 1, 1, S)  # [1, 1, 1, S]
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=D ** -0.5)  # [1, nkv, rep, D]
        return out.reshape(1, nh * D)
    qh = q.transpose(0, 1)[None]  # [1, nh, T, D]
    gqa = {"enable_gqa": True} if rep > 1 else {}
    if static:
        mask = torch.arange(S, device=q.device)[None, :] <= positions[:, None]  # [T, S]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=D ** -0.5, **gqa)
    elif T == S:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=D ** -0.5, **gqa)
    else:
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=causal_lower_right(T, S), scale=D ** -0.5, **gqa)
    return out[0].transpose(0, 1).reshape(T, nh * D)  # [T, nh*D]


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int) -> torch.Tensor:
    """Causal GQA attention of sequences packed end to end, each over its own rows only: ``[T, nh*D]``.

    :param q: ``[T, nh, D]`` queries (RoPE applied); ``k``, ``v``: ``[T, nkv, D]`` the same rows' keys and values
    :param cu_seqlens: int32 ``[S + 1]`` on the device: sequence s is rows ``[cu[s], cu[s + 1])`` (a
        sequence may be empty; ``cu[-1] == T``); read on the device only, so a CUDA graph can replay it
    :param max_len: an upper bound of every sequence's length (host int)

    On CUDA one varlen FlashAttention launch (``aten::_flash_attention_forward``); elsewhere SDPA with a
    block-diagonal causal mask made on the device (``T x T``: the reference, for small T).
    """
    T, nh, D = q.shape
    if q.device.type == "cuda":
        out = torch.ops.aten._flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens,
                                                      cu_seqlens, max_len, max_len, 0.0, True, False,
                                                      scale=D ** -0.5)[0]  # [T, nh, D]
        return out.reshape(T, nh * D)
    rows = torch.arange(T, device=q.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)  # [T]: each row's sequence
    mask = (seq[:, None] == seq[None, :]) & (rows[None, :] <= rows[:, None])  # [T, T]
    gqa = {"enable_gqa": True} if nh != k.shape[1] else {}
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=D ** -0.5, **gqa)  # [1, nh, T, D]
    return out[0].transpose(0, 1).reshape(T, nh * D)
