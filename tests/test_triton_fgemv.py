"""The fused decode GEMV (mlxr.ops.triton_fgemv) against its torch twin, in the CPU interpreter.

* float32 (every rounding point exact): y within the fp32 summation bound 2K*2^-24 * |x| @ |W|^T
  (plus the norm's statistic, reduced in another order: 1e-6 relative). A wrong code, group
  scale or bias moves y by orders of magnitude more (test_check_catches_a_wrong_code).
* bf16: the prologue's rounding points replayed with the interpreter's truncating cast
  (`trunc_bf16`; CUDA rounds to nearest): h_out bit-exact, y within one bf16 ulp of the
  GEMV of that x plus the summation bound.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from test_triton_fused import gen, trunc_bf16
from test_triton_qmm import random_weight

from mlxr.ops import reference as R
from mlxr.ops import triton_fgemv as F
from mlxr.ops.triton_qmm import dequant_f32

C = F.FgemvConfig
SHAPES = [(40, 256, C(block_n=8, kt=128)),  # 2 tiles, a partial row block
          (24, 384, C(block_n=4, kt=128)),  # 3 tiles (K not a power of two)
          (16, 512, None)]  # the default launch


def operands(bits, group, n, k, seed, dtype, pro):
    w, s, b, _ = random_weight("affine", bits, group, n, k, seed)
    g = gen(("fgemv", bits, group, n, k, seed, str(dtype), pro))
    x = (torch.randn(2 * k if pro == "act" else k, generator=g)).to(dtype)
    r = torch.randn(k, generator=g).to(dtype)
    nw = (torch.randn(k, generator=g) * 0.5 + 1).to(dtype)
    return w, s.to(dtype), b.to(dtype), x, r, nw


def kwargs(pro, x, r, nw, offset=0.0):
    if pro == "norm":
        return {"x": x, "r": r, "norm": nw, "eps": 1e-5, "offset": offset, "h_out": torch.empty_like(r)}
    if pro == "norm0":
        return {"x": x, "norm": nw, "eps": 1e-5, "offset": offset}
    if pro == "act":
        return {"x": x, "act": "silu"}
    return {"x": x}


def bound(xin, w, s, b, bits, group):
    wf = dequant_f32(w, s, b, None, "affine", bits, group).double()
    return 2 * wf.shape[1] * 2.0**-24 * (xin.double().abs() @ wf.abs().t())


@pytest.mark.parametrize("bits,group", [(4, 64), (2, 32), (8, 128), (4, 32)])
@pytest.mark.parametrize("pro", ["plain", "norm", "norm0", "act"])
@pytest.mark.parametrize("n,k,cfg", SHAPES)
def test_fgemv_fp32(bits, group, pro, n, k, cfg):
    w, s, b, x, r, nw = operands(bits, group, n, k, 3, torch.float32, pro)
    offset = 1.0 if pro == "norm0" else 0.0
    kw = kwargs(pro, x, r, nw, offset)
    y = F.fgemv(w, s, b, bits=bits, group=group, config=cfg, **kw)
    kw_ref = kwargs(pro, x, r, nw, offset)
    want = F.fgemv_ref(w, s, b, bits=bits, group=group, **kw_ref)
    if pro == "norm":
        assert torch.equal(kw["h_out"], kw_ref["h_out"])
    if pro == "plain":
        xin = x
    elif pro == "act":
        xin = R.gated_act(x[:k], x[k:], "silu")
    else:
        xin = R.rms_norm(x + r if pro == "norm" else x, nw, 1e-5, offset)
    tol = bound(xin, w, s, b, bits, group) + 1e-6 * want.abs().double() + 1e-30
    err = (y.double() - want.double()).abs()
    assert y.shape == (n,) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"


@pytest.mark.parametrize("pro", ["plain", "norm", "act"])
def test_fgemv_bf16_rounding_points(pro):
    bits, group, n, k = 4, 64, 24, 256
    w, s, b, x, r, nw = operands(bits, group, n, k, 5, torch.bfloat16, pro)
    kw = kwargs(pro, x, r, nw)
    out = torch.empty(n, dtype=torch.float32)
    y = F.fgemv(w, s, b, bits=bits, group=group, out=out, config=C(block_n=8, kt=128), **kw)
    assert y is out
    if pro == "norm":  # the interpreter's roundings of reference.add_rms_norm
        s32 = trunc_bf16(x.float() + r.float())
        assert torch.equal(kw["h_out"].float(), s32)
        xin = trunc_bf16(trunc_bf16(s32 * torch.rsqrt(s32.pow(2).mean() + 1e-5)) * nw.float())
    elif pro == "act":
        g, u = x[:k].float(), x[k:].float()
        xin = trunc_bf16(trunc_bf16(g / (1 + torch.exp(-g))) * u)
    else:
        xin = x.float()
    ref = xin @ dequant_f32(w, s, b, None, "affine", bits, group).t()
    ulp = 2.0**-7 * ref.abs()  # y is rounded (truncated here) to bf16 once
    err = (y - ref).abs().double()
    assert (err <= ulp.double() + 4 * bound(xin, w, s, b, bits, group) + 1e-30).all(), err.max()


def test_check_catches_a_wrong_code():
    """One flipped code changes y by far more than test_fgemv_fp32's tolerance."""
    bits, group, n, k = 4, 64, 8, 256
    w, s, b, x, _r, _nw = operands(bits, group, n, k, 7, torch.float32, "plain")
    y = F.fgemv(w, s, b, bits=bits, group=group, x=x, config=C(block_n=8, kt=128))
    w2 = w.clone()
    w2[3, 5] ^= 0x0F0  # code 1 of word 5 in row 3
    want = F.fgemv_ref(w2, s, b, bits=bits, group=group, x=x)
    tol = bound(x, w2, s, b, bits, group) + 1e-6 * want.abs().double()
    assert ((y.double() - want.double()).abs() > tol)[3]


def test_fgemv_rejects_bad_tiles():
    w, s, b, x, _r, nw = operands(4, 64, 8, 384, 1, torch.float32, "plain")
    with pytest.raises(ValueError, match="tile"):
        F.fgemv(w, s, b, bits=4, group=64, x=x, config=C(block_n=8, kt=256))
    with pytest.raises(ValueError, match="one prologue"):
        F.fgemv(w, s, b, bits=4, group=64, x=torch.cat([x, x]), act="silu", norm=nw)


def test_default_config(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's launch table
    c = F.default_config(4096, 1024)  # Qwen3-0.6B qkv
    assert c.kt == 1024 and 4096 // c.block_n >= 256
    c = F.default_config(1024, 3072)  # its down_proj: K = 3 * 1024
    assert 3072 % c.kt == 0 and c.kt == 1024
    c = F.default_config(151936, 1024)  # the tied LM head
    assert c.block_n == 8
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert F.default_config(4096, 1024).block_n == 32


# ---------------------------------------------------------------------------- the decode step
def quantized_decoder(kind: str, bits: int = 4, group: int = 32):
    """test_triton_layer's tiny decoder with every projection and the head quantized (fp32
    compute keeps the packed words on the CPU, as the CUDA path does)."""
    from test_triton_layer import tiny_decoder

    from mlxr.config import QuantSpec
    from mlxr.layers import Linear
    from mlxr.quant import QuantWeight

    dec = tiny_decoder(kind, torch.float32)
    seed = iter(range(100, 200))

    def quant(lin):
        n, k = lin.weight.shape
        w, s, b, _ = random_weight("affine", bits, group, n, k, next(seed))
        return Linear(QuantWeight.from_tensors(w, s.float() * 2, b.float(),
                                               QuantSpec("affine", bits, group),
                                               compute_dtype=torch.float32))

    for layer in dec.layers:
        for name in ("qkv", "o_proj", "gate_up", "down_proj"):
            setattr(layer, name, quant(getattr(layer, name)))
    dec.lm_head = quant(dec.lm_head)
    return dec


@pytest.mark.parametrize("kind,bits", [("llama", 4), ("qwen3", 2)])
def test_fused_decode_step_matches_generic(kind, bits, monkeypatch):
    """fused_decode.run vs Decoder._run on the same cache state, token by token (fp32: only the
    GEMVs' summation order differs)."""
    from mlxr.engine.kv_cache import new_cache
    from mlxr.models import fused_decode

    dec = quantized_decoder(kind, bits)
    ids = torch.tensor([3, 17, 42, 5, 9, 31, 0, 22])
    cap, p0 = 16, 5
    cache = new_cache(dec, cap)
    tables = {id(rope.spec): rope.cos_sin(0, cap) for rope in dec.ropes}
    key_pos = torch.arange(cap)
    with torch.inference_mode():
        dec.forward(ids[:p0], cache)
        for p in range(p0, len(ids)):
            pos = torch.tensor([p])
            monkeypatch.setenv("MLXR_DECODE_FGEMV", "0")
            want = dec.forward_static(ids[p:p + 1], pos, cache.pool, tables, key_pos)
            k_want = [k[:, p].clone() for k in cache.pool.k]
            causal = key_pos <= pos

            def attend(i, q, causal=causal):
                from mlxr import ops
                return ops.attention_masked(q, cache.pool.k[i], cache.pool.v[i], causal,
                                            dec.config.attn_scale, None)

            got = fused_decode.run(dec, ids[p:p + 1], {k: (c[pos], s[pos])
                                                       for k, (c, s) in tables.items()},
                                   cache.pool, pos, attend)
            assert got.shape == want.shape == (1, dec.config.vocab_size)
            assert got.dtype == torch.float32
            tol = 1e-5 * (want.amax() - want.amin())
            assert (got - want).abs().max() <= tol, float((got - want).abs().max())
            for i, k in enumerate(cache.pool.k):
                torch.testing.assert_close(k[:, p], k_want[i], rtol=1e-5, atol=1e-6)


def test_fused_decode_eligibility(monkeypatch):
    from mlxr import ops
    from mlxr.models import fused_decode

    monkeypatch.setenv("MLXR_DECODE_FGEMV", "1")
    dec = quantized_decoder("qwen3")
    assert not fused_decode.eligible(dec)  # CPU
    monkeypatch.setattr(ops, "fast_kernels", lambda device: True)
    dec = quantized_decoder("qwen3")
    dec.device = torch.device("cuda")  # only the checks read it
    dec.dtype = torch.float32
    assert not fused_decode.eligible(dec)  # float32 compute stays on the generic path
    dec._fgemv_eligible = None
    dec.dtype = torch.bfloat16
    for layer in dec.layers:
        for name in ("qkv", "o_proj", "gate_up", "down_proj"):
            getattr(layer, name).weight.compute_dtype = torch.bfloat16
    dec.lm_head.weight.compute_dtype = torch.bfloat16
    assert fused_decode.eligible(dec)
    monkeypatch.delenv("MLXR_DECODE_FGEMV")  # opt-in: off by default
    assert not fused_decode.eligible(dec)
    monkeypatch.setenv("MLXR_DECODE_FGEMV", "1")
    dec._fgemv_eligible = None
    dec.layers[1].o_proj.bias = torch.zeros(dec.config.hidden_size)
    assert not fused_decode.eligible(dec)
