"""Workbench for the tensor-core decode GEMV (`mlxr.ops.matmul.decode_gemv_tc`).

    PYTHONPATH=. python benchmarks/gpu/q4tc_probe.py [K GROUP RT U WARPS PF STAGES [UNROLL]]
        [pdl] [fp4|fp8]
    cd benchmarks/gpu && PYTHONPATH=../..:. python q4tc_probe.py --gpu [--tma|--wide|--deep]
    [8b|0.6b]
    cd benchmarks/gpu && PYTHONPATH=../..:. python q4tc_probe.py --rows 2,4,8 [8b|0.6b]
    cd benchmarks/gpu && PYTHONPATH=../..:. python q4tc_probe.py --glu 1,4

Offline (no GPU): compiles the kernel for sm_90 with Triton's ptxas, prints the layouts from
the TTGIR and those of the inline PTX's results (per-lane tensors: one element per thread, lanes
along the last dimension), the layout conversions, registers, and the K loop's instructions per
code.
--gpu: the default launch, then a sweep (`--tma`: the TMA-staged word tiles; `--wide`: 16 and
32 warps per program); max error against
fp64 (over sum |x||w|, and in bf16 units against the fp32 reference),
then us per call in CUDA graphs over weight copies larger than the L2, against q4gemv's default
launch, for a sweep of launch shapes. The last line is JSON.
--rows: 2-8 rows of x (batched decode) through q4tc's default launch, tinygemm and the fused
GEMM: us per call and the error against fp64.
--glu: the MLP's gate_up with act(gate) * up in q4tc's epilogue (a glu copy, `act="silu"`)
against the plain launch followed by `gated_act`, and the plain launch alone (us per call),
for the given rows of x; the fused results must equal the pair's bit for bit.
"""

from __future__ import annotations

import collections
import json
import re
import sys

from q4mma_probe import loop_mix
from sass_report import compile_sm90

from mlxr.ops.matmul import decode_gemv_tc as T

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096),
          "8b down": (4096, 14336), "8b head": (128256, 4096), "0.6b qkv": (4096, 1024),
          "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
          "0.6b head": (151936, 1024)}
PF1 = ((4, 1, 4), (2, 1, 4), (2, 2, 4), (8, 1, 4), (1, 1, 8), (1, 2, 8), (2, 1, 8), (4, 1, 8))
PF2 = ((4, 1, 4), (2, 1, 4), (2, 2, 4), (1, 2, 4), (1, 1, 8), (2, 1, 8), (4, 1, 8))
LAUNCHES = tuple(c + (1, 0) for c in PF1) + tuple(c + (2, 0) for c in PF2)
# --tma: the word tiles through shared memory by TMA, 2 or 4 stages
TMA = tuple(c + (1, st) for st in (2, 4) for c in ((1, 1, 4), (2, 1, 4), (4, 1, 4), (1, 1, 8),
                                                    (2, 1, 8), (1, 2, 8)))
# --wide: 16 and 32 warps per row tile (more warps per SM on the <= 4096-row matrices, whose
# 16-row programs number only 256), registers or TMA
WIDE = ((1, 1, 16, 1, 0), (1, 1, 16, 2, 0), (1, 1, 16, 1, 4), (1, 2, 16, 1, 4),
        (1, 1, 32, 1, 0), (1, 1, 32, 1, 4), (2, 1, 16, 1, 0), (2, 1, 16, 1, 4), (1, 1, 4, 2, 0))
# --deep: more word bytes in flight per SM (Nsight Compute: the warps stall on the word loads,
# and on the moves that rotate a prefetched tile into place, which wait for its load):
# (rt, u, warps, pf, stages, unroll, maxnreg): two blocks per warp and iteration, two
# tiles in flight with the loop unrolled twice (they swap registers instead of moving),
# deeper TMA rings, registers capped so two 16-warp programs fit per SM
DEEP = ((1, 2, 16, 1, 0, 1, 0), (1, 2, 16, 1, 0, 1, 64), (1, 2, 8, 1, 0, 1, 0),
        (1, 2, 8, 2, 0, 1, 0), (1, 1, 16, 2, 0, 2, 0), (1, 1, 8, 2, 0, 2, 0),
        (1, 1, 16, 1, 6, 1, 0), (1, 1, 16, 1, 8, 1, 0), (1, 1, 8, 1, 8, 1, 0),
        (1, 2, 8, 1, 6, 1, 0), (2, 1, 8, 1, 6, 1, 0), (2, 2, 4, 1, 0, 1, 0),
        (2, 1, 8, 2, 0, 2, 0))


def offline(k: int, group: int, rt: int, u: int, nw: int, pf: int, stages: int,
            unroll: int = 1, gdc: bool = False, fp4: bool = False, fp8: bool = False) -> None:
    cfg = T.TcConfig(rt=rt, u=u, num_warps=nw, pf=pf, stages=stages, unroll=unroll)
    desc = f"tensordesc<i32[{rt}, {cfg.wt // 256}, 256]>" if stages else "constexpr"
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "w_desc": desc, "sb_ptr": "*bf16",
           "y_ptr": "*bf16", "xaddr": "i64", "sbaddr": "i64", "NRT": "i32", "gs": "fp32"}
    const = dict(K=k, GROUP=group, RT=rt, WT=cfg.wt, PF=pf, STAGES=stages, UNROLL=unroll,
                 M=1, ACT=-1, P=1, F16=False, GDC=gdc, INTERP=False, FP4=fp4, HAS_GS=False,
                 FP8=fp8)
    if not stages:
        const["w_desc"] = None
    ck = compile_sm90(T._q4tc_kernel, sig, const, nw, max(stages, 1))
    ttgir = ck.asm["ttgir"]
    for m in re.finditer(r"#(\w+) = #ttg\.blocked<\{([^}]*)\}>", ttgir):
        print(f"layout #{m.group(1)}: {m.group(2)}")
    print(f"convert_layout ops: {ttgir.count('ttg.convert_layout')}, "
          f"TMA copies: {ttgir.count('async_tma_copy_global_to_local')}")
    # the PTX's lane semantics need per-lane tensors: one element per thread along the lanes
    for lay, n in collections.Counter(re.findall(r"elementwise_inline_asm.*-> (.*) loc",
                                                 ttgir)).items():
        print(f"inline asm x{n} -> {lay[:160]}")
    usage, n, ops = loop_mix(ck.asm["cubin"])
    codes = rt * cfg.wt * 8 // (32 * nw)  # (fp8: the same codes, from twice the words)
    print(usage)
    print(f"loop body: {n} instructions for {codes} codes per thread, {n / codes:.2f} per code")
    print(", ".join(f"{op} {c}" for op, c in ops.most_common(16)))


def _weight_copies(n: int, k: int, g: int, most: int, extra=lambda w, sc, b: ()) -> list:
    """Random 4-bit weights [N, K], bf16 scales: enough copies (up to `most`) that rotating
    through them defeats the L2. Each is (MLX words, scales, biases, (scale, bias) pairs,
    q4tc words) + extra(words, scales, biases)."""
    import torch
    from gpu_timing import L2_BYTES

    from mlxr.ops.matmul.decode_gemv_q4 import pair_scales

    nbytes = n * k // 2 + 4 * n * (k // g)
    out = []
    for _ in range(max(1, min(most, -(-2 * L2_BYTES // nbytes)))):
        w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        sc = (torch.randn(n, k // g, device="cuda") * 0.02).bfloat16()
        b = (torch.randn(n, k // g, device="cuda") * 0.1).bfloat16()
        out.append((w, sc, b, pair_scales(sc, b), T.repack(w)) + tuple(extra(w, sc, b)))
    return out


def gpu(only: str = "", launches=LAUNCHES) -> None:
    import torch
    from gpu_timing import graph_time_us

    from mlxr.ops.matmul import decode_gemv_q4 as Q
    from mlxr.ops.matmul.generic_qmm import dequant_f32

    g = 64
    rows = []
    for name, (n, k) in SHAPES.items():
        if not name.startswith(tuple(only.split(","))):
            continue
        nbytes = n * k // 2 + 4 * n * (k // g)
        ws = _weight_copies(n, k, g, 16, lambda w, sc, b: (Q.repack(w),))  # [5]: q4gemv's
        x = torch.randn(k, device="cuda").bfloat16()
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        w, sc, b = ws[0][:3]
        deq = dequant_f32(w, sc, b, None, "affine", 4, g)
        exact = x.double() @ deq.double().t()
        scale = x.double().abs() @ deq.double().abs().t()
        ref32 = (x.float() @ deq.t()).bfloat16()
        base = graph_time_us([lambda a=a: Q.q4gemv(x, a[5], a[1], a[2], group=g, sb=a[3], out=y)
                              for a in ws])
        Q.q4gemv(x, ws[0][5], sc, b, group=g, sb=ws[0][3], out=y)
        qerr = float(((y.double() - exact).abs() / scale).max())
        print(f"{name} {n}x{k}: q4gemv {base:.2f} us ({nbytes / base / 1e3:.0f} GB/s), "
              f"err {qerr:.1e}, bf16 != fp32 ref: {(y != ref32).float().mean().item():.4f}",
              flush=True)
        row = {"shape": name, "q4gemv_us": round(base, 2)}
        for rt, u, nw, pf, st, *more in ((None,) * 5,) + launches:
            un, reg = (more + [1, 0][len(more):])[:2]  # DEEP's unroll and maxnreg
            cfg = (T.default_config(n, k) if rt is None
                   else T.TcConfig(rt=rt, u=u, num_warps=nw, pf=pf, stages=st, unroll=un,
                                   maxnreg=reg))
            if (k // 64) % (cfg.wt // 128):
                continue
            try:
                T.q4tc(x, ws[0][4], ws[0][3], group=g, out=y, config=cfg)
            except Exception as e:  # a launch shape that does not compile is reported, not fatal
                print(f"  {cfg.label()}: {type(e).__name__}: {str(e)[:200]}")
                continue
            err = float(((y.double() - exact).abs() / scale).max())
            neq = (y != ref32).float().mean().item()
            us = graph_time_us([lambda a=a, cfg=cfg: T.q4tc(x, a[4], a[3], group=g, out=y,
                                                            config=cfg) for a in ws])
            tag = "default " * (rt is None)
            print(f"  tc {tag}{cfg.label()}: {us:.2f} us ({nbytes / us / 1e3:.0f} GB/s), "
                  f"err {err:.1e}, bf16 != fp32 ref: {neq:.4f}", flush=True)
            row[cfg.label()] = round(us, 2)
            row[cfg.label() + "_err"] = err
        rows.append(row)
    print(json.dumps(rows))


def rows(ms: list[int], only: str = "") -> None:
    """Several rows of x (batched decode): q4tc's default launch against tinygemm (the
    serving engine's 2-7-row path, on its own copy of the weights) and the fused GEMM, with
    the max error over sum |x||w| against fp64 for each."""
    import torch
    from gpu_timing import graph_time_us

    from mlxr.ops.matmul.generic_qmm import dequant_f32
    from mlxr.ops.matmul.prefill_gemm import qgemm
    from mlxr.quant.cuda_copies import tinygemm_pack

    g = 64
    for name, (n, k) in SHAPES.items():
        if not name.startswith(tuple(only.split(","))):
            continue
        ws = _weight_copies(n, k, g, 8, tinygemm_pack)  # [5], [6]: tinygemm's copy
        w, sc, b = ws[0][:3]
        deq = dequant_f32(w, sc, b, None, "affine", 4, g).double()
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact, scale = x.double() @ deq.t(), x.double().abs() @ deq.abs().t()
            paths = {
                "q4tc": lambda a: T.q4tc(x, a[4], a[3], group=g),
                "tinygemm": lambda a: torch._weight_int4pack_mm(x, a[5], g, a[6]),
                "fused": lambda a: qgemm(x, a[0], a[1], a[2], bits=4, group=g)}
            line = []
            for label, f in paths.items():
                err = float(((f(ws[0]).double() - exact).abs() / scale).max())
                us = graph_time_us([lambda a=a, f=f: f(a) for a in ws])
                line.append(f"{label} {us:7.2f} us (err {err:.1e})")
            print(f"{name:12s} M={m}: " + ", ".join(line), flush=True)


def glu(ms: list[int]) -> None:
    import torch
    from gpu_timing import graph_time_us

    from mlxr.ops.layer.norm_rope_act import gated_act
    from mlxr.ops.matmul.decode_gemv_q4 import pair_scales

    g = 64
    for name in ("8b gate_up", "0.6b gate_up"):
        n, k = SHAPES[name]
        perm = T.glu_rows(n).cuda()
        ws = _weight_copies(n, k, g, 8, lambda w, sc, b: (
            T.repack(w[perm]), pair_scales(sc[perm], b[perm])))  # [5], [6]: the glu copy
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            plain = lambda a: T.q4tc(x, a[4], a[3], group=g)  # noqa: E731
            pair = lambda a: gated_act(*plain(a).view(m, n).chunk(2, -1), "silu")  # noqa: E731
            fused = lambda a: T.q4tc(x, a[5], a[6], group=g, act="silu")  # noqa: E731
            same = torch.equal(fused(ws[0]).view(m, -1), pair(ws[0]))
            line = [f"{label} {graph_time_us([lambda a=a, f=f: f(a) for a in ws]):6.2f} us"
                    for label, f in (("plain", plain), ("plain + act", pair), ("fused", fused))]
            print(f"{name:12s} M={m}: " + ", ".join(line) + f", fused == pair: {same}",
                  flush=True)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--glu":  # --glu 1,4
        return glu([int(m) for m in argv[1].split(",")])
    if argv and argv[0] == "--rows":  # --rows 2,4,8 [8b|0.6b]
        return rows([int(m) for m in argv[1].split(",")], argv[2] if len(argv) > 2 else "")
    if argv and argv[0] == "--gpu":  # --gpu [--tma | --wide | --deep] [shape prefix]
        sweep = {"--tma": TMA, "--wide": WIDE, "--deep": DEEP}.get(
            next((a for a in argv if a.startswith("--") and a != "--gpu"), ""), LAUNCHES)
        argv = [a for a in argv if a not in ("--tma", "--wide", "--deep")]
        return gpu(argv[1] if len(argv) > 1 else "", sweep)
    nums = [int(a) for a in argv if a not in ("pdl", "fp4", "fp8")] or [4096, 64, 2, 2, 4, 1, 0]
    # an 8th number: the unroll factor; pdl: launched with PDL; fp4 / fp8: the mxfp4 / mxfp8
    # chain
    offline(*nums, gdc="pdl" in argv, fp4="fp4" in argv, fp8="fp8" in argv)


if __name__ == "__main__":
    main(sys.argv[1:])
