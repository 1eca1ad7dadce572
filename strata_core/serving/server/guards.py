"""ASGI guards in front of the API: what a browser page on another site must not be able to do.

Any web page can make the browser of a person running ``strata serve`` send requests to it. A
``text/plain`` or form POST needs no CORS pre-flight, so the JSON routes accept bodies only as
``application/json`` (415 otherwise); DNS rebinding points a foreign name at 127.0.0.1, so the
``Host`` header must name the bound address (its loopback names for a loopback address) or one of
``--allowed-hosts`` (400 otherwise).
"""

from __future__ import annotations

from litestar.exceptions import HTTPException
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

__all__ = ["RequestGuard", "allowed_host_names"]

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
