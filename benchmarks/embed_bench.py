"""Embeddings throughput: texts/s and tokens/s of an embedding model, through `model.embed`'s
batch path and through the serving engine (the path the server's /v1/embeddings takes).

    python benchmarks/embed_bench.py MODEL_DIR --device {cpu,cuda} [--batch 1,16,256]
        [--tokens 16,512] [--repeats 3] [--threads N] [--engine-tokens N] [--dtype D]

Each configuration (batch B texts of T tokens each, random ids inside the vocabulary, so no
tokenizer is needed and every text is exactly T tokens; new texts for every run, so the
engine's prefix cache never answers from an earlier run) runs once to warm up, then `--repeats`
times; the median wall time is reported, device-synchronised:
- `embed`: `mlxr.embed.embed_ids` -- model.embed without the tokenizer: one forward pass per
  8192 tokens over a scratch KV range, last-token pooling, L2 norm;
- `engine`: the B texts as one embeddings request of an LLMEngine (prefill-only sequences
  packed into steps of `--engine-tokens`, default the engine's: 2048 on CUDA, 256 on the CPU),
  stepped to completion on this thread.
One line per configuration, then a JSON line with all of them. Make a real-shape random
checkpoint with `python benchmarks/make_checkpoint.py qwen3-embedding-0.6b DIR`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mlxr
from mlxr.embed import embed_ids
from mlxr.engine import LLMEngine


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def through_engine(engine: LLMEngine, seqs: list[list[int]]) -> torch.Tensor:
    got: dict[int, torch.Tensor] = {}

    def emit(out) -> None:
        if isinstance(out, BaseException):
            raise out
        got[out.index] = out.vector
    engine.add_embeddings(seqs, "last", emit)
    while engine.has_work():
        engine.step()
    return torch.stack([got[i] for i in range(len(seqs))])


def timed(fn, runs: list[list[list[int]]], dev: torch.device) -> float:
    """Median wall time of fn(texts) over runs[1:] (runs[0] warms up)."""
    fn(runs[0])
    walls = []
    for seqs in runs[1:]:
        sync(dev)
        t = time.perf_counter()
        fn(seqs)
        sync(dev)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="compute dtype (default: mlxr's, bfloat16)")
    ap.add_argument("--batch", default="1,16,256")
    ap.add_argument("--tokens", default="16,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--engine-tokens", type=int, help="the engine's tokens per step")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batch.split(",")]
    lengths = [int(t) for t in a.tokens.split(",")]
    t0 = time.perf_counter()
    model = mlxr.load(a.model, device=a.device, dtype=a.dtype)
    dev = model.decoder.device
    budget = a.engine_tokens or (2048 if dev.type == "cuda" else 256)
    # room for a step's texts and one text in chunks: the pool is not what is measured
    blocks = 2 * -(-(budget + max(lengths)) // 16)
    engine = LLMEngine(model, max_num_batched_tokens=budget, num_blocks=blocks)
    print(f"{model.path.name}: loaded in {time.perf_counter() - t0:.1f} s on {dev} "
          f"({model.dtype}, {torch.get_num_threads()} threads); engine {budget} tokens/step")
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        for b in batches:
            runs = [torch.randint(0, model.config.vocab_size, (b, n), generator=g).tolist()
                    for _ in range(2 * (a.repeats + 1))]
            check = embed_ids(model, runs[0][:2])
            got = through_engine(engine, runs[0][:2]).to(check.device)
            assert (got - check).abs().max() < 1e-2, "engine and embed paths disagree"
            for i, (path, fn) in enumerate((("embed", lambda s: embed_ids(model, s)),
                                            ("engine", lambda s: through_engine(engine, s)))):
                s = timed(fn, runs[i * (a.repeats + 1):(i + 1) * (a.repeats + 1)], dev)
                r = {"path": path, "batch": b, "tokens": n, "seconds": round(s, 4),
                     "texts_s": round(b / s, 3), "tokens_s": round(b * n / s, 1)}
                rows.append(r)
                print(f"{dev.type} {path:6s} batch {b:4d} x {n:4d} tokens: "
                      f"{r['texts_s']:10.3f} texts/s {r['tokens_s']:11.1f} tokens/s "
                      f"(median of {a.repeats}: {s:.3f} s)", flush=True)
    print(json.dumps({"model": model.path.name, "device": dev.type, "dtype": str(model.dtype),
                      "threads": torch.get_num_threads(), "engine_tokens": budget,
                      "rows": rows}))


if __name__ == "__main__":
    main()
