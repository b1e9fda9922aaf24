"""The single request's decode attention (mlxr.ops.kv_attention.masked.attention_masked, what the
CUDA-graph decode step runs) launch sweep on one CUDA GPU: splits x keys per tile.

    PYTHONPATH=. python benchmarks/gpu/gpu_attn_decode_sweep.py [--budget-s 90] [--default-only]
        [--loads 8192x6000,16384x12000] [--shapes 8B]

(--default-only: the default launch at each load, for an A/B of the kernel against another
checkout's, e.g. PYTHONPATH=base:benchmarks.)

The decode graph attends over its whole capacity under a visibility mask; tiles past the
position are skipped without K/V traffic, but every (kv head, split) program is launched, and
more than one split adds the combine launch. At batch 1 the step is latency-bound (Qwen3-0.6B:
28 x (4.4 us split + 1.6 us combine) per token, docs/perf.md), so fewer splits may win at
short contexts. Shapes: Qwen3-0.6B (16 q heads, 8 kv heads, D 128) and Llama-3.1-8B (32 / 8 /
128), bf16; capacity x position in (1024 x 600, 2048 x 600, 4096 x 3000). Each variant is
checked against the default launch (bf16 tolerance of tests/test_triton_fused.py) and timed as
the median of CUDA-graph replays over 28 layers' caches (the decode reads them from HBM, not
the L2). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gpu_timing import graph_time_us

from mlxr.ops.kv_attention import masked as F

SHAPES = {"0.6B": (16, 8, 128), "8B": (32, 8, 128)}
LOADS = [(1024, 600), (2048, 600), (4096, 3000)]
VARIANTS = [(bs, sp) for bs in (32, 64, 128) for sp in (1, 2, 4, 8, 16, 32)]
LONG = [(bs, sp) for bs in (64, 128, 256) for sp in (16, 32, 64)]  # with --loads
LAYERS = 28


def sweep_load(name, h, kh, d, cap, pos, deadline, rows, variants=VARIANTS) -> None:
    g = torch.Generator().manual_seed(cap + pos)
    caches = [(torch.randn(kh, cap, d, generator=g).to("cuda", torch.bfloat16),
               torch.randn(kh, cap, d, generator=g).to("cuda", torch.bfloat16))
              for _ in range(LAYERS)]
    q = torch.randn(1, h, d, generator=g).to("cuda", torch.bfloat16)
    visible = (torch.arange(cap) <= pos).to("cuda")
    scale = d ** -0.5

    def run(i, bs, sp):
        k, v = caches[i]
        return F.attention_masked_split(q, k, v, visible, scale, None, block_s=bs, splits=sp)

    gb = 2 * (pos + 1) * kh * d * 2 / 1e9  # visible K and V of one layer
    best = None
    for bs, sp in [(None, None), *variants]:
        if time.perf_counter() > deadline:
            break
        label = f"s{bs or 'auto'}_k{sp or 'auto'}"
        try:
            base = run(0, None, None).float()
            err = (run(0, bs, sp).float() - base).abs().max().item()
            ok = err <= 2 ** -7 * (1 + base.abs().max().item())
            us = graph_time_us([lambda i=i, bs=bs, sp=sp: run(i, bs, sp)
                                for i in range(LAYERS)])
        except Exception as e:  # noqa: BLE001 - fail soft: report and go on
            print(f"{name} cap={cap} pos={pos} {label}: FAILED {type(e).__name__}: {e}")
            continue
        row = {"shape": name, "capacity": cap, "pos": pos, "variant": label,
               "us_per_layer": round(us, 2), "gb_s": round(gb / us * 1e6, 1), "ok": ok}
        rows.append(row)
        print(f"{name} cap={cap:5d} pos={pos:5d} {label:12s} {us:8.2f} us/layer "
              f"{row['gb_s']:8.1f} GB/s {'' if ok else 'WRONG'}", flush=True)
        if ok and (best is None or us < best["us_per_layer"]):
            best = row
    if best:
        print(f"== {name} cap={cap} pos={pos}: best {best['variant']} "
              f"{best['us_per_layer']} us/layer", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--default-only", action="store_true")
    ap.add_argument("--loads", help="CAPxPOS,... (then the long-context variants)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    loads = ([tuple(map(int, x.split("x"))) for x in a.loads.split(",")] if a.loads
             else LOADS)
    variants = [] if a.default_only else LONG if a.loads else VARIANTS
    deadline, rows = time.perf_counter() + a.budget_s, []
    for name in a.shapes.split(","):
        h, kh, d = SHAPES[name]
        for cap, pos in loads:
            sweep_load(name, h, kh, d, cap, pos, deadline, rows, variants)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
