"""CPU prefill, A/B in one process: the affine projections' tiles from mlxr's compiled dequant
(`native.i4deq`, and from `I4_MAX_M_DEQ` rows on) against torch's path (env `MLXR_CPU_DEQ=0`,
read per call: torch's int4 kernel below `I4_MAX_M` rows, torch-built tiles above); with
`--env MLXR_CPU_PREFILL_ATTEND` the whole prompt's attention in bf16 (torch's flash kernel,
`mlxr.ops.cpu.prefill_attend`) against the reference's float32 SDPA (arm "off" = the env "0",
"on" = "1").

    PYTHONPATH=. python benchmarks/cpu/cpu_prefill_ab.py MODEL_DIR [--prompt 512 64]
        [--rounds 4] [--threads 1] [--cpu-time] [--env MLXR_CPU_DEQ]

Each round prefills the same random prompt (a fresh KV cache, one `forward_step` of all its
tokens, logits of the last) once per arm, the order flipped every round; prints each arm's
median over the rounds, tok/s, the ratio, and whether the two arms' logits were equal (they
must be at prompts >= `I4_MAX_M`, where both run the tiles with the same bf16 weights; below,
the arms run different kernels and the largest difference relative to the logit range is
printed). The last line is JSON.
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


def prefill(dec, prompt: torch.Tensor) -> torch.Tensor:
    cache = new_cache(dec, len(prompt) + 8)
    step = Step([SeqSpan(0, len(prompt), slot_range=(0, len(prompt)))],
                torch.arange(len(prompt)), torch.tensor([len(prompt) - 1]))
    return dec.forward_step(prompt, step, cache.pool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, nargs="*", default=[512])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--env", default="MLXR_CPU_DEQ", help="the switch alternated (0 / 1)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dec = mlxr.load(a.model, device="cpu").decoder
    clock = time.process_time if a.cpu_time else time.perf_counter
    g = torch.Generator().manual_seed(0)
    arms = {"torch": "0", "i4deq": "1"} if a.env == "MLXR_CPU_DEQ" else {"off": "0", "on": "1"}
    off, on = arms
    out = {"threads": torch.get_num_threads(), "cpu_time": a.cpu_time}
    with torch.inference_mode():
        for p in a.prompt:
            prompt = torch.randint(0, dec.config.vocab_size, (p,), generator=g)
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            got = {}
            for r in range(a.rounds + 1):  # round 0 warms up, not counted
                for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    os.environ[a.env] = arms[arm]
                    t0 = clock()
                    got[arm] = prefill(dec, prompt)
                    if r:
                        times[arm].append(clock() - t0)
            ms = {arm: 1e3 * statistics.median(v) for arm, v in times.items()}
            ref = got[off].float()
            rng = float(ref.max() - ref.min())
            diff = float((got[on].float() - ref).abs().max()) / rng
            for arm, v in ms.items():
                print(f"prompt {p:5d} {arm:6s} {v:9.1f} ms  {1e3 * p / v:7.1f} tok/s  "
                      f"(rounds {[round(1e3 * x) for x in times[arm]]})")
            print(f"prompt {p:5d} {on} / {off}: {ms[off] / ms[on]:.2f}x; logits "
                  f"equal: {torch.equal(got[off], got[on])} (max diff {diff:.2e} of "
                  f"the range); same argmax: "
                  f"{torch.equal(got[off].argmax(-1), got[on].argmax(-1))}", flush=True)
            out[f"p{p}"] = {"ms": ms, "ratio": ms[off] / ms[on], "diff": diff, "env": a.env}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
