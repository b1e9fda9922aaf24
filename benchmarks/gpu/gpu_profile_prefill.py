"""Where a CUDA prefill spends its time: wall time vs GPU time, GPU time per kernel family, and
the host ops with the most self time (launch overhead, syncs).

    PYTHONPATH=. python benchmarks/gpu/gpu_profile_prefill.py MODEL_DIR [prompt_len]
"""

from __future__ import annotations

import json
import sys
import time

import torch
from gpu_timing import kernel_families

import mlxr
from mlxr.engine.kv_cache import new_cache


def main(path: str, prompt_len: int = 512) -> None:
    m = mlxr.load(path, device="cuda")
    dec = m.decoder
    ids = torch.randint(0, m.config.vocab_size, (prompt_len,))

    def once():
        cache = new_cache(dec, 1024)
        dec.forward(ids, cache, last_only=True)
        torch.cuda.synchronize()

    with torch.inference_mode():
        for _ in range(3):
            once()
        t = time.perf_counter()
        for _ in range(5):
            once()
        wall_ms = (time.perf_counter() - t) / 5 * 1e3
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            once()
    gpu = kernel_families(prof)
    total = sum(v[1] for v in gpu.values())
    print(f"prefill {prompt_len}: wall {wall_ms:.2f} ms ({prompt_len / wall_ms * 1e3:.0f} tok/s), "
          f"GPU busy {total / 1e3:.2f} ms in {sum(v[0] for v in gpu.values())} kernels")
    for name, (c, us) in list(gpu.items())[:14]:
        print(f"  gpu {us:9.1f} us  {c:5d}x  {name}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    print(table)
    print(json.dumps({"wall_ms": wall_ms, "gpu_ms": total / 1e3}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
