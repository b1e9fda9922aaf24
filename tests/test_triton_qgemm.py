"""The fused prefill GEMM (mlxr.ops.matmul.prefill_gemm) and the dequantizer
(mlxr.ops.matmul.prefill_dequant) under the CPU interpreter.

Reference (`generic_qmm.qgemm_ref`): the weight dequantized in fp32 (mlxr.quant's unpacker),
rounded once to bf16, then an fp32 matmul. The kernel feeds tl.dot the same bf16 weights (the
interpreter path rounds to nearest even with integer ops, as the GPU's cvt does) and multiplies
in fp32 (input_precision="ieee"); bf16 x bf16 products are exact in fp32, so only the order of
the fp32 sums differs: |y - ref| <= 2*K*2^-24 * (|x| @ |W|^T) (`check`, fp64). A wrong group of
scales or a wrong code moves y by far more (test_check_catches_wrong_scale_group).

Dequantizer: bit-exact (torch.equal) against mlxr.quant.dequantize in fp32 and that result
rounded to bf16/fp16 (q*s is exact in fp32, so one rounding of q*s + b is the whole story), for
2/4/8-bit and for 3/5/6-bit, whose codes straddle words (the data holds such codes with bits on
both sides of the boundary).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from test_triton_qmm import random_weight

from mlxr.config import QuantSpec
from mlxr.ops.matmul import generic_qmm as T
from mlxr.ops.matmul import prefill_dequant as D
from mlxr.ops.matmul import prefill_gemm as Q
from mlxr.quant import QuantWeight, dequantize
from mlxr.quant import cuda as qcuda
from mlxr.quant.affine import unpack_codes

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

C = Q.QgemmConfig
# small tiles keep the interpreter fast; each covers another kernel path
CONFIGS = [C(block_m=16, block_n=32, block_k=64, num_warps=4),  # x @ W^T
           C(block_m=32, block_n=32, block_k=128, w_as_a=True),  # W @ x^T
           C(block_m=64, block_n=16, block_k=32, w_as_a=True, split_k=2)]  # split-K partials


def ref(x, w, s, b, bits, group):
    return T.qgemm_ref(x, w, s, b, None, mode="affine", bits=bits, group=group,
                       out_dtype=torch.float32)


def check(y, x, w, s, b, bits, group):
    """|y - ref| <= 2*K*2^-24 * |x| @ |W_bf16|^T: fp32 sums of exact products, any order."""
    want = ref(x, w, s, b, bits, group).double()
    wbf = T.dequant_f32(w, s, b, None, "affine", bits, group).to(x.dtype).double()
    tol = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ wbf.abs().t()) + 1e-30
    err = (y.double() - want).abs()
    assert y.shape == want.shape and torch.isfinite(y).all()
    assert (err <= tol).all(), (f"{bits}b g{group} M={x.shape[0]}: max err {err.max():.3g}, "
                                f"worst err/tol {(err / tol).max():.3g}")


def run(bits, group, n, k, ms, cfg, seed, xdtype=torch.bfloat16, sdtype=torch.bfloat16):
    w, s, b, _ = random_weight("affine", bits, group, n, k, seed, sdtype=sdtype)
    g = torch.Generator().manual_seed(seed + 1)
    for m in ms:
        x = torch.randn(m, k, generator=g).to(xdtype)
        y = Q.qgemm(x, w, s, b, bits=bits, group=group, out_dtype=torch.float32, config=cfg)
        check(y, x, w, s, b, bits, group)


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("group", (32, 64, 128))
def test_qgemm(bits, group):
    """Every width x group; N = 72 (ragged against 32-row tiles); K = 384 (3 tiles of 128, 6 of
    64, 12 of 32; g128 with 64- and 32-wide tiles: tiles inside one group); M = 1, 17, 70."""
    cfg = CONFIGS[(bits + group // 32) % 3]
    run(bits, group, 72, 384, (1, 17, 70), cfg, 10 * bits + group)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_ragged_k_and_splits(cfg):
    """K = 320 = 2.5 tiles of 128 (masked words, groups and x columns) and splits past the end;
    fp16 activations with fp16 scales; N = 40."""
    run(4, 32, 40, 320, (33,), cfg, 3)
    run(8, 64, 40, 320, (5,), replace(cfg, split_k=3), 4, torch.float16, torch.float16)


def test_default_config_and_bf16_output():
    """No config: default_config's launch (split-K for the small grid); bf16 output within one
    rounding of the fp32 result."""
    w, s, b, _ = random_weight("affine", 4, 64, 64, 1024, 7)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    assert Q.default_config(40, 64, 1024, 4, 64).split_k > 1
    y = Q.qgemm(x, w, s, b, bits=4, group=64)
    want = ref(x, w, s, b, 4, 64)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - want).abs() <= want.abs() * 2.0**-7 + 1e-5).all()


def test_default_configs_fill_the_gpu():
    """The 0.6B / 8B prefill shapes: enough programs for 132 SMs, no split below 4 tiles; every
    width and group gets a K tile that holds whole groups or lies in one."""
    for m in (33, 64, 100, 128, 300, 512, 2048):
        for n, k in ((4096, 1024), (6144, 1024), (1024, 3072), (4096, 4096), (6144, 4096),
                     (28672, 4096), (4096, 14336)):
            for bits, group in ((4, 64), (2, 32), (8, 128)):
                c = Q.default_config(m, n, k, bits, group)
                tiles = -(-m // c.block_m) * -(-n // c.block_n) * c.split_k
                assert k // c.block_k // c.split_k >= 4 and (tiles >= 100 or c.split_k > 1), \
                    (m, n, k)
                assert c.block_k % group == 0 or group % c.block_k == 0
    # a few sweep winners (H200, 4-bit g64) the table must keep
    assert Q.default_config(512, 6144, 4096, 4, 64).label() == "256x128x64_w8_s3_wa_k2"
    assert Q.default_config(128, 28672, 4096, 4, 64).label() == "128x128x64_w4_s3"
    assert Q.default_config(64, 4096, 14336, 4, 64).label() == "64x256x64_w8_s3_wa_k8"


def test_check_catches_wrong_scale_group():
    """The tolerance sees a kernel that reads the neighbouring group's scales, or one code off
    by one: both runs must fail `check`."""
    w, s, b, _ = random_weight("affine", 4, 32, 32, 128, 5)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y_roll = Q.qgemm(x, w, s.roll(1, dims=1), b, bits=4, group=32, out_dtype=torch.float32,
                     config=CONFIGS[0])
    with pytest.raises(AssertionError):
        check(y_roll, x, w, s, b, 4, 32)
    w2 = w.clone()
    w2[3, 0] ^= 1  # row 3, code 0 changes by one: y[:, 3] moves by s[3, 0] * x[:, 0]
    y_code = Q.qgemm(x, w2, s, b, bits=4, group=32, out_dtype=torch.float32, config=CONFIGS[1])
    with pytest.raises(AssertionError):
        check(y_code, x, w, s, b, 4, 32)
    check(Q.qgemm(x, w, s, b, bits=4, group=32, out_dtype=torch.float32, config=CONFIGS[1]),
          x, w, s, b, 4, 32)


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("group", (32, 64, 128))
def test_dequant_bit_exact(bits, group):
    """N = 40 (ragged against 32-row tiles), K = 384 (1.5 tiles of 256): fp32 output equals
    mlxr.quant.dequantize in fp32, bf16 output that value rounded to nearest even."""
    w, s, b, _ = random_weight("affine", bits, group, 40, 384, bits * group)
    spec = QuantSpec("affine", bits, group)
    want = dequantize(w, s.float(), b.float(), spec, dtype=torch.float32)
    assert torch.equal(D.dequant_affine(w, s, b, 384, bits, group, torch.float32), want)
    got = D.dequant_affine(w, s, b, 384, bits, group)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert not torch.equal(got, want.to(torch.bfloat16).view(torch.int16).add(1)
                           .view(torch.bfloat16))  # (torch.equal is not vacuous)


def test_dequant_fp16_and_even_shapes():
    """fp16 scales and output, N and K multiples of the tile (the unmasked path)."""
    w, s, b, _ = random_weight("affine", 4, 64, 64, 512, 2, sdtype=torch.float16)
    want = dequantize(w, s.float(), b.float(), QuantSpec("affine", 4, 64), dtype=torch.float32)
    got = D.dequant_affine(w, s, b, 512, 4, 64, torch.float16)
    assert torch.equal(got, want.to(torch.float16))


def straddlers(bits, k):
    """Columns [S] whose codes straddle two words, and their bit counts in the first word."""
    sh = torch.arange(k) * bits % 32
    cols = torch.nonzero(sh + bits > 32).flatten()
    return cols, 32 - sh[cols]


@pytest.mark.parametrize("bits", (3, 5, 6))
@pytest.mark.parametrize("group", (32, 64, 128))
def test_dequant_straddling_bit_exact(bits, group):
    """3/5/6-bit (codes straddle words), N = 40 (ragged against 32-row tiles), K = 384 (1.5 tiles
    of 256): fp32, bf16 and fp16 outputs equal mlxr.quant.dequantize in fp32, then cast. The data
    holds straddling codes with set bits on both sides of the word boundary, so a wrong low or
    high part changes the output."""
    w, s, b, _ = random_weight("affine", bits, group, 40, 384, 100 * bits + group)
    q = unpack_codes(w, bits, 384).long()
    cols, low = straddlers(bits, 384)
    assert len(cols) == 384 // 32 * {3: 2, 5: 4, 6: 4}[bits]  # per 32 codes
    assert ((q[:, cols] & ((1 << low) - 1)) != 0).any() and ((q[:, cols] >> low) != 0).any()
    want = dequantize(w, s.float(), b.float(), QuantSpec("affine", bits, group),
                      dtype=torch.float32)
    assert torch.equal(D.dequant_affine(w, s, b, 384, bits, group, torch.float32), want)
    for dt in (torch.bfloat16, torch.float16):
        got = D.dequant_affine(w, s, b, 384, bits, group, dt)
        assert got.dtype == dt and torch.equal(got, want.to(dt)), dt


@pytest.mark.parametrize("bits", (3, 5, 6))
def test_dequant_straddling_even_shapes(bits):
    """The unmasked path (N = 64, K = 512: whole tiles), fp16 scales, a uint32 weight; flipping
    the high part of one straddling code changes exactly that output, as in the reference."""
    w, s, b, _ = random_weight("affine", bits, 64, 64, 512, bits, sdtype=torch.float16)
    spec = QuantSpec("affine", bits, 64)
    want = dequantize(w, s.float(), b.float(), spec, dtype=torch.float32)
    got = D.dequant_affine(w.view(torch.uint32), s, b, 512, bits, 64, torch.float16)
    assert torch.equal(got, want.to(torch.float16))
    col = int(straddlers(bits, 512)[0][0])
    w2 = w.clone()
    w2[5, col * bits // 32 + 1] ^= 1  # lowest bit of the second word of code (5, col)
    got2 = D.dequant_affine(w2, s, b, 512, bits, 64, torch.float32)
    assert torch.equal(got2, dequantize(w2, s.float(), b.float(), spec, dtype=torch.float32))
    assert torch.nonzero(got2 != want).tolist() == [[5, col]]


def test_rejects_unsupported():
    w, s, b, _ = random_weight("affine", 3, 32, 16, 128, 1)
    x = torch.zeros(20, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3-bit"):
        Q.qgemm(x, w, s, b, bits=3, group=32)
    w, s, b, _ = random_weight("affine", 4, 32, 16, 128, 1)
    with pytest.raises(ValueError, match="block_k"):
        Q.qgemm(x, w, s, b, bits=4, group=32, config=C(block_k=16))
    with pytest.raises(ValueError, match="bf16/fp16"):
        Q.qgemm(x.float(), w, s, b, bits=4, group=32)
    with pytest.raises(ValueError, match="shape mismatch"):
        Q.qgemm(x[:, :64], w, s, b, bits=4, group=32)
    with pytest.raises(ValueError, match="7-bit"):
        D.dequant_affine(w, s, b, 128, 7, 32)
    w, s, b, _ = random_weight("affine", 5, 32, 16, 128, 1)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        D.dequant_affine(w, s, b, 112, 5, 32)
    with pytest.raises(ValueError, match="in_features 96 does not match"):
        D.dequant_affine(w, s, b, 96, 5, 32)
    with pytest.raises(ValueError, match="shape mismatch"):
        D.dequant_affine(w[:, :15], s, b, 128, 5, 32)


def test_env_routes_prefill(monkeypatch):
    """MLXR_PREFILL_GEMM (read at each call): `fused` serves prefill rows of
    mlxr.quant.cuda.linear with qgemm; otherwise this module's dequantizer + matmul serves
    them. Both agree with the reference."""
    spec = QuantSpec("affine", 2, 64)
    w, s, b, _ = random_weight("affine", 2, 64, 48, 256, 6)
    qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.bfloat16)
    qw.packed = w  # the CUDA layout: the mlx words as shipped
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    want = ref(x, w, s, b, 2, 64)
    wabs = T.dequant_f32(w, s, b, None, "affine", 2, 64).abs()
    tol = 2.0**-7 * (x.float().abs() @ wabs.t())  # bf16 output and matmul (the GEMM bound)
    calls = []
    for mod, fn in ((Q, "qgemm"), (D, "dequant_affine")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn,
                            lambda *a, _f=fn, _r=real, **k: calls.append(_f) or _r(*a, **k))
    for mode, called in (("", ["dequant_affine"]), ("fused", ["qgemm"]),
                         ("dequant", ["dequant_affine"])):
        monkeypatch.setenv("MLXR_PREFILL_GEMM", mode)
        calls.clear()
        y = qcuda.linear(qw, x)
        assert calls == called, mode
        assert y.dtype == torch.bfloat16 and ((y.float() - want).abs() <= tol).all(), mode


@pytest.mark.parametrize("mode", ("", "fused"))
def test_straddling_prefill_routes_to_dequant(monkeypatch, mode):
    """A 3-bit weight at M = 40 (> DECODE_MAX_M): mlxr.quant.cuda.linear serves it with this
    module's dequantizer + matmul, also under MLXR_PREFILL_GEMM=fused (qgemm is 2/4/8-bit)."""
    spec = QuantSpec("affine", 3, 32)
    w, s, b, _ = random_weight("affine", 3, 32, 48, 256, 8)
    qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.bfloat16)
    qw.packed = w  # the CUDA layout: the mlx words as shipped
    assert qcuda.dequant_supported(qw)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    want = ref(x, w, s, b, 3, 32)
    tol = 2.0**-7 * (x.float().abs() @ T.dequant_f32(w, s, b, None, "affine", 3, 32).abs().t())
    calls = []
    real = D.dequant_affine
    monkeypatch.setattr(D, "dequant_affine", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    monkeypatch.setenv("MLXR_PREFILL_GEMM", mode)
    y = qcuda.linear(qw, x)
    assert calls == [3]
    assert y.dtype == torch.bfloat16 and ((y.float() - want).abs() <= tol).all()


def test_auto_prefill_gemm_rule(monkeypatch):
    """auto: the fused GEMM for 2..128 rows of 4-bit weights of >= 4096 x 4096 (8..128 where
    tinygemm's copy exists) and 2..32 (8..32) rows of LM heads (where the H200 sweeps
    measured it faster), tinygemm or dequant + cuBLAS elsewhere."""
    monkeypatch.delenv("MLXR_PREFILL_GEMM", raising=False)

    class W:
        def __init__(self, bits, n, k):
            self.spec, self.out_features, self.in_features = QuantSpec("affine", bits, 64), n, k
            self.i4 = None  # no tinygemm copy (a single request)
            self.packed, self.tc = "words", None  # the MLX words (a stand-in), no q4tc copy

        words_dropped = property(lambda self: self.packed is None and self.tc is not None)

    assert qcuda.fused_gemm(W(4, 28672, 4096), 128)
    dropped = W(4, 28672, 4096)
    dropped.packed, dropped.tc = None, "copy"  # words dropped: dequantized from the copy
    assert not qcuda.fused_gemm(dropped, 128)
    assert qcuda.fused_gemm(W(4, 4096, 4096), 33)
    assert qcuda.fused_gemm(W(4, 4096, 4096), 2)  # no tinygemm copy: from 2 rows
    batch = W(4, 4096, 4096)
    batch.i4 = object()  # the batching engine's tinygemm copy: it keeps 2-7 rows
    assert not qcuda.fused_gemm(batch, 7) and qcuda.fused_gemm(batch, 8)
    assert qcuda.fused_gemm(W(4, 151936, 1024), 16)  # a 0.6B LM head up to 32 rows
    assert not qcuda.fused_gemm(W(4, 151936, 1024), 33)
    assert not qcuda.fused_gemm(W(4, 4096, 1024), 16)  # small weights: measured equal
    assert not qcuda.fused_gemm(W(4, 28672, 4096), 129)  # prefill-sized: cuBLAS wins
    assert not qcuda.fused_gemm(W(4, 4096, 1024), 64)  # small weights (0.6B): cuBLAS wins
    assert not qcuda.fused_gemm(W(4, 151936, 1024), 64)  # a 0.6B LM head: K = 1024 too
    assert not qcuda.fused_gemm(W(8, 28672, 4096), 64)  # 8-bit: not measured at these M
    monkeypatch.setenv("MLXR_PREFILL_GEMM", "fused")
    assert qcuda.fused_gemm(W(8, 4096, 1024), 512)
    assert not qcuda.fused_gemm(W(3, 4096, 4096), 64)  # a width the GEMM does not take
    monkeypatch.setenv("MLXR_PREFILL_GEMM", "dequant")
    assert not qcuda.fused_gemm(W(4, 28672, 4096), 64)


def test_gpu_sweep_smoke():
    """benchmarks/gpu/gpu_qgemm_sweep.py runs and passes its correctness checks (--smoke, and
    --smoke --dequant-bits for the straddling widths)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu" / "gpu_qgemm_sweep.py"),
                        "--smoke"], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "0 wrong or failed, 0 dq inexact" in r.stdout and "wa_split" in r.stdout
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu" / "gpu_qgemm_sweep.py"),
                        "--smoke", "--dequant-bits", "3,5,6"], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "3 dequant rows, 0 dq inexact" in r.stdout
