"""mlxr.ops.matmul.decode_gemv_q4 (the 4-bit decode GEMV on repacked words) against its torch twin
and against fp64, under TRITON_INTERPRET=1 on the CPU (the H200 runs the same checks in
benchmarks/gpu/gpu_q4gemv_sweep.py)."""

from __future__ import annotations


import pytest
import torch


triton = pytest.importorskip("triton")

from mlxr.ops.matmul import decode_gemv_q4 as Q
from mlxr.ops.matmul.generic_qmm import dequant_f32

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU


def _weights(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    s = (torch.randn(n, k // group, generator=g) * 0.02).to(dtype)
    b = (torch.randn(n, k // group, generator=g) * 0.1).to(dtype)
    x = torch.randn(k, generator=g).to(dtype)
    return packed, s, b, x


def _exact(x, packed, s, b, group):
    """fp64 x @ dequant(W)^T over the MLX words (no rounding at all)."""
    w = dequant_f32(packed, s, b, None, "affine", 4, group).double()
    return x.double() @ w.t()


def test_repack_round_trip_and_layout():
    packed = torch.randint(-2**31, 2**31 - 1, (5, 256), dtype=torch.int32)
    r = Q.repack(packed)
    assert r.shape == packed.shape and r.dtype == torch.int32
    assert torch.equal(Q.unrepack(r), packed)
    # code 32c + 4j + e sits at nibble j of word 4c + e
    codes = ((packed.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 15).reshape(5, -1)
    for c, j, e in [(0, 0, 0), (0, 7, 3), (3, 2, 1), (63, 5, 2)]:
        assert int((r[4, 4 * c + e] >> (4 * j)) & 15) == int(codes[4, 32 * c + 4 * j + e])
    with pytest.raises(ValueError, match="multiple of 4"):
        Q.repack(packed[:, :6])


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,cfg", [
    (48, 1024, None),                       # one 128-word tile, 1 warp
    (37, 2048, Q.Q4Config(block_n=8, wt=128)),  # two tiles (prefetch), ragged last program
    (40, 3072, Q.Q4Config(block_n=4, wt=128)),  # three tiles, K not a power of two
    (16, 4096, Q.Q4Config(block_n=16, wt=256)),  # 2 warps
])
def test_q4gemv_matches_twin_and_fp64(group, dtype, n, k, cfg):
    packed, s, b, x = _weights(n, k, group, dtype, seed=n + k + group)
    words = Q.repack(packed)
    y = Q.q4gemv(x, words, s, b, group=group, config=cfg)
    # the same sums with (scale, bias) pairs read as one word, and with .cg weight loads
    assert torch.equal(Q.q4gemv(x, words, s, b, group=group, config=cfg,
                                sb=Q.pair_scales(s, b)), y)
    if cfg is not None:
        cg = Q.Q4Config(cfg.block_n, cfg.wt, cg=True)
        assert torch.equal(Q.q4gemv(x, words, s, b, group=group, config=cg), y)
    ref = Q.q4gemv_ref(x, words, s, b, group=group)
    exact = _exact(x, packed, s, b, group)
    assert y.dtype == dtype and y.shape == (n,)
    # the kernel's fp32 sums (offsets cancelled per column) are within ~1e-5 of the magnitude
    # of the products before the final rounding to x.dtype
    scale = (x.double().abs() @ dequant_f32(packed, s, b, None, "affine", 4, group).double()
             .abs().t())
    # The kernel's fp32 sums (offsets cancelled per column) stay within 1e-5 of sum |x||w|;
    # then one rounding to x.dtype. fp16 rounds to nearest in the interpreter too: half a unit
    # in the last place. The interpreter's fp32 -> bf16 cast truncates (the GPU rounds to
    # nearest), so bf16 gets one unit.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    tol = (ulp if dtype == torch.bfloat16 else ulp / 2) * exact.abs() + 1e-5 * scale
    err = (y.double() - exact).abs()
    assert bool((err <= tol).all()), float((err / scale).max())
    if dtype == torch.float16:  # same rounding as the fp32 twin nearly everywhere
        assert int((y == ref).sum()) >= 0.9 * y.numel()  # counted: 18 of 20 passes


def test_q4gemv_fp32_sums_before_rounding():
    """With the output in fp32-representable range the kernel's error is far below bf16's:
    compare the pre-rounding sums via float16 activations of small magnitude."""
    n, k, group = 32, 2048, 64
    packed, s, b, _ = _weights(n, k, group, torch.float16, seed=7)
    x = torch.full((k,), 8.0, dtype=torch.float16)  # same sign everywhere: no cancellation help
    y = Q.q4gemv(x, Q.repack(packed), s, b, group=group, config=Q.Q4Config(8, 128))
    exact = _exact(x, packed, s, b, group)
    assert bool(((y.double() - exact).abs() <= 2.0 ** -11 * exact.abs() + 1e-3).all())


def test_q4gemv_sees_every_code():
    """A test that can fail: one flipped code changes exactly its row."""
    n, k, group = 16, 1024, 64
    packed, s, b, x = _weights(n, k, group, torch.bfloat16, seed=3)
    s = s.abs() + 0.01  # no zero scale to hide the flip
    words = Q.repack(packed)
    y0 = Q.q4gemv(x, words, s, b, group=group)
    bad = words.clone()
    bad[5, 77] ^= 0x00F00000  # nibble 5 of one word
    y1 = Q.q4gemv(x, bad, s, b, group=group)
    diff = (y0 != y1).nonzero().flatten().tolist()
    assert diff == [5]
    assert torch.equal(y1, Q.q4gemv_ref(x, bad, s, b, group=group)) or torch.allclose(
        y1.float(), Q.q4gemv_ref(x, bad, s, b, group=group).float(), rtol=1e-2, atol=1e-3)


def test_q4gemv_rejects_bad_shapes():
    packed, s, b, x = _weights(8, 1024, 64, torch.bfloat16)
    words = Q.repack(packed)
    with pytest.raises(ValueError, match="K="):
        Q.q4gemv(x[:512], words, s, b, group=64)
    with pytest.raises(ValueError, match="scales"):
        Q.q4gemv(x, words, s[:, :8], b[:, :8], group=64)
    with pytest.raises(ValueError, match="sb"):
        Q.q4gemv(x, words, s, b, group=64, sb=Q.pair_scales(s, b)[:4])
    with pytest.raises(ValueError, match="16-bit"):
        Q.pair_scales(s.float(), b.float())
    with pytest.raises(ValueError, match="tile"):
        Q.q4gemv(x, words, s, b, group=64, config=Q.Q4Config(block_n=8, wt=256))
    assert not Q.supported(64, 1000, torch.bfloat16)
    assert not Q.supported(64, 1024, torch.float32)


def _prologue_args(pro, k, dtype, g):
    """x and the prologue's keyword arguments: norm (with / without the residual, gemma's
    offset) or act over [gate | up]."""
    if pro == "act":
        return torch.randn(2 * k, generator=g).to(dtype), {"act": "silu"}
    x = torch.randn(k, generator=g).to(dtype)
    kw = {"norm": (1.0 + 0.3 * torch.randn(k, generator=g)).to(dtype), "eps": 1e-6}
    if pro in ("norm_r", "norm_offset"):
        kw["r"] = torch.randn(k, generator=g).to(dtype)
        kw["h_out"] = torch.empty(k, dtype=dtype)
    if pro == "norm_offset":
        kw["offset"] = 1.0
    return x, kw


@pytest.mark.parametrize("pro", ["norm", "norm_r", "norm_offset", "act"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,cfg", [(24, 1024, None), (20, 2048, Q.Q4Config(4, 128))])
def test_prologue_matches_twin(pro, dtype, n, k, cfg):
    """The fused op before the projection (rms_norm(h + r) or act(gate) * up) gives the twin's
    x: y within what one unit of x's last place can move it, the residual bit for bit."""
    g = torch.Generator().manual_seed(n + k + len(pro))
    packed, s, b, _ = _weights(n, k, 64, dtype, seed=n * k)
    words = Q.repack(packed)
    x, kw = _prologue_args(pro, k, dtype, g)
    kw_ref = {**kw, "h_out": torch.empty_like(kw["h_out"])} if "h_out" in kw else kw
    y = Q.q4gemv(x, words, s, b, group=64, config=cfg, sb=Q.pair_scales(s, b), **kw)
    ref = Q.q4gemv_ref(x, words, s, b, group=64, **kw_ref).double()
    assert y.shape == (n,) and y.dtype == dtype
    scale = dequant_f32(packed, s, b, None, "affine", 4, 64).double().abs().sum(1)
    units = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    # f(x) is below 4 in magnitude here (the norm's output; act over N(0,1) inputs): a unit
    # in the last place of each x moves y by at most 4 units * sum |w|; then y's rounding
    err = (y.double() - ref).abs()
    assert bool((err <= 2 * units * ref.abs() + 4 * units * scale).all()), float(err.max())
    if dtype == torch.float16:  # the interpreter rounds fp16 to nearest, as torch does
        assert int((y.double() == ref).sum()) >= 0.9 * y.numel()  # 18 of 20 passes
        if "h_out" in kw:
            assert torch.equal(kw["h_out"], (x + kw["r"]).to(dtype))
            assert torch.equal(kw["h_out"], kw_ref["h_out"])


def test_prologue_changes_the_result():
    """A test that can fail: the norm and the act prologue each change y (against the plain
    GEMV of the same x), and the residual enters the norm."""
    g = torch.Generator().manual_seed(9)
    n, k = 16, 1024
    packed, s, b, _ = _weights(n, k, 64, torch.float16, seed=9)
    words = Q.repack(packed)
    x, kw = _prologue_args("norm_r", k, torch.float16, g)
    plain = Q.q4gemv(x, words, s, b, group=64)
    normed = Q.q4gemv(x, words, s, b, group=64, **kw)
    no_r = Q.q4gemv(x, words, s, b, group=64, norm=kw["norm"], eps=1e-6)
    assert not torch.allclose(plain.float(), normed.float(), atol=1e-2)
    assert not torch.allclose(no_r.float(), normed.float(), atol=1e-2)
    xa = torch.randn(2 * k, generator=g).to(torch.float16)
    assert not torch.allclose(Q.q4gemv(xa, words, s, b, group=64, act="silu").float(),
                              Q.q4gemv(xa[:k], words, s, b, group=64).float(), atol=1e-2)


def test_prologue_rejects_bad_arguments():
    packed, s, b, x = _weights(8, 1024, 64, torch.bfloat16)
    words = Q.repack(packed)
    nw = torch.ones(1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="h_out"):  # a residual needs its own output
        Q.q4gemv(x, words, s, b, group=64, norm=nw, r=x.clone())
    with pytest.raises(ValueError, match="h_out"):
        Q.q4gemv(x, words, s, b, group=64, norm=nw, r=x.clone(), h_out=x)
    with pytest.raises(ValueError, match="act"):
        Q.q4gemv(torch.cat([x, x]), words, s, b, group=64, act="relu6")
    with pytest.raises(ValueError, match="K="):  # act takes [gate | up]: 2K values
        Q.q4gemv(x, words, s, b, group=64, act="silu")


def test_repack_in_row_slices_is_the_same():
    packed = torch.randint(-2**31, 2**31 - 1, (37, 64), dtype=torch.int32)
    assert torch.equal(Q.repack(packed, chunk_bytes=64 * 8 * 4 * 5), Q.repack(packed))
