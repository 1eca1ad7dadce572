"""ASGI guards in front of the API: what a browser page on another site must not be able to do.

Any web page can make the browser of a person running ``strata serve`` send requests to it. A
``text/plain`` or form POST needs no CORS pre-flight, so the JSON routes accept bodies only as
``application/json`` (415 otherwise); DNS rebinding points a foreign name at 127.0.0.1, so the
``Host`` header must name the bound address (its loopback names for a loopback address) or one of
``--allowed-hosts`` (400 otherwise). ``--cors`` lets the pages of the origins it names read the
answers (:class:`Cors`; none by default).
"""

from __future__ import annotations

import re

from litestar.exceptions import HTTPException
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

__all__ = ["Cors", "RequestGuard", "allowed_host_names"]

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD = frozenset({"", "0.0.0.0", "::"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _normal(host: str) -> str:
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def allowed_host_names(bound: str, extra: list[str]) -> frozenset[str] | None:
    """The Host names answered for a server bound to ``bound`` plus ``extra``; None: any host
    (``*`` in ``extra``, or a wildcard address without ``--allowed-hosts``)."""
    names = {_normal(h) for h in extra}
    if "*" in names or (_normal(bound) in WILDCARD and not names):
        return None
    bound = _normal(bound)
    names |= LOOPBACK if bound in LOOPBACK or bound in WILDCARD else {bound}
    return frozenset(names)


def host_of(header: str) -> str:
    """The host name of a ``Host`` header value (``[::1]:8080`` -> ``::1``, ``a.b:80`` -> ``a.b``)."""
    header = header.strip()
    if header.startswith("["):
        return _normal(header.split("]", 1)[0])
    return _normal(header.rsplit(":", 1)[0] if header.count(":") == 1 else header)


class RequestGuard(ASGIMiddleware):
    """400 for a ``Host`` the server does not answer to, 415 for a body that is not JSON."""

    def __init__(self, allowed: frozenset[str] | None) -> None:
        self._allowed = allowed
        self._suffixes = tuple(name[1:] for name in allowed or () if name.startswith("*."))

    def _host_ok(self, host: str) -> bool:
        return self._allowed is None or host in self._allowed or (bool(self._suffixes) and host.endswith(self._suffixes))

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if host is not None and not self._host_ok(host_of(host.decode("latin-1"))):
            raise HTTPException(status_code=400, detail=f"this server does not answer to Host "
                                f"{host.decode('latin-1')[:100]!r}; add it with --allowed-hosts")
        if scope["type"] == "http" and scope["method"] in _BODY_METHODS:
            media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                raise HTTPException(status_code=415, detail="the request body must be JSON sent as "
                                    f"Content-Type: application/json (got {media.decode('latin-1')[:100]!r})")
        await next_app(scope, receive, send)


#: an origin on this machine, any port (``--cors localhost``, as llama-server's --cors-origins localhost)
LOOPBACK_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?", re.IGNORECASE)
CORS_METHODS = b"GET, POST, DELETE, OPTIONS"


class Cors(ASGIMiddleware):
    """CORS for the origins of ``--cors``: exact origins, ``*`` (any) and ``localhost`` (any origin on this
    machine: localhost, 127.0.0.1, [::1], any port). A pre-flight is answered 200 as llama-server answers
    it, naming the origin only when it is allowed (a browser then stops there); an allowed origin's
    requests get ``Access-Control-Allow-Origin`` with their answers. Credentials are never allowed: the
    API key is a header, not a cookie. Header names go out capitalized, as llama-server sends them (some
    clients look them up by exact name)."""

    def __init__(self, origins: list[str]) -> None:
        self._any = "*" in origins
        self._loopback = "localhost" in origins
        self._origins = frozenset(origins)

    def allowed(self, origin: str) -> bool:
        """Whether the pages of ``origin`` may call the API."""
        return self._any or origin in self._origins or (self._loopback and bool(LOOPBACK_ORIGIN.fullmatch(origin)))

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if scope["type"] != "http" or origin is None:
            await next_app(scope, receive, send)
            return
        allowed = self.allowed(origin.decode("latin-1"))
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:  # a pre-flight
            answer = [(b"Vary", b"Origin"), (b"Content-Length", b"0")]
            if allowed:
                answer += [(b"Access-Control-Allow-Origin", origin), (b"Access-Control-Allow-Methods", CORS_METHODS),
                           (b"Access-Control-Allow-Headers", headers.get(b"access-control-request-headers", b"*")),
                           (b"Access-Control-Max-Age", b"600")]
            await send({"type": "http.response.start", "status": 200, "headers": answer})
            await send({"type": "http.response.body", "body": b""})
            return
        if not allowed:
            await next_app(scope, receive, send)
            return

        async def send_with_origin(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"Access-Control-Allow-Origin", origin),
                                      (b"Vary", b"Origin")]
            await send(message)

        await next_app(scope, receive, send_with_origin)
