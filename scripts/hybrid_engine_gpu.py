"""The hybrid families' serving engine on CUDA (issue 29): the slot pool and its captured
decode step per batch bucket (engine.slot_caches, engine.hybrid_graphs) against the
per-sequence caches it replaces. Needs torch and triton, not mlx.

    python benchmarks/make_checkpoint.py qwen3.5-2b MODEL_DIR
    PYTHONPATH=. python scripts/hybrid_engine_gpu.py MODEL_DIR [--budget 540] [--tiny-dir D]
        [--only check | bench]

1. check (float32, tiny random models of tests/hybrid_configs.py written with
   make_checkpoint's real-format tensors, q4g64, in --tiny-dir; every family): the static
   step's logits vs each sequence's own forward on the same states (worst |diff| over the
   largest |logit|, bound 1e-4: other kernels for 1 and 4 rows; the CPU test holds 1e-5),
   then the engine with captured graphs (eagerly where a MoE block is not capturable), 6
   greedy requests of different lengths through 4 slots (joining and leaving mid-decode)
   == each alone (`generate`), and a repeated prompt resumed from its prefix snapshot ==
   the first run.
   Then MODEL_DIR in bf16: 8 greedy requests x 32 tokens, the graphs engine vs the slot
   path run eagerly (the same kernels: must be equal) and vs the per-sequence caches (other
   attention kernels: a difference is printed with its position, not failed).
2. bench (MODEL_DIR, bf16): engine_bench-style rounds (prompt 32, greedy, ignore_eos) at
   batches 1, 8, 64 with 128 output tokens: modes `graphs` (default engine), `slots-eager`
   (paged_decode=True, MLXR_HYBRID_GRAPHS=0) and `old` (paged_decode=False: per-sequence
   caches; 32 tokens, batches 1 and 8 only, it was 82 ms a step at batch 1), then
   `graphs-nosnap` (no prefix snapshots: what the decode-time state copies cost) at 64.
   Per row: output tok/s over the round (prefill included), median decode step ms, the
   runner's share of it.
Each unit checks the time left (--budget seconds from the start) and prints SKIP (budget)
rather than start what may not finish. Last line: "done: all ok" or "done: FAIL".
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mlxr  # noqa: E402
from hybrid_configs import FAMILIES  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.engine.decode_graphs import supported  # noqa: E402
from mlxr.engine.scheduler import Sequence  # noqa: E402
from mlxr.engine.slot_caches import SlotCaches  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

VOCAB = 320  # hybrid_configs' vocab_size
START = time.monotonic()
DEV = "cuda"  # --device cpu: a smoke run of the script's code (graphs mode runs eagerly)


def left(budget: float) -> float:
    return budget - (time.monotonic() - START)


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _engine(model, mode: str, **kw) -> LLMEngine:
    """graphs: the default engine; graphs-nosnap: without prefix snapshots; slots-eager: the
    slot path without capture; old: the per-sequence caches."""
    os.environ["MLXR_HYBRID_GRAPHS"] = "0" if mode == "slots-eager" else "1"
    os.environ["MLXR_HYBRID_SLOTS"] = "1"  # the default since session 23; set for old trees
    if mode == "graphs-nosnap":
        mode, kw = "graphs", dict(kw, prefix_snapshot_bytes=0)
    paged = {"graphs": None if DEV == "cuda" else True, "slots-eager": True,
             "old": False}[mode]
    engine = LLMEngine(model, paged_decode=paged, **kw)
    os.environ["MLXR_HYBRID_GRAPHS"] = "1"
    slots = isinstance(engine.seq_caches, SlotCaches)
    assert slots == (mode != "old"), (mode, type(engine.seq_caches))
    if mode == "graphs" and DEV == "cuda":
        runner = engine.seq_caches.runner
        assert sorted(runner.graphs) == runner.buckets, \
            f"buckets {runner.buckets}, captured {sorted(runner.graphs)}"
    return engine


def _run(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        engine.add(EngineRequest(p, params), lambda o, i=i: outs[i].extend(o.token_ids))
    while engine.has_work():
        engine.step()
    return outs


def static_err(model) -> float:
    """Worst |static step - own forward| / max|logit| over three sequences (bucket 4)."""
    dec = model.decoder
    caches = SlotCaches(dec, 16, 0, num_blocks=16, max_seqs=4, max_positions=128,
                        graphs=False)
    rng = random.Random(5)
    worst = 0.0
    seqs, views, refs = [], [], []
    with torch.inference_mode():
        for j, n in enumerate((5, 23, 40)):
            p = [rng.randrange(VOCAB) for _ in range(n)]
            seq = Sequence(p + [7], n + 1)
            seq.block_table = [4 * j + b for b in range(4)]
            view = caches._cache_at(seq)
            dec.forward(torch.tensor(p), view, last_only=True)
            seq.num_computed = n
            ref = dec.new_cache(128)
            dec.forward(torch.tensor(p), ref, last_only=True)
            seqs.append(seq), views.append(view), refs.append(ref)
        got = caches.runner.run(seqs, views).clone()
        for j, ref in enumerate(refs):
            want = dec.forward(torch.tensor([7]), ref, last_only=True)[0]
            worst = max(worst, float((got[j] - want).abs().max() / want.abs().max()))
    return worst


def check_tiny(out: Path, budget: float, families: list[str]) -> bool:
    mc = _module("make_checkpoint", ROOT / "benchmarks" / "make_checkpoint.py")
    ok = True
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in (5, 23, 11, 17, 9, 30)]
    lengths = [12, 5, 9, 14, 3, 10]
    for family in families:
        if left(budget) < 60:
            print(f"{family:15s} SKIP (budget)", flush=True)
            continue
        path = out / f"{family}-q4g64"
        try:
            if not (path / "config.json").is_file():
                mc.write_hybrid(copy.deepcopy(FAMILIES[family]), path, (4, 64, "affine"))
            ok &= _check_family(family, path, prompts, lengths)
        except Exception as e:  # noqa: BLE001 -- reported, the next family runs
            ok = False
            print(f"{family:15s} FAIL {type(e).__name__}: {e}", flush=True)
        _free()
    return ok


def _check_family(family: str, path: Path, prompts: list, lengths: list) -> bool:
    model = mlxr.load(path, device=DEV, dtype="float32")
    err = static_err(model)
    mode = "graphs" if supported(model.decoder) or DEV == "cpu" else "slots-eager"
    engine = _engine(model, mode, max_num_seqs=4, block_size=16)
    got = _run(engine, prompts, lengths)
    want = [list(model.generate(p, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    again = _run(engine, prompts[5:], [10])[0]
    resumed = engine.stats()["prefix_cache_hits"] > 0
    good = err <= 1e-4 and got == want and again == want[5] and resumed
    print(f"{family:15s} f32 static-vs-own {err:.1e}  engine({mode})==alone "
          f"{got == want}  snapshot resume same {again == want[5]} (hit {resumed})  "
          f"{'ok' if good else 'FAIL'}", flush=True)
    return good


def check_model(path: Path, budget: float) -> bool:
    if left(budget) < 120:
        print("bf16 model check SKIP (budget)", flush=True)
        return True
    model = mlxr.load(path, device=DEV)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(100, model.config.vocab_size - 100, (32,), generator=g).tolist()
               for _ in range(8)]
    runs = {}
    for mode in ("graphs", "slots-eager", "old"):
        engine = _engine(model, mode, max_num_seqs=8, num_blocks=8 * 5 + 8)
        runs[mode] = _run(engine, prompts, [32] * 8)
        del engine
        _free()
    same = runs["graphs"] == runs["slots-eager"]
    vs_old = sum(a == b for a, b in zip(runs["graphs"], runs["old"]))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(runs["graphs"], runs["old"])]
    print(f"{path.name} bf16 8x32: graphs == slots-eager {same}  graphs == old "
          f"{vs_old}/8 (first differences at {[f for f in first if f is not None]})  "
          f"{'ok' if same else 'FAIL'}", flush=True)
    return same


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def _round(engine: LLMEngine, batch: int, tokens: int, seed: int, deadline: float) -> dict:
    """One round of `batch` requests (prompt 32); None past the deadline (aborted)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    reqs, done = [], [0]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for _ in range(batch):
        ids = torch.randint(100, vocab - 100, (32,), generator=g).tolist()
        reqs.append(engine.add(EngineRequest(ids, params),
                               lambda o: done.__setitem__(0, done[0] + len(o.token_ids))))
    runner = getattr(engine.seq_caches, "runner", None)
    inside = [0.0]
    if runner is not None:
        run = runner.run

        def timed(*a):
            t = time.perf_counter()
            out = run(*a)
            inside[0] += time.perf_counter() - t
            return out
        runner.run = timed
    steps = []
    _sync()
    t0 = time.perf_counter()
    while engine.has_work():
        if time.monotonic() > deadline:
            for r in reqs:
                engine.abort(r)
            while engine.has_work():
                engine.step()
            return None
        t, before = time.perf_counter(), inside[0]
        engine.step()
        steps.append((time.perf_counter() - t, inside[0] - before))
    _sync()
    wall = time.perf_counter() - t0
    if runner is not None:
        runner.run = run
    decode = steps[len(steps) // 4:]
    return {"tok_s": done[0] / wall, "step_ms": 1e3 * statistics.median(s for s, _ in decode),
            "runner_ms": 1e3 * statistics.median(r for _, r in decode)}


def bench(path: Path, budget: float) -> None:
    model = mlxr.load(path, device=DEV)
    print(f"{'mode':12s} {'batch':>5s} {'tokens':>6s} {'out tok/s':>10s} {'step ms':>8s} "
          f"{'runner ms':>9s}", flush=True)
    plan = [("graphs", (1, 8, 64), 128), ("slots-eager", (1, 8, 64), 128),
            ("old", (1, 8), 32), ("graphs-nosnap", (64,), 128)]
    for mode, batches, tokens in plan:
        if left(budget) < 45:
            print(f"{mode:12s} SKIP (budget)", flush=True)
            continue
        try:
            _bench_mode(model, mode, batches, tokens, budget)
        except Exception as e:  # noqa: BLE001 -- reported, the next mode runs
            print(f"{mode:12s} FAIL {type(e).__name__}: {e}", flush=True)
        _free()


def _bench_mode(model, mode: str, batches: tuple, tokens: int, budget: float) -> None:
    t = time.monotonic()
    engine = _engine(model, mode, max_num_seqs=max(batches),
                     num_blocks=max(batches) * -(-(32 + tokens + 16) // 16) + 8)
    runner = getattr(engine.seq_caches, "runner", None)
    pool = f", slot pool {runner.pool.nbytes / 1e9:.2f} GB" if runner else ""
    print(f"{mode:12s} engine ready in {time.monotonic() - t:.1f} s, graphs "
          f"{sorted(runner.graphs) if runner else '-'}{pool}", flush=True)
    for b in batches:
        deadline = START + budget - 20
        warm = _round(engine, b, 8, 0, deadline)
        r = _round(engine, b, tokens, 1, deadline) if warm is not None else None
        if r is None:
            print(f"{mode:12s} {b:5d} {tokens:6d} SKIP (budget: aborted)", flush=True)
            return
        print(f"{mode:12s} {b:5d} {tokens:6d} {r['tok_s']:10.1f} {r['step_ms']:8.2f} "
              f"{r['runner_ms']:9.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--tiny-dir", type=Path,
                    help="where the tiny checkpoints go (default: a temp dir)")
    ap.add_argument("--only", choices=["check", "bench"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--families", default=",".join(sorted(FAMILIES)),
                    help="the tiny families to check (comma-separated)")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA")
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    ok = True
    if a.only in (None, "check"):
        tiny = a.tiny_dir or Path(tempfile.mkdtemp(prefix="hybeng-"))
        ok &= check_tiny(tiny, a.budget * 0.45 if a.only is None else a.budget,
                         a.families.split(","))
        try:
            ok &= check_model(a.model, a.budget)
        except Exception as e:  # noqa: BLE001 -- reported, the bench runs
            ok = False
            print(f"bf16 model check FAIL {type(e).__name__}: {e}", flush=True)
    if a.only in (None, "bench"):
        bench(a.model, a.budget)
    print(f"done: {'all ok' if ok else 'FAIL'} ({time.monotonic() - START:.0f} s)", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
