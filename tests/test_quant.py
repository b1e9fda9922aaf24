"""mlxr.quant: bit-exact reference dequantizers vs mlx, and QuantWeight CPU matmul/embedding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlxr.config import QuantSpec
from mlxr.errors import ModelFormatError
from mlxr.quant import QuantWeight, dequantize, unpack_codes
from mlxr.quant import cpu as qcpu

mx = pytest.importorskip("mlx.core")

_TO_MX = {torch.bfloat16: mx.bfloat16, torch.float16: mx.float16, torch.float32: mx.float32}


def t(a) -> torch.Tensor:
    """mlx array -> torch tensor with identical bits (uint32 -> int32 view)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a))


def m(x: torch.Tensor):
    """torch tensor -> mlx array with identical bits."""
    if x.dtype == torch.bfloat16:
        return mx.array(x.view(torch.int16).numpy()).view(mx.bfloat16)
    if x.dtype == torch.int32:
        return mx.array(x.numpy().view(np.uint32))
    return mx.array(x.numpy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(iv), b.view(iv))


def mx_quantize(shape, seed, bits, group, dtype=mx.bfloat16, mode="affine", std=0.05):
    mx.random.seed(seed)
    w = (mx.random.normal(shape) * std).astype(dtype)
    r = mx.quantize(w, group, bits, mode=mode)
    return r[0], r[1], (r[2] if mode == "affine" else None)


def pack_stream(codes: list[int], bits: int) -> list[int]:
    """Independent packer: LSB-first bit stream of one row -> uint32 words (as Python ints)."""
    acc = sum(c << (i * bits) for i, c in enumerate(codes))
    n_words = len(codes) * bits // 32
    return [(acc >> (32 * k)) & 0xFFFFFFFF for k in range(n_words)]


def words_tensor(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(np.array(rows, dtype=np.uint32).view(np.int32))


# ---------------------------------------------------------------------------- unpack_codes

WORKED = [  # docs/mlx-formats.md §3.2 table: (bits, first codes, first word)
    (2, [0, 1, 2, 3, 0, 1, 2, 3], 0xE4E4E4E4),
    (3, [0, 1, 2, 3, 4, 5, 6, 7], 0x88FAC688),
    (4, [0, 1, 2, 3, 4, 5, 6, 7], 0x76543210),
    (5, [0, 1, 2, 3, 4, 5, 6, 7], 0x8A418820),
    (6, [1, 2, 3, 4, 5, 6, 7, 8], 0x85103081),
    (8, [1, 2, 3, 4], 0x04030201),
]


@pytest.mark.parametrize("bits,codes,word", WORKED)
def test_unpack_worked_examples(bits, codes, word):
    row = (codes * 32)[:32]  # repeat the pattern over one 32-element row
    if bits == 2:  # pattern 0..3 repeats: word must be e4e4e4e4 everywhere
        row = [i % 4 for i in range(32)]
    words = pack_stream(row, bits)
    assert words[0] == word
    got = unpack_codes(words_tensor([words]), bits, 32)
    assert got.dtype == torch.uint8
    assert got[0].tolist() == row


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpack_random_vs_independent_packer(bits):
    rng = np.random.default_rng(100 + bits)
    codes = rng.integers(0, 2**bits, size=(2, 3, 96)).tolist()
    words = [[pack_stream(r, bits) for r in e] for e in codes]
    w = torch.tensor(np.array(words, dtype=np.uint32).view(np.int32))
    assert unpack_codes(w, bits, 96).tolist() == codes
    assert unpack_codes(w.view(torch.uint32), bits, 96).tolist() == codes


def test_unpack_codes_match_mlx_quantize():
    # 5-bit codes recovered from mx.quantize output must reproduce mx.dequantize exactly.
    qw, s, b = mx_quantize((4, 128), 7, 5, 32, mx.float32)
    q = unpack_codes(t(qw), 5, 128).to(torch.float32)
    ref = t(mx.dequantize(qw, s, b, 32, 5))
    w = q.view(4, 4, 32) * t(s)[..., None] + t(b)[..., None]
    assert same_bits(w.view(4, 128), ref)


# ---------------------------------------------------------------------------- affine dequantize


@pytest.mark.parametrize("sdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_affine_dequant_bit_exact(bits, group, sdtype):
    seed = bits * 1000 + group * 10 + [torch.bfloat16, torch.float16, torch.float32].index(sdtype)
    shape = (3, 16, 256) if seed % 2 else (24, 384)  # 3-D (experts) and 2-D
    qw, s, b = mx_quantize(shape, seed, bits, group, _TO_MX[sdtype])
    spec = QuantSpec("affine", bits, group)
    ref = t(mx.dequantize(qw, s, b, group, bits))
    out = dequantize(t(qw), t(s), t(b), spec)
    assert out.dtype == sdtype and same_bits(out, ref)
    # float32 exact mode: scales/biases cast to fp32
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    ref32 = t(mx.dequantize(qw, s32, b32, group, bits))
    assert same_bits(dequantize(t(qw), t(s32), t(b32), spec), ref32)
    # explicit output dtype: mlx rounds in the scale dtype, then casts
    refd = t(mx.dequantize(qw, s, b, group, bits, dtype=mx.float32))
    assert same_bits(dequantize(t(qw), t(s), t(b), spec, dtype=torch.float32), refd)


def test_affine_negative_scales_present():
    qw, s, b = mx_quantize((16, 256), 3, 4, 64)
    assert (t(s).float() < 0).any()  # the tests above do exercise negative scales


# ---------------------------------------------------------------------------- fp modes

FP = [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]


@pytest.mark.parametrize("mode,bits,group", FP)
def test_fp_dequant_bit_exact_quantized(mode, bits, group):
    qw, s, _ = mx_quantize((2, 16, 128), 11 + bits + group, bits, group, mode=mode)
    spec = QuantSpec(mode, bits, group)
    dts = [(mx.float32, torch.float32), (None, torch.bfloat16), (mx.float16, torch.float16)]
    for mdt, tdt in dts:
        ref = t(mx.dequantize(qw, s, mode=mode, dtype=mdt))
        out = dequantize(t(qw), t(s), None, spec, dtype=None if mdt is None else tdt)
        assert out.dtype == tdt and same_bits(out, ref), (mode, tdt)


@pytest.mark.parametrize("mode,bits,group", FP)
def test_fp_dequant_bit_exact_crafted(mode, bits, group):
    """Every code (incl. negative and -0) and every scale byte: E8M0 byte 0 (2^-127, an fp32
    subnormal), large exponents, E4M3 subnormal and negative scales. 0x7F/0xFF (E4M3 NaN) and
    E8M0 255 (inf) are left out: never produced by a quantizer and NaN bits are not unique."""
    rng = np.random.default_rng(5 + bits + group)
    rows, cols = 32, 256
    words = rng.integers(0, 2**32, size=(rows, cols * bits // 32), dtype=np.uint64)
    words = words.astype(np.uint32)
    if mode == "mxfp8":  # E4M3 element codes 0x7F/0xFF are NaN: checked separately below
        by = words.view(np.uint8)
        by[(by & 0x7F) == 0x7F] -= 1
    w = torch.tensor(words.view(np.int32))
    if mode == "nvfp4":
        pool = np.array([b for b in range(256) if b & 0x7F != 0x7F])
    else:
        pool = np.arange(0, 255)
    sc = rng.choice(pool, size=(rows, cols // group)).astype(np.uint8)
    sc[0, : min(len(pool), cols // group)] = pool[: cols // group]  # force small bytes, incl. 0
    sc[1, :8] = [0, 1, 2, 3, 4, 5, 6, 7]  # E8M0 tiny / E4M3 subnormals
    s = torch.from_numpy(sc)
    spec = QuantSpec(mode, bits, group)
    ref = t(mx.dequantize(m(w), m(s), mode=mode, dtype=mx.float32))
    out = dequantize(w, s, None, spec, dtype=torch.float32)
    assert same_bits(out, ref)
    assert (out < 0).any() and (out == 0).any()
    refb = t(mx.dequantize(m(w), m(s), mode=mode))
    assert same_bits(dequantize(w, s, None, spec), refb)


def test_e4m3_nan_codes():
    # 0x7F / 0xFF decode to NaN in mlx 0.32.4 (as element codes of mxfp8 and as nvfp4 scales)
    w = torch.tensor(np.full((1, 8), 0xFF7F7E01, dtype=np.uint32).view(np.int32))
    s = torch.full((1, 1), 127, dtype=torch.uint8)
    out = dequantize(w, s, None, QuantSpec("mxfp8", 8, 32), dtype=torch.float32)
    ref = t(mx.dequantize(m(w), m(s), mode="mxfp8", dtype=mx.float32))
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().sum() == 16
    assert torch.equal(out[~out.isnan()], ref[~ref.isnan()])
    s4 = torch.tensor([[0x7F, 0xFF, 0x7E, 0x01]], dtype=torch.uint8)
    w4 = torch.full((1, 8), 0x12345671, dtype=torch.int32)
    out = dequantize(w4, s4, None, QuantSpec("nvfp4", 4, 16), dtype=torch.float32)
    ref = t(mx.dequantize(m(w4), m(s4), mode="nvfp4", dtype=mx.float32))
    assert torch.equal(out.isnan(), ref.isnan()) and out[0, :32].isnan().all()
    assert torch.equal(out[0, 32:], ref[0, 32:])


def test_nvfp4_global_scale():
    mx.random.seed(21)
    w = mx.random.normal((3, 32, 128)) * 0.02
    spec = QuantSpec("nvfp4", 4, 16, global_scale=True)
    qs, ss, gs, refs = [], [], [], []
    for e in range(3):
        g = mx.max(mx.abs(w[e]))
        q, s = mx.quantize(w[e], mode="nvfp4", global_scale=g)[:2]
        ref = mx.dequantize(q, s, mode="nvfp4", global_scale=g, dtype=mx.float32)
        out = dequantize(t(q), t(s), None, spec, global_scale=t(g), dtype=torch.float32)
        assert same_bits(out, t(ref))
        qs.append(t(q)), ss.append(t(s)), gs.append(t(g).reshape(())), refs.append(t(ref))
    # per-expert global_scale [E] on a stacked 3-D weight (mlx CPU refuses gather_qmm here;
    # the formula value(code) * e4m3(scale) * g/2688 is checked per expert against mlx above)
    out3 = dequantize(torch.stack(qs), torch.stack(ss), None, spec,
                      global_scale=torch.stack(gs), dtype=torch.float32)
    assert same_bits(out3, torch.stack(refs))
    # and the global scale does matter
    plain = dequantize(qs[0], ss[0], None, QuantSpec("nvfp4", 4, 16), dtype=torch.float32)
    assert not torch.equal(plain, refs[0])


# ---------------------------------------------------------------------------- QuantWeight


def build(mode, bits, group, out_f, in_f, seed, cd, sdtype=mx.bfloat16):
    qw, s, b = mx_quantize((out_f, in_f), seed, bits, group, sdtype, mode=mode)
    spec = QuantSpec(mode, bits, group)
    tb = None if b is None else t(b)
    Q = QuantWeight.from_tensors(t(qw), t(s), tb, spec, compute_dtype=cd, name="layer.q_proj")
    if mode == "affine" and cd == torch.float32:
        W = dequantize(t(qw), t(s).float(), tb.float(), spec)  # exact mode = fp32 params
    else:
        W = dequantize(t(qw), t(s), tb, spec, dtype=torch.float32) if mode != "affine" else \
            dequantize(t(qw), t(s).float(), tb.float(), spec)  # fp32 value of the file weights
    return Q, W, (qw, s, b)


def bf16_tol(x: torch.Tensor, W: torch.Tensor, group: int) -> torch.Tensor:
    """Error bound for the bf16 fast path vs the fp32 product x @ W^T (x already bf16-exact).

    Each weight is rounded to bf16 (<= 2^-9 relative), and the int4 kernel also rounds its
    zero point b + 8s to bf16 (<= 2^-9 of that group's largest |w|), and the dequant may round
    twice: so |dw| <= 2^-8 * max|w| of its group. The output is rounded to bf16 (2^-9 of |y|),
    fp32 accumulation error is negligible at these sizes. Hence
    |dy| <= 2^-8 * (|x| @ gmax^T) + 2^-8 * |y|."""
    o, k = W.shape
    gmax = W.abs().view(o, k // group, group).amax(-1, keepdim=True).expand(o, k // group, group)
    return 2**-8 * (x.abs() @ gmax.reshape(o, k).T) + 2**-8 * (x @ W.T).abs() + 1e-30


CASES = [  # mode, bits, group, out, in
    ("affine", 4, 64, 192, 256),  # int4pack, N % 64 == 0 (layout decoded, no second copy)
    ("affine", 4, 32, 80, 128),  # int4pack, N % 64 != 0 (keeps packed copy)
    ("affine", 4, 128, 40, 256),  # N % 16 != 0: no int4pack
    ("affine", 2, 64, 64, 256),
    ("affine", 3, 32, 64, 192),
    ("affine", 5, 128, 48, 256),
    ("affine", 6, 64, 64, 128),
    ("affine", 8, 64, 96, 256),
    ("mxfp4", 4, 32, 64, 256),
    ("nvfp4", 4, 16, 64, 128),
    ("mxfp8", 8, 32, 64, 256),
]


@pytest.mark.parametrize("mode,bits,group,out_f,in_f", CASES)
def test_linear_exact_mode(mode, bits, group, out_f, in_f):
    Q, W, (qw, s, b) = build(mode, bits, group, out_f, in_f, out_f + bits, torch.float32)
    assert Q.in_features == in_f and Q.out_features == out_f
    assert same_bits(Q.dequantize(), W)
    g = torch.Generator().manual_seed(bits)
    for n in (1, 64):
        x = torch.randn(n, in_f, generator=g)
        y = Q.linear(x)
        assert y.dtype == torch.float32 and y.shape == (n, out_f)
        ref = x @ W.T
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # against mlx's own quantized matmul (fp32 params / fp32 activations)
        if mode == "affine":
            ym = mx.quantized_matmul(m(x), qw, s.astype(mx.float32), b.astype(mx.float32),
                                     transpose=True, group_size=group, bits=bits)
        else:
            ym = mx.quantized_matmul(m(x), qw, s, transpose=True, group_size=group, bits=bits,
                                     mode=mode)
        ym = t(ym).float()
        torch.testing.assert_close(y, ym, rtol=1e-5, atol=1e-5 * ym.abs().max().item())


@pytest.mark.parametrize("mode,bits,group,out_f,in_f", CASES)
def test_linear_fast_bf16(mode, bits, group, out_f, in_f):
    Q, W, _ = build(mode, bits, group, out_f, in_f, 3 * out_f + bits, torch.bfloat16)
    if (mode, bits) == ("affine", 4) and out_f % 16 == 0:
        assert Q.i4 is not None
    g = torch.Generator().manual_seed(out_f)
    for n in (1, 5, 300):  # 1 and 5 use int4pack where available, 300 the tiled bf16 GEMM
        x = torch.randn(n, in_f, generator=g).to(torch.bfloat16)
        y = Q.linear(x)
        assert y.dtype == torch.bfloat16 and y.shape == (n, out_f)
        xf = x.float()
        err = (y.float() - xf @ W.T).abs()
        assert (err <= bf16_tol(xf, W, group)).all(), err.max()
    # leading dims pass through
    x3 = torch.randn(2, 3, in_f, generator=g).to(torch.bfloat16)
    assert torch.equal(Q.linear(x3), Q.linear(x3.reshape(6, in_f)).reshape(2, 3, out_f))


def test_linear_fast_fails_on_wrong_weights():
    """The tolerance is tight enough to catch a wrong zero point (bias off by one scale)."""
    Q, W, _ = build("affine", 4, 64, 64, 256, 9, torch.bfloat16)
    x = torch.randn(4, 256).to(torch.bfloat16)
    Wbad = W + Q.scales.float().repeat_interleave(64, 1)
    err = (Q.linear(x).float() - x.float() @ Wbad.T).abs()
    assert not (err <= bf16_tol(x.float(), Wbad, 64)).all()


def test_bf16_fast_dequant_matches_mlx_bits():
    # bf16 scales + bf16 compute: q*s+b in bf16 ops = mlx's R(R(q*s)+b), bit for bit
    for bits in (3, 4, 8):
        Q, _, (qw, s, b) = build("affine", bits, 64, 128, 256, bits, torch.bfloat16)
        assert same_bits(Q.dequantize(torch.bfloat16), t(mx.dequantize(qw, s, b, 64, bits)))


@pytest.mark.parametrize("mode,bits,group,out_f,in_f", CASES)
@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
def test_embed_rows(mode, bits, group, out_f, in_f, cd):
    Q, _, _ = build(mode, bits, group, out_f, in_f, 17 + bits, cd)
    ids = torch.tensor([[0, out_f - 1, 1], [out_f // 2, 33 % out_f, 0]])
    e = Q.embed(ids)
    assert e.shape == (2, 3, in_f) and e.dtype == cd
    assert same_bits(e.reshape(6, in_f), Q.dequantize(cd)[ids.reshape(-1)])
    with pytest.raises(IndexError):
        Q.embed(torch.tensor([out_f]))


@pytest.mark.parametrize("blk", [64, 32])
def test_int4_block_layouts_decode(monkeypatch, blk):
    """Both layouts torch's CPU int4 pack uses (AVX-512: 64-row blocks, AVX2: 32-row blocks;
    bytes [N/blk, K, blk/2], low nibble row r, high nibble row r + blk/2), built here by hand
    so that both are checked on any CPU: rows and gathered rows decode to the codes."""
    from mlxr.quant import int4pack

    g = torch.Generator().manual_seed(blk)
    n, k = 192, 48
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    c = codes.view(n // blk, 2, blk // 2, k)  # [block, nibble, row in half, K]
    packed = (c[:, 0] | (c[:, 1] << 4)).transpose(1, 2).contiguous()  # [N/blk, K, blk/2]
    monkeypatch.setattr(int4pack, "block", lambda: blk)
    assert torch.equal(int4pack.decode_rows(packed, k, 64, 192), codes[64:])
    ids = torch.tensor([0, 15, 16, 31, 32, 63, 64, 100, 191])
    assert torch.equal(int4pack.decode_gather(packed, k, ids), codes[ids])
    # two planes (8-bit codes as [high | low] nibbles over 2K): merged from the bytes
    wide = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    c = torch.cat([wide >> 4, wide & 15], 1).view(n // blk, 2, blk // 2, 2 * k)
    packed2 = (c[:, 0] | (c[:, 1] << 4)).transpose(1, 2).contiguous()
    got = int4pack.decode_rows_planes(packed2, k, 64, 192, lambda hi, lo: (hi << 4) | lo)
    assert torch.equal(got, wide[64:])


def test_int4_layout_decode_matches_codes(monkeypatch):
    """Rows decode from torch's int4 CPU layout where this torch build packs a layout
    `int4pack.decode_rows` reads (no second copy: the 64- or 32-row blocks of the AVX-512 and
    AVX2 builds); where it packs another one the MLX words are kept for it."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths' storage
    from mlxr.quant import int4pack

    Q, _, (qw, _, _) = build("affine", 4, 64, 192, 256, 5, torch.bfloat16)
    assert Q.i4 is not None and Q.codes is None
    codes = unpack_codes(t(qw), 4, 256)
    assert torch.equal(Q.row_codes(slice(0, 192)), codes)
    assert torch.equal(Q.row_codes(slice(70, 130)), codes[70:130])
    words = 0 if int4pack.layout_ok() else 192 * 256 // 2
    assert (Q.packed is None) == (words == 0)
    # int4 codes + the kept MLX words (if any) + (s, b) + (s, z) bf16
    assert Q.nbytes == 192 * 256 // 2 + words + 2 * (192 * 4 * 2 * 2)


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_other_widths_take_int4_planes_on_cpu(bits, monkeypatch):
    """bf16 CPU weights of 2/3/5/6/8 bits keep torch's int4 copy of their nibble planes
    (`affine.planes`; two planes over x repeated twice for 5/6/8-bit): decode within the bf16
    bar of mlx's weight, the codes read back from the copy (rows and gathered rows) equal
    mlx's, a copy packed in row slices equals one packed whole, MLXR_PLANES=0 keeps the old
    storage."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths' storage
    Q, W, (qw, _, _) = build("affine", bits, 64, 192, 256, 40 + bits, torch.bfloat16)
    assert Q.i4 is not None and Q.planes == (2 if bits > 4 else 1)
    codes = unpack_codes(t(qw), bits, 256)
    assert torch.equal(Q.row_codes(slice(70, 192)), codes[70:])
    ids = torch.tensor([0, 65, 191, 3])
    assert torch.equal(Q.row_codes(ids), codes[ids])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(bits)).to(torch.bfloat16)
    err = (Q.linear(x).float() - x.float() @ W.T).abs()
    assert (err <= bf16_tol(x.float(), W, 64)).all(), err.max()
    whole = Q.i4
    assert Q._int4_copy(t(qw).view(torch.int32), chunk_rows=64) and torch.equal(Q.i4, whole)
    monkeypatch.setenv("MLXR_PLANES", "0")
    Q0, _, _ = build("affine", bits, 64, 192, 256, 40 + bits, torch.bfloat16)
    assert Q0.i4 is None and Q0.planes == 1


def test_cpu_rows_route_between_int4_and_tiles(monkeypatch):
    """Prompts take torch's int4 kernel below `cpu.i4_max_m` rows (one plane: 160, two: 80,
    mxfp4's two too), the tiles from there on."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths' storage
    from mlxr.quant import cpu, int4pack

    calls = []
    real = int4pack.mm
    monkeypatch.setattr(int4pack, "mm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for mode, bits, group, rows in [("affine", 4, 64, (159, 160)), ("affine", 8, 64, (79, 80)),
                                    ("mxfp4", 4, 32, (79, 80))]:
        Q, _, _ = build(mode, bits, group, 64, 256, 11, torch.bfloat16)
        assert cpu.i4_max_m(Q) == rows[1]
        for m in rows:
            calls.clear()
            Q.linear(torch.randn(m, 256).to(torch.bfloat16))
            assert calls == ([m] if m < rows[1] else [])


def test_mxfp4_takes_int4_planes_on_cpu(monkeypatch):
    """mxfp4 on the CPU (bf16): two nibble planes of 2v + 12 at scale s/2 (`fp.fp4_planes`)
    give s v exactly for every code; the weight keeps only torch's int4 copy of them, whose
    decoded rows dequantize to the same bits as the file's codes; a non-finite scale (E8M0
    byte 255) keeps the tiled path; MLXR_PLANES=0 too."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths' storage
    from mlxr.quant import fp

    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 2)  # [2, 32]: every code, twice
    s = torch.tensor([[2.0**-9], [2.0**5]])
    c, s2, b2 = fp.fp4_planes(codes, s)
    got = s2.repeat_interleave(32, 1) * c.float() + b2.repeat_interleave(32, 1)
    assert torch.equal(got[:, :32] + got[:, 32:], fp.E2M1[codes.long()] * s)
    assert torch.equal(fp.fp4_codes(c[:, :32] + c[:, 32:]), torch.where(codes == 8, 0, codes))
    Q, _, (qw, sc, _) = build("mxfp4", 4, 32, 128, 256, 7, torch.bfloat16)
    assert Q.i4 is not None and Q.planes == 2 and Q.packed is None and Q.codes is None
    monkeypatch.setenv("MLXR_PLANES", "0")
    Q0, _, _ = build("mxfp4", 4, 32, 128, 256, 7, torch.bfloat16)
    assert Q0.i4 is None
    assert same_bits(Q.dequantize(torch.bfloat16), Q0.dequantize(torch.bfloat16))
    monkeypatch.delenv("MLXR_PLANES")
    bad = t(sc).clone()
    bad[3, 2] = 255
    Qb = QuantWeight.from_tensors(t(qw), bad, None, QuantSpec("mxfp4", 4, 32),
                                  compute_dtype=torch.bfloat16)
    assert Qb.i4 is None


@pytest.mark.parametrize("mode,bits,group", [("nvfp4", 4, 16), ("mxfp8", 8, 32)])
def test_dense_copy_on_cpu(mode, bits, group, monkeypatch):
    """nvfp4 / mxfp8 on the CPU (bf16) keep `dequant_rows`' values once (`dense`): `linear`,
    `embed` and `dequant_rows` give bit for bit what the tiles give without it (MLXR_DENSE=0),
    mlx's own dequantization rounded to bf16 included; `dense_bytes` is its size; the
    float32 exact mode and an only-gathered weight (matmul=False) build none."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths' storage
    from mlxr.quant.weight import dense_bytes

    Q, W, (qw, s, _) = build(mode, bits, group, 96, 256, 11, torch.bfloat16)
    assert Q.dense is not None and Q.dense.dtype == torch.bfloat16
    assert Q.dense.nbytes == dense_bytes(Q.spec, 96, 256, torch.bfloat16) == 96 * 256 * 2
    assert same_bits(Q.dense, W.to(torch.bfloat16))  # v * s is exact in bf16
    monkeypatch.setenv("MLXR_DENSE", "0")
    T, _, _ = build(mode, bits, group, 96, 256, 11, torch.bfloat16)
    monkeypatch.delenv("MLXR_DENSE")
    assert T.dense is None and dense_bytes(Q.spec, 96, 256, torch.float32) == 0
    g = torch.Generator().manual_seed(bits)
    for n in (1, 7):
        x = torch.randn(n, 256, generator=g).to(torch.bfloat16)
        assert torch.equal(Q.linear(x), T.linear(x))
    ids = torch.tensor([[0, 95, 17]])
    assert torch.equal(Q.embed(ids), T.embed(ids))
    assert same_bits(Q.dequantize(), T.dequantize())  # fp32 requests bypass the copy
    assert build(mode, bits, group, 96, 256, 11, torch.float32)[0].dense is None
    only = QuantWeight.from_tensors(t(qw), t(s), None, Q.spec, compute_dtype=torch.bfloat16,
                                    matmul=False)
    assert only.dense is None


def test_loader_budgets_dense_copies_on_cpu(monkeypatch):
    """The loader's RAM budget on the CPU: nvfp4 / mxfp8 weights get their dense copy while it
    fits (`dense_bytes` each), the rest load without (decode_copies=False) and are counted."""
    from types import SimpleNamespace

    from mlxr.models import loader
    from mlxr.models.loader import RawQuant, _Builder

    asked = []
    monkeypatch.setattr(loader.QuantWeight, "from_tensors",
                        lambda *a, **kw: asked.append(kw["decode_copies"])
                        or SimpleNamespace(words_dropped=False))
    spec = QuantSpec("nvfp4", 4, 16)
    raw = RawQuant(torch.zeros(64, 32, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.uint8),
                   None, spec, None)
    need = 64 * 256 * 2
    b = _Builder(None, None, torch.bfloat16, "cpu", dry_run=True)
    b.dry_run, b.copy_budget = False, 2 * need + 5
    for _ in range(3):
        b.quant(raw)
    assert asked == [True, True, False] and b.copy_budget == 5 and b.copies_skipped == 1
    b.copy_budget = -10  # less RAM than the file: still no affine weight is "skipped"
    b.quant(RawQuant(raw.weight, torch.zeros(64, 4, dtype=torch.bfloat16),
                     torch.zeros(64, 4, dtype=torch.bfloat16), QuantSpec("affine", 4, 64), None))
    assert asked[-1] and b.copy_budget == -10 and b.copies_skipped == 1  # no copy to pay for
    assert loader._ram()[0] > 0


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
def test_tiled_path_equals_single_tile(monkeypatch, cd):
    Q, W, _ = build("affine", 3, 64, 320, 256, 2, cd)
    x = torch.randn(40, 256).to(cd)
    one = Q.linear(x)
    monkeypatch.setattr(qcpu, "SMALL_BYTES", 0)
    monkeypatch.setattr(qcpu, "TILE_BYTES", 64 * 256 * 4)  # 64-row tiles, last one partial
    assert Q.tile_rows(4, qcpu.TILE_BYTES) == 64
    assert torch.equal(Q.linear(x), one)


# ---------------------------------------------------------------------------- validation


def _ok():
    qw, s, b = mx_quantize((64, 256), 1, 4, 64)
    return t(qw), t(s), t(b)


def _fp():
    qw, s, _ = mx_quantize((64, 256), 1, 4, 32, mode="mxfp4")
    return t(qw), t(s)


def _nv():
    qw, s, _ = mx_quantize((64, 256), 1, 4, 16, mode="nvfp4")
    return t(qw), t(s)


def hostile():
    w, s, b = _ok()
    fw, fs = _fp()
    nw, ns = _nv()
    A = QuantSpec("affine", 4, 64)
    return [
        (w[:, :-1], s, b, A, None),  # weight last dim wrong
        (w, s[:, :-1], b[:, :-1], A, None),  # groups don't match
        (w, s[:-1], b[:-1], A, None),  # rows don't match
        (w, s, None, A, None),  # affine without biases
        (w, s, b[:, :2], A, None),  # biases shape
        (w, s, b.float(), A, None),  # biases dtype
        (w, s.view(torch.int16), b, A, None),  # integer scales
        (w.float(), s, b, A, None),  # float weight
        (w[0], s[0], b[0], A, None),  # 1-D
        (w, s, b, QuantSpec("affine", 7, 64), None),  # bits 7
        (w, s, b, QuantSpec("affine", 4, 16), None),  # group 16
        (w, s, b, QuantSpec("int4", 4, 64), None),  # unknown mode
        (w, s, b, QuantSpec("affine", 2, 64), None),  # spec inconsistent with shapes
        (fw, fs, None, QuantSpec("mxfp4", 4, 16), None),  # mxfp4 must be 4/32
        (fw, fs, None, QuantSpec("mxfp8", 4, 32), None),
        (fw, fs.to(torch.bfloat16), None, QuantSpec("mxfp4", 4, 32), None),  # scales not uint8
        (fw, fs, fs, QuantSpec("mxfp4", 4, 32), None),  # fp mode with biases
        (fw, fs, None, QuantSpec("mxfp4", 4, 32, global_scale=True), torch.ones(())),
        (nw, ns, None, QuantSpec("nvfp4", 4, 16, global_scale=True), None),  # gs missing
        (nw, ns, None, QuantSpec("nvfp4", 4, 16), torch.ones(())),  # gs unexpected
        (nw, ns, None, QuantSpec("nvfp4", 4, 16, True), torch.ones(3)),  # gs shape
    ]


@pytest.mark.parametrize("case", range(21))
def test_hostile_shapes_raise(case):
    w, s, b, spec, gs = hostile()[case]
    with pytest.raises(ModelFormatError, match="blk.7.ffn"):
        QuantWeight.from_tensors(w, s, b, spec, global_scale=gs, name="blk.7.ffn")
    with pytest.raises(ModelFormatError):
        dequantize(w, s, b, spec, global_scale=gs)


def test_hostile_list_is_complete_and_valid_baseline_passes():
    assert len(hostile()) == 21
    w, s, b = _ok()
    QuantWeight.from_tensors(w, s, b, QuantSpec("affine", 4, 64))
    fw, fs = _fp()
    QuantWeight.from_tensors(fw, fs, None, QuantSpec("mxfp4", 4, 32))
    nw, ns = _nv()
    QuantWeight.from_tensors(nw, ns, None, QuantSpec("nvfp4", 4, 16))
    QuantWeight.from_tensors(nw, ns, None, QuantSpec("nvfp4", 4, 16, True),
                             global_scale=torch.ones(()))


def test_quantweight_rejects_3d():
    qw, s, b = mx_quantize((2, 32, 128), 1, 4, 64)
    with pytest.raises(ModelFormatError, match="2-D"):
        QuantWeight.from_tensors(t(qw), t(s), t(b), QuantSpec())


def test_quantweight_nvfp4_global_scale():
    mx.random.seed(4)
    w = mx.random.normal((64, 128)) * 0.02
    g = mx.max(mx.abs(w))
    q, s = mx.quantize(w, mode="nvfp4", global_scale=g)[:2]
    spec = QuantSpec("nvfp4", 4, 16, global_scale=True)
    ref = t(mx.dequantize(q, s, mode="nvfp4", global_scale=g, dtype=mx.float32))
    for cd in (torch.float32, torch.bfloat16):
        Q = QuantWeight.from_tensors(t(q), t(s), None, spec, global_scale=t(g), compute_dtype=cd)
        assert same_bits(Q.dequantize(), ref)
        x = torch.randn(3, 128).to(cd)
        err = (Q.linear(x).float() - x.float() @ ref.T).abs()
        tol = 1e-5 * ref.abs().max() * 128 if cd == torch.float32 else bf16_tol(x.float(), ref, 16)
        assert (err <= tol).all()
