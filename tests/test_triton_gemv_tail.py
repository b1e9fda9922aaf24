"""The decode GEMVs' residual tail (mlxr.ops.layer.residual_tail, MLXR_GEMV_TAIL=1): q4gemv and
q4tc with the residual step in their last program vs the same GEMV without it followed by the
standalone Triton kernels (`add_norm_qkv_rope.add_rms_norm`, `residual_norm.residual_norm`),
under the CPU interpreter, on fresh random data; and the decoders on it.

y is the same GEMV code with or without the tail, so the residual h' (a rounded add of the
same values, or the same norm of y added) must equal the standalone kernel's bit for bit
except where the norm's sum of squares (one tl.sum over the row here, a row of a 2-D tile
there) rounds its last bit apart: then one ulp of the dtype on some elements; x likewise one
more ulp. Every launch leaves the ticket counter at zero.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from test_triton_q4gemv import _weights  # noqa: E402

from mlxr.ops import reference as R  # noqa: E402
from mlxr.ops import tickets  # noqa: E402
from mlxr.ops.layer import add_norm_qkv_rope as A  # noqa: E402
from mlxr.ops.layer import residual_norm as RN  # noqa: E402
from mlxr.ops.layer import residual_tail as T  # noqa: E402
from mlxr.ops.matmul import decode_gemv_q4 as Q  # noqa: E402
from mlxr.ops.matmul import decode_gemv_tc as TC  # noqa: E402

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

DTYPES = (torch.bfloat16, torch.float16)


def _residual(n: int, dtype: torch.dtype, seed: int, m: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, n, generator=g) * 3).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    s = (torch.rand(1, generator=g) + 0.5).to(dtype)
    w2 = torch.randn(n, generator=g).to(dtype)
    return h, w, s, w2


def _standalone(mode, y, h, w, s, w2, offset=0.0):
    if mode == T.ADD_NORM:
        return A.add_rms_norm(h, y, w, 1e-6, offset)
    return RN.residual_norm(h, y, w, 1e-6, s, w2)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for last-bit differences of the norm statistic: one ulp, on few elements."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    ulp = 2.0**-7 if got.dtype == torch.bfloat16 else 2.0**-10
    err = (got.float() - ref.float()).abs()
    assert bool((err <= ulp * ref.float().abs() + 1e-6).all()), float(err.max())
    assert int((got == ref).sum()) >= 0.9 * got.numel()


def _counters_zero() -> None:
    assert int(tickets.counters(torch.device("cpu"), tickets.RESIDUAL).abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset,scaled,nxt", [
    (T.ADD_NORM, 0.0, False, False), (T.ADD_NORM, 1.0, False, False),
    (T.SANDWICH, 0.0, True, True), (T.SANDWICH, 0.0, False, False)])
@pytest.mark.parametrize("n,k,cfg", [(48, 1024, Q.Q4Config(block_n=8, wt=128)),
                                     (40, 2048, Q.Q4Config(block_n=16, wt=128))])
@pytest.mark.parametrize("chunk", [1024, 16])  # 16: the last program walks rows in 3 chunks
def test_q4gemv_tail(monkeypatch, dtype, mode, offset, scaled, nxt, n, k, cfg, chunk):
    monkeypatch.setattr(T, "CHUNK", chunk)
    packed, sc, b, x = _weights(n, k, 64, dtype, seed=n + k)
    words = Q.repack(packed)
    h, w, s, w2 = _residual(n, dtype, n + mode)
    s, w2 = (s if scaled else None), (w2 if nxt else None)
    y = Q.q4gemv(x, words, sc, b, group=64, config=cfg)
    ref_h, ref_x = _standalone(mode, y.view(1, n), h, w, s, w2, offset)
    tail = T.new_tail(mode, h, w, 1e-6, offset, s, w2)
    y2 = Q.q4gemv(x, words, sc, b, group=64, config=cfg, tail=tail)
    assert torch.equal(y2, y)
    _close(tail.h_out, ref_h)
    assert (tail.x_out is None) == (ref_x is None)
    if ref_x is not None:
        _close(tail.x_out, ref_x)
    _counters_zero()
    # and the plain-torch twin: q4gemv_ref, then the reference op. y may differ by two ulps
    # (fp32 order, and the interpreter truncates bf16 casts where torch rounds to nearest),
    # then each rounding point by one: h' (up to 4 points) within 6, x (2 more) within 8
    twin_y = Q.q4gemv_ref(x, words, sc, b, group=64).view(1, n)
    if mode == T.ADD_NORM:
        tw_h, tw_x = R.add_rms_norm(h, twin_y, w, 1e-6, offset)
    else:
        tw_h, tw_x = R.residual_norm(h, twin_y, w, 1e-6, s, w2)
    _near(tail.h_out, tw_h, 6)
    if tw_x is not None:
        _near(tail.x_out, tw_x, 8)


def _near(got: torch.Tensor, ref: torch.Tensor, ulps: int) -> None:
    """Within `ulps` units of the dtype at each row's largest value."""
    ulp = 2.0**-7 if got.dtype == torch.bfloat16 else 2.0**-10
    tol = ulps * ulp * ref.float().abs().amax(-1, keepdim=True)
    assert bool(((got.float() - ref.float()).abs() <= tol).all())


def test_tail_argument_checks():
    h, w, s, w2 = _residual(64, torch.bfloat16, 1)
    assert T.takes(T.ADD_NORM, h, w)
    assert not T.takes(T.ADD_NORM, h, w, scalar=s)  # no scalar in a pre-norm add
    assert not T.takes(T.SANDWICH, h, w, offset=1.0)
    assert not T.takes(T.ADD_NORM, h, w[:32])
    assert not T.takes(T.ADD_NORM, h.float(), w)
    packed, sc, b, x = _weights(32, 1024, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="tail"):
        Q.q4gemv(x, Q.repack(packed), sc, b, group=64, tail=T.new_tail(T.ADD_NORM, h, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset,scaled,nxt", [
    (T.ADD_NORM, 0.0, False, False), (T.SANDWICH, 0.0, True, True)])
@pytest.mark.parametrize("m", [1, 3])  # 3 rows: padded to 4 in the launch, the tail takes 3
def test_q4tc_tail(dtype, mode, offset, scaled, nxt, m):
    n, k = 64, 1024  # 4 row tiles of 16: several programs at rt 1
    packed, sc, b, _ = _weights(n, k, 64, dtype, seed=m + 7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    words, sb = TC.repack(packed), Q.pair_scales(sc, b)
    cfg = TC.default_config(n, k, m)
    cfg = dataclasses.replace(cfg, rt=1)
    h, w, s, w2 = _residual(n, dtype, 11 * m + mode, m)
    s, w2 = (s if scaled else None), (w2 if nxt else None)
    y = TC.q4tc(x, words, sb, group=64, config=cfg).view(m, n)
    ref_h, ref_x = _standalone(mode, y, h, w, s, w2, offset)
    tail = T.new_tail(mode, h, w, 1e-6, offset, s, w2)
    y2 = TC.q4tc(x, words, sb, group=64, config=cfg, tail=tail).view(m, n)
    assert torch.equal(y2, y)
    _close(tail.h_out, ref_h)
    if ref_x is not None:
        _close(tail.x_out, ref_x)
    _counters_zero()
    with pytest.raises(ValueError, match="tail"):
        TC.q4tc(x, words, sb, group=64, config=cfg, act="silu", tail=tail)
