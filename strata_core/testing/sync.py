"""Check DESIGN's invariant 3: code that must enqueue work without waiting on the device.

``no_host_sync`` raises on CUDA at the first synchronisation; ``HostReads`` counts, on any device
(the CPU included, so in CI), the reads of tensor values back to the host that would be one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

#: the tensor methods that read device values back to the host
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy")


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


class HostReads:
    """Counts host reads of tensor values (``HOST_READS``, plus any function ``watch``ed) made while
    ``counting()`` is active. Patches through ``monkeypatch``, so it is undone after the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch, self.reads, self._active = monkeypatch, [], False
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                self.reads.append(name)
            return real(*args, **kwargs)
        return wrapper

    def watch(self, owner: object, name: str) -> None:
        """Count calls of ``owner.name`` too (e.g. a routine that reads the routing on the host)."""
        self.monkeypatch.setattr(owner, name, self._counted(name, getattr(owner, name)))

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[str]]:
        """Count inside the block; yields the list of reads (names, in order)."""
        self._active = True
        try:
            yield self.reads
        finally:
            self._active = False
