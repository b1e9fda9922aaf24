"""Ollama's API: `POST /api/generate`, `POST /api/chat` (NDJSON streamed by default) and
`GET /api/version`; the model-management routes (tags, show, ps, pull, delete) are in
ollama_models.py.

An Ollama body is translated into the OpenAI request models (`ChatRequest`, `CompletionRequest`)
and built into a `Job` by the same `chat_job` / `completion_job` as the OpenAI routes, then run
with `render.start` -- so validation, chat templates, tools, grammars, sampling defaults, queue
limits and metrics are shared. Only the wire format differs: one JSON object per line, a final
`done: true` line with counts and durations (ns), and errors as `{"error": "..."}`.

Options are Ollama's; the defaults are the model's generation_config.json (as on the OpenAI
routes), not Ollama's built-in ones (temperature 0.8, top_k 40, ...). Load-time options (num_ctx,
num_gpu, ...) have no effect here and are accepted; options that would change sampling in ways
this engine cannot (mirostat, typical_p, tfs_z) are a 400 unless neutral, as are unknown fields.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the (string) annotations here
from pydantic import Field

from . import render, request_checks
from .jobs import chat_job, completion_job
from .protocol import APIError, ChatRequest, CompletionRequest, _Req, bad_request
from .render import Logprobs, _splitter, collect, events_to_delta

IGNORED_OPTIONS = {"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
                   "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only",
                   "num_thread", "num_keep", "penalize_newline"}
NEUTRAL_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "mirostat_tau": None,
                   "mirostat_eta": None}
RENAMED = {"repeat_penalty": "repetition_penalty"}
SAMPLING = {"temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop"}


class _Base(_Req):
    model: str = ""
    stream: bool | None = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class GenerateRequest(_Base):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class OllamaChatRequest(_Base):
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _options(model, req: _Base) -> dict:
    """Ollama options + format/think -> OpenAI request fields (validated there)."""
    out: dict[str, Any] = {}
    for k, v in (req.options or {}).items():
        if v is None or k in IGNORED_OPTIONS:
            continue
        if k in NEUTRAL_OPTIONS:
            if NEUTRAL_OPTIONS[k] is not None and v != NEUTRAL_OPTIONS[k]:
                raise bad_request(f"option {k!r} is not supported", f"options.{k}")
        elif k in SAMPLING:
            out[RENAMED.get(k, k)] = v
        elif k == "num_predict":
            if not isinstance(v, int) or (v < 1 and v not in (-1, -2)):
                raise bad_request("options.num_predict must be -1, -2 or a positive integer",
                                  "options.num_predict")
            if v > 0:
                out["max_tokens"] = v
        elif k == "repeat_last_n":
            if not isinstance(v, int) or v < -1:
                raise bad_request("options.repeat_last_n must be -1, 0 or a positive integer",
                                  "options.repeat_last_n")
            if v:
                out["repetition_context_size"] = model.config.context_length if v < 0 else v
        else:
            raise bad_request(f"unrecognized option: {k!r}", f"options.{k}")
    if (req.options or {}).get("repeat_last_n") == 0:
        out.pop("repetition_penalty", None)  # 0: disabled
    fmt = req.format
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": fmt}}
    elif fmt:
        raise bad_request("format must be \"json\" or a JSON schema", "format")
    return out


def _chat_fields(req: _Base) -> dict:
    out: dict[str, Any] = {}
    if req.think is False:
        out["reasoning_effort"] = "none"
    elif req.think is True:
        out["chat_template_kwargs"] = {"enable_thinking": True}
    elif isinstance(req.think, str):
        out["reasoning_effort"] = req.think
    if req.logprobs:
        out["logprobs"], out["top_logprobs"] = True, req.top_logprobs
    elif req.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return out


def _message(i: int, m) -> dict:
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
    m = dict(m)
    if m.pop("images", None):
        raise bad_request(f"messages[{i}].images: images are not supported (text only)",
                          f"messages[{i}].images")
    if m.get("thinking"):
        m["reasoning_content"] = m["thinking"]
    m.pop("thinking", None)
    if m.get("tool_calls"):
        m["tool_calls"] = [{"type": "function", **tc} if isinstance(tc, dict) else tc
                           for tc in m["tool_calls"]]
    return m


def _no_template(model) -> bool:
    return model.tokenizer.chat_template is None


def generate_job(model, req: GenerateRequest, parse):
    for f in ("suffix", "template", "context", "images"):
        if getattr(req, f):
            raise bad_request(f"{f!r} is not supported by this server", f)
    fields = _options(model, req)
    if req.raw or _no_template(model):
        if req.system:
            raise bad_request(f"model {model.path.name!r} has no chat template: 'system' "
                              "cannot be applied" if not req.raw else
                              "'system' cannot be combined with raw: true", "system")
        if req.think is not None:
            raise bad_request("'think' needs the chat template (raw: false)", "think")
        ids = model.tokenizer.encode(req.prompt, add_special_tokens=True)
        if "max_tokens" not in fields:
            fields["max_tokens"] = max(1, model.config.context_length - len(ids))
        if req.logprobs:
            fields["logprobs"] = req.top_logprobs or 0
        return completion_job(model, parse(CompletionRequest, dict(fields, prompt=ids)))
    msgs = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    return chat_job(model, parse(ChatRequest, dict(fields, messages=msgs, **_chat_fields(req))))


def ollama_chat_job(model, req: OllamaChatRequest, parse):
    if _no_template(model):
        raise bad_request(f"model {model.path.name!r} has no chat template: use /api/generate "
                          "with raw: true for plain text completion", "messages")
    fields = dict(_options(model, req), **_chat_fields(req),
                  messages=[_message(i, m) for i, m in enumerate(req.messages)])
    if req.tools:
        fields["tools"] = [{"type": "function", **t} for t in req.tools]
    return chat_job(model, parse(ChatRequest, fields))


# -- wire format ---------------------------------------------------------------------------------

def _final(state, gen, t_req: float) -> dict:
    end = time.monotonic()
    ttft = gen.ttft if gen.ttft is not None else end - gen.t0
    return {"done": True, "done_reason": "length" if gen.finish_reason == "length" else "stop",
            "total_duration": int((end - t_req) * 1e9), "load_duration": 0,
            "prompt_eval_count": gen.prompt_tokens, "prompt_eval_duration": int(ttft * 1e9),
            "eval_count": gen.completion_tokens,
            "eval_duration": int(max(0.0, end - gen.t0 - ttft) * 1e9)}


def _calls(sp) -> list[dict]:
    out = []
    for i, c in enumerate(sp.tools.calls if sp.tools else []):
        try:
            args = json.loads(c["arguments"] or "{}")
        except ValueError:
            args = c["arguments"]
        out.append({"id": c["id"], "function": {"index": i, "name": c["name"],
                                                "arguments": args}})
    return out


def _piece(kind: str, content: str, thought: str, calls=None) -> dict:
    if kind == "generate":
        d = {"response": content}
        if thought:
            d["thinking"] = thought
        return d
    msg = {"role": "assistant", "content": content}
    if thought:
        msg["thinking"] = thought
    if calls:
        msg["tool_calls"] = calls
    return {"message": msg}


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def _stream(state, model, job, gen, kind: str, t_req: float):
    head = {"model": state.model_id}
    sp, lpf = _splitter(job), Logprobs(model.tokenizer)
    try:
        async for out in gen:
            d = events_to_delta(sp.feed(out.text) + (sp.flush() if out.finish_reason else []))
            lp = lpf.chat(out.logprobs) if job.logprobs is not None and out.logprobs else None
            if d.get("content") or d.get("reasoning") or lp:
                line = dict(head, created_at=_now(), **_piece(kind, d.get("content", ""),
                                                             d.get("reasoning", "")),
                            done=False)
                if lp:
                    line["logprobs"] = lp
                yield _line(line)
        if gen.finish_reason is None:
            d = events_to_delta(sp.flush())
            if d.get("content") or d.get("reasoning"):
                yield _line(dict(head, created_at=_now(), **_piece(
                    kind, d.get("content", ""), d.get("reasoning", "")), done=False))
        calls = _calls(sp)
        if calls:
            yield _line(dict(head, created_at=_now(), **_piece(kind, "", "", calls), done=False))
        yield _line(dict(head, created_at=_now(), **_piece(kind, "", ""),
                         **_final(state, gen, t_req)))
    except Exception as e:  # noqa: BLE001 -- mid-stream: Ollama sends an error line
        yield _line({"error": f"generation failed: {e}"})


async def _full(state, model, job, gen, kind: str, t_req: float) -> dict:
    sp, evs, lps = await collect(gen, job)
    d = events_to_delta(evs)
    out = dict(model=state.model_id, created_at=_now(),
               **_piece(kind, d.get("content", ""), d.get("reasoning", ""), _calls(sp)),
               **_final(state, gen, t_req))
    if job.logprobs is not None:
        out["logprobs"] = Logprobs(model.tokenizer).chat(lps)
    return out


# -- routes --------------------------------------------------------------------------------------

def register(app, state, parse) -> None:
    """Add the Ollama routes to `app`; `parse(cls, body: bytes)` is app.py's validating parser."""
    from fastapi.responses import JSONResponse

    def parse_dict(cls, data: dict):
        return parse(cls, json.dumps(data).encode())

    async def serve(request: Request, cls, kind: str):
        t_req = time.monotonic()
        try:
            req = parse(cls, await request.body())
            if not req.model:
                raise bad_request("model is required", "model")
            empty = not (req.prompt if kind == "generate" else req.messages)
            if empty and req.keep_alive is not None and \
                    state.models.keep_alive_seconds(req.keep_alive) == 0:
                # Ollama: unload the model (`mlxr stop`), generate nothing
                mid = state.models.resolve(req.model)[0]
                await asyncio.to_thread(state.models.unload, mid)  # joins threads, collects
                return JSONResponse(dict(model=mid, created_at=_now(), **_piece(kind, "", ""),
                                         done=True, done_reason="unload"))
            entry = await state.acquire(req.model, req.keep_alive)
            model, engine = entry.model, entry.engine
            if empty:  # Ollama: load the model, generate nothing
                return JSONResponse(dict(model=entry.model_id, created_at=_now(),
                                         **_piece(kind, "", ""), done=True, done_reason="load"))
            job = await request_checks.build_job(
                generate_job if kind == "generate" else ollama_chat_job, model, req, parse_dict)
            gen = await render.start(entry, engine, job, "ollama_" + kind)
        except APIError as e:
            return JSONResponse({"error": e.message}, e.status, headers=e.headers)
        if req.stream is False:
            return await render.json_unless_disconnected(
                request.receive, _full(entry, model, job, gen, kind, t_req))
        return render.EventStream(_stream(entry, model, job, gen, kind, t_req),
                                  media_type="application/x-ndjson",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/api/generate")
    async def generate(request: Request):
        return await serve(request, GenerateRequest, "generate")

    @app.post("/api/chat")
    async def chat(request: Request):
        return await serve(request, OllamaChatRequest, "chat")

    @app.get("/api/version")
    async def version():
        from .. import __version__
        return {"version": __version__}
