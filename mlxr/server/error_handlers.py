"""The app's exception handlers: every error in its route's API shape, Ollama's
`{"error": "..."}` under /api/ and OpenAI's envelope elsewhere (404s and 405s included)."""

from __future__ import annotations

import logging

from .protocol import APIError, error_body
from .security import OLLAMA_PREFIX

log = logging.getLogger("mlxr.server")


def error(request, status: int, body: dict, headers=None):
    """`body` (OpenAI's envelope) as the response, reshaped for Ollama's routes."""
    from fastapi.responses import JSONResponse

    if request.url.path.startswith(OLLAMA_PREFIX):
        body = {"error": body["error"]["message"]}
    return JSONResponse(body, status, headers=headers)


def install(app) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        msg = (f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404
               else f"Method {request.method} not allowed for {request.url.path}"
               if exc.status_code == 405 else str(exc.detail))
        return error(request, exc.status_code, error_body(msg, "invalid_request_error"),
                     getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        err = (exc.errors() or [{}])[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        return error(request, 400, error_body(f"{loc}: {err.get('msg')}", param=loc or None))

    @app.exception_handler(Exception)
    async def _server_error(request, exc):
        log.exception("unhandled error")
        return error(request, 500, error_body(f"internal error: {type(exc).__name__}",
                                              "server_error"))
