"""The memory budget with the hybrid families (tiny qwen3_5 and gemma4_text, float32): what
their per-sequence caches may hold is counted from what each layer keeps (K/V only on the
layers that store it, at their own heads and width; sliding rings at their window; nothing on
gemma4's KV-shared layers; qwen3_5's recurrent states per sequence; the caches' doubling; the
prefix snapshots), the engine's blocks are sized to the budget (they used to take a share of
the free memory whatever the budget, and report no cache bytes), real caches stay within the
plan, and `mlxr serve --memory-budget` shows and enforces it. Embeddings of a hybrid model:
a clear 400 (no embedding model of these families ships)."""

import httpx
import pytest
from test_model_manager import cache_model, hub_env, ps
from hostile_models import write_tokenizer
from test_server_helpers import Server

import mlxr
from mlxr.embed import embed_ids
from mlxr.engine import EngineRequest, LLMEngine
from mlxr.engine.memory import sequence_caches_plan
from mlxr.errors import MemoryBudgetError, MlxrError
from mlxr.text.sampling import SamplingParams

hyb = pytest.importorskip("mlx_ref_hybrid")

F32 = 4
# tests/hybrid_configs.py, by hand. qwen3_5: layers 1 and 3 full (interval 2), 2 KV heads x 32;
# layers 0 and 2 gated DeltaNet: conv [3, 2*2*32 + 4*32], state [4, 32, 32] float32
QWEN_POSITION = 2 * 2 * 2 * 32 * F32
QWEN_STATES = 2 * (3 * 256 * F32 + 4 * 32 * 32 * F32)
# gemma4_text: layer 1 full (1 KV head x global 64), layers 0 and 2 sliding (window 8, 1 x 32),
# layers 3 and 4 KV-shared (they read 1 and 2: nothing stored)
GEMMA_POSITION = 2 * 1 * 64 * F32
GEMMA_RINGS = 2 * 8 * 2 * 1 * 32 * F32
PER_SEQ = {"qwen3_5": (QWEN_POSITION, QWEN_STATES), "gemma4_text": (GEMMA_POSITION, GEMMA_RINGS)}
SLACK = 16  # slots a sequence's cache is made with beyond its tokens


@pytest.fixture(scope="module", params=list(PER_SEQ))
def model(request, tmp_path_factory):
    path = hyb.make_model(tmp_path_factory.mktemp(request.param), request.param,
                          dict(bits=4, group_size=64))
    return request.param, mlxr.load(path, device="cpu", dtype="float32")


def test_plan_counts_what_each_layer_keeps(model):
    family, m = model
    position, fixed = PER_SEQ[family]
    plan = sequence_caches_plan(m.config, m.dtype, 16, 3, 1000)
    assert plan.block_bytes == 2 * 16 * position  # a cache grows by doubling
    assert plan.seq_bytes == SLACK * position + fixed
    assert (plan.max_seqs, plan.fixed_bytes) == (3, 1000)
    assert (plan.min_blocks, plan.full_blocks) == (4096 // 16, 3 * 4096 // 16)  # context 4096
    assert plan.bytes(10) == 10 * plan.block_bytes + 3 * plan.seq_bytes + 1000


def test_engine_sizes_its_blocks_to_the_budget(model):
    _, m = model
    snap = 1 << 16
    plan = sequence_caches_plan(m.config, m.dtype, 16, 2, snap)
    weights = LLMEngine(m, max_num_seqs=2, num_blocks=1).weights_bytes
    want = plan.min_blocks + 7
    budget = weights + plan.bytes(want) + plan.block_bytes // 2  # half a block is not a block
    eng = LLMEngine(m, max_num_seqs=2, memory_budget=budget, prefix_snapshot_bytes=snap)
    assert len(eng.blocks.blocks) == want
    assert eng.kv_cache_bytes == plan.bytes(want) and eng.stats()["kv_cache_bytes"] > 0
    assert eng.weights_bytes + eng.kv_cache_bytes <= budget
    with pytest.raises(MemoryBudgetError, match=rf"{m.path.name} needs "
                                                rf"{weights + plan.bytes(plan.min_blocks)} bytes"):
        LLMEngine(m, max_num_seqs=2, memory_budget=budget - 8 * plan.block_bytes,
                  prefix_snapshot_bytes=snap)


def test_caches_stay_within_the_plan(model):
    """Every step: the live caches (grown by decoding past their first capacity) and the
    snapshots hold no more than the plan gives the blocks in use and the running sequences."""
    _, m = model
    bs, snap = 4, 1 << 15
    plan = sequence_caches_plan(m.config, m.dtype, bs, 3, snap)
    eng = LLMEngine(m, max_num_seqs=3, num_blocks=64, block_size=bs, prefix_snapshot_bytes=snap)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for p in ([3, 1, 4, 1, 5], list(range(2, 40)), [7] * 9):
        eng.add(EngineRequest(p, params), lambda out: None)
    peak = 0
    while eng.has_work():
        eng.step()
        caches = eng.seq_caches.caches.values()
        held = sum(c.nbytes() for c in caches) + eng.seq_caches.snapshots.used
        used = len(eng.blocks.blocks) - eng.blocks.num_free
        assert held <= used * plan.block_bytes + len(caches) * plan.seq_bytes + snap
        peak = max(peak, max((c.capacity for c in caches), default=0))
    assert peak > 5 + 60  # a cache doubled: the growth the plan counts was exercised


def test_embeddings_refused(model):
    _, m = model
    with pytest.raises(MlxrError, match="plain decoder"):
        embed_ids(m, [[1, 5, 9]])  # model.embed's path after the tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    src = hyb.make_model(tmp_path_factory.mktemp("qwen35"), "qwen3_5", dict(bits=4, group_size=64))
    write_tokenizer(src)  # ids < 320, the tiny vocabulary
    (src / "modules.json").write_text("[]")  # a sentence-transformers file: still refused
    env = hub_env(tmp_path_factory.mktemp("hf"))
    cache_model(env, "mlxr-test/qwen35-tiny", src)
    # 64 MiB of prefix snapshots (the CPU default) + 10 MiB: in float32 (the test server's) the
    # smallest cache (256 blocks of 32 KiB) fits, the full one (512) does not
    s = Server(None, "--no-preload", "--memory-budget", "74MB", "--max-num-seqs", "2", env=env)
    yield s, mlxr.load(src, device="cpu", dtype="float32", weights=False)
    s.stop()


def test_server_budget_counts_the_hybrid_caches(server):
    s, m = server
    name = "mlxr-test/qwen35-tiny"
    r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": [1, 5, 9],
                                                    "max_tokens": 3}, timeout=120)
    assert r.status_code == 200, r.text
    got = ps(s)[name]
    plan = sequence_caches_plan(m.config, m.dtype, 16, 2, 64 << 20)
    blocks = (74 * 2**20 - got["weights_bytes"] - plan.bytes(0)) // plan.block_bytes
    assert plan.min_blocks <= blocks < plan.full_blocks
    assert got["kv_cache_bytes"] == plan.bytes(blocks)
    assert got["size"] == got["weights_bytes"] + got["kv_cache_bytes"] <= 74 * 2**20
    r = httpx.post(s.url + "/v1/embeddings", json={"model": name, "input": ["hi"]}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "not_an_embedding_model" and "qwen3_5" in err["message"]
    r = httpx.post(s.url + "/api/embed", json={"model": name, "input": "hi"}, timeout=60)
    assert r.status_code == 400 and "not an embedding model" in r.json()["error"]
