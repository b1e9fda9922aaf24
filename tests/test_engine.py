"""The serving engine: batch == single, prefix caching, chunked prefill, preemption, abort."""

from __future__ import annotations

import asyncio
import itertools

import pytest

import mlxr
from decode_checks import ids_of, run_all
from mlxr.cli.common import BUNDLED
from mlxr.engine import AsyncEngine, EngineRequest, LLMEngine
from mlxr.text.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return mlxr.load(BUNDLED / "stories260K", device="cpu", dtype="float32")


PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The sun", "A big dog saw a cat"]


def single(model, prompt_ids, n):
    return list(model.generate(prompt_ids, max_tokens=n, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("budget,num_blocks", [(256, None), (7, None), (256, 10)])
def test_batch_equals_single(model, budget, num_blocks):
    """Greedy tokens of concurrent requests equal each request run alone, also with tiny
    prefill chunks (budget 7) and a pool small enough to force preemption (10 blocks)."""
    tok = model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    n = 40
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=budget,
                       num_blocks=num_blocks)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = run_all(engine, [EngineRequest(p, params) for p in prompts])
    for p, o in zip(prompts, outs):
        assert ids_of(o) == single(model, p, n)
        assert o[-1].finish_reason == "length" and o[-1].completion_tokens == n
        assert "".join(x.text for x in o) == tok.decode(ids_of(o), skip_special_tokens=True)
    assert engine.blocks.num_free == len(engine.blocks.blocks)  # everything freed
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_and_same_output(model):
    tok = model.tokenizer
    base = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                      "outside in the park. One day, she saw a big, red ball.")
    engine = LLMEngine(model, max_num_seqs=2)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = run_all(engine, [EngineRequest(base, params)])[0]
    assert first[-1].cached_tokens == 0
    second_prompt = base + ids_of(first) + tok.encode("Then", add_special_tokens=False)
    second = run_all(engine, [EngineRequest(second_prompt, params)])[0]
    # the first turn's full blocks (prompt and answer) are reused
    assert second[-1].cached_tokens >= (len(base) + 16) // 16 * 16 - 16
    assert second[-1].cached_tokens % engine.block_size == 0
    assert ids_of(second) == single(model, second_prompt, 16)
    assert engine.blocks.hits > 0


def test_stop_string_and_logprobs(model):
    tok = model.tokenizer
    engine = LLMEngine(model)
    p = tok.encode("Once upon a time")
    full = "".join(o.text for o in run_all(engine, [EngineRequest(
        p, SamplingParams(max_tokens=30, temperature=0))])[0])
    stop = full[10:14]
    outs = run_all(engine, [EngineRequest(p, SamplingParams(max_tokens=30, temperature=0,
                                                              stop=(stop,)), logprobs=3)])[0]
    text = "".join(o.text for o in outs)
    assert text == full[:full.index(stop)] and outs[-1].finish_reason == "stop"
    lp = outs[0].logprobs[0]
    assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob <= 0


def test_bad_request_rejected_before_queueing(model):
    engine = LLMEngine(model)
    with pytest.raises(ValueError, match="top_p"):
        engine.add(EngineRequest([1, 2], SamplingParams(top_p=3.0)), lambda o: None)
    with pytest.raises(ValueError, match="context"):
        engine.add(EngineRequest([5] * 600, SamplingParams()), lambda o: None)
    assert not engine.has_work()


def test_async_engine_concurrent_and_abort(model):
    tok = model.tokenizer
    eng = AsyncEngine(model, max_num_seqs=4)

    async def collect(prompt, n):
        ids = []
        async for out in eng.generate(EngineRequest(tok.encode(prompt), SamplingParams(
                max_tokens=n, temperature=0, ignore_eos=True))):
            ids += out.token_ids
        return ids

    async def abandon():
        agen = eng.generate(EngineRequest(tok.encode("The sun"), SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True)))
        async for _ in agen:
            break
        await agen.aclose()

    async def main():
        res = await asyncio.gather(*(collect(p, 20) for p in PROMPTS), abandon())
        for _ in range(100):  # the engine thread frees the aborted request's blocks
            if not eng.engine.has_work():
                break
            await asyncio.sleep(0.02)
        return res

    res = asyncio.run(main())
    for p, ids in zip(PROMPTS, res):
        assert ids == single(model, tok.encode(p), 20)
    assert not eng.engine.has_work()
    assert eng.engine.blocks.num_free == len(eng.engine.blocks.blocks)


def test_async_engine_prepares_the_processor_before_queueing(model):
    """A logits processor's prepare() (a grammar's matcher build) runs in generate, before the
    request is queued; what it raises reaches the caller and nothing is queued."""
    eng = AsyncEngine(model, max_num_seqs=4)
    calls = []

    class Proc:
        def __init__(self, fail):
            self.fail = fail

        def prepare(self):
            calls.append(self.fail)
            if self.fail:
                raise RuntimeError("does not fit the vocabulary")

        def __call__(self, ids, logits):
            return logits

    async def run(proc):
        out = []
        async for o in eng.generate(EngineRequest(model.tokenizer.encode("The sun"),
                                                  SamplingParams(max_tokens=3, temperature=0,
                                                                 ignore_eos=True),
                                                  logits_processor=proc)):
            out += o.token_ids
        return out

    with pytest.raises(RuntimeError, match="vocabulary"):
        asyncio.run(run(Proc(True)))
    assert calls == [True] and not eng.engine.has_work()
    assert len(asyncio.run(run(Proc(False)))) == 3 and calls == [True, False]


def test_long_prompt_prefilled_in_chunks_alone(model):
    """A prompt longer than the step budget, with nothing else running: the steps that only
    prefill (no sampled row) must work and the result equal the single-request path."""
    tok = model.tokenizer
    prompt = tok.encode("Once upon a time, there was a little girl named Lily. " * 6)
    engine = LLMEngine(model, max_num_batched_tokens=16)
    out = run_all(engine, [EngineRequest(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                                  ignore_eos=True))])[0]
    assert len(prompt) > 3 * 16
    assert ids_of(out) == single(model, prompt, 8)


def test_engine_default_dtype_batches():
    """The fast dtype (bf16 compute, float32 KV on CPU) through the batched paged path."""
    model = mlxr.load(BUNDLED / "stories260K", device="cpu")
    tok = model.tokenizer
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = run_all(engine, [EngineRequest(p, params) for p in prompts])
    for p, o in zip(prompts, outs):
        assert ids_of(o)[:6] == single(model, p, 6)  # a real model: no near-ties this early
        assert o[-1].completion_tokens == 12


@pytest.mark.parametrize("skip,text", [(True, ""), (False, "<s>")])
def test_special_tokens_in_text_only_when_asked(model, skip, text):
    """Tool-call parsing needs special markers in the text; plain chat leaves them out."""
    engine = LLMEngine(model)
    params = SamplingParams(max_tokens=1, temperature=0, logit_bias={1: 100.0})  # force <s>
    out = run_all(engine, [EngineRequest([1, 403], params, skip_special_tokens=skip)])[0]
    assert ids_of(out) == [1] and "".join(o.text for o in out) == text


# -- AsyncEngine: one handoff per step, merged outputs for a lagging consumer ----------------------

def test_merge_outputs():
    from mlxr.engine.async_engine import merge_outputs
    from mlxr.engine.engine import RequestOutput, TokenLogprob

    a = RequestOutput([5], "Once", None, 3, 1, 0, [TokenLogprob(5, -0.1)])
    b = RequestOutput([], "", None, 3, 1, 0, None)  # e.g. text held back by a stop string
    c = RequestOutput([7, 8], " upon", "length", 3, 3, 2, [TokenLogprob(7, -1.0),
                                                            TokenLogprob(8, -2.0)])
    m = merge_outputs([a, b, c])
    assert m.token_ids == [5, 7, 8] and m.text == "Once upon"
    assert (m.finish_reason, m.prompt_tokens, m.completion_tokens, m.cached_tokens) == \
        ("length", 3, 3, 2)
    assert [lp.token_id for lp in m.logprobs] == [5, 7, 8]
    assert merge_outputs([b, RequestOutput([9], "x", None, 3, 2, 0)]).logprobs is None
    assert merge_outputs([a]) is a


def test_async_engine_slow_consumer_gets_merged_outputs(model):
    """A consumer that falls behind gets what queued up as one output; the concatenation equals
    the token-by-token stream (ids, text, logprobs) and the greedy result of the request alone."""
    tok = model.tokenizer
    n = 24
    prompt = tok.encode("Once upon a time")
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ref = run_all(LLMEngine(model), [EngineRequest(prompt, params, logprobs=2)])[0]
    assert len(ref) == n
    eng = AsyncEngine(model)

    async def main():
        outs = []
        async for out in eng.generate(EngineRequest(prompt, params, logprobs=2)):
            outs.append(out)
            if len(outs) == 1:  # lag behind until the engine has produced everything
                for _ in range(500):
                    if not eng.engine.has_work():
                        break
                    await asyncio.sleep(0.01)
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 2 and len(outs[1].token_ids) == n - 1  # merged, not n outputs
    assert ids_of(outs) == ids_of(ref) == single(model, prompt, n)
    assert "".join(o.text for o in outs) == "".join(o.text for o in ref)
    lps = [lp for o in outs for lp in o.logprobs]
    assert [(lp.token_id, lp.logprob, lp.top) for lp in lps] == \
        [(lp.token_id, lp.logprob, lp.top) for o in ref for lp in o.logprobs]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == n


def test_async_engine_one_handoff_per_step(model):
    """8 concurrent streams: the engine thread wakes the event loop once per step (not once per
    token per stream), and every stream still equals its request served alone."""
    tok = model.tokenizer
    eng = AsyncEngine(model, max_num_seqs=8)
    steps, handoffs = [0], [0]
    step = eng.engine.step

    def counted_step():
        steps[0] += 1
        step()
    eng.engine.step = counted_step
    prompts = [tok.encode(f"{p} {i}") for i in range(2) for p in PROMPTS]

    async def collect(p):
        ids = []
        async for out in eng.generate(EngineRequest(p, SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True))):
            ids += out.token_ids
        return ids

    async def main():
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counted(*a, **kw):
            handoffs[0] += 1
            return threadsafe(*a, **kw)
        loop.call_soon_threadsafe = counted
        return await asyncio.gather(*(collect(p) for p in prompts))

    res = asyncio.run(main())
    for p, ids in zip(prompts, res):
        assert ids == single(model, p, 16)
    assert 0 < handoffs[0] <= steps[0] < 8 * 16


def test_async_engine_fault_ends_every_stream(model):
    """An exception in a step reaches every running request (through the batched handoff) as an
    MlxrError, after the outputs it had; the engine then serves new requests."""
    from mlxr.errors import MlxrError

    tok = model.tokenizer
    eng = AsyncEngine(model, max_num_seqs=4)
    step, calls = eng.engine.step, [0]

    def faulty():
        calls[0] += 1
        if calls[0] == 6:
            raise RuntimeError("boom")
        step()
    eng.engine.step = faulty

    async def collect(p):
        got = []
        try:
            async for out in eng.generate(EngineRequest(tok.encode(p), SamplingParams(
                    max_tokens=50, temperature=0, ignore_eos=True))):
                got += out.token_ids
        except MlxrError as e:
            return got, str(e)
        return got, None

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(p) for p in PROMPTS)), 60)

    res = asyncio.run(main())
    assert all(err is not None and "boom" in err and 0 < len(got) < 50 for got, err in res)
    again = asyncio.run(collect(PROMPTS[0]))
    assert again[1] is None and again[0] == single(model, tok.encode(PROMPTS[0]), 50)


@pytest.mark.parametrize("interval", [3, None])
def test_async_engine_stream_interval(model, interval):
    """With a stream interval of 3, a stream gets its first token at once, then its tokens
    three steps at a time (and the rest at the end); the concatenation is the same stream. The
    default hands every token over while at most 64 streams run."""
    tok = model.tokenizer
    eng = AsyncEngine(model, max_num_seqs=4, stream_interval=interval)
    n = 20

    async def collect(p):
        outs = []
        async for out in eng.generate(EngineRequest(tok.encode(p), SamplingParams(
                max_tokens=n, temperature=0, ignore_eos=True))):
            outs.append(out)
        return outs

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS))

    for p, outs in zip(PROMPTS, asyncio.run(main())):
        assert ids_of(outs) == single(model, tok.encode(p), n)
        ends = list(itertools.accumulate(len(o.token_ids) for o in outs))
        if interval == 3:  # deliveries end at 1, 4, 7, ... 19, 20 (a lagging consumer may
            assert set(ends) <= {1, 4, 7, 10, 13, 16, 19, 20}  # merge some of them)
            assert len(ends) >= 2
        assert ends[-1] == n and outs[-1].finish_reason == "length"
    assert not eng._held


def test_prefill_bucket(monkeypatch):
    """A prompt's prefill graph bucket: the smallest that holds it and fits the cache (the graph
    writes the whole bucket's K/V); none past the largest bucket, or with MLXR_PREFILL_GRAPHS=0
    (the captured path itself is tested on CUDA: tests/test_gpu_prefill.py)."""
    from mlxr.engine.cuda_graph import PREFILL_BUCKETS, prefill_bucket

    assert [prefill_bucket(n, 4096) for n in (1, 16, 17, 257, 385, 2048)] == \
        [16, 16, 32, 384, 512, 2048]
    assert prefill_bucket(2049, 1 << 20) is None
    assert prefill_bucket(300, 256) is None  # no bucket >= 300 fits a 256-slot cache
    assert prefill_bucket(250, 256) == 256
    big = [b for b in PREFILL_BUCKETS if b >= 256]  # past 256 the padding is at most half
    assert all(b2 <= 1.5 * b1 for b1, b2 in itertools.pairwise(big))
    monkeypatch.setenv("MLXR_PREFILL_GRAPHS", "0")
    assert prefill_bucket(16, 4096) is None
