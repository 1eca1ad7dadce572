"""Route handlers, one controller per domain: chat, completions, models, and the system routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.exceptions import ClientException
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from litestar.response.base import ASGIResponse

from strata_core.serving.server import metrics
from strata_core.serving.server import schemas as s
from strata_core.serving.scheduler import RequestHandle
from strata_core.serving.server.responses import (
    Collected, cancel_on_disconnect, chat_completion, chat_stream, collect, completion, completion_stream,
    llama_completion, llama_completion_stream,
)  # fmt: skip
from strata_core.serving.server.errors import RETRY_AFTER_S
from strata_core.serving.server.service import GenerationService

T = TypeVar("T")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(Stream):
    """A ``text/event-stream`` response: Litestar's ``Stream`` lets the handler's JSON media type win."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIResponse:
        """The ASGI response, with this response's own media type."""
        return super().to_asgi_response(*args, **{**kwargs, "media_type": self.media_type})


async def respond(request: Request, handle: RequestHandle, chunks: AsyncIterator[bytes] | None,
                   body: Callable[[Collected], T]) -> T | Stream:
    """Server-sent events when ``chunks`` is given, else the whole body once generation ends
    (cancelled if the client goes away first)."""
    if chunks is not None:
        return EventStream(chunks, media_type="text/event-stream", headers=_SSE_HEADERS)
    async with cancel_on_disconnect(request, handle):
        out = await collect(handle)
    return body(out)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client goes away first (a chat template still rendering is stopped)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientException("the client went away before its request started")
    return task.result()


async def llama_completion_route(request: Request, data: s.LlamaCompletionRequest,
                                 service: GenerationService) -> s.LlamaCompletion | Stream:
    """llama-server's native completion of ``data``, whole or streamed."""
    service.check_fields(s.unknown_fields(await request.body(), s.LlamaCompletionRequest))
    bias = await service.llama_logit_bias(data.logit_bias)
    settings = data.params(service.default_max_tokens, service.settings.seed, bias)
    handle = await service.complete(data.completion_request(bias), fallback_max_tokens=None)
    chunks = llama_completion_stream(service.model_id, handle, settings) if data.stream else None
    return await respond(request, handle, chunks, lambda out: llama_completion(
        service.model_id, out.text, out.end, settings, out.logprobs if data.n_probs else None))


class ChatController(Controller):
    """``/v1/chat/completions`` and ``/v1/chat/completions/input_tokens``."""

    path = "/chat/completions"
    tags = ["chat"]

    @post(operation_id="createChatCompletion", status_code=200,
          summary="Generate the next message of a conversation (SSE with stream=true)")
    async def create(self, request: Request, data: JSONBody[s.ChatCompletionRequest],
                     service: NamedDependency[GenerationService]) -> s.ChatCompletion | Stream:
        service.check_fields(s.unknown_fields(await request.body(), s.ChatCompletionRequest))
        handle = await until_disconnect(request, service.chat(data))
        fmt = service.reply_format(data, handle)
        chunks = chat_stream(service.model_id, handle, data, fmt) if data.stream else None
        return await respond(request, handle, chunks,
                              lambda out: chat_completion(service.model_id, out, data.logprobs, fmt))


    @post("/input_tokens", operation_id="countChatTokens", status_code=200,
          summary="The prompt tokens a chat request renders to (llama-server's)")
    async def input_tokens(self, request: Request, data: JSONBody[s.ChatCompletionRequest],
                           service: NamedDependency[GenerationService]) -> s.InputTokens:
        service.check_fields(s.unknown_fields(await request.body(), s.ChatCompletionRequest))
        service.check_model(data.model)
        text = await until_disconnect(request, service.render(data))
        return s.InputTokens(len(await service.tokenize(text, True, "messages")))


class CompletionsController(Controller):
    """``/v1/completions``."""

    path = "/completions"
    tags = ["completions"]

    @post(operation_id="createCompletion", status_code=200,
          summary="Continue a prompt (SSE with stream=true)")
    async def create(self, request: Request, data: JSONBody[s.CompletionRequest],
                     service: NamedDependency[GenerationService]) -> s.Completion | Stream:
        service.check_fields(s.unknown_fields(await request.body(), s.CompletionRequest))
        handle = await service.complete(data)
        chunks = completion_stream(service.model_id, handle, data) if data.stream else None
        return await respond(request, handle, chunks,
                              lambda out: completion(service.model_id, out, data.logprobs is not None))


class ModelsController(Controller):
    """``/v1/models``."""

    path = "/models"
    tags = ["models"]

    @get(operation_id="listModels", summary="The model this server serves")
    async def list_models(self, service: NamedDependency[GenerationService]) -> s.ModelList:
        return s.ModelList([s.Model(service.model_id, service.created)])

    @get("/{model_id:str}", operation_id="retrieveModel", summary="One model by name")
    async def retrieve(self, model_id: FromPath[str], service: NamedDependency[GenerationService]) -> s.Model:
        service.check_model(model_id)
        return s.Model(service.model_id, service.created)


class LlamaServerController(Controller):
    """llama-server's routes: ``/completion`` (and ``/completions``), ``/tokenize``, ``/detokenize``,
    ``/apply-template``, ``/props``,
    ``/slots``."""

    path = "/"
    tags = ["llama-server"]

    @post("/tokenize", operation_id="tokenize", status_code=200,
          summary="Token ids of a text (with_pieces: each with its piece)")
    async def tokenize(self, request: Request, data: JSONBody[s.TokenizeRequest],
                       service: NamedDependency[GenerationService]) -> s.Tokens | s.TokenPieces:
        service.check_fields(s.unknown_fields(await request.body(), s.TokenizeRequest))
        tokens = await service.tokenize(data.content, data.add_special)
        if not data.with_pieces:
            return s.Tokens(tokens)
        return s.TokenPieces([s.TokenPiece(t, piece) for t, piece in zip(tokens, await service.pieces(tokens))])

    @post("/detokenize", operation_id="detokenize", status_code=200, summary="The text of token ids")
    async def detokenize(self, request: Request, data: JSONBody[s.DetokenizeRequest],
                         service: NamedDependency[GenerationService]) -> s.Content:
        service.check_fields(s.unknown_fields(await request.body(), s.DetokenizeRequest))
        return s.Content(await service.detokenize(data.tokens))

    @post("/completion", operation_id="llamaCompletion", status_code=200,
          summary="Continue a prompt, llama-server's native form (SSE with stream=true)")
    async def native_completion(self, request: Request, data: JSONBody[s.LlamaCompletionRequest],
                                service: NamedDependency[GenerationService]) -> s.LlamaCompletion | Stream:
        return await llama_completion_route(request, data, service)

    @post("/completions", status_code=200, include_in_schema=False)
    async def native_completions(self, request: Request, data: JSONBody[s.LlamaCompletionRequest],
                                 service: NamedDependency[GenerationService]) -> s.LlamaCompletion | Stream:
        """``/completions`` without ``/v1``: llama-server's native ``/completion`` too."""
        return await llama_completion_route(request, data, service)

    @post("/apply-template", operation_id="applyTemplate", status_code=200,
          summary="The prompt a chat request renders to, through the model's chat template")
    async def apply_template(self, request: Request, data: JSONBody[s.ChatCompletionRequest],
                             service: NamedDependency[GenerationService]) -> s.Prompt:
        service.check_fields(s.unknown_fields(await request.body(), s.ChatCompletionRequest))
        return s.Prompt(await until_disconnect(request, service.render(data)))

    @get("/props", operation_id="props", summary="The served model, its context, slots and sampling defaults")
    async def props(self, service: NamedDependency[GenerationService]) -> s.Props:
        defaults = s.LlamaCompletionRequest(prompt="").params(service.default_max_tokens, service.settings.seed)
        return s.Props(s.GenerationSettings(service.scheduler.max_context, service.model_id, defaults),
                       service.scheduler.parallel, str(service.settings.model), service.model_id,
                       service.engine.chat.source)

    @get("/slots", operation_id="slots", summary="What each generation slot holds and does")
    async def slots(self, service: NamedDependency[GenerationService]) -> list[s.SlotState]:
        return [s.SlotState(**state) for state in service.scheduler.slot_states()]


class SystemController(Controller):
    """``/health`` (never needs the API key; 503 ``loading`` until the model is ready, 503 ``error`` once a
    model file changed under the server or another rank of the engine failed) and ``/metrics``."""

    path = "/"
    tags = ["system"]

    @get("/health", operation_id="health", summary="Liveness and slot use; 503 while the model loads")
    async def health(self, state: State) -> Response[s.Health]:
        service = state.loader.service
        if service is None:
            return Response(s.Health("loading", 0, 0, 0, progress=state.loader.progress), status_code=503,
                            headers={"Retry-After": RETRY_AFTER_S})
        stats = service.scheduler.stats
        broken = service.scheduler.broken or getattr(service.engine, "broken", None)  # a model file, a rank
        if broken is not None:
            return Response(s.Health("error", 0, 0, 0, error=str(broken)), status_code=503)
        return Response(s.Health("ok", service.scheduler.parallel - stats.active, stats.active, stats.waiting))

    @get("/metrics", operation_id="metrics", media_type=MediaType.TEXT, summary="Prometheus metrics")
    async def metrics(self, service: NamedDependency[GenerationService]) -> Response[str]:
        return Response(metrics.render(service.scheduler), media_type="text/plain; version=0.0.4")
