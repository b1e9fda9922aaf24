"""mxfp4 single-row decode on q4tc's fp4 copy (`q4tc(fp4=True)`) against affine 4-bit g32 on
q4tc (the same bytes per code, the same launch) and against the generic Triton GEMV that
served mxfp4 before (`triton_qmm.qgemv` on the MLX words), per 8B / 0.6B projection: us per
call (CUDA graphs rotating through copies larger than the L2, median) and GB/s of the bytes
each reads (codes + scales: mxfp4 1 B, affine g32 4 B of pairs per 32 codes).

    python benchmarks/gpu_q4tc_fp4.py
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_timing import L2_BYTES, graph_time_us  # noqa: E402

from mlxr.ops.triton_q4gemv import pair_scales  # noqa: E402
from mlxr.ops.triton_q4tc import fp4_bits, q4tc, q4tc_ref, repack  # noqa: E402
from mlxr.ops.triton_qmm import qgemv  # noqa: E402

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096),
          "8b_down": (4096, 14336), "8b_head": (128256, 4096), "0.6b_qkv": (4096, 1024),
          "0.6b_o": (1024, 2048), "0.6b_gate_up": (6144, 1024), "0.6b_down": (1024, 3072)}


def main() -> None:
    dev, group = "cuda", 32
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        nrot = max(1, -(-2 * L2_BYTES // (n * k // 2)))
        x = torch.randn(k, generator=g, device=dev).bfloat16()
        words = [torch.randint(-(2**31), 2**31, (n, k // 8), generator=g, device=dev,
                               dtype=torch.int64).to(torch.int32) for _ in range(nrot)]
        e8 = [torch.randint(118, 126, (n, k // group), generator=g, device=dev,
                            dtype=torch.int32).to(torch.uint8) for _ in range(nrot)]
        s = [torch.exp2(e.float() - 127).bfloat16() for e in e8]
        fp4 = [(fp4_bits(repack(w)), pair_scales(si, torch.zeros_like(si)))
               for w, si in zip(words, s)]
        aff = [(repack(w), pair_scales(si, (si * -8).bfloat16())) for w, si in zip(words, s)]
        y = q4tc(x, *fp4[0], group=group, fp4=True)
        twin = q4tc_ref(x, *fp4[0], group=group, fp4=True)
        err = float((y.float() - twin.float()).abs().max() / twin.float().abs().max())
        t_fp4 = graph_time_us([lambda c=c: q4tc(x, *c, group=group, fp4=True) for c in fp4])
        t_aff = graph_time_us([lambda c=c: q4tc(x, *c, group=group) for c in aff])
        t_gen = graph_time_us([lambda w=w, e=e: qgemv(x[None], w, e, None, None, mode="mxfp4",
                                                       bits=4, group=group)
                               for w, e in zip(words, e8)])
        gb_fp4, gb_aff = n * k * (0.5 + 1 / 32) / 1e3, n * k * (0.5 + 4 / 32) / 1e3
        print(f"{name:12s} fp4 q4tc {t_fp4:7.1f} us ({gb_fp4 / t_fp4:5.0f} GB/s)  affine g32 "
              f"q4tc {t_aff:7.1f} us ({gb_aff / t_aff:5.0f} GB/s)  generic mxfp4 GEMV "
              f"{t_gen:7.1f} us  fp4 vs twin {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
