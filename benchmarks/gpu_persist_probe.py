"""Is a grid barrier cheaper than a kernel launch on this GPU? The question behind a persistent
decode-layer kernel (mlxr.ops.triton_persist; docs/perf.md, "Where v7 stands").

    PYTHONPATH=. python benchmarks/gpu_persist_probe.py [--json OUT.json]

1. Barrier cost: launches of `sync_probe` crossing 1 or 65 barriers, in a CUDA graph; every
   barrier is checked (each program's share arrived before any program left it).
2. A layer's four 4-bit GEMVs (Qwen3-0.6B and Llama-8B shapes, one distinct weight set per
   layer, 28 / 32 layers, so the weights stream from DRAM as in decode): 4 q4gemv launches per
   layer with the default launches (today's path) and with the chain's launch shapes, against
   one `chain4` launch per layer (3 barriers inside) for 1-8 one-warp or 1-4 two-warp
   programs per SM (128 registers each: all resident; a barrier would never open otherwise).
   The chain's outputs must equal the 4 launches' bit for bit (same body, same shapes).
Prints one JSON line per measurement; us per layer (or per barrier).
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_timing import graph_time_us

from mlxr.ops import triton_persist as P
from mlxr.ops import triton_q4gemv as Q

GROUP = 64
LAYERS = {"0.6B": (28, [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]),
          "8B": (32, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])}


def barrier_cost(per_sm: int) -> dict:
    cnt = P.new_counter("cuda")
    g = P.programs(torch.device("cuda"), per_sm)
    out = {}
    for nb in (1, 65):
        outs = [P.sync_probe(cnt, nb, grid=g) for _ in range(20)]
        ok = all(int(o[-1]) == 0 and o[:-1].tolist() == [g * (g + 1) // 2] * nb for o in outs)
        out[nb] = (graph_time_us([lambda nb=nb: P.sync_probe(cnt, nb, grid=g)
                                  for _ in range(20)]), ok)
    return {"probe": "barrier", "programs": g, "launch_1_barrier_us": round(out[1][0], 2),
            "per_barrier_us": round((out[65][0] - out[1][0]) / 64, 3),
            "checked": out[1][1] and out[65][1]}


def layer_weights(shapes):
    ws = []
    for n, k in shapes:
        w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        s = (torch.rand(n, k // GROUP, device="cuda") * 0.01).to(torch.bfloat16)
        b = (-7.5 * s.float() + torch.randn(n, k // GROUP, device="cuda") * 0.002).to(
            torch.bfloat16)
        ws.append((Q.repack(w), Q.pair_scales(s, b), s, b, n))
    return ws


def launches(x, ws, configs):
    """The four q4gemv launches of one layer (configs None: the default launches)."""
    ys, xi = [], x
    for i, (w, sb, s, b, _) in enumerate(ws):
        xi = Q.q4gemv(xi[:w.shape[1] * 8], w, s, b, group=GROUP, sb=sb,
                      config=None if configs is None else configs[i])
        ys.append(xi)
    return ys


def chain_configs(shapes, wt):
    return [Q.Q4Config(Q.default_config(n, k).block_n, wt, cg=True) for n, k in shapes]


def layers(model: str) -> list[dict]:
    n_layers, shapes = LAYERS[model]
    per_layer = [layer_weights(shapes) for _ in range(n_layers)]
    x = torch.randn(shapes[0][1], device="cuda").to(torch.bfloat16)
    rows = []
    base = graph_time_us([lambda ws=ws: launches(x, ws, None) for ws in per_layer], reps=10)
    rows.append({"probe": "layer", "model": model, "form": "4 launches, default shapes",
                 "us_per_layer": round(base, 2)})
    for wt in (128, 256):
        if any((k // 8) % wt for _, k in shapes):
            continue
        cfgs = chain_configs(shapes, wt)
        us = graph_time_us([lambda ws=ws: launches(x, ws, cfgs) for ws in per_layer], reps=10)
        rows.append({"probe": "layer", "model": model, "form": f"4 launches, wt {wt}",
                     "us_per_layer": round(us, 2)})
        for per_sm in (1, 2, 4, 8) if wt == 128 else (1, 2, 4):  # all resident: <= 32K regs
            g = P.programs(torch.device("cuda"), per_sm)
            cnt = P.new_counter("cuda")
            chain = [(w, sb, b, n) for w, sb, _, b, n in per_layer[0]]
            same = all(torch.equal(a, b) for a, b in zip(
                P.chain4(x, chain, group=GROUP, counter=cnt, grid=g, configs=cfgs),
                launches(x, per_layer[0], cfgs)))
            try:
                us = graph_time_us([lambda ws=ws: P.chain4(
                    x, [(w, sb, b, n) for w, sb, _, b, n in ws], group=GROUP, counter=cnt,
                    grid=g, configs=cfgs) for ws in per_layer], reps=10)
            except RuntimeError as e:  # e.g. too many registers for this many programs
                us = float("nan")
                print(json.dumps({"error": str(e)[:200]}))
            rows.append({"probe": "layer", "model": model, "form": f"chain4, wt {wt}",
                         "programs": g, "us_per_layer": round(us, 2), "bit_identical": same})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    out = []
    for per_sm in (1, 2, 4):
        out.append(barrier_cost(per_sm))
        print(json.dumps(out[-1]), flush=True)
    for model in LAYERS:
        out += layers(model)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
