"""The chat page at ``/`` and the API docs at ``/schema``, over HTTP: open without the key, off with
--no-webui, nothing loaded from another site."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from test_server_support import FakeEngine, live_server

from strata_core.config import StrataSettings
from strata_core.serving.server.docs import render_page
from strata_core.serving.server.webui import page_html

KEY = {"Authorization": "Bearer sesame"}
# a URL of another site in a script, style sheet, image or frame (a link to follow is fine)
FOREIGN = re.compile(r"""(<script[^>]*\bsrc|<link[^>]*\bhref|<img[^>]*\bsrc|<iframe[^>]*\bsrc|@import|url\()\s*=?\s*["']?(https?:)?//""",
                     re.IGNORECASE)


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    with live_server(StrataSettings(model_alias="demo", api_key="sesame", parallel=1), FakeEngine()) as url:
        yield url


def test_page_is_served_without_the_key(keyed_url: str) -> None:
    page = httpx.get(f"{keyed_url}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.content == page_html()
    assert "<title>Strata chat</title>" in page.text
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    # the API still needs the key, also a route whose handler path is "/" (/v1/models)
    assert httpx.get(f"{keyed_url}/v1/models").status_code == 401
    assert httpx.get(f"{keyed_url}/props").status_code == 401


def test_page_loads_nothing_from_elsewhere() -> None:
    page = page_html().decode()
    assert FOREIGN.search('<script src="https://cdn.example/x.js">')  # the pattern does catch one
    assert FOREIGN.search(page) is None
    assert "http://" not in page and "https://" not in page
    assert "/v1/chat/completions" in page and "Authorization" in page


def test_no_webui_is_404() -> None:
    settings = StrataSettings(model_alias="demo", webui=False, parallel=1)
    assert StrataSettings(_cli_parse_args=["--no-webui"]).webui is False
    with live_server(settings, FakeEngine()) as url:
        assert httpx.get(f"{url}/").status_code == 404
        assert httpx.get(f"{url}/health").status_code == 200


def test_docs_are_offline(keyed_url: str) -> None:
    assert httpx.get(f"{keyed_url}/schema").status_code == 401
    docs = httpx.get(f"{keyed_url}/schema", headers=KEY)
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "<script" not in docs.text and FOREIGN.search(docs.text) is None
    assert "/v1/chat/completions" in docs.text and 'href="/schema/openapi.json"' in docs.text
    assert 'id="ChatCompletionRequest"' in docs.text  # the request body's schema is on the page
    for site in ("swagger", "redoc", "elements", "rapidoc", "scalar"):  # the CDN-backed sites are gone
        assert httpx.get(f"{keyed_url}/schema/{site}", headers=KEY).status_code == 404
    schema = httpx.get(f"{keyed_url}/schema/openapi.json", headers=KEY).json()
    assert "/" not in schema["paths"]  # the page is not part of the API


def test_docs_escape_the_schema() -> None:
    schema = {"info": {"title": "<b>x</b>", "version": "1"},
              "paths": {"/a<i>": {"get": {"summary": "<script>", "responses": {"200": {}}}}},
              "components": {"schemas": {"S": {"description": "</pre><script>"}}}}
    page = render_page(schema, "/schema/openapi.json")
    assert "<script>" not in page and "<b>x</b>" not in page
    assert "&lt;script&gt;" in page and "/a&lt;i&gt;" in page
