"""The fused layer calls of the CPU decode step (`mlxr.ops.cpu.fused`, layer.c) against their
torch twins on fresh random data: equal bit for bit (they repeat the torch path's float32
operations in its order, the RMSNorm's sum in torch's own order), so no bound is derived; and
the lean step with them against the generic loop, single and batched, logits and caches."""

from __future__ import annotations

import pytest
import torch

from mlxr.engine.kv_cache import new_cache
from mlxr.models import cpu_decode
from mlxr.ops import reference
from mlxr.ops.cpu import fused, native, twins

pytestmark = pytest.mark.skipif(not native.available() or not fused.lanes(),
                                reason="mlxr's CPU kernels not built (or torch's sum order "
                                       "not reproduced on this build)")


def _rnd(g, *shape, scale=1.0):
    """bf16 values over many binades (log-normal magnitudes), signs random."""
    x = torch.randn(*shape, generator=g) * scale
    return (x * (torch.randn(*shape, generator=g) * 1.5).exp()).to(torch.bfloat16)


@pytest.mark.parametrize("n", [1, 3, 5, 7, 8, 9, 16, 24, 33, 100, 896, 1024, 4100, 20000])
def test_row_sum_is_torchs(n):
    """torch's float32 sum of a contiguous row, reproduced for lengths below, at and past the
    vector width and the 16-chunk levels (the RMSNorm's mean of squares)."""
    g = torch.Generator().manual_seed(n)
    x = _rnd(g, 8, n).float().pow(2)
    want = x.sum(-1)
    got = torch.tensor([native._module().row_sum(r.data_ptr(), n, fused.lanes()) for r in x])
    assert torch.equal(got, want)


@pytest.mark.parametrize("e", [64, 172, 896, 1024])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_equals_twin(e, residual, offset):
    g = torch.Generator().manual_seed(e + int(residual))
    h, r = _rnd(g, 5, e), _rnd(g, 5, e, scale=4.0) if residual else None
    w = _rnd(g, e)
    w = w + offset if offset else w  # as the plan forms gemma's (1 + w)
    want = twins.add_rms_norm(h.clone(), r, w, 1e-5)
    got = fused.add_rms_norm(h.clone(), r, w, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = reference.add_rms_norm(h, r, w, 1e-5) if residual else (h, reference.rms_norm(h, w,
                                                                                        1e-5))
    assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("rotary", [64, 32])
@pytest.mark.parametrize("normed", [True, False])
def test_qk_rope_equals_twin(traditional, rotary, normed):
    """q out, K and V written at the slots (gathered, out of order), partial rotary."""
    g = torch.Generator().manual_seed(rotary + 2 * int(traditional) + int(normed))
    n, h, kh, d, p = 4, 6, 2, 64, 11
    qkv = _rnd(g, n, (h + 2 * kh) * d, scale=3.0)
    w = _rnd(g, h + kh, d) if normed else None
    ang = torch.rand(p, rotary // 2, generator=g) * 6.3
    if traditional:
        cos = ang.cos().repeat_interleave(2, -1)
        sin = torch.stack((-ang.sin(), ang.sin()), -1).flatten(-2)
    else:
        cos, sin = torch.cat((ang.cos(),) * 2, -1), torch.cat((-ang.sin(), ang.sin()), -1)
    pos, slots = torch.tensor([3, 0, 10, 7]), torch.tensor([9, 2, 4, 0])
    caches = [_rnd(g, kh, p, d) for _ in range(2)]
    mine = [c.clone() for c in caches]
    want = twins.qk_rope(qkv, h, kh, w, 1e-6, cos, sin, traditional, pos, *caches, slots)
    got = fused.qk_rope(qkv, h, kh, w, 1e-6, cos, sin, traditional, pos, *mine, slots)
    assert torch.equal(got, want)
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("inter", [172, 3072])
def test_act_mul_equals_twin(act, inter):
    g = torch.Generator().manual_seed(inter)
    gu = _rnd(g, 3, 2 * inter, scale=4.0)
    assert torch.equal(fused.act_mul(gu, fused.act_table(act)), twins.act_mul(gu, act))
    # silu of gates near -90 times small ups: bf16 denormal products, kept (not flushed)
    gate = -85 - 10 * torch.rand(3, inter, generator=g)
    up = (torch.rand(3, inter, generator=g) * 0.1 + 1e-3) * (torch.randint(0, 2, (3, inter),
                                                                            generator=g) * 2 - 1)
    gu = torch.cat((gate, up), -1).bfloat16()
    want = twins.act_mul(gu, act)
    if act == "silu":
        assert (want != 0).any() and (want.float().abs() < 2.0 ** -126).any()
    assert torch.equal(fused.act_mul(gu, fused.act_table(act)), want)


def test_declined():
    """gelu's vector and scalar loops round some bf16 values differently: no table; rows of
    32,768 and more (torch splits their sums over threads) are not fused."""
    assert fused.act_table("gelu") is None and fused.act_table("gelu_tanh") is None
    assert not fused.ready(32768, 4, 2, 64, 64, False, True, "silu")
    assert fused.ready(128, 4, 2, 32, 32, False, True, "silu")


@pytest.mark.parametrize("kind,traditional,rotary,offset",
                         [("qwen3", False, 32, 0.0), ("qwen3", True, 16, 1.0),
                          ("llama", False, 32, 0.0)])
def test_lean_step_fused_equals_generic(kind, traditional, rotary, offset, monkeypatch):
    """Decode steps with the fused calls (weights on torch's int4 kernel: loaded with
    MLXR_CPU_KERNELS=0, stepped with it on) give the generic loop's logits and K/V bit for
    bit, and the calls are taken; MLXR_CPU_FUSED=0 and MLXR_CPU_KERNELS=0 turn them off."""
    from test_cpu_decode import _decode, tiny_decoder

    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")
    dec = tiny_decoder(kind, 4, traditional=traditional, rotary=rotary, norm_offset=offset)
    ids = torch.tensor([3, 17, 42, 5, 9, 61, 2, 77])
    want, cache_want = _decode(dec, ids, 3, False, monkeypatch)
    assert cpu_decode._plan(dec).fused  # built (and checked) before counting the calls
    calls = []
    real = fused.qk_rope
    monkeypatch.setattr(fused, "qk_rope", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("MLXR_CPU_KERNELS", "1")
    monkeypatch.delenv("MLXR_CPU_ATTEND", raising=False)
    got, cache_got = _decode(dec, ids, 3, True, monkeypatch)
    assert len(calls) == (len(ids) - 3) * len(dec.layers)
    assert torch.equal(got, want)
    for i in range(len(dec.layers)):
        assert torch.equal(cache_got.pool.k[i], cache_want.pool.k[i])
        assert torch.equal(cache_got.pool.v[i], cache_want.pool.v[i])
    for env in ("MLXR_CPU_FUSED", "MLXR_CPU_KERNELS"):
        monkeypatch.setenv(env, "0")
        n = len(calls)
        again, _ = _decode(dec, ids, 3, True, monkeypatch)
        assert len(calls) == n and torch.equal(again, want)
        monkeypatch.setenv(env, "1")


def test_fused_batch_equals_single(monkeypatch):
    """The engine's decode batch (three sequences, one by gathered slots) through the fused
    calls: each row equals that sequence decoded alone."""
    from test_cpu_decode import _step, tiny_decoder

    from mlxr.models.decoder import SeqSpan, Step

    dec = tiny_decoder("qwen3", 4, seed=1)
    assert cpu_decode._plan(dec).fused
    g = torch.Generator().manual_seed(5)
    cap, lens = 24, [5, 9, 2]
    prompts = [torch.randint(0, 80, (n,), generator=g) for n in lens]
    nxt = torch.randint(0, 80, (3,), generator=g)
    cache = new_cache(dec, 3 * cap)
    with torch.inference_mode():
        for b, pr in enumerate(prompts):
            st = Step([SeqSpan(0, len(pr), slot_range=(b * cap, b * cap + len(pr)))],
                      torch.arange(b * cap, b * cap + len(pr)))
            dec.forward_step(pr, st, cache.pool)
        base = [k.clone() for k in cache.pool.k], [v.clone() for v in cache.pool.v]
        singles = [dec.forward_step(nxt[b:b + 1], _step([(b * cap, lens[b])], cap), cache.pool)
                   for b in range(3)]
        for i in range(len(dec.layers)):
            cache.pool.k[i].copy_(base[0][i])
            cache.pool.v[i].copy_(base[1][i])
        both = dec.forward_step(nxt, _step([(b * cap, n) for b, n in enumerate(lens)], cap, {1}),
                                cache.pool)
    assert torch.equal(both, torch.cat(singles))
