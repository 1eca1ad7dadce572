"""The model behind a server that already listens: it loads on the compute thread (the one that
later runs every step) while ``/health``
answers 503 ``{"status": "loading"}`` and the API answers 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from strata_core.config import StrataSettings
from strata_core.errors import StrataError
from strata_core.runtime.heap import freeze_loaded
from strata_core.serving.compute_thread import ComputeThread
from strata_core.serving.scheduler import Scheduler
from strata_core.serving.server.service import GenerationService

__all__ = ["ModelLoadingError", "ServiceLoader", "window_rows"]

log = logging.getLogger(__name__)


def window_rows(settings: StrataSettings, rewindable: bool = True) -> int:
    """The most rows a replayed decode window of the server takes (its start captures the decode graphs up to
    them, so no window captures later): one a slot, and with ``--spec`` each slot's drafts too, unless the model
    keeps a recurrent state (not ``rewindable``: its speculative windows run eagerly)."""
    drafts = settings.spec != "off" and rewindable
    return settings.parallel * (1 + settings.spec_tokens if drafts else 1)


class ModelLoadingError(StrataError):
    """The model is still loading (HTTP 503 with Retry-After)."""


class ServiceLoader:
    """Loads the engine (unless one is given), starts the scheduler, and hands out the service.

    ``on_error`` receives a load failure (``strata serve`` stops the server and reports it).
    """

    def __init__(self, settings: StrataSettings, engine: Any = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.settings = settings
        self.service: GenerationService | None = None
        self.progress = 0.0  # fraction of the model loaded (reported by /health)
        self.started = time.monotonic()
        self._engine = engine
        self._owned = engine is None
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None
        # Every torch call of the server (load, steps, release) runs on this one thread.
        self.worker = ComputeThread(settings.threads)

    def get(self) -> GenerationService:
        """The running service; ModelLoadingError while the model loads."""
        if self.service is None:
            raise ModelLoadingError(f"the model is loading ({time.monotonic() - self.started:.0f} s so far); "
                                    "retry shortly")
        return self.service

    def _loaded(self, fraction: float) -> None:
        """Progress callback of the engine's load (on the loading thread)."""
        self.progress = round(fraction, 3)

    async def start(self) -> None:
        """A given engine is served at once; an owned one loads in the background."""
        if self._owned:
            self._task = asyncio.create_task(self._load())
        else:
            await self._load()

    async def _load(self) -> None:
        from strata_core.engine import Engine

        settings = self.settings
        try:
            if self._owned:
                self._engine = await self.worker.call(Engine.from_settings, settings, self._loaded)
                await self.worker.call(self._engine.capture_decode_graphs,
                                       window_rows(settings, self._engine.spec.rewindable))
                await self.worker.call(self._engine.capture_prompt_graphs)
                await self.worker.call(self._engine.warm_up_prompts)
                freeze_loaded()  # no full collection scanning the engine in the middle of a request
        except Exception as error:  # noqa: BLE001 - reported to on_error, which stops the server
            log.error("loading %s failed: %s", settings.model, error)
            if self._on_error is not None:
                self._on_error(error)
            return
        scheduler = Scheduler(
            self._engine, parallel=settings.parallel, step_tokens=settings.step_tokens, max_queue=settings.max_queue,
            conv_cache=settings.conv_cache, conv_cache_bytes=int(settings.conv_cache_gib * 2**30),
            worker=self.worker, overlap=settings.overlap_windows,
            spec_tokens=settings.spec_tokens if settings.spec != "off" else 0, drafts=settings.spec,
        )  # fmt: skip
        scheduler.start()
        self.service = GenerationService(self._engine, scheduler, settings)
        log.info("serving %s (%s) with strategy %s on %s: %d slots, %d tokens a step, queue %d, conversation cache %d; "
                 "loaded in %.1f s", self.service.model_id, settings.model, settings.strategy, ",".join(settings.devices),
                 settings.parallel, settings.step_tokens, settings.max_queue, settings.conv_cache,
                 time.monotonic() - self.started)

    def drain(self, grace: float) -> None:
        """The server is shutting down: the scheduler admits nothing more and ends what runs after
        ``grace`` seconds."""
        if self.service is not None:
            self.service.scheduler.drain(grace)

    async def close(self) -> None:
        """Wait for a load under way, stop the scheduler, release an owned engine."""
        if self._task is not None:
            await self._task
        if self.service is not None:
            self.service.close()
            await anyio.to_thread.run_sync(self.service.scheduler.stop)
        if self._owned and self._engine is not None:
            await self.worker.call(self._engine.close)
        await anyio.to_thread.run_sync(self.worker.close)
