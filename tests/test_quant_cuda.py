"""The CUDA prefill dequant kernel (mlxr.quant.cuda) under TRITON_INTERPRET=1 on CPU, against
the bit-exact reference dequantizer. The kernel computes q*s+b in fp32 and rounds once to bf16:
within one bf16 ulp (2^-7 relative) of the fp32 reference (the interpreter truncates where the
GPU rounds to nearest, so equality is not expected here)."""


from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from mlxr.config import QuantSpec
from mlxr.quant import QuantWeight
from mlxr.quant import cuda as qcuda
from mlxr.quant import cuda_copies as qcopies
from mlxr.quant.dequant import dequantize as ref_dequantize

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU


def _spy(monkeypatch, module, name, record):
    """Replace module.name by a wrapper that still calls it and appends record(args, kwargs)
    of each call to the returned list."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, **kw: calls.append(record(a, kw)) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [24, 67])
def test_dequant_kernel_matches_reference(bits, group, n):
    g = torch.Generator().manual_seed(bits * 1000 + group + n)
    k = 256
    words = torch.randint(-(2**31), 2**31, (n, k * bits // 32), generator=g, dtype=torch.int64)
    w = words.to(torch.int32)
    s = (torch.randn(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    b = (torch.randn(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    spec = QuantSpec("affine", bits, group)
    qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.bfloat16, device="cpu")
    qw.packed = w  # the CUDA layout: the mlx words as shipped
    got = qcuda.dequantize(qw, torch.bfloat16)
    want32 = ref_dequantize(w, s.float(), b.float(), spec, dtype=torch.float32)
    ulp = 2.0 ** -7 * want32.abs() + 2.0 ** -126
    assert ((got.float() - want32).abs() <= ulp).all()
    assert (got.float() - want32).abs().max() > 0 or bits == 8  # the test sees real rounding


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "nvfp4-nogs", "mxfp8"])
@pytest.mark.parametrize("n,k", [(64, 512), (24, 384)])  # whole tiles; rows and columns past
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp_dequant_kernel_matches_reference(mode, n, k, dtype):
    """`dequant_fp` (the fp modes' prefill dequantization) against `fp.fp_dequantize`: the same
    bits, except E4M3's NaN bytes (0x7F / 0xFF: +-480 in the kernels, as in the GEMVs).
    nvfp4's global scale is optional (the 8B nvfp4 checkpoint has none); only nvfp4 takes
    one."""
    from mlxr.ops.matmul.prefill_dequant import dequant_fp
    from mlxr.quant.fp import FP_MODES, fp_dequantize, fp_scales

    gs = torch.tensor(3.5e3) if mode == "nvfp4" else None
    mode = mode.removesuffix("-nogs")
    bits, group = FP_MODES[mode]
    g = torch.Generator().manual_seed(n + k + bits)
    w = torch.randint(-(2**31), 2**31, (n, k * bits // 32), generator=g,
                      dtype=torch.int64).to(torch.int32)
    lo, hi = (0, 127) if mode == "nvfp4" else (110, 135)  # E4M3 / E8M0 scale bytes
    sc = torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.uint8)
    got = dequant_fp(w, sc, gs, mode, dtype)
    want = fp_dequantize(w, sc, mode, global_scale=gs, out_dtype=dtype)
    finite = torch.isfinite(want)
    assert finite.float().mean() > 0.9
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    if mode == "mxfp8":  # the NaN bytes decode to +-480 x scale
        s_el = fp_scales(sc, mode).repeat_interleave(group, 1)
        assert bool((~finite).any())
        assert torch.equal(got[~finite].float().abs(), (480 * s_el[~finite]).to(dtype).float())
    if mode != "nvfp4":
        with pytest.raises(ValueError, match="global scale"):
            dequant_fp(w, sc, torch.tensor(1.0), mode, dtype)


def test_fp_prefill_takes_dequant(monkeypatch):
    """17+ rows of an fp-mode weight take `dequant_fp` + a matmul (the same values as the
    generic kernels within bf16 rounding), the generic kernels with MLXR_FP_DEQUANT=0;
    the fused affine GEMM never takes them, whatever MLXR_PREFILL_GEMM says."""
    from mlxr.ops.matmul import prefill_dequant
    from mlxr.quant.fp import fp_dequantize

    g = torch.Generator().manual_seed(3)
    n, k = 64, 256
    w = torch.randint(-(2**31), 2**31, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    sc = torch.randint(118, 124, (n, k // 32), generator=g, dtype=torch.uint8)
    qw = QuantWeight.from_tensors(w, sc, None, QuantSpec("mxfp4", 4, 32), device="cpu")
    qw.packed, qw.codes, qw.i4 = w, None, None  # as CUDA keeps it
    x = torch.randn(20, k, generator=g).to(torch.bfloat16)
    monkeypatch.setenv("MLXR_FP_DEQUANT", "0")
    assert qcuda.linear(qw, x) is None
    monkeypatch.delenv("MLXR_FP_DEQUANT")
    calls = _spy(monkeypatch, prefill_dequant, "dequant_fp", lambda a, kw: a[3])
    monkeypatch.setenv("MLXR_PREFILL_GEMM", "fused")
    y = qcuda.linear(qw, x)
    assert calls == ["mxfp4"] and y.shape == (20, n)
    want = x.float() @ fp_dequantize(w, sc, "mxfp4", out_dtype=torch.float32).t()
    assert torch.allclose(y.float(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))


def test_tinygemm_nibble_order():
    """tinygemm wants element 2j in the high nibble of byte j; mlx stores it in the low one."""
    codes = torch.arange(16, dtype=torch.int32).repeat(2, 4)  # [2, 64]
    from mlxr.quant.affine import unpack_codes

    mlx_words = torch.zeros(2, 8, dtype=torch.int32)
    for j in range(8):
        for e in range(8):
            mlx_words[:, j] |= codes[:, 8 * j + e] << (4 * e)
    assert torch.equal(unpack_codes(mlx_words, 4, 64).to(torch.int32), codes)
    b = mlx_words.view(torch.uint8)
    swapped = (b << 4) | (b >> 4)
    assert torch.equal((swapped >> 4).to(torch.int32), codes[:, 0::2])
    assert torch.equal((swapped & 15).to(torch.int32), codes[:, 1::2])


def _q4_weight(g, n, k, group):
    """Random 4-bit bf16 weight drawn from g, as CUDA keeps it after load (the MLX words, no
    tinygemm copy), built on the CPU: (words, scales, biases, QuantWeight)."""
    w = torch.randint(-(2**31), 2**31, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    s = (torch.randn(n, k // group, generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, k // group, generator=g) * 0.1).to(torch.bfloat16)
    qw = QuantWeight.from_tensors(w, s, b, QuantSpec("affine", 4, group),
                                  compute_dtype=torch.bfloat16, device="cpu")
    qw.packed, qw.i4, qw.i4_sz = w, None, None
    return w, s, b, qw


def test_single_row_decode_takes_q4gemv(monkeypatch):
    """M = 1 of a 4-bit bf16 weight runs decode_gemv_q4 on the load-time repack; MLXR_Q4GEMV=0
    turns it off (then tinygemm, absent here, would serve it); other widths never take it."""
    g = torch.Generator().manual_seed(11)
    n, k, group = 40, 1024, 64
    w, s, b, qw = _q4_weight(g, n, k, group)  # the CUDA layout, without tinygemm's copy
    spec = qw.spec
    assert qcuda.q4gemv_supported(qw)
    qw.q4, qw.q4_sb = qcopies.q4gemv_pack(w, s, b)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    y = qcuda.linear(qw, x)
    want = x.float() @ ref_dequantize(w, s.float(), b.float(), spec, dtype=torch.float32).t()
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert ((y.float() - want).abs() <= 2.0 ** -7 * want.abs() + 1e-3).all()
    monkeypatch.setenv("MLXR_Q4GEMV", "0")
    assert qcuda.linear(qw, x) is None
    monkeypatch.delenv("MLXR_Q4GEMV")
    # 2-16 rows without tinygemm's copy: the prefill path (one read of the packed words), not
    # the generic per-row-block kernels (None); without the q4 repack they stay generic
    from mlxr.ops.matmul import prefill_dequant

    calls = _spy(monkeypatch, prefill_dequant, "dequant_affine", lambda a, kw: a[4])
    x8 = torch.randn(8, k, generator=g).to(torch.bfloat16)
    y8 = qcuda.linear(qw, x8)
    want8 = x8.float() @ ref_dequantize(w, s.float(), b.float(), spec, dtype=torch.float32).t()
    assert calls == [4] and y8.shape == (8, n)
    assert ((y8.float() - want8).abs() <= 2.0 ** -7 * want8.abs() + 2e-2).all()
    qw.q4 = qw.q4_sb = None
    assert qcuda.linear(qw, x8) is None
    qw3 = QuantWeight.from_tensors(torch.zeros(n, k * 3 // 32, dtype=torch.int32),
                                   torch.ones(n, k // group), torch.zeros(n, k // group),
                                   QuantSpec("affine", 3, group), device="cpu")
    qw3.packed = torch.zeros(n, k * 3 // 32, dtype=torch.int32)
    assert not qcuda.q4gemv_supported(qw3)


def test_single_row_decode_takes_q4tc_where_preferred(monkeypatch):
    """M = 1 of a tall 4-bit weight (N >= 4K) runs decode_gemv_tc on its load-time repack;
    MLXR_Q4TC=0 (read at load) or the fused decode step keep q4gemv; a square one keeps
    q4gemv."""
    from mlxr.ops.matmul import decode_gemv_tc

    g = torch.Generator().manual_seed(12)
    n, k, group = 2048, 512, 64
    w, s, b, qw = _q4_weight(g, n, k, group)  # the CUDA layout, without tinygemm's copy
    spec = qw.spec
    assert qcuda.q4tc_preferred(qw)
    qw.tc, qw.q4_sb = qcopies.q4tc_pack(w, s, b)
    calls = _spy(monkeypatch, decode_gemv_tc, "q4tc", lambda a, kw: 1)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    y = qcuda.linear(qw, x)
    want = x.float() @ ref_dequantize(w, s.float(), b.float(), spec, dtype=torch.float32).t()
    assert calls == [1] and y.shape == (1, n) and y.dtype == torch.bfloat16
    assert ((y.float() - want).abs() <= 2.0 ** -7 * want.abs() + 1e-3).all()
    xs = torch.cat([torch.zeros(1, 1, dtype=torch.bfloat16), x], 1)[:, 1:]  # 2 bytes off
    assert xs.data_ptr() % 16 and torch.equal(qcuda.linear(qw, xs), y)  # copied, aligned
    for var in ("MLXR_Q4TC", "MLXR_DECODE_FUSED"):
        monkeypatch.setenv(var, "0" if var == "MLXR_Q4TC" else "1")
        assert not qcuda.q4tc_preferred(qw)
        monkeypatch.delenv(var)
    square = QuantWeight.from_tensors(w[:512], s[:512], b[:512], spec, device="cpu")
    assert not qcuda.q4tc_preferred(square)
    fp16 = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.float16, device="cpu")
    assert not qcuda.q4tc_preferred(fp16)  # bf16 scales, fp16 activations: q4gemv


def test_several_rows_take_q4tc(monkeypatch):
    """2-16 rows (2-8 for group 32) of a tall weight with q4tc's copy run decode_gemv_tc, in
    launches of 8 (4) rows; 2-8 (2-4) rows of a 4096-row one; more rows, or
    MLXR_Q4TC_ROWS=0, take the other paths. With both one-row
    copies (the batching engine adds `tc` to a q4gemv weight), one row keeps q4gemv."""
    from mlxr.ops.matmul import decode_gemv_q4, decode_gemv_tc

    g = torch.Generator().manual_seed(21)
    n, k = 32, 1024
    for group, most in ((64, 16), (32, 8)):
        w, s, b, qw = _q4_weight(g, n, k, group)
        qw.tc, qw.q4_sb = qcopies.q4tc_pack(w, s, b)
        monkeypatch.setattr(qw, "out_features", 4112)  # counts as tall (N > 4096)
        launches = []
        real = decode_gemv_tc._q4tc_kernel
        monkeypatch.setattr(decode_gemv_tc, "_q4tc_kernel", type(
            "Count", (), {"__getitem__": lambda self, grid: launches.append(1) or real[grid]})())
        x = torch.randn(most + 1, k, generator=g).to(torch.bfloat16)
        want = x.float() @ ref_dequantize(w, s.float(), b.float(), qw.spec,
                                          dtype=torch.float32).t()
        for m in (2, 5, most):
            launches.clear()
            y = qcuda.linear(qw, x[:m])
            assert y.shape == (m, n) and len(launches) == -(-m // decode_gemv_tc.max_rows(group))
            assert ((y.float() - want[:m]).abs() <= 2.0 ** -7 * want[:m].abs() + 1e-3).all()
        launches.clear()
        qcuda.linear(qw, x)  # 17 (9) rows: the prefill paths
        assert not qcuda.q4tc_rows(qw, most + 1)
        monkeypatch.setattr(qw, "out_features", 4096)  # not tall: one launch only
        assert qcuda.q4tc_rows(qw, most // 2) and not qcuda.q4tc_rows(qw, most // 2 + 1)
        monkeypatch.setenv("MLXR_Q4TC_ROWS", "0")
        qcuda.linear(qw, x[:2])
        assert launches == []
        monkeypatch.delenv("MLXR_Q4TC_ROWS")
        monkeypatch.undo()
    qw.q4 = decode_gemv_q4.repack(w)
    calls = []
    monkeypatch.setattr(decode_gemv_q4, "q4gemv",
                        lambda x, *a, **kw: calls.append("q4gemv") or torch.zeros(n))
    qcuda.linear(qw, x[:1])
    assert calls == ["q4gemv"]


def test_glu_copy_serves_gated_and_linear(monkeypatch):
    """A gate_up weight's glu copy (rows interleaved, `from_tensors(glu=True)` on CUDA):
    `gated` gives act(gate) * up in one launch, equal to the plain copy's `linear` followed by
    `gated_act` (same sums, same roundings), for one row and several; `linear` on it gives the
    plain copy's result (rows back in [gate | up] order). Where q4tc does not serve the rows
    (prefill, MLXR_Q4GEMV=0) or the copy is plain, `gated` declines."""
    from mlxr.ops.matmul import decode_gemv_tc
    from mlxr.ops.layer.norm_rope_act import gated_act

    g = torch.Generator().manual_seed(31)
    n, k, group = 64, 1024, 64
    w, s, b, plain = _q4_weight(g, n, k, group)
    plain.tc, plain.q4_sb = qcopies.q4tc_pack(w, s, b)
    _, _, _, qw = _q4_weight(torch.Generator().manual_seed(31), n, k, group)
    qw.tc, qw.q4_sb = qcopies.q4tc_pack(w, s, b, glu=True)
    qw.tc_glu = True
    assert not torch.equal(qw.tc, plain.tc)
    launches = _spy(monkeypatch, decode_gemv_tc, "q4tc", lambda a, kw: kw.get("act"))
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    for m in (1, 5):
        gate, up = qcuda.linear(plain, x[:m]).chunk(2, dim=-1)
        launches.clear()
        y = qcuda.gated(qw, x[:m], "silu")
        assert launches == ["silu"] and y.shape == (m, n // 2)
        assert torch.equal(y, gated_act(gate, up, "silu"))
        assert torch.equal(qcuda.linear(qw, x[:m]), torch.cat([gate, up], -1))
    assert qcuda.gated(qw, torch.randn(40, k).to(torch.bfloat16), "silu") is None  # prefill
    monkeypatch.setenv("MLXR_Q4GEMV", "0")
    assert qcuda.gated(qw, x[:1], "silu") is None
    monkeypatch.delenv("MLXR_Q4GEMV")
    assert qcuda.gated(plain, x[:1], "silu") is None
    with pytest.raises(ValueError, match="glu"):
        qcopies.q4tc_pack(w, s, b, plain.q4_sb, glu=True)


def _affine_words(g, n, k, bits, group):
    """Random MLX words of a b-bit weight with bf16 scales and biases drawn from g, and its
    spec."""
    w = torch.randint(-(2**31), 2**31, (n, k * bits // 32), generator=g,
                      dtype=torch.int64).to(torch.int32)
    s = (torch.rand(n, k // group, generator=g) * 0.04 / 2**bits + 1e-4).to(torch.bfloat16)
    b = (torch.randn(n, k // group, generator=g) * 0.05).to(torch.bfloat16)
    return w, s, b, QuantSpec("affine", bits, group)


def _cuda_layout(w, s, b, spec):
    """A bf16 QuantWeight as CUDA holds it after load (the MLX words as shipped, none of the
    CPU's copies), built on the CPU; its decode copies are the caller's."""
    qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.bfloat16, device="cpu")
    qw.packed, qw.codes, qw.i4, qw.i4_sz = w, None, None, None
    return qw


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_other_widths_decode_through_planes(bits, monkeypatch):
    """A 2/3/5/6/8-bit weight's decode copy (`planes_pack`, what the CUDA load builds): 1-8
    rows take q4tc over its nibble planes, within rounding of fp64 over mlx's dequantization;
    a glu copy gives act(gate) * up as the plain linear + `gated_act` does; 2/3-bit single
    rows leave decode_gemv; MLXR_PLANES=0 builds no copy, and an overflowing plane scale
    none either (the Triton GEMVs keep the weight)."""
    from mlxr.ops.matmul import decode_gemv_tc
    from mlxr.ops.layer.norm_rope_act import gated_act
    from mlxr.quant.dequant import dequantize as ref_dequantize

    g = torch.Generator().manual_seed(bits)
    n, k, group = 64, 1024, 64
    w, s, b, spec = _affine_words(g, n, k, bits, group)

    def weight():
        return _cuda_layout(w, s, b, spec)

    qw, glu = weight(), weight()
    assert qcuda.planes_supported(qw)
    qw.tc, qw.q4_sb, qw.planes = qcopies.planes_pack(qw, chunk_rows=32)
    glu.tc, glu.q4_sb, glu.planes = qcopies.planes_pack(glu, glu=True)
    glu.tc_glu = True
    assert qw.planes == (2 if bits > 4 else 1)
    assert not qcuda.gemv_v2_default(qw, 1)
    launches = _spy(monkeypatch, decode_gemv_tc, "q4tc", lambda a, kw: kw["planes"])
    x = torch.randn(4, k, generator=g).to(torch.bfloat16)
    wd = ref_dequantize(w, s.float(), b.float(), spec, dtype=torch.float64)
    for m in (1, 4):
        launches.clear()
        y = qcuda.linear(qw, x[:m])
        assert launches == [qw.planes] and y.shape == (m, n)
        exact, scale = x[:m].double() @ wd.t(), x[:m].double().abs() @ wd.abs().t()
        err = (y.double() - exact).abs()
        assert bool((err <= 2**-7 * exact.abs() + 1e-5 * scale).all())
        gate, up = y.chunk(2, dim=-1)
        assert torch.equal(qcuda.gated(glu, x[:m], "silu"), gated_act(gate, up, "silu"))
    monkeypatch.setenv("MLXR_PLANES", "0")
    assert not qcuda.planes_supported(weight())
    monkeypatch.delenv("MLXR_PLANES")
    if bits > 4:  # 2^(b-4) x a huge fp16 scale overflows
        big = QuantWeight.from_tensors(w, torch.full_like(s, 60000.0, dtype=torch.float16),
                                       b.half(), spec, compute_dtype=torch.float16, device="cpu")
        big.packed = w
        assert qcuda.planes_supported(big) and qcopies.planes_pack(big) is None


def _routes_to_q4tc(monkeypatch, qw, glu, wd, x, flag):
    """1 and all of x's rows through `linear` take one q4tc launch with `flag` (fp4 / fp8)
    set, within rounding of fp64 x @ wd^T; the glu copy's act epilogue is linear +
    `gated_act`."""
    from mlxr.ops.matmul import decode_gemv_tc
    from mlxr.ops.layer.norm_rope_act import gated_act

    launches = _spy(monkeypatch, decode_gemv_tc, "q4tc", lambda a, kw: kw[flag])
    for m in (1, x.shape[0]):
        launches.clear()
        y = qcuda.linear(qw, x[:m])
        assert launches == [True] and y.shape == (m, qw.out_features)
        exact, scale = x[:m].double() @ wd.t(), x[:m].double().abs() @ wd.abs().t()
        assert bool(((y.double() - exact).abs() <= 2**-7 * exact.abs() + 1e-5 * scale).all())
        gate, up = y.chunk(2, dim=-1)
        assert torch.equal(qcuda.gated(glu, x[:m], "silu"), gated_act(gate, up, "silu"))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "nvfp4-nogs"])
def test_fp4_decodes_through_its_fp4_copy(mode, monkeypatch):
    """An mxfp4 / nvfp4 weight's fp4 copy (`fp4_tc_pack`, what the CUDA load builds by
    default): 1 and the most rows one launch takes go to q4tc with fp4=True, within rounding
    of fp64 over mlx's dequantization (nvfp4: with its global scale); a glu copy's act
    epilogue is linear + `gated_act`; the copy's bytes are `decode_copy_bytes` (the file's
    codes and a 4-byte pair per group); MLXR_FP4_TC=0 builds none, nor does a NaN scale
    (E8M0 255, E4M3 0x7F)."""
    from mlxr.ops.matmul import decode_gemv_tc
    from mlxr.quant.fp import fp_dequantize

    g = torch.Generator().manual_seed(14)
    n, k = 64, 1024
    fmt = mode.split("-")[0]
    group = 32 if fmt == "mxfp4" else 16
    w = torch.randint(-(2**31), 2**31, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    lo, hi = (115, 125) if fmt == "mxfp4" else (1, 0x60)
    sc = torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.uint8)
    gsc = torch.tensor(3.5) if mode == "nvfp4" else None
    spec = QuantSpec(fmt, 4, group, global_scale=gsc is not None)

    def weight(scales=sc):
        qw = QuantWeight.from_tensors(w, scales, None, spec, global_scale=gsc, device="cpu")
        qw.packed, qw.codes, qw.i4, qw.planes = w, None, None, 1  # as CUDA keeps it
        return qw

    qw, glu = weight(), weight()
    assert qcuda.fp4_tc_supported(qw)
    qw.tc, qw.q4_sb, qw.tc_gs = qcopies.fp4_tc_pack(qw, chunk_rows=32)
    glu.tc, glu.q4_sb, glu.tc_gs = qcopies.fp4_tc_pack(glu, glu=True)
    glu.tc_glu = True
    assert qw.tc_fp4 and glu.tc_fp4 and (qw.tc_gs is None) == (gsc is None)
    assert qcopies.decode_copy_bytes(spec, n, k) == qw.tc.nbytes + qw.q4_sb.nbytes
    wd = fp_dequantize(w, sc, fmt, global_scale=gsc, out_dtype=torch.float32).double()
    most = decode_gemv_tc.max_rows(group)
    x = torch.randn(most, k, generator=g).to(torch.bfloat16)
    _routes_to_q4tc(monkeypatch, qw, glu, wd, x, "fp4")
    monkeypatch.setenv("MLXR_FP4_TC", "0")
    assert not qcuda.fp4_tc_supported(weight())
    monkeypatch.delenv("MLXR_FP4_TC")
    nan = sc.clone()
    nan[3, 5] = 255 if fmt == "mxfp4" else 0x7F
    assert qcopies.fp4_tc_pack(weight(nan)) is None
    # the words dropped (MLXR_WORDS=drop): decode on the copy, prefill by `dequant_copy`
    # from it, the same results and codes as with the words
    dropped = weight()
    dropped.tc, dropped.q4_sb, dropped.tc_gs = qcopies.fp4_tc_pack(dropped)
    _dropped_matches_kept(dropped, qw, w.nbytes, x, g)


def _dropped_matches_kept(dropped, qw, nbytes: int, x, g) -> None:
    """A weight whose words are dropped for its copy frees their bytes, and decodes (x's first
    row) and prefills (20 fresh rows, by `dequant_copy`) as `qw` with its words does, with the
    same codes."""
    assert dropped.drop_words() == nbytes and dropped.words_dropped
    x20 = torch.randn(20, x.shape[1], generator=g).to(torch.bfloat16)
    for xs in (x[:1], x20):
        assert torch.equal(qcuda.linear(dropped, xs), qcuda.linear(qw, xs))
    n = qw.out_features
    assert torch.equal(dropped.row_codes(slice(0, n)), qw.row_codes(slice(0, n)))


def test_fp8_decodes_through_its_fp8_copy(monkeypatch):
    """An mxfp8 weight's fp8 copy (`fp8_tc_pack`): 1 and 4 rows go to q4tc with fp8=True,
    within rounding of fp64 over mlx's dequantization; a glu copy's act epilogue is linear +
    `gated_act`; the copy's bytes are `decode_copy_bytes` (1 B per code, a pair per group);
    MLXR_FP8_TC=0 builds none, nor does a NaN code (0x7F / 0xFF: the copy could not hold it)
    or a NaN scale; with the words dropped, decode and prefill (`dequant_copy` from the copy)
    give the same results and codes."""
    from mlxr.quant.fp import fp_dequantize

    g = torch.Generator().manual_seed(15)
    n, k = 64, 1024
    codes = torch.randint(0, 254, (n, k), generator=g, dtype=torch.int32)
    codes = (codes + (codes >= 0x7F).int()).to(torch.uint8)  # every code but 0x7F, 0xFF
    w = codes.view(torch.int32)  # MLX mxfp8 words: code k at byte k % 4 of word k // 4
    sc = torch.randint(115, 125, (n, k // 32), generator=g, dtype=torch.uint8)
    spec = QuantSpec("mxfp8", 8, 32)

    def weight(words=w, scales=sc):
        qw = QuantWeight.from_tensors(words, scales, None, spec, device="cpu")
        qw.packed, qw.codes, qw.dense = words, None, None  # as CUDA keeps it
        return qw

    qw, glu = weight(), weight()
    assert qcuda.fp8_tc_supported(qw)
    qw.tc, qw.q4_sb = qcopies.fp8_tc_pack(qw, chunk_rows=32)
    glu.tc, glu.q4_sb = qcopies.fp8_tc_pack(glu, glu=True)
    glu.tc_glu = True
    assert qw.tc_fp8 and not qw.tc_fp4 and glu.tc_fp8
    assert qcopies.decode_copy_bytes(spec, n, k) == qw.tc.nbytes + qw.q4_sb.nbytes
    wd = fp_dequantize(w, sc, "mxfp8", out_dtype=torch.float32).double()
    x = torch.randn(4, k, generator=g).to(torch.bfloat16)
    _routes_to_q4tc(monkeypatch, qw, glu, wd, x, "fp8")
    monkeypatch.setenv("MLXR_FP8_TC", "0")
    assert not qcuda.fp8_tc_supported(weight()) and qcopies.decode_copy_bytes(spec, n, k) == 0
    monkeypatch.delenv("MLXR_FP8_TC")
    for bad in (0x7F, 0xFF):
        nan = codes.clone()
        nan[3, 5] = bad
        assert qcopies.fp8_tc_pack(weight(nan.view(torch.int32))) is None
    nan = sc.clone()
    nan[1, 2] = 255
    assert qcopies.fp8_tc_pack(weight(scales=nan)) is None
    dropped = weight()
    dropped.tc, dropped.q4_sb = qcopies.fp8_tc_pack(dropped)
    _dropped_matches_kept(dropped, qw, w.nbytes, x, g)


def test_fp_words_go_as_affine_words_go(monkeypatch):
    """The loader drops an mxfp4 / nvfp4 / mxfp8 weight's words for its copy as it drops affine
    words: always under MLXR_WORDS=drop, under memory pressure with auto (the default); keep
    keeps the words and skips the copy."""
    from types import SimpleNamespace

    from mlxr.models import loader
    from mlxr.models.loader import RawQuant, _Builder

    asked = []
    monkeypatch.setattr(loader.QuantWeight, "from_tensors",
                        lambda *a, **kw: asked.append((kw["decode_copies"], kw["keep_words"]))
                        or SimpleNamespace(words_dropped=not kw["keep_words"]))
    for spec in (QuantSpec("nvfp4", 4, 16), QuantSpec("mxfp8", 8, 32)):
        raw = RawQuant(torch.zeros(64, 1024 * spec.bits // 32, dtype=torch.int32),
                       torch.zeros(64, 1024 // spec.group_size, dtype=torch.uint8), None, spec,
                       None)
        for words, budget, want in [("drop", 10**9, (True, False)), ("auto", 10, (True, False)),
                                    ("auto", 10**9, (True, True)), ("keep", 10, (False, True))]:
            monkeypatch.setenv("MLXR_WORDS", words)
            b = _Builder(None, None, torch.bfloat16, "cuda", dry_run=True)
            b.dry_run, b.copy_budget = False, budget  # 10: short
            b.quant(raw)
            assert asked[-1] == want, (spec.mode, words, budget)


def test_decode_copy_bytes_and_the_loaders_budget(monkeypatch):
    """`decode_copy_bytes` is what the copies take (4-bit q4tc, 3-bit and 8-bit planes); the
    loader builds copies while they fit its GPU budget, and loads the rest without (matmul
    weights only: a gathered embedding costs nothing)."""
    from mlxr.models import loader
    from mlxr.models.loader import RawQuant, _Builder

    g = torch.Generator().manual_seed(5)
    w, s, b, qw = _q4_weight(g, 64, 1024, 64)
    tc, sb = qcopies.q4tc_pack(w, s, b)
    assert qcopies.decode_copy_bytes(qw.spec, 64, 1024) == tc.nbytes + sb.nbytes
    for bits in (3, 8):
        pw = torch.randint(-(2**31), 2**31, (64, 1024 * bits // 32), generator=g,
                           dtype=torch.int64).to(torch.int32)
        spec = QuantSpec("affine", bits, 64)
        q = QuantWeight.from_tensors(pw, s, b, spec, device="cpu")
        q.packed = pw
        words, pairs, _ = qcopies.planes_pack(q)
        assert qcopies.decode_copy_bytes(spec, 64, 1024) == words.nbytes + pairs.nbytes
    fp4 = QuantSpec("mxfp4", 4, 32)
    assert qcopies.decode_copy_bytes(fp4, 64, 1024) == 64 * 1024 // 2 + 64 * 32 * 4
    monkeypatch.setenv("MLXR_FP4_TC", "0")
    assert qcopies.decode_copy_bytes(fp4, 64, 1024) == 0
    monkeypatch.delenv("MLXR_FP4_TC")
    monkeypatch.setenv("MLXR_PLANES", "0")  # no planes: an 8-bit weight gets no copy
    assert qcopies.decode_copy_bytes(QuantSpec("affine", 8, 64), 64, 1024) == 0
    assert qcopies.decode_copy_bytes(qw.spec, 64, 1024) == tc.nbytes + sb.nbytes
    monkeypatch.delenv("MLXR_PLANES")
    asked = []

    def built(*a, **kw):  # what from_tensors was asked for; the words go where it may drop
        asked.append((kw["decode_copies"], kw["keep_words"]))
        return SimpleNamespace(packed=a[0] if kw["keep_words"] else None, tc=1,
                               words_dropped=not kw["keep_words"])

    monkeypatch.setattr(loader.QuantWeight, "from_tensors", built)
    need = qcopies.decode_copy_bytes(qw.spec, 64, 1024)
    raw = RawQuant(w, s, b, qw.spec, None)
    yes, no = (True, True), (True, False)  # copies with the words, copies instead of them
    for words, want, left in [("keep", [yes, yes, (False, True), yes], 1),
                              ("auto", [yes, yes, no, no, yes], 1 - 2 * (need - w.nbytes)),
                              ("drop", [no, yes, yes], 1 + w.nbytes)]:
        monkeypatch.setenv("MLXR_WORDS", words)
        builder = _Builder(None, None, torch.bfloat16, "cuda", dry_run=True)
        builder.dry_run, builder.copy_budget = False, 2 * need + 1
        asked.clear()
        for _ in range(len(want) - 1 - (words == "drop")):
            builder.quant(raw)
        if words == "drop":
            builder.quant(raw, gathered=True)  # a tied embedding keeps its words
        builder.quant(raw, matmul=False)
        assert asked == want, words
        assert builder.copy_budget == left, words
        assert builder.copies_skipped == (words == "keep")
        assert builder.words_dropped == sum(not k for _, k in want)
    monkeypatch.setenv("MLXR_WORDS", "sometimes")
    with pytest.raises(ValueError, match="MLXR_WORDS"):
        _Builder(None, None, torch.bfloat16, "cpu", dry_run=True)


@pytest.mark.parametrize("bits,glu", [(4, False), (4, True), (8, False), (3, True)])
def test_dropped_words_serve_from_the_copy(bits, glu, monkeypatch):
    """A weight whose MLX words were dropped (`drop_words`, the loader under memory pressure
    or MLXR_WORDS=drop) gives the same results as with them: 1-4 rows by q4tc on the copy,
    17+ rows by `dequant_copy` + the matmul (never the fused GEMM, which reads the words),
    its codes and dequantization from the copy."""
    from mlxr.ops.matmul import prefill_dequant

    g = torch.Generator().manual_seed(20 + bits)
    n, k, group = 64, 1024, 64
    w, s, b, spec = _affine_words(g, n, k, bits, group)

    def weight():
        qw = _cuda_layout(w, s, b, spec)
        if bits == 4:
            qw.tc, qw.q4_sb = qcopies.q4tc_pack(w, s, b, glu=glu)
        else:
            qw.tc, qw.q4_sb, qw.planes = qcopies.planes_pack(qw, glu=glu)
        qw.tc_glu = glu
        return qw

    kept, dropped = weight(), weight()
    assert dropped.drop_words() == w.nbytes and dropped.packed is None
    assert dropped.drop_words() == 0
    calls = _spy(monkeypatch, prefill_dequant, "dequant_copy", lambda a, kw: a[3])
    monkeypatch.setenv("MLXR_PREFILL_GEMM", "fused")
    x = torch.randn(20, k, generator=g).to(torch.bfloat16)
    for m in (1, 4):
        assert torch.equal(qcuda.linear(dropped, x[:m]), qcuda.linear(kept, x[:m]))
    one = qcuda.linear(dropped, x[:1])
    monkeypatch.setenv("MLXR_Q4GEMV", "0")  # an A/B switch: the copy still serves one row
    assert torch.equal(qcuda.linear(dropped, x[:1]), one)
    monkeypatch.delenv("MLXR_Q4GEMV")
    assert calls == []
    monkeypatch.setenv("MLXR_PREFILL_GEMM", "dequant")
    want = qcuda.linear(kept, x)
    monkeypatch.setenv("MLXR_PREFILL_GEMM", "fused")
    assert torch.equal(qcuda.linear(dropped, x), want) and calls == [bits]
    assert torch.equal(dropped.dequantize(torch.float32), kept.dequantize(torch.float32))
    rows = torch.tensor([n - 1, 0, 9, n // 2 + 3, 9])
    assert torch.equal(dropped.row_codes(rows), kept.row_codes(rows))


def test_gated_falls_back_off_the_glu_copy():
    """`Linear.gated` on a CPU weight (no glu copy): `ops.gated_act` over the output halves;
    `from_tensors(glu=True)` builds no copy off CUDA."""
    from mlxr import ops
    from mlxr.layers import Linear

    g = torch.Generator().manual_seed(32)
    w, s, b, _ = _q4_weight(g, 64, 512, 64)
    qw = QuantWeight.from_tensors(w, s, b, QuantSpec("affine", 4, 64), device="cpu", glu=True)
    assert not qw.tc_glu and qw.gated(torch.randn(2, 512), "silu") is None
    lin = Linear(qw)
    x = torch.randn(3, 512).to(torch.bfloat16)
    gate, up = lin(x).chunk(2, dim=-1)
    assert torch.equal(lin.gated(x, "gelu"), ops.gated_act(gate, up, "gelu"))


def test_batch_copy_is_built_on_demand(monkeypatch):
    """The several-row copies are not built with q4gemv's at load; add_batch_copy builds them
    once, for matmul weights on CUDA only, and reports their bytes: q4tc's repack where
    decode_gemv_tc serves the weight (keeping q4gemv's pairs), plus tinygemm's where
    `tinygemm_rows`; tinygemm's alone where q4tc cannot serve it or MLXR_Q4TC_ROWS=0."""
    g = torch.Generator().manual_seed(8)
    n, k, group = 16, 1024, 64
    w, s, b, qw = _q4_weight(g, n, k, group)  # the CUDA layout after load
    calls = []

    def fake_pack(packed, scales, biases):
        calls.append(packed.shape)
        return torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(k // group, n, 2)

    i4_bytes = n * k // 2 + (k // group) * n * 2 * 4
    monkeypatch.setattr(qcuda, "tinygemm_supported", lambda qw: True)
    monkeypatch.setattr(qcopies, "tinygemm_pack", fake_pack)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert qw.add_batch_copy() == 0 and qw.tc is None and qw.i4 is None  # not a CUDA weight
    monkeypatch.setattr(qw, "device", torch.device("cuda"))
    qw.q4_sb = sb = torch.zeros(n, k // group, 2, dtype=torch.bfloat16)  # q4gemv's pairs
    assert qcuda.q4tc_supported(qw) and qcuda.tinygemm_rows(qw)  # a small squarish weight
    assert qw.add_batch_copy() == n * k // 2 + i4_bytes and qw.q4_sb is sb
    assert torch.equal(qw.tc, qcopies.q4tc_pack(w, s, b)[0]) and calls == [(n, k // 8)]
    assert qw.add_batch_copy() == 0 and len(calls) == 1  # once
    qw.tc = qw.q4_sb = qw.i4 = None
    monkeypatch.setattr(qcuda, "tinygemm_rows", lambda qw: False)  # a tall one: q4tc only
    assert qw.add_batch_copy() == n * k // 2 + n * (k // group) * 4  # the pairs too
    assert qw.i4 is None
    qw.tc = qw.q4_sb = None
    monkeypatch.setenv("MLXR_Q4TC_ROWS", "0")
    assert qw.add_batch_copy() == i4_bytes and qw.tc is None and qw.i4 is not None
    qw.i4, qw.matmul = None, False  # a gather-only embedding never gets one
    assert qw.add_batch_copy() == 0


def test_batching_engine_asks_for_batch_copies(monkeypatch):
    """LLMEngine builds every weight's batch copy before it sizes the KV pool; a single request
    (mlxr.load + generate) never does."""
    import mlxr
    from mlxr.cli.common import BUNDLED
    from mlxr.engine import LLMEngine, engine as engine_mod

    model = mlxr.load(BUNDLED / "stories260K", device="cpu", dtype="float32")
    order = []

    class Fake:
        def add_batch_copy(self):
            order.append("copy")
            return 0

    real_kv = engine_mod.free_memory_blocks  # the pool sized from the free memory
    monkeypatch.setattr(model.decoder, "quant_weights", lambda: [Fake(), Fake()])
    monkeypatch.setattr(engine_mod, "free_memory_blocks",
                        lambda *a, **kw: order.append("kv") or real_kv(*a, **kw))
    list(model.generate([1, 2, 3], max_tokens=2))
    assert order == []
    LLMEngine(model, max_num_seqs=2)
    assert order == ["copy", "copy", "kv"]


def test_quant_weights_lists_each_weight_once():
    from test_fused_decode import quantized_decoder

    for kind in ("llama", "qwen3"):  # qwen3's head is the (tied) embedding's weight
        dec = quantized_decoder(kind, torch.bfloat16)
        qws = dec.quant_weights()
        assert len(qws) == len({id(q) for q in qws}) == 4 * len(dec.layers) + 1
        assert dec.head.weight in qws and dec.layers[0].gate_up.weight in qws


def test_batch_rows_route_between_tinygemm_and_the_fused_gemm(monkeypatch):
    """With tinygemm's copy (the batching engine), a weight under the fused GEMM's rule keeps
    2-7 rows on tinygemm and sends 8-32 to the fused GEMM; without the copy (a single
    request) 2+ rows go to the fused GEMM. The kernels are stand-ins: only the route is
    checked here (the kernels have their own tests)."""
    from mlxr.ops.matmul import prefill_gemm

    g = torch.Generator().manual_seed(5)
    n, k, group = 32, 1024, 64
    w, s, b, qw = _q4_weight(g, n, k, group)
    qw.i4, qw.i4_sz = torch.zeros(1), torch.zeros(1)  # a tinygemm copy (never read here)
    calls = []
    monkeypatch.setattr(torch, "_weight_int4pack_mm",
                        lambda x, *a: calls.append("tinygemm") or torch.zeros(x.shape[0], n))
    monkeypatch.setattr(prefill_gemm, "qgemm",
                        lambda x, *a, **kw: calls.append("fused") or torch.zeros(x.shape[0], n))
    monkeypatch.setattr(qcuda, "FUSED_MIN_DIM", 32)  # this small weight counts as large
    monkeypatch.delenv("MLXR_PREFILL_GEMM", raising=False)
    for m, want in ((2, "tinygemm"), (7, "tinygemm"), (8, "fused"), (32, "fused")):
        calls.clear()
        qcuda.linear(qw, torch.zeros(m, k, dtype=torch.bfloat16))
        assert calls == [want], m
    qw.i4 = qw.i4_sz = None
    qw.q4 = torch.zeros(1)  # q4gemv's repack: a single request
    calls.clear()
    qcuda.linear(qw, torch.zeros(2, k, dtype=torch.bfloat16))
    assert calls == ["fused"]


def test_build_picks_each_formats_decode_copy():
    """`cuda.build_copies` (what a CUDA load runs on each matmul weight, here on CPU-held
    tensors): affine 4-bit gets q4tc's copy where preferred (a tall weight), else q4gemv's,
    and q4tc's wherever the words are to go; mxfp4 / mxfp8 their fp copies; 3-bit its nibble
    planes; a gathered-only weight nothing."""
    g = torch.Generator().manual_seed(21)

    def fresh(spec, n, k):
        w = torch.randint(-(2**31), 2**31, (n, k * spec.bits // 32), generator=g,
                          dtype=torch.int64).to(torch.int32)
        if spec.mode == "mxfp8":  # no NaN bytes: they get no copy
            b = w.view(torch.uint8)
            b[(b & 0x7F) == 0x7F] -= 1
        if spec.mode == "affine":
            s = (torch.randn(n, k // spec.group_size, generator=g) * 0.02).to(torch.bfloat16)
            b = (torch.randn(n, k // spec.group_size, generator=g) * 0.1).to(torch.bfloat16)
        else:
            s = torch.randint(115, 125, (n, k // spec.group_size), generator=g,
                              dtype=torch.uint8)
            b = None
        qw = QuantWeight.from_tensors(w, s, b, spec, compute_dtype=torch.bfloat16,
                                      device="cpu")
        qw.packed, qw.codes, qw.i4, qw.i4_sz, qw.dense, qw.planes = w, None, None, None, None, 1
        return qw

    tall, square = (8192, 1024), (1024, 1024)
    qw = fresh(QuantSpec("affine", 4, 64), *tall)
    qcuda.build_copies(qw, True, True)
    assert qw.tc is not None and qw.tc_glu and qw.q4 is None
    qw = fresh(QuantSpec("affine", 4, 64), *square)
    qcuda.build_copies(qw, False, True)
    assert qw.q4 is not None and qw.tc is None
    qw = fresh(QuantSpec("affine", 4, 64), *square)
    qcuda.build_copies(qw, False, False)
    assert qw.tc is not None and qw.q4 is None
    for spec, check in [(QuantSpec("mxfp4", 4, 32), lambda q: q.tc_fp4),
                        (QuantSpec("mxfp8", 8, 32), lambda q: q.tc_fp8),
                        (QuantSpec("affine", 3, 64), lambda q: q.tc.shape == (64, 2048))]:
        qw = fresh(spec, *square)
        qcuda.build_copies(qw, False, True)
        assert qw.tc is not None and check(qw), spec
    qw = fresh(QuantSpec("affine", 4, 64), *square)
    qw.matmul = False
    qcuda.build_copies(qw, False, True)
    assert qw.tc is None and qw.q4 is None
