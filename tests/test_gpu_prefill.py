"""Prefill CUDA graphs (mlxr.engine.cuda_graph.PrefillGraph) on the GPU: a prompt padded to its
bucket and replayed from a graph gives the eager prefill's last-token logits and the same greedy
continuation, at bucket edges and inside buckets. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import mlxr
from mlxr.cli.common import BUNDLED
from mlxr.engine import cuda_graph
from mlxr.engine.kv_cache import new_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model():
    return mlxr.load(BUNDLED / "stories260K-8bit", device="cuda", dtype="float32")


@pytest.mark.parametrize("n", [1, 5, 16, 17, 100, 384, 480])
def test_prefill_graph_equals_eager(model, n):
    dec = model.decoder
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    with torch.inference_mode():
        eager = dec.forward(torch.tensor(prompt), new_cache(dec, 1024), last_only=True)[0]
        graphs = cuda_graph.GraphCache()
        cache, _ = graphs.get(dec, n + 8, new_cache)
        pg = graphs.prefill_graph(dec, cache, n)
        assert pg is not None and pg.bucket >= n
        for _ in range(2):  # a replay reuses the buffers of the one before
            got = pg.run(prompt)[0].clone()
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
            assert cache.length == n
    # the padding's K/V never shows: the continuation equals the eager run's token for token
    on = list(model.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXR_PREFILL_GRAPHS", "0")
        assert cuda_graph.prefill_bucket(n, 4096) is None
        off = list(model.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True))
    assert on == off
