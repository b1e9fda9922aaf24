"""The engine's batched decode step (PagedDecodeRunner over Decoder.forward_paged), run eagerly
on CPU: the same host bookkeeping (block-table mirror, padding rows in the trash block, device
greedy vs host sampling) that the CUDA graphs replay on the GPU."""

from __future__ import annotations

import pytest
import torch
from decode_checks import ids_of, run_all
from test_engine import single

import mlxr
from mlxr.cli.common import BUNDLED
from mlxr.engine import EngineRequest, LLMEngine
from mlxr.engine.decode_graphs import buckets_for
from mlxr.text.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return mlxr.load(BUNDLED / "stories260K", device="cpu", dtype="float32")


PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The sun", "A big dog saw a cat",
           "Tim had a red ball", "One day", "The little bird sang"]


def test_buckets_cover_every_batch():
    for m in (1, 3, 16, 100, 256, 300):
        b = buckets_for(m)
        assert b == sorted(set(b)) and b[-1] == m and all(x < m for x in b[:-1])


@pytest.mark.parametrize("max_seqs,budget,num_blocks", [(4, 256, None), (3, 5, None),
                                                        (4, 256, 8)])
def test_paged_decode_equals_single(model, max_seqs, budget, num_blocks):
    """Different lengths (rows change owner as sequences finish and others are admitted), tiny
    prefill chunks, and a pool small enough to force preemption (a preempted sequence comes
    back with a new block table)."""
    tok = model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    lens = [40, 25, 33, 18, 40, 9, 30]
    engine = LLMEngine(model, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                       num_blocks=num_blocks, paged_decode=True)
    assert engine.paged is not None and not engine.paged.graphs
    assert engine.pool.num_blocks == len(engine.blocks.blocks) + 1  # the trash block
    batches = []
    run = engine.paged.run
    engine.paged.run = lambda seqs, want: batches.append(len(seqs)) or run(seqs, want)
    outs = run_all(engine, [EngineRequest(p, SamplingParams(max_tokens=n, temperature=0,
                                                            ignore_eos=True))
                            for p, n in zip(prompts, lens)])
    for p, n, o in zip(prompts, lens, outs):
        assert ids_of(o) == single(model, p, n)
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    assert len(batches) > 30 and max(batches) == max_seqs and min(batches) == 1
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0


def test_host_sampled_rows_beside_device_greedy(model):
    """Rows that need their logits on the host (seeded sampling, penalties, logprobs, a logits
    processor) give exactly what the eager engine gives, in the same batch as plain greedy."""
    tok = model.tokenizer
    p = [tok.encode(x) for x in PROMPTS[:5]]
    seen = []

    def proc(generated, logits):
        seen.append(len(generated))
        return logits + 5.0 * (torch.arange(logits.shape[0]) == 403)

    def reqs():
        return [EngineRequest(p[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
                EngineRequest(p[1], SamplingParams(max_tokens=20, temperature=0.8, seed=7,
                                                   ignore_eos=True)),
                EngineRequest(p[2], SamplingParams(max_tokens=20, temperature=0,
                                                   repetition_penalty=1.3, ignore_eos=True)),
                EngineRequest(p[3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                              logprobs=2),
                EngineRequest(p[4], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                              logits_processor=proc)]

    eager = run_all(LLMEngine(model, max_num_seqs=5, paged_decode=False), reqs())
    n_eager = len(seen)
    paged = run_all(LLMEngine(model, max_num_seqs=5, paged_decode=True), reqs())
    assert len(seen) == 2 * n_eager == 40
    for a, b in zip(eager, paged):
        assert ids_of(a) == ids_of(b)
        assert [o.text for o in a] == [o.text for o in b]
    la, lb = eager[3], paged[3]
    assert [x.logprobs[0].top for x in la] == [x.logprobs[0].top for x in lb]


@pytest.mark.parametrize("family", ["llama_sliding", "gemma2", "gemma3_text", "phi3", "qwen3"])
def test_paged_engine_equals_eager_engine_per_family(family, tmp_path):
    """The paged step (one attention call over the whole batch, windows and softcaps applied
    from block tables) gives the eager engine's tokens for the families whose attention has
    something special: sliding windows (prompts longer than the window of 8), logit softcap,
    partial rotary with longrope, q/k norms. Chunked prefill (budget 11) mixes prefill chunks
    and decodes in one step."""
    mlx_ref = pytest.importorskip("mlx_ref")
    path = mlx_ref.make_model(tmp_path, family, "q4g64")
    model = mlxr.load(path, device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(5)
    vocab = mlx_ref.BASE["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 12, 21, 30)]

    def run(paged):
        engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=11,
                           paged_decode=paged)
        return run_all(engine, [EngineRequest(p, SamplingParams(max_tokens=14, temperature=0,
                                                                ignore_eos=True))
                                for p in prompts])

    eager, paged = run(False), run(True)
    for a, b in zip(eager, paged):
        assert ids_of(a) == ids_of(b) and len(ids_of(a)) == 14
