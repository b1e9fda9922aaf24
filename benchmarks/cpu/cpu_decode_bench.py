"""CPU decode, the lean step (`mlxr.models.cpu_decode`) against the generic layer loop, in one
process, alternating (the dev box's 2 cores are shared: only ratios measured this way mean much).

    PYTHONPATH=. python benchmarks/cpu/cpu_decode_bench.py MODEL_DIR [--prompt 512]
        [--steps 8] [--rounds 8] [--batch 1] [--threads N] [--cpu-time]

Two KV caches get the same random prompt; then each round decodes `steps` tokens on each path
(env MLXR_CPU_DECODE=0 selects the generic loop, read per step), the paths' order flipped every
round. `--batch B` decodes B sequences per step through `forward_step` (the serving engine's
CPU decode). Prints each path's median ms per step over the rounds' medians, tok/s, the ratio,
and whether the two paths' logits were equal (they must be: the lean step keeps the numbers).
`--cpu-time` times the process's CPU time instead of the wall: with `--threads 1` on a busy
box it counts the work done, not the waits for a core (with 2 threads, OpenMP's spinning
counts too).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import mlxr
from mlxr.engine.kv_cache import new_cache
from mlxr.models.decoder import SeqSpan, Step


class _Seqs:
    """B sequences decoding side by side, each in its own contiguous slot range of one pool."""

    def __init__(self, dec, batch: int, prompt: torch.Tensor, capacity: int):
        self.dec, self.batch, self.cap = dec, batch, capacity
        self.cache = new_cache(dec, batch * capacity)
        self.lens = [0] * batch
        for b in range(batch):
            step = self._step([(b, len(prompt))], last_only=True)
            dec.forward_step(prompt, step, self.cache.pool)
            self.lens[b] = len(prompt)

    def _step(self, rows: list[tuple[int, int]], last_only: bool = False) -> Step:
        spans, slots = [], []
        for b, t in rows:
            a, start = b * self.cap, self.lens[b]
            spans.append(SeqSpan(start, t, slot_range=(a, a + start + t)))
            slots += range(a + start, a + start + t)
        rows_t = torch.tensor([len(slots) - 1]) if last_only else None
        return Step(spans, torch.tensor(slots), rows_t)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.dec.forward_step(tokens, self._step([(b, 1) for b in range(self.batch)]),
                                       self.cache.pool)
        self.lens = [n + 1 for n in self.lens]
        return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = mlxr.load(a.model, device="cpu")
    dec = model.decoder
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, dec.config.vocab_size, (a.prompt,), generator=g)
    cap = a.prompt + a.rounds * a.steps + 8
    paths = {"generic": "0", "lean": "1"}
    clock = time.process_time if a.cpu_time else time.perf_counter
    with torch.inference_mode():
        seqs = {name: _Seqs(dec, a.batch, prompt, cap) for name in paths}
        times: dict[str, list[float]] = {name: [] for name in paths}
        equal = True
        for r in range(a.rounds):
            tokens = torch.randint(0, dec.config.vocab_size, (a.steps, a.batch), generator=g)
            got = {}
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                os.environ["MLXR_CPU_DECODE"] = paths[name]
                ts = []
                for t in tokens:
                    t0 = clock()
                    got[name] = seqs[name].decode(t)
                    ts.append(clock() - t0)
                times[name].append(statistics.median(ts))
            equal &= torch.equal(got["generic"], got["lean"])
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    for name, v in ms.items():
        print(f"{name:8s} {v:7.2f} ms/step  {1e3 * a.batch / v:7.1f} tok/s  "
              f"(round medians {[round(1e3 * x, 1) for x in times[name]]})")
    ratio = ms["generic"] / ms["lean"]
    print(f"lean / generic tok/s: {ratio:.2f}x; logits equal: {equal}")
    print(json.dumps({"ms_generic": ms["generic"], "ms_lean": ms["lean"], "ratio": ratio,
                      "batch": a.batch, "prompt": a.prompt, "threads": torch.get_num_threads(),
                      "cpu_time": a.cpu_time, "logits_equal": equal}))


if __name__ == "__main__":
    main()
