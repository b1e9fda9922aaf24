"""Gemma 4's padded prefill (`forward_padded`, the body of its prefill CUDA graph), on the CPU:
a prompt padded to its graph bucket gives the unpadded prompt's last logits, leaves the cache
as the unpadded prefill leaves it (every slot a later query can see), and the decode steps
after it (eager, and the decode graph's `forward_static`) give the same logits as after an
unpadded prefill. Prompts shorter and far longer than the sliding window (16: the rings wrap
many times within a bucket), on the family's layouts: sliding + full layers, KV-shared layers,
per-layer embeddings, k = v full layers. float32, within 1e-5 of each row's logit range."""

from __future__ import annotations

import copy

import pytest
import torch
from hybrid_configs import FAMILIES

import mlxr
from mlxr.engine import cuda_graph
from mlxr.engine.kv_cache import new_cache

WINDOW = 16
CAP = 1024
TOL = 1e-5


def _load(family: str, tmp_path_factory, make_checkpoint):
    cfg = copy.deepcopy(FAMILIES[family])
    text = cfg.get("text_config", cfg)
    text["sliding_window"] = WINDOW
    path = make_checkpoint.write_hybrid(cfg, tmp_path_factory.mktemp(f"{family}-pad"), None)
    return mlxr.load(path, device="cpu", dtype="float32").decoder


@pytest.fixture(scope="module", params=["gemma4", "gemma4_text"])
def dec(request, tmp_path_factory, make_checkpoint):
    """gemma4: PLE, KV sharing, k = v full layers; gemma4_text: separate v, one kv head."""
    return _load(request.param, tmp_path_factory, make_checkpoint)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    rng = (want.amax(-1) - want.amin(-1))[..., None]
    assert ((got - want).abs() <= tol * rng).all(), float(((got - want).abs() / rng).max())


def _same_cache(dec, got, want, n: int) -> None:
    """Every slot a query after position n - 1 may read: a ring's slots of positions
    [max(0, n - R), n), a full layer's [0, n)."""
    for i, (kg, kw) in enumerate(zip(got.k, want.k)):
        if kw is None:
            assert kg is None
            continue
        m = min(n, kw.shape[1])
        for a, b in ((kg, kw), (got.v[i], want.v[i])):
            scale = float(b[:, :m].abs().max())
            assert float((a[:, :m] - b[:, :m]).abs().max()) <= TOL * scale, (i, n)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 37, 100, 511, 512, 513])
def test_padded_prefill_then_decode(dec, n):
    bucket = cuda_graph.prefill_bucket(n, CAP)
    g = torch.Generator().manual_seed(n)
    seq = torch.randint(0, dec.config.vocab_size, (n + 20,), generator=g)
    plain, padded = new_cache(dec, CAP), new_cache(dec, CAP)
    assert dec.pads_fit(padded, bucket)
    ids = torch.zeros(bucket, dtype=torch.long)
    ids[:n] = seq[:n]
    padded.length = 5  # forward_padded starts the cache over
    tables = {id(r.spec): r.cos_sin(0, CAP) for r in dec._rope_kinds}
    with torch.inference_mode():
        want = dec.forward(seq[:n], plain, last_only=True)
        got = dec.forward_padded(ids, torch.tensor([n - 1]), padded)
        _close(got, want)
        assert padded._ring_index == (None, None, None)  # the graph body caches no index
        padded.length = n  # as PrefillGraph.run leaves it
        _same_cache(dec, padded, plain, n)
        eager = padded.copy(CAP)  # the eager decode path after a graph prefill
        for p in range(n, n + 20):  # past the next ring wrap
            want = dec.forward(seq[p:p + 1], plain, last_only=True)
            got = dec.forward_static(seq[p:p + 1], torch.tensor([p]), padded, tables)
            _close(got, want)
            _close(dec.forward(seq[p:p + 1], eager, last_only=True), want)


def test_padded_prefill_rerun(dec):
    """A second padded prefill into the same cache (a graph's next replay) after a longer
    one and after eager decode steps: the same as a fresh unpadded prefill."""
    long_ = torch.randint(0, dec.config.vocab_size, (300,),
                          generator=torch.Generator().manual_seed(1))
    short = long_[:37].flip(0)
    cache = new_cache(dec, CAP)
    ids = torch.zeros(64, dtype=torch.long)
    ids[:37] = short
    with torch.inference_mode():
        big = torch.zeros(384, dtype=torch.long)
        big[:300] = long_
        dec.forward_padded(big, torch.tensor([299]), cache)
        cache.length = 300
        dec.forward(long_[:3], cache, last_only=True)
        got = dec.forward_padded(ids, torch.tensor([36]), cache)
        plain = new_cache(dec, CAP)
        _close(got, dec.forward(short, plain, last_only=True))
        cache.length = 37
        _same_cache(dec, cache, plain, 37)


def test_padded_prefill_gate(monkeypatch, tmp_path_factory, make_checkpoint):
    """On by default, off by env; any bucket within the cache (rings wrap safely), never for
    the MoE variant."""
    dec = _load("gemma4", tmp_path_factory, make_checkpoint)
    cache = new_cache(dec, 64)
    monkeypatch.setenv("MLXR_HYBRID_PREFILL_GRAPHS", "0")
    assert not cuda_graph.padded_prefill(dec, cache, WINDOW)
    monkeypatch.delenv("MLXR_HYBRID_PREFILL_GRAPHS")
    assert cuda_graph.padded_prefill(dec, cache, WINDOW)
    assert cuda_graph.padded_prefill(dec, cache, 64)
    assert not cuda_graph.padded_prefill(dec, cache, 128)
    moe = _load("gemma4_moe", tmp_path_factory, make_checkpoint)
    assert not cuda_graph.padded_prefill(moe, new_cache(moe, 64), 8)


def test_padded_prefill_on_kernels(dec, monkeypatch):
    """The same with every op forced onto its Triton kernel (the interpreter), a bucket
    past the window (the rings wrap)."""
    from mlxr import ops
    from mlxr.ops.layer import norm_rope_act

    n, bucket = 21, 32
    seq = torch.randint(0, dec.config.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    ids = torch.zeros(bucket, dtype=torch.long)
    ids[:n] = seq
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setattr(ops, "_fused", norm_rope_act)
    plain, padded = new_cache(dec, 64), new_cache(dec, 64)
    with torch.inference_mode():
        _close(dec.forward_padded(ids, torch.tensor([n - 1]), padded),
               dec.forward(seq, plain, last_only=True))
    padded.length = n
    _same_cache(dec, padded, plain, n)
