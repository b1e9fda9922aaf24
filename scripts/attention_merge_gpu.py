"""The decode attention with its splits merged in the split kernel (MLXR_ATTN_MERGE=1) against
the split kernel + combine launch, on CUDA at the decode graph's shapes (`attention_at`: a
buffer of S slots, the query at position P, bf16).

    PYTHONPATH=. python scripts/attention_merge_gpu.py

Per shape: whether the merge applies (`merge_in_split`'s budget), the outputs' agreement (the
same `_merge_splits` arithmetic; the reductions may run in another layout: elements equal and
the largest difference in bf16 ulps of the head's largest |value|), and µs per call in a CUDA
graph of 32 calls, two launches vs one. The last line says whether every check passed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.gpu_timing import graph_time_us  # noqa: E402
from mlxr.ops.kv_attention import masked as A  # noqa: E402

# (name, kv heads, q heads per kv head, head dim, slots S, position P, window)
SHAPES = [("Qwen3-0.6B", 8, 2, 128, 4096, 640, None),
          ("Llama-3.1-8B", 8, 4, 128, 4096, 640, None),
          ("Qwen3-30B-A3B", 4, 8, 128, 4096, 640, None),
          ("Qwen3-30B-A3B long", 4, 8, 128, 16384, 12000, None),
          ("Gemma-4-E2B sliding", 1, 8, 256, 512, 600, 512),
          ("Qwen3.5-2B attention", 2, 4, 256, 4096, 640, None)]


class _Spy:
    """Counts the combine kernel's launches (none where the split kernel merged)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def main() -> int:
    ok = True
    for name, kh, rep, d, s, p, window in SHAPES:
        g = torch.Generator().manual_seed(d + s)
        q = torch.randn(1, kh * rep, d, generator=g).bfloat16().cuda()
        k = torch.randn(kh, s, d, generator=g).bfloat16().cuda()
        v = torch.randn(kh, s, d, generator=g).bfloat16().cuda()
        pos = torch.tensor([p], device="cuda")

        def call():
            return A.attention_at(q, k, v, pos, window, d**-0.5)

        os.environ.pop("MLXR_ATTN_MERGE", None)
        two = call()
        t_two = graph_time_us([call] * 32)
        os.environ["MLXR_ATTN_MERGE"] = "1"
        spy = _Spy(A._attn_combine_kernel)
        A._attn_combine_kernel = spy
        one = call()
        A._attn_combine_kernel = spy.kernel
        applies = spy.launches == 0
        t_one = graph_time_us([call] * 32)
        os.environ.pop("MLXR_ATTN_MERGE", None)
        eq = float((one == two).float().mean())
        ulp = 2.0**-7 * two.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
        ulps = float(((one.float() - two.float()).abs() / ulp).max())
        good = ulps <= 1.0 and eq >= 0.9
        ok &= good
        print(f"{name:22s} merge {'on ' if applies else 'off'}: two launches "
              f"{t_two:6.2f} us, merged {t_one:6.2f} us ({t_two / t_one:.2f}x); "
              f"{eq * 100:.1f}% equal, max {ulps:.2f} ulp {'ok' if good else 'FAIL'}", flush=True)
    print("all checks ok" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
