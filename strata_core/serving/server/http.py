"""The HTTP server around the app: uvicorn, with what a public server needs against its clients.

* **Read timeouts.** uvicorn's keep-alive timeout only covers the idle time between requests; a
  client that sends its request head a byte at a time, or a body shorter than its Content-Length,
  or a chunked body that never ends, holds its connection for ever. :func:`guarded_protocol` adds a
  deadline for the request head (``--header-timeout``, from its first byte; for a new connection from
  the connection) and one for the body (``--body-timeout``, from the end of the head): past it the
  client gets ``408`` and the connection is closed.
* **A cap on connections** (``--max-connections``): a connection past it is answered ``503`` and
  closed at once, so half-open sockets cannot exhaust the file descriptors. (uvicorn's
  ``limit_concurrency`` is not used: it answers 503 to every request, ``/health`` too, while that
  many connections are open, even idle ones; HTTP/1.1 runs one request per connection at a time, so
  the connection cap bounds the requests in flight as well.)
* **Graceful shutdown** (:class:`StrataServer`): on SIGTERM/SIGINT the server stops accepting, fails
  the queued requests at once (503), gives the running ones ``--shutdown-grace`` seconds to finish
  and then ends each with an error (a stream gets an ``error`` event and ``[DONE]``), then exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from strata_core.config import StrataSettings

__all__ = ["StrataServer", "guarded_protocol", "uvicorn_config"]

log = logging.getLogger(__name__)


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = ('{"error": {"message": "%s", "type": "server_error", "param": null, "code": null}}' % message).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def guarded_protocol(header_timeout: float, body_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with read deadlines for the request head and body and a connection cap."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _phase: str = ""  # "head" or "body": what the armed deadline waits for

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refusing a connection: %d are open (--max-connections %d)", len(self.connections) - 1,
                            max_connections)
                transport.write(_raw_response(503, "Service Unavailable",
                                              f"the server has {max_connections} connections open; retry later"))
                transport.close()
                return
            self._arm("head")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Arm or drop the deadline for what the connection now waits for from the client."""
            state = self.conn.their_state
            if state is h11.IDLE and self.conn.trailing_data[0]:
                self._arm("head")  # part of a request head has come
            elif state is h11.SEND_BODY:
                self._arm("body")
            elif state is not h11.IDLE or self._phase == "body":
                self._disarm()

        def _arm(self, phase: str) -> None:
            if self._phase == phase or self.transport.is_closing():
                return
            self._disarm()
            self._phase = phase
            timeout = header_timeout if phase == "head" else body_timeout
            self._deadline = self.loop.call_later(timeout, self._expired, phase, timeout)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._phase = None, ""

        def _expired(self, phase: str, timeout: float) -> None:
            self._deadline, self._phase = None, ""
            if self.transport.is_closing():
                return
            what = "request head" if phase == "head" else "request body"
            flag = "--header-timeout" if phase == "head" else "--body-timeout"
            cycle = self.cycle
            if cycle is None or not cycle.response_started:
                self.transport.write(_raw_response(408, "Request Timeout",
                                                   f"the {what} did not arrive within {timeout:g} s ({flag})"))
            if cycle is not None and phase == "body":
                log.info("closing a connection whose request body did not arrive within %g s", timeout)
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app: Any, settings: StrataSettings, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn configuration of ``strata serve`` for ``app`` (``kwargs``: host, port, log_level...)."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings.header_timeout, settings.body_timeout, settings.max_connections),
        timeout_graceful_shutdown=settings.shutdown_grace + 5,
        **kwargs,
    )


class StrataServer(uvicorn.Server):
    """uvicorn's server; its shutdown first drains the scheduler (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, settings: StrataSettings) -> None:
        super().__init__(config)
        self.grace = settings.shutdown_grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        """uvicorn re-raises a caught signal once it has shut down (the process then dies of it); a
        SIGTERM that ended in a clean shutdown exits 0 instead."""
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            self._captured_signals.remove(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop admitting, give the running requests the grace time, then uvicorn's shutdown."""
        loader = getattr(getattr(self.config.loaded_app, "state", None), "loader", None)
        if loader is None:  # the ASGI app is wrapped: find the Litestar app under it
            app = self.config.loaded_app
            while app is not None and loader is None:
                app = getattr(app, "app", None)
                loader = getattr(getattr(app, "state", None), "loader", None)
        if loader is not None:
            loader.drain(self.grace)
        await super().shutdown(sockets)
