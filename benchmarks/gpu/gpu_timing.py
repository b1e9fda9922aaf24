"""Shared by the GPU workbenches: median time per call of work replayed in a CUDA graph."""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch

L2_BYTES = 50 << 20  # H200 L2: rotate through copies of the inputs larger than this


def graph_time_us(fns, reps: int = 15) -> float:
    """Median time per call of a CUDA graph holding all fns (each one launch)."""
    for f in fns:
        f()  # warm-up / autotune outside capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # one eager pass on a side stream (allocator warm-up before capture)
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1000.0 / len(fns))
    del g
    return statistics.median(times)


def kernel_families(prof) -> dict[str, list]:
    """A torch profile's GPU kernels by family (the name up to its template arguments): family
    -> [launches, total us], largest total first."""
    fam: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            f = fam[e.name.split("<")[0][:70]]
            f[0] += 1
            f[1] += e.device_time_total
    return dict(sorted(fam.items(), key=lambda kv: -kv[1][1]))
