"""The ASGI app: OpenAI routes (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models),
/health, /metrics and the Ollama routes (ollama.py), over the batching engine
(`mlxr.engine.AsyncEngine` on a thread, or `mlxr.engine.proc_engine.ProcEngine` in a process of
its own, when this process then loads the config and tokenizer only).

Requests are validated and turned into a `Job` (prompt ids, sampling params, grammar, tool and
reasoning parsing) here; `render.py` turns the engine's outputs into each API's wire format.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from fastapi import Request
from pydantic import ValidationError

from ..errors import MlxrError
from ..text.sampling import SamplingParams
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ResponsesRequest,
    bad_request,
    error_body,
    unsupported,
)
from .security import SecurityConfig, SecurityMiddleware

log = logging.getLogger("mlxr.server")


@dataclass
class Job:
    """One validated generation request."""

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None
    processor: object = None
    family: str | None = None  # tool-call format to parse, None = no tool parsing
    reasoning: bool = False
    start_in_reasoning: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)


class ServerState:
    """The model and engine, loaded in the background so /health can say "loading".
    engine_process: "on" runs the engine in a child process (ProcEngine), "off" on a thread of
    this process (AsyncEngine), "auto" = on when the device is CUDA."""

    def __init__(self, model_path: Path, model_id: str, engine_kw: dict, load_kw: dict,
                 engine_process: str = "auto"):
        if engine_process not in ("auto", "on", "off"):
            raise ValueError(f"engine_process must be auto, on or off, not {engine_process!r}")
        self.model_path, self.model_id = Path(model_path), model_id
        self.engine_kw, self.load_kw, self.engine_process = engine_kw, load_kw, engine_process
        self.model = self.engine = None
        self.error: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics()
        self.ready = threading.Event()

    def load(self) -> None:
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
            log.info("model %s ready", self.model_id)
        except Exception as e:  # reported by /health and every request
            log.exception("loading %s failed", self.model_path)
            self.error = f"{type(e).__name__}: {e}"

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
                           f"{self.model_id!r}; it never downloads models)",
                           "invalid_request_error", "model", "model_not_found")


# -- request -> Job ------------------------------------------------------------------------------

def _messages(raw: list) -> list[dict]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in (
                "system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, developer, user, assistant "
                              "or tool", f"messages[{i}].role")
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") not in (
                        "text", "input_text", "output_text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"messages[{i}].content[{j}]: content type {kind!r} is "
                                      "not supported (text only)", f"messages[{i}].content[{j}]")
                texts.append(str(part.get("text", "")))
            m["content"] = "".join(texts)
        elif c is not None and not isinstance(c, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for tc in calls:
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:  # templates expect a mapping (as transformers and mlx-lm pass it)
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                tc["function"] = fn
                fixed.append(tc)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def _sampling(model, req, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    ctx = model.config.context_length
    if prompt_len >= ctx:
        raise bad_request(f"the prompt has {prompt_len} tokens; the model's context is {ctx} "
                          "tokens", "messages", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = ctx - prompt_len
    elif prompt_len + max_tokens > ctx:
        raise bad_request(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                          f"the model's context of {ctx} tokens", "max_tokens",
                          "context_length_exceeded")
    bias = None
    if getattr(req, "logit_bias", None):
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
        if any(abs(v) > 100 for v in bias.values()):
            raise bad_request("logit_bias values must be in [-100, 100]", "logit_bias")
    stop = getattr(req, "stop", None)
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    kw = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
              top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
              presence_penalty=getattr(req, "presence_penalty", None) or 0.0,
              frequency_penalty=getattr(req, "frequency_penalty", None) or 0.0,
              logit_bias=bias, seed=req.seed, stop=stop,
              stop_token_ids=tuple(getattr(req, "stop_token_ids", None) or ()),
              ignore_eos=bool(getattr(req, "ignore_eos", False)))
    if getattr(req, "repetition_context_size", None):
        kw["repetition_context_size"] = req.repetition_context_size
    try:
        params = SamplingParams(**kw).with_defaults(model.generation_config)
        params.validate(model.config.vocab_size)
    except MlxrError as e:
        raise bad_request(str(e), str(e).split(":")[0].split("[")[0].strip() or None) from None
    return params


def chat_job(model, req: ChatRequest) -> Job:
    from .grammar import GrammarProcessor, response_format_grammar, tool_call_grammar
    from .tools import detect_family, template_supports_tools

    tok = model.tokenizer
    if tok.chat_template is None:
        raise bad_request(f"model {model.path.name!r} has no chat template: use "
                          "/v1/completions for plain text completion", "messages",
                          "no_chat_template")
    choice = req.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    if tools and choice != "none":
        template = tok.get_chat_template(tools)
        if not template_supports_tools(template):
            raise bad_request(f"model {model.path.name!r} does not support tools (its chat "
                              "template has no tool support)", "tools")
    else:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        tools, template = None, tok.chat_template
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
    try:
        ids = tok.apply_chat_template(_messages(req.messages), tools=tools,
                                      add_generation_prompt=True, tokenize=True, **kwargs)
    except MlxrError as e:
        raise bad_request(f"chat template: {e}", "messages") from None
    family = detect_family(template) if tools else None
    reasoning = "<think>" in template or "reasoning_content" in template
    job = Job(list(ids), _sampling(model, req, len(ids), req.max_completion_tokens or
                                    req.max_tokens),
              family=family, reasoning=reasoning,
              start_in_reasoning=reasoning and tok.decode(ids[-24:]).rstrip().endswith(
                  "<think>"),
              include_usage=bool(req.stream_options and req.stream_options.include_usage))
    if req.logprobs:
        job.logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    rf = req.response_format.model_dump(by_alias=True, exclude_none=True) \
        if req.response_format else None
    grammar = response_format_grammar(rf)
    if tools:
        tg = tool_call_grammar(tools, choice, family or "hermes")
        if tg and grammar:
            raise bad_request("response_format cannot be combined with a forced tool_choice",
                              "response_format")
        grammar = grammar or tg
    if grammar:
        job.processor = GrammarProcessor(model, grammar)
    return job


def completion_job(model, req: CompletionRequest) -> Job:
    from .grammar import GrammarProcessor, response_format_grammar

    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        ids = model.tokenizer.encode(p, add_special_tokens=True)
    else:
        ids = [int(i) for i in p]
        if not ids or any(not 0 <= i < model.config.vocab_size for i in ids):
            raise bad_request("prompt token ids must be non-empty and inside the vocabulary",
                              "prompt")
    job = Job(ids, _sampling(model, req, len(ids), req.max_tokens or 16),
              logprobs=req.logprobs,
              include_usage=bool(req.stream_options and req.stream_options.include_usage))
    rf = req.response_format.model_dump(by_alias=True, exclude_none=True) \
        if req.response_format else None
    grammar = response_format_grammar(rf)
    if grammar:
        job.processor = GrammarProcessor(model, grammar)
    return job


def _parse(cls, body: bytes):
    try:
        data = json.loads(body)
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
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
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from . import ollama, render
    from .responses import responses_job

    security.check()
    app = FastAPI(title="mlxr", docs_url=None, redoc_url=None, openapi_url=None)

    @app.on_event("startup")
    async def _startup():
        if load_in_background:
            threading.Thread(target=state.load, daemon=True, name="mlxr-load").start()
        else:
            state.load()

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        msg = (f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404
               else f"Method {request.method} not allowed for {request.url.path}"
               if exc.status_code == 405 else str(exc.detail))
        return JSONResponse(error_body(msg, "invalid_request_error"), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        err = (exc.errors() or [{}])[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        return JSONResponse(error_body(f"{loc}: {err.get('msg')}", param=loc or None), 400)

    @app.exception_handler(Exception)
    async def _server_error(request, exc):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"),
                            500)

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
        job = build(model, req)
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
                               render.responses_stream, render.responses_full))):
        app.add_route(path, partial(serve, *args), methods=["POST"])

    ollama.register(app, state, _parse)  # /api/generate, /api/chat, /api/tags, /api/version
    app.add_middleware(SecurityMiddleware, cfg=security)
    return app

