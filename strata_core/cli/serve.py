"""``strata serve``: the OpenAI-compatible HTTP API, served by uvicorn."""

from __future__ import annotations

import logging
import socket

from strata_core.cli.settings import ENGINE, RANKS, SERVER, settings_with
from strata_core.errors import ConfigError

log = logging.getLogger(__name__)
BACKLOG = 2048  # uvicorn's default


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, or a ConfigError saying why not (the port is taken...)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening here, not in uvicorn: with SO_REUSEADDR two servers starting at once may both
        # bind, and only listen() tells the loser the port is taken.
        sock.listen(BACKLOG)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def raise_fd_limit(connections: int) -> None:
    """Raise the soft limit on open files to fit ``connections`` and the model's files (up to the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("the open-file limit is %d: fewer than --max-connections %d leave room for", new, connections)


class ServeCommand(settings_with(ENGINE, SERVER, RANKS)):  # type: ignore[misc]
    """Serve the model over an OpenAI-compatible HTTP API (/v1/...) and a chat page at /.

    Binds 127.0.0.1 unless --host says otherwise; --api-key (or STRATA_API_KEY) guards every route
    but /health and the page. The port is bound first and the model loads in the background:
    /health answers 503 {"status": "loading"} until it is ready. Launched as several ranks (torchrun,
    or --nnodes N --node-rank R --dist-init-addr HOST:PORT), rank 0 serves and the others compute
    their --devices entries rankN:DEVICE.
    """

    def cli_cmd(self) -> None:
        """Bind the port, start uvicorn, load the engine behind it; a load failure stops the server
        and is raised here (one line and exit status 2 for a StrataError)."""
        from strata_core.remote import launch_of, serve_stages
        from strata_core.serving.server import create_app
        from strata_core.serving.server.http import StrataServer, uvicorn_config

        settings = self.strata_settings()
        launch = launch_of(settings)
        if launch is not None and settings.conv_cache:
            log.info("the conversation cache is off across ranks (the other ranks hold no snapshots)")
            settings = settings.model_copy(update={"conv_cache": 0})
        if launch is not None and launch.rank != 0:
            serve_stages(settings, launch)
            return
        if self.host not in {"127.0.0.1", "localhost", "::1"} and self.api_key is None:
            log.warning("listening on %s without --api-key: anyone who can reach it may use the model", self.host)
        sock = listen(self.host, self.port)
        failures: list[BaseException] = []

        def failed(error: BaseException) -> None:
            failures.append(error)
            server.should_exit = True

        app = create_app(settings, on_load_error=failed)
        raise_fd_limit(settings.max_connections)
        server = StrataServer(uvicorn_config(app, settings, log_level="info"), settings)
        log.info("strata serve: model %s, strategy %s, devices %s, %d slots, http://%s:%d/v1",
                 self.model, self.strategy, ",".join(self.devices), self.parallel, self.host, self.port)
        server.run(sockets=[sock])
        if failures:
            raise failures[0]
