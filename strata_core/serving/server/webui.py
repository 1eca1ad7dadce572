"""The chat page at ``/``: one HTML file shipped in the package (static/index.html, CSS and JS inline).

It needs no API key to load (it asks for one when the API answers 401). Its Content-Security-Policy
lets it run its own inline script and talk to this server only: nothing is fetched from elsewhere.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from litestar import MediaType, Response, get

__all__ = ["chat_page", "page_html"]

PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@cache
def page_html() -> bytes:
    """The chat page, read once from the package."""
    return (files(__package__) / "static" / "index.html").read_bytes()


@get("/", media_type=MediaType.HTML, include_in_schema=False, sync_to_thread=False)
def chat_page() -> Response[bytes]:
    """The chat page."""
    return Response(page_html(), media_type=MediaType.HTML, headers=PAGE_HEADERS)
