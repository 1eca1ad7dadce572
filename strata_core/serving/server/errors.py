"""The one exception-to-response mapper: every error becomes an OpenAI-style error body.

StrataError subclasses are the user's problem (4xx, 503 when busy); Litestar's HTTP exceptions
keep their status; validation errors are 400 naming the field; anything else is a logged 500 and
the server goes on.
"""

from __future__ import annotations

import logging
import re

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from strata_core.errors import InvalidParamError, StrataError, TemplateLimitError
from strata_core.model.kvpool import KVPoolFull
from strata_core.remote.group import RankFailedError
from strata_core.serving.model_files import ModelFileChangedError
from strata_core.serving.requests import ContextLengthError, ServerBusyError, ShuttingDownError
from strata_core.serving.server.loading import ModelLoadingError
from strata_core.serving.server.schemas import ErrorBody, ErrorDetail
from strata_core.serving.server.service import UnknownModelError

log = logging.getLogger(__name__)

_FIELD = re.compile(r"field `([^`]+)`")
RETRY_AFTER_S = "1"  # the Retry-After of a 503: slots free up within seconds
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 503: "server_error"}


def _body(status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None,
          **counts: int) -> tuple[int, ErrorBody]:
    kind = kind or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return status, ErrorBody(ErrorDetail(message, kind, param, code, **counts))


def _validation(exc: ValidationException) -> tuple[int, ErrorBody]:
    problems = exc.extra if isinstance(exc.extra, list) else []
    if not problems:
        return _body(400, str(exc.detail), code="invalid_request")
    parts, params = [], []
    for item in problems:
        key = item.get("key") if isinstance(item, dict) else None
        message = item.get("message", str(item)) if isinstance(item, dict) else str(item)
        if key == "data":  # the body as a whole: a missing or unknown field names itself
            named = _FIELD.search(message)
            key = named.group(1) if named else None
        parts.append(f"{key}: {message}" if key else message)
        params.append(key)
    return _body(400, "invalid request: " + "; ".join(parts), params[0], "invalid_request")


def error_body(exc: Exception) -> tuple[int, ErrorBody]:
    """The HTTP status and OpenAI error body for ``exc``."""
    if isinstance(exc, ValidationException):
        return _validation(exc)
    if isinstance(exc, HTTPException):
        return _body(exc.status_code, str(exc.detail))
    if isinstance(exc, ModelFileChangedError):
        return _body(503, str(exc), code="model_file_changed")
    if isinstance(exc, RankFailedError):
        return _body(503, str(exc), code="rank_failed")
    if isinstance(exc, ShuttingDownError):
        return _body(503, str(exc), code="shutting_down")
    if isinstance(exc, ServerBusyError):
        return _body(503, str(exc), code="server_busy")
    if isinstance(exc, ModelLoadingError):
        return _body(503, str(exc), code="model_loading")
    if isinstance(exc, UnknownModelError):
        return _body(404, str(exc), "model", "model_not_found")
    if isinstance(exc, InvalidParamError):
        return _body(400, str(exc), exc.param, exc.code)
    if isinstance(exc, ContextLengthError):
        # llama-server's type, with OpenAI's code: clients of either find it
        return _body(400, str(exc), None, "context_length_exceeded", "exceed_context_size_error",
                     n_prompt_tokens=exc.n_prompt_tokens, n_ctx=exc.n_ctx)
    if isinstance(exc, KVPoolFull):  # the server's memory, not the request: a 500, as llama-server answers it
        return _body(500, f"the context size has been exceeded: {exc}", code="kv_pool_full")
    if isinstance(exc, TemplateLimitError):
        return _body(500, str(exc), code="chat_template_limit")
    if isinstance(exc, StrataError):
        return _body(400, str(exc), code="invalid_request")
    if isinstance(exc, RecursionError) and "deserializing" in str(exc):  # msgspec on JSON nested too deep
        return _body(400, "the JSON body is nested too deeply", code="invalid_request")
    log.error("unhandled error", exc_info=exc)
    return _body(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def error_headers(status: int) -> dict[str, str] | None:
    """The headers an error response of ``status`` carries: how to authenticate (401), when to retry (503)."""
    return {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": RETRY_AFTER_S}}.get(status)


def handle_exception(_: Request, exc: Exception) -> Response[ErrorBody]:
    """Litestar exception handler for every exception type."""
    status, body = error_body(exc)
    return Response(body, status_code=status, headers=error_headers(status))
