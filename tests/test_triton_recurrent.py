"""Triton gated DeltaNet kernels (mlxr.ops.recurrent.gated_delta_scan) vs their torch twins
(mlxr.ops.recurrent.reference), CPU interpreter, fresh random data.

Cases: decode (T = 1) and prefill (T = 7), value heads sharing key heads (rep 2) or not, value
dims that are not a power of two (masked tiles), strided q/k/v views as the mixer passes them
(splits of one projection), a non-zero incoming state, bf16 and float32.

Tolerances (derived):
* gated_delta, float32: both compute the same float32 steps; only the order of the two Dk-term
  sums per token differs (tree vs torch's), each off by <= Dk * 2^-24 of the sum of |terms|.
  |k| = 1 and g, beta in (0, 1) keep the state bounded by its start plus |v|, and an error
  made at one token is carried, not amplified (I - beta k k^T contracts). With Dk = 32 and
  T = 7: <= 7 * 32 * 2^-24 ~ 1.4e-5 of the scale; checked at 2e-5 * max|ref| + 1e-6.
* gated_delta, bf16 y: that, plus the one rounding of y to bf16, where the two sides may
  differ by 2 ulps (<= 2 * 2^-7 |ref|: the interpreter truncates, torch rounds to nearest).
  The state is float32 in both modes.
* conv1d_silu: the taps are summed in the same order (FMA contraction may change the last
  bit): float32 1e-6 of the sum of |terms|; bf16 rounds twice (the conv, then SiLU), see the
  test for how the first rounding carries through SiLU.
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

from mlxr.ops.recurrent import reference as R  # noqa: E402
from mlxr.ops.recurrent import gated_delta_scan as K  # noqa: E402

INTERPRETER_ONLY = True

ULP = 2.0**-7


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _inputs(bsz, t, hk, hv, dk, dv, dtype, g):
    # one projection's output, split as the mixer does: strided views
    proj = torch.randn(bsz, t, 2 * hk * dk + hv * dv, generator=g).to(dtype)
    q, k, v = proj.split([hk * dk, hk * dk, hv * dv], -1)
    q, k = R.l2norm_qk(q.reshape(bsz, t, hk, dk), k.reshape(bsz, t, hk, dk))
    v = v.reshape(bsz, t, hv, dv)
    gate = torch.rand(bsz, t, hv, generator=g) * 0.9 + 0.05
    beta = torch.rand(bsz, t, hv, generator=g).to(dtype)
    state = torch.randn(bsz, hv, dv, dk, generator=g) * 0.5
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("prefetch", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("hk,hv,dv", [(2, 4, 48), (2, 2, 32)])
def test_gated_delta_matches_reference(dtype, t, hk, hv, dv, prefetch, monkeypatch):
    """Both load orders of the kernel (MLXR_GDN_PREFETCH) against the twin."""
    monkeypatch.setenv("MLXR_GDN_PREFETCH", prefetch)
    g = _gen(dtype, t, hk, hv, dv)
    q, k, v, gate, beta, state = _inputs(2, t, hk, hv, 32, dv, dtype, g)
    s, s_ref = state.clone(), state.clone()  # each updated in place
    y = K.gated_delta(q, k, v, gate, beta, s)
    y_ref = R.gated_delta(q, k, v, gate, beta, s_ref)
    assert y.dtype == dtype and not torch.equal(s, state)
    s_tol = 2e-5 * s_ref.abs().max() + 1e-6
    assert (s - s_ref).abs().max() <= s_tol
    y_tol = 2e-5 * y_ref.float().abs().max() + 1e-6
    if dtype == torch.bfloat16:
        y_tol = y_tol + 2 * ULP * y_ref.float().abs()
    assert ((y.float() - y_ref.float()).abs() <= y_tol).all()


def test_gated_delta_prefetch_is_the_same_arithmetic(monkeypatch):
    """The prefetching kernel's y and state equal the other order's bit for bit (also with
    MLXR_GDN_BLOCK_V's narrower programs, here in the interpreter's numpy sums)."""
    q, k, v, gate, beta, state = _inputs(2, 9, 2, 4, 32, 48, torch.bfloat16, _gen("pf"))
    out = []
    for flag, block in (("0", ""), ("1", ""), ("1", "16")):
        monkeypatch.setenv("MLXR_GDN_PREFETCH", flag)
        monkeypatch.setenv("MLXR_GDN_BLOCK_V", block)
        s = state.clone()
        out.append((K.gated_delta(q, k, v, gate, beta, s), s))
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[2]))


@pytest.mark.parametrize("dk,env,want", [
    (128, {}, (2, 1)),  # the checkpoints' key width: 2 rows over 1 warp (the H100 sweeps)
    (64, {}, (16, 4)), (32, {}, (32, 4)), (256, {}, (8, 4)),  # elsewhere: 1024 / Dk rows
    (128, {"MLXR_GDN_BLOCK_V": "32"}, (32, 4)),  # the sweep's old launch stays 4 warps
    (128, {"MLXR_GDN_BLOCK_V": "2", "MLXR_GDN_WARPS": "4"}, (2, 4)),
    (128, {"MLXR_GDN_WARPS": "2"}, (2, 2))])
def test_gated_delta_launch_shape(monkeypatch, dk, env, want):
    for name in ("MLXR_GDN_BLOCK_V", "MLXR_GDN_WARPS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert K.launch_shape(dk) == want


def test_gated_delta_narrow_launch_at_the_checkpoints_width(monkeypatch):
    """Dk = Dv = 128 (2 value rows a program by default): the twin's values, and the wider
    launch's bits (8 rows over 4 warps; here in the interpreter's numpy sums)."""
    q, k, v, gate, beta, state = _inputs(1, 5, 2, 4, 128, 128, torch.bfloat16,
                                         _gen("narrow"))
    out = []
    for block, warps in (("", ""), ("8", "4")):
        monkeypatch.setenv("MLXR_GDN_BLOCK_V", block)
        monkeypatch.setenv("MLXR_GDN_WARPS", warps)
        s = state.clone()
        out.append((K.gated_delta(q, k, v, gate, beta, s), s))
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))
    s_ref = state.clone()
    y_ref = R.gated_delta(q, k, v, gate, beta, s_ref)
    assert (out[0][1] - s_ref).abs().max() <= 2e-5 * s_ref.abs().max() + 1e-6
    y_tol = 2e-5 * y_ref.float().abs().max() + 1e-6 + 2 * ULP * y_ref.float().abs()
    assert ((out[0][0].float() - y_ref.float()).abs() <= y_tol).all()


def test_gated_delta_chunks_compose():
    """Two calls (T = 3, then T = 4) carrying the state equal one call over T = 7."""
    g = _gen("chunks")
    q, k, v, gate, beta, state = _inputs(1, 7, 2, 4, 32, 32, torch.float32, g)
    s, s2 = state.clone(), state.clone()
    y = K.gated_delta(q, k, v, gate, beta, s)
    y1 = K.gated_delta(q[:, :3], k[:, :3], v[:, :3], gate[:, :3], beta[:, :3], s2)
    y2 = K.gated_delta(q[:, 3:], k[:, 3:], v[:, 3:], gate[:, 3:], beta[:, 3:], s2)
    assert torch.allclose(torch.cat((y1, y2), 1), y, rtol=0, atol=1e-6)
    assert torch.allclose(s2, s, rtol=0, atol=1e-6)


def test_gated_delta_refuses_a_state_it_cannot_update():
    q, k, v, gate, beta, state = _inputs(1, 1, 2, 2, 32, 32, torch.float32, _gen("bad"))
    for bad in (state.bfloat16(), state.transpose(2, 3)):
        for f in (K.gated_delta, R.gated_delta):
            with pytest.raises(ValueError, match="contiguous float32"):
                f(q, k, v, gate, beta, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 19])
def test_conv1d_silu_matches_reference(dtype, t):
    g = _gen("conv", dtype, t)
    c, w = 200, 4  # channels not a multiple of the block
    x = torch.randn(2, t, c + 8, generator=g).to(dtype)[..., 8:]  # a strided view
    state = torch.randn(2, w - 1, c, generator=g).to(dtype)
    weight = torch.randn(c, w, generator=g).to(dtype)
    y, ns = K.conv1d_silu(x, state, weight)
    y_ref, ns_ref = R.conv1d_silu(x, state, weight)
    assert torch.equal(ns, ns_ref)
    seq = torch.cat((state, x), 1).float()
    mag = sum(seq[:, j:j + t].abs() * weight[:, j].float().abs() for j in range(w))
    tol = 1e-6 * mag + 1e-7
    if dtype == torch.bfloat16:
        # the conv output a is rounded before SiLU, then SiLU's output: at each point the two
        # sides may differ by 2 ulps (<= 2 * 2^-7 |value|: the interpreter truncates, torch
        # rounds to nearest); the first difference reaches the output scaled by |silu'|
        # (taken at both ends of the interval)
        a = sum(seq[:, j:j + t] * weight[:, j].float() for j in range(w))

        def dsilu(z):
            s = torch.sigmoid(z)
            return (s * (1 + z * (1 - s))).abs()

        slope = torch.maximum(dsilu(a * (1 - ULP)), dsilu(a * (1 + ULP)))
        tol = tol * 2 + 2 * ULP * (a.abs() * slope + y_ref.float().abs()) + 2.0**-20
    assert ((y.float() - y_ref.float()).abs() <= tol).all()
