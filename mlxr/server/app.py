"""The ASGI app: OpenAI routes (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models),
/health, /metrics and the Ollama routes (ollama.py, ollama_models.py), over the batching engine
(`mlxr.engine.AsyncEngine` on a thread, or `mlxr.engine.proc_engine.ProcEngine` in a process of
its own, when this process then loads the config and tokenizer only).

Requests are validated here and turned into a `Job` (prompt ids, sampling params, grammar, tool
and reasoning parsing) by `jobs.py`; `render.py` turns the engine's outputs into each API's wire
format.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fastapi import Request
from pydantic import ValidationError

from .. import bounded_json
from ..errors import MlxrError
from . import error_handlers, ollama, ollama_models, render, request_checks
from .jobs import chat_job, completion_job
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ResponsesRequest,
    bad_request,
    unsupported,
)
from .responses import responses_full, responses_job, responses_stream
from .security import SecurityConfig, SecurityMiddleware

log = logging.getLogger("mlxr.server")


class ServerState:
    """The model and engine, loaded in the background so /health can say "loading".
    engine_process: "on" runs the engine in a child process (ProcEngine), "off" on a thread of
    this process (AsyncEngine), "auto" = on when the device is CUDA."""

    def __init__(self, model_path: Path, model_id: str, engine_kw: dict, load_kw: dict,
                 engine_process: str = "auto", allow_pull: bool = False,
                 allow_delete: bool = False):
        if engine_process not in ("auto", "on", "off"):
            raise ValueError(f"engine_process must be auto, on or off, not {engine_process!r}")
        self.model_path, self.model_id = Path(model_path), model_id
        self.engine_kw, self.load_kw, self.engine_process = engine_kw, load_kw, engine_process
        self.allow_pull, self.allow_delete = allow_pull, allow_delete
        self.model = self.engine = None
        self.error: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics()
        self.ready = threading.Event()
        # called once the load ended (state.error says how); the runner stops the server on an
        # error and reports it, so it is only logged here when nobody is told
        self.on_loaded: Callable[[], None] | None = None

    def load(self) -> None:
        log.info("loading %s (%s)", self.model_id, self.model_path)
        try:
            import mlxr

            from ..engine import AsyncEngine
            from ..engine.proc_engine import ProcEngine
            from ..model import _pick_device

            mode = self.engine_process
            if mode == "auto":
                mode = "on" if _pick_device(self.load_kw.get("device")).type == "cuda" else "off"
            if mode == "on":
                # the child loads (and validates) the weights; here: config and tokenizer
                engine = ProcEngine(self.model_path, self.load_kw, **self.engine_kw)
                try:
                    model = mlxr.load(self.model_path, **self.load_kw, weights=False)
                    model.tokenizer  # noqa: B018 -- fail now, not on the first request
                    engine.wait_ready()
                except BaseException:
                    engine.close()
                    raise
            else:
                model = mlxr.load(self.model_path, **self.load_kw)
                model.tokenizer  # noqa: B018 -- fail now, not on the first request
                engine = AsyncEngine(model, **self.engine_kw)
            self.set_ready(model, engine)
        except Exception as e:  # reported by /health and every request
            log.debug("loading %s failed", self.model_path, exc_info=True)
            self.error = str(e) if isinstance(e, MlxrError) else f"{type(e).__name__}: {e}"
            if self.on_loaded is None:
                log.error("loading %s failed: %s", self.model_path, self.error)
        if self.on_loaded is not None:
            self.on_loaded()

    def set_ready(self, model, engine) -> None:
        """Serve requests from now on. What loading left on the heap (modules, the tokenizer,
        the model: ~200k objects) is frozen out of the cyclic GC first: otherwise each full
        collection walks all of it again, ~100 ms every few hundred requests at 256 streams.
        And the young generation's threshold goes from 700 to 50k allocations: 256 requests in
        flight keep more than 700 objects alive, so at 700 a collection ran every few requests
        (and promoted them all into older generations, collected again) while finding nearly no
        garbage: ~45 us of ~260 per short request."""
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000)
        self.engine, self.model = engine, model
        self.ready.set()

    def require(self):
        if self.error:
            raise APIError(500, f"the model failed to load: {self.error}", "server_error")
        if not self.ready.is_set():
            raise APIError(503, "the model is still loading", "server_error",
                           code="model_loading", headers={"Retry-After": "2"})
        return self.model, self.engine

    def check_model(self, name: str | None) -> None:
        if name and name not in (self.model_id, self.model_path.name, str(self.model_path)):
            raise APIError(404, f"The model {name!r} does not exist (this server serves "
                           f"{self.model_id!r})",
                           "invalid_request_error", "model", "model_not_found")


def _parse(cls, body: bytes):
    try:  # bounded: depth, numbers, lone surrogates (no consumer of the body accepts them)
        data = bounded_json.loads(body, "request body", strings=True)
    except MlxrError as e:
        raise bad_request(str(e)) from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "str",
                                                                         "list[", "dict[")))
        msg = ("unrecognized request argument supplied: " + loc if err["type"] == "extra_forbidden"
               else f"{loc}: {err['msg']}")
        raise bad_request(msg, loc or None) from None
    unsupported(req)
    return req


# -- the app -------------------------------------------------------------------------------------

def create_app(state: ServerState, security: SecurityConfig, load_in_background: bool = True):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    security.check()
    request_checks.allow_client_templates(security.allow_client_chat_template)
    app = FastAPI(title="mlxr", docs_url=None, redoc_url=None, openapi_url=None)

    @app.on_event("startup")
    async def _startup():
        if load_in_background:
            threading.Thread(target=state.load, daemon=True, name="mlxr-load").start()
        else:
            state.load()

    error_handlers.install(app)

    @app.get("/health")
    async def health():
        error = state.error or (state.engine is not None and not state.engine.ready
                                and state.engine.error)  # ProcEngine: its process is gone
        if error:
            return JSONResponse({"status": "error", "message": error}, 500)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "2"})
        return {"status": "ok", "model": state.model_id}

    @app.get("/metrics")
    async def metrics():
        stats = state.engine.stats() if state.engine is not None else None
        return PlainTextResponse(state.metrics.render(stats, state.ready.is_set()),
                                 media_type="text/plain; version=0.0.4")

    def model_card():
        return {"id": state.model_id, "object": "model", "created": state.created,
                "owned_by": "mlxr"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        state.check_model(name)
        return model_card()

    async def serve(cls, build, route: str, stream_fn, full_fn, request: Request):
        req = _parse(cls, await request.body())
        state.check_model(getattr(req, "model", None))
        model, engine = state.require()
        job = await request_checks.build_job(build, model, req)
        if req.stream:
            gen = await render.start(state, engine, job, route)
            return render.EventStream(stream_fn(state, model, job, gen, req),
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        return await render.json_unless_disconnected(
            request.receive, full_fn(state, model, engine, job, req, route))

    # The generation routes are plain Starlette routes (endpoint(request) -> response): FastAPI's
    # dependency solving and endpoint wrapping have nothing to do for them and cost ~50 us per
    # request (in-process, 256 concurrent)
    for path, args in (
            ("/v1/chat/completions", (ChatRequest, chat_job, "chat", render.chat_stream,
                                      render.chat_full)),
            ("/v1/completions", (CompletionRequest, completion_job, "completions",
                                 render.completion_stream, render.completion_full)),
            ("/v1/responses", (ResponsesRequest, responses_job, "responses",
                               responses_stream, responses_full))):
        app.add_route(path, partial(serve, *args), methods=["POST"])

    ollama.register(app, state, _parse)  # /api/generate, /api/chat, /api/version
    ollama_models.register(app, state, _parse)  # /api/tags, show, ps, pull, delete
    app.add_middleware(SecurityMiddleware, cfg=security)
    return app

