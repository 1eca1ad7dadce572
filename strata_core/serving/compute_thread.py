"""The one long-lived thread that makes every torch call of a server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any

import torch

__all__ = ["ComputeThread"]


class ComputeThread:
    """The one long-lived thread that makes every torch call of a server: the model's load, then the
    scheduler's loop, then the engine's release.

    torch's CPU pool (OpenMP) is tied to the thread that drives it: a load on a short-lived worker
    thread leaves OpenMP workers behind that busy-wait against the decode's once that thread is
    retired. ``threads`` (``--threads``) sets the pool's size on this thread before any work.
    """

    def __init__(self, threads: int | None = None, name: str = "strata-compute") -> None:
        self.threads = threads
        self._jobs: queue.SimpleQueue[tuple[Any, tuple[Any, ...], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while (item := self._jobs.get()) is not None:
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on the thread after what is already queued."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        return future

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the thread, awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        """End the thread once the queued work is done."""
        self._jobs.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join()
