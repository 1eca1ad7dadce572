"""``HostRegion``: a page-locked host buffer the arena fills in place, then registers with CUDA.

torch's pinned allocator page-locks a buffer as it allocates it: its pages are faulted in and registered
4 KiB at a time (on the H100 host 15.2 GiB of experts took 5.2 s to allocate, then 0.5 s to fill). A region
is anonymous memory asked for transparent huge pages (``MADV_HUGEPAGE``, where the kernel offers them),
faulted in by the fill's threads as they copy the experts into it, and registered once filled
(``cudaHostRegister``, the call torch's allocator makes with its host-register setting): a 2 MiB page is
one entry to lock where a 4 KiB page was one of 512. Kernels and copies use it as any pinned memory (device
code reads it through the same address). ``close`` unregisters it; a region left open is unregistered when
it is collected.
"""

from __future__ import annotations

import mmap
import weakref

import torch

__all__ = ["HostRegion", "transparent_huge_pages"]


def transparent_huge_pages(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``; ``unknown`` without one)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unknown"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def _register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for CUDA (RuntimeError naming the CUDA error when refused)."""
    error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))  # cudaHostRegisterDefault, as torch's
    if error:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {error})")


def _unregister(address: int) -> None:
    """Undo ``_register`` (errors ignored: it runs at teardown)."""
    torch.cuda.cudart().cudaHostUnregister(address)


class HostRegion:
    """``nbytes`` of host memory as a uint8 tensor (``tensor``), page-locked by ``register``."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError:  # a kernel without transparent huge pages: 4 KiB pages
                pass
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # [nbytes], nothing touched yet
        self._finalizer: weakref.finalize | None = None

    @property
    def registered(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def register(self) -> None:
        """Page-lock the region for CUDA (once; after the fill, so the fill's threads fault its pages in)."""
        if self.registered:
            return
        address = self.tensor.data_ptr()
        _register(address, self.tensor.numel())
        self._finalizer = weakref.finalize(self, _unregister, address)

    def close(self) -> None:
        """Unregister the region (its memory is unmapped once no tensor views it any more)."""
        if self._finalizer is not None:
            self._finalizer()
