"""Does programmatic dependent launch (PDL) shorten a chain of small dependent kernels inside a
CUDA graph, and does a kernel's independent prologue (weight loads) overlap the kernel before it?

A chain of CHAIN kernels, each reading the previous one's output x [GRID*BLOCK] fp32 and writing
its own, optionally after reading WBYTES of its own weights (a GEMV's packed words, which do not
depend on the previous kernel). Variants: plain launches; launch_pdl with griddepcontrol.wait
before the x load (the weight loads may then run while the previous kernel drains). Reports
microseconds per kernel from CUDA-graph replays (median of repeats), and checks the chain's
result against the same chain run eagerly without PDL.

Usage: python benchmarks/gpu/gpu_pdl_probe.py
"""

from __future__ import annotations

import json
from functools import partial

import torch
import triton
import triton.language as tl
from gpu_timing import graph_time_us
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _link(x_ptr, y_ptr, w_ptr, WCHUNK: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    pid = tl.program_id(0)
    ws = 0.0
    if WCHUNK > 0:  # independent of the previous kernel: may run before griddepcontrol.wait
        wv = tl.load(w_ptr + pid * WCHUNK + tl.arange(0, WCHUNK))
        ws = tl.sum((wv & 1).to(tl.float32), axis=0)
    if GDC:
        gdc_wait()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if GDC:
        gdc_launch_dependents()
    tl.store(y_ptr + offs, x * 0.5 + 1.0 + ws * 1e-9)


def chain(bufs, weights, grid, block, wchunk, pdl, n):
    for i in range(n):
        w = weights[i % len(weights)]
        _link[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], w, WCHUNK=wchunk, BLOCK=block,
                       GDC=pdl, launch_pdl=pdl, num_warps=4)


def main() -> None:
    n = 256
    rows = []
    for grid, block in ((8, 128), (132, 256)):
        for wbytes in (0, 1 << 20, 4 << 20):
            wchunk = wbytes // 4 // grid
            wchunk = 1 << (wchunk.bit_length() - 1) if wchunk else 0
            nw = max(1, (64 << 20) // max(wbytes, 1)) if wbytes else 1  # rotate past the L2
            weights = [torch.randint(0, 1 << 30, (max(grid * wchunk, 1),), device="cuda",
                                     dtype=torch.int32) for _ in range(min(nw, 64))]
            res = {}
            outs = {}
            for pdl in (False, True):
                x0 = torch.randn(grid * block, device="cuda")
                bufs = [x0.clone(), torch.empty_like(x0)]
                us = graph_time_us([partial(chain, bufs, weights, grid, block, wchunk, pdl, n)])
                res[pdl] = us / n
                bufs[0].copy_(x0)
                chain(bufs, weights, grid, block, wchunk, pdl, n)
                torch.cuda.synchronize()
                outs[pdl] = bufs[n % 2].clone()
            same = bool(torch.equal(outs[False], outs[True]))
            row = {"grid": grid, "block": block, "weight_bytes": grid * wchunk * 4,
                   "us_plain": round(res[False], 3), "us_pdl": round(res[True], 3),
                   "same": same}
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
