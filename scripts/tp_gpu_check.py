"""Tensor parallelism on N GPUs of one host: parity against one GPU, decode / prefill speed,
and the all-reduce's own cost (docs/tensor_parallel.md gives the commands and the targets).

    PYTHONPATH=. python scripts/tp_gpu_check.py parity MODEL --tp 2
    PYTHONPATH=. python scripts/tp_gpu_check.py speed MODEL --tp 2 [-p 512] [-n 128]
    PYTHONPATH=. python scripts/tp_gpu_check.py allreduce --tp 2 [--hidden 4096 --layers 32]

parity: teacher-forced logits of a fixed 64-token sequence and 32 greedy tokens, TP=N against
float32 TP=1 on GPU 0. float32 TP=N: logits within 1e-3 of each position's range (the CPU
bound: only sums are regrouped). bfloat16 TP=N: no further from float32 TP=1 than 1.5x
bfloat16 TP=1's own distance from it plus 1% of the range (tests/test_parity.py's bf16 rule:
the regrouped sums round at other points, an error of the same kind and size as bf16's own).
Greedy tokens equal up to the first position whose top-two margin is under twice the
tolerance (a near-tie). speed: `mlxr bench`'s measurement (median of 3 after a
warm-up) at TP=1 and TP=N, and the weight bytes each rank reads per token with the bandwidth
that implies. allreduce: N processes time the step's collectives alone (2L+1 all-reduces of
[B, hidden] bf16 and one all-gather of [B, V/N] float32 logits). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxr  # noqa: E402

os.environ["NCCL_NVLS_ENABLE"] = "0"
F32_TOL = 1e-3


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        _sync()


def _seq(vocab: int, n: int = 64) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(n)]


def _run(a, dtype: str, world: int, seq: list[int], extra: list[int] | None):
    """(logits of seq, greedy tokens after seq, logits of seq + extra) of one load."""
    model = mlxr.load(a.model, device=a.device, dtype=dtype, tensor_parallel=world)
    logits = model.logits(seq).numpy()
    greedy = list(model.generate(seq, max_tokens=32, ignore_eos=True))
    full = model.logits(seq + (greedy if extra is None else extra)).numpy()
    model.close()
    del model
    _free()
    return logits, greedy, full


def parity(a) -> dict:
    from mlxr.config import load_config
    from mlxr.names import resolve_model

    config, _ = load_config(resolve_model(a.model))
    seq = _seq(config.vocab_size)
    ref, greedy, full = _run(a, "float32", 1, seq, None)
    scale = ref.max(-1) - ref.min(-1)
    part = np.sort(full, -1)
    margin = (part[:, -1] - part[:, -2]) / (part[:, -1] - part[:, 0])
    own, bf16_greedy, _ = _run(a, "bfloat16", 1, seq, greedy)
    bf16_own = float((np.abs(own - ref).max(-1) / scale).max())
    out = {"bf16_tp1_err_of_range": bf16_own}
    for dtype in ("float32", "bfloat16"):
        tol = F32_TOL if dtype == "float32" else 1.5 * bf16_own + 0.01
        got, tokens, _ = _run(a, dtype, a.tp, seq, greedy)
        err = float((np.abs(got - ref).max(-1) / scale).max())
        tie = next((i for i in range(len(greedy)) if margin[len(seq) - 1 + i] < 2 * tol),
                   len(greedy))
        same = tokens[:tie] == greedy[:tie]
        out[dtype] = {"max_err_of_range": err, "tolerance": tol, "greedy_equal_upto": tie,
                      "greedy_equal": same, "ok": err <= tol and same}
        if dtype == "bfloat16":  # information: how long bf16 TP=N follows bf16 TP=1
            out[dtype]["same_tokens_as_bf16_tp1"] = next(
                (i for i, (x, y) in enumerate(zip(tokens, bf16_greedy)) if x != y), len(tokens))
        print(f"{dtype:9s} TP={a.tp} vs float32 TP=1: logits {err:.2e} of the range (tol "
              f"{tol:.2e}), greedy equal over the {tie} tokens before a near-tie: {same}",
              flush=True)
    return out


def speed(a) -> dict:
    from mlxr.cli.bench import weight_bytes_per_token
    from mlxr.cli.common import resolve_model

    path = resolve_model(a.model)
    out = {}
    for world in (1, a.tp):
        model = mlxr.load(path, device=a.device, tensor_parallel=world)
        prompt = _seq(model.config.vocab_size, a.p)

        def once(m):
            stats = None
            for chunk in m.stream(prompt, max_tokens=a.n, temperature=0, ignore_eos=True):
                stats = chunk.stats
            return stats

        once(model)
        runs = [once(model) for _ in range(3)]
        wbytes = weight_bytes_per_token(model)
        model.close()
        del model
        _free()
        decode = statistics.median(r.decode_tps for r in runs)
        prefill = statistics.median(r.prefill_tps for r in runs)
        out[f"tp{world}"] = {"decode_tok_s": round(decode, 1), "prefill_tok_s": round(prefill, 1),
                             "weight_gb_per_rank_token": round(wbytes / 1e9, 3),
                             "gb_s_per_rank": round(wbytes * decode / 1e9, 1)}
        print(f"TP={world}: prefill {a.p} tokens {prefill:9.1f} tok/s, decode {a.n} tokens "
              f"{decode:8.1f} tok/s, {wbytes / 1e9:.2f} GB/token/rank -> "
              f"{wbytes * decode / 1e9:.0f} GB/s per rank", flush=True)
    return out


def _time_collectives(rank: int, a, port: int, results) -> None:
    from mlxr.parallel.group import Group, master_store

    dev = torch.device(f"cuda:{rank}" if a.device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = master_store(a.tp) if rank == 0 else None
    if rank == 0:
        port.value = store.port
    else:
        while port.value == 0:
            time.sleep(0.01)
    g = Group(store, port.value, rank, a.tp, dev)
    row = {}
    for b in (1, 8, 64, 256):
        x = torch.randn(b, a.hidden, dtype=torch.bfloat16, device=dev)
        logits = torch.randn(b, -(-a.vocab // a.tp), dtype=torch.float32, device=dev)
        for _ in range(5):
            g.all_reduce(x)
            g.all_gather_last(logits, logits.shape[1], a.vocab)
        _sync()
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            g.all_reduce(x)
        _sync()
        reduce_us = (time.perf_counter() - t0) / reps * 1e6
        t0 = time.perf_counter()
        for _ in range(reps):
            g.all_gather_last(logits, logits.shape[1], a.vocab)
        _sync()
        gather_us = (time.perf_counter() - t0) / reps * 1e6
        row[b] = {"all_reduce_us": round(reduce_us, 1), "all_gather_us": round(gather_us, 1),
                  "per_step_us": round((2 * a.layers + 1) * reduce_us + gather_us, 1)}
    if rank == 0:
        results.update({str(k): v for k, v in row.items()})


def allreduce(a) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    mgr = ctx.Manager()
    results, port = mgr.dict(), ctx.Value("i", 0)
    procs = [ctx.Process(target=_time_collectives, args=(r, a, port, results))
             for r in range(a.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = dict(results)
    for b, row in out.items():
        print(f"batch {b:>3}: all-reduce [{b}, {a.hidden}] bf16 {row['all_reduce_us']:.1f} us, "
              f"logit all-gather {row['all_gather_us']:.1f} us, per decode step "
              f"({2 * a.layers + 1} + 1) {row['per_step_us'] / 1e3:.2f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["parity", "speed", "allreduce"])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("-p", type=int, default=512, help="speed: prompt tokens")
    ap.add_argument("-n", type=int, default=128, help="speed: decoded tokens")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run over gloo")
    ap.add_argument("--hidden", type=int, default=4096, help="allreduce: hidden size")
    ap.add_argument("--layers", type=int, default=32, help="allreduce: layers")
    ap.add_argument("--vocab", type=int, default=128256, help="allreduce: vocabulary")
    a = ap.parse_args()
    if a.what != "allreduce" and a.model is None:
        ap.error(f"{a.what} needs MODEL")
    out = {"parity": parity, "speed": speed, "allreduce": allreduce}[a.what](a)
    print(json.dumps({"check": a.what, "tp": a.tp, **out}))


if __name__ == "__main__":
    main()
