"""Ollama's model-management routes against a real `mlxr serve` of a pulled Hub model, with the
fake Hub (tests/fake_hub.py) behind HF_ENDPOINT and a temporary HF_HOME: /api/tags, /api/show and
/api/ps in Ollama's shapes, /api/pull's NDJSON progress, /api/delete. (Both are off by default:
test_server_bundled.py.) Bodies are sent as `curl -d` sends them, without a JSON Content-Type."""

import json
import os
import subprocess
import sys

import httpx
import pytest
from fake_hub import FakeHub
from safetensors.numpy import load_file
from test_server_helpers import BUNDLED, Server

from mlxr.server.ollama_models import parameter_count

SERVED = "mlxr-test/stories260K"
OTHER = "mlxr-test/stories-copy"
FORM = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends


@pytest.fixture(scope="module")
def hub():
    h = FakeHub().start()
    h.add_dir(SERVED, BUNDLED)
    h.add_dir(OTHER, BUNDLED)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def env(hub, tmp_path_factory) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in (
        "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME")}
    return dict(e, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path_factory.mktemp("hf")),
                HF_HUB_DISABLE_PROGRESS_BARS="1")


@pytest.fixture(scope="module")
def server(env):
    r = subprocess.run([sys.executable, "-m", "mlxr", "pull", SERVED], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s = Server(SERVED, "--allow-pull", "--allow-delete", env=env)
    yield s
    s.stop()


def api(server, method: str, path: str, body: dict) -> httpx.Response:
    return httpx.request(method, server.url + path, content=json.dumps(body).encode(),
                         headers=FORM, timeout=60)


def repo_root(env, repo_id: str):
    from pathlib import Path

    return Path(env["HF_HOME"]) / "hub" / ("models--" + repo_id.replace("/", "--"))


def numel(path) -> int:
    total = 0
    for t in load_file(path / "model.safetensors").values():
        total += t.size
    return total


def test_parameter_count_reads_through_quantization():
    """The 8-bit copy (packed U32 weights + scales/biases) has the float model's parameters."""
    n = numel(BUNDLED)
    assert parameter_count(BUNDLED) == n
    assert parameter_count(BUNDLED.parent / "stories260K-8bit") == n


def test_tags_show_ps(server):
    weights = (BUNDLED / "model.safetensors").stat().st_size
    tag = httpx.get(server.url + "/api/tags").json()["models"][0]
    assert tag["name"] == tag["model"] == SERVED and tag["size"] == weights
    assert len(tag["digest"]) == 64 and tag["details"]["family"] == "llama"
    assert tag["details"]["parameter_size"] == "260.0K"
    for body in ({"model": SERVED + ":latest"}, {"name": SERVED}):  # "name": older clients
        r = api(server, "POST", "/api/show", body)
        assert r.status_code == 200, r.text
        show = r.json()
        assert show["details"] == tag["details"] and show["capabilities"] == ["completion"]
        assert "bos_token" in show["template"] and show["license"].startswith("MIT License")
        info = show["model_info"]
        assert info["general.architecture"] == "llama"
        assert info["general.parameter_count"] == numel(BUNDLED)
        assert info["llama.context_length"] == 512 and info["llama.block_count"] == 5
    r = api(server, "POST", "/api/show", {"model": "llama3"})
    assert r.status_code == 404 and "llama3" in r.json()["error"]
    ps = httpx.get(server.url + "/api/ps").json()["models"]
    assert [m["name"] for m in ps] == [SERVED]
    assert ps[0]["context_length"] == 512 and ps[0]["digest"] == tag["digest"]
    # measured: the float32 tensors (the file less its header) and the KV pool
    assert 0 < weights - ps[0]["weights_bytes"] < 8192 and ps[0]["kv_cache_bytes"] > 0
    assert ps[0]["size"] == ps[0]["weights_bytes"] + ps[0]["kv_cache_bytes"]
    assert ps[0]["expires_at"].endswith("Z")


def ndjson(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(x) for x in r.text.splitlines()]


def test_pull_streams_progress(server, hub, env):
    lines = ndjson(api(server, "POST", "/api/pull", {"model": OTHER}))
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    assert all(set(x) == {"status"} or set(x) == {"status", "digest", "total", "completed"}
               for x in lines)
    repo = hub.repos[OTHER]
    weights = [x for x in lines if x.get("digest") == "sha256:" + repo.etag("model.safetensors")]
    size = len(repo.files["model.safetensors"])
    assert weights and all(x["total"] == size for x in weights)
    done = [x["completed"] for x in weights]
    assert done == sorted(done) and done[-1] == size
    assert {x["status"] for x in lines if "digest" in x} == {
        f"pulling {f}" for f in repo.files}
    snap = repo_root(env, OTHER) / "snapshots" / repo.sha
    assert (snap / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
    # again, whole: already there
    r = api(server, "POST", "/api/pull", {"model": OTHER, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}
    # errors: a line of the stream, or the whole answer
    lines = ndjson(api(server, "POST", "/api/pull", {"model": "mlxr-test/nope"}))
    assert "no such model" in lines[-1]["error"]  # the Hub answers 401 for unknown repos
    r = api(server, "POST", "/api/pull", {"model": "mlxr-test/nope", "stream": False})
    assert r.status_code == 500 and "no such model" in r.json()["error"]
    r = api(server, "POST", "/api/pull", {"model": "llama3"})
    assert r.status_code == 400 and "ORG/REPO" in r.json()["error"]


def test_delete(server, env):
    r = api(server, "POST", "/api/pull", {"model": OTHER, "stream": False})
    assert r.json() == {"status": "success"}
    r = api(server, "DELETE", "/api/delete", {"model": OTHER})
    assert r.status_code == 200 and not repo_root(env, OTHER).exists()
    r = api(server, "DELETE", "/api/delete", {"model": OTHER})
    assert r.status_code == 404 and OTHER in r.json()["error"]
    r = api(server, "DELETE", "/api/delete", {"model": SERVED})  # what this server is serving
    assert r.status_code == 409 and "serving" in r.json()["error"]
    assert repo_root(env, SERVED).is_dir()
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
