"""Prefill GEMM sweep on one CUDA GPU: the fused tensor-core kernel of mlxr.ops.matmul.prefill_gemm
over launch configs, against dequant + cuBLAS (what serves prefill) and plain bf16 cuBLAS, at
real shapes. One call, < 4 minutes on an H200 (compiles included):

    PYTHONPATH=. python benchmarks/gpu/gpu_qgemm_sweep.py [--budget-s 200] [--only SUBSTR]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/gpu/gpu_qgemm_sweep.py --smoke   # CPU check
    PYTHONPATH=. python benchmarks/gpu/gpu_qgemm_sweep.py --dequant-bits 4,3,5,6  # dequantizer only

Shapes (out x in): Llama-3.1-8B qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
4096x14336; Qwen3-0.6B qkv 4096x1024, gate_up 6144x1024, down 1024x3072. M = 512, 2048, 128,
64 (in that order, so a spent budget cuts the least important rows); affine 4-bit g64, plus
8-bit g64 for the 8B gate_up. Random MLX words, bf16 scales/biases, bf16 x.

Per case:
* correctness: the dequantizer (prefill_dequant.dequant_affine) must equal mlxr.quant.dequantize
  (fp32, then rounded to bf16) bit for bit (`dq exact` in the summary line); every fused output
  (bf16) is compared with the fp32 product of x and the dequantized bf16 weight:
  err = max|y - ref| / max|ref| must stay under 2^-7 (one bf16 rounding of the output is up to
  2^-8; a wrong group or code gives O(1)); dequant + cuBLAS under 2^-6 (cuBLAS may reduce
  split-K partials in bf16). A failure is printed and the variant still timed.
* timing: a CUDA graph of R launches over R copies of the weights (working set >= 3x the L2, so
  the words stream from HBM as in a real prefill), median replay / R
  (benchmarks/gpu/gpu_timing.py). TFLOP/s = 2*M*N*K / time.
* variants: `default` (prefill_gemm.default_config), candidate configs (label
  BMxBNxBK_w<warps>_s<stages>[_wa: W @ x^T][_k<split>], split-K filled by fill_split for the
  grid), `dq+cublas` (prefill_dequant.dequant_affine + cuBLAS, what serves prefill today),
  `cublas_bf16` (x @ W^T on a pre-dequantized bf16 weight: the ceiling).
Each case's fused configs are compiled before it is timed, in parallel threads where Triton's
AsyncCompileMode exists (compile time counts against the budget, so it is printed). A config that
fails to compile or run is printed and skipped.
Per case one summary line (best fused config vs the baselines); the last line is JSON.

`--dequant-bits B,...` runs only the dequantizer (dequant_affine) at the 8B shapes for those
widths (3/5/6-bit: codes straddle words): bit-exact check as above, time per call and GB/s
(packed words, scales and biases read, bf16 written).
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

from mlxr.config import QuantSpec
from mlxr.ops.matmul import generic_qmm as T
from mlxr.ops.matmul import prefill_dequant as D
from mlxr.ops.matmul import prefill_gemm as Q
from mlxr.quant import dequantize

SHAPES = [("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 28672, 4096),
          ("8B down", 4096, 14336), ("0.6B qkv", 4096, 1024), ("0.6B gate_up", 6144, 1024),
          ("0.6B down", 1024, 3072)]
MS = (512, 2048, 128, 64)
GROUP = 64
L2_BYTES = 50 << 20
C = Q.QgemmConfig
# BM, BN, BK, group_m, warps, stages, w_as_a (, split, maxnreg). Large M: the dequantized tile
# as wgmma's shared-memory B operand (x @ W^T: the MMA waits for each tile, so overlap comes from
# a second program per SM) or as its register A operand (W @ x^T: the next tile's dequant runs
# under the MMA), 128/256-row tiles, 4 or 8 warps (256x64 W @ x^T: one warpgroup, each weight
# dequantized once per 256 rows, two programs per SM); small M: W as A (the x side of the MMA
# can be 64 wide), split-K to fill the SMs.
LARGE = [C(128, 128, 64, 8, 8, 3), C(128, 128, 64, 8, 8, 3, True, 1, 128),
         C(128, 128, 64, 8, 8, 3, True), C(128, 128, 64, 8, 4, 3), C(128, 128, 64, 8, 4, 3, True),
         C(256, 128, 64, 8, 8, 3), C(256, 128, 64, 8, 8, 3, True), C(128, 128, 128, 8, 8, 2),
         C(128, 128, 128, 8, 8, 2, False, 1, 128), C(256, 64, 64, 8, 4, 3, True)]
SMALL = [C(64, 128, 64, 8, 4, 4, True), C(64, 64, 128, 8, 4, 4, True), C(64, 128, 64, 8, 4, 4),
         C(128, 128, 64, 8, 8, 3, True, 1, 128), C(128, 64, 64, 8, 4, 4, True),
         C(128, 128, 64, 8, 8, 3), C(128, 128, 64, 8, 4, 3)]


def variants(m: int, n: int, k: int, bits: int, sms: int, smoke: bool):
    """(name, config) to run for this case: default, its no-split twin, the candidates (each
    with split-K filled for this grid; BM above the rows left out)."""
    if smoke:  # small tiles: the interpreter is slow
        return [("default", Q.default_config(m, n, k, bits, GROUP, sms)),
                ("xw", C(16, 32, 64, 8, 4, 1)), ("wa_split", C(32, 32, 128, 8, 4, 1, True, 2))]
    d = Q.default_config(m, n, k, bits, GROUP, sms)
    out = [("default", d)]
    if d.split_k > 1:
        out.append(("nosplit", replace(d, split_k=1)))
    cands = SMALL if m <= 128 else LARGE
    if bits != 4:  # the extra width: the first few only
        cands = cands[:4]
    seen = {d, replace(d, split_k=1)}
    for c in cands:
        if c.block_m > max(64, 2 * m):
            continue
        c = Q.fill_split(c, m, n, k, GROUP, sms)
        if c not in seen:
            seen.add(c)
            out.append((c.label(), c))
    return out


def make_weight(n, k, bits, dev, gen):
    w = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), device=dev, dtype=torch.int32,
                      generator=gen)
    s = (torch.randn(n, k // GROUP, device=dev, generator=gen) * 0.01).to(torch.bfloat16)
    b = (torch.randn(n, k // GROUP, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    return w, s, b


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def rel_err(y, ref) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def warm(x, w, s, bits, cfgs) -> None:
    """Compile the case's fused launches before timing them, in parallel threads where Triton
    has AsyncCompileMode (failures surface again, and are reported, at the real launch)."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    t0 = time.time()
    try:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex, \
                AsyncCompileMode(ex, ignore_errors=True):
            for cfg in cfgs:
                Q.qgemm(x, w, s, s, bits=bits, group=GROUP, config=cfg, warmup=True)
    except Exception as e:  # noqa: BLE001 - compiles then happen at the first launch
        print(f"# warm-up: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    print(f"# compiled {len(cfgs)} launches in {time.time() - t0:.1f}s", flush=True)


def run_case(label, n, k, bits, m, dev, gen, sms, smoke, rows, best):
    w, s, b = make_weight(n, k, bits, dev, gen)
    nbytes = sum(t.numel() * t.element_size() for t in (w, s, b))
    reps = 1 if smoke else copies_for(nbytes)
    copies = [(w, s, b)] + [(w.clone(), s.clone(), b.clone()) for _ in range(reps - 1)]
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    wbf = D.dequant_affine(w, s, b, k, bits, GROUP)
    want = dequantize(w, s.float(), b.float(), QuantSpec("affine", bits, GROUP),
                      dtype=torch.float32).to(torch.bfloat16)
    dq_exact = bool(torch.equal(wbf, want))
    del want
    ref = x.float() @ wbf.float().t()
    flop = 2 * m * n * k
    wbfs = [wbf] + ([] if smoke else [wbf.clone() for _ in range(copies_for(wbf.numel() * 2) - 1)])
    vs = variants(m, n, k, bits, sms, smoke)
    if not smoke:
        warm(x, w, s, bits, [cfg for _, cfg in vs])
    cands = [(name, cfg.label(), (lambda c, cfg=cfg: Q.qgemm(x, *c, bits=bits, group=GROUP,
                                                            config=cfg)))
             for name, cfg in vs]
    cands.append(("dq+cublas", "-", lambda c: x @ D.dequant_affine(*c, k, bits, GROUP).t()))
    case = {}
    for name, cfg_label, fn in cands:
        try:
            err = rel_err(fn(copies[0]), ref)
            ok = err < (2.0**-6 if "cublas" in name else 2.0**-7)
            us = None if smoke else graph_us([lambda c=c, fn=fn: fn(c) for c in copies])
        except Exception as e:  # noqa: BLE001 - fail soft: report and go on
            print(f"{label:12s} {bits}b M={m:<4d} {name:24s} FAILED {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            rows.append({"shape": label, "bits": bits, "m": m, "variant": name, "error": True})
            continue
        row = {"shape": label, "n": n, "k": k, "bits": bits, "m": m, "variant": name,
               "config": cfg_label, "us": us and round(us, 2),
               "tflops": us and round(flop / us / 1e6, 1), "err": float(f"{err:.2g}"), "ok": ok}
        rows.append(row)
        case[name] = row
        t = f"{us:9.2f} us {row['tflops']:6.1f} TFLOP/s" if us else "   (not timed)"
        print(f"{label:12s} {bits}b M={m:<4d} {name:24s} {cfg_label:26s} {t} err {err:.1e}"
              f"{'' if ok else ' WRONG'}", flush=True)
    cub = None if smoke else graph_us([lambda wb=wb: x @ wb.t() for wb in wbfs])
    fused = [r for nm, r in case.items() if "cublas" not in nm and r["ok"] and r["us"]]
    top = min(fused, key=lambda r: r["us"]) if fused else None
    summary = {"shape": label, "n": n, "k": k, "bits": bits, "m": m, "dq_bit_exact": dq_exact,
               "best": top and top["config"], "best_us": top and top["us"],
               "best_tflops": top and top["tflops"],
               "default_us": case.get("default", {}).get("us"),
               "dq_cublas_us": case.get("dq+cublas", {}).get("us"),
               "cublas_bf16_us": cub and round(cub, 2),
               "cublas_bf16_tflops": cub and round(flop / cub / 1e6, 1)}
    best.append(summary)
    if top and cub:
        print(f"== {label} {bits}b M={m}: best {top['config']} {top['us']:.1f} us "
              f"{top['tflops']:.0f} TFLOP/s | default {summary['default_us']} | dq+cublas "
              f"{summary['dq_cublas_us']} | bf16 cublas {cub:.1f} us "
              f"{summary['cublas_bf16_tflops']} TFLOP/s | dq exact {dq_exact}",
              flush=True)
    del copies, wbfs
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def dequant_case(label, n, k, bits, dev, gen, smoke, rows) -> None:
    """dequant_affine alone: bit-exact check, then (GPU) time per call over weight copies."""
    w, s, b = make_weight(n, k, bits, dev, gen)
    want = dequantize(w, s.float(), b.float(), QuantSpec("affine", bits, GROUP),
                      dtype=torch.float32).to(torch.bfloat16)
    exact = bool(torch.equal(D.dequant_affine(w, s, b, k, bits, GROUP), want))
    del want
    nbytes = sum(t.numel() * t.element_size() for t in (w, s, b)) + n * k * 2
    us = None
    if not smoke:
        copies = [(w, s, b)] + [(w.clone(), s.clone(), b.clone())
                                for _ in range(copies_for(nbytes) - 1)]
        us = graph_us([lambda c=c: D.dequant_affine(*c, k, bits, GROUP) for c in copies])
        del copies
    t = f"{us:9.2f} us {nbytes / us / 1e3:7.0f} GB/s" if us else "   (not timed)"
    print(f"{label:12s} {bits}b dequant {t} {'exact' if exact else 'INEXACT'}", flush=True)
    rows.append({"shape": label, "n": n, "k": k, "bits": bits, "variant": "dequant",
                 "us": us and round(us, 2), "gbps": us and round(nbytes / us / 1e3),
                 "dq_bit_exact": exact})


def print_table(best) -> None:
    """One line per case: us (TFLOP/s) of the best fused config, the default config,
    dequant + cuBLAS and bf16 cuBLAS."""
    def f(us, flop):
        return f"{us:8.1f} ({flop / us / 1e6:5.0f})" if us else f"{'-':>15s}"

    print(f"\n{'shape':12s} {'b':>1s} {'M':>5s} | {'best fused us (TF/s)':>20s} "
          f"{'config':26s} | {'default':>15s} | {'dq+cublas':>15s} | {'cublas bf16':>15s}")
    for s in best:
        flop = 2 * s["m"] * s["n"] * s["k"]
        print(f"{s['shape']:12s} {s['bits']:1d} {s['m']:5d} | {f(s['best_us'], flop):>20s} "
              f"{s['best'] or '-':26s} | {f(s['default_us'], flop)} | "
              f"{f(s['dq_cublas_us'], flop)} | {f(s['cublas_bf16_us'], flop)}")


def graph_us(fns) -> float:
    from gpu_timing import graph_time_us

    return graph_time_us(fns)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, correctness only (CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--only", default="", help="only shapes whose label contains this")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip cases after this")
    ap.add_argument("--dequant-bits", default="",
                    help="comma list of widths: only time and check dequant_affine (8B shapes)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("gpu_qgemm_sweep: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    dev = torch.device("cpu" if smoke else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = 132 if smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    plan = [(lb, n, k, 4, m) for m in MS for lb, n, k in SHAPES]
    plan.insert(len(SHAPES), ("8B gate_up", 28672, 4096, 8, 512))  # after the 4-bit M=512 rows
    if smoke:  # ragged N against the tiles, split-K, 2- and 8-bit
        plan = [("tiny", 72, 512, 4, 40), ("tiny-8b", 48, 256, 8, 33), ("tiny-2b", 40, 256, 2, 70)]
    plan = [p for p in plan if args.only in p[0]]
    name = "interpreter" if smoke else torch.cuda.get_device_name()
    print(f"# {name}  torch {torch.__version__}  triton {T.triton.__version__}", flush=True)
    if args.dequant_bits:
        rows = []
        shapes = [("tiny", 40, 384)] if smoke else [sh for sh in SHAPES if "8B" in sh[0]]
        for bits in map(int, args.dequant_bits.split(",")):
            for lb, n, k in shapes:
                dequant_case(lb, n, k, bits, dev, gen, smoke, rows)
        inexact = [r for r in rows if not r["dq_bit_exact"]]
        print(f"# {len(rows)} dequant rows, {len(inexact)} dq inexact")
        print(json.dumps(rows))
        sys.exit(1 if inexact else 0)
    t0 = time.time()
    rows: list[dict] = []
    best: list[dict] = []
    for lb, n, k, bits, m in plan:
        if time.time() - t0 > args.budget_s:
            print(f"# budget spent: skipping {lb} {bits}b M={m}")
            rows.append({"shape": lb, "bits": bits, "m": m, "skipped": True})
            continue
        run_case(lb, n, k, bits, m, dev, gen, sms, smoke, rows, best)
    print_table(best)
    bad = [r for r in rows if r.get("ok") is False or r.get("error")]
    inexact = [s for s in best if not s["dq_bit_exact"]]
    print(f"# {len(rows)} rows, {len(bad)} wrong or failed, {len(inexact)} dq inexact, "
          f"{time.time() - t0:.0f}s")
    print(json.dumps(best))
    if smoke and (bad or inexact):
        sys.exit(1)


if __name__ == "__main__":
    main()
