"""The serving engine's host work per decode step, with the model taken out (CPU is enough).

    PYTHONPATH=. python benchmarks/cpu/engine_host_bench.py [--batch 256] [--steps 200]
        [--tokenizer DIR] [--profile]

`LLMEngine` over the bundled stories260K with the paged decode runner on (eager) and its model
body replaced by a stand-in that writes random next ids: what is left of `engine.step()` is what
the H200 engine spends besides the graph replay (scheduling, the runner's host tables, prefix
cache bookkeeping, detokenization, stop checks, outputs and their callbacks). `--tokenizer`
swaps in another tokenizer for detokenization (e.g. a Qwen3 tokenizer dir: byte-level BPE, the
serving benchmark's); generated ids stay below the model's vocab. Reports the median host ms
per step with `batch` sequences decoding (prefill steps excluded); `--profile` prints the top of
a cProfile of those steps. The last line is JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import mlxr
from mlxr.cli.common import BUNDLED
from mlxr.engine import EngineRequest, LLMEngine
from mlxr.text.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    model = mlxr.load(BUNDLED / "stories260K", device="cpu")
    if a.tokenizer:
        model._tokenizer = mlxr.load_tokenizer(a.tokenizer)  # unchecked: ids stay < vocab
    vocab = model.config.vocab_size
    engine = LLMEngine(model, max_num_seqs=a.batch, paged_decode=True,
                       max_num_batched_tokens=a.batch * a.prompt)
    runner = engine.paged
    g = torch.Generator().manual_seed(0)

    def body(b: int) -> None:  # the stand-in for the model: next ids only
        runner.next_ids[:b] = torch.randint(3, vocab, (b,), generator=g)

    runner._body = body
    params = SamplingParams(max_tokens=a.steps + 8, temperature=0, ignore_eos=True)
    for _ in range(a.batch):
        ids = torch.randint(3, vocab, (a.prompt,), generator=g).tolist()
        engine.add(EngineRequest(ids, params), lambda o: None)
    while len(engine.scheduler.running) < a.batch:  # prefill (through the real model)
        engine.step()
    times = []
    prof = cProfile.Profile() if a.profile else None
    for _ in range(a.steps):
        t = time.perf_counter()
        if prof:
            prof.enable()
        engine.step()
        if prof:
            prof.disable()
        times.append((time.perf_counter() - t) * 1e3)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    ms = statistics.median(times)
    print(f"batch {a.batch}: host {ms:.3f} ms per decode step ({ms * 1e3 / a.batch:.1f} us per "
          f"sequence), median of {a.steps}")
    print(json.dumps({"batch": a.batch, "host_ms_per_step": round(ms, 3),
                      "us_per_seq": round(ms * 1e3 / a.batch, 2)}))


if __name__ == "__main__":
    main()
