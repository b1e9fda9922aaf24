"""Qwen3.5's padded prefill (`Qwen35Decoder.forward_padded`, the body of its prefill CUDA
graph), on the CPU: a prompt padded to its graph bucket gives the unpadded prompt's last
logits, leaves the conv and recurrent states and the attention K/V as the unpadded prefill
leaves them, and the decode steps after it (eager, and the decode graph's `forward_static`)
give the same logits. Prompts shorter than the conv window (1, 2: part of the old state stays
in the new one) up to two buckets' worth. float32, within 1e-5 of each row's logit range."""

from __future__ import annotations

import copy

import pytest
import torch
from hybrid_configs import FAMILIES

import mlxr
from mlxr.engine import cuda_graph
from mlxr.engine.kv_cache import new_cache

CAP = 1024
TOL = 1e-5


def _load(family: str, tmp_path_factory, make_checkpoint):
    path = make_checkpoint.write_hybrid(copy.deepcopy(FAMILIES[family]),
                                        tmp_path_factory.mktemp(f"{family}-pad"), None)
    return mlxr.load(path, device="cpu", dtype="float32").decoder


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_untied"])
def dec(request, tmp_path_factory, make_checkpoint):
    """qwen3_5: Hv = 2 Hk, tied head; qwen3_5_untied: Hv = Hk, attention biases."""
    return _load(request.param, tmp_path_factory, make_checkpoint)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    rng = (want.amax(-1) - want.amin(-1))[..., None]
    assert ((got - want).abs() <= TOL * rng).all(), float(((got - want).abs() / rng).max())


def _near(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = max(float(b.abs().max()), 1e-30)
    assert float((a - b).abs().max()) <= TOL * scale


def _same_cache(got, want, n: int) -> None:
    """The states, and the attention layers' K/V of positions [0, n)."""
    for g, w in zip(got.conv + got.ssm, want.conv + want.ssm):
        assert (g is None) == (w is None)
        if w is not None:
            _near(g, w)
    for i, w in enumerate(want.k):
        if w is not None:
            _near(got.k[i][:, :n], w[:, :n])
            _near(got.v[i][:, :n], want.v[i][:, :n])


@pytest.mark.parametrize("n", [1, 2, 3, 37, 100, 511, 512, 513])
def test_padded_prefill_then_decode(dec, n):
    bucket = cuda_graph.prefill_bucket(n, CAP)
    seq = torch.randint(0, dec.config.vocab_size, (n + 8,),
                        generator=torch.Generator().manual_seed(n))
    plain, padded = new_cache(dec, CAP), new_cache(dec, CAP)
    assert dec.pads_fit(padded, bucket)
    ids = torch.zeros(bucket, dtype=torch.long)
    ids[:n] = seq[:n]
    padded.length = 5  # forward_padded starts the cache over, states too
    for t in padded.conv + padded.ssm:
        if t is not None:
            t.fill_(0.5)
    tables = {id(r.spec): r.cos_sin(0, CAP) for r in dec.ropes}
    with torch.inference_mode():
        want = dec.forward(seq[:n], plain, last_only=True)
        _close(dec.forward_padded(ids, torch.tensor([n - 1]), padded), want)
        padded.length = n  # as PrefillGraph.run leaves it
        _same_cache(padded, plain, n)
        eager = padded.copy(CAP)  # the eager decode path after a graph prefill
        for p in range(n, n + 8):
            want = dec.forward(seq[p:p + 1], plain, last_only=True)
            _close(dec.forward_static(seq[p:p + 1], torch.tensor([p]), padded, tables), want)
            _close(dec.forward(seq[p:p + 1], eager, last_only=True), want)


def test_padded_gate(monkeypatch, tmp_path_factory, make_checkpoint, dec):
    """Opt-in by env, any bucket within the cache; never for the MoE variant."""
    cache = new_cache(dec, 64)
    monkeypatch.setenv("MLXR_HYBRID_PREFILL_GRAPHS", "1")
    assert cuda_graph.padded_prefill(dec, cache, 64)
    assert not cuda_graph.padded_prefill(dec, cache, 128)
    moe = _load("qwen3_5_moe", tmp_path_factory, make_checkpoint)
    assert not cuda_graph.padded_prefill(moe, new_cache(moe, 64), 16)


def test_padded_prefill_on_kernels(dec, monkeypatch):
    """The same with every op forced onto its Triton kernel (the interpreter): the conv and
    the sequential gated-delta kernels take the padding's masked gates as the twins do."""
    from mlxr import ops
    from mlxr.ops.layer import norm_rope_act

    n, bucket = 5, 16
    seq = torch.randint(0, dec.config.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    ids = torch.zeros(bucket, dtype=torch.long)
    ids[:n] = seq
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setattr(ops, "_fused", norm_rope_act)
    plain, padded = new_cache(dec, 64), new_cache(dec, 64)
    with torch.inference_mode():
        _close(dec.forward_padded(ids, torch.tensor([n - 1]), padded),
               dec.forward(seq, plain, last_only=True))
    _same_cache(padded, plain, n)
