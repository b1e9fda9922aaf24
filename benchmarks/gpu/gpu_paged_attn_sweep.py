"""Paged decode attention (mlxr.ops.kv_attention.paged.paged_attention) launch sweep on one CUDA
GPU: keys per tile x warps x splits, at the serving engine's shapes, against the KV-read bound.

    PYTHONPATH=. python benchmarks/gpu/gpu_paged_attn_sweep.py [--budget-s 120]

Shapes: Qwen3-0.6B (16 q heads, 8 kv heads, D 128) and Llama-3.1-8B (32 / 8 / 128), bf16, block
size 16, shuffled block tables; batch x context in (256 x 96, 64 x 512, 8 x 2048, 1 x 8192).
Each variant is checked against the default launch (max |diff| <= 2^-7 max|v| + 2^-7 |out|, the
bf16 tolerance of tests/test_triton_paged.py) and timed as the median of CUDA-graph replays
(benchmarks/gpu/gpu_timing.py). GB/s = K and V bytes of the visible context / time; at 256 x 96 the
0.6B layer reads ~102 MB (the engine's decode step at 256: 28 layers, 1.33 ms measured in
gpu_profile_paged.py, i.e. ~2.1 TB/s). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gpu_timing import graph_time_us

from mlxr.ops.kv_attention import paged as P

SHAPES = {"0.6B": (16, 8, 128), "8B": (32, 8, 128)}
LOADS = [(256, 96), (64, 512), (8, 2048), (1, 8192)]
VARIANTS = [(bs, w, sp) for bs in (32, 64, 128) for w in (2, 4, 8) for sp in (None, 1)]


def case(h, kh, d, batch, ctx, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = -(-ctx // bs)
    nblocks = batch * need + 1
    perm = torch.randperm(nblocks, generator=g)[:batch * need].view(batch, need)
    k = torch.randn(kh, nblocks * bs, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(kh, nblocks * bs, d, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(batch, h, d, generator=g).to("cuda", torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, k, v, perm.to("cuda", torch.int32), lens


def sweep_load(name, h, kh, d, batch, ctx, deadline, rows) -> None:
    """Every variant at one (shape, batch, context): checked, timed, best printed."""
    q, k, v, tables, lens = case(h, kh, d, batch, ctx)
    scale = d ** -0.5

    def run(bs, w, sp):
        return P.paged_attention(q, k, v, tables, lens, 16, scale, splits=sp, block_s=bs,
                                 num_warps=w)

    base = run(None, 4, None).float()
    gb = 2 * batch * ctx * kh * d * 2 / 1e9
    best = None
    for bs, w, sp in [(None, 4, None), *VARIANTS]:
        if time.perf_counter() > deadline:
            break
        label = f"s{bs or 'auto'}_w{w}_k{sp or 'auto'}"
        try:
            err = (run(bs, w, sp).float() - base).abs().max().item()
            ok = err <= 2 ** -7 * (1 + base.abs().max().item())
            us = graph_time_us([lambda bs=bs, w=w, sp=sp: run(bs, w, sp)])
        except Exception as e:  # noqa: BLE001 - fail soft: report and go on
            print(f"{name} B={batch} ctx={ctx} {label}: FAILED {type(e).__name__}: {e}")
            continue
        row = {"shape": name, "batch": batch, "ctx": ctx, "variant": label, "us": round(us, 2),
               "gb_s": round(gb / us * 1e6, 1), "ok": ok}
        rows.append(row)
        print(f"{name} B={batch:3d} ctx={ctx:5d} {label:16s} {us:9.2f} us {row['gb_s']:8.1f} GB/s"
              f" {'' if ok else 'WRONG'}", flush=True)
        if ok and (best is None or us < best["us"]):
            best = row
    if best:
        print(f"== {name} B={batch} ctx={ctx}: best {best['variant']} {best['us']} us "
              f"({best['gb_s']} GB/s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=120.0)
    a = ap.parse_args()
    deadline, rows = time.perf_counter() + a.budget_s, []
    for name, (h, kh, d) in SHAPES.items():
        for batch, ctx in LOADS:
            sweep_load(name, h, kh, d, batch, ctx, deadline, rows)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
