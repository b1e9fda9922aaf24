"""Ollama's /api/generate and /api/chat end to end (NDJSON streaming and whole, options, errors)
against real server processes: the bundled story model with a Qwen2.5 chat template, and a copy of
it without a chat template (a plain base model). Ollama's request leniency (any Content-Type) and
error shape on /api/*. (The model-management routes: test_server_ollama_models.py.)"""

import json

import httpx
import pytest
from test_server_helpers import Server, model_with_template, model_without_template

MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, assets):
    tpl = (assets / "chat-templates/llamacpp-jinja/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    s = Server(model_with_template(tmp_path_factory.mktemp("m"), "story-chat", tpl))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    s = Server(model_without_template(tmp_path_factory.mktemp("m"), "base"))
    yield s
    s.stop()


def post(server, path, body, **options):
    body = dict({"model": "story-chat"}, **body)
    if options:
        body["options"] = dict(body.get("options", {}), **options)
    return httpx.post(server.url + path, json=body, timeout=60)


def lines(r) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]


def check_final(d, eval_count=None, reason=None):
    assert d["done"] is True and d["model"] == "story-chat" and d["created_at"].endswith("Z")
    assert d["done_reason"] in ("stop", "length") and d["prompt_eval_count"] > 0
    for k in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(d[k], int) and d[k] >= 0
    assert d["total_duration"] >= d["eval_duration"]
    if eval_count is not None:
        assert d["eval_count"] == eval_count
    if reason is not None:
        assert d["done_reason"] == reason


def test_generate_stream_and_whole(server):
    body = {"prompt": "Once upon a time"}
    ls = lines(post(server, "/api/generate", body, num_predict=12, temperature=0))
    assert all(x["done"] is False and "response" in x for x in ls[:-1]) and len(ls) > 2
    check_final(ls[-1], eval_count=12, reason="length")
    assert ls[-1]["response"] == ""
    whole = post(server, "/api/generate", dict(body, stream=False), num_predict=12,
                 temperature=0).json()
    check_final(whole, eval_count=12, reason="length")
    assert whole["response"] == "".join(x["response"] for x in ls) and whole["response"]
    # raw: the prompt as is, no template (fewer prompt tokens), still a story continuation
    raw = post(server, "/api/generate", dict(body, stream=False, raw=True), num_predict=4).json()
    check_final(raw, eval_count=4)
    assert raw["prompt_eval_count"] < whole["prompt_eval_count"]
    sys_ = post(server, "/api/generate", dict(body, stream=False, system="Be brief."),
                num_predict=4).json()
    oa = httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 4, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Once upon a time"}]}, timeout=60).json()
    assert sys_["prompt_eval_count"] == oa["usage"]["prompt_tokens"] != whole["prompt_eval_count"]


def test_chat_stream_and_whole(server):
    ls = lines(post(server, "/api/chat", {"messages": MSGS}, num_predict=12, temperature=0))
    for x in ls[:-1]:
        assert x["done"] is False and x["message"]["role"] == "assistant"
    check_final(ls[-1], eval_count=12, reason="length")
    assert ls[-1]["message"] == {"role": "assistant", "content": ""}
    whole = post(server, "/api/chat", {"messages": MSGS, "stream": False}, num_predict=12,
                 temperature=0).json()
    check_final(whole, eval_count=12, reason="length")
    assert whole["message"]["content"] == "".join(x["message"]["content"] for x in ls)
    # the same prompt and sampling as the OpenAI route
    oa = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 12, "temperature": 0}, timeout=60).json()
    assert oa["choices"][0]["message"]["content"] == whole["message"]["content"]
    assert oa["usage"]["prompt_tokens"] == whole["prompt_eval_count"]


def test_options(server):
    def chat(**opts):
        r = post(server, "/api/chat", {"messages": MSGS, "stream": False}, **opts)
        assert r.status_code == 200, r.text
        return r.json()
    short = chat(num_predict=3, temperature=0)
    assert short["eval_count"] == 3 and short["done_reason"] == "length"
    text = chat(num_predict=32, temperature=0)["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    r = chat(num_predict=32, temperature=0, stop=[stop])
    assert r["done_reason"] == "stop" and r["message"]["content"] == text[:text.index(stop)]
    a, b, c = (chat(num_predict=24, temperature=1.0, seed=s)["message"]["content"]
               for s in (7, 7, 8))
    assert a == b and a != c
    # load-time options are accepted (no effect); unsupported or invalid ones are 400s
    assert chat(num_predict=2, num_ctx=4096, num_gpu=1, repeat_penalty=1.1, repeat_last_n=32,
                top_k=20, top_p=0.9, min_p=0.05)["eval_count"] == 2
    for bad in ({"mirostat": 2}, {"temperature": 9}, {"num_predict": 0}, {"frobnicate": 1}):
        r = post(server, "/api/chat", {"messages": MSGS, "stream": False}, **bad)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text


def test_format_logprobs_and_tool_history(server):
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}},
              "required": ["age"], "additionalProperties": False}
    r = post(server, "/api/chat", {"messages": MSGS, "stream": False, "format": schema},
             num_predict=40).json()
    assert 0 <= json.loads(r["message"]["content"])["age"] <= 120
    r = post(server, "/api/generate", {"prompt": "Hi", "stream": False, "logprobs": True,
                                       "top_logprobs": 2}, num_predict=4, temperature=0).json()
    assert len(r["logprobs"]) == 4 and all(len(t["top_logprobs"]) == 2 for t in r["logprobs"])
    assert "".join(t["token"] for t in r["logprobs"]) == r["response"]
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    msgs = MSGS + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    r = post(server, "/api/chat", {"messages": msgs, "tools": [tool], "stream": False},
             num_predict=4)
    assert r.status_code == 200 and r.json()["eval_count"] == 4, r.text


def test_errors(server):
    r = httpx.post(server.url + "/api/chat", json={"model": "gpt-4o", "messages": MSGS})
    assert r.status_code == 404 and "gpt-4o" in r.json()["error"]
    r = httpx.post(server.url + "/api/generate", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    for path in ("/api/chat", "/api/generate"):
        r = httpx.post(server.url + path, content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]
    assert post(server, "/api/generate", {"model": "", "prompt": "x"}).json() == {
        "error": "model is required"}
    r = post(server, "/api/generate", {"prompt": "x", "images": ["aGk="]})
    assert r.status_code == 400 and "images" in r.json()["error"]
    r = post(server, "/api/chat", {"messages": MSGS, "frobnicate": True})
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]
    # an empty prompt / no messages loads the model (Ollama's preload); ':latest' is the model
    r = post(server, "/api/generate", {"model": "story-chat:latest"}).json()
    assert r["done"] is True and r["done_reason"] == "load" and r["response"] == ""
    assert post(server, "/api/chat", {"messages": []}).json()["done_reason"] == "load"
    assert httpx.get(server.url + "/api/tags").json()["models"][0]["name"] == "story-chat"


def test_no_chat_template(bare):
    """A base model without a chat template (not the bundled one, which has its own): chat is a
    400 saying so, /api/generate continues the prompt as plain text."""
    r = httpx.post(bare.url + "/api/chat", json={"model": "base", "messages": MSGS})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]
    r = httpx.post(bare.url + "/api/generate", json={
        "model": "base", "prompt": "Once upon a time", "stream": False,
        "options": {"num_predict": 6}}, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 6 and r.json()["response"]
    r = httpx.post(bare.url + "/api/generate", json={
        "model": "base", "prompt": "Once", "system": "Be brief."})
    assert r.status_code == 400 and "system" in r.json()["error"]
    assert httpx.get(bare.url + "/health").json()["status"] == "ok"


def test_curl_style_bodies_and_ollama_error_shape(server):
    """`curl -d` sends application/x-www-form-urlencoded: Ollama's routes take the JSON anyway
    (and no Content-Type at all); the OpenAI routes stay JSON-only. Every error under /api/,
    404s and 405s included, is Ollama's {"error": "..."}."""
    body = json.dumps({"model": "story-chat", "prompt": "Once", "stream": False,
                       "options": {"num_predict": 3}}).encode()
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        r = httpx.post(server.url + "/api/generate", content=body, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["eval_count"] == 3, r.text
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(server.url + "/api/chat", content=b"model=story-chat",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = httpx.get(server.url + "/api/nope")
    assert r.status_code == 404 and r.json() == {"error": "Invalid URL (GET /api/nope)"}
    r = httpx.get(server.url + "/api/chat")
    assert r.status_code == 405 and isinstance(r.json()["error"], str)
    r = httpx.get(server.url + "/v1/nope")  # the OpenAI envelope elsewhere
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(server.url + "/api/chat", json={"model": "story-chat", "messages": MSGS},
                   headers={"Host": "evil.example"})  # refused by the middleware
    assert r.status_code == 403 and isinstance(r.json()["error"], str)
