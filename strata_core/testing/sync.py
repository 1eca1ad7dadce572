"""Check DESIGN's invariant 3 on CUDA: code that must enqueue work without waiting on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise if the block synchronises the host with a CUDA device (``.item()``, a pageable copy,
    ``nonzero``...); work queued before the block is finished first so it cannot be blamed."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
