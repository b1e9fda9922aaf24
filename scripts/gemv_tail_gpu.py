"""The decode GEMVs' residual tail on CUDA (`ops.layer.residual_tail`, MLXR_GEMV_TAIL=1): a
projection and the residual step after it in one launch, against the projection followed by
the standalone add_rms_norm / residual_norm kernel, at real decode shapes.

    PYTHONPATH=. python scripts/gemv_tail_gpu.py [--rows 1,4]

Per shape (MLX affine 4-bit g64 random weights loaded as QuantWeights, so the GEMV is the one
the dispatch picks: q4gemv or q4tc) and rows: the outputs' agreement with the composed ops (the
GEMV part is the same code; the norm statistic may round its last bit apart: elements equal,
and the largest difference in bf16 ulps of the row's largest value) and the time of each in a
CUDA graph of 32 copies (µs per projection + residual step). The last line says whether every
check passed (at most one ulp apart, >= 90% equal).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.gpu_timing import graph_time_us  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.config.spec import QuantSpec  # noqa: E402
from mlxr.layers import Linear  # noqa: E402
from mlxr.ops.layer import residual_tail as T  # noqa: E402
from mlxr.quant import QuantWeight  # noqa: E402

# (name, out = residual width, in, mode)
SHAPES = [("0.6B o", 1024, 2048, T.ADD_NORM), ("0.6B down", 1024, 3072, T.ADD_NORM),
          ("Qwen3.5-2B down", 2048, 6144, T.ADD_NORM),
          ("Qwen3-30B-A3B o", 2048, 4096, T.ADD_NORM),
          ("8B o", 4096, 4096, T.ADD_NORM), ("8B down", 4096, 14336, T.ADD_NORM),
          ("Gemma-4-E2B o (sliding)", 1536, 2048, T.SANDWICH),
          ("Gemma-4-E2B o (full)", 1536, 4096, T.SANDWICH)]


def quant_linear(n: int, k: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64)
    scales = torch.rand(n, k // 64, generator=g) * 0.004 + 0.001
    biases = -8 * scales + torch.randn(n, k // 64, generator=g) * 0.002
    qw = QuantWeight.from_tensors(words.to(torch.int32).view(torch.uint32),
                                  scales.bfloat16(), biases.bfloat16(), QuantSpec("affine", 4, 64),
                                  compute_dtype=torch.bfloat16, device="cuda")
    return Linear(qw)


def run(lin, mode, x, h, w, w2, s):
    if mode == T.ADD_NORM:
        return ops.linear_add_norm(x, lin, h, w, 1e-6)
    return ops.linear_residual_norm(x, lin, h, w, 1e-6, s, w2)


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(share of equal elements, largest difference in bf16 ulps of the row's max |value|)."""
    eq = float((a == b).float().mean())
    ulp = 2.0**-7 * b.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return eq, float(((a.float() - b.float()).abs() / ulp).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4")
    a = ap.parse_args()
    ok = True
    for name, n, k, mode in SHAPES:
        lin = quant_linear(n, k, n + k)
        for m in (int(r) for r in a.rows.split(",")):
            g = torch.Generator().manual_seed(m)
            x = (torch.randn(m, k, generator=g)).bfloat16().cuda()
            h = (torch.randn(m, n, generator=g) * 3).bfloat16().cuda()
            w = (torch.rand(n, generator=g) + 0.5).bfloat16().cuda()
            w2 = torch.randn(n, generator=g).bfloat16().cuda()
            s = (torch.rand(1, generator=g) + 0.5).bfloat16().cuda()
            os.environ.pop("MLXR_GEMV_TAIL", None)
            ref = run(lin, mode, x, h, w, w2, s)
            t_ref = graph_time_us([lambda: run(lin, mode, x, h, w, w2, s)] * 32)
            os.environ["MLXR_GEMV_TAIL"] = "1"
            w_ = lin.weight
            tailed = ops._gemv_tail(x, lin, mode, h, w, 1e-6, 0.0,
                                    s if mode == T.SANDWICH else None,
                                    w2 if mode == T.SANDWICH else None)
            if tailed is None:
                print(f"{name:26s} rows {m}: no decode GEMV with a tail serves it "
                      f"(q4 {w_.q4 is not None}, tc {w_.tc is not None})", flush=True)
                continue
            got = run(lin, mode, x, h, w, w2, s)
            t_got = graph_time_us([lambda: run(lin, mode, x, h, w, w2, s)] * 32)
            os.environ.pop("MLXR_GEMV_TAIL", None)
            parts = []
            for label, u, v in (("h", got[0], ref[0]), ("x", got[1], ref[1])):
                eq, ulps = compare(u, v)
                good = ulps <= 1.0 and eq >= 0.9
                ok &= good
                parts.append(f"{label} {eq * 100:.1f}% equal, max {ulps:.2f} ulp "
                             f"{'ok' if good else 'FAIL'}")
            print(f"{name:26s} rows {m}: composed {t_ref:6.2f} us, tail {t_got:6.2f} us "
                  f"({t_ref / t_got:.2f}x); " + "; ".join(parts), flush=True)
    print("all checks ok" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
