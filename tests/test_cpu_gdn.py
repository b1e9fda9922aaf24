"""The compiled gated DeltaNet decode step (`mlxr.ops.cpu.gdn.step`, gdn.c) against its torch
twin (`twins.gdn_step`, the lean step's own arithmetic) on fresh random data.

The two agree up to the order of the two float32 dot products per state row (S k and S q) and
the decay's exp (libm's against torch's): the conv state equals bit for bit; the float32 state
after a step lies within the summation bound of the S k product carried into the update
(|d S_ij| <= beta |k_j| 2 (Dk - 1) u sum_l |g S_il k_l| + one rounding), checked here in the
looser form 2 Dk^1.5 u max|S| (k is unit-norm, beta <= 1); the bf16 outputs agree within a
bf16 step, most of them exactly."""

from __future__ import annotations

import pytest
import torch

from mlxr.ops.cpu import gdn, native, twins

pytestmark = pytest.mark.skipif(not gdn.ready(), reason="mlxr's CPU extension not built")

U = 2.0**-24


def _case(hk: int, hv: int, dk: int, dv: int, bsz: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = 4
    c = 2 * hk * dk + hv * dv
    p = c + hv * dv + 2 * hv

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    conv = rnd(bsz, w - 1, c).to(torch.bfloat16)
    ssm = rnd(bsz, hv, dv, dk, s=0.3)
    tables = (rnd(w, c, s=0.5), -torch.exp(rnd(hv, s=0.5)), rnd(hv).to(torch.bfloat16),
              (rnd(dv, s=0.2) + 1).to(torch.bfloat16), (hk, hv, dk, dv), 1e-6)
    projs = [(rnd(bsz, p, s=2.0) * rnd(bsz, p).exp()).to(torch.bfloat16) for _ in range(4)]
    return conv, ssm, tables, projs


@pytest.mark.parametrize("hk,hv,dk,dv,bsz", [(2, 2, 128, 128, 1), (2, 4, 128, 64, 3),
                                             (16, 16, 128, 128, 1), (3, 6, 24, 40, 2)])
def test_step_against_twin(hk, hv, dk, dv, bsz):
    """Four steps from the same states (Hv = Hk and 2 Hk, one and several sequences, Dk a
    multiple of 16 (the vector path) and not): conv states equal, float32 states within the
    bound after each step (then re-synchronised, so the bound stays one step's), outputs
    within a bf16 step of the twin's."""
    conv, ssm, tables, projs = _case(hk, hv, dk, dv, bsz, seed=hk * 7 + dk + bsz)
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    same = total = 0
    for proj in projs:
        want = twins.gdn_step(proj, c1, s1, *tables)
        got = gdn.step(proj, c2, s2, *tables)
        assert torch.equal(c2, c1)
        bound = 2 * dk**1.5 * U * s1.abs().max() + 2 * U * s1.abs()
        assert ((s2 - s1).abs() <= bound).all()
        assert ((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs() + 1e-30).all()
        same += int((got == want).sum())
        total += got.numel()
        s2.copy_(s1)
    assert same >= 0.9 * total


def test_step_rows_independent():
    """A batch of three sequences gives each row what it gives alone (no state crosses
    rows)."""
    conv, ssm, tables, projs = _case(2, 4, 32, 32, 3, seed=5)
    cb, sb = conv.clone(), ssm.clone()
    batch = gdn.step(projs[0], cb, sb, *tables)
    for i in range(3):
        ci, si = conv[i:i + 1].clone(), ssm[i:i + 1].clone()
        one = gdn.step(projs[0][i:i + 1], ci, si, *tables)
        assert torch.equal(one[0], batch[i]) and torch.equal(si[0], sb[i])
        assert torch.equal(ci[0], cb[i])


def test_step_checks_its_inputs():
    conv, ssm, tables, projs = _case(2, 2, 32, 32, 1, seed=1)
    with pytest.raises(ValueError, match="gdn"):
        gdn.step(projs[0], conv, ssm.transpose(2, 3), *tables)
    with pytest.raises(ValueError, match="gdn"):
        gdn.step(projs[0].float(), conv, ssm, *tables)


def test_switch(monkeypatch):
    """`MLXR_CPU_GDN`: unset, on for served layers only; "1" / "0" force it; off without the
    extension's switch (`MLXR_CPU_KERNELS=0`)."""
    monkeypatch.delenv("MLXR_CPU_GDN", raising=False)
    assert gdn.enabled(True) and not gdn.enabled(False)
    monkeypatch.setenv("MLXR_CPU_GDN", "1")
    assert gdn.enabled(False)
    monkeypatch.setenv("MLXR_CPU_GDN", "0")
    assert not gdn.enabled(True)
    monkeypatch.setenv("MLXR_CPU_GDN", "1")
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")
    assert not gdn.enabled(True) and not native.enabled()


def test_step_threads_agree():
    """The heads split over OpenMP threads give what one thread gives (rows are independent)."""
    conv, ssm, tables, projs = _case(2, 4, 32, 32, 2, seed=9)
    out = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            c, s = conv.clone(), ssm.clone()
            out.append((gdn.step(projs[0], c, s, *tables), c, s))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*out))
