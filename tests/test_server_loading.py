"""The server listens before the model is loaded: /health is 503 "loading", the API 503 with
Retry-After, until the engine is ready; a model that fails to load is reported, not served."""

from __future__ import annotations

import threading

import httpx
import pytest
from test_server_support import FakeEngine, serving

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ModelFileError


def test_health_says_loading_until_the_model_is_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    reported = threading.Event()

    loaded: list[FakeEngine] = []

    def slow_load(settings: StrataSettings, progress) -> FakeEngine:
        progress(0.4)  # the dense weights are in, the arena is coming
        reported.set()
        assert release.wait(20)
        loaded.append(FakeEngine())
        return loaded[0]

    monkeypatch.setattr(Engine, "from_settings", staticmethod(slow_load))
    with serving(StrataSettings(model_alias="demo"), ready=False) as (url, _):
        try:
            assert reported.wait(20)
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.headers["retry-after"] == "1"
            assert health.json()["status"] == "loading" and health.json()["progress"] == 0.4
            busy = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "x"})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_loading"
        finally:
            release.set()
        for _ in range(1000):  # the loader thread hands the engine over within a few requests
            ready = httpx.get(f"{url}/health", timeout=10)
            if ready.status_code == 200:
                break
        assert ready.json()["status"] == "ok" and ready.json()["progress"] == 1.0
        assert loaded[0].captured == StrataSettings().parallel  # the decode graphs of every slot count, before serving
        assert loaded[0].prompts_captured and loaded[0].warmed  # and the prompt graphs, and the prompt path
        done = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert done.status_code == 200


def test_a_load_failure_goes_to_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(settings: StrataSettings, progress) -> None:
        raise ModelFileError("x.gguf: broken")

    failures: list[BaseException] = []
    reported = threading.Event()
    monkeypatch.setattr(Engine, "from_settings", staticmethod(broken))
    from strata_core.serving.server import create_app
    import test_server_support as support

    monkeypatch.setattr(support, "create_app", lambda s, e=None: create_app(
        s, e, on_load_error=lambda error: (failures.append(error), reported.set())))
    with serving(StrataSettings(model_alias="demo"), ready=False) as (url, _):
        assert reported.wait(20)
        assert httpx.get(f"{url}/health").json()["status"] == "loading"
    assert [str(f) for f in failures] == ["x.gguf: broken"]


def test_a_speculative_server_captures_the_windows_of_its_drafts_too() -> None:
    from strata_core.serving.server.loading import window_rows

    assert window_rows(StrataSettings(parallel=4)) == 4
    assert window_rows(StrataSettings(parallel=4, spec="ngram", spec_tokens=3)) == 16
    assert window_rows(StrataSettings(parallel=4, spec="mtp", spec_tokens=3), rewindable=False) == 4  # eager drafts
