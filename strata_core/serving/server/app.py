"""``create_app``: the Litestar application of the OpenAI-compatible API.

The lifespan owns the :class:`~strata_core.serving.server.loading.ServiceLoader` (the engine, loaded from
the settings in the background unless one is given, and the scheduler) and puts it on the typed
:class:`StrataState`; handlers receive the :class:`GenerationService` through ``Provide``. The OpenAI
routes answer under ``/v1`` and, as llama-server's do, without it (left out of the docs), but for
``/completions``, which is llama-server's native ``/completion`` there. With an
API key every route but ``/health`` and the chat page ``/`` (webui.py) needs ``Authorization: Bearer
KEY`` or ``X-Api-Key: KEY``; every route checks the ``Host`` header and that a body is JSON (see
guards.py). ``--cors`` lets web pages of the origins it names call the API (no CORS headers without
it). The API docs at ``/schema`` are rendered on the server (docs.py), so they need nothing from a
CDN.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import NotAuthorizedException
from litestar.middleware import ASGIMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.types import ASGIApp, Receive, Scope, Send

from strata_core.config import StrataSettings
from strata_core.serving.server.anthropic_api import MessagesController
from strata_core.serving.server.controllers import (
    ChatController, CompletionsController, LlamaServerController, ModelsController, SystemController,
)  # fmt: skip
from strata_core.serving.server.docs import EndpointList
from strata_core.serving.server.errors import handle_exception
from strata_core.serving.server.guards import Cors, RequestGuard, allowed_host_names
from strata_core.serving.server.loading import ServiceLoader
from strata_core.serving.server.responses_api import ResponsesController
from strata_core.serving.server.service import GenerationService
from strata_core.serving.server.webui import chat_page

__all__ = ["StrataState", "create_app"]

OPEN_PATHS = frozenset({"/health", "/"})


class StrataState(State):
    """What the lifespan puts on the application state."""

    loader: ServiceLoader


def provide_service(state: StrataState) -> GenerationService:
    """The generation service of the running app (ModelLoadingError, a 503, while it loads)."""
    return state.loader.get()


class ApiKeyAuth(ASGIMiddleware):
    """Answer 401 unless the key is sent as ``Authorization: Bearer KEY`` or, as llama-server takes it,
    ``X-Api-Key: KEY`` (``/health`` and the chat page ``/`` are open)."""

    def __init__(self, key: str) -> None:
        self._bearer = f"Bearer {key}".encode()
        self._key = key.encode()

    @staticmethod
    def should_bypass_for_scope(scope: Scope) -> bool:
        """True for the open paths: ``/health`` and the chat page ``/`` (the exact request path, not a
        handler's own path, which is ``/`` for many routes)."""
        return scope["path"] in OPEN_PATHS

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = dict(scope["headers"])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self._bearer)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)
        if not (bearer_ok or key_ok):
            raise NotAuthorizedException("a valid API key is needed: send `Authorization: Bearer KEY` "
                                         "or `X-Api-Key: KEY`")
        await next_app(scope, receive, send)


def create_app(settings: StrataSettings, engine: Any = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> Litestar:
    """The API app for ``settings``; ``engine`` (already loaded) is served at once instead of loading
    one in the background. ``on_load_error`` receives a failure to load the model."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        loader = ServiceLoader(settings, engine, on_load_error)
        app.state.loader = loader
        await loader.start()
        try:
            yield
        finally:
            await loader.close()

    key = settings.api_key.get_secret_value() if settings.api_key else None
    openai_api = [ChatController, ModelsController, ResponsesController, MessagesController]
    return Litestar(
        route_handlers=[
            Router("/v1", route_handlers=[*openai_api, CompletionsController]),
            # llama-server also answers without /v1, except /completions: its native /completion there
            Router("/", route_handlers=openai_api, include_in_schema=False),
            SystemController,
            LlamaServerController,
            *([chat_page] if settings.webui else []),
        ],
        dependencies={"service": Provide(provide_service, sync_to_thread=False)},
        lifespan=[lifespan],
        middleware=[*([Cors(settings.cors)] if settings.cors else []),  # a pre-flight needs no key
                    RequestGuard(allowed_host_names(settings.host, settings.allowed_hosts)),
                    *([ApiKeyAuth(key)] if key else [])],
        exception_handlers={Exception: handle_exception},
        openapi_config=OpenAPIConfig(title="Strata", version="0.1.0",
                                     render_plugins=[EndpointList(), JsonRenderPlugin()]),
        request_max_body_size=int(settings.max_body_mib * 2**20),
        state=StrataState(),
    )
