"""mlxr.ops.matmul.decode_gemv_tc (the tensor-core 4-bit decode GEMV) against fp64 and its torch
twin.

With a GPU this runs the kernel's PTX (mma.sync, lane loads); without one, under
TRITON_INTERPRET=1, the kernel runs with the PTX emulated at the same lane semantics, which
checks the repack, the column masks, the window flushes and the final row reduction."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from test_triton_q4gemv import _weights

from mlxr.ops.matmul import decode_gemv_tc as T
from mlxr.ops.matmul.decode_gemv_q4 import pair_scales
from mlxr.ops.matmul.generic_qmm import dequant_f32

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _exact(x, packed, s, b, group):
    """fp64 x @ dequant(W)^T and sum |x| |W| over the MLX words."""
    w = dequant_f32(packed, s, b, None, "affine", 4, group).double()
    return x.double() @ w.t(), x.double().abs() @ w.abs().t()


def _run(x, packed, s, b, group, cfg=None):
    words = T.repack(packed.to(DEV))
    return T.q4tc(x.to(DEV), words, pair_scales(s, b).to(DEV), group=group, config=cfg).cpu()


def test_repack_round_trip_and_layout():
    packed = torch.randint(-2**31, 2**31 - 1, (32, 128), dtype=torch.int32)
    r = T.repack(packed)
    assert r.shape == (2, 2048) and r.dtype == torch.int32
    assert torch.equal(T.unrepack(r), packed)
    codes = ((packed.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 15).reshape(32, -1)
    # row 16R + 8h + g, k = 64 blk + 32 (s // 2) + 8 tig + 4 (s % 2) + 2m + hi sits in word
    # blk * 128 + 4 (4g + tig) + s of row tile R, at nibble h + 2m + 4hi
    for rt, h, g, blk, s, tig, m, hi in [(0, 0, 0, 0, 0, 0, 0, 0), (1, 1, 7, 15, 3, 3, 1, 1),
                                         (0, 1, 2, 5, 2, 1, 0, 1), (1, 0, 5, 9, 1, 2, 1, 0)]:
        row = 16 * rt + 8 * h + g
        k = 64 * blk + 32 * (s // 2) + 8 * tig + 4 * (s % 2) + 2 * m + hi
        word = int(r[rt, blk * 128 + 4 * (4 * g + tig) + s])
        assert (word >> (4 * (h + 2 * m + 4 * hi))) & 15 == int(codes[row, k])
    assert torch.equal(T.repack(packed, chunk_rows=16), r)
    with pytest.raises(ValueError, match="multiple of 16"):
        T.repack(packed[:24])


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,cfg", [
    (32, 512, None),
    (48, 1024, T.TcConfig(rt=1, u=1, num_warps=4)),  # 3 programs, 4 iterations (half a window)
    (64, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),  # 12 iterations: a full and a part window
    (16, 4096, T.TcConfig(rt=1, u=2, num_warps=4)),  # 8 iterations, prefetch across windows
    (32, 2048, T.TcConfig(rt=4, u=1, num_warps=4)),  # a program's row tiles past N
    (32, 1536, T.TcConfig(rt=1, u=1, num_warps=4, pf=2)),  # two word tiles in flight
    (16, 512, T.TcConfig(rt=1, u=1, num_warps=2, pf=2)),  # ... past the last one
    (48, 2048, T.TcConfig(rt=2, u=1, num_warps=4, stages=3)),  # GPU: TMA, rows past N
    (32, 3072, T.TcConfig(rt=1, u=1, num_warps=8, stages=2)),  # GPU: TMA, 8 warps
    (16, 4096, T.TcConfig(rt=1, u=1, num_warps=16, pf=2)),  # 16 warps: 2 iterations
    (32, 6144, T.TcConfig(rt=1, u=1, num_warps=16, stages=4)),  # GPU: TMA, 16 warps
    (16, 3584, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, unroll=2)),  # 14 iterations (8B down)
    (32, 2560, T.TcConfig(rt=2, u=1, num_warps=8, pf=2, unroll=2)),  # 5: an odd count
])
def test_q4tc_matches_fp64_and_twin(group, dtype, n, k, cfg):
    packed, s, b, x = _weights(n, k, group, dtype, seed=n + k + group)
    y = _run(x, packed, s, b, group, cfg)
    exact, scale = _exact(x, packed, s, b, group)
    # the fp32 sums are within ~1e-6 of sum |x||w|; rounding to the 16-bit output (the
    # interpreter truncates) adds up to 2^-7 |y|
    err = (y.double() - exact).abs()
    assert bool((err <= 2**-7 * exact.abs() + 1e-5 * scale).all()), float((err / scale).max())
    twin = T.q4tc_ref(x, T.repack(packed), pair_scales(s, b), group=group)
    assert (y.float() - twin.float()).abs().max() <= 2**-6 * twin.float().abs().max()


@pytest.mark.parametrize("group,m", [(g, m) for g in (32, 64, 128) for m in (2, 3, 4, 5, 8, 9, 12)
                                     if m <= T.max_rows(g) or m > 8])
@pytest.mark.parametrize("n,k,cfg", [
    (32, 1024, None),
    (48, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),  # windows of 4 / 2 / 1 iterations
    (32, 2048, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, stages=3)),  # GPU: TMA
])
def test_q4tc_several_rows(group, m, n, k, cfg):
    """Up to 8 rows of x (4 with group 32) in one launch: the B columns hold rows x group
    slots; 3 and 5 rows are padded to 4 and 8; 9 and 12 rows take launches of 8 (4) and a
    rest (9 = 8 + 1: the one-row kernel). Each row as the one-row kernel computes it."""
    packed, s, b, _ = _weights(n, k, group, torch.bfloat16, seed=m + n + group)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    words = T.repack(packed.to(DEV))
    sb = pair_scales(s, b).to(DEV)
    y = T.q4tc(x.to(DEV), words, sb, group=group, config=cfg).cpu()
    assert y.shape == (m, n)
    w = dequant_f32(packed, s, b, None, "affine", 4, group).double()
    exact, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    err = (y.double() - exact).abs()
    assert bool((err <= 2**-7 * exact.abs() + 1e-5 * scale).all()), float((err / scale).max())
    one = torch.stack([T.q4tc(x[i].to(DEV), words, sb, group=group, config=cfg).cpu()
                       for i in (0, m - 1)])
    assert (y[[0, m - 1]].float() - one.float()).abs().max() <= 2**-6 * one.float().abs().max()


def test_q4tc_sees_every_code_position():
    """With x one-hot at k, y[row] = s * q[row, k] exactly, for every row: each of a block's
    64 positions (all lanes, steps and nibbles) and positions in later blocks and windows. A
    repack or lane-mapping mistake would drop or misplace codes."""
    n, k, group = 32, 1024, 64
    packed, s, b, _ = _weights(n, k, group, torch.bfloat16, seed=3)
    s = torch.full_like(s, 0.5)
    b = torch.zeros_like(b)
    codes = ((packed.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 15).reshape(n, k)
    for kk in list(range(64)) + [64, 200, 511, 512, 777, 1023]:
        x = torch.zeros(k, dtype=torch.bfloat16)
        x[kk] = 1
        y = _run(x, packed, s, b, group).float()
        assert torch.equal(y, 0.5 * codes[:, kk].float()), kk


def test_q4tc_rejects_bad_input():
    packed, s, b, x = _weights(32, 512, 64, torch.bfloat16)
    words = T.repack(packed)
    sb = pair_scales(s, b)
    with pytest.raises(ValueError, match="x must be"):
        T.q4tc(x[:256], words, sb, group=64)
    with pytest.raises(ValueError, match="sb"):
        T.q4tc(x, words, sb[:16], group=64)
    with pytest.raises(ValueError, match="x must be"):  # 16-byte alignment
        T.q4tc(torch.zeros(513, dtype=torch.bfloat16)[1:], words, sb, group=64)
    with pytest.raises(ValueError, match="out"):
        T.q4tc(x.expand(9, 512).contiguous(), words, sb, group=64, out=torch.empty(8, 32))
    with pytest.raises(ValueError, match="divide"):
        T.q4tc(x, words, sb, group=64, config=T.TcConfig(rt=1, u=4, num_warps=4))
    assert not T.supported(64, 24, 512, torch.bfloat16)
    assert not T.supported(64, 32, 768, torch.bfloat16)
    assert not T.supported(64, 32, 512, torch.float32)


def test_default_config_one_row_launches(monkeypatch):
    """The GPU defaults (the interpreter has its own): the 8B down and the K >= 4096 LM heads
    take two word tiles in flight with the K loop unrolled twice for one row of x only (the
    launch measured for one row); several rows keep the previous launches."""
    from mlxr.ops.matmul import decode_gemv_tc_config

    monkeypatch.setattr(decode_gemv_tc_config, "_interpret", lambda: False)
    monkeypatch.delenv("MLXR_Q4TC_STAGES", raising=False)
    down, head = (4096, 14336), (128256, 4096)
    assert T.default_config(*down) == T.TcConfig(rt=1, u=1, num_warps=16, pf=2, unroll=2)
    assert T.default_config(*head) == T.TcConfig(rt=2, u=1, num_warps=8, pf=2, unroll=2)
    assert T.default_config(*down, 8) == T.TcConfig(rt=1, u=1, num_warps=16, pf=1)
    assert T.default_config(*head, 2) == T.TcConfig(rt=4, u=1, num_warps=4, pf=2)
    # K < 8192 (the 0.6B down) and K < 4096 (the 0.6B head) are unchanged
    assert T.default_config(1024, 3072) == T.TcConfig(rt=1, u=1, num_warps=16, pf=1)
    assert T.default_config(151936, 1024) == T.TcConfig(rt=2, u=1, num_warps=4, pf=2)
    # the fp8 copy at one row: the 8B qkv / o / down; its gate_up, head and 0.6B unchanged
    fp8 = T.TcConfig(rt=1, u=1, num_warps=8, pf=2, unroll=2)
    assert [T.default_config(n, k, 1, True) for n, k in ((6144, 4096), (4096, 4096), down)] == [
        fp8] * 3
    assert T.default_config(*down, 2, True) == T.default_config(*down, 2)
    for n, k in ((28672, 4096), head, (4096, 1024), (1024, 3072)):
        assert T.default_config(n, k, 1, True) == T.default_config(n, k)


def test_glu_rows_and_order():
    """The glu copy's row order puts gate row 8t + j at 16t + j and its up row at 16t + 8 + j,
    and `glu_order` undoes it."""
    perm = T.glu_rows(64)
    assert torch.equal(perm[:16], torch.tensor([*range(8), *range(32, 40)]))
    assert torch.equal(perm[16:24], torch.arange(8, 16))
    assert torch.equal(torch.sort(perm).values, torch.arange(64))
    y = torch.randn(3, 64)
    assert torch.equal(T.glu_order(y[:, perm]), y)
    with pytest.raises(ValueError, match="multiple of 16"):
        T.glu_rows(40)


_UNROLLED = T.TcConfig(rt=1, u=1, num_warps=4, pf=2, unroll=2)


@pytest.mark.parametrize("act,group,m,dtype,n,k,cfg", [
    ("silu", 64, 1, torch.bfloat16, 64, 1024, None),
    ("gelu", 32, 1, torch.float16, 96, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),  # rows past N
    ("silu", 64, 1, torch.bfloat16, 32, 3584, _UNROLLED),
    ("gelu_tanh", 128, 2, torch.bfloat16, 64, 1024, None),
    ("silu", 32, 4, torch.float16, 32, 3584, _UNROLLED),
    ("silu", 64, 5, torch.bfloat16, 96, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),
    ("gelu", 64, 9, torch.bfloat16, 64, 1024, None),
])
def test_q4tc_gated(act, group, m, dtype, n, k, cfg):
    """act(gate) * up from a glu copy in one launch: exactly what the plain launch on the
    un-permuted weight followed by `gated_act` computes (same sums, same roundings), and
    within rounding of the torch twin. 9 rows: a launch of 8 and a one-row launch."""
    from mlxr.ops.layer.norm_rope_act import gated_act

    packed, s, b, _ = _weights(n, k, group, dtype, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    x = x[0] if m == 1 else x
    perm = T.glu_rows(n)
    words, sb = T.repack(packed[perm].to(DEV)), pair_scales(s[perm], b[perm]).to(DEV)
    y = T.q4tc(x.to(DEV), words, sb, group=group, config=cfg, act=act).cpu()
    assert y.shape == ((n // 2,) if m == 1 else (m, n // 2))
    plain = T.q4tc(x.to(DEV), T.repack(packed.to(DEV)), pair_scales(s, b).to(DEV),
                   group=group, config=cfg)
    gate, up = plain.reshape(m, n).chunk(2, dim=-1)
    assert torch.equal(y.reshape(m, -1), gated_act(gate, up, act).cpu())
    twin = T.q4tc_ref(x, T.repack(packed[perm]), pair_scales(s[perm], b[perm]), group=group,
                      act=act)
    assert twin.shape == y.shape
    # four 16-bit roundings (gate, up, act, product; the interpreter truncates): 2^-5 |y|
    y, twin = y.float(), twin.float()
    assert bool(((y - twin).abs() <= 2**-5 * twin.abs() + 2**-8 * twin.abs().max()).all())
    with pytest.raises(ValueError, match="activation"):
        T.q4tc(x.to(DEV), words, sb, group=group, act="relu")


def _affine(g, n, k, bits, group, dtype):
    """Random b-bit codes [N, K] with scales and biases [N, K/G] drawn from g."""
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.int32)
    s = (torch.rand(n, k // group, generator=g) * 0.04 / 2**bits + 1e-4).to(dtype)
    b = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype)
    return codes, s, b


def _dequant64(codes, s, b, group):
    n, k = codes.shape
    w = codes.double().view(n, k // group, group) * s.double()[..., None] + b.double()[..., None]
    return w.view(n, k)


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_planes_are_the_weight(bits):
    """`planes`: nibble codes whose 4-bit weight over x repeated P times is the b-bit weight
    (in fp64, so only the summation order differs); a scale that overflows when scaled by
    2^(b-4) is refused."""
    from mlxr.quant.affine import planes

    g = torch.Generator().manual_seed(bits)
    codes, s, b = _affine(g, 16, 256, bits, 64, torch.bfloat16)
    c, s2, b2 = planes(codes, s, b, bits)
    p = 1 if bits <= 4 else 2
    assert c.shape == (16, p * 256) and int(c.min()) >= 0 and int(c.max()) < 16
    assert s2.shape == b2.shape == (16, p * 4) and s2.dtype == s.dtype
    x = torch.randn(3, 256, generator=g, dtype=torch.float64)
    want = x @ _dequant64(codes, s, b, 64).t()
    got = x.repeat(1, p) @ _dequant64(c, s2, b2, 64).t()
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
    if p == 2:
        with pytest.raises(ValueError, match="overflow"):
            planes(codes, torch.full_like(s, 60000.0, dtype=torch.float16), b.half(), bits)


@pytest.mark.parametrize("bits,group,m,dtype,n,k,cfg", [
    (8, 64, 1, torch.bfloat16, 32, 1024, None),
    (8, 32, 3, torch.float16, 48, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),  # windows span planes
    (6, 64, 1, torch.bfloat16, 32, 1536, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, unroll=2)),
    (5, 128, 2, torch.bfloat16, 16, 2048, None),
    (3, 64, 1, torch.bfloat16, 32, 1024, None),
    (2, 32, 4, torch.bfloat16, 32, 512, None),
    (8, 64, 9, torch.bfloat16, 32, 512, None),  # a launch of 8 rows and a one-row launch
])
def test_q4tc_planes(bits, group, m, dtype, n, k, cfg):
    """2/3/5/6/8-bit weights through their nibble planes (`q4tc(planes=P)`: the kernel walks
    K = P x x's length and reads x once per plane): within rounding of fp64 x @ W^T of the
    b-bit weight, and of the torch twin."""
    from mlxr.ops.matmul.decode_gemv_tc_layout import repack_codes
    from mlxr.quant.affine import planes

    g = torch.Generator().manual_seed(bits * 100 + m)
    codes, s, b = _affine(g, n, k, bits, group, dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    c, s2, b2 = planes(codes, s, b, bits)
    p = 1 if bits <= 4 else 2
    words, sb = repack_codes(c), pair_scales(s2, b2)
    y = T.q4tc(x.to(DEV), words.to(DEV), sb.to(DEV), group=group, config=cfg, planes=p).cpu()
    assert y.shape == ((n,) if m == 1 else (m, n))
    w = _dequant64(codes, s, b, group)
    exact, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    err = (y.double() - exact).abs()
    assert bool((err <= 2**-7 * exact.abs() + 1e-5 * scale).all()), float((err / scale).max())
    twin = T.q4tc_ref(x, words, sb, group=group, planes=p)
    assert (y.float() - twin.float()).abs().max() <= 2**-6 * twin.float().abs().max()
    with pytest.raises(ValueError, match="x must be"):  # x of the planes' length
        T.q4tc(x.repeat(1, p + 1).to(DEV), words.to(DEV), sb.to(DEV), group=group, planes=p)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("glu", [False, True])
def test_copy_dequant_is_dequant_affine(bits, glu):
    """`dequant_copy` (prefill from the q4tc copy, so the MLX words can go) gives
    `dequant_affine`'s values bit for bit, from 4-bit's repack or the other widths' nibble
    planes, in either row order; its torch twin too. K = 640 leaves a partial column tile."""
    from mlxr.config import QuantSpec
    from mlxr.ops.matmul.decode_gemv_tc_layout import dequant_copy_ref, repack_codes
    from mlxr.ops.matmul.prefill_dequant import dequant_affine, dequant_copy
    from mlxr.quant.fp import nibble_planes

    group = (32, 64, 128)[bits % 3] if bits != 4 else 64
    n, k, dtype = 48, 640 if group != 128 else 768, torch.bfloat16 if bits % 2 else torch.float16
    g = torch.Generator().manual_seed(100 * bits + glu)
    w = torch.randint(-(2**31), 2**31, (n, k * bits // 32), generator=g,
                      dtype=torch.int64).to(torch.int32)
    s = (torch.rand(n, k // group, generator=g) * 0.04 / 2**bits + 1e-4).to(dtype)
    b = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype)
    perm = T.glu_rows(n) if glu else torch.arange(n)
    if bits == 4:
        copy, p = T.repack(w[perm]), 1
    else:
        c = nibble_planes(QuantSpec("affine", bits, group), w[perm], s[perm], b[perm], k)[0]
        copy, p = repack_codes(c), c.shape[1] // k
    assert p == (2 if bits > 4 else 1)
    want = dequant_affine(w.to(DEV), s.to(DEV), b.to(DEV), k, bits, group, dtype).cpu()
    got = dequant_copy(copy.to(DEV), s.to(DEV), b.to(DEV), bits, group, p, glu, dtype).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    twin = dequant_copy_ref(copy, s, b, bits, group, p, glu, dtype)
    assert torch.equal(twin.view(torch.int16), want.view(torch.int16))
    assert len(set(want[0].tolist())) > 4  # real, varied values (not an all-zero row)
    with pytest.raises(ValueError, match="dequant_copy"):
        dequant_copy(copy.to(DEV), s.to(DEV), b.to(DEV), bits, group, 3 - p, glu, dtype)


def _fp4(g, n, k, group=32):
    """Random mxfp4 (group 32: E8M0 scales) or nvfp4 (group 16: E4M3 scales, subnormal ones
    among them) weight: codes [N, K] (all 16 E2M1 codes, -0 and the subnormal +-0.5 among
    them), its MLX words, the scales' fp32 values [N, K/G] and the fp64 weight."""
    from mlxr.quant.fp import code_table, scale_table

    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    if group == 32:
        sbytes = torch.randint(116, 126, (n, k // group), generator=g)
    else:  # E4M3 bytes 1..0x5F: 2^-9 .. 16 (0x7F is NaN)
        sbytes = torch.randint(1, 0x60, (n, k // group), generator=g)
    s = scale_table("mxfp4" if group == 32 else "nvfp4", torch.device("cpu"))[sbytes]
    packed = (codes.view(n, k // 8, 8) << torch.arange(0, 32, 4)).sum(-1, dtype=torch.int32)
    w = (code_table("mxfp4", torch.device("cpu"))[codes.long()].double().view(n, -1, group)
         * s.double()[..., None]).view(n, k)
    return codes, packed, s, w


def _fp4_pairs(s):
    """q4tc's pairs for fp4 scales: (the scale in bf16, exact, and 0)."""
    sb = s.to(torch.bfloat16)
    assert torch.equal(sb.float(), s)
    return pair_scales(sb, torch.zeros_like(sb))


def test_fp4_bits_round_trip_and_extraction():
    """`fp4_bits` moves each code's bits within its word and `fp4_unbits` undoes it; the
    kernel's extraction (the masks and shifts of its PTX, here in torch) gives every nibble's
    E2M1 value x 2^-126 as bf16 bits, the subnormal +-0.5 included."""
    from mlxr.ops.matmul.decode_gemv_tc_layout import fp4_unbits
    from mlxr.quant.fp import code_table

    w = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(5))
    f = T.fp4_bits(w)
    assert f.dtype == torch.int32 and torch.equal(fp4_unbits(f), w) and not torch.equal(f, w)
    u = f.long() & 0xFFFFFFFF
    m = 0x81C081C0
    regs = [u & m, (u << 3) & m, (u << 6) & m,
            ((u << 1) & 0x80008000) | ((u >> 3) & 0x01800180) | ((u >> 7) & 0x00400040)]
    table = code_table("mxfp4", torch.device("cpu")).double()
    for j in range(8):
        half = (regs[j % 4] >> (16 * (j // 4))) & 0xFFFF
        v = (half << 16).to(torch.int32).view(torch.float32).double() * 2.0**126
        code = (w.long() >> (4 * j)) & 15
        assert torch.equal(v, table[code]), j


@pytest.mark.parametrize("m,act,group,gs,n,k,cfg", [
    (1, None, 32, None, 32, 512, None),
    (1, None, 32, None, 48, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),  # rows past N, windows
    (1, None, 32, None, 16, 3584, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, unroll=2)),
    (1, None, 32, None, 32, 2048, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, stages=3)),  # TMA
    (3, None, 32, None, 32, 1024, None),
    (4, "silu", 32, None, 64, 1024, None),
    (1, "silu", 32, None, 64, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),
    (9, None, 32, None, 32, 512, None),  # launches of 4 rows (group 32) and a one-row launch
    (1, None, 16, 0.75, 32, 512, None),  # nvfp4: 4 columns per block, windows of 2
    (1, None, 16, None, 48, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),
    (1, "silu", 16, 3.0, 32, 3584, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, unroll=2)),
    (2, None, 16, 0.5, 32, 1024, None),  # two rows: x rows in columns 0-3 and 4-7
    (5, "gelu", 16, 1.5, 64, 1024, None),  # launches of 2 rows and a one-row launch
])
def test_q4tc_fp4(m, act, group, gs, n, k, cfg):
    """mxfp4 / nvfp4 weights through their fp4 copy (`q4tc(fp4=True)`): within rounding of
    fp64 x @ W^T (the E2M1 values times exact scales, times the global scale gs, so only the
    fp32 summation order and the output rounding differ), and of the torch twin; with a glu
    copy, act(gate) * up exactly as the plain launch followed by `gated_act`."""
    from mlxr.ops.layer.norm_rope_act import gated_act

    g = torch.Generator().manual_seed(m * 1000 + n + k + group)
    _, packed, s, w = _fp4(g, n, k, group)
    w = w * (1.0 if gs is None else gs)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    words, sb = T.fp4_bits(T.repack(packed)), _fp4_pairs(s)
    y = T.q4tc(x.to(DEV), words.to(DEV), sb.to(DEV), group=group, config=cfg, fp4=True,
               gs=gs).cpu()
    assert y.shape == ((n,) if m == 1 else (m, n))
    exact, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    err = (y.double() - exact).abs()
    assert bool((err <= 2**-7 * exact.abs() + 1e-5 * scale).all()), float((err / scale).max())
    twin = T.q4tc_ref(x, words, sb, group=group, fp4=True, gs=gs)
    assert (y.float() - twin.float()).abs().max() <= 2**-6 * twin.float().abs().max()
    if act is not None:
        perm = T.glu_rows(n)
        gw, gsb = T.fp4_bits(T.repack(packed[perm])), _fp4_pairs(s[perm])
        yg = T.q4tc(x.to(DEV), gw.to(DEV), gsb.to(DEV), group=group, config=cfg, act=act,
                    fp4=True, gs=gs).cpu()
        gate, up = y.reshape(m, n).to(DEV).chunk(2, dim=-1)
        assert torch.equal(yg.reshape(m, -1), gated_act(gate, up, act).cpu())
    with pytest.raises(ValueError, match="fp4"):
        T.q4tc(x.half().to(DEV), words.to(DEV), sb.half().to(DEV), group=group, fp4=True)
    with pytest.raises(ValueError, match="global scale"):
        T.q4tc(x.to(DEV), words.to(DEV), sb.to(DEV), group=group, gs=2.0)


@pytest.mark.parametrize("group", [32, 16])
def test_q4tc_fp4_sees_every_code_position(group):
    """One-hot x at k: y[row] = value(code[row, k]) exactly (unit scales), for each of a
    block's 64 positions and some later ones: a misplaced bit in `fp4_bits` or the
    extraction, or a lane's x in the wrong group column (nvfp4's 16-code groups), would show
    as a wrong value at its position."""
    n, k = 32, 1024
    codes, packed, s, w = _fp4(torch.Generator().manual_seed(2), n, k, group)
    from mlxr.quant.fp import code_table

    table = code_table("mxfp4", torch.device("cpu"))
    words, sb = T.fp4_bits(T.repack(packed)).to(DEV), _fp4_pairs(torch.ones_like(s)).to(DEV)
    for kk in list(range(64)) + [64, 300, 1023]:
        x = torch.zeros(k, dtype=torch.bfloat16)
        x[kk] = 1
        y = T.q4tc(x.to(DEV), words, sb, group=group, fp4=True).cpu().float()
        assert torch.equal(y, table[codes[:, kk].long()].float()), kk


def _fp8(g, n, k):
    """Random mxfp8 weight: E4M3 codes [N, K] uint8 (every code but the NaN ones 0x7F / 0xFF:
    zeros, subnormals, 448 among them), E8M0 scales' fp32 values [N, K/32], the fp64 weight."""
    from mlxr.quant.fp import code_table, scale_table

    codes = torch.randint(0, 254, (n, k), generator=g, dtype=torch.int32)
    codes = (codes + (codes >= 0x7F).int()).to(torch.uint8)  # skip 0x7F, and 0xFF (254 + 1)
    s = scale_table("mxfp8", torch.device("cpu"))[torch.randint(116, 126, (n, k // 32),
                                                                generator=g)]
    w = (code_table("mxfp8", torch.device("cpu"))[codes.long()].double().view(n, -1, 32)
         * s.double()[..., None]).view(n, k)
    return codes, s, w


def test_fp8_words_round_trip_and_extraction():
    """`fp8_words` / `fp8_unwords` round-trip; the kernel's extraction (its PTX's masks and
    shifts, here in torch) gives each step's 8 codes' E4M3 values x 2^-120 as bf16 bits,
    subnormals included, in the fragment order `repack` gives 4-bit codes."""
    from mlxr.ops.matmul.decode_gemv_tc_layout import fp8_unwords, lane_order
    from mlxr.quant.fp import code_table

    g = torch.Generator().manual_seed(8)
    codes, _, _ = _fp8(g, 32, 512)
    codes[0, :254] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F],
                                  dtype=torch.uint8)
    f = T.fp8_words(codes)
    assert f.shape == (2, 4 * 512) and torch.equal(fp8_unwords(f), codes)
    u = f.long() & 0xFFFFFFFF
    table = code_table("mxfp8", torch.device("cpu")).double()
    k2 = 2 * 512
    lane = lane_order(torch.arange(32 * 512).view(32, 512))  # [2, 2K, 8] flat code index
    for j in range(8):
        i, hi = j % 4, j // 4
        word = u[:, :k2] if i < 2 else u[:, k2:]
        r = (word & 0x87F087F0 if i % 2 == 0
             else ((word >> 4) & 0x07000700) | ((word << 4) & 0x80F080F0))
        half = (r >> (16 * hi)) & 0xFFFF
        v = (half << 16).to(torch.int32).view(torch.float32).double() * 2.0**120
        want = table[codes.view(-1)[lane[..., j].reshape(-1)].long()].view(2, k2)
        assert torch.equal(v, want), j


@pytest.mark.parametrize("m,act,n,k,cfg", [
    (1, None, 32, 512, None),
    (1, None, 48, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),  # rows past N, windows
    (1, None, 16, 3584, T.TcConfig(rt=1, u=1, num_warps=4, pf=2, unroll=2)),
    (3, None, 32, 1024, None),
    (1, "silu", 64, 1536, T.TcConfig(rt=2, u=1, num_warps=2)),
    (9, "gelu", 64, 1024, None),  # launches of 4 rows and a one-row launch
])
def test_q4tc_fp8(m, act, n, k, cfg):
    """mxfp8 weights through their fp8 copy (`q4tc(fp8=True)`): within rounding of fp64
    x @ W^T (E4M3 values times exact scales) and of the torch twin; a glu copy gives the plain
    launch followed by `gated_act` exactly."""
    from mlxr.ops.layer.norm_rope_act import gated_act

    g = torch.Generator().manual_seed(m * 1000 + n + k + 8)
    codes, s, w = _fp8(g, n, k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    words, sb = T.fp8_words(codes), _fp4_pairs(s)
    y = T.q4tc(x.to(DEV), words.to(DEV), sb.to(DEV), group=32, config=cfg, fp8=True).cpu()
    assert y.shape == ((n,) if m == 1 else (m, n))
    exact, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    err = (y.double() - exact).abs()
    assert bool((err <= 2**-7 * exact.abs() + 1e-5 * scale).all()), float((err / scale).max())
    twin = T.q4tc_ref(x, words, sb, group=32, fp8=True)
    assert (y.float() - twin.float()).abs().max() <= 2**-6 * twin.float().abs().max()
    if act is not None:
        perm = T.glu_rows(n)
        yg = T.q4tc(x.to(DEV), T.fp8_words(codes[perm]).to(DEV), _fp4_pairs(s[perm]).to(DEV),
                    group=32, config=cfg, act=act, fp8=True).cpu()
        gate, up = y.reshape(m, n).to(DEV).chunk(2, dim=-1)
        assert torch.equal(yg.reshape(m, -1), gated_act(gate, up, act).cpu())
    with pytest.raises(ValueError, match="fp8"):
        T.q4tc(x.half().to(DEV), words.to(DEV), sb.half().to(DEV), group=32, fp8=True)


def test_q4tc_fp8_sees_every_code_position():
    """One-hot x at k: y[row] = value(code[row, k]) exactly (unit scales), for each of a
    block's 64 positions and some later ones (a misplaced bit or word would show there)."""
    from mlxr.quant.fp import code_table

    n, k = 32, 1024
    codes, s, _ = _fp8(torch.Generator().manual_seed(3), n, k)
    table = code_table("mxfp8", torch.device("cpu"))
    words, sb = T.fp8_words(codes).to(DEV), _fp4_pairs(torch.ones_like(s)).to(DEV)
    for kk in list(range(64)) + [64, 300, 1023]:
        x = torch.zeros(k, dtype=torch.bfloat16)
        x[kk] = 1
        y = T.q4tc(x.to(DEV), words, sb, group=32, fp8=True).cpu().float()
        assert torch.equal(y, table[codes[:, kk].long()].bfloat16().float()), kk


@pytest.mark.parametrize("mode,gs", [("mxfp4", None), ("nvfp4", None), ("nvfp4", 3.5)])
@pytest.mark.parametrize("glu", [False, True])
def test_copy_dequant_of_fp4_is_dequant_fp(mode, gs, glu):
    """`dequant_copy(mode=...)` from an fp4 copy gives `dequant_fp`'s values from the MLX
    words bit for bit (E2M1 value x scale in fp32, nvfp4 times its global scale / 2688), in
    either row order; its torch twin too; the copy's codes come back as the words' codes.
    K = 640 leaves a partial column tile."""
    from mlxr.ops.matmul.decode_gemv_tc_layout import copy_rows_codes, dequant_copy_ref
    from mlxr.ops.matmul.prefill_dequant import dequant_copy, dequant_fp

    group = 32 if mode == "mxfp4" else 16
    n, k = 48, 640
    g = torch.Generator().manual_seed(len(mode) + glu + int(gs or 0))
    codes, packed, _, _ = _fp4(g, n, k, group)
    lo, hi = (116, 126) if mode == "mxfp4" else (1, 0x60)
    sc = torch.randint(lo, hi, (n, k // group), generator=g).to(torch.uint8)
    gst = None if gs is None else torch.tensor(gs)
    perm = T.glu_rows(n) if glu else torch.arange(n)
    copy = T.fp4_bits(T.repack(packed[perm]))
    want = dequant_fp(packed.to(DEV), sc.to(DEV), None if gst is None else gst.to(DEV), mode)
    got = dequant_copy(copy.to(DEV), sc.to(DEV), None, 4, group, 1, glu, mode=mode,
                       global_scale=None if gst is None else gst.to(DEV))
    assert torch.equal(got.cpu().view(torch.int16), want.cpu().view(torch.int16))
    twin = dequant_copy_ref(copy, sc, None, 4, group, 1, glu, mode=mode, global_scale=gst)
    assert torch.equal(twin.view(torch.int16), want.cpu().view(torch.int16))
    assert len(set(want[0].tolist())) > 4
    rows = torch.tensor([n - 1, 0, 9, n // 2 + 3])
    assert torch.equal(copy_rows_codes(copy, rows, 1, 4, glu, fp4=True), codes[rows])
    with pytest.raises(ValueError, match="dequant_copy"):
        dequant_copy(copy.to(DEV), sc.to(DEV), None, 4, 64 if group == 32 else 32, mode=mode)


@pytest.mark.parametrize("glu", [False, True])
def test_copy_dequant_of_fp8_is_dequant_fp(glu):
    """`dequant_copy(mode="mxfp8")` from an fp8 copy gives `dequant_fp`'s values from the MLX
    words bit for bit, in either row order; its torch twin too; the copy's codes come back as
    the words' codes. K = 640 leaves a partial column tile."""
    from mlxr.ops.matmul.decode_gemv_tc_layout import copy_rows_codes, dequant_copy_ref
    from mlxr.ops.matmul.prefill_dequant import dequant_copy, dequant_fp

    n, k = 48, 640
    g = torch.Generator().manual_seed(80 + glu)
    codes, _, _ = _fp8(g, n, k)
    packed = codes.view(torch.int32)
    sc = torch.randint(110, 135, (n, k // 32), generator=g).to(torch.uint8)
    perm = T.glu_rows(n) if glu else torch.arange(n)
    copy = T.fp8_words(codes[perm])
    want = dequant_fp(packed.to(DEV), sc.to(DEV), None, "mxfp8").cpu()
    got = dequant_copy(copy.to(DEV), sc.to(DEV), None, 8, 32, 1, glu, mode="mxfp8").cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    twin = dequant_copy_ref(copy, sc, None, 8, 32, 1, glu, mode="mxfp8")
    assert torch.equal(twin.view(torch.int16), want.view(torch.int16))
    assert len(set(want[0].tolist())) > 100
    rows = torch.tensor([n - 1, 0, 9, n // 2 + 3])
    assert torch.equal(copy_rows_codes(copy, rows, 1, 8, glu, fp8=True), codes[rows].int())
    with pytest.raises(ValueError, match="dequant_copy"):
        dequant_copy(copy.to(DEV), sc.to(DEV), None, 8, 32, 2, mode="mxfp8")
