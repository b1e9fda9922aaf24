"""The KV pool sized to the memory budget: an engine given `memory_budget` bytes keeps its
measured weights and gives the pool what is left (whole blocks, at most max_num_seqs full
contexts, at least memory.MIN_POOL_TOKENS or the context); a budget below that is a
MemoryBudgetError. Then `mlxr serve --memory-budget` (stories260K copies, float32, 2 sequences):
a pool shrunk to fit, shown by /api/ps; idle models evicted before a pool is shrunk; a budget
too small for the weights plus the smallest pool refused with a 507 that names the model, the
sizes and the budget, while the server keeps serving."""

import httpx
import pytest
from test_model_manager import A, B, MSGS, cache_model, chat, hub_env, ps
from test_server_helpers import BUNDLED, Server

import mlxr
from mlxr.engine import LLMEngine
from mlxr.engine.memory import pool_plan
from mlxr.errors import MemoryBudgetError

# stories260K: 5 layers, 4 KV heads x 8 dims, float32: a 16-token block is 2*5*4*8*16*4 bytes;
# its context (512) is the smallest pool, two contexts the full one at max_num_seqs 2
BLOCK = 2 * 5 * 4 * 8 * 16 * 4
LEAST, FULL = 32, 64  # blocks


@pytest.fixture(scope="module")
def model():
    return mlxr.load(BUNDLED, device="cpu", dtype="float32")


def test_pool_plan_of_the_config(model):
    plan = pool_plan(model.config, model.dtype, 16, 2)
    assert (plan.block_bytes, plan.min_blocks, plan.full_blocks) == (BLOCK, LEAST, FULL)


@pytest.mark.parametrize("extra_blocks,want", [(FULL + 5, FULL), (40, 40), (LEAST, LEAST)])
def test_engine_pool_within_its_budget(model, extra_blocks, want):
    weights = LLMEngine(model, max_num_seqs=2, num_blocks=1).weights_bytes
    budget = weights + extra_blocks * BLOCK + BLOCK // 2  # half a block is not a block
    eng = LLMEngine(model, max_num_seqs=2, memory_budget=budget)
    assert len(eng.blocks.blocks) == want and eng.kv_cache_bytes == want * BLOCK
    assert eng.weights_bytes + eng.kv_cache_bytes <= budget


def test_engine_refuses_a_budget_below_the_smallest_pool(model):
    weights = LLMEngine(model, max_num_seqs=2, num_blocks=1).weights_bytes
    budget = weights + (LEAST - 1) * BLOCK
    with pytest.raises(MemoryBudgetError, match=rf"stories260K needs {weights + LEAST * BLOCK} "
                                                rf"bytes .*more than the {budget} bytes"):
        LLMEngine(model, max_num_seqs=2, memory_budget=budget)


def _server(tmp_path_factory, budget: str) -> Server:
    env = hub_env(tmp_path_factory.mktemp("hf"))
    for name in (A, B):
        cache_model(env, name, BUNDLED)
    return Server(None, "--no-preload", "--keep-alive", "60s", "--memory-budget", budget,
                  "--max-num-seqs", "2", env=env)


def test_server_shrinks_the_pool_and_evicts_idle_models_first(tmp_path_factory):
    # 2 MiB: one model's weights (~1.04 MB) and 51 blocks; never two models
    s = _server(tmp_path_factory, "2MB")
    try:
        assert chat(s, A) == A
        m = ps(s)[A]
        assert LEAST * BLOCK <= m["kv_cache_bytes"] < FULL * BLOCK
        assert m["kv_cache_bytes"] == (2 * 2**20 - m["weights_bytes"]) // BLOCK * BLOCK
        assert m["size"] == m["weights_bytes"] + m["kv_cache_bytes"] <= 2 * 2**20
        assert chat(s, B) == B  # A was idle: evicted, and B gets the same pool
        assert list(ps(s)) == [B] and ps(s)[B]["kv_cache_bytes"] == m["kv_cache_bytes"]
    finally:
        s.stop()


def test_server_refuses_a_model_that_does_not_fit(tmp_path_factory):
    s = _server(tmp_path_factory, "1.5MB")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": A, "messages": MSGS},
                       timeout=60)
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "memory_budget_exceeded"
        for part in (A, str(int(1.5 * 2**20)), str(LEAST * BLOCK), "--memory-budget"):
            assert part in err["message"]
        r = httpx.post(s.url + "/api/generate", json={"model": A, "prompt": "x"}, timeout=60)
        assert r.status_code == 507 and "memory budget" in r.json()["error"]
        assert ps(s) == {} and httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()
