"""Filling the pinned arena at memory speed: ``fill_packed`` copies runs of bytes from the memory-mapped
GGUF into buffers already allocated, cut into tasks of about ``FILL_CHUNK`` bytes over a thread pool.

One thread copies ~1.5 GB/s from a mapped file (page faults, one core's share of the memory bandwidth);
several saturate it. Each task is one ``numpy.copyto`` per run piece: a single-threaded memcpy that
releases the GIL, so ``threads`` workers are exactly ``threads`` copiers (torch's ``copy_`` would start
an OpenMP team inside each worker). The buffers are allocated before the copy starts: page-locking and
the copy's page faults both take the process's memory-map lock, and interleaving them serialises both.

``configure_pinned_allocator`` sets torch's pinned-allocator keys that make large pinned blocks fast
to allocate (pages touched by several threads, then registered) and exact in size (no power-of-two
round-up of a multi-GiB layer), unless the user configured the allocator.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["FILL_CHUNK", "FillReport", "configure_pinned_allocator", "copy_tasks", "default_threads",
           "fill_packed"]

log = logging.getLogger(__name__)

#: bytes a fill task copies (about): large enough that a task's overhead is nothing, small enough that
#: the last tasks of the fill keep every thread busy
FILL_CHUNK = 64 << 20
#: most fill threads by default: more add nothing once the memory bandwidth is saturated
MAX_FILL_THREADS = 16
#: the pinned-allocator keys set where CUDA is present, oldest first (torch rejects a key it does not
#: know: the newest are dropped until it takes the rest)
PINNED_KEYS = ("pinned_use_cuda_host_register:True", "pinned_num_register_threads:8",
               "pinned_max_round_threshold_mb:64")
#: environment variables through which a user configures torch's allocators
ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

#: one copy: (destination, source), uint8 arrays of one shape ``[rows, n]`` (or ``[n]``)
Run = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class FillReport:
    """What one fill did: bytes, threads, and the seconds spent allocating and copying."""

    nbytes: int
    threads: int
    allocate_s: float
    copy_s: float
    register_s: float | None = None  # page-locking the filled buffers (host_region.py); None: not done

    @property
    def seconds(self) -> float:
        return self.allocate_s + self.copy_s + (self.register_s or 0.0)

    @property
    def gbps(self) -> float:
        """Bytes a second of the whole fill (allocation included), in GB/s."""
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def message(self) -> str:
        """The one log line of the fill."""
        register = "" if self.register_s is None else f", registering {self.register_s:.1f} s"
        return (f"arena: {self.nbytes / (1 << 30):.2f} GiB filled in {self.seconds:.1f} s ({self.gbps:.2f} GB/s, "
                f"{self.threads} threads; allocating {self.allocate_s:.1f} s, copying {self.copy_s:.1f} s{register})")


def default_threads() -> int:
    """Fill threads for this host: one per core, at most ``MAX_FILL_THREADS``."""
    return max(1, min(MAX_FILL_THREADS, os.cpu_count() or 1))


@functools.cache
def configure_pinned_allocator() -> str | None:
    """Set torch's pinned-allocator keys (``PINNED_KEYS``) once per process, where CUDA is present and
    neither ``PYTORCH_ALLOC_CONF`` nor ``PYTORCH_CUDA_ALLOC_CONF`` is set; returns the settings applied
    (None: left alone). Keys this torch does not know are dropped (logged)."""
    if not torch.cuda.is_available():
        return None
    user = next((name for name in ALLOC_ENV if os.environ.get(name)), None)
    if user is not None:
        log.info("arena: pinned allocator left as %s configures it", user)
        return None
    for n in range(len(PINNED_KEYS), 0, -1):  # all the keys in one call, else the older ones
        settings = ",".join(PINNED_KEYS[:n])
        try:
            torch._C._accelerator_setAllocatorSettings(settings)
        except (ValueError, RuntimeError, AttributeError) as err:  # torch 2.11: ValueError, unknown key
            log.info("arena: this torch does not take pinned allocator setting %s (%s)", PINNED_KEYS[n - 1], err)
            continue
        log.info("arena: pinned allocator settings %s", settings)
        return settings
    return None


def copy_tasks(runs: Sequence[Run], chunk: int = FILL_CHUNK) -> list[list[Run]]:
    """``runs`` cut into tasks of about ``chunk`` bytes: a run larger than ``chunk`` into row ranges (a
    row larger than ``chunk`` into column ranges), the small ones packed together in order."""
    if chunk < 1:
        raise ValueError(f"copy_tasks: chunk must be at least 1 byte, not {chunk}")
    pieces: list[Run] = []
    for dst, src in runs:
        if dst.shape != src.shape or dst.dtype != np.uint8 or src.dtype != np.uint8:
            raise ValueError(f"copy_tasks: a run copies uint8 onto uint8 of one shape, not {src.dtype}"
                             f"{src.shape} onto {dst.dtype}{dst.shape}")
        if dst.ndim == 1:
            dst, src = dst[None], src[None]
        rows, width = dst.shape
        if width > chunk:  # one row is already too large: cut each row into column ranges
            pieces += [(dst[r, c:c + chunk], src[r, c:c + chunk]) for r in range(rows) for c in range(0, width, chunk)]
        else:
            step = max(1, chunk // max(width, 1))
            pieces += [(dst[r:r + step], src[r:r + step]) for r in range(0, rows, step)]
    tasks: list[list[Run]] = []
    size = chunk  # bytes in the last task
    for piece in pieces:
        if size + piece[0].nbytes > chunk:
            tasks.append([])
            size = 0
        tasks[-1].append(piece)
        size += piece[0].nbytes
    return tasks


def fill_packed(runs: Sequence[Run], threads: int | None = None, progress: Callable[[int], None] | None = None,
                chunk: int = FILL_CHUNK) -> float:
    """Copy every run (destination <- source) with ``threads`` threads (default ``default_threads()``) in
    tasks of about ``chunk`` bytes; ``progress(nbytes)`` is called after each task with the bytes it
    copied (from the worker threads, one call at a time). Returns the seconds the copy took; raises the
    first failure."""
    tasks = copy_tasks(runs, chunk)
    threads = threads or default_threads()
    lock = threading.Lock()
    report = progress or (lambda nbytes: None)

    def copy(task: list[Run]) -> None:
        for dst, src in task:
            np.copyto(dst, src)
        with lock:
            report(sum(dst.nbytes for dst, _ in task))

    start = time.perf_counter()
    if threads == 1 or len(tasks) <= 1:
        for task in tasks:
            copy(task)
    else:
        with ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="strata-fill") as pool:
            list(pool.map(copy, tasks))
    return time.perf_counter() - start
