"""The OpenAI-compatible HTTP API (Litestar): ``create_app(settings, engine=None)``."""

from strata_core.serving.server.app import StrataState, create_app

__all__ = ["StrataState", "create_app"]
