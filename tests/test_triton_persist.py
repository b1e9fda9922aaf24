"""mlxr.ops.triton_persist (the persistent-kernel probe) in the interpreter, where a launch runs
one program (programs run one after another, so a grid barrier could never open for more):
the barrier's counter arithmetic across launches, and the one-launch GEMV chain against four
q4gemv launches. The H200 runs the same checks with 132+ programs
(benchmarks/gpu_persist_probe.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

pytest.importorskip("triton")

from mlxr.ops import triton_persist as P
from mlxr.ops import triton_q4gemv as Q

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, g, group=64):
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    b = (-7.5 * s.float() + torch.randn(n, k // group, generator=g) * 0.002).to(torch.bfloat16)
    words = Q.repack(packed).to(DEV)
    s, b = s.to(DEV), b.to(DEV)
    return words, Q.pair_scales(s, b), s, b, n


def test_sync_counts_and_needs_no_reset():
    cnt = P.new_counter(DEV)
    g = P.programs(torch.device(DEV))
    for launch in range(3):  # the counter only grows: each launch finds its own base
        out = P.sync_probe(cnt, 4, grid=g)
        assert out[:4].tolist() == [g * (g + 1) // 2] * 4 and int(out[4]) == 0
        assert int(cnt) == 4 * g * (launch + 1)


@pytest.mark.parametrize("shapes", [
    [(2048, 1024), (1024, 2048), (3072, 1024), (1024, 3072)],  # a 0.6B-style layer, smaller
    [(1040, 1024), (1024, 1024), (1024, 1024), (1000, 1024)],  # ragged row blocks
])
def test_chain4_is_four_q4gemv_launches(shapes):
    g = torch.Generator().manual_seed(len(shapes[0]) + shapes[0][0])
    ws = [_weight(n, k, g) for n, k in shapes]
    x = torch.randn(shapes[0][1], generator=g).to(torch.bfloat16).to(DEV)
    cnt = P.new_counter(DEV)
    cfgs = [Q.Q4Config(64, 128, cg=True) for _ in ws]  # the interpreter: few, large programs
    ys = P.chain4(x, [(w, sb, b, n) for w, sb, _, b, n in ws], group=64, counter=cnt,
                  configs=cfgs)
    xi = x
    for (w, sb, s, b, n), cfg, y in zip(ws, cfgs, ys):
        want = Q.q4gemv(xi[:w.shape[1] * 8], w, s, b, group=64, sb=sb, config=cfg)
        assert torch.equal(y, want)
        assert float(y.float().abs().max()) > 0
        xi = want
    assert int(cnt) == 3 * P.programs(torch.device(DEV))


def test_chain4_rejects_bad_chains():
    g = torch.Generator().manual_seed(1)
    same = [_weight(1024, 1024, g) for _ in range(4)]
    x = torch.randn(1024, generator=g).to(torch.bfloat16).to(DEV)
    chain = [(w, sb, b, n) for w, sb, _, b, n in same]
    wide = _weight(1024, 2048, g)
    with pytest.raises(ValueError, match="after an input"):  # K = 2048 after 1024 outputs
        P.chain4(x, chain[:3] + [(wide[0], wide[1], wide[3], wide[4])], group=64,
                 counter=P.new_counter(DEV))
    with pytest.raises(ValueError, match="num_warps"):  # one launch, one warp count
        P.chain4(x, chain, group=64, counter=P.new_counter(DEV),
                 configs=[Q.Q4Config(8, 128)] * 3 + [Q.Q4Config(8, 256)])


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float16), ("qwen3", torch.bfloat16)])
def test_persistent_decode_step_matches_the_fused_step(kind, dtype):
    """persist_decode.run (one launch per layer) against fused_decode.run (the same phase
    bodies as separate launches), token by token on the same cache; a different token's
    logits are far outside the tolerance."""
    from test_fused_decode import quantized_decoder

    from mlxr import ops
    from mlxr.engine.kv_cache import new_cache
    from mlxr.models import fused_decode, persist_decode

    dec = quantized_decoder(kind, dtype)
    ids = torch.tensor([3, 17, 42, 5], device=DEV)
    cap, p0 = 80, 2  # 80 keys: two 64-key tiles, so attention runs split and merged
    cache = new_cache(dec, cap)
    tables = {id(rope.spec): rope.cos_sin(0, cap) for rope in dec.ropes}
    key_pos = torch.arange(cap, device=DEV)
    unit = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    with torch.inference_mode():
        dec.forward(ids[:p0], cache)
        for p in range(p0, len(ids)):
            pos = torch.tensor([p], device=DEV)
            causal = key_pos <= pos
            step = {k: (c[pos], s[pos]) for k, (c, s) in tables.items()}

            def attend(i, q, causal=causal):
                return ops.attention_masked(q, cache.pool.k[i], cache.pool.v[i], causal,
                                            dec.config.attn_scale, None)

            other = persist_decode.run(dec, ids[p - 1:p], step, cache.pool, pos, causal)
            want = fused_decode.run(dec, ids[p:p + 1], step, cache.pool, pos, attend)
            k_want = [k[:, p].clone() for k in cache.pool.k]
            got = persist_decode.run(dec, ids[p:p + 1], step, cache.pool, pos, causal)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert torch.isfinite(got).all()
            if DEV == "cuda":  # the same kernel bodies in the same order: the same bits
                assert torch.equal(got, want)
                for i, k in enumerate(cache.pool.k):
                    assert torch.equal(k[:, p], k_want[i])
                continue
            # on the CPU fused_decode's attention and RoPE are the torch references (which
            # round q * scale and q . k to the dtype), so a few units of the dtype apart
            tol = 16 * unit * float(want.abs().max())
            assert float((got - want).abs().max()) <= tol
            assert float((other - want).abs().max()) > 4 * tol
            for i, k in enumerate(cache.pool.k):
                err = float((k[:, p].float() - k_want[i].float()).abs().max())
                assert err <= 16 * unit * float(k_want[i].abs().max())
