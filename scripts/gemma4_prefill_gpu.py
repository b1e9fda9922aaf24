"""Gemma 4 prefill host overhead (issue 29) on one GPU call, under 2 minutes: the padded
prefill graph checked against the eager prefill, then both timed. Each part runs in its own
try/except: a failure prints FAIL and the next part runs.

    PYTHONPATH=. python scripts/gemma4_prefill_gpu.py DIR    # CUDA; DIR: a gemma4 checkpoint,
        written there first (make_checkpoint.py gemma-4-e2b, 4-bit g64) if it has no config.json
    PYTHONPATH=. python scripts/gemma4_prefill_gpu.py DIR --tiny --float32   # CPU smoke run

1. check, bf16 (--float32: float32 first), prompts of 37 and 512 tokens: the last-token
   logits of the padded prefill (the captured `PaddedPrefillGraph` on CUDA, `forward_padded`
   uncaptured on the CPU) against the eager `forward`'s, then 8 decode steps (`forward_static`,
   the decode graph's body) on the padded cache and on the eager one: worst |diff| / logit
   range (float32 bound 1e-4: the same math over other row counts; the decode steps see no
   padding) and the greedy tokens (bf16: all 9 must agree).
2. time (CUDA, bf16): one prefill of 512 tokens, eager `forward` vs the graph's replay, median
   of 5 (wall, synchronised), and `mlxr bench`'s measure (prompt 512, 128 tokens, median of 3)
   with MLXR_HYBRID_PREFILL_GRAPHS off and on, alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hybrid_tables  # noqa: E402
import make_checkpoint  # noqa: E402

import mlxr  # noqa: E402
from mlxr.engine import cuda_graph  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402

GRAPH_ENV = "MLXR_HYBRID_PREFILL_GRAPHS"


def checkpoint(path: Path, tiny: bool) -> Path:
    if (path / "config.json").exists():
        return path
    cfg = make_checkpoint.SHAPES["gemma-4-e2b"]
    if tiny:
        cfg = hybrid_tables.narrow_gemma4(cfg)
    t = time.perf_counter()
    make_checkpoint.write_hybrid(cfg, path, (4, 64, "affine"))
    print(f"wrote {path} in {time.perf_counter() - t:.0f} s")
    return path


def padded_prefill(dec, prompt: list[int], capacity: int):
    """(the padded prefill's last logits [V], its cache); the graph on CUDA."""
    bucket = cuda_graph.prefill_bucket(len(prompt), capacity)
    if dec.device.type == "cuda":
        graphs = cuda_graph.GraphCache()
        cache, _ = graphs.get(dec, capacity, new_cache)
        pg = graphs.prefill_graph(dec, cache, len(prompt))
        assert isinstance(pg, cuda_graph.PaddedPrefillGraph), "no padded prefill graph"
        return pg.run(prompt)[0].clone(), cache
    cache = new_cache(dec, capacity)
    ids = torch.zeros(bucket, dtype=torch.long)
    ids[:len(prompt)] = torch.tensor(prompt)
    logits = dec.forward_padded(ids, torch.tensor([len(prompt) - 1]), cache)[0]
    cache.length = len(prompt)
    return logits, cache


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    rng = (want.amax(-1) - want.amin(-1)).clamp_min(1e-30)
    return float(((got - want).abs().amax(-1) / rng).max())


def check(path: Path, device: str, dtypes: tuple[str, ...]) -> None:
    os.environ[GRAPH_ENV] = "1"
    for dtype in dtypes:
        m = mlxr.load(path, device=device, dtype=dtype)
        dec = m.decoder
        for n in (37, 512):
            prompt = torch.randint(0, m.config.vocab_size, (n + 8,),
                                   generator=torch.Generator().manual_seed(n)).tolist()
            with torch.inference_mode():
                plain = new_cache(dec, 1024)
                want = [dec.forward(torch.tensor(prompt[:n]), plain, last_only=True)[0]]
                got, cache = padded_prefill(dec, prompt[:n], 1024)
                got = [got]
                tables = {id(r.spec): r.cos_sin(0, cache.capacity) for r in dec._rope_kinds}
                for p in range(n, n + 8):  # the decode graph's body on both caches
                    ids = torch.tensor([prompt[p]], device=dec.device)
                    pos = torch.tensor([p], device=dec.device)
                    want.append(dec.forward_static(ids, pos, plain, tables)[0])
                    got.append(dec.forward_static(ids, pos, cache, tables)[0])
            w, g = torch.stack(want).float(), torch.stack(got).float()
            same = int((w.argmax(-1) == g.argmax(-1)).sum())
            first, rest = worst(g[:1], w[:1]), worst(g[1:], w[1:])
            ok = max(first, rest) <= 1e-4 if dtype == "float32" else same == 9
            print(f"check {dtype} n={n}: |diff| / range prefill {first:.2e}, decode {rest:.2e}, "
                  f"greedy {same}/9 {'ok' if ok else 'FAIL'}")
        del m, dec


def timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_prefill(path: Path) -> None:
    m = mlxr.load(path, device="cuda", dtype="bfloat16")
    dec = m.decoder
    prompt = torch.randint(0, m.config.vocab_size, (512,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    os.environ[GRAPH_ENV] = "1"
    with torch.inference_mode():
        graphs = cuda_graph.GraphCache()
        cache, _ = graphs.get(dec, 640, new_cache)
        pg = graphs.prefill_graph(dec, cache, 512)
        ids = torch.tensor(prompt)
        eager = timed(lambda: dec.forward(ids, new_cache(dec, 1024), last_only=True))
        graph = timed(lambda: pg.run(prompt))
    print(f"prefill 512: eager {eager * 1e3:.2f} ms ({512 / eager:,.0f} tok/s), graph "
          f"{graph * 1e3:.2f} ms ({512 / graph:,.0f} tok/s)")
    runs: dict[str, list] = {"0": [], "1": []}
    for _ in range(3):
        for flag in ("0", "1"):
            os.environ[GRAPH_ENV] = flag
            stats = None
            for chunk in m.stream(prompt, max_tokens=128, temperature=0, ignore_eos=True):
                stats = chunk.stats
            runs[flag].append(stats)
    for flag, rs in runs.items():
        rs = rs[1:]  # the first round captures the graphs
        print(f"bench {GRAPH_ENV}={flag}: prefill 512 "
              f"{statistics.median(r.prefill_tps for r in rs):,.0f} tok/s, decode "
              f"{statistics.median(r.decode_tps for r in rs):,.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny gemma4 (smoke run)")
    ap.add_argument("--float32", action="store_true", help="check float32 too (first)")
    a = ap.parse_args()
    device = "cpu" if a.tiny else "cuda"
    path = checkpoint(a.dir, a.tiny)
    dtypes = ("float32", "bfloat16") if a.float32 else ("bfloat16",)
    parts = [("check", lambda: check(path, device, dtypes))]
    if not a.tiny:
        parts.append(("time", lambda: time_prefill(path)))
    for name, part in parts:
        try:
            part()
        except Exception:  # noqa: BLE001 -- report and go on to the next part
            traceback.print_exc()
            print(f"{name}: FAIL")


if __name__ == "__main__":
    main()
