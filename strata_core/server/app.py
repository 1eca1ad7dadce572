"""``create_app``: the Litestar application of the OpenAI-compatible API.

The lifespan owns the engine (loaded from the settings unless one is given) and the scheduler and
puts them on the typed :class:`StrataState`; handlers receive the :class:`GenerationService`
through ``Provide``. With an API key every route but ``/health`` needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import NotAuthorizedException
from litestar.middleware import ASGIMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Receive, Scope, Send

from strata_core.config import StrataSettings
from strata_core.scheduler import Scheduler
from strata_core.server.controllers import (
    ChatController, CompletionsController, LlamaServerController, ModelsController, SystemController,
)  # fmt: skip
from strata_core.server.errors import handle_exception
from strata_core.server.service import GenerationService

__all__ = ["StrataState", "create_app"]

log = logging.getLogger(__name__)


class StrataState(State):
    """What the lifespan puts on the application state."""

    service: GenerationService


def provide_service(state: StrataState) -> GenerationService:
    """The generation service of the running app."""
    return state.service


class BearerAuth(ASGIMiddleware):
    """Answer 401 unless ``Authorization: Bearer KEY`` is sent (``/health`` is open)."""

    exclude_path_pattern = "^/health$"

    def __init__(self, key: str) -> None:
        self._expected = f"Bearer {key}".encode()

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        sent = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(sent, self._expected):
            raise NotAuthorizedException("a valid API key is needed: send `Authorization: Bearer KEY`")
        await next_app(scope, receive, send)


def create_app(settings: StrataSettings, engine: Any = None) -> Litestar:
    """The API app for ``settings``; ``engine`` (already loaded) is used instead of loading one."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        from strata_core.engine import Engine

        owned = engine is None
        live = await anyio.to_thread.run_sync(Engine.from_settings, settings) if owned else engine
        scheduler = Scheduler(
            live, parallel=settings.parallel, max_queue=settings.max_queue,
            conv_cache=settings.conv_cache, conv_cache_bytes=int(settings.conv_cache_gib * 2**30),
        )  # fmt: skip
        scheduler.start()
        service = GenerationService(live, scheduler, settings)
        app.state.service = service
        log.info("serving %s (%s) with strategy %s on %s: %d slots, queue %d, conversation cache %d",
                 service.model_id, settings.model, settings.strategy, ",".join(settings.devices),
                 settings.parallel, settings.max_queue, settings.conv_cache)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(scheduler.stop)
            if owned:
                live.close()

    key = settings.api_key.get_secret_value() if settings.api_key else None
    return Litestar(
        route_handlers=[
            Router("/v1", route_handlers=[ChatController, CompletionsController, ModelsController]),
            SystemController,
            LlamaServerController,
        ],
        dependencies={"service": Provide(provide_service, sync_to_thread=False)},
        lifespan=[lifespan],
        middleware=[BearerAuth(key)] if key else [],
        exception_handlers={Exception: handle_exception},
        openapi_config=OpenAPIConfig(title="Strata", version="0.1.0"),
        request_max_body_size=int(settings.max_body_mib * 2**20),
        state=StrataState(),
    )
