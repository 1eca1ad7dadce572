"""The grammar mask of a window: one bit per token for each constrained row.

:func:`fill_bitmask` asks every constrained row's matcher, in parallel on llguidance's threads, for
the tokens its grammar allows next and writes them into one int32 bitmask on the host (bit ``t % 32``
of word ``t // 32``: token ``t`` allowed); the sampler copies it to the logits' device once per
window and :func:`apply_bitmask` sets every forbidden logit of those rows to -inf. Rows without a
grammar are not read or written.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import torch

from strata_core.serving.grammar import TokenConstraint

__all__ = ["apply_bitmask", "fill_bitmask"]

_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _shared_executor() -> llguidance.LLExecutor:
    """The process's llguidance thread pool, started on first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def fill_bitmask(constraints: Sequence[TokenConstraint], n_vocab: int) -> torch.Tensor:
    """The allowed tokens of each of ``constraints`` next, a row each: ``[R, ceil(n_vocab / 32)]`` int32
    on the host (pinned when CUDA is there, for a non-blocking copy)."""
    words = (n_vocab + 31) // 32
    mask = torch.empty(len(constraints), words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    _shared_executor().unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)],
                                               mask.data_ptr(), words * 4, len(constraints))
    return mask


def apply_bitmask(x: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``x`` ``[B, V]`` (out of place) with each of ``rows``' forbidden tokens at -inf; ``mask`` is
    their bitmask on ``x``'s device, in the order of ``rows``. The other rows are left as they are."""
    n_rows, vocab = x.shape
    bits = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((mask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
    if len(rows) == n_rows:
        return x.masked_fill(~allowed, -torch.inf)
    index = torch.tensor(rows, dtype=torch.long, device=x.device)
    return x.index_copy(0, index, x.index_select(0, index).masked_fill(~allowed, -torch.inf))
