"""The fused single-token decode step (mlxr.models.fused_decode: the op before each projection
in q4gemv's prologue) against the generic layer loop: in the CPU interpreter, and on the GPU
where there is one (scripts/gpu_parity.sh run).

q4gemv takes K in multiples of 1024, so the decoder here has E = H*D = F = 1024 (2 layers)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

pytest.importorskip("triton")

from mlxr.config import ModelConfig, QuantSpec, RopeSpec
from mlxr.engine.kv_cache import new_cache
from mlxr.layers import Embedding, Linear
from mlxr.models import fused_decode
from mlxr.models.decoder import Decoder, Layer
from mlxr.quant import QuantWeight
from mlxr.quant import cuda_copies as qcopies


def quantized_decoder(kind: str, dtype=torch.float16, group: int = 64,
                      device: str = DEVICE) -> Decoder:
    """Random 4-bit weights, each with q4gemv's decode copy (built at load on CUDA, here by
    hand on the CPU). llama: plain GQA; qwen3: q/k norms and a tied head; gemma3: what the
    fused step declines."""
    g = torch.Generator().manual_seed(len(kind))
    e, h, kh, d, f, v, n_layers = 1024, 16, 4, 64, 1024, 96, 2
    gemma = kind == "gemma3"
    spec = RopeSpec(d, 10000.0, traditional=False, scaling=None, max_position_embeddings=64)
    c = ModelConfig(
        model_type=kind, vocab_size=v, hidden_size=e, num_layers=n_layers, num_heads=h,
        num_kv_heads=kh, head_dim=d, intermediate_size=f, rms_norm_eps=1e-6,
        max_position_embeddings=64, tie_word_embeddings=kind == "qwen3",
        qk_norm=kind != "llama", norm_offset=1.0 if gemma else 0.0, embed_scale=None,
        hidden_act="gelu_tanh" if gemma else "silu", sandwich_norm=gemma,
        attn_scale=d ** -0.5, attn_logit_softcap=None, final_logit_softcap=None,
        clip_residual_fp16=gemma, layer_rope=(spec,) * n_layers, layer_window=(None,) * n_layers)
    seed = iter(range(1000))

    def quant(n, k):
        # MLX 4-bit words drawn directly (any int32 is a valid word), scales of ~unit-gain rows
        gw = torch.Generator().manual_seed(next(seed))
        w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gw)
        s = (torch.rand(n, k // group, generator=gw) * 0.05).to(dtype)
        b = (-7.5 * s.float() + torch.randn(n, k // group, generator=gw) * 0.01).to(dtype)
        with mock.patch.dict(os.environ, {"MLXR_Q4TC": "0"}):  # the step needs q4gemv's copy
            qw = QuantWeight.from_tensors(w, s, b, QuantSpec("affine", 4, group),
                                          compute_dtype=dtype, device=device)
        if device == "cpu":
            qw.q4, qw.q4_sb = qcopies.q4gemv_pack(w, s, b)
        assert qw.q4 is not None
        assert device == "cpu" or qw.i4 is None  # CUDA: tinygemm's copy only on demand
        return qw

    def norm(size):
        return (torch.randn(size, generator=g) * 0.2 + (0.0 if gemma else 1.0)).to(device, dtype)

    layers = [Layer(norm(e), Linear(quant((h + 2 * kh) * d, e)), Linear(quant(e, h * d)),
                    norm(e), Linear(quant(2 * f, e)), Linear(quant(e, f)),
                    norm(d) if c.qk_norm else None, norm(d) if c.qk_norm else None,
                    norm(e) if gemma else None, norm(e) if gemma else None)
              for _ in range(n_layers)]
    embed = Embedding(quant(v, e))
    head = None if c.tie_word_embeddings else Linear(quant(v, e))
    return Decoder(c, embed, layers, norm(e), head, dtype, torch.device(device))


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float16), ("qwen3", torch.bfloat16)])
def test_fused_decode_step_matches_generic(kind, dtype, monkeypatch):
    """fused_decode.run vs Decoder._run on the same cache state, token by token: logits within
    a few units of the dtype over the logit range (the norm statistics and GEMV sums run in
    other orders), the K/V written the same; a different token's logits are far outside."""
    dec = quantized_decoder(kind, dtype)
    ids = torch.tensor([3, 17, 42, 5, 9], device=DEVICE)
    cap, p0 = 16, 3
    cache = new_cache(dec, cap)
    tables = {id(rope.spec): rope.cos_sin(0, cap) for rope in dec.ropes}
    key_pos = torch.arange(cap, device=DEVICE)
    monkeypatch.setenv("MLXR_DECODE_FUSED", "0")
    unit = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    with torch.inference_mode():
        dec.forward(ids[:p0], cache)
        for p in range(p0, len(ids)):
            pos = torch.tensor([p], device=DEVICE)
            want = dec.forward_static(ids[p:p + 1], pos, cache.pool, tables)
            k_want = [k[:, p].clone() for k in cache.pool.k]
            causal = key_pos <= pos

            def attend(i, q, causal=causal):
                from mlxr import ops
                return ops.attention_masked(q, cache.pool.k[i], cache.pool.v[i], causal,
                                            dec.config.attn_scale, None)

            tol = 16 * unit * float(want.abs().max())
            if p == p0:  # the tolerance is tight enough to tell another token apart
                other = fused_decode.run(dec, ids[p - 1:p], tables, cache.pool, pos, attend)
                assert float((other - want).abs().max()) > 4 * tol
            got = fused_decode.run(dec, ids[p:p + 1], tables, cache.pool, pos, attend)
            assert got.shape == want.shape == (1, dec.config.vocab_size)
            assert got.dtype == torch.float32
            assert float((got - want).abs().max()) <= tol
            for i, k in enumerate(cache.pool.k):
                err = float((k[:, p].float() - k_want[i].float()).abs().max())
                assert err <= 16 * unit * float(k_want[i].abs().max())


@pytest.mark.skipif(DEVICE != "cpu", reason="eligibility is decided for a CPU decoder here")
def test_fused_decode_eligibility(monkeypatch):
    from mlxr import ops

    dec = quantized_decoder("qwen3", torch.bfloat16)
    assert not fused_decode.eligible(dec)  # CPU
    monkeypatch.setattr(dec, "device", torch.device("cuda"))
    monkeypatch.setattr(ops, "fast_kernels", lambda device: True)
    dec._fused_eligible = None
    assert not fused_decode.eligible(dec)  # opt-in
    monkeypatch.setenv("MLXR_DECODE_FUSED", "1")
    assert fused_decode.eligible(dec)
    monkeypatch.setenv("MLXR_Q4GEMV", "0")
    assert not fused_decode.eligible(dec)
    monkeypatch.delenv("MLXR_Q4GEMV")
    assert fused_decode.eligible(dec)
    dec.layers[1].down_proj.weight.q4 = None  # one projection without the decode copy
    dec._fused_eligible = None
    assert not fused_decode.eligible(dec)
    gemma = quantized_decoder("gemma3", torch.bfloat16)  # sandwich norms, fp16 clipping
    monkeypatch.setattr(gemma, "device", torch.device("cuda"))
    assert not fused_decode.eligible(gemma)
