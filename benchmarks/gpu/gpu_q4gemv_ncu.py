"""Runs a 4-bit decode GEMV once per 8B decode shape (default launch), for Nsight Compute:

    ncu --clock-control none -k regex:_q4gemv_kernel --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        python benchmarks/gpu/gpu_q4gemv_ncu.py
    ncu --clock-control none -k regex:_q4tc_kernel --set full \
        python benchmarks/gpu/gpu_q4gemv_ncu.py q4tc      # the tensor-core GEMV (decode_gemv_tc)
"""

import sys

import torch

from mlxr.ops.matmul import decode_gemv_q4 as Q
from mlxr.ops.matmul import decode_gemv_tc as T

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
tc = sys.argv[1:] == ["q4tc"]

for name, (n, k) in SHAPES.items():
    w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    s = (torch.randn(n, k // 64, device="cuda") * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, k // 64, device="cuda") * 0.1).to(torch.bfloat16)
    x = torch.randn(k, device="cuda").to(torch.bfloat16)
    if tc:
        T.q4tc(x, T.repack(w), Q.pair_scales(s, b), group=64)
    else:
        Q.q4gemv(x, Q.repack(w), s, b, group=64)
    torch.cuda.synchronize()
    print(name, (T if tc else Q).default_config(n, k).label(), flush=True)
