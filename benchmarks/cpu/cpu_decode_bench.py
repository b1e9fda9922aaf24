"""CPU decode, three arms in one process, alternating (the dev box's 2 cores are shared: only
ratios measured this way mean much): the generic layer loop and the lean step
(`mlxr.models.cpu_decode`) on torch's kernels (a model loaded with MLXR_CPU_KERNELS=0), and the
lean step on mlxr's compiled kernels (`mlxr.ops.cpu`, a second load of the model; skipped where
they were not built) with their defaults ("kernels"), that again without the fused layer calls
(`mlxr.ops.cpu.fused`, env MLXR_CPU_FUSED=0: "unfused", whose logits must equal the kernels
arm's bit for bit) and with torch's attention (MLXR_CPU_ATTEND=0: "torch_attn").

    PYTHONPATH=. python benchmarks/cpu/cpu_decode_bench.py MODEL_DIR [--prompt 512]
        [--steps 8] [--rounds 8] [--batch 1] [--threads N] [--cpu-time]

Two KV caches get the same random prompt; then each round decodes `steps` tokens on each path
(env MLXR_CPU_DECODE=0 selects the generic loop, read per step), the paths' order flipped every
round. `--batch B` decodes B sequences per step through `forward_step` (the serving engine's
CPU decode). Prints each path's median ms per step over the rounds' medians, tok/s, the ratios,
whether the torch arms' logits were equal (they must be: the lean step keeps the numbers) and
the kernels arm's largest logit difference from them, relative to the logit range.
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
from mlxr.ops.cpu import native
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


ENVS = ("MLXR_CPU_DECODE", "MLXR_CPU_KERNELS", "MLXR_CPU_FUSED", "MLXR_CPU_ATTEND")


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
    os.environ["MLXR_CPU_KERNELS"] = "0"
    dec0 = mlxr.load(a.model, device="cpu").decoder
    # arm: (decoder, MLXR_CPU_DECODE, _KERNELS, _FUSED, _ATTEND); "" = the default
    arms = {"generic": (dec0, "0", "0", "", ""), "lean": (dec0, "1", "0", "", "")}
    if native.available():
        os.environ["MLXR_CPU_KERNELS"] = "1"
        dec1 = mlxr.load(a.model, device="cpu").decoder
        arms["kernels"] = (dec1, "1", "1", "", "")  # all of mlxr's kernels, their defaults
        arms["unfused"] = (dec1, "1", "1", "0", "")  # the same values without layer.c
        arms["torch_attn"] = (dec1, "1", "1", "", "0")  # the same with torch's attention
    g = torch.Generator().manual_seed(0)
    vocab = dec0.config.vocab_size
    prompt = torch.randint(0, vocab, (a.prompt,), generator=g)
    cap = a.prompt + a.rounds * a.steps + 8
    clock = time.process_time if a.cpu_time else time.perf_counter

    def use(name):
        for k, v in zip(ENVS, arms[name][1:], strict=True):
            os.environ[k] = v

    with torch.inference_mode():
        seqs = {}
        for name in arms:
            use(name)
            seqs[name] = _Seqs(arms[name][0], a.batch, prompt, cap)
        times: dict[str, list[float]] = {name: [] for name in arms}
        equal, fused_equal, diff, attn_diff = True, True, 0.0, 0.0
        for r in range(a.rounds):
            tokens = torch.randint(0, vocab, (a.steps, a.batch), generator=g)
            got = {}
            for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                use(name)
                ts = []
                for t in tokens:
                    t0 = clock()
                    got[name] = seqs[name].decode(t)
                    ts.append(clock() - t0)
                times[name].append(statistics.median(ts))
            equal &= torch.equal(got["generic"], got["lean"])
            if "kernels" in got:
                fused_equal &= torch.equal(got["kernels"], got["unfused"])
                rng = got["generic"].max(-1).values - got["generic"].min(-1).values
                d = (got["kernels"] - got["generic"]).abs().max(-1).values / rng
                diff = max(diff, float(d.max()))
                d = (got["kernels"] - got["torch_attn"]).abs().max(-1).values / rng
                attn_diff = max(attn_diff, float(d.max()))
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    for name, v in ms.items():
        print(f"{name:10s} {v:7.2f} ms/step  {1e3 * a.batch / v:7.1f} tok/s  "
              f"(round medians {[round(1e3 * x, 1) for x in times[name]]})")
    out = {f"ms_{k}": v for k, v in ms.items()}
    out["ratio"] = ms["generic"] / ms["lean"]
    line = f"lean / generic tok/s: {out['ratio']:.2f}x; torch arms' logits equal: {equal}"
    if "kernels" in ms:
        out["ratio_kernels"] = ms["lean"] / ms["kernels"]
        out["kernels_max_diff_of_range"] = diff
        out["ratio_fused"] = ms["unfused"] / ms["kernels"]
        out["fused_logits_equal"] = fused_equal
        out["ratio_attend"] = ms["torch_attn"] / ms["kernels"]
        out["attend_max_diff_of_range"] = attn_diff
        line += (f"; kernels / lean: {out['ratio_kernels']:.2f}x, logits within "
                 f"{diff:.2e} of the range; kernels / unfused: {out['ratio_fused']:.2f}x, "
                 f"logits equal: {fused_equal}; kernels / torch_attn: "
                 f"{out['ratio_attend']:.2f}x, logits within {attn_diff:.2e} of the range")
    print(line)
    out.update(batch=a.batch, prompt=a.prompt, threads=torch.get_num_threads(),
               cpu_time=a.cpu_time, logits_equal=equal)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
