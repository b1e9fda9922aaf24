"""The Responses API (`POST /v1/responses`), stateless: input items -> a chat Job, and the
response object / typed stream events (`response.created` ... `response.completed`)."""

from __future__ import annotations

import json
import secrets
import time

from .jobs import chat_job
from .protocol import ChatRequest, ResponsesRequest, bad_request
from .render import _reasoning_tokens, _splitter, collect, start


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(f"{where}[{j}]: content type {kind!r} is not supported (text only)",
                              f"{where}[{j}]")
        out.append(part.get("text") or part.get("refusal") or "")
    return "".join(out)


def input_messages(req: ResponsesRequest) -> list[dict]:
    msgs = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{i}].role {role!r} is not supported",
                                  f"input[{i}].role")
            msgs.append({"role": role, "content": _text(it.get("content"),
                                                        f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input[{i}]: item type {kind!r} is not supported",
                              f"input[{i}].type")
    return msgs


def to_chat(req: ResponsesRequest) -> ChatRequest:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported",
                              f"tools[{i}].type")
        tools.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (req.text or {}).get("format")
    rf = None
    if fmt and fmt.get("type") == "json_schema":
        rf = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    elif fmt and fmt.get("type") in ("json_object", "text"):
        rf = {"type": fmt["type"]}
    elif fmt:
        raise bad_request(f"text.format.type {fmt.get('type')!r} is not supported",
                          "text.format.type")
    effort = (req.reasoning or {}).get("effort")
    return ChatRequest.model_validate({k: v for k, v in dict(
        messages=input_messages(req), max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, seed=req.seed, tools=tools or None,
        tool_choice=choice, response_format=rf, reasoning_effort=effort,
        chat_template_kwargs=req.chat_template_kwargs,
        logprobs=True if req.top_logprobs is not None else None,
        top_logprobs=req.top_logprobs).items() if v is not None})


def responses_job(model, req: ResponsesRequest):
    return chat_job(model, to_chat(req))


def _usage(gen, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _envelope(state, req, rid: str, created: int, status: str, output: list, usage=None,
              incomplete=None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "model": state.model_id, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "store": False,
            "previous_response_id": None, "reasoning": req.reasoning, "truncation": "disabled"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class _Items:
    """Output items built from splitter events, with the stream events they produce."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.by_call: dict[int, dict] = {}

    def _add(self, item, events):
        if self.open is not None and self.open["type"] != "function_call":
            events += self._close(self.open)
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index":
                       len(self.items) - 1, "item": dict(item, status="in_progress")})
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})

    def _close(self, item) -> list[dict]:
        idx, ev = self.items.index(item), []
        if item["type"] == "message":
            part = item["content"][0]
            ev += [{"type": "response.output_text.done", "item_id": item["id"],
                    "output_index": idx, "content_index": 0, "text": part["text"]},
                   {"type": "response.content_part.done", "item_id": item["id"],
                    "output_index": idx, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            ev.append({"type": "response.reasoning_text.done", "item_id": item["id"],
                       "output_index": idx, "content_index": 0,
                       "text": item["content"][0]["text"]})
        else:
            ev.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": idx, "arguments": item["arguments"]})
        ev.append({"type": "response.output_item.done", "output_index": idx, "item": item})
        return ev

    def feed(self, evs) -> list[dict]:
        out: list[dict] = []
        for e in evs:
            kind = e[0]
            if kind in ("content", "reasoning"):
                t = "message" if kind == "content" else "reasoning"
                if self.open is None or self.open["type"] != t:
                    item = ({"type": "message", "id": _new_id("msg"), "status": "completed",
                             "role": "assistant", "content": [
                                 {"type": "output_text", "text": "", "annotations": []}]}
                            if t == "message" else
                            {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}]})
                    self._add(item, out)
                self.open["content"][0]["text"] += e[1]
                out.append({"type": "response.output_text.delta" if t == "message" else
                            "response.reasoning_text.delta", "item_id": self.open["id"],
                            "output_index": len(self.items) - 1, "content_index": 0,
                            "delta": e[1]} | ({"logprobs": []} if t == "message" else {}))
            elif kind == "call":
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": e[2],
                        "name": e[3], "arguments": "", "status": "completed"}
                self._add(item, out)
                self.by_call[e[1]] = item
            elif kind == "args":
                item = self.by_call[e[1]]
                item["arguments"] += e[2]
                out.append({"type": "response.function_call_arguments.delta",
                            "item_id": item["id"], "output_index": self.items.index(item),
                            "delta": e[2]})
        return out

    def close_all(self) -> list[dict]:
        out: list[dict] = []
        for item in self.items:
            if item is self.open or item["type"] == "function_call":
                out += self._close(item)
        self.open = None
        return out


def _status(gen):
    if gen.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


async def responses_full(state, model, engine, job, req, route):
    gen = await start(state, engine, job, route)
    _, evs, _ = await collect(gen, job)
    items = _Items()
    items.feed(evs)
    status, incomplete = _status(gen)
    thought = "".join(e[1] for e in evs if e[0] == "reasoning")
    return _envelope(state, req, _new_id("resp"), int(time.time()), status, items.items,
                     _usage(gen, _reasoning_tokens(model, thought)), incomplete)


async def responses_stream(state, model, job, gen, req):
    rid, created, seq = _new_id("resp"), int(time.time()), 0
    items, sp, thought = _Items(), _splitter(job), []

    def event(e):
        nonlocal seq
        e = dict(e, sequence_number=seq)
        seq += 1
        return f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"

    head = _envelope(state, req, rid, created, "in_progress", [])
    yield event({"type": "response.created", "response": head})
    yield event({"type": "response.in_progress", "response": head})
    try:
        async for out in gen:
            evs = sp.feed(out.text) + (sp.flush() if out.finish_reason else [])
            thought += [e[1] for e in evs if e[0] == "reasoning"]
            for e in items.feed(evs):
                yield event(e)
        if gen.finish_reason is None:
            for e in items.feed(sp.flush()):
                yield event(e)
        for e in items.close_all():
            yield event(e)
        status, incomplete = _status(gen)
        final = _envelope(state, req, rid, created, status, items.items,
                          _usage(gen, _reasoning_tokens(model, "".join(thought))), incomplete)
        yield event({"type": "response.completed" if status == "completed" else
                     "response.incomplete", "response": final})
    except Exception as e:  # noqa: BLE001 -- reported in the stream
        yield event({"type": "error", "code": "server_error", "message":
                     f"generation failed: {e}", "param": None})
