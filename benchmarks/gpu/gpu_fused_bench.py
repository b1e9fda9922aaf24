"""Workbench for the fused Triton ops (mlxr.ops.layer.norm_rope_act) vs the torch reference, one
GPU.

    python benchmarks/gpu/gpu_fused_bench.py [--only SUBSTR]

Decode shapes (T = 1) of Qwen3-0.6B (E 1024, H 16, K 8, D 128, F 3072) and Llama-3.1-8B
(E 4096, H 32, K 8, D 128, F 14336): rms_norm of the residual row and of per-head q/k (strided
views of the fused qkv output, as the model calls it), rope on q and k, gated_act on the halves
of the gate_up output, attention_masked over a KV capacity S = 1024 / 8192 (and 32768 for
0.6B) with every key visible (pos = S - 1: the worst case) and with pos = S / 8 (the kernel
skips tiles with no visible key; the reference always reads all S).

Correctness: each fused op vs the reference on the same inputs (attention: vs the reference on
fp32-upcast inputs, the exact answer; the bf16 reference rounds scores to bf16). Reported:
max |y - ref| / max |ref| and, for the elementwise ops, the fraction of bit-identical outputs.

Timing: a CUDA graph holding R calls (attention: over R distinct KV copies so that the cache
streams from HBM, >= 3x the 50 MB L2, as each layer's cache does in a real step), replayed;
median replay time / R, in us per call: the figure that matters for a launch-bound CUDA-graph
decode step. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from gpu_timing import L2_BYTES, graph_time_us

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mlxr.ops import reference as R
from mlxr.ops.kv_attention import masked as A
from mlxr.ops.layer import norm_rope_act as F

MODELS = {  # name: E, H, K, D, F
    "qwen3-0.6b": (1024, 16, 8, 128, 3072),
    "llama-8b": (4096, 32, 8, 128, 14336),
}
SEQS = {"qwen3-0.6b": (1024, 8192, 32768), "llama-8b": (1024, 8192)}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    d = (y.float() - ref.float()).abs().max()
    return (d / ref.float().abs().max().clamp_min(1e-30)).item()


def case(results, label, fused, ref, exact_ref=None, n_calls=64, elementwise=True):
    """fused / ref: lists of zero-arg callables (one per copy); the first is checked."""
    y, r = fused[0](), (exact_ref or ref[0])()
    row = {"case": label, "rel_err": rel_err(y, r)}
    if elementwise:
        row["bit_exact"] = (y == ref[0]()).float().mean().item()
    reps = max(1, n_calls // len(fused))
    row["fused_us"] = graph_time_us(fused * reps)
    row["torch_us"] = graph_time_us(ref * reps)
    row["speedup"] = row["torch_us"] / row["fused_us"]
    results.append(row)
    extra = f" bit-exact {row['bit_exact']:.4f}" if elementwise else ""
    print(f"{label:42s} fused {row['fused_us']:8.2f} us  torch {row['torch_us']:8.2f} us  "
          f"x{row['speedup']:5.2f}  rel err {row['rel_err']:.2e}{extra}", flush=True)


def bench_model(name, dev, gen, results, only):
    e, h, kh, d, f = MODELS[name]
    dt = torch.bfloat16
    eps = 1e-6

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    def want(label):
        return only is None or only in label

    x, w = rnd(1, e, scale=3), rnd(e, scale=0.3)
    qkv = rnd(1, (h + 2 * kh) * d, scale=2)
    q = qkv[:, :h * d].view(1, h, d)
    k = qkv[:, h * d:(h + kh) * d].view(1, kh, d)
    wq = rnd(d, scale=0.3)
    lab = f"{name} rms_norm [1,{e}]"
    if want(lab):
        case(results, lab, [lambda: F.rms_norm(x, w, eps)], [lambda: R.rms_norm(x, w, eps)])
    lab = f"{name} rms_norm +1 [1,{e}]"
    if want(lab):
        case(results, lab, [lambda: F.rms_norm(x, w, eps, 1.0)],
             [lambda: R.rms_norm(x, w, eps, 1.0)])
    lab = f"{name} rms_norm q heads [1,{h},{d}] strided"
    if want(lab):
        case(results, lab, [lambda: F.rms_norm(q, wq, eps)], [lambda: R.rms_norm(q, wq, eps)])
    lab = f"{name} rms_norm k heads [1,{kh},{d}] strided"
    if want(lab):
        case(results, lab, [lambda: F.rms_norm(k, wq, eps)], [lambda: R.rms_norm(k, wq, eps)])

    ang = torch.rand(1, d // 2, device=dev, generator=gen) * 1000
    cos, sin = ang.cos(), ang.sin()
    qc = q.contiguous()
    for trad in (False, True):
        lab = f"{name} rope q [1,{h},{d}] {'trad' if trad else 'half'}"
        if want(lab):
            case(results, lab, [lambda t=trad: F.rope(qc, cos, sin, t)],
                 [lambda t=trad: R.rope(qc, cos, sin, t)])
    lab = f"{name} rope k [1,{kh},{d}] strided"
    if want(lab):
        case(results, lab, [lambda: F.rope(k, cos, sin, False)],
             [lambda: R.rope(k, cos, sin, False)])

    gu = rnd(1, 2 * f, scale=3)
    gate, up = gu[:, :f], gu[:, f:]
    for act in ("silu", "gelu", "gelu_tanh"):
        lab = f"{name} gated_act {act} [1,{f}]"
        if want(lab):
            case(results, lab, [lambda a=act: F.gated_act(gate, up, a)],
                 [lambda a=act: R.gated_act(gate, up, a)])

    qa = rnd(1, h, d)
    for s in SEQS[name]:  # previous caches are freed when ks / vs are rebound
        kv_bytes = 2 * kh * s * d * 2
        copies = max(1, min(16, math.ceil(3 * L2_BYTES / kv_bytes)))
        ks = [rnd(kh, s, d) for _ in range(copies)]
        vs = [rnd(kh, s, d) for _ in range(copies)]
        bench_attention(results, name, qa, ks, vs, want)


def bench_attention(results, name, q, ks, vs, want):
    """attention_masked at decode over len(ks) distinct KV caches [K, S, D]."""
    _, s, d = ks[0].shape
    copies = len(ks)
    scale = d ** -0.5
    keys = torch.arange(s, device=q.device)

    def exact(vis, cap=None):
        return lambda: R.attention_masked(q.float(), ks[0].float(), vs[0].float(), vis, scale,
                                          cap)

    for pos in sorted({s - 1, s // 8}):
        vis = keys <= pos
        lab = f"{name} attention S={s} pos={pos} (x{copies} kv)"
        if want(lab):
            fused = [lambda i=i, m=vis: A.attention_masked(q, ks[i], vs[i], m, scale)
                     for i in range(copies)]
            ref = [lambda i=i, m=vis: R.attention_masked(q, ks[i], vs[i], m, scale)
                   for i in range(copies)]
            case(results, lab, fused, ref, exact(vis), n_calls=max(copies, 16),
                 elementwise=False)
    lab = f"{name} attention softcap S={s}"
    if want(lab) and s == 1024:
        vis = keys <= s - 1
        case(results, lab, [lambda: A.attention_masked(q, ks[0], vs[0], vis, scale, 30.0)],
             [lambda: R.attention_masked(q, ks[0], vs[0], vis, scale, 30.0)], exact(vis, 30.0),
             n_calls=16, elementwise=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="run cases whose label contains this")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    t0 = time.time()
    results: list[dict] = []
    for name in MODELS:
        bench_model(name, dev, gen, results, args.only)
    bad = [r["case"] for r in results if not r["rel_err"] < 2e-2]
    print(f"{len(results)} cases in {time.time() - t0:.1f} s; accuracy failures: {bad}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
