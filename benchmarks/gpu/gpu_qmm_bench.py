"""Kernel workbench for the Triton quantized matmuls (mlxr.ops.matmul.generic_qmm) on one CUDA GPU.

    python benchmarks/gpu/gpu_qmm_bench.py [--quick] [--only SUBSTR] [--budget-s 270]

Random MLX-format weights at real shapes (Llama-3.1-8B, Qwen3-0.6B; 4-bit g64 everywhere, and
2/3/6/8-bit, mxfp4, nvfp4(+global scale), mxfp8 at the 8B gate_up shape). For every case:
a correctness check against the torch twin (fp32 dequant + fp32 matmul), then timing.

Timing: one CUDA graph holding R launches on R *different* copies of the weights (R chosen so
the working set is >= 3x the 50 MB L2), replayed; the figure is the median replay time / R. So
the weights stream from HBM as in a real decode step, and launch cost is graph-launch cost.
Reported: us per call, GB/s = (packed words + scales + biases bytes) / time, TFLOP/s = 2MNK /
time, and torch bf16 `x @ W.T` on the same shape (GB/s of its bf16 weight bytes).

Paths: GEMV (FMA kernel) for M = 1, 4, 16; GEMM (tensor-core kernel) for M = 4, 16, 512. The
dispatcher `qmatmul` uses GEMV up to MLXR_QMM_GEMV_MAX_M (default 4): the M = 4/16 rows show
where the crossover really is. Formats other than affine 4-bit g64 autotune a reduced config
set (MLXR_QMM_TUNE=quick) to stay inside the time budget. The last line is a JSON list.
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

from mlxr.ops.matmul import generic_qmm as T


LLAMA8B = [("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 28672, 4096),
           ("8B down", 4096, 14336), ("8B lm_head", 128256, 4096)]
QWEN06 = [("0.6B qkv", 4096, 1024), ("0.6B o", 1024, 2048), ("0.6B gate_up", 6144, 1024),
          ("0.6B down", 1024, 3072), ("0.6B lm_head", 151936, 1024)]
# (mode, bits, group, global_scale)
MAIN_FMT = ("affine", 4, 64, False)
EXTRA_FMTS = [("affine", 2, 64, False), ("affine", 3, 64, False), ("affine", 6, 64, False),
              ("affine", 8, 64, False), ("mxfp4", 4, 32, False), ("nvfp4", 4, 16, True),
              ("mxfp8", 8, 32, False)]


def fmt_name(f) -> str:
    mode, bits, group, gs = f
    return f"{mode}{bits}g{group}" if mode == "affine" else mode + ("+gs" if gs else "")


def make_weight(n: int, k: int, f, dev, gen):
    mode, bits, group, gs = f
    words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), device=dev, dtype=torch.int32,
                          generator=gen)
    if mode == "mxfp8":  # no 0x7F/0xFF bytes (NaN in mlx, never written by its quantizer)
        words &= ~0x01010101
    ng = k // group
    if mode == "affine":
        s = (torch.randn(n, ng, device=dev, generator=gen) * 0.01).to(torch.bfloat16)
        b = (torch.randn(n, ng, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
        return words, s, b, None
    if mode == "nvfp4":
        s = torch.randint(0, 0x7F, (n, ng), device=dev, dtype=torch.uint8, generator=gen)
    else:
        s = torch.randint(120, 128, (n, ng), device=dev, dtype=torch.uint8, generator=gen)
    g = torch.tensor(3.0, device=dev) if gs else None
    return words, s, None, g


def weight_bytes(w, s, b) -> int:
    return sum(t.numel() * t.element_size() for t in (w, s, b) if t is not None)


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| (fp32)."""
    d = (y.float() - ref.float()).abs().max()
    return (d / ref.float().abs().max().clamp_min(1e-30)).item()


def bench_case(label, n, k, f, ms, dev, gen, results, with_torch: bool) -> None:
    mode, bits, group, _ = f
    w, s, b, gs = make_weight(n, k, f, dev, gen)
    nb = weight_bytes(w, s, b)
    r = copies_for(nb)
    ws = [(w, s, b, gs)] + [tuple(t.clone() if t is not None else None for t in (w, s, b, gs))
                            for _ in range(r - 1)]
    wref = T.dequant_f32(w, s, b, gs, mode, bits, group)  # fp32 [n, k]
    wbfs = []
    if with_torch:
        wbf = wref.to(torch.bfloat16)
        wbfs = [wbf] + [wbf.clone() for _ in range(copies_for(wbf.numel() * 2) - 1)]
    kw = {"mode": mode, "bits": bits, "group": group}
    for m in ms:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.float() @ wref.t()
        t_bf16 = graph_time_us([lambda wb=wb, x=x: x @ wb.t() for wb in wbfs]) if wbfs else None
        for path in ("gemv", "gemm"):
            if (path == "gemv" and m > 16) or (path == "gemm" and m < 4):
                continue
            fn = T.qgemv if path == "gemv" else T.qgemm
            y = fn(x, w, s, b, gs, out_dtype=torch.float32, **kw)
            err = rel_err(y, ref)
            ok = err < (1e-4 if path == "gemv" else 2e-2)
            t_us = graph_time_us([lambda c=c, fn=fn, x=x: fn(x, *c, **kw) for c in ws])
            gbs = nb / t_us / 1e3
            tfs = 2 * m * n * k / t_us / 1e6
            row = {"shape": label, "n": n, "k": k, "fmt": fmt_name(f), "m": m, "path": path,
                   "us": round(t_us, 2), "gbs": round(gbs, 1), "tflops": round(tfs, 2),
                   "err": float(f"{err:.3g}"), "ok": ok, "copies": r,
                   "torch_bf16_us": round(t_bf16, 2) if t_bf16 else None,
                   "torch_bf16_gbs": round(n * k * 2 / t_bf16 / 1e3, 1) if t_bf16 else None}
            results.append(row)
            tb = (f" | torch bf16 {t_bf16:8.2f} us {row['torch_bf16_gbs']:7.1f} GB/s "
                  f"{2 * m * n * k / t_bf16 / 1e6:6.1f} TFLOP/s" if t_bf16 else "")
            print(f"{label:13s} {n:6d}x{k:<5d} {fmt_name(f):11s} M={m:<3d} {path:4s} "
                  f"{t_us:8.2f} us {gbs:7.1f} GB/s {tfs:7.2f} TFLOP/s err {err:.1e}"
                  f"{'' if ok else ' FAIL'}{tb}", flush=True)
    del ws, wbfs, wref
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="reduced autotune set everywhere")
    ap.add_argument("--only", default="", help="run only cases whose shape label contains this")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip cases after this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_qmm_bench: needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {T.triton.__version__}  gemv_max_m={T.gemv_max_m()}", flush=True)
    t0 = time.time()
    results: list[dict] = []
    plan = [(label, n, k, MAIN_FMT, True, args.quick) for label, n, k in LLAMA8B + QWEN06]
    plan += [("8B gate_up", 28672, 4096, f, False, True) for f in EXTRA_FMTS]
    for label, n, k, f, with_torch, quick in plan:
        if args.only and args.only not in label:
            continue
        if time.time() - t0 > args.budget_s:
            print(f"# budget {args.budget_s:.0f}s spent: skipping {label} {fmt_name(f)}")
            results.append({"shape": label, "fmt": fmt_name(f), "skipped": True})
            continue
        os.environ["MLXR_QMM_TUNE"] = "quick" if quick else "full"
        bench_case(label, n, k, f, (1, 4, 16, 512), dev, gen, results, with_torch)
        print(f"#   elapsed {time.time() - t0:.0f}s", flush=True)
    bad = [r for r in results if r.get("ok") is False]
    print(f"# {len(results)} rows, {len(bad)} correctness failures, {time.time() - t0:.0f}s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
