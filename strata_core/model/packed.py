"""Where a packed prompt pass writes its K/V: sessions starting at position 0, their rows end to end in one
batch (``MoEModel.attention_packed``), each row's K/V at a row id of one device slot's pools."""

from __future__ import annotations

import torch

from strata_core.model.kvcache import KVCache

__all__ = ["PackedKV"]


class PackedKV:
    """A packed prompt batch's K/V destination and its sequences' bounds (device tensors a CUDA graph reads).

    :param pools: a cache on the device slot every session of the batch keeps its layers in: its pools are
        theirs (``KVCache.pool_rows``), with float rows (no quantized KV)
    :param kv_rows: int64 ``[T]``: each row's row id in those pools
    :param cu_seqlens: int32 ``[S + 1]``: sequence s is rows ``[cu[s], cu[s + 1])``
    :param max_len: an upper bound of every sequence's length
    """

    def __init__(self, pools: KVCache, kv_rows: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int):
        if pools.kv_format is not None:
            raise ValueError(f"a packed prompt pass writes float K/V rows, not {pools.kv_format}")
        self.pools, self.kv_rows, self.cu_seqlens, self.max_len = pools, kv_rows, cu_seqlens, max_len

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the rows' keys and values ``[T, nkv, D]`` of ``layer`` at their row ids."""
        rows = self.pools.pool_rows(layer)
        for name, value in (("k", k), ("v", v)):
            target = rows[name].view(-1, *rows[name].shape[2:])  # [n_blocks * block_size, nkv, D]
            target.index_copy_(0, self.kv_rows, value.to(target.dtype))
