"""Gemma 4's per-layer-input branch on CUDA (`ops.layer.residual_gemv`, on by default;
MLXR_GEMMA4_PLE_FUSED=0 off):
the two kernels against their twins, then one layer's branch timed in CUDA graphs, composed
(residual_norm, the gate GEMV, gated_act, the projection GEMV, residual_norm: five launches,
the GEMVs on the dispatch a loaded QuantWeight gets) against fused (two launches).

    PYTHONPATH=. python scripts/gemma4_ple_gpu.py [--e 1536] [--p 256] [--rows 1,4,8,16]

Shapes: Gemma-4-E2B's (hidden 1536, per-layer input 256), MLX affine 4-bit g64 weights with
random codes, scales and biases. Check bounds (of the twin's largest |value| per row): float32
1e-5 (fp32 sums in another order; h' one norm statistic apart), bf16 2^-6 (the outputs round
to bf16 at four points, where the order may flip one ulp, 2^-8 relative, each).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.gpu_timing import graph_time_us  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.config.spec import QuantSpec  # noqa: E402
from mlxr.layers import Linear  # noqa: E402
from mlxr.ops import reference as R  # noqa: E402
from mlxr.ops.layer import residual_gemv as K  # noqa: E402
from mlxr.ops.moe import decode_experts as D  # noqa: E402
from mlxr.ops.moe.operands import linear_stack  # noqa: E402
from mlxr.quant import QuantWeight  # noqa: E402


def quant_linear(n: int, k: int, seed: int, dtype: torch.dtype) -> Linear:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    scales = (torch.rand(n, k // 64, generator=g) * 0.02 + 0.005)
    biases = -8 * scales + torch.randn(n, k // 64, generator=g) * 0.01
    qw = QuantWeight.from_tensors(words.view(torch.uint32), scales.to(dtype), biases.to(dtype),
                                  QuantSpec("affine", 4, 64), compute_dtype=dtype,
                                  device="cuda")
    return Linear(qw)


def twin_linear(lin: Linear, dtype: torch.dtype):
    q = linear_stack(lin.weight)
    qc = q._replace(**{f: None if getattr(q, f) is None else getattr(q, f).cpu()
                       for f in ("w", "scales", "biases", "global_scale", "bias")})

    def f(x: torch.Tensor) -> torch.Tensor:
        return D.expert_matmul_ref(x.cpu(), torch.zeros(x.shape[0], dtype=torch.long), qc,
                                   dtype)
    return f


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.float().cpu(), ref.float().cpu()
    return float(((g - r).abs() / r.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max())


def check(e: int, p: int, rows: list[int]) -> bool:
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        gate, proj = quant_linear(p, e, 1, dtype), quant_linear(e, p, 2, dtype)
        tg, tp = twin_linear(gate, dtype), twin_linear(proj, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2**-6
        for m in rows:
            g = torch.Generator().manual_seed(m)
            h = (torch.randn(m, e, generator=g) * 2).to(dtype)
            a = (torch.randn(m, e, generator=g) * 0.3).to(dtype)
            w = (torch.rand(e, generator=g) + 0.5).to(dtype)
            ple = torch.randn(m, 35, p, generator=g).to(dtype)
            s = (torch.rand(1, generator=g) + 0.5).to(dtype)
            w2 = torch.randn(e, generator=g).to(dtype)
            cu = [t.cuda() for t in (h, a, w, ple, s, w2)]
            h1, g1 = K.residual_linear_act(cu[0], cu[1], cu[2], 1e-6, gate, cu[3][:, 7],
                                           "gelu_tanh")
            rh1, rg1 = R.residual_linear_act(h, a, w, 1e-6, tg, ple[:, 7], "gelu_tanh")
            h2, x2 = K.linear_residual_norm(g1, proj, h1, cu[2], 1e-6, cu[4], cu[5])
            rh2, rx2 = R.linear_residual_norm(g1.cpu(), tp, h1.cpu(), w, 1e-6, s, w2)
            for name, got, ref in (("h'", h1, rh1), ("g", g1, rg1), ("h''", h2, rh2),
                                   ("x", x2, rx2)):
                err = rel_err(got, ref)
                good = err <= tol
                ok &= good
                print(f"check {str(dtype):15s} rows {m:2d} {name:4s} err {err:.2e} "
                      f"tol {tol:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def bench(e: int, p: int, rows: list[int]) -> None:
    dtype = torch.bfloat16
    gate, proj = quant_linear(p, e, 1, dtype), quant_linear(e, p, 2, dtype)
    for m in rows:
        g = torch.Generator().manual_seed(m)
        h, a = (torch.randn(m, e, generator=g) * 2).to(dtype).cuda(), (
            torch.randn(m, e, generator=g) * 0.3).to(dtype).cuda()
        w = (torch.rand(e, generator=g) + 0.5).to(dtype).cuda()
        ple = torch.randn(m, 35, p, generator=g).to(dtype).cuda()
        s, w2 = torch.ones(1, dtype=dtype, device="cuda"), w.clone()

        def composed():
            h1, _ = ops.residual_norm(h, a, w, 1e-6)
            g1 = ops.gated_act(gate(h1), ple[:, 7], "gelu_tanh")
            return ops.residual_norm(h1, proj(g1), w, 1e-6, s, w2)

        def fused():
            h1, g1 = K.residual_linear_act(h, a, w, 1e-6, gate, ple[:, 7], "gelu_tanh")
            return K.linear_residual_norm(g1, proj, h1, w, 1e-6, s, w2)

        same = all(torch.equal(x, y) for x, y in zip(composed(), fused()))
        tc = graph_time_us([composed] * 35)
        tf = graph_time_us([fused] * 35)
        print(f"bench rows {m:2d}: branch composed {tc:.2f} us, fused {tf:.2f} us "
              f"({tc / tf:.2f}x); outputs bit-equal: {same}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--e", type=int, default=1536)
    ap.add_argument("--p", type=int, default=256)
    ap.add_argument("--rows", default="1,4,8,16")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    K.MAX_ROWS = max(K.MAX_ROWS, *rows)  # measure past the dispatch's cap (where it would go)
    ok = check(a.e, a.p, rows)
    bench(a.e, a.p, rows)
    print("all checks ok" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
