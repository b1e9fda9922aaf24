"""Engine outputs -> OpenAI wire format: chat and completions, streamed (SSE) and whole.

`start()` submits a Job to the engine and waits for its first output, so that a full queue is a
429 (with Retry-After) and bad input a 400 before any stream begins. Metrics (TTFT, TPOT, token
counts) are recorded here, at the HTTP layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from json.encoder import encode_basestring as json_str  # json.dumps(s, ensure_ascii=False), C

from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import MlxrError
from .protocol import APIError
from .tools import OutputSplitter


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def json_value(v) -> str:
    """json.dumps(v, ensure_ascii=False), short-cut for the per-chunk scalars."""
    if v is None:
        return "null"
    if type(v) is str:
        return json_str(v)
    return json.dumps(v, ensure_ascii=False)


def sse_prefix(envelope: dict, tail: str) -> str:
    """`data: ` + the JSON of `envelope` left open + `tail`: the constant head of every chunk of
    one stream, so that a chunk costs the encoding of its own fields only. The bytes equal
    `sse()` of the whole object (same key order, same separators)."""
    return "data: " + json.dumps(envelope, ensure_ascii=False)[:-1] + tail


class Gen:
    """A running request: iterate it for RequestOutputs; usage and timing are kept."""

    def __init__(self, state, job, route: str):
        self.state, self.job, self.route = state, job, route
        self.t0 = time.monotonic()
        self.ttft = None
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = len(job.prompt_ids), 0, 0
        self.agen = self.head = None
        self.finish_reason = None

    def _track(self, out) -> None:
        if self.ttft is None and out.token_ids:
            self.ttft = time.monotonic() - self.t0
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens or 0
        if out.finish_reason:
            self.finish_reason = out.finish_reason

    async def __aiter__(self):
        outcome = "cancelled"
        try:
            if self.head is not None:
                self._track(self.head)
                yield self.head
            async for out in self.agen:
                self._track(out)
                yield out
            outcome = "ok"
        except Exception:
            outcome = "error"
            raise
        finally:
            self.state.metrics.request_done(
                self.route, outcome, self.prompt_tokens, self.completion_tokens,
                self.cached_tokens, self.ttft, time.monotonic() - self.t0)
            if outcome != "ok":
                await self.agen.aclose()

    def usage(self, reasoning_tokens: int = 0) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


async def start(state, engine, job, route: str) -> Gen:
    from ..engine import EngineRequest, QueueFullError

    g = Gen(state, job, route)
    g.agen = engine.generate(EngineRequest(prompt_ids=job.prompt_ids, params=job.params,
                                           logprobs=job.logprobs,
                                           logits_processor=job.processor,
                                           skip_special_tokens=job.family is None))
    try:
        g.head = await g.agen.__anext__()
    except StopAsyncIteration:
        g.head = None
    except asyncio.CancelledError:  # the client left before the first output
        state.metrics.request_done(route, "cancelled")
        raise
    except QueueFullError as e:
        state.metrics.request_done(route, "rejected")
        retry = str(max(1, round(getattr(e, "retry_after", 1) or 1)))
        raise APIError(429, "the server is busy: too many queued requests", "server_error",
                       code="queue_full", headers={"Retry-After": retry}) from None
    except APIError:  # a grammar that does not fit the vocabulary (its prepare())
        state.metrics.request_done(route, "invalid")
        raise
    except MlxrError as e:
        state.metrics.request_done(route, "invalid")
        if str(e).startswith("engine failure"):
            raise APIError(500, str(e), "server_error") from None
        raise APIError(400, str(e), "invalid_request_error") from None
    return g


async def _client_gone(receive) -> None:
    """Return when the client disconnects (`receive`: the request's, its body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def json_unless_disconnected(receive, coro) -> Response:
    """`coro`'s result (a non-streaming generation's body) as JSON, unless the client
    disconnects first: the generation is then cancelled, so its cleanup aborts the request in
    the engine and frees its KV blocks instead of running to max_tokens for nobody (499)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():  # (cancel() above only requests it)
        return JSONResponse(task.result())
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)


class EventStream(StreamingResponse):
    """A StreamingResponse that watches for the client's disconnect with one plain task.

    Starlette runs the stream in an anyio task group next to a disconnect listener (uvicorn
    speaks ASGI 2.3: a send after the client left is dropped, not an error); at 256 streams that
    group's task, cancel scopes and cancellation delivery cost ~80 us of ~280 per short request.
    Here the stream runs in the request's own task and the listener cancels it when the client
    goes: the CancelledError ends the body iterator (so Gen aborts the request in the engine)
    and is absorbed here, as the task group's cancel scope absorbs it."""

    async def __call__(self, scope, receive, send) -> None:
        task, gone = asyncio.current_task(), False

        async def watch():
            nonlocal gone
            await _client_gone(receive)
            gone = True
            task.cancel()  # lands in stream_response: this task only waits inside it

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:  # cancelled from outside (shutdown): not ours to absorb
                raise
            task.uncancel()
        finally:
            watcher.cancel()


# -- logprobs ------------------------------------------------------------------------------------

def _lp(v: float) -> float:
    return max(float(v), -9999.0)


class Logprobs:
    """OpenAI logprobs entries for one request. Token text is what the token adds after the
    tokens before it (so SentencePiece word-initial spaces are kept); byte tokens give their
    byte."""

    def __init__(self, tok):
        self.tok, self.ctx = tok, []

    def piece(self, i: int) -> tuple[str, list[int]]:
        t = self.tok.id_to_token(i) or ""
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            b = bytes([int(t[3:5], 16)])
            return b.decode("utf-8", "replace"), list(b)
        ctx = self.ctx[-4:]
        prev, full = self.tok.decode(ctx), self.tok.decode(ctx + [i])
        s = full[len(prev):] if full.startswith(prev) else self.tok.decode([i])
        return s, list(s.encode())

    def chat(self, lps) -> list[dict]:
        out = []
        for t in lps or []:
            s, b = self.piece(t.token_id)
            top = []
            for i, v in t.top or []:
                ts, tb = self.piece(i)
                top.append({"token": ts, "logprob": _lp(v), "bytes": tb})
            out.append({"token": s, "logprob": _lp(t.logprob), "bytes": b, "top_logprobs": top})
            self.ctx.append(t.token_id)
        return out

    def completion(self, lps, offset: int) -> dict:
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in lps or []:
            s, _ = self.piece(t.token_id)
            d["tokens"].append(s)
            d["token_logprobs"].append(_lp(t.logprob))
            d["top_logprobs"].append({self.piece(i)[0]: _lp(v) for i, v in t.top or []})
            d["text_offset"].append(offset)
            offset += len(s)
            self.ctx.append(t.token_id)
        return d


# -- chat ----------------------------------------------------------------------------------------

def events_to_delta(evs: list[tuple]) -> dict:
    delta: dict = {}
    content = "".join(e[1] for e in evs if e[0] == "content")
    thought = "".join(e[1] for e in evs if e[0] == "reasoning")
    if content:
        delta["content"] = content
    if thought:
        delta["reasoning_content"] = delta["reasoning"] = thought
    calls: dict[int, dict] = {}
    for e in evs:
        if e[0] == "call":
            calls[e[1]] = {"index": e[1], "id": e[2], "type": "function",
                           "function": {"name": e[3], "arguments": ""}}
        elif e[0] == "args":
            c = calls.setdefault(e[1], {"index": e[1], "function": {"arguments": ""}})
            c["function"]["arguments"] += e[2]
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta


def _splitter(job) -> OutputSplitter:
    return OutputSplitter(job.family, job.reasoning, job.start_in_reasoning,
                          tools=job.family is not None)


def _reasoning_tokens(model, text: str) -> int:
    return len(model.tokenizer.encode(text, add_special_tokens=False)) if text else 0


def _finish(reason: str | None, calls) -> str:
    reason = reason or "stop"
    return "tool_calls" if calls and reason == "stop" else reason


async def chat_stream(state, model, job, gen: Gen, req):
    cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())

    # per chunk: the delta, logprobs and finish reason are encoded; the rest is prebuilt
    pre = sse_prefix({"id": cid, "object": "chat.completion.chunk", "created": created,
                      "model": state.model_id, "system_fingerprint": None},
                     ', "choices": [{"index": 0, "delta": ')

    def chunk(delta, finish=None, logprobs=None):
        d = ('{"content": ' + json_str(delta["content"]) + "}"
             if len(delta) == 1 and "content" in delta else json_value(delta))
        return (f'{pre}{d}, "logprobs": {json_value(logprobs)}, '
                f'"finish_reason": {json_value(finish)}}}], "usage": null}}\n\n')

    yield chunk({"role": "assistant", "content": ""})
    sp, thought, lpf = _splitter(job), [], Logprobs(model.tokenizer)
    try:
        async for out in gen:
            evs = sp.feed(out.text) + (sp.flush() if out.finish_reason else [])
            thought += [e[1] for e in evs if e[0] == "reasoning"]
            delta = events_to_delta(evs)
            lp = ({"content": lpf.chat(out.logprobs)}
                  if job.logprobs is not None and out.logprobs else None)
            if delta or lp:
                yield chunk(delta, None, lp)
        if gen.finish_reason is None:
            delta = events_to_delta(sp.flush())
            if delta:
                yield chunk(delta)
        yield chunk({}, _finish(gen.finish_reason, sp.tools and sp.tools.calls))
        if job.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                       "model": state.model_id, "choices": [],
                       "usage": gen.usage(_reasoning_tokens(model, "".join(thought)))})
    except Exception as e:  # noqa: BLE001 -- mid-stream: the client raises APIError from it
        yield sse({"error": {"message": f"generation failed: {e}", "type": "server_error",
                             "param": None, "code": None}})
    yield "data: [DONE]\n\n"


async def collect(gen: Gen, job):
    sp, evs, lps = _splitter(job), [], []
    async for out in gen:
        evs += sp.feed(out.text)
        lps += out.logprobs or []
    evs += sp.flush()
    return sp, evs, lps


async def chat_full(state, model, engine, job, req, route):
    gen = await start(state, engine, job, route)
    sp, evs, lps = await collect(gen, job)
    d = events_to_delta(evs)
    calls = sp.tools.calls if sp.tools else []
    msg = {"role": "assistant", "content": d.get("content", "" if not calls else None)}
    if "reasoning" in d:
        msg["reasoning_content"] = msg["reasoning"] = d["reasoning"]
    if calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in calls]
    return {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion",
            "created": int(time.time()), "model": state.model_id, "system_fingerprint": None,
            "choices": [{"index": 0, "message": msg, "finish_reason":
                         _finish(gen.finish_reason, calls),
                         "logprobs": {"content": Logprobs(model.tokenizer).chat(lps)}
                         if job.logprobs is not None else None}],
            "usage": gen.usage(_reasoning_tokens(model, d.get("reasoning", "")))}


# -- completions ---------------------------------------------------------------------------------

async def completion_stream(state, model, job, gen: Gen, req):
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

    head = {"id": cid, "object": "text_completion", "created": created,
            "model": state.model_id, "system_fingerprint": None}
    pre = sse_prefix(head, ', "choices": [{"index": 0, "text": ')

    def chunk(text, finish=None, logprobs=None):  # prebuilt head: see chat_stream
        return (f'{pre}{json_str(text)}, "logprobs": {json_value(logprobs)}, '
                f'"finish_reason": {json_value(finish)}}}], "usage": null}}\n\n')
    offset, lpf = 0, Logprobs(model.tokenizer)
    try:
        async for out in gen:
            lp = (lpf.completion(out.logprobs, offset)
                  if job.logprobs is not None else None)
            offset += len(out.text)
            if out.text or lp or out.finish_reason:
                yield chunk(out.text, out.finish_reason, lp)
        if gen.finish_reason is None:
            yield chunk("", "stop")
        if job.include_usage:
            yield sse(dict(head, choices=[], usage=gen.usage()))
    except Exception as e:  # noqa: BLE001 -- reported in the stream
        yield sse({"error": {"message": f"generation failed: {e}", "type": "server_error",
                             "param": None, "code": None}})
    yield "data: [DONE]\n\n"


async def completion_full(state, model, engine, job, req, route):
    gen = await start(state, engine, job, route)
    text, lps = [], []
    async for out in gen:
        text.append(out.text)
        lps += out.logprobs or []
    return {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion",
            "created": int(time.time()), "model": state.model_id, "system_fingerprint": None,
            "choices": [{"index": 0, "text": "".join(text), "finish_reason":
                         gen.finish_reason or "stop",
                         "logprobs": Logprobs(model.tokenizer).completion(lps, 0)
                         if job.logprobs is not None else None}],
            "usage": gen.usage()}
