"""Embeddings through the serving engine (embedding_seqs.py): each text a prefill-only sequence
in the engine's steps, beside generations. The vectors must equal `mlxr.embed.embed_ids` (one
forward pass per batch over a scratch pool) whatever the chunking, pooling, preemption or
company; greedy generation beside them must stay what it is alone. Then a real server process
with the engine in its own process: concurrent requests equal one-by-one, an embeddings
request beside a streaming chat, the 400s.

Tolerance: both sides run the same float32 kernels; they differ only in how attention and the
mean are split (chunks, the rows batched together), i.e. float32 rounding of sums over <= 256
positions: |error| ~ 256 * 2^-24 ~ 2e-5 relative on a single sum, far less on a normalised
vector's components (|x| <= 1, observed <= 1e-6). atol 1e-5 allows that and nothing more."""

import asyncio
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from test_embeddings import embed_dir, reference  # noqa: F401 -- a fixture
from test_server_helpers import Server

import mlxr
from mlxr.embed import embed_ids
from mlxr.engine import AsyncEngine, LLMEngine
from mlxr.errors import MlxrError

TEXTS = ["a tiny decoder says hello", "the quick brown fox says hello to the fox",
         "1 2 3 4 5 6 7 8 9 10 hello fox 1 2 3 4 5 6 7 8 9 10", "hello"]
NAME = "mlxr-test/tiny-qwen3-embedding"


@pytest.fixture(scope="module")
def model(embed_dir):  # noqa: F811
    return mlxr.load(embed_dir, device="cpu", dtype="float32")


def token_lists(model, texts):
    return [model.tokenizer.encode(t) for t in texts]


async def _requests(eng: AsyncEngine, batches, pooling, gen_ids):
    """Embeddings requests and one greedy generation, concurrently."""
    from mlxr.engine import EngineRequest
    from mlxr.text.sampling import SamplingParams

    async def generate():
        req = EngineRequest(gen_ids, SamplingParams(max_tokens=40, temperature=0,
                                                    ignore_eos=True))
        return [t async for o in eng.generate(req) for t in o.token_ids]
    return await asyncio.gather(generate(), *(eng.embed(b, pooling) for b in batches))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("budget,num_blocks", [(256, None), (5, None), (5, 3)])
def test_engine_equals_embed_ids(model, pooling, budget, num_blocks):
    """Three requests and a generation share steps (budget 5: every text in chunks; 3 blocks of
    16: preemptions); vectors equal embed_ids', generation equals its run alone."""
    seqs = token_lists(model, TEXTS)
    batches = [seqs, seqs[::-1][:3], seqs[1:2] * 3]
    gen_ids = seqs[3]
    alone = list(model.generate(gen_ids, max_tokens=40, temperature=0, ignore_eos=True))
    eng = AsyncEngine(model, max_num_seqs=2, max_num_batched_tokens=budget,
                      num_blocks=num_blocks)
    try:
        gen, *outs = asyncio.run(_requests(eng, batches, pooling, gen_ids))
    finally:
        eng.close()
    assert gen == alone
    for b, (e, n) in zip(batches, outs):
        assert e.dtype == torch.float32 and e.shape == (len(b), 64)
        assert n == sum(map(len, b))
        assert (e - embed_ids(model, b, pooling)).abs().max() <= 1e-5
    stats = eng.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    if num_blocks:
        assert stats["preemptions"] > 0


def test_engine_matches_transformers_and_reuses_prefixes(model, embed_dir):  # noqa: F811
    """Last-token pooling may start from cached prefix blocks (a shared instruction): the
    second request hits the cache and still matches transformers."""
    task = "1 2 3 4 5 6 7 8 9 10 " * 2  # > one 16-token block
    texts = [f"Instruct: {task}\nQuery:the quick brown fox {i}" for i in range(3)]
    eng = AsyncEngine(model, max_num_batched_tokens=64)
    try:
        first, _ = asyncio.run(eng.embed(token_lists(model, texts)))
        second, _ = asyncio.run(eng.embed(token_lists(model, texts[::-1])))
    finally:
        eng.close()
    assert eng.engine.stats()["prefix_cache_hits"] > 0
    assert (first * reference(embed_dir, texts)).sum(-1).min() >= 0.9999
    assert (second.flip(0) - first).abs().max() <= 1e-5


def test_engine_refusals_and_cancel(model):
    eng = LLMEngine(model, max_num_batched_tokens=4, num_blocks=4)  # the pool holds 64 tokens
    ctx = model.config.context_length
    for seqs, msg in (([], "input must not be empty"), ([[5], []], "input[1] is empty"),
                      ([[5], [5] * (ctx + 1)], f"input[1] has {ctx + 1} tokens; the model's "),
                      ([[5] * 65], "input[0] has 65 tokens; the KV cache holds 64"),
                      ([[5, 384]], "input[0]: token ids must be inside the vocabulary")):
        with pytest.raises(MlxrError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            eng.add_embeddings(seqs, "last", lambda out: None)
    with pytest.raises(MlxrError, match="pooling"):
        eng.add_embeddings([[5]], "max", lambda out: None)

    async def cancelled():
        a = AsyncEngine(model, engine=eng)
        task = asyncio.ensure_future(a.embed([[5] * 60] * 50))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        t0 = time.monotonic()
        while eng.has_work():  # the engine thread drops the aborted texts at its next step
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.01)
        a.close()
    asyncio.run(cancelled())
    assert eng.blocks.num_free == 4 and eng.scheduler.waiting_requests() == 0


# -- a real server, the engine in its own process ------------------------------------------------

@pytest.fixture(scope="module")
def server(embed_dir, tmp_path_factory):  # noqa: F811
    from test_model_manager import cache_model, hub_env

    src = tmp_path_factory.mktemp("models") / "tiny-qwen3-embedding"
    shutil.copytree(embed_dir, src)
    (src / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    env = hub_env(tmp_path_factory.mktemp("hf"))
    cache_model(env, NAME, src)
    s = Server(NAME, "--engine-process", "on", "--max-num-batched-tokens", "32", env=env)
    yield s
    s.stop()


def embed_http(server, texts) -> torch.Tensor:
    r = httpx.post(server.url + "/v1/embeddings", json={"model": NAME, "input": texts},
                   timeout=120)
    assert r.status_code == 200, r.text
    return torch.tensor([d["embedding"] for d in r.json()["data"]])


def test_server_concurrent_equals_one_by_one(server, model):
    reqs = [[f"the quick brown fox {i} says hello {j}" for j in range(i % 3 + 1)] + TEXTS[:i % 4]
            for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda t: embed_http(server, t), reqs))
    for texts, got in zip(reqs, together):
        alone = torch.cat([embed_http(server, [t]) for t in texts])
        assert (got - alone).abs().max() <= 1e-5
        assert (got - model.embed(texts)).abs().max() <= 1e-5


def test_server_embeddings_beside_a_streaming_chat(server, model):
    body = {"model": NAME, "stream": True, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": "hello fox"}]}
    chunks, got = [], {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:  # the stream is running: now an embeddings request beside it
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                break
        t = threading.Thread(target=lambda: got.update(e=embed_http(server, TEXTS)))
        t.start()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        t.join(120)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert (got["e"] - model.embed(TEXTS)).abs().max() <= 1e-5


def test_server_refusals(server, model):
    ctx = model.config.context_length
    r = httpx.post(server.url + "/v1/embeddings",
                   json={"model": NAME, "input": [[5, 6], [5] * (ctx + 1)]})
    assert r.status_code == 400 and "input[1]" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/embeddings", json={"model": NAME, "input": []})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/api/embed", json={"model": NAME, "input": ["a", ""]})
    assert r.status_code == 400 and "input[1]" in r.json()["error"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_make_checkpoint_embedding_shape_and_bench(tmp_path):
    """make_checkpoint's embedding shape is recognised as one (sentence-transformers files,
    last-token pooling), and embed_bench runs both paths on it."""
    import subprocess
    import sys
    from pathlib import Path

    from mlxr.embed import is_embedding_model, pooling

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "tiny"
    subprocess.run([sys.executable, "benchmarks/make_checkpoint.py", "qwen3-embedding-tiny",
                    str(out)], cwd=root, check=True, capture_output=True, timeout=120)
    assert is_embedding_model(out) and pooling(out) == "last"
    r = subprocess.run([sys.executable, "benchmarks/embed_bench.py", str(out), "--device", "cpu",
                        "--batch", "1,3", "--tokens", "8", "--repeats", "1"], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.splitlines()[-1])["rows"]
    assert [(x["path"], x["batch"]) for x in rows] == [("embed", 1), ("engine", 1),
                                                       ("embed", 3), ("engine", 3)]
    assert all(x["texts_s"] > 0 for x in rows)
