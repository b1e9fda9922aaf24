"""The CPU prefill attention in bf16 (`mlxr.ops.cpu.prefill_attend`: torch's flash kernel,
is_causal) against the reference's float32 SDPA with a mask, and where the decoder takes it
(`native.prefill_attend_enabled`: layers whose matmuls run mlxr's kernels; env
MLXR_CPU_PREFILL_ATTEND forces it on / off)."""

from __future__ import annotations

import pytest
import torch

from mlxr.ops import reference
from mlxr.ops.cpu import native, prefill_attend

pytestmark = pytest.mark.skipif(not native.available(), reason="mlxr.ops.cpu not built")


@pytest.mark.parametrize("t,h,kh,d", [(2, 4, 4, 32), (37, 4, 2, 64), (130, 16, 8, 128)])
def test_matches_reference(t, h, kh, d):
    """Fresh random bf16 q/K/V: within the bf16 rounding of the probabilities (each output a
    convex combination of V's rows, so the error is a few bf16 steps of max |V|)."""
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in ((t, h, d), (kh, t, d),
                                                                   (kh, t, d)))
    scale = d ** -0.5
    want = reference.attention(q, k, v, 0, 0, scale)
    got = prefill_attend.attention(q, k, v, scale)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= 4 * 2 ** -8 * v.float().abs().max()
    assert torch.equal(got[0], want[0])  # the first query sees one key: V's row itself


def test_takes():
    q = torch.zeros(8, 4, 32, dtype=torch.bfloat16)
    assert prefill_attend.takes(q, 0, 0, 8, None, None, None)
    assert not prefill_attend.takes(q, 3, 0, 11, None, None, None)  # a chunk after a prefix
    assert not prefill_attend.takes(q[:1], 0, 0, 1, None, None, None)  # decode
    assert not prefill_attend.takes(q.float(), 0, 0, 8, None, None, None)  # the exact mode
    assert not prefill_attend.takes(q, 0, 0, 8, 4, None, None)  # a window
    assert not prefill_attend.takes(q, 0, 0, 8, None, 30.0, None)  # a soft-cap
    assert not prefill_attend.takes(q, 0, 0, 8, None, None, torch.zeros(4))  # sinks


def test_decoder_takes_it_where_served(monkeypatch):
    """By default a bf16 prompt's attention runs here in layers on mlxr's kernels (i4mm), not
    in layers loaded on torch's (MLXR_CPU_KERNELS=0 at load: the prefill stays the
    reference's bit for bit); the env forces it off / on; logits within the bf16 bound of the
    reference attention's, same argmax."""
    from test_cpu_decode import tiny_decoder

    from mlxr.engine.kv_cache import new_cache

    monkeypatch.delenv("MLXR_CPU_PREFILL_ATTEND", raising=False)
    dec = tiny_decoder("qwen3", seed=5)
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")
    torch_dec = tiny_decoder("qwen3", seed=5)
    monkeypatch.setenv("MLXR_CPU_KERNELS", "1")
    calls = {"n": 0}
    real = prefill_attend.attention
    monkeypatch.setattr(prefill_attend, "attention",
                        lambda *a: calls.__setitem__("n", calls["n"] + 1) or real(*a))
    ids = torch.tensor([3, 17, 42, 5, 9, 61, 2, 77, 11, 30])

    def prefill(d):
        with torch.inference_mode():
            return d.forward(ids, new_cache(d, 16))

    got = prefill(dec)
    assert calls["n"] == len(dec.layers)
    prefill(torch_dec)
    assert calls["n"] == len(dec.layers)
    monkeypatch.setenv("MLXR_CPU_PREFILL_ATTEND", "0")
    want = prefill(dec)
    assert calls["n"] == len(dec.layers)
    rng = want.max(-1).values - want.min(-1).values
    assert ((got - want).abs().max(-1).values <= 0.05 * rng).all()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    monkeypatch.setenv("MLXR_CPU_PREFILL_ATTEND", "1")
    prefill(torch_dec)
    assert calls["n"] == 2 * len(dec.layers)
