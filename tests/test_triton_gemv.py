"""The decode GEMV (mlxr.ops.matmul.decode_gemv) under the CPU interpreter, against the torch twin
`generic_qmm.qgemv_ref` (fp32 dequant + fp32 matmul) on fresh random packed codes.

Every affine width x group size, every fp mode, M = 1, 3, 16; launch configs that take the
split-K partial-sum kernel, ragged N (row masks), K not a multiple of the tile (group masks,
whole tiles past the end of a split), no prefetch, and the unmasked path (N and K even).
Tolerance: the GEMV bound of tests/test_triton_qmm.py (fp32 sums in another order plus the
folded bias): |y - ref| <= 2*K*2^-24 * |x| @ (|q*s| + |b|)^T.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_triton_qmm import check, random_weight

from mlxr.config import QuantSpec
from mlxr.ops.matmul import decode_gemv as G
from mlxr.ops.matmul import generic_qmm as T
from mlxr.quant import QuantWeight
from mlxr.quant import cuda as qcuda

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

AFFINE = [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
FP = [("mxfp4", 4, 32, False), ("nvfp4", 4, 16, False), ("nvfp4", 4, 16, True),
      ("mxfp8", 8, 32, False)]
MS = (1, 3, 16)


def run(mode, bits, group, gs, n, k, seed, ms=MS, config=None, sdtype=torch.bfloat16):
    w, s, b, gsc = random_weight(mode, bits, group, n, k, seed, gs, sdtype)
    g = torch.Generator().manual_seed(seed + 1)
    for m in ms:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ref = T.qgemv_ref(x, w, s, b, gsc, mode=mode, bits=bits, group=group,
                          out_dtype=torch.float32)
        y = G.qgemv(x, w, s, b, gsc, mode=mode, bits=bits, group=group,
                    out_dtype=torch.float32, config=config)
        assert y.shape == (m, n)
        check(y, ref, x, w, s, b, gsc, mode, bits, group, False)


@pytest.mark.parametrize("bits,group", AFFINE)
def test_affine(bits, group):
    run("affine", bits, group, False, 40, 256, 300 * bits + group)


@pytest.mark.parametrize("mode,bits,group,gs", FP)
def test_fp(mode, bits, group, gs):
    run(mode, bits, group, gs, 40, 256, 7 * bits + group + gs)


@pytest.mark.parametrize("bits,group,prefetch", [(4, 64, 1), (3, 32, 0), (6, 32, 1),
                                                 (2, 128, 0), (8, 32, 1)])
def test_split_k_ragged(bits, group, prefetch):
    """K = 320: 10 groups of 32 (fewer of larger groups) in tiles of 4 or 2 groups, 2-3 splits:
    partial tiles, tiles past the end, the partial-sum kernel; N = 24 in blocks of 16."""
    gt = 4 if group == 32 else 2
    for split in (2, 3):
        cfg = G.GemvConfig(block_n=16, gt=gt, num_warps=4, split_k=split, prefetch=prefetch)
        run("affine", bits, group, False, 24, 320 if group == 32 else 384, bits + split,
            ms=(1, 16), config=cfg)


def test_unmasked_path_fp16_fp32_params():
    """N and K multiples of the tile (no masks on the word loads); fp16 and fp32 scales."""
    cfg = G.GemvConfig(block_n=8, gt=2, num_warps=2, split_k=2, prefetch=0)
    run("affine", 4, 32, False, 32, 256, 5, ms=(1, 3), config=cfg, sdtype=torch.float16)
    run("affine", 5, 64, False, 32, 256, 6, ms=(2,), config=cfg, sdtype=torch.float32)


def test_output_dtype_and_split_cast():
    """bf16 output (direct store and through the partial-sum kernel); uint32 words accepted."""
    w, s, b, _ = random_weight("affine", 4, 64, 64, 256, 5)
    x = torch.randn(3, 256).to(torch.bfloat16)
    ref = T.qgemv_ref(x, w, s, b, None, mode="affine", bits=4, group=64)
    for cfg in (None, G.GemvConfig(block_n=16, gt=1, split_k=4)):
        y = G.qgemv(x, w.view(torch.uint32), s, b, None, mode="affine", bits=4, group=64,
                    config=cfg)
        assert y.dtype == torch.bfloat16
        assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7 + 1e-6).all()


def test_check_detects_a_wrong_code():
    """The comparison is sharp enough to see one code off by one in one row."""
    w, s, b, _ = random_weight("affine", 4, 64, 16, 128, 9)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x[0, 0], s[3, 0] = 1.0, 0.02  # the changed term s*x is 0.02, far above the tolerance
    y = G.qgemv(x, w, s, b, None, mode="affine", bits=4, group=64, out_dtype=torch.float32)
    w2 = w.clone()
    w2[3, 0] ^= 1  # code 0 of row 3 changes by one
    ref = T.qgemv_ref(x, w2, s, b, None, mode="affine", bits=4, group=64,
                      out_dtype=torch.float32)
    with pytest.raises(AssertionError):
        check(y, ref, x, w, s, b, None, "affine", 4, 64, False)


def test_rejects_large_m():
    w, s, b, _ = random_weight("affine", 4, 64, 16, 128, 1)
    with pytest.raises(ValueError):
        G.qgemv(torch.zeros(17, 128), w, s, b, None, mode="affine", bits=4, group=64)


def test_default_config_fills_the_gpu():
    """Small N gets split-K (every split with at least one tile); the LM head needs none."""
    for n, k in ((1024, 3072), (1024, 2048), (4096, 4096), (6144, 1024)):
        c = G.default_config(1, n, k, 4, 64)
        assert c.split_k > 1 and -(-(k // 64) // c.gt) >= c.split_k, (n, k, c)
    c = G.default_config(1, 151936, 1024, 4, 64)
    assert c.split_k == 1 and c.gt * 64 <= 1024


def test_env_switch_routes_decode(monkeypatch):
    """MLXR_GEMV=triton: the CUDA dispatcher serves M <= 16 with decode_gemv (checked here on
    CPU tensors through the interpreter); unset, it leaves non-tinygemm weights to generic_qmm.
    Prefill rows (M = 17) of the 3-bit weight go to prefill_dequant's dequantizer either way."""
    spec = QuantSpec(mode="affine", bits=3, group_size=32)
    w, s, b, _ = random_weight("affine", 3, 32, 24, 128, 4)
    qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.bfloat16)
    qw.packed = w  # the CUDA layout: the mlx words as shipped
    x = torch.randn(2, 128).to(torch.bfloat16)
    monkeypatch.delenv("MLXR_GEMV", raising=False)
    assert qcuda.linear(qw, x) is None
    one = qcuda.linear(qw, x[:1])  # M = 1, 3-bit, bf16: decode_gemv by default (measured)
    ref1 = T.qgemv_ref(x[:1], w, s, b, None, mode="affine", bits=3, group=32)
    assert one is not None
    assert ((one.float() - ref1.float()).abs() <= ref1.float().abs() * 2.0**-7 + 1e-6).all()
    monkeypatch.setenv("MLXR_GEMV", "triton")
    y = qcuda.linear(qw, x)
    ref = T.qgemv_ref(x, w, s, b, None, mode="affine", bits=3, group=32)
    assert y is not None and y.dtype == torch.bfloat16
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7 + 1e-6).all()
    x17 = torch.randn(17, 128).to(torch.bfloat16)  # prefill rows: dequantizer + matmul
    y17 = qcuda.linear(qw, x17)
    ref17 = T.qgemm_ref(x17, w, s, b, None, mode="affine", bits=3, group=32).float()
    tol = 2.0**-7 * (x17.float().abs() @ T.dequant_f32(w, s, b, None, "affine", 3, 32).abs().t())
    assert y17 is not None and ((y17.float() - ref17).abs() <= tol).all()  # bf16 GEMM bound


def test_default_route_only_where_measured():
    """2/3-bit M = 1 bf16 go to decode_gemv by default; 4/6/8-bit, M > 1 and the float32 mode do
    not; a large 2-bit matrix gets the sweep's 32-row launch."""
    def qw_of(bits, n=24, k=128, dtype=torch.bfloat16):
        spec = QuantSpec(mode="affine", bits=bits, group_size=32)
        w, s, b, _ = random_weight("affine", bits, 32, n, k, 4)
        return QuantWeight.from_tensors(w, s, b, spec, compute_dtype=dtype)

    assert qcuda.gemv_v2_default(qw_of(2), 1) and qcuda.gemv_v2_default(qw_of(3), 1)
    assert not qcuda.gemv_v2_default(qw_of(2), 2)
    assert not any(qcuda.gemv_v2_default(qw_of(b), 1) for b in (4, 6, 8))
    assert not qcuda.gemv_v2_default(qw_of(2, dtype=torch.float32), 1)
    assert qcuda._gemv_v2_config(qw_of(2, 4096, 4096), 1).block_n == 32
    assert qcuda._gemv_v2_config(qw_of(3, 4096, 4096), 1) is None


def test_gpu_sweep_smoke():
    """benchmarks/gpu/gpu_gemv_sweep.py imports and passes its correctness checks (--smoke)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu" / "gpu_gemv_sweep.py"),
                        "--smoke"], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "0 wrong or failed" in r.stdout and "default" in r.stdout
