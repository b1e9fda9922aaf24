"""Where a CUDA decode step spends its time: kernels per token, GPU time per kernel family,
graph replay time per token. Usage: python benchmarks/gpu/gpu_profile.py MODEL_DIR [prompt_len].

Two profiles: the eager step (kernel count and each kernel's own time, launched one by one)
and 10 replays of the captured step (the kernels as the graph runs them, back to back with
programmatic dependent launch). The second's busy share (the kernels' summed device time over
the replay's wall time) says where a token goes: near 100%, inside the kernels (make them
faster or fewer and fuller); well below, in the gaps between them (fewer launches)."""

from __future__ import annotations

import json
import sys
import time

import torch
from gpu_timing import kernel_families

import mlxr
from mlxr.engine.cuda_graph import GraphDecoder
from mlxr.engine.kv_cache import new_cache


def main(path: str, prompt_len: int = 512) -> None:
    m = mlxr.load(path, device="cuda")
    dec = m.decoder
    cache = new_cache(dec, 1024)
    ids = torch.randint(0, m.config.vocab_size, (prompt_len,))
    with torch.inference_mode():
        dec.forward(ids, cache, last_only=True)
        graph = GraphDecoder(dec, cache)
        graph.start(5, prompt_len)
        for _ in range(5):
            graph.graph.replay()
        torch.cuda.synchronize()
        n = 100
        t = time.perf_counter()
        for _ in range(n):
            graph.graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / n * 1e3
        # eager step under the profiler: kernel count and GPU time by kernel name
        pos = torch.tensor([prompt_len], device="cuda")
        tok = torch.tensor([5], device="cuda")
        for _ in range(2):
            dec.forward_static(tok, pos, cache.pool, graph.tables)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.forward_static(tok, pos, cache.pool, graph.tables)
            torch.cuda.synchronize()
        reps = 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as gprof:
            for _ in range(reps):
                graph.graph.replay()
            torch.cuda.synchronize()
    by = kernel_families(prof)
    count = sum(c for c, _ in by.values())
    total = sum(v[1] for v in by.values())
    print(f"graph replay: {replay_ms:.3f} ms/token ({1e3 / replay_ms:.0f} tok/s); "
          f"{count} kernels per eager step, {total / 1e3:.3f} ms GPU time")
    for name, (c, us) in list(by.items())[:15]:
        print(f"  {us:9.1f} us  {c:5d}x  {name}")
    gby = kernel_families(gprof)
    gcount = sum(c for c, _ in gby.values()) / reps
    gtotal = sum(v[1] for v in gby.values()) / reps
    busy = gtotal / 1e3 / replay_ms
    print(f"in the graph: {gcount:.0f} kernels a token, {gtotal / 1e3:.3f} ms device time, "
          f"busy {busy * 100:.0f}% of the replay")
    for name, (c, us) in list(gby.items())[:15]:
        print(f"  {us / reps:9.1f} us  {c / reps:7.1f}x  {name}")
    print(json.dumps({"replay_ms": replay_ms, "kernels": count, "gpu_ms": total / 1e3,
                      "graph_kernels": gcount, "graph_gpu_ms": gtotal / 1e3,
                      "graph_busy": round(busy, 3)}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
