"""Which 4-bit matmul serves batched decode and short prompts (M = 2..512 rows): torch's
tinygemm int4 kernel, one Triton dequantization pass + cuBLAS, or the fused tensor-core GEMM
(`prefill_gemm`, on the packed words)? CUDA-graph timing at the Qwen3-0.6B and Llama-3.1-8B
projection shapes. The last line is JSON.

    PYTHONPATH=. python benchmarks/gpu/gpu_mid_m.py [M ...] [--shapes 8b]
"""

from __future__ import annotations

import json
import sys

import torch
from gpu_timing import graph_time_us

from mlxr.ops.matmul.prefill_dequant import dequant_affine
from mlxr.ops.matmul.prefill_gemm import qgemm
from mlxr.quant.cuda_copies import tinygemm_pack

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
          "0.6b down": (1024, 3072), "0.6b head": (151936, 1024), "8b qkv": (6144, 4096),
          "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336)}
MS = (16, 32, 64, 128, 256, 512)


def main(argv: list[str]) -> None:
    g = 64
    ms = [int(a) for a in argv if a.isdigit()] or MS
    only = argv[argv.index("--shapes") + 1] if "--shapes" in argv else ""
    rows = []
    for name, (n, k) in SHAPES.items():
        if not name.startswith(only):
            continue
        packed = torch.randint(0, 2 ** 31, (n, k // 8), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // g, device="cuda") * 0.01).bfloat16()
        biases = (-8 * scales.float()).bfloat16()
        i4, sz = tinygemm_pack(packed, scales, biases)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tg = graph_time_us([lambda x=x, i4=i4, sz=sz: torch._weight_int4pack_mm(x, i4, g, sz)])
            dq = graph_time_us([lambda x=x, w=(packed, scales, biases), k=k:
                                x @ dequant_affine(*w, k, 4, g, torch.bfloat16).t()])
            fu = graph_time_us([lambda x=x: qgemm(x, packed, scales, biases, bits=4, group=g)])
            ref = x @ dequant_affine(packed, scales, biases, k, 4, g, torch.bfloat16).t()
            err = (torch._weight_int4pack_mm(x, i4, g, sz).float() - ref.float()).abs().max()
            ferr = (qgemm(x, packed, scales, biases, bits=4, group=g).float()
                    - ref.float()).abs().max()
            rows.append({"shape": name, "m": m, "tinygemm_us": round(tg, 1),
                         "dequant_cublas_us": round(dq, 1), "fused_us": round(fu, 1),
                         "max_diff": float(err), "fused_max_diff": float(ferr)})
            print(f"{name:14s} M={m:4d} tinygemm {tg:8.1f} us  dequant+cuBLAS {dq:8.1f} us  "
                  f"fused {fu:8.1f} us  max |diff| vs dequant: tinygemm {float(err):.3g}, "
                  f"fused {float(ferr):.3g} (|ref| <= {float(ref.abs().max()):.3g})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
