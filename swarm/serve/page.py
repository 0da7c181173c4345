"""The page of ``swarm serve``: a live view of jobs in a browser, at ``/``.

Three files shipped with the package (``swarm/serve/static/``): the HTML, one script and
one style sheet, served as they are, without a token (they hold nothing of any job: a
browser cannot send a header when it opens a page). Everything the page shows it asks
of the API with the bearer token a person types in (kept in the tab's sessionStorage,
never in a cookie or a URL), so it sees what that token sees and nothing more.

Each file goes with a strict Content-Security-Policy: scripts only from this origin
and never inline, requests only to this origin, no frames, no forms posted elsewhere.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

#: The files, their media types.
FILES = {"index.html": "text/html; charset=utf-8",
         "page.js": "text/javascript; charset=utf-8",
         "page.css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def static_file(name: str) -> bytes:
    return (resources.files("swarm.serve") / "static" / name).read_bytes()


def add_page(app: FastAPI) -> None:
    """Serve the page at ``/`` and its script and style at ``/static/``."""
    files = {name: static_file(name) for name in FILES}

    def serve(name: str) -> Response:
        return Response(files[name], media_type=FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        return serve("index.html")

    @app.get("/static/page.js", include_in_schema=False)
    def script() -> Response:
        return serve("page.js")

    @app.get("/static/page.css", include_in_schema=False)
    def style() -> Response:
        return serve("page.css")
