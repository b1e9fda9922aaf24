"""The chunked gated delta rule (mlxr.ops.recurrent.gated_delta_chunked: Triton, the
interpreter) vs its torch twin (reference.gated_delta_chunked) and both vs the sequential
reference (reference.gated_delta, mlx-lm's order), on fresh random data.

Cases: T below one chunk, exactly one, and not a multiple of 64 (two chunks, the second
partial); value heads sharing key heads (rep 2) or not; a value dim that is not a power of two
(masked tiles); strided q/k/v views as the mixer passes them; a non-zero incoming state; bf16
and float32; decays that underflowed to 0 (the state wiped); calls split mid-chunk carrying
the state.

Tolerances: tests/gdn_chunk_bound.py derives them (first order in the float32 roundoff, the
triangular inverse's growth kappa and the run's largest state entry M measured in float64).
Chunked vs chunked: twice the chunked form's own term. bf16 outputs: plus the one rounding of
y to bf16 on each side, 2 ulps (<= 2 * 2^-7 |ref|: the interpreter truncates, torch rounds to
nearest). The measured differences are ~1e-7 of the scale (float32), far inside the bounds;
an error in the formulation (a missing decay, a wrong mask) moves outputs by O(0.1).
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

from gdn_chunk_bound import chunked_bound  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.ops.recurrent import gated_delta_chunked as KC  # noqa: E402
from mlxr.ops.recurrent import reference as R  # noqa: E402

INTERPRETER_ONLY = True

ULP = 2.0**-7


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _inputs(bsz, t, hk, hv, dk, dv, dtype, g):
    proj = torch.randn(bsz, t, 2 * hk * dk + hv * dv, generator=g).to(dtype)
    q, k, v = proj.split([hk * dk, hk * dk, hv * dv], -1)
    q, k = R.l2norm_qk(q.reshape(bsz, t, hk, dk), k.reshape(bsz, t, hk, dk))
    v = v.reshape(bsz, t, hv, dv)
    gate = torch.rand(bsz, t, hv, generator=g) * 0.9 + 0.05
    beta = torch.rand(bsz, t, hv, generator=g).to(dtype)
    state = torch.randn(bsz, hv, dv, dk, generator=g) * 0.5
    return q, k, v, gate, beta, state


def _close(y, y_ref, tol, dtype) -> None:
    bound = tol + (2 * ULP * y_ref.float().abs() if dtype == torch.bfloat16 else 0.0)
    err = (y.float() - y_ref.float()).abs()
    assert (err <= bound).all(), f"{float(err.max()):.2e} (bound {tol:.2e})"


def _check(q, k, v, gate, beta, state, dtype) -> None:
    s_seq, s_twin, s_k = state.clone(), state.clone(), state.clone()
    y_seq = R.gated_delta(q, k, v, gate, beta, s_seq)
    y_twin = R.gated_delta_chunked(q, k, v, gate, beta, s_twin)
    y_k = KC.gated_delta_chunked(q, k, v, gate, beta, s_k)
    assert y_k.dtype == y_twin.dtype == dtype and not torch.equal(s_k, state)
    s_tol, y_tol, _ = chunked_bound(q, k, v, gate, beta, state, R.CHUNK)
    s_tol2, y_tol2, _ = chunked_bound(q, k, v, gate, beta, state, R.CHUNK,
                                      with_sequential=False)
    for y, s in ((y_twin, s_twin), (y_k, s_k)):  # each chunked form vs the sequential one
        assert (s - s_seq).abs().max() <= s_tol
        _close(y, y_seq, y_tol, dtype)
    assert (s_k - s_twin).abs().max() <= s_tol2  # the kernel vs its twin
    _close(y_k, y_twin, y_tol2, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hk,hv,dv", [(100, 2, 4, 48), (64, 2, 2, 32), (5, 1, 2, 16)])
def test_chunked_matches_twin_and_sequential(dtype, t, hk, hv, dv):
    g = _gen(dtype, t, hk, hv, dv)
    _check(*_inputs(2, t, hk, hv, 32, dv, dtype, g), dtype)


def test_decays_underflowed_to_zero():
    """g = 0 (exp(-big) underflowed) wipes the state at that token: the chunked forms keep
    e^-80 of it (LOG_G_MIN), which the bound's float32 term covers many times over."""
    q, k, v, gate, beta, state = _inputs(1, 90, 2, 2, 32, 32, torch.float32, _gen("zero"))
    gate[:, [0, 30, 70]] = 0.0
    gate[:, 40:45] = 1.0  # no decay at all
    _check(q, k, v, gate, beta, state, torch.float32)


def test_calls_split_mid_chunk_carry_the_state():
    q, k, v, gate, beta, state = _inputs(1, 100, 2, 4, 32, 32, torch.float32, _gen("split"))
    s, s2 = state.clone(), state.clone()
    y = KC.gated_delta_chunked(q, k, v, gate, beta, s)
    parts = [KC.gated_delta_chunked(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b],
                                    beta[:, a:b], s2) for a, b in ((0, 70), (70, 100))]
    s_tol, y_tol, _ = chunked_bound(q, k, v, gate, beta, state, R.CHUNK,
                                    with_sequential=False)
    assert (s2 - s).abs().max() <= s_tol
    _close(torch.cat(parts, 1), y, y_tol, torch.float32)


def test_chunked_refuses_a_state_it_cannot_update():
    q, k, v, gate, beta, state = _inputs(1, 3, 2, 2, 32, 32, torch.float32, _gen("bad"))
    for bad in (state.bfloat16(), state.transpose(2, 3)):
        for f in (KC.gated_delta_chunked, R.gated_delta_chunked):
            with pytest.raises(ValueError, match="contiguous float32"):
                f(q, k, v, gate, beta, bad)


def test_precision_setting_is_checked(monkeypatch):
    monkeypatch.setenv("MLXR_GDN_CHUNK_PRECISION", "fp8")
    with pytest.raises(ValueError, match="MLXR_GDN_CHUNK_PRECISION"):
        KC.precision()


def test_dispatch_is_off_by_default_and_needs_a_chunk(monkeypatch):
    """ops.gated_delta takes the chunked form only with MLXR_GDN_CHUNKED=1 and >= 64 tokens
    (the CPU path: the twin); otherwise the sequential reference, bit for bit."""
    calls = []
    monkeypatch.setattr(R, "gated_delta_chunked",
                        lambda *a: calls.append(a[0].shape[1]) or R.gated_delta(*a))
    q, k, v, gate, beta, state = _inputs(1, 64, 2, 2, 32, 32, torch.float32, _gen("dispatch"))
    monkeypatch.delenv("MLXR_GDN_CHUNKED", raising=False)
    ops.gated_delta(q, k, v, gate, beta, state.clone())
    monkeypatch.setenv("MLXR_GDN_CHUNKED", "1")
    ops.gated_delta(q[:, :63], k[:, :63], v[:, :63], gate[:, :63], beta[:, :63], state.clone())
    assert calls == []
    ops.gated_delta(q, k, v, gate, beta, state.clone())
    assert calls == [64]
