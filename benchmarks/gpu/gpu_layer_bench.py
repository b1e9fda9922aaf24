"""Workbench for the fused layer glue (mlxr.ops.layer.add_norm_qkv_rope) vs the op sequence it
replaces.

    python benchmarks/gpu/gpu_layer_bench.py

Decode shapes of Qwen3-0.6B (E 1024, H 16, K 8, D 128, q/k norms, 28 layers) and Llama-3.1-8B
(E 4096, H 32, K 8, D 128, 32 layers) at N = 1, 16, 256 tokens, bf16, a KV cache of 4096 slots
written at N random distinct slots. Per layer, between the matmuls:

* qkv: the previous sequence (norm_rope_act rms_norm of q and of k where the model has q/k
  norms, rope of q and of k, index_copy_ of k and of v: 4-6 launches) vs `qkv_rope_write` (1).
* add_norm: `h + r` then norm_rope_act rms_norm (2 launches) vs `add_rms_norm` (1).
* layer: one qkv and two add_norm, i.e. everything a layer runs besides the matmuls and the
  attention and activation kernels (8-10 launches vs 3).

Correctness: old vs fused outputs (q, the written k and v, s and y): max |new - old| / max |old|
and the fraction of bit-identical elements (CUDA rounds to nearest in both: differences are
only fp32 contraction/summation order crossing a bf16 rounding boundary).

Timing: a CUDA graph holding 32 copies of the sequence, replayed (benchmarks/gpu/gpu_timing.py);
median us per sequence. Inputs stay in L2 (small): the figures are launch and latency costs,
what batch-1 decode pays. `saved_us_per_token` = (old - fused) layer glue x layers. The last
line is JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from gpu_timing import graph_time_us

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mlxr.ops.layer import add_norm_qkv_rope as L
from mlxr.ops.layer import norm_rope_act as F

MODELS = {  # name: E, H, K, D, q/k norms, layers
    "qwen3-0.6b": (1024, 16, 8, 128, True, 28),
    "llama-8b": (4096, 32, 8, 128, False, 32),
}
TOKENS = (1, 16, 256)
SLOTS = 4096
CALLS = 32
EPS = 1e-6


def compare(new: torch.Tensor, old: torch.Tensor) -> tuple[float, float]:
    """(max |new - old| / max |old|, fraction of bit-identical elements)."""
    d = (new.float() - old.float()).abs().max()
    return ((d / old.float().abs().max().clamp_min(1e-30)).item(),
            (new == old).float().mean().item())


def bench(name: str, n: int, dev, gen) -> tuple[list[dict], float]:
    e, h, kh, d, qk_norm, layers = MODELS[name]
    dt = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    qkv = rnd(n, (h + 2 * kh) * d, scale=2)
    qn, kn = (rnd(d, scale=0.3), rnd(d, scale=0.3)) if qk_norm else (None, None)
    ang = torch.rand(n, d // 2, device=dev, generator=gen) * 1000
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(SLOTS, device=dev, generator=gen)[:n]
    caches = {k: (rnd(kh, SLOTS, d), rnd(kh, SLOTS, d)) for k in ("old", "new")}
    hid, res, w = rnd(n, e, scale=3), rnd(n, e), rnd(e, scale=0.3)

    def old_qkv():
        kc, vc = caches["old"]
        q, k, v = qkv.split([h * d, kh * d, kh * d], dim=-1)
        q, k, v = q.reshape(n, h, d), k.reshape(n, kh, d), v.reshape(n, kh, d)
        if qk_norm:
            q, k = F.rms_norm(q, qn, EPS), F.rms_norm(k, kn, EPS)
        q, k = F.rope(q, cos, sin, False), F.rope(k, cos, sin, False)
        kc.index_copy_(1, slots, k.transpose(0, 1))
        vc.index_copy_(1, slots, v.transpose(0, 1))
        return q

    def new_qkv():
        kc, vc = caches["new"]
        return L.qkv_rope_write(qkv, h, kh, d, qn, kn, EPS, 0.0, 1.0, cos, sin, False, kc, vc,
                                slots)

    def old_add_norm():
        s = hid + res
        return s, F.rms_norm(s, w, EPS)

    def new_add_norm():
        return L.add_rms_norm(hid, res, w, EPS)

    def old_layer():
        old_add_norm()
        old_qkv()
        old_add_norm()

    def new_layer():
        new_add_norm()
        new_qkv()
        new_add_norm()

    q_old, q_new = old_qkv(), new_qkv()
    (s_old, y_old), (s_new, y_new) = old_add_norm(), new_add_norm()
    checks = {
        "q": compare(q_new, q_old),
        "k": compare(caches["new"][0][:, slots], caches["old"][0][:, slots]),
        "v": compare(caches["new"][1][:, slots], caches["old"][1][:, slots]),
        "s": compare(s_new, s_old),
        "y": compare(y_new, y_old),
    }
    rows = []
    for case, old, new, keys in (("qkv", old_qkv, new_qkv, "qkv"),
                                 ("add_norm", old_add_norm, new_add_norm, "sy"),
                                 ("layer", old_layer, new_layer, "qkvsy")):
        row = {"model": name, "n": n, "case": case,
               "old_us": graph_time_us([old] * CALLS), "fused_us": graph_time_us([new] * CALLS),
               "rel_err": max(checks[k][0] for k in keys),
               "bit_exact": min(checks[k][1] for k in keys)}
        row["speedup"] = row["old_us"] / row["fused_us"]
        rows.append(row)
        print(f"{name:11s} N={n:<4d} {case:9s} old {row['old_us']:7.2f} us  fused "
              f"{row['fused_us']:7.2f} us  x{row['speedup']:5.2f}  rel err {row['rel_err']:.1e}"
              f"  bit-exact {row['bit_exact']:.4f}", flush=True)
    layer = rows[-1]
    return rows, (layer["old_us"] - layer["fused_us"]) * layers


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    t0 = time.time()
    results, saved = [], {}
    for name in MODELS:
        for n in TOKENS:
            rows, saved[f"{name} N={n}"] = bench(name, n, dev, gen)
            results += rows
    bad = [f"{r['model']} N={r['n']} {r['case']}" for r in results if not r["rel_err"] < 2e-2]
    print(f"{len(results)} cases in {time.time() - t0:.1f} s; accuracy failures: {bad}")
    print(json.dumps({"cases": results, "saved_us_per_token": saved}))


if __name__ == "__main__":
    main()
