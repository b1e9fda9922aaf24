"""Triton fused ops (mlxr.ops.layer.norm_rope_act) vs their plain-torch references, CPU interpreter.

Fresh random data at small sizes; bf16 and fp32; rms offset 0/1; both rope layouts and partial
rotary; silu / gelu / gelu_tanh; attention with rep 1/2/4, T 1/3, S not a multiple of the tile,
sliding-window masks (holes), softcap on/off, single-pass and split (combine) paths.

Tolerances (elementwise, derived):
* fp32 outputs: the same fp32 operations in another order (sum of squares, FMA contraction,
  exp/erf/rsqrt implementations): |y - ref| <= 1e-5 * |ref| + 1e-6 (attention: 1e-5 * max|v|;
  gated_act: + 2^-20 |gate * up| for torch's cancelling 1 + erf / 1 + tanh at gate << 0).
* bf16 outputs: one bf16 ulp is <= 2^-7 |value|. The interpreter truncates fp32 -> bf16 (CUDA
  rounds to nearest), and a different fp32 intermediate may round the other way, so each
  rounding point may differ by 1 ulp: n * 2^-7 |ref| + 2^-20 for n rounding points. rope: 1;
  gated_act: 2 (act(gate), then the product); rms_norm: 2 (y, the product), 3 with an offset
  (weight + offset is rounded to the weight dtype: exact on CUDA, truncated by the interpreter).
* bf16 attention vs the reference run on fp32-upcast inputs (the exact answer; the bf16
  reference itself rounds q*scale and the scores to bf16): the kernel rounds p to bf16 before
  P.V (|err| <= 2^-7 sum p|v| <= 2^-7 max|v|) and the output once (2^-7 |out|). Leaks of masked
  keys are checked separately with NaN / huge values in the invisible slots.
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

from mlxr import ops
from mlxr.ops import reference as R
from mlxr.ops.kv_attention import masked as A
from mlxr.ops.layer import norm_rope_act as F

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

DTYPES = (torch.float32, torch.bfloat16)


def gen(seed) -> torch.Generator:
    """A generator seeded from any (repr-able) case key: reproducible across runs."""
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


def check(out: torch.Tensor, ref: torch.Tensor, rel: float, abs_: float = 0.0) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    err = (o - r).abs()
    tol = rel * r.abs() + abs_
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} / {bad.numel()} over tol; max err {err.max():.3g}"


# ---------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(3, 200), (1, 1024), (2, 5, 48)])
def test_rms_norm(dtype, offset, shape):
    g = gen((str(dtype), offset, shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype)
    out = F.rms_norm(x, w, 1e-5, offset)
    ref = R.rms_norm(x, w, 1e-5, offset)
    if dtype == torch.float32:
        check(out, ref, 1e-5, 1e-6)
    else:  # roundings: y, the product, and (interpreter only: it truncates) weight + offset
        check(out, ref, (3 if offset else 2) * 2**-7, 2**-20)


def test_rms_norm_strided_and_promoted():
    """q/k straight out of a fused qkv split (strided [N, H, D] view); fp32 weight on bf16 x."""
    g = gen(1)
    qkv = torch.randn(3, 4 * 32 + 64, generator=g).to(torch.bfloat16)
    q = qkv[:, :128].reshape(3, 4, 32)
    assert not q.is_contiguous()
    w = torch.randn(32, generator=g).to(torch.bfloat16)
    check(F.rms_norm(q, w, 1e-6, 1.0), R.rms_norm(q, w, 1e-6, 1.0), 3 * 2**-7, 2**-20)
    w32 = torch.randn(32, generator=g)
    out, ref = F.rms_norm(q, w32, 1e-6), R.rms_norm(q, w32, 1e-6)
    assert out.dtype == torch.float32
    check(out, ref, 2**-7, 1e-6)  # y rounded to bf16 once (1 ulp), fp32 product


def test_rms_norm_wide_row():
    g = gen(2)
    x = torch.randn(2, 16384, generator=g)
    w = torch.rand(16384, generator=g)
    check(F.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6), 1e-5, 1e-6)


def trunc_bf16(x32: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 as the interpreter casts (truncation; CUDA rounds to nearest)."""
    return (x32.contiguous().view(torch.int32) & -65536).view(torch.float32)


def interp_exact(out: torch.Tensor, emu: torch.Tensor, abs_=2**-30) -> None:
    """The reference's rounding points replayed with the interpreter's truncating cast. Most
    elements match exactly; the rest are fp32 ulps of rsqrt/erf/exp crossing a truncation
    boundary (frequent where act(g) == g exactly, phi = 1: measured 93-100% exact), <= 1 ulp per
    rounding point. Skipping or adding a rounding point leaves only 45-78% exact."""
    o = out.float()
    assert ((o - emu).abs() <= 2 * 2**-7 * emu.abs() + abs_).all()
    assert (o == emu).float().mean() > 0.9


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_rounding_points(offset):
    g = gen(("rms-exact", offset))
    x = (torch.randn(4, 256, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(256, generator=g).to(torch.bfloat16)
    x32 = x.float()
    y = trunc_bf16(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))
    w32 = trunc_bf16(w.float() + offset) if offset else w.float()
    interp_exact(F.rms_norm(x, w, 1e-5, offset), trunc_bf16(y * w32))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "sigmoid"])
def test_gated_act_rounding_points(act):
    g = gen(("act-exact", act))
    gate = (torch.randn(2, 1024, generator=g) * 3).to(torch.bfloat16)
    up = (torch.randn(2, 1024, generator=g) * 3).to(torch.bfloat16)
    a = R.gated_act(gate.float(), torch.ones(()), act)  # act in fp32
    interp_exact(F.gated_act(gate, up, act), trunc_bf16(trunc_bf16(a) * up.float()),
                 2**-20 * (gate.float() * up.float()).abs() + 2**-30)  # see test_gated_act


# ---------------------------------------------------------------------------- rope
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("t,h,d,r", [(1, 4, 64, 32), (3, 5, 64, 16), (2, 3, 80, 20)])
def test_rope(dtype, traditional, t, h, d, r):
    g = gen((str(dtype), traditional, t, h, d, r))
    x = (torch.randn(t, h, d, generator=g) * 2).to(dtype)
    ang = torch.rand(t, r, generator=g) * 100
    cos, sin = ang.cos(), ang.sin()
    out = F.rope(x, cos, sin, traditional)
    ref = R.rope(x, cos, sin, traditional)
    if dtype == torch.float32:
        check(out, ref, 1e-5, 1e-6)
    else:
        check(out, ref, 2**-7, 2**-20)
    assert torch.equal(out[..., 2 * r:], x[..., 2 * r:])  # pass-through is bit exact


def test_rope_strided_input():
    g = gen(3)
    qkv = torch.randn(2, 6 * 16, generator=g)
    k = qkv[:, 64:].reshape(2, 2, 16)
    ang = torch.rand(2, 8, generator=g) * 10
    check(F.rope(k, ang.cos(), ang.sin(), False), R.rope(k, ang.cos(), ang.sin(), False),
          1e-5, 1e-6)


# ---------------------------------------------------------------------------- gated_act
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "sigmoid"])
def test_gated_act(dtype, act):
    g = gen((str(dtype), act))
    gu = (torch.randn(3, 2 * 1100, generator=g) * 4).to(dtype)
    gate, up = gu[:, :1100], gu[:, 1100:]  # strided halves of a fused gate_up output
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3], dtype=dtype)  # saturation, 0
    out = F.gated_act(gate, up, act)
    ref = R.gated_act(gate, up, act)
    # act(g) = g * phi(g), phi in [0, 1]; torch forms phi as 1 + erf / 1 + tanh, which cancels
    # for g << 0 (absolute error a few fp32 eps; its bf16 CPU path even flushes to 0 there,
    # the kernel's x * sigmoid(2z) does not): allow 2^-20 |g * u| on top.
    gu_abs = (gate.float() * up.float()).abs()
    if dtype == torch.float32:
        check(out, ref, 1e-5, 2**-20 * gu_abs)
    else:
        check(out, ref, 2 * 2**-7, 2**-20 * gu_abs + 2**-20)


def test_gated_act_rejects_unknown():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError):
        F.gated_act(x, x, "relu2")


# ---------------------------------------------------------------------------- attention
def attn_case(seed, dtype, t, kh, rep, s, d, window, flat=False):
    g = gen(seed)
    q = torch.randn(t, kh * rep, d, generator=g).to(dtype)
    k = torch.randn(kh, s, d, generator=g).to(dtype)
    v = torch.randn(kh, s, d, generator=g).to(dtype)
    pos = torch.arange(s - 20, s - 20 + t)  # the queries' positions; keys past them invisible
    key = torch.arange(s)
    vis = key[None, :] <= pos[:, None]
    if window is not None:
        vis &= pos[:, None] - key[None, :] < window
        vis[:, 0] = True  # e.g. an attention sink; gives a hole between key 0 and the window
    if flat:
        vis = vis[0]  # the [S] form (t == 1)
    return q, k, v, vis


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("window", [None, 37])
def test_attention_masked(dtype, rep, t, softcap, window):
    kh, s, d = 2, 150, 32
    seed = (str(dtype), rep, t, softcap, window)
    q, k, v, vis = attn_case(seed, dtype, t, kh, rep, s, d, window, t == 1 and rep != 2)
    scale = d ** -0.5 * 2
    exact = R.attention_masked(q.float(), k.float(), v.float(), vis, scale, softcap)
    for block_s, splits in ((16, 1), (16, 3), (32, 64)):  # single pass, 3 splits, 1 tile each
        out = A.attention_masked_split(q, k, v, vis, scale, softcap, block_s, splits)
        assert out.dtype == dtype and out.shape == q.shape
        vmax = v.float().abs().amax(dim=1).repeat_interleave(rep, 0)  # [H, D] per kv head
        _check_attention(out, exact, vmax)
        if dtype != torch.float32:  # and near the bf16 reference (which itself rounds
            # q*scale and q.k to bf16)
            ref = R.attention_masked(q, k, v, vis, scale, softcap).float()
            assert (out.float() - ref).abs().max() < 0.05 * float(vmax.max())


def _check_attention(out, exact, vmax):
    """An attention kernel's output against the fp32 reference: within 1e-5 of the values'
    range for fp32 inputs, else 2^-7 of (|v| max per head + |exact|) elementwise."""
    if out.dtype == torch.float32:
        check(out, exact, 0.0, 1e-5 * float(vmax.max()))
    else:
        o, e = out.float(), exact
        tol = 2**-7 * (vmax.amax(-1)[None, :, None] + e.abs())
        assert ((o - e).abs() <= tol).all(), float((o - e).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [256, 512])
def test_attention_wide_heads(dtype, d, monkeypatch):
    """Gemma 4's 512-wide full-attention heads and 256-wide sliding ones, decode (t = 1, the
    graph's attention_at) and a 3-row chunk, single pass and split: over 256 the q.k dot goes
    by 128-wide slices (`wide_head`), equal to the one-dot launch (MLXR_ATTN_DK=0) within the
    fp32 reordering bound, and both within the module's bounds of the fp32 reference."""
    kh, rep_, s = 1, 2, 70
    for t in (1, 3):
        q, k, v, vis = attn_case(("wide", str(dtype), d, t), dtype, t, kh, rep_, s, d, None)
        pos = torch.tensor([s - 1, 40, 5][:t])
        exact = R.attention_at(q.float(), k.float(), v.float(), pos, None, 1.0)
        vmax = v.float().abs().amax(dim=1).repeat_interleave(rep_, 0)
        for splits in (1, 3):
            out = A.attention_masked_split(q, k, v, None, 1.0, None, None, splits,
                                           positions=pos)
            _check_attention(out, exact, vmax)
            if d > 256:
                monkeypatch.setenv("MLXR_ATTN_DK", "0")
                one = A.attention_masked_split(q, k, v, None, 1.0, None, None, splits,
                                               positions=pos)
                monkeypatch.delenv("MLXR_ATTN_DK")
                if dtype == torch.float32:
                    check(out, one, 0.0, 1e-5 * float(vmax.max()))
    assert A.wide_head(512) == (128, 4, 8) and A.wide_head(256) == (256, 1, 4)


def test_attention_default_policy_and_odd_head_dim():
    """The public entry (auto split), a non-power-of-two D and S % tile != 0."""
    q, k, v, vis = attn_case(5, torch.float32, 1, 2, 2, 333, 48, None)
    out = A.attention_masked(q, k, v, vis, 0.2)
    check(out, R.attention_masked(q, k, v, vis, 0.2), 0.0, 1e-5 * float(v.abs().max()))


def test_attention_launch_policy(monkeypatch):
    """Decode launch (8 kv heads, one row block): splits for ~256 programs below 4096 keys, ~512
    from there (the long-context sweep's winner); the env switches override both knobs."""
    monkeypatch.delenv("MLXR_ATTN_PROGRAMS", raising=False)
    monkeypatch.delenv("MLXR_ATTN_BLOCK_S", raising=False)
    assert [A.attn_splits(s, 8, 1) for s in (1024, 2048, 4095, 4096, 16384)] == [32] * 3 + [64] * 2
    assert A.attn_splits(4096, 32, 2) == 8 and A.attn_block_s(128) == 64
    assert A.attn_block_s(256) == 32
    monkeypatch.setenv("MLXR_ATTN_PROGRAMS", "256")
    monkeypatch.setenv("MLXR_ATTN_BLOCK_S", "128")
    assert A.attn_splits(16384, 8, 1) == 32 and A.attn_block_s(128) == 128


@pytest.mark.parametrize("splits", [1, 4])
def test_attention_masked_keys_contribute_nothing(splits):
    """Invisible slots hold NaN / inf / huge values (stale cache): no effect on the output."""
    q, k, v, vis = attn_case(7, torch.float32, 3, 2, 2, 96, 32, 30)
    seen = vis.any(0)
    k2, v2 = k.clone(), v.clone()
    k2[:, ~seen] = float("nan")
    v2[:, ~seen] = float("inf")
    v2[:, (~seen).nonzero()[::2, 0]] = 1e30
    out = A.attention_masked_split(q, k2, v2, vis, 0.3, None, 16, splits)
    ref = R.attention_masked(q, k, v, vis, 0.3)
    check(out, ref, 0.0, 1e-5 * float(v.abs().max()))
    # a key masked for one row but seen by another: huge values must not leak either
    v3 = v.clone()
    only_last = vis[-1] & ~vis[0]
    assert only_last.any()
    v3[:, only_last] = 1e6
    out = A.attention_masked_split(q, k, v3, vis, 0.3, None, 16, splits)
    ref = R.attention_masked(q, k, v3, vis, 0.3)
    check(out[:1], ref[:1], 0.0, 1e-5 * float(v.abs().max()))


def test_attention_fully_masked_row_is_zero_not_nan():
    q, k, v, vis = attn_case(9, torch.float32, 2, 1, 2, 40, 16, None)
    vis = vis.clone()
    vis[1] = False
    for splits in (1, 3):
        out = A.attention_masked_split(q, k, v, vis, 0.25, None, 16, splits)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


# ---------------------------------------------------------------------------- dispatch
def test_dispatch_cpu_is_reference():
    x = torch.randn(2, 8)
    assert torch.equal(ops.rms_norm(x, torch.ones(8), 1e-5), R.rms_norm(x, torch.ones(8), 1e-5))
    assert not ops._fast(x)


def test_dispatch_cuda_flag(monkeypatch):
    class FakeCuda:
        is_cuda = True

    monkeypatch.delenv("MLXR_KERNELS", raising=False)
    assert ops._fast(FakeCuda())
    monkeypatch.setenv("MLXR_KERNELS", "torch")
    assert not ops._fast(FakeCuda())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("window", [None, 37, 1])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_attention_at_positions(dtype, t, window, softcap):
    """`attention_at` (the visibility computed from the rows' positions in the kernel) gives
    the masked kernel's output for the mask `reference.attention_at` builds, bit for bit,
    single pass and split; NaN in every slot past the last position never reaches it."""
    kh, rep, s, d = 2, 2, 150, 32
    q, k, v, _ = attn_case(("at", str(dtype), t, window, softcap), dtype, t, kh, rep, s, d,
                           None)
    pos = torch.tensor([101, 3, 130][:t])
    ref = R.attention_at(q.float(), k.float(), v.float(), pos, window, 0.3, softcap)
    k[:, 131:] = float("nan")  # stale slots past every position
    v[:, 131:] = float("nan")
    j = torch.arange(s)
    vis = (j <= pos[:, None]) & (True if window is None else pos[:, None] - j < window)
    for block_s, splits in ((16, 1), (16, 3), (32, 64)):
        out = A.attention_masked_split(q, k, v, None, 0.3, softcap, block_s, splits,
                                       positions=pos, window=window)
        want = A.attention_masked_split(q, k, v, vis, 0.3, softcap, block_s, splits)
        assert torch.isfinite(out).all()
        assert torch.equal(out, want)
    vmax = v[:, :131].float().abs().amax(dim=1).repeat_interleave(rep, 0)
    _check_attention(A.attention_at(q, k, v, pos, window, 0.3, softcap), ref, vmax)


def test_attention_at_rejects_bad_positions():
    q, k, v, _ = attn_case("at-bad", torch.float32, 2, 1, 2, 40, 16, None)
    with pytest.raises(ValueError, match="positions"):
        A.attention_at(q, k, v, torch.tensor([3]), None, 0.3)
    with pytest.raises(ValueError, match="window"):
        A.attention_at(q, k, v, torch.tensor([3, 4]), 0, 0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,window", [(1, None), (3, 37)])
def test_attention_sinks(dtype, t, window):
    """gpt-oss's sinks [H] (one more logit per head, no value) in the kernel, single pass and
    split (the sink counted once, in the first split), vs `reference.attention_at` with the
    same sinks; tolerance: `_check_attention`'s. A large sink (8) moves the output visibly:
    the same call without sinks is far from the reference."""
    kh, rep, s, d = 2, 2, 150, 32
    q, k, v, _ = attn_case(("sink", str(dtype), t, window), dtype, t, kh, rep, s, d, None)
    sinks = torch.linspace(-2.0, 8.0, kh * rep).to(dtype)
    pos = torch.tensor([101, 3, 130][:t])
    ref = R.attention_at(q.float(), k.float(), v.float(), pos, window, 0.3, None, sinks)
    vmax = v[:, :131].float().abs().amax(dim=1).repeat_interleave(rep, 0)
    for block_s, splits in ((16, 1), (16, 3)):
        out = A.attention_masked_split(q, k, v, None, 0.3, None, block_s, splits,
                                       positions=pos, window=window, sinks=sinks)
        _check_attention(out, ref, vmax)
    plain = A.attention_at(q, k, v, pos, window, 0.3)
    assert (plain.float() - ref).abs().max() > 0.05
