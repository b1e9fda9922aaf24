"""The model manager against a real `mlxr serve --no-preload` process: copies of the bundled
model in a temporary Hugging Face cache, loaded on demand by name (the official openai client
and Ollama-shaped HTTP calls), unloaded after keep_alive, evicted least recently used under a
memory budget that fits two of them, waited on by concurrent requests while loading; a broken
model answers its requests with the load error and leaves the others serving. `mlxr ps` and
`mlxr stop` talk to the same server."""

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from test_server_helpers import BUNDLED, Server

from mlxr.server.models_manager import parse_keep_alive, parse_size

A, B, C = "mlxr-test/story-a", "mlxr-test/story-b", "mlxr-test/story-c"
BROKEN = "mlxr-test/broken"
MSGS = [{"role": "user", "content": "Once upon a time"}]
# one copy: ~1.04 MB of float32 weights + a 1.3 MB KV pool (2 sequences x 512 tokens x 5
# layers x 2 x 32 x 4 bytes): two fit in 5 MiB, three do not
BUDGET = "5MB"


def hub_env(hf_home: Path) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in (
        "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
        "XDG_CACHE_HOME")}
    return dict(e, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")


def cache_model(env: dict, repo_id: str, src: Path) -> Path:
    """`src` as the pulled snapshot of `repo_id` (refs/main -> one snapshot directory)."""
    root = Path(env["HF_HOME"]) / "hub" / ("models--" + repo_id.replace("/", "--"))
    sha = "0" * 40
    shutil.copytree(src, root / "snapshots" / sha)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    return root / "snapshots" / sha


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = hub_env(tmp_path_factory.mktemp("hf"))
    for name in (A, B, C):
        cache_model(env, name, BUNDLED)
    broken = cache_model(env, BROKEN, BUNDLED)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": -4}))
    s = Server(None, "--no-preload", "--keep-alive", "60s", "--memory-budget", BUDGET,
               "--max-num-seqs", "2", env=env)
    s.env = env
    yield s
    s.stop()


def ps(server) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(server.url + "/api/ps").json()["models"]}


def chat(server, model: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4)
    assert r.choices[0].message.content
    return r.model


def ollama(server, model: str, **kw) -> httpx.Response:
    body = dict(model=model, prompt="Once upon a time", stream=False,
                options={"num_predict": 3}, **kw)
    return httpx.post(server.url + "/api/generate", json=body, timeout=120)


def mlxr_cli(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxr", *args, "--host", server.url],
                          capture_output=True, text=True, timeout=60, env=server.env)


def unload_all(server):
    for name in ps(server):  # Ollama's unload: no prompt, keep_alive 0
        r = httpx.post(server.url + "/api/generate", json={"model": name, "keep_alive": 0})
        assert r.json()["done_reason"] == "unload"
    assert ps(server) == {}


def test_parsers():
    assert parse_size("5MB") == 5 << 20 and parse_size("1024") == 1024
    assert parse_keep_alive("5m") == 300 and parse_keep_alive(-1) is None
    assert parse_keep_alive("0") == 0 and parse_keep_alive("1.5s") == 1.5
    with pytest.raises(ValueError):
        parse_keep_alive("soon")


def test_starts_empty_and_loads_two_by_name(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert ps(server) == {}
    assert chat(server, A) == A
    r = ollama(server, B)
    assert r.status_code == 200 and r.json()["model"] == B and r.json()["eval_count"] == 3
    loaded = ps(server)
    assert set(loaded) == {A, B}
    for m in loaded.values():
        assert m["device"] == "cpu" and m["size_vram"] == 0
        assert m["weights_bytes"] > 1_000_000 and m["kv_cache_bytes"] == 2 * 512 * 5 * 2 * 32 * 4
        assert m["size"] == m["weights_bytes"] + m["kv_cache_bytes"]
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert set(ids) == {A, B}
    tags = [m["name"] for m in httpx.get(server.url + "/api/tags").json()["models"]]
    assert {A, B, C, "stories260K"} <= set(tags) and BROKEN not in tags
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "nope/nope",
                                                              "messages": MSGS})
    assert r.status_code == 404 and "nope/nope" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 400 and "model is required" in r.json()["error"]["message"]


def test_lru_eviction_under_the_budget(server):
    unload_all(server)
    chat(server, A)
    chat(server, B)
    chat(server, A)  # A is now the most recently used: B goes first
    chat(server, C)
    assert set(ps(server)) == {A, C}
    assert sum(m["size"] for m in ps(server).values()) <= parse_size(BUDGET)
    chat(server, B)  # A was used before C: A goes
    assert set(ps(server)) == {B, C}


def test_keep_alive_unloads_idle_models(server):
    unload_all(server)
    r = ollama(server, A, keep_alive="1s")
    assert r.status_code == 200
    assert ollama(server, B).status_code == 200  # the server's 60 s
    until = ps(server)
    assert set(until) == {A, B}
    t0 = time.monotonic()
    while A in ps(server):
        assert time.monotonic() - t0 < 10, "A was not unloaded after its keep_alive"
        time.sleep(0.1)
    assert set(ps(server)) == {B}
    # keep_alive 0 with a prompt: answered, then unloaded
    assert ollama(server, B, keep_alive=0).status_code == 200
    t0 = time.monotonic()
    while B in ps(server):
        assert time.monotonic() - t0 < 5
        time.sleep(0.1)


def test_cli_ps_and_stop(server):
    unload_all(server)
    t0 = time.monotonic()
    chat(server, C)
    load = time.monotonic() - t0
    r = mlxr_cli(server, "ps")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAME", "SIZE"] and lines[1].startswith(C)
    assert "cpu" in lines[1] and "from now" in lines[1]
    r = mlxr_cli(server, "stop", C)
    assert r.returncode == 0 and r.stdout.startswith(f"stopped {C}"), r.stderr
    assert ps(server) == {}
    print(f"\nload (first request, {C}): {load:.2f} s; {r.stdout.strip()}")
    r = mlxr_cli(server, "stop", C)
    assert r.returncode == 1 and "not loaded" in r.stderr and "Traceback" not in r.stderr


def test_concurrent_requests_wait_for_one_load(server):
    unload_all(server)
    with ThreadPoolExecutor(6) as pool:
        models = list(pool.map(lambda _: chat(server, B), range(6)))
    assert models == [B] * 6
    assert list(ps(server)) == [B]


def test_broken_model_fails_its_requests_only(server):
    unload_all(server)
    chat(server, A)
    with ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda _: httpx.post(
            server.url + "/v1/chat/completions", json={"model": BROKEN, "messages": MSGS},
            timeout=60), range(3)))
    for r in rs:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "hidden_size" in err["message"]
    r = ollama(server, BROKEN)
    assert r.status_code == 500 and "hidden_size" in r.json()["error"]
    assert chat(server, A) == A and set(ps(server)) == {A}
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
