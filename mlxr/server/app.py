"""The ASGI app: OpenAI routes (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models),
/health, /metrics, the Ollama routes (ollama.py, ollama_models.py), embeddings (embeddings.py)
and the web page (page.py), over one batching engine per loaded model (`mlxr.engine.AsyncEngine`
on a thread, or `mlxr.engine.proc_engine.ProcEngine` in a process of its own, when this process
then loads the config and tokenizer only); models_manager.py loads and unloads them.

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
from . import embeddings, error_handlers, ollama, ollama_models, page, render, request_checks
from .jobs import chat_job, completion_job
from .metrics import Metrics
from .models_manager import ModelManager, resolver
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
    """The server's models: those named on the command line (`model_path`, more in `preload`),
    loaded in the background at startup so /health can say "loading", and any other local model
    a request names, loaded on demand by the ModelManager (models_manager.py).
    engine_process: "on" runs each engine in a child process (ProcEngine), "off" on a thread of
    this process (AsyncEngine), "auto" = on when the device is CUDA."""

    def __init__(self, model_path: Path | None, model_id: str | None, engine_kw: dict,
                 load_kw: dict, engine_process: str = "auto", allow_pull: bool = False,
                 allow_delete: bool = False, keep_alive: float | None = 300.0,
                 memory_budget: int | None = None,
                 preload: list[tuple[Path, str]] | None = None):
        if engine_process not in ("auto", "on", "off"):
            raise ValueError(f"engine_process must be auto, on or off, not {engine_process!r}")
        pinned = ([(Path(model_path), model_id or Path(model_path).name)] if model_path
                  else []) + [(Path(p), i) for p, i in preload or []]
        self.pinned = {mid: path for path, mid in pinned}
        self.model_id = pinned[0][1] if pinned else None  # the default model of a request
        self.engine_kw, self.load_kw, self.engine_process = engine_kw, load_kw, engine_process
        self.allow_pull, self.allow_delete = allow_pull, allow_delete
        self.error: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics()
        self.ready = threading.Event()
        self.models = ModelManager(self.build_engine, resolver(self.pinned), self.metrics,
                                   self._device().type, keep_alive, memory_budget,
                                   self.kv_pool_sizes)
        # called once the preload ended (state.error says how); the runner stops the server on
        # an error and reports it, so it is only logged here when nobody is told
        self.on_loaded: Callable[[], None] | None = None

    def _device(self):
        from ..model import _pick_device

        return _pick_device(self.load_kw.get("device"))

    def kv_pool_sizes(self, path: Path) -> tuple[int, int]:
        """The smallest and the full KV pool of a model's engine, in bytes, from its config
        (the ModelManager's sizer); for a hybrid family, what its per-sequence caches and
        prefix snapshots may hold (as LLMEngine sizes them)."""
        import mlxr

        from ..engine.memory import pool_plan, sequence_caches_plan, snapshot_budget

        model = mlxr.load(path, **self.load_kw, weights=False)
        c, kw = model.config, self.engine_kw
        sizes = (c, model.dtype, kw.get("block_size", 16), kw.get("max_num_seqs", 16))
        plan = pool_plan(*sizes) if c.arch is None else sequence_caches_plan(
            *sizes, snapshot_budget(self._device(), kw.get("prefix_snapshot_bytes")))
        return plan.bytes(plan.min_blocks), plan.bytes(plan.full_blocks)

    def build_engine(self, path: Path, memory_budget: int | None = None):
        """(model, engine) for one model directory, its weights and KV pool within
        `memory_budget` bytes when given (the ModelManager's loader)."""
        import mlxr

        from ..engine import AsyncEngine
        from ..engine.proc_engine import ProcEngine

        mode = self.engine_process
        if mode == "auto":
            mode = "on" if self._device().type == "cuda" else "off"
        kw = dict(self.engine_kw, memory_budget=memory_budget)
        if mode == "on":
            # the child loads (and validates) the weights; here: config and tokenizer
            engine = ProcEngine(path, self.load_kw, **kw)
            try:
                model = mlxr.load(path, **self.load_kw, weights=False)
                model.tokenizer  # noqa: B018 -- fail now, not on the first request
                engine.wait_ready()
            except BaseException:
                engine.close()
                raise
        else:
            model = mlxr.load(path, **self.load_kw)
            model.tokenizer  # noqa: B018 -- fail now, not on the first request
            engine = AsyncEngine(model, **kw)
        freeze_heap()
        return model, engine

    def load(self) -> None:
        """Load the models named on the command line (pinned: never unloaded when idle)."""
        for mid in self.pinned:
            try:
                self.models.load_sync(mid, pin=True)
            except Exception as e:  # reported by /health and stops the server (runner)
                self.error = str(e) if isinstance(e, MlxrError) else f"{type(e).__name__}: {e}"
                if self.on_loaded is None:
                    log.error("loading %s failed: %s", mid, self.error)
                break
        if not self.error:
            self.ready.set()
        if self.on_loaded is not None:
            self.on_loaded()

    def check_ready(self) -> None:
        if self.error:
            raise APIError(500, f"the model failed to load: {self.error}", "server_error")
        if not self.ready.is_set():
            raise APIError(503, "the model is still loading", "server_error",
                           code="model_loading", headers={"Retry-After": "2"})

    async def acquire(self, name: str | None, keep_alive=None):
        """The loaded model (a models_manager.Loaded) that a request names."""
        self.check_ready()
        return await self.models.acquire(name, keep_alive)

    def engine_stats(self) -> dict | None:
        """The loaded engines' stats, summed (for /metrics)."""
        loaded = self.models.loaded()
        if not loaded:
            return None
        total: dict = {}
        for e in loaded:
            for k, v in e.engine.stats().items():
                total[k] = total.get(k, 0) + v
        return total


def freeze_heap() -> None:
    """What loading left on the heap (modules, the tokenizer, the model: ~200k objects) is
    frozen out of the cyclic GC: otherwise each full collection walks all of it again, ~100 ms
    every few hundred requests at 256 streams. And the young generation's threshold goes from
    700 to 50k allocations: 256 requests in flight keep more than 700 objects alive, so at 700
    a collection ran every few requests (and promoted them all into older generations,
    collected again) while finding nearly no garbage: ~45 us of ~260 per short request."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000)


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

    @app.on_event("shutdown")
    async def _shutdown():
        state.models.close()

    error_handlers.install(app)

    @app.get("/health")
    async def health():
        error = state.error or next((e.engine.error for e in state.models.loaded()
                                     if not e.engine.ready and e.engine.error), None)
        if error:  # a ProcEngine whose process is gone
            return JSONResponse({"status": "error", "message": error}, 500)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "2"})
        return {"status": "ok", "model": state.model_id,
                "loaded": [e.model_id for e in state.models.loaded()]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.engine_stats(), state.ready.is_set()),
                                 media_type="text/plain; version=0.0.4")

    def model_card(mid: str):
        return {"id": mid, "object": "model", "created": state.created, "owned_by": "mlxr"}

    @app.get("/v1/models")
    async def models():
        ids = dict.fromkeys([*state.pinned, *(e.model_id for e in state.models.loaded())])
        return {"object": "list", "data": [model_card(m) for m in ids]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        return model_card(state.models.resolve(name)[0])

    async def serve(cls, build, route: str, stream_fn, full_fn, request: Request):
        req = _parse(cls, await request.body())
        entry = await state.acquire(getattr(req, "model", None))
        model, engine = entry.model, entry.engine
        job = await request_checks.build_job(build, model, req)
        if req.stream:
            gen = await render.start(entry, engine, job, route)
            return render.EventStream(stream_fn(entry, model, job, gen, req),
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        return await render.json_unless_disconnected(
            request.receive, full_fn(entry, model, engine, job, req, route))

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
    embeddings.register(app, state, _parse)  # /v1/embeddings, /api/embed
    page.register(app, state)  # the web page at /, its static files, Hub search
    app.add_middleware(SecurityMiddleware, cfg=security)
    return app

