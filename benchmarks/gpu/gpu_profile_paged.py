"""Where the serving engine's batched decode step spends its GPU time: one step of B sequences
(each at context `ctx`) through `PagedDecodeRunner`, timed as a CUDA-graph replay (median) and
profiled eagerly per kernel family.

    PYTHONPATH=. python benchmarks/gpu/gpu_profile_paged.py MODEL_DIR [B=256] [ctx=96]
"""

from __future__ import annotations

import json
import statistics
import sys
from types import SimpleNamespace

import torch
from gpu_timing import kernel_families

import mlxr
from mlxr.engine.decode_graphs import PagedDecodeRunner
from mlxr.engine.kv_cache import KVPool


def main(path: str, batch: int = 256, ctx: int = 96) -> None:
    m = mlxr.load(path, device="cuda")
    c, dec, bs = m.config, m.decoder, 16
    width = -(-(ctx + 1) // bs)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, batch * width + 1, bs, m.dtype,
                  "cuda")
    runner = PagedDecodeRunner(dec, pool, batch * width, batch, width * bs, capture=True)
    seqs = [SimpleNamespace(num_computed=ctx, token_ids=[7] * (ctx + 1),
                            block_table=list(range(r * width, (r + 1) * width)))
            for r in range(batch)]
    want = [False] * batch
    with torch.inference_mode():
        for _ in range(3):
            runner.run(seqs, want)
        g = runner.graphs[next(b for b in runner.buckets if b >= batch)]
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        replay_ms = statistics.median(times)
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            runner._body(batch)
            torch.cuda.synchronize()
    fam = kernel_families(prof)
    total = sum(v[1] for v in fam.values())
    print(f"batch {batch} ctx {ctx}: graph replay {replay_ms:.3f} ms "
          f"({batch / replay_ms * 1e3:.0f} tok/s); eager GPU time {total / 1e3:.3f} ms in "
          f"{sum(v[0] for v in fam.values())} kernels")
    for name, (n, us) in list(fam.items())[:16]:
        print(f"  gpu {us:9.1f} us  {n:5d}x  {name}")
    print(json.dumps({"batch": batch, "ctx": ctx, "replay_ms": replay_ms,
                      "eager_gpu_ms": total / 1e3}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
