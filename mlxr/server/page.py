"""The web page at `/` (static files in ./static: HTML, CSS, plain JavaScript; no build step, no
CDN, so it works offline) and the two small routes it needs beside the APIs: `GET /api/info`
(what this server allows) and `GET /api/search?q=` (Hub search, as `mlxr search`).

The page and its files are public (no API key: they hold no secret, and the page is where a
key is entered); everything they call goes through the same security checks as any client.
Every page response carries a Content-Security-Policy that allows this origin's scripts,
styles and requests only: no inline script, no other origin, no framing. Model output is
rendered by the page's own markdown code, which escapes it first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the (string) annotations here

from ..errors import MlxrError
from .protocol import APIError, bad_request

STATIC = Path(__file__).resolve().parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
           "Cache-Control": "no-cache"}
MAX_SEARCH = 50


def static_file(name: str):
    """One of the page's files by bare name (no directories: nothing else is reachable)."""
    from fastapi.responses import Response

    path = STATIC / name
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in TYPES \
            or not path.is_file():
        raise APIError(404, f"no such file: {name}", "invalid_request_error")
    return Response(path.read_bytes(), media_type=TYPES[path.suffix], headers=HEADERS)


def register(app, state) -> None:
    @app.get("/")
    async def index():
        return static_file("index.html")

    @app.get("/static/{name}")
    async def static(name: str):
        return static_file(name)

    @app.get("/api/info")
    async def info():
        from .. import __version__

        return {"version": __version__, "default_model": state.model_id,
                "allow_pull": state.allow_pull, "allow_delete": state.allow_delete}

    @app.get("/api/search")
    async def search(request: Request):
        from ..store.hub import search as hub_search

        q = request.query_params.get("q", "")
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            raise bad_request("limit must be an integer", "limit") from None
        if not 1 <= limit <= MAX_SEARCH or len(q) > 200:
            raise bad_request(f"limit must be 1..{MAX_SEARCH} and q at most 200 characters")
        try:
            hits = await asyncio.to_thread(hub_search, q, limit=limit)
        except MlxrError as e:
            raise APIError(502, str(e).splitlines()[0], "server_error") from None
        return {"models": [{"name": h.repo_id, "downloads": h.downloads, "likes": h.likes,
                            "size": h.size, "quantization": h.quantization} for h in hits]}
