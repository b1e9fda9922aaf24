"""Hostile requests (issue 34) against a real `mlxr serve` of the bundled model with a tool-aware
chat template: every client mistake is a 4xx naming the field, never a 500, and a bad request
never fails or stalls another one."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from test_server_helpers import BUNDLED, Server, model_with_template

import mlxr
from mlxr.engine.engine import EngineRequest, LLMEngine
from mlxr.text.sampling import SamplingParams
from mlxr.server import request_checks
from mlxr.server.protocol import APIError

TOOL_TEMPLATE = (
    "{% if tools %}{{ tools|tojson }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<call>{{ c['function']|tojson }}</call>"
    "{% endfor %}\n{% endfor %}<assistant>"
)
MSG = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = model_with_template(tmp_path_factory.mktemp("hostile"), "m", TOOL_TEMPLATE)
    s = Server(model, "--max-num-seqs", "4")
    yield s
    s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def chat(**extra):
    return {"messages": MSG, "max_tokens": 2, **extra}


def assert_400(r, needle=""):
    assert r.status_code == 400, (r.status_code, r.text)
    assert needle in r.text, r.text


# -- sampling values and the engine ------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("temperature", 1e-300), ("repetition_penalty", 1e-300),
                                         ("presence_penalty", 1e300)])
def test_sampling_values_the_engine_cannot_compute(server, field, value):
    assert_400(post(server, "/v1/completions",
                    {"prompt": "Once", "max_tokens": 2, field: value}), field)


def test_one_sequence_failing_does_not_fail_the_batch():
    model = mlxr.load(BUNDLED, device="cpu", dtype="float32")
    engine = LLMEngine(model, max_num_seqs=4, num_blocks=64)
    outs: dict[str, list] = {"good": [], "bad": []}

    def boom(ids, logits):
        raise RuntimeError("processor exploded")

    params = SamplingParams(max_tokens=4, temperature=0.0)
    ids = model.tokenizer.encode("Once upon a time")
    engine.add(EngineRequest(ids, params), outs["good"].append)
    engine.add(EngineRequest(ids, params, logits_processor=boom), outs["bad"].append)
    for _ in range(50):
        if not engine.has_work():
            break
        engine.step()
    assert isinstance(outs["bad"][-1], ValueError) and "processor exploded" in str(outs["bad"][-1])
    assert outs["good"][-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs["good"]) == 4


# -- templates from clients ---------------------------------------------------------------------

def test_client_template_source_refused(server):
    r = post(server, "/v1/chat/completions",
             chat(chat_template_kwargs={"chat_template": "{{ 'x' * 10 }}"}))
    assert_400(r, "--allow-client-chat-template")


@pytest.mark.parametrize("key", ["tokenize", "messages", "tools", "add_generation_prompt",
                                 "documents", "_private"])
def test_reserved_template_kwargs_refused(server, key):
    assert_400(post(server, "/v1/chat/completions", chat(chat_template_kwargs={key: 1})), key)


def test_operator_can_allow_client_templates():
    request_checks.allow_client_templates(True)
    try:
        assert request_checks.template_kwargs({"chat_template": "x"}) == {"chat_template": "x"}
        with pytest.raises(APIError):
            request_checks.template_kwargs({"tokenize": True})
    finally:
        request_checks.allow_client_templates(False)
    with pytest.raises(APIError):
        request_checks.template_kwargs({"chat_template": "x"})


# -- body shapes -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/api/chat", "/api/generate"])
def test_deeply_nested_body(server, path):
    raw = b'{"model": "m", "x": ' + b"[" * 1500 + b"1" + b"]" * 1500 + b"}"
    r = httpx.post(server.url + path, content=raw, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert_400(r, "nested")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/completions", {"prompt": "\udfff"}),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/api/generate", {"model": "m", "prompt": "x\ud800"}),
])
def test_lone_surrogate(server, path, body):
    raw = json.dumps(body).encode()  # json.dumps escapes the surrogate as \\udxxx
    r = httpx.post(server.url + path, content=raw, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert_400(r, "surrogate")


RESPONSES_SHAPES = {
    "tool without function": {"input": "hi", "tools": [{"type": "function"}]},
    "text.format a string": {"input": "hi", "text": {"format": "json"}},
    "content an int": {"input": [{"role": "user", "content": 5}]},
    "input item a string": {"input": ["hi"]},
}


@pytest.mark.parametrize("case", list(RESPONSES_SHAPES))
def test_responses_shapes(server, case):
    assert_400(post(server, "/v1/responses", {**RESPONSES_SHAPES[case], "max_output_tokens": 2}))


TOOL_CALLS = {
    "a string": "call it",
    "ints": [1, 2],
    "function a string": [{"type": "function", "function": "f"}],
    "name an int": [{"type": "function", "function": {"name": 3, "arguments": "{}"}}],
}


@pytest.mark.parametrize("case", list(TOOL_CALLS))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_tool_call_shapes(server, path, case):
    msgs = [MSG[0], {"role": "assistant", "content": "", "tool_calls": TOOL_CALLS[case]},
            {"role": "user", "content": "go on"}]
    r = post(server, path, {"model": "m", "messages": msgs, "max_tokens": 2, "stream": False})
    assert r.status_code == 400, (r.status_code, r.text)


def test_deeply_nested_tool_arguments_string(server):
    args = "[" * 5000 + "]" * 5000
    msgs = [MSG[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": args}}]}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code in (200, 400), (r.status_code, r.text)


def test_tool_parameters_300_deep(server):
    params: dict = {"type": "object"}
    for _ in range(300):
        params = {"type": "object", "properties": {"a": params}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    assert_400(post(server, "/v1/chat/completions", chat(tools=tools)), "nested")


def test_tool_choice_function_a_string(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = post(server, "/v1/chat/completions",
             chat(tools=tools, tool_choice={"type": "function", "function": "f"}))
    assert_400(r, "tool_choice")


# -- the event loop and the connection ---------------------------------------------------------

def test_big_prompt_does_not_block_health(server):
    prompt = "Once upon a time there was a cat. " * 115_000  # ~3.9 MB
    result = {}

    def big():
        result["r"] = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    while t.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    t.join()
    assert result["r"].status_code == 400  # longer than the context
    assert worst < 1.0, f"/health took {worst:.2f} s while a big prompt was tokenized"


def _raw(server, head: bytes, body: bytes, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + body)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if half_close is False and b"\r\n\r\n" in data and data.count(b"}") >= 2:
                break
        return data


def test_413_reaches_the_client(server):
    body = b'{"prompt": "' + b"a" * (6 << 20) + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    reply = _raw(server, head, body)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_half_closed_client_gets_its_reply(server):
    body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    reply = _raw(server, head, body, half_close=True)
    while reply.startswith(b"HTTP/1.1 1"):  # interim probes (see security.eof_received)
        reply = reply.split(b"\r\n\r\n", 1)[1]
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b'"text_completion"' in reply
