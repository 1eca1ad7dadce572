"""The API docs at ``/schema``: one HTML page rendered on the server from the OpenAPI schema.

Litestar's own docs sites (Swagger, Redoc, Scalar...) load their scripts from a CDN and show a blank
page offline. This page has no script at all: each operation with its summary and the schemas of its
body and answers, then every schema as JSON; ``/schema/openapi.json`` is the schema itself.
"""

from __future__ import annotations

import html
import json
from typing import Any

from litestar import Request
from litestar.openapi.plugins import OpenAPIRenderPlugin

__all__ = ["EndpointList"]

_METHODS = ("get", "post", "put", "patch", "delete")
_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
code, pre { font: 13px ui-monospace, monospace; }
table { border-collapse: collapse; width: 100%; }
td, th { text-align: left; padding: .3rem .6rem; border-bottom: 1px solid #ddd; vertical-align: top; }
.method { font-weight: 600; text-transform: uppercase; }
pre { background: #f6f6f6; padding: .6rem; overflow-x: auto; }
"""


def _ref_names(node: Any) -> list[str]:
    """The component names ``node`` refers to (``#/components/schemas/X`` -> ``X``), in order."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            return [ref.rsplit("/", 1)[-1]]
        return [name for value in node.values() for name in _ref_names(value)]
    if isinstance(node, list):
        return [name for value in node for name in _ref_names(value)]
    return []


def _links(names: list[str]) -> str:
    return ", ".join(f'<a href="#{html.escape(n)}">{html.escape(n)}</a>' for n in dict.fromkeys(names))


def _operation_rows(schema: dict[str, Any]) -> list[str]:
    rows = []
    for path, item in schema.get("paths", {}).items():
        for method in _METHODS:
            op = item.get(method)
            if op is None:
                continue
            answers = " ".join(f"{html.escape(code)}: {_links(_ref_names(a))}" if _ref_names(a) else html.escape(code)
                               for code, a in op.get("responses", {}).items())
            rows.append(f'<tr><td class="method">{method}</td><td><code>{html.escape(path)}</code></td>'
                        f'<td>{html.escape(op.get("summary", ""))}</td>'
                        f'<td>{_links(_ref_names(op.get("requestBody", {})))}</td><td>{answers}</td></tr>')
    return rows


def render_page(schema: dict[str, Any], json_url: str) -> str:
    """The docs page of ``schema``; ``json_url`` is where the schema itself is served."""
    info = schema.get("info", {})
    title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
    schemas = "".join(
        f'<details id="{html.escape(name)}"><summary><code>{html.escape(name)}</code></summary>'
        f"<pre>{html.escape(json.dumps(body, indent=2))}</pre></details>"
        for name, body in schema.get("components", {}).get("schemas", {}).items()
    )  # fmt: skip
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{_STYLE}</style></head><body><h1>{title}</h1>"
            f'<p>The OpenAPI schema: <a href="{html.escape(json_url)}">{html.escape(json_url)}</a></p>'
            "<table><tr><th>method</th><th>path</th><th>what</th><th>body</th><th>answers</th></tr>"
            f'{"".join(_operation_rows(schema))}</table><h2>Schemas</h2>{schemas}</body></html>')


class EndpointList(OpenAPIRenderPlugin):
    """Litestar render plugin of :func:`render_page` (served at the docs root)."""

    def __init__(self) -> None:
        super().__init__(path="/")

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        """The docs page, with a link to the JSON schema's route."""
        return render_page(openapi_schema, self.get_openapi_json_route(request)).encode()
