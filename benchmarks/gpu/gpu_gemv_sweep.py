"""Decode GEMV sweep on one CUDA GPU: mlxr.ops.matmul.decode_gemv launch variants vs tinygemm and
the old generic_qmm kernel, at real shapes. One call, < 4 minutes on an H200:

    PYTHONPATH=. python benchmarks/gpu/gpu_gemv_sweep.py [--budget-s 200] [--only SUBSTR]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/gpu/gpu_gemv_sweep.py --smoke   # CPU check

Shapes: Llama-3.1-8B (6144x4096, 4096x4096, 28672x4096, 4096x14336, 128256x4096) and Qwen3-0.6B
(4096x1024, 6144x1024, 1024x2048, 151936x1024); affine 4-bit g64 first, then 2/3/6/8-bit g64;
M = 1, 4, 16 (M = 1 of every width before any M = 4/16 case, so the budget cuts the least
important rows). Weights are random MLX words with bf16 scales/biases.

Per case: every variant's fp32 output is checked once against the fp32 reference
(max |y - ref| / max |ref| < 1e-4; a failure is printed, the variant still timed), then timed
in a CUDA graph of R launches over R copies of the weights (working set >= 3x L2, so bytes
come from HBM), median replay / R (benchmarks/gpu/gpu_timing.py). GB/s counts packed words +
scales + biases. A variant that fails to compile or run is reported and skipped.

Variants: `default` (decode_gemv.default_config), then GemvConfig templates (rows per
program, words per row tile, warps, Triton pipelining stages, register prefetch on/off), each
with split-K filled by decode_gemv.fill_split; `nosplit` isolates the split-K gain. Baselines:
`tinygemm` (4-bit only, torch._weight_int4pack_mm on its repacked copy) and `qmm` (the
generic_qmm path serving today: its GEMV for M <= 4, its tensor-core GEMM above).
The last line is JSON: the best variant per (shape, bits, M) with the baselines' times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mlxr.ops.matmul import decode_gemv as G
from mlxr.ops.matmul import generic_qmm as T

SHAPES = [("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 28672, 4096),
          ("8B down", 4096, 14336), ("8B lm_head", 128256, 4096), ("0.6B qkv", 4096, 1024),
          ("0.6B gate_up", 6144, 1024), ("0.6B o", 1024, 2048), ("0.6B lm_head", 151936, 1024)]
BITS = (4, 2, 3, 6, 8)
GROUP = 64
# (name, block_n, words per row tile, num_warps, num_stages, prefetch)
TEMPLATES = [("nopf", 16, 256, 4, 1, 0), ("stages3", 16, 256, 4, 3, 0),
             ("bn32", 32, 256, 4, 1, 1), ("bn8w2", 8, 256, 2, 1, 1),
             ("tile512", 16, 512, 4, 1, 1), ("tile128w2", 16, 128, 2, 1, 1),
             ("bn32w8t512", 32, 512, 8, 1, 1), ("bn64w8", 64, 256, 8, 1, 1)]
MAIN_ONLY = 4  # templates beyond the first few run only for 4-bit at M = 1
L2_BYTES = 50 << 20


def variants(m: int, n: int, k: int, bits: int, sms: int, full: bool):
    d = G.default_config(m, n, k, bits, GROUP, sms)
    out = [("default", d)]
    if d.split_k > 1:
        out.append(("nosplit", replace(d, split_k=1)))
    temps = TEMPLATES if full else TEMPLATES[:MAIN_ONLY] if m == 1 else TEMPLATES[:1]
    for name, bn, words, warps, stages, pf in temps:
        bn = max(2, bn // max(1, m // 2)) if m > 1 else bn  # keep accumulators in registers
        cfg = G.GemvConfig(block_n=bn, num_warps=warps, num_stages=stages, prefetch=pf)
        out.append((name, G.fill_split(cfg, n, k, bits, GROUP, words, sms)))
    return out


def make_weight(n, k, bits, dev, gen):
    w = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), device=dev, dtype=torch.int32,
                      generator=gen)
    s = (torch.randn(n, k // GROUP, device=dev, generator=gen) * 0.01).to(torch.bfloat16)
    b = (torch.randn(n, k // GROUP, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    return w, s, b


def rel_err(y, ref) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_case(label, n, k, bits, m, dev, gen, smoke, rows, best):
    from mlxr.quant import cuda_copies as qcopies

    w, s, b = make_weight(n, k, bits, dev, gen)
    nbytes = sum(t.numel() * t.element_size() for t in (w, s, b))
    reps = 1 if smoke else max(1, min(64, math.ceil(3 * L2_BYTES / nbytes)))
    copies = [(w, s, b)] + [(w.clone(), s.clone(), b.clone()) for _ in range(reps - 1)]
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    ref = x.float() @ T.dequant_f32(w, s, b, None, "affine", bits, GROUP).t()
    kw = {"mode": "affine", "bits": bits, "group": GROUP}
    sms = 132 if smoke else torch.cuda.get_device_properties(dev).multi_processor_count

    cands = [(name, (lambda x, c, cfg=cfg, **o: G.qgemv(x, *c, None, config=cfg, **kw, **o)))
             for name, cfg in variants(m, n, k, bits, sms, bits == 4 and m == 1 and not smoke)]
    labels = {name: cfg.label() for name, cfg in variants(m, n, k, bits, sms, True)}
    qmm = T.qgemv if m <= T.gemv_max_m() else T.qgemm
    cands.append(("qmm", lambda x, c, **o: qmm(x, *c, None, **kw, **o)))
    if bits == 4 and not smoke and hasattr(torch, "_weight_int4pack_mm"):
        packs = {id(c[0]): qcopies.tinygemm_pack(*c) for c in copies}  # (int4pack, s+z)
        cands.append(("tinygemm", lambda x, c, **o: torch._weight_int4pack_mm(
            x, packs[id(c[0])][0], GROUP, packs[id(c[0])][1])))
    case = {}
    for name, fn in cands:
        try:
            err = rel_err(fn(x, copies[0], out_dtype=torch.float32), ref)
            ok = err < (1e-4 if name != "tinygemm" and (name != "qmm" or m <= 4) else 2e-2)
            us = None
            if not smoke:
                from gpu_timing import graph_time_us
                us = graph_time_us([lambda c=c, fn=fn: fn(x, c) for c in copies])
        except Exception as e:  # noqa: BLE001 - fail soft: report and go on
            print(f"{label:13s} {bits}b M={m:<2d} {name:10s} FAILED {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            rows.append({"shape": label, "bits": bits, "m": m, "variant": name, "error": True})
            continue
        gbs = nbytes / us / 1e3 if us else None
        row = {"shape": label, "n": n, "k": k, "bits": bits, "m": m, "variant": name,
               "config": labels.get(name, name), "us": us and round(us, 2),
               "gbs": gbs and round(gbs, 1), "err": float(f"{err:.2g}"), "ok": ok}
        rows.append(row)
        case[name] = row
        t = f"{us:8.2f} us {gbs:7.1f} GB/s" if us else "   (not timed)"
        print(f"{label:13s} {bits}b M={m:<2d} {name:10s} {row['config']:26s} {t} "
              f"err {err:.1e}{'' if ok else ' WRONG'}", flush=True)
    ours = [r for nm, r in case.items() if nm not in ("qmm", "tinygemm") and r["ok"] and r["us"]]
    if ours:
        top = min(ours, key=lambda r: r["us"])
        best.append({"shape": label, "n": n, "k": k, "bits": bits, "m": m,
                     "best": top["config"], "variant": top["variant"], "us": top["us"],
                     "gbs": top["gbs"], "default_us": case.get("default", {}).get("us"),
                     "qmm_us": case.get("qmm", {}).get("us"),
                     "tinygemm_us": case.get("tinygemm", {}).get("us")})
    del copies
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, correctness only (CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--only", default="", help="only shapes whose label contains this")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip cases after this")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("gpu_gemv_sweep: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    dev = torch.device("cpu" if smoke else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    os.environ["MLXR_QMM_TUNE"] = "quick"  # the old kernel's autotune: its reduced set
    plan = [(lb, n, k, bits, m) for m in (1, 4, 16) for bits in BITS
            for lb, n, k in SHAPES if (m == 1 or bits == 4 or lb.startswith("8B"))]
    if smoke:  # split-K, straddling codes, the old kernel's GEMV and GEMM paths
        plan = [("tiny-k", 32, 512, 4, 1), ("tiny", 48, 256, 3, 16)]
    name = "interpreter" if smoke else torch.cuda.get_device_name()
    print(f"# {name}  torch {torch.__version__}  triton {T.triton.__version__}", flush=True)
    t0 = time.time()
    rows: list[dict] = []
    best: list[dict] = []
    for lb, n, k, bits, m in plan:
        if args.only and args.only not in lb:
            continue
        if time.time() - t0 > args.budget_s:
            print(f"# budget spent: skipping {lb} {bits}b M={m}")
            rows.append({"shape": lb, "bits": bits, "m": m, "skipped": True})
            continue
        run_case(lb, n, k, bits, m, dev, gen, smoke, rows, best)
    bad = [r for r in rows if r.get("ok") is False or r.get("error")]
    print(f"# {len(rows)} rows, {len(bad)} wrong or failed, {time.time() - t0:.0f}s")
    print(json.dumps(best))
    if smoke and bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
