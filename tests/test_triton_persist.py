"""mlxr.ops.triton_persist (the persistent-kernel probe) in the interpreter, where a launch runs
one program (programs run one after another, so a grid barrier could never open for more):
the barrier's counter arithmetic across launches, and the one-launch GEMV chain against four
q4gemv launches. The H200 runs the same checks with 132+ programs
(benchmarks/gpu_persist_probe.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

pytest.importorskip("triton")

from mlxr.ops import triton_persist as P
from mlxr.ops import triton_q4gemv as Q

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, g, group=64):
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    b = (-7.5 * s.float() + torch.randn(n, k // group, generator=g) * 0.002).to(torch.bfloat16)
    words = Q.repack(packed).to(DEV)
    s, b = s.to(DEV), b.to(DEV)
    return words, Q.pair_scales(s, b), s, b, n


def test_sync_counts_and_needs_no_reset():
    cnt = P.new_counter(DEV)
    g = P.programs(torch.device(DEV))
    for launch in range(3):  # the counter only grows: each launch finds its own base
        out = P.sync_probe(cnt, 4, grid=g)
        assert out[:4].tolist() == [g * (g + 1) // 2] * 4 and int(out[4]) == 0
        assert int(cnt) == 4 * g * (launch + 1)


@pytest.mark.parametrize("shapes", [
    [(2048, 1024), (1024, 2048), (3072, 1024), (1024, 3072)],  # a 0.6B-style layer, smaller
    [(1040, 1024), (1024, 1024), (1024, 1024), (1000, 1024)],  # ragged row blocks
])
def test_chain4_is_four_q4gemv_launches(shapes):
    g = torch.Generator().manual_seed(len(shapes[0]) + shapes[0][0])
    ws = [_weight(n, k, g) for n, k in shapes]
    x = torch.randn(shapes[0][1], generator=g).to(torch.bfloat16).to(DEV)
    cnt = P.new_counter(DEV)
    cfgs = [Q.Q4Config(64, 128, cg=True) for _ in ws]  # the interpreter: few, large programs
    ys = P.chain4(x, [(w, sb, b, n) for w, sb, _, b, n in ws], group=64, counter=cnt,
                  configs=cfgs)
    xi = x
    for (w, sb, s, b, n), cfg, y in zip(ws, cfgs, ys):
        want = Q.q4gemv(xi[:w.shape[1] * 8], w, s, b, group=64, sb=sb, config=cfg)
        assert torch.equal(y, want)
        assert float(y.float().abs().max()) > 0
        xi = want
    assert int(cnt) == 3 * P.programs(torch.device(DEV))


def test_chain4_rejects_bad_chains():
    g = torch.Generator().manual_seed(1)
    same = [_weight(1024, 1024, g) for _ in range(4)]
    x = torch.randn(1024, generator=g).to(torch.bfloat16).to(DEV)
    chain = [(w, sb, b, n) for w, sb, _, b, n in same]
    wide = _weight(1024, 2048, g)
    with pytest.raises(ValueError, match="after an input"):  # K = 2048 after 1024 outputs
        P.chain4(x, chain[:3] + [(wide[0], wide[1], wide[3], wide[4])], group=64,
                 counter=P.new_counter(DEV))
    with pytest.raises(ValueError, match="num_warps"):  # one launch, one warp count
        P.chain4(x, chain, group=64, counter=P.new_counter(DEV),
                 configs=[Q.Q4Config(8, 128)] * 3 + [Q.Q4Config(8, 256)])
