"""Output tokens/s of the serving engine itself (no HTTP): B requests at once, greedy, fixed
length, stepped to completion by LLMEngine; the same batches the server would run.

    python benchmarks/engine_bench.py MODEL [--batches 1,8,64,256] [--prompt 32] [--tokens 128]
        [--device cuda] [--eager] [--tokens-out FILE] [--tensor-parallel N]

Per batch size: a warm-up round, then a measured one. Reports output tok/s over the whole round
(prefill steps included), the median decode-step time, and how much of it the host spends
outside the decode runner (scheduling, sampling bookkeeping, detokenization), and the bytes of
the quantized weights with their decode copies and the KV pool's size. `--eager` turns
the captured decode graphs off (the eager forward_step path; for the hybrid families the
per-sequence caches, `MLXR_HYBRID_GRAPHS=0` likewise) for an A/B; `MLXR_HYBRID_SLOTS=0` takes
the hybrid families off the slot pool and its captured decode (the default) onto per-sequence
caches.
`--tokens-out` writes the measured rounds' greedy tokens (per batch size, per request) as
JSON, to compare two runs (e.g. two `MLXR_PREFILL_GEMM` routings). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mlxr
from mlxr.engine import EngineRequest, LLMEngine
from mlxr.text.sampling import SamplingParams


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def decode_runner(engine: LLMEngine):
    """The engine's batched decode runner: the paged one (dense families) or the hybrids'
    slot-pool one (None: the hybrids' per-sequence caches, or no runner)."""
    return engine.paged or getattr(engine.seq_caches, "runner", None)


def round_(engine: LLMEngine, batch: int, prompt: int, tokens: int, vocab: int,
           seed: int, got: list | None = None) -> dict:
    """One round of `batch` requests; `got` (if given) receives each request's tokens."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    done = [0]
    for i in range(batch):
        ids = torch.randint(100, vocab - 100, (prompt,), generator=g).tolist()
        if got is not None:
            got.append([])

        def emit(o, i=i):
            done[0] += len(o.token_ids)
            if got is not None:
                got[i] += o.token_ids
        engine.add(EngineRequest(ids, params), emit)
    runner = decode_runner(engine)
    inside = [0.0]
    if runner is not None:
        run = runner.run

        def timed(*args):
            t = time.perf_counter()
            out = run(*args)
            inside[0] += time.perf_counter() - t
            return out
        runner.run = timed
    steps = []
    dev = engine.decoder.device
    sync(dev)
    t0 = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        before = inside[0]
        engine.step()
        steps.append((time.perf_counter() - t, inside[0] - before))
    sync(dev)
    wall = time.perf_counter() - t0
    if runner is not None:
        runner.run = run
    decode = [s for s in steps[len(steps) // 4:]]  # past the prefill steps
    step_s = statistics.median(s for s, _ in decode)
    runner_s = statistics.median(r for _, r in decode)
    return {"batch": batch, "output_tok_s": round(done[0] / wall, 1), "wall_s": round(wall, 3),
            "steps": len(steps), "step_ms": round(step_s * 1e3, 3),
            "runner_ms": round(runner_s * 1e3, 3),
            "host_other_ms": round((step_s - runner_s) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--eager", action="store_true", help="no decode graphs (forward_step)")
    ap.add_argument("--tokens-out", help="write the measured rounds' tokens here (JSON)")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (GPUs) to split over")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    model = mlxr.load(a.model, device=a.device, tensor_parallel=a.tensor_parallel)
    t = time.perf_counter()
    engine = LLMEngine(model, max_num_seqs=max(batches), paged_decode=False if a.eager else None)
    setup = time.perf_counter() - t
    weights = sum(qw.nbytes for qw in engine.decoder.quant_weights())
    runner = decode_runner(engine)
    kind = "" if engine.seq_caches is None else \
        " (hybrid: per-sequence caches)" if runner is None else " (hybrid: slot pool)"
    print(f"engine ready in {setup:.1f} s (decode graphs: "
          f"{sorted(runner.graphs) if runner else 'off'}); quantized weights with "
          f"their copies {weights / 1e9:.2f} GB, KV pool "
          f"{len(engine.blocks.blocks)} blocks{kind}")
    out, tokens = [], {}
    for b in batches:
        round_(engine, b, a.prompt, min(16, a.tokens), model.config.vocab_size, 0)  # warm-up
        r = round_(engine, b, a.prompt, a.tokens, model.config.vocab_size, 1,
                   tokens.setdefault(b, []))
        out.append(r)
        print(f"batch {b:4d}: {r['output_tok_s']:10.1f} output tok/s  step {r['step_ms']} ms "
              f"(runner {r['runner_ms']} ms, host other {r['host_other_ms']} ms)")
    if a.tokens_out:
        with open(a.tokens_out, "w") as f:
            json.dump(tokens, f)
    print(json.dumps({"setup_s": round(setup, 1), "eager": a.eager,
                      "quant_weights_gb": round(weights / 1e9, 3),
                      "kv_blocks": len(engine.blocks.blocks), "rounds": out}))


if __name__ == "__main__":
    main()
