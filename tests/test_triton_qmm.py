"""Triton quantized matmul kernels (mlxr.ops.matmul.generic_qmm) under the CPU interpreter.

Every bit width x group size x mode, GEMV (M = 1, 3, 16) and GEMM (M = 33, 64) paths, fresh
random packed codes (packed by an independent bit-stream packer) and mx.quantize output, vs
the torch twins and mlx's own quantized_matmul.

Tolerances (outputs compared in fp32):
* GEMV: fp32 products and sums in another order than the reference (plus the folded bias
  s*sum(q x) + b*sum(x)): |y - ref| <= 2*K*2^-24 * A, A = |x| @ (|q*s| + |b|)^T.
* GEMM: weights are rounded once to bf16 before tl.dot (the interpreter truncates, the GPU rounds
  to nearest): |y - ref| <= 2^-7 * (|x| @ |W|^T) + the GEMV term.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from mlxr.config import QuantSpec
from mlxr.ops.matmul import generic_qmm as T
from mlxr.quant import QuantWeight, dequantize, unpack_codes
from mlxr.quant.fp import code_table, fp_scales

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

AFFINE = [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
FP = [("mxfp4", 4, 32, False), ("nvfp4", 4, 16, False), ("nvfp4", 4, 16, True),
      ("mxfp8", 8, 32, False)]
GEMV_M = (1, 3, 16)
GEMM_M = (33, 64)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Independent packer: each row's codes as an LSB-first bit stream -> int32 words."""
    n, k = codes.shape
    c = codes.numpy().astype(np.uint64)
    bitmat = ((c[:, :, None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8)
    stream = bitmat.reshape(n, k * bits)  # stream bit j*bits+i = bit i of code j
    words = np.packbits(stream.reshape(n, -1, 8), axis=-1, bitorder="little")
    return torch.from_numpy(words.reshape(n, -1).copy().view(np.int32))


def random_weight(mode: str, bits: int, group: int, n: int, k: int, seed: int, gs: bool = False,
                  sdtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    if mode == "mxfp8":  # 0x7F/0xFF (NaN in mlx CPU) never occur in quantized files
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    w = pack_codes(codes, bits)
    assert torch.equal(unpack_codes(w, bits, k).long(), codes)
    ng = k // group
    if mode == "affine":
        s = (torch.randn(n, ng, generator=g) * 0.02).to(sdtype)
        b = (torch.randn(n, ng, generator=g) * 0.1).to(sdtype)
        return w, s, b, None
    if mode == "nvfp4":  # E4M3 scale bytes incl. subnormals, never 0x7F/0xFF
        s = torch.randint(0, 0x7F, (n, ng), generator=g, dtype=torch.uint8)
        s = s | (torch.randint(0, 2, (n, ng), generator=g, dtype=torch.uint8) << 7)
    else:  # E8M0 around 2^0 (byte 0 included once for the 2^-127 path)
        s = torch.randint(118, 134, (n, ng), generator=g, dtype=torch.uint8)
        s[0, 0] = 0
    gsc = torch.tensor(2.5) if gs else None
    return w, s, None, gsc


def abs_bound(x, w, s, b, gs, mode, bits, group):
    """A = |x| @ (|q*s| + |b|)^T and |x| @ |W|^T (fp64)."""
    k = s.shape[1] * group
    q = unpack_codes(w, bits, k)
    n = q.shape[0]
    if mode == "affine":
        qs = (q.double().view(n, -1, group) * s.double().unsqueeze(-1)).view(n, k)
        bb = b.double().repeat_interleave(group, 1)
        wabs, a_w = (qs + bb).abs(), qs.abs() + bb.abs()
    else:
        v = code_table(mode)[q.long()].double().view(n, -1, group)
        wabs = a_w = (v * fp_scales(s, mode, gs).double().unsqueeze(-1)).abs().view(n, k)
    xa = x.double().abs()
    return xa @ a_w.t(), xa @ wabs.t()


def check(y, ref, x, w, s, b, gs, mode, bits, group, gemm: bool):
    k = x.shape[1]
    a, aw = abs_bound(x, w, s, b, gs, mode, bits, group)
    tol = 2 * k * 2.0**-24 * a + (2.0**-7 * aw if gemm else 0) + 1e-30
    err = (y.double() - ref.double()).abs()
    assert torch.isfinite(y).all()
    bad = err > tol
    assert not bad.any(), (f"{mode} {bits}b g{group} M={x.shape[0]}: max err "
                           f"{err.max().item():.3g}, worst err/tol {(err / tol).max().item():.3g}")


def run_case(mode, bits, group, gs, n, k, seed, ms, sdtype=torch.bfloat16):
    w, s, b, gsc = random_weight(mode, bits, group, n, k, seed, gs, sdtype)
    g = torch.Generator().manual_seed(seed + 1)
    for m in ms:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ref = T.qgemv_ref(x, w, s, b, gsc, mode=mode, bits=bits, group=group,
                          out_dtype=torch.float32)
        gemm = m > 16
        fn = T.qgemm if gemm else T.qgemv
        y = fn(x, w, s, b, gsc, mode=mode, bits=bits, group=group, out_dtype=torch.float32)
        check(y, ref, x, w, s, b, gsc, mode, bits, group, gemm)


@pytest.mark.parametrize("bits,group", AFFINE)
def test_affine_gemv(bits, group):
    run_case("affine", bits, group, False, 80, 256, 100 * bits + group, GEMV_M)


@pytest.mark.parametrize("bits,group", AFFINE)
def test_affine_gemm(bits, group):
    run_case("affine", bits, group, False, 80, 256, 200 * bits + group, GEMM_M)


@pytest.mark.parametrize("mode,bits,group,gs", FP)
def test_fp_gemv_gemm(mode, bits, group, gs):
    run_case(mode, bits, group, gs, 80, 256, bits + group + gs, GEMV_M + GEMM_M)


@pytest.mark.parametrize("bits", (3, 4, 8))
def test_ragged_k_fp16_scales(bits):
    """K = 160 (not a multiple of any tile), N = 72, fp16 and fp32 affine params."""
    run_case("affine", bits, 32, False, 72, 160, 7 * bits, (1, 16, 40), torch.float16)
    run_case("affine", bits, 32, False, 72, 160, 9 * bits, (2, 33), torch.float32)


@pytest.mark.parametrize("split", (2, 3))
def test_split_k(split):
    w, s, b, _ = random_weight("affine", 5, 32, 48, 512, 11)
    x = torch.randn(4, 512).to(torch.bfloat16)
    ref = T.qgemv_ref(x, w, s, b, None, mode="affine", bits=5, group=32,
                      out_dtype=torch.float32)
    for fn, gemm in ((T.qgemv, False), (T.qgemm, True)):
        y = fn(x, w, s, b, None, mode="affine", bits=5, group=32, out_dtype=torch.float32,
               split_k=split)
        check(y, ref, x, w, s, b, None, "affine", 5, 32, gemm)


def test_bf16_output():
    w, s, b, _ = random_weight("affine", 4, 64, 64, 256, 5)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = T.qgemv(x, w, s, b, None, mode="affine", bits=4, group=64)
    assert y.dtype == torch.bfloat16
    ref = T.qgemv_ref(x, w, s, b, None, mode="affine", bits=4, group=64)
    # fp32 results agree to ~1e-6 relative, so bf16 roundings differ by at most one ulp
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7 + 1e-6).all()


mx = None
try:
    import mlx.core as mx
except ImportError:  # pragma: no cover
    pass


def _mx(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    if t.dtype == torch.int32:
        return mx.array(t.numpy().view(np.uint32))
    return mx.array(t.numpy())


def _t(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a))


@pytest.mark.skipif(mx is None, reason="mlx not installed")
@pytest.mark.parametrize("mode,bits,group", [("affine", 4, 64), ("affine", 3, 32),
                                             ("affine", 6, 128), ("mxfp4", 4, 32),
                                             ("nvfp4", 4, 16), ("mxfp8", 8, 32)])
def test_vs_mlx_quantized_matmul(mode, bits, group):
    """mx.quantize'd weights: kernels vs mx.quantized_matmul (bf16 output) and vs the bit-exact
    reference dequant (whose bf16-rounded weights add 2^-8 * |x||W| to the tolerance)."""
    mx.random.seed(bits + group)
    wf = (mx.random.normal((96, 256)) * 0.05).astype(mx.bfloat16)
    r = mx.quantize(wf, group, bits, mode=mode)
    w, s = _t(r[0]), _t(r[1])
    b = _t(r[2]) if mode == "affine" else None
    spec = QuantSpec(mode=mode, bits=bits, group_size=group)
    wd = dequantize(w, s, b, spec, dtype=torch.float32)
    for m in (1, 5, 40):
        x = torch.randn(m, 256).to(torch.bfloat16)
        y = T.qmatmul(x, _fake_qw(w, s, b, spec), out_dtype=torch.float32)
        kw = {"biases": _mx(b)} if b is not None else {}
        # mlx CPU accumulates bf16 inputs coarsely: ask it for fp32 activations
        ym = mx.quantized_matmul(_mx(x.float()), r[0], r[1], transpose=True, group_size=group,
                                 bits=bits, mode=mode, **kw)
        ym = _t(ym.astype(mx.float32))
        a, aw = abs_bound(x, w, s, b, None, mode, bits, group)
        tol = 2 * 256 * 2.0**-24 * a + 2.0**-7 * aw + 1e-30
        ref = x.double() @ wd.double().t()
        assert ((y.double() - ref).abs() <= tol + 2.0**-8 * aw).all()
        assert ((y.double() - ym.double()).abs() <= tol + 2.0**-8 * aw).all()


def _fake_qw(w, s, b, spec):
    qw = QuantWeight()
    qw.packed, qw.scales, qw.biases, qw.spec = w, s, b, spec
    qw.in_features, qw.out_features = s.shape[1] * spec.group_size, w.shape[0]
    return qw


def test_quantweight_dispatch(monkeypatch):
    """qmatmul picks GEMV for M <= MLXR_QMM_GEMV_MAX_M, GEMM above; both match the twin."""
    spec = QuantSpec(mode="affine", bits=4, group_size=64)
    w, s, b, _ = random_weight("affine", 4, 64, 64, 256, 3)
    qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.float32)
    assert qw.packed is not None and T.supported(qw)
    calls = []
    monkeypatch.setattr(T, "qgemv", lambda *a, **k: calls.append("gemv") or T.qgemv_ref(*a, **k))
    monkeypatch.setattr(T, "qgemm", lambda *a, **k: calls.append("gemm") or T.qgemm_ref(*a, **k))
    monkeypatch.setenv("MLXR_QMM_GEMV_MAX_M", "2")
    x = torch.randn(3, 256)
    T.qmatmul(x[:2], qw)
    T.qmatmul(x, qw)
    assert calls == ["gemv", "gemm"]
    torch.testing.assert_close(T.qmatmul_ref(x, qw), qw.linear(x), rtol=1e-5, atol=1e-5)
