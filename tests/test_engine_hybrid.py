"""The serving engine with the hybrid families: per-sequence recurrent state beside the K/V,
made, carried across prefill chunks, dropped on finish / cancel / preemption; batched greedy
output equals each request run alone (float32); prefix caching by state snapshots at block
boundaries (resumed sequences equal to recomputed ones, snapshot memory within its budget)."""

from __future__ import annotations

import random

import pytest

hyb = pytest.importorskip("mlx_ref_hybrid")

import mlxr  # noqa: E402
from decode_checks import ids_of, run_all  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

FAMILIES = ["qwen3_5", "gemma4_text", "qwen3_next", "gemma4_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = hyb.make_model(tmp_path_factory.mktemp(request.param), request.param,
                          dict(bits=4, group_size=64))
    return mlxr.load(path, device="cpu", dtype="float32")


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(320) for _ in range(n)] for n in (5, 23, 11, 17)]


_singles: dict = {}


def _single(model, prompt: list[int], n: int) -> list[int]:
    key = (str(model.path), tuple(prompt), n)  # not id(model): a freed model's id is reused
    if key not in _singles:
        _singles[key] = list(model.generate(prompt, max_tokens=n, ignore_eos=True))
    return _singles[key]


@pytest.mark.parametrize("budget,num_blocks", [(256, None), (7, 14)])
def test_batch_equals_single(model, budget, num_blocks, monkeypatch):
    """Concurrent greedy requests equal each run alone, also with prefill chunks of at most
    7 tokens (the recurrent state carried across chunks) and a pool of 14 blocks of 4 that forces
    preemption (the preempted sequence recomputed from a fresh state)."""
    n = 12
    prompts = _prompts()
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=budget,
                       num_blocks=num_blocks, block_size=4)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    batched = []
    inner = model.decoder.forward_batch
    monkeypatch.setattr(model.decoder, "forward_batch",
                        lambda ids, caches: batched.append(len(caches)) or inner(ids, caches))
    outs = run_all(engine, [EngineRequest(p, params) for p in prompts])
    assert batched and max(batched) > 1  # decodes ran together
    for p, o in zip(prompts, outs):
        assert ids_of(o) == _single(model, p, n)
        assert o[-1].finish_reason == "length"
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    assert engine.seq_caches.caches == {}  # dropped as each sequence finished
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_snapshot_resumes_with_the_same_output(model):
    """A repeated prompt resumes from the state snapshot at its last block boundary before
    its last token and gives the same tokens; so does a follow-up prompt extending the first
    exchange (resumed from a snapshot taken while decoding), equal to the engine without
    prefix caching."""
    prompt = _prompts()[1]  # 23 tokens: blocks of 4 -> the snapshot at 20
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = LLMEngine(model, max_num_seqs=2, block_size=4)
    plain = LLMEngine(model, max_num_seqs=2, block_size=4, prefix_snapshot_bytes=0)
    first = run_all(engine, [EngineRequest(prompt, params)])[0]
    second = run_all(engine, [EngineRequest(prompt, params)])[0]
    assert ids_of(first) == ids_of(second) == _single(model, prompt, 10)
    assert first[-1].cached_tokens == 0 and second[-1].cached_tokens == 20
    follow = prompt + ids_of(first)[:9] + [5, 6, 7]  # 35 tokens, the first 32 computed before
    got = run_all(engine, [EngineRequest(follow, params)])[0]
    assert got[-1].cached_tokens == 32
    assert ids_of(got) == ids_of(run_all(plain, [EngineRequest(follow, params)])[0])
    assert plain.stats()["prefix_snapshots"] == 0 and plain.stats()["prefix_cache_hits"] == 0
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == (20 + 32) // 4


def test_prefix_snapshots_stay_within_their_budget(model):
    """Snapshots are dropped oldest first to stay within the byte budget; outputs are those of
    the engine without prefix caching."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    probe = LLMEngine(model, max_num_seqs=1, block_size=4)
    run_all(probe, [EngineRequest(_prompts()[0], params)])
    one = max(s.nbytes() for s in probe.seq_caches.snapshots.items.values())
    budget = 3 * one
    engine = LLMEngine(model, max_num_seqs=4, block_size=4, prefix_snapshot_bytes=budget)
    reqs = [EngineRequest(p, params) for p in _prompts()]
    outs = run_all(engine, reqs)
    snaps = engine.seq_caches.snapshots
    assert 0 < snaps.used <= budget and len(snaps) < 10
    assert snaps.used == sum(s.nbytes() for s in snaps.items.values())
    assert [ids_of(o) for o in outs] == [_single(model, p, 6) for p in _prompts()]


def test_cancel_drops_the_sequence_cache(model):
    engine = LLMEngine(model, max_num_seqs=2, max_num_batched_tokens=4)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    a = engine.add(EngineRequest(_prompts()[1], params), lambda o: None)
    kept = []
    engine.add(EngineRequest(_prompts()[0], SamplingParams(max_tokens=5, temperature=0,
                                                           ignore_eos=True)), kept.append)
    for _ in range(3):
        engine.step()
    assert a.id in engine.seq_caches.caches
    engine.abort(a)
    engine.step()
    assert a.id not in engine.seq_caches.caches
    while engine.has_work():
        engine.step()
    assert engine.seq_caches.caches == {}
    assert ids_of(kept) == _single(model, _prompts()[0], 5)


def test_sampled_and_logprob_rows_come_from_the_right_sequence(model):
    """Host-side rows (logprobs) of a mixed step belong to their own sequence."""
    engine = LLMEngine(model, max_num_seqs=4)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = _prompts()[:3]
    reqs = [EngineRequest(p, params, logprobs=2 if i == 1 else None)
            for i, p in enumerate(prompts)]
    outs = run_all(engine, reqs)
    for p, o in zip(prompts, outs):
        assert ids_of(o) == _single(model, p, 3)
    lp = [x.logprobs[0] for x in outs[1] if x.logprobs]
    assert lp and all(t.token_id == t.top[0][0] for t in lp)
