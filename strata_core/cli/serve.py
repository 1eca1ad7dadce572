"""``strata serve``: the OpenAI-compatible HTTP API, served by uvicorn."""

from __future__ import annotations

import logging

from strata_core.config import StrataSettings

log = logging.getLogger(__name__)


class ServeCommand(StrataSettings):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).

    Binds 127.0.0.1 unless --host says otherwise; --api-key (or STRATA_API_KEY) guards every route
    but /health.
    """

    def cli_cmd(self) -> None:
        """Load the engine (in the app's lifespan) and run uvicorn until interrupted."""
        import uvicorn

        from strata_core.server import create_app

        if self.host not in {"127.0.0.1", "localhost", "::1"} and self.api_key is None:
            log.warning("listening on %s without --api-key: anyone who can reach it may use the model", self.host)
        log.info("strata serve: model %s, strategy %s, devices %s, %d slots, http://%s:%d/v1",
                 self.model, self.strategy, ",".join(self.devices), self.parallel, self.host, self.port)
        uvicorn.run(create_app(self), host=self.host, port=self.port, log_level="info", timeout_graceful_shutdown=5)
