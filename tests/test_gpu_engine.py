"""The serving engine on the GPU: decode steps replayed from CUDA graphs (one per batch bucket)
give the same greedy tokens as each request decoded alone. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import mlxr
from decode_checks import run_ids
from mlxr.cli.common import BUNDLED
from mlxr.engine import EngineRequest, LLMEngine
from mlxr.text.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The sun", "A big dog saw a cat",
           "Tim had a red ball", "One day", "The little bird sang", "Sam was sad"]


@pytest.fixture(scope="module")
def model():
    return mlxr.load(BUNDLED / "stories260K-8bit", device="cuda", dtype="float32")


@pytest.mark.parametrize("max_seqs,num_blocks", [(8, None), (3, None), (8, 10)])
def test_graph_decode_equals_single(model, max_seqs, num_blocks):
    tok = model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    lens = [48, 20, 33, 64, 5, 40, 17, 50]
    engine = LLMEngine(model, max_num_seqs=max_seqs, num_blocks=num_blocks)
    assert engine.paged is not None and max_seqs in engine.paged.graphs
    outs = run_ids(engine, [EngineRequest(p, SamplingParams(max_tokens=n, temperature=0,
                                                            ignore_eos=True))
                            for p, n in zip(prompts, lens)])
    for p, n, o in zip(prompts, lens, outs):
        assert o == list(model.generate(p, max_tokens=n, temperature=0, ignore_eos=True))
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_graph_decode_sampled_rows_match_eager(model):
    tok = model.tokenizer
    p = [tok.encode(x) for x in PROMPTS[:4]]

    def reqs():
        return [EngineRequest(p[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
                EngineRequest(p[1], SamplingParams(max_tokens=24, temperature=0.7, seed=3,
                                                   ignore_eos=True)),
                EngineRequest(p[2], SamplingParams(max_tokens=24, temperature=0, top_k=5,
                                                   repetition_penalty=1.2, ignore_eos=True)),
                EngineRequest(p[3], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                              logprobs=1)]

    graph = run_ids(LLMEngine(model, max_num_seqs=4), reqs())
    eager = run_ids(LLMEngine(model, max_num_seqs=4, paged_decode=False), reqs())
    assert graph == eager


def test_sampling_on_the_gpu(model):
    """The single-request path samples where the logits are: a seed reproduces its tokens,
    top_k=1 is greedy, and a repetition penalty works on the device too."""
    p = model.tokenizer.encode("Once upon a time")

    def gen(**kw):
        return list(model.generate(p, max_tokens=24, ignore_eos=True, **kw))

    a = gen(temperature=0.9, top_p=0.9, seed=11)
    assert a == gen(temperature=0.9, top_p=0.9, seed=11)
    assert gen(temperature=0.9, top_k=1, seed=3) == gen(temperature=0)
    pen = gen(temperature=0, repetition_penalty=1.5)
    assert len(pen) == 24 and pen == gen(temperature=0, repetition_penalty=1.5)
    # the penalty divides repeated tokens' positive logits: the greedy text repeats less
    assert len(set(pen)) >= len(set(gen(temperature=0)))
