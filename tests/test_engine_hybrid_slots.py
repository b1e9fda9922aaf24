"""The hybrid families served from one slot pool (engine.slot_caches, models.slot_pool) with the
static batched decode step (`forward_batch_static`, captured per bucket on CUDA, eager here):
batched greedy output equals each request run alone (float32) with sequences joining and
leaving mid-decode, chunked prefill, preemption, cancel and prefix-snapshot resume; the static
step equals the per-sequence step on the same states; a reused slot starts from zero state."""

from __future__ import annotations

import random

import pytest
import torch

try:
    import triton
except ImportError:  # pragma: no cover - torch-only installs
    triton = None

hyb = pytest.importorskip("mlx_ref_hybrid")

import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from decode_checks import ids_of, run_all  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.engine.scheduler import Sequence  # noqa: E402
from mlxr.engine.slot_caches import SlotCaches  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

FAMILIES = ["qwen3_5", "qwen3_5_untied", "qwen3_5_moe", "qwen3_next", "gemma4_text",
            "gemma4", "gemma4_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = hyb.make_model(tmp_path_factory.mktemp(request.param), request.param,
                          dict(bits=4, group_size=64))
    return mlxr.load(path, device="cpu", dtype="float32")


def _prompts(k: int = 5) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(320) for _ in range(n)] for n in (5, 23, 11, 17, 9, 30)[:k]]


_singles: dict = {}


def _single(model, prompt: list[int], n: int) -> list[int]:
    key = (str(model.path), tuple(prompt), n)
    if key not in _singles:
        _singles[key] = list(model.generate(prompt, max_tokens=n, ignore_eos=True))
    return _singles[key]


def _engine(model, **kw) -> LLMEngine:
    engine = LLMEngine(model, paged_decode=True, **kw)
    assert isinstance(engine.seq_caches, SlotCaches)
    return engine


@pytest.mark.parametrize("budget,num_blocks", [(256, None), (7, 12)])
def test_slot_engine_batch_equals_single(model, budget, num_blocks):
    """Requests of different lengths (so they join and leave mid-decode), prefill chunks of
    at most 7 tokens, and a pool of 12 blocks of 4 that forces preemption: every output
    equals its request alone; every slot and block is free at the end."""
    prompts = _prompts()
    lengths = [12, 5, 9, 14, 3]
    engine = _engine(model, max_num_seqs=3, max_num_batched_tokens=budget,
                     num_blocks=num_blocks, block_size=4)
    sizes = []
    inner = engine.seq_caches.runner.run
    engine.seq_caches.runner.run = lambda s, c: sizes.append(len(s)) or inner(s, c)
    reqs = [EngineRequest(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    outs = run_all(engine, reqs)
    assert sizes and max(sizes) > 1 and min(sizes) == 1
    for p, n, o in zip(prompts, lengths, outs):
        assert ids_of(o) == _single(model, p, n)
    assert engine.seq_caches.caches == {} and engine.seq_caches.pending == {}
    assert sorted(engine.seq_caches.pool.free) == list(range(3))
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0


def test_slot_engine_prefix_resume_and_cancel(model):
    """A repeated prompt resumes from its snapshot (loaded into a fresh slot); a follow-up
    resumes from a snapshot taken while decoding; a cancelled sequence gives its slot back."""
    prompt = _prompts()[1]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = _engine(model, max_num_seqs=2, block_size=4)
    first = run_all(engine, [EngineRequest(prompt, params)])[0]
    second = run_all(engine, [EngineRequest(prompt, params)])[0]
    assert ids_of(first) == ids_of(second) == _single(model, prompt, 10)
    assert second[-1].cached_tokens == 20
    follow = prompt + ids_of(first)[:9] + [5, 6, 7]
    got = run_all(engine, [EngineRequest(follow, params)])[0]
    assert got[-1].cached_tokens == 32
    assert ids_of(got) == _single(model, follow, 10)
    a = engine.add(EngineRequest(_prompts()[3], SamplingParams(max_tokens=50, temperature=0,
                                                                ignore_eos=True)), lambda o: 0)
    kept: list = []
    engine.add(EngineRequest(_prompts()[0], SamplingParams(max_tokens=6, temperature=0,
                                                           ignore_eos=True)), kept.append)
    for _ in range(4):
        engine.step()
    assert a.id in engine.seq_caches.caches
    engine.abort(a)
    engine.step()
    assert a.id not in engine.seq_caches.caches
    while engine.has_work():
        engine.step()
    assert ids_of(kept) == _single(model, _prompts()[0], 6)
    assert sorted(engine.seq_caches.pool.free) == [0, 1]


@pytest.mark.parametrize("cpu_decode", ["1", "0"])
def test_static_step_equals_per_sequence_step(model, cpu_decode, monkeypatch):
    """forward_batch_static over slots (padding rows included) gives each sequence the
    logits of its own per-sequence forward on the same states, within 1e-5 of the largest
    logit (float32: the batched matmuls sum in another order); also without the C
    extension's CPU step (MLXR_CPU_DECODE=0: the mixer's `decode_rows`, states indexed in
    the pools by the decode op)."""
    monkeypatch.setenv("MLXR_CPU_DECODE", cpu_decode)
    _static_equals_alone(model.decoder)


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter)")
def test_static_step_on_the_kernels(model, monkeypatch):
    """The same on the CUDA path's kernels (Triton interpreter): the paged decode kernel
    over the full layers' blocks and over the sliding layers' rings (block = state slot),
    the fused DeltaNet step reading its states at their pool rows."""
    from mlxr.ops.kv_attention import paged
    from mlxr.ops.recurrent import gated_delta_decode as gdn

    calls = []

    def attention(*a, **k):
        calls.append(a[5])  # block size: the pool's, or a ring's
        return paged.paged_attention(*a, **k)

    monkeypatch.setattr(ops, "paged_attention", attention)
    monkeypatch.setattr(ops, "gated_delta_decode", gdn.gated_delta_decode)
    monkeypatch.setenv("MLXR_CPU_DECODE", "0")
    _static_equals_alone(model.decoder)
    assert calls
    if "gemma" in str(model.path):
        assert len(set(calls)) == 2  # full layers' blocks and sliding rings


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter)")
def test_engine_on_the_kernels(model, monkeypatch, request):
    """The whole engine with every op on its Triton kernel, as on CUDA (the interpreter
    here): prefill chunks over slot views, the static step, four requests through three
    slots == each alone on the torch ops (qwen3_5 and gemma4_text: the others' static step
    is checked on the kernels above)."""
    if request.node.callspec.params["model"] not in ("qwen3_5", "gemma4_text"):
        pytest.skip("one DeltaNet and one sliding-window family")
    from mlxr.ops.layer import norm_rope_act

    prompts, lengths = _prompts(4), [8, 3, 6, 7]
    want = [_single(model, p, n) for p, n in zip(prompts, lengths)]
    monkeypatch.setattr(ops, "_fused", norm_rope_act)
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setenv("MLXR_CPU_DECODE", "0")
    engine = _engine(model, max_num_seqs=3, max_num_batched_tokens=7, block_size=4)
    reqs = [EngineRequest(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    assert [ids_of(o) for o in run_all(engine, reqs)] == want


def _static_equals_alone(dec) -> None:
    """Three prompts prefilled into slots (their blocks 4 positions each) and into their own
    HybridCaches; one static step (bucket 4: one padding row) against each one's forward."""
    caches = SlotCaches(dec, 4, 0, num_blocks=40, max_seqs=4, max_positions=64, graphs=False)
    prompts = _prompts(3)
    seqs, views, refs = [], [], []
    blocks = iter(range(40))
    with torch.inference_mode():
        for p in prompts:
            seq = Sequence(list(p) + [7], len(p) + 1)
            seq.block_table = [next(blocks) for _ in range(-(-(len(p) + 1) // 4))]
            view = caches._cache_at(seq)
            dec.forward(torch.tensor(p), view, last_only=True)
            seq.num_computed = len(p)
            ref = dec.new_cache(64)
            dec.forward(torch.tensor(p), ref, last_only=True)
            seqs.append(seq), views.append(view), refs.append(ref)
        got = caches.runner.run(seqs, views).clone()  # bucket 4: one padding row
        for j, (seq, ref) in enumerate(zip(seqs, refs)):
            want = dec.forward(torch.tensor([7]), ref, last_only=True)[0]
            err = float((got[j] - want).abs().max())
            assert err < 1e-5 * max(1.0, float(want.abs().max())), err
            views[j].length += 1
            # the pool now holds what the per-sequence cache holds
            snap = views[j].copy(views[j].length)
            for a, b in zip(snap.conv + snap.ssm, ref.conv + ref.ssm):
                if a is not None:
                    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_reused_slot_starts_from_zero_state(model):
    """A slot given back and taken again has zero recurrent state, and a sequence in it
    decodes as if alone."""
    engine = _engine(model, max_num_seqs=1, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run_all(engine, [EngineRequest(_prompts()[2], params)])
    pool = engine.seq_caches.pool
    slot = pool.take()
    assert all(not t[slot].any() for t in pool.conv + pool.ssm if t is not None)
    pool.give(slot)
    got = run_all(engine, [EngineRequest(_prompts()[4], params)])[0]
    assert ids_of(got) == _single(model, _prompts()[4], 4)
