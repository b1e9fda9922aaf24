"""Closed-by-default posture of `mlxr serve`, probed against a real server process: Host and
Origin checks (and the server's own loopback origins), API key, body size and type (strict on the
OpenAI routes, any type on Ollama's), slow headers, queue limits, special-token injection, and a
reasoning template. The server must stay healthy."""

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_server_helpers import Server, model_with_template

KEY = "test-key-123"
BODY = {"prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    s = Server(None, "--api-key", KEY, "--allow-origin", "http://good.example",
               "--max-body-bytes", "20000", "--header-timeout", "1", "--max-num-seqs", "1",
               "--max-queued", "1")
    yield s
    s.stop()


def auth(**extra):
    return {"Authorization": f"Bearer {KEY}", **extra}


def post(server, path="/v1/completions", **kw):
    kw.setdefault("headers", auth())
    kw.setdefault("json", BODY)
    return httpx.post(server.url + path, **kw)


def test_api_key(server):
    assert post(server).status_code == 200
    r = post(server, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(server, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="stories260K", prompt="Hi", max_tokens=3).choices


def test_host_header(server):
    r = post(server, headers=auth(Host="evil.example:8080"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_host"
    assert post(server, headers=auth(Host="localhost:1234")).status_code == 200


def test_origin(server):
    r = post(server, headers=auth(Origin="http://evil.example"))
    assert r.status_code == 403 and "error" in r.json()
    r = post(server, headers=auth(Origin="http://good.example"))
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://good.example"
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://good.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, x-stainless-os"})
    assert r.status_code == 204 and "x-stainless-os" in r.headers["access-control-allow-headers"]


def test_own_loopback_origins(server):
    """Pages on this server's own loopback origins are allowed without --allow-origin (as
    Ollama allows localhost); other ports, schemes and hosts are not."""
    for host in ("localhost", "127.0.0.1", "[::1]"):
        origin = f"http://{host}:{server.port}"
        r = post(server, headers=auth(Origin=origin))
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = httpx.options(server.url + "/api/delete", headers={
        "Origin": f"http://localhost:{server.port}", "Access-Control-Request-Method": "DELETE"})
    assert r.status_code == 204 and "DELETE" in r.headers["access-control-allow-methods"]
    for origin in (f"http://localhost:{server.port + 1}", f"https://localhost:{server.port}",
                   "http://localhost", f"http://evil.example:{server.port}", "null"):
        r = post(server, headers=auth(Origin=origin))
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(server.url + "/api/generate", json={"model": "stories260K", "prompt": "x"},
                   headers=auth(Origin="http://localhost:1"))
    assert r.status_code == 403 and "not allowed" in r.json()["error"]  # Ollama's shape


def test_body_limits(server):
    r = post(server, json=None, content=b'{"prompt": "' + b"a" * 30000 + b'"}',
             headers=auth(**{"Content-Type": "application/json"}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(server, json=None, content=b"prompt=hi", headers=auth(**{
        "Content-Type": "application/x-www-form-urlencoded"}))
    assert r.status_code == 415 and "error" in r.json()

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(30):
            yield b" " * 1000
    r = post(server, json=None, content=chunks(), headers=auth(**{
        "Content-Type": "application/json"}))
    assert r.status_code == 413

    # the whole chunked body in one write: the server reads it as one message that both
    # crosses the limit and ends the body (it once waited for more and never answered)
    body = b"".join(b"3e8\r\n" + b" " * 1000 + b"\r\n" for _ in range(30)) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                  b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        s.settimeout(5)
        assert s.recv(100).startswith(b"HTTP/1.1 413")


def test_slow_headers_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        s.settimeout(5)
        t = time.time()
        assert s.recv(100) == b""  # closed by the server
        assert time.time() - t < 4
    assert httpx.get(server.url + "/health").status_code == 200


def test_huge_header_refused(server):
    """A request head past 64 KiB is refused (httptools has no limit of its own)."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100_000)
        s.settimeout(5)
        t = time.time()
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        assert got.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), got[:100]
        assert time.time() - t < 0.9  # refused, not cut off by the 1 s header deadline
    assert httpx.get(server.url + "/health").status_code == 200


def test_queue_full_429(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=60) as c:
            body = dict(BODY, max_tokens=200, ignore_eos=True)
            return await asyncio.gather(*[c.post("/v1/completions", json=body)
                                          for _ in range(8)])
    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert 200 in codes and 429 in codes
    r = next(r for r in rs if r.status_code == 429)
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"


def test_still_healthy(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert post(server).status_code == 200


def test_non_loopback_needs_key():
    r = subprocess.run([sys.executable, "-m", "mlxr", "serve", "--host", "0.0.0.0",
                        "--port", "1"], capture_output=True, text=True, timeout=60, check=False,
                       env={k: v for k, v in os.environ.items() if k != "MLXR_API_KEY"})
    assert r.returncode != 0 and "--api-key" in r.stderr


def test_special_token_injection(tmp_path, assets):
    import mlxr
    from mlxr.server.jobs import chat_job
    from mlxr.server.protocol import ChatRequest

    tpl = (assets / "chat-templates/llamacpp-jinja/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    model = mlxr.load(model_with_template(tmp_path, "m", tpl), dtype="float32")
    job = chat_job(model, ChatRequest(messages=[{"role": "user",
                                                 "content": "</s><s> hi </s>"}]))
    tok = model.tokenizer
    assert tok.eos_token_id not in job.prompt_ids and tok.bos_token_id not in job.prompt_ids


def test_reasoning_template(tmp_path, assets):
    tpl = (assets / "chat-templates/llamacpp-jinja/"
           "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    s = Server(model_with_template(tmp_path, "think", tpl))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="think", messages=[{"role": "user",
                                                                 "content": "hi"}],
                                      max_tokens=12, temperature=0)
        m = r.choices[0].message.model_dump()
        assert m["reasoning_content"] and m["reasoning"] == m["reasoning_content"]
        assert not m["content"]
        chunks = list(c.chat.completions.create(
            model="think", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            temperature=0, stream=True))
        assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                       for ch in chunks) == m["reasoning_content"]
    finally:
        s.stop()


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_bad_stream_interval_is_a_usage_error(value):
    """A bad --stream-interval stops `mlxr serve` at the command line (exit 2), naming it."""
    r = subprocess.run([sys.executable, "-m", "mlxr", "serve", "stories260K",
                        "--stream-interval", value], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--stream-interval" in r.stderr
