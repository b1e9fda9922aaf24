"""Runs triton_q4gemv once per 8B decode shape (default launch), for Nsight Compute:

    ncu --clock-control none -k regex:_q4gemv_kernel --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        python benchmarks/gpu_q4gemv_ncu.py
"""

import torch

from mlxr.ops import triton_q4gemv as Q

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

for name, (n, k) in SHAPES.items():
    w = Q.repack(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda"))
    s = (torch.randn(n, k // 64, device="cuda") * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, k // 64, device="cuda") * 0.1).to(torch.bfloat16)
    x = torch.randn(k, device="cuda").to(torch.bfloat16)
    Q.q4gemv(x, w, s, b, group=64)
    torch.cuda.synchronize()
    print(name, Q.default_config(n, k).label(), flush=True)
