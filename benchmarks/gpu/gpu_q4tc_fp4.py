"""mxfp4 / nvfp4 single-row decode on q4tc's fp4 copy (`q4tc(fp4=True)`) against affine 4-bit
of the same group on q4tc (the same bytes per code, the same launch; none for group 16) and
against the generic Triton GEMV that served them before (`generic_qmm.qgemv` on the MLX
words), per 8B / 0.6B projection: us per call (CUDA graphs rotating through copies larger
than the L2, median) and GB/s of the file's bytes (codes + 1-byte scales). mxfp8: its fp8
copy (`q4tc(fp8=True)`) against the generic GEMV; with --sweep, also each of `SWEEP`'s
launches (the default is 4-bit's, tuned for half the bytes per code).

    python benchmarks/gpu/gpu_q4tc_fp4.py [mxfp4] [nvfp4] [mxfp8] [--sweep]
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_timing import L2_BYTES, graph_time_us  # noqa: E402

from mlxr.ops.matmul.decode_gemv_q4 import pair_scales  # noqa: E402
from mlxr.ops.matmul.decode_gemv_tc import (  # noqa: E402
    GROUPS, TcConfig, fp4_bits, fp8_words, q4tc, q4tc_ref, repack)
from mlxr.ops.matmul.generic_qmm import qgemv  # noqa: E402
from mlxr.quant.fp import scale_table  # noqa: E402

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096),
          "8b_down": (4096, 14336), "8b_head": (128256, 4096), "0.6b_qkv": (4096, 1024),
          "0.6b_o": (1024, 2048), "0.6b_gate_up": (6144, 1024), "0.6b_down": (1024, 3072)}
# fp8 launches tried by --sweep: (rt, u, num_warps, pf, unroll)
SWEEP = [(1, 1, 4, 2, 1), (1, 1, 8, 1, 1), (1, 1, 8, 2, 1), (1, 1, 8, 2, 2), (1, 1, 16, 1, 1),
         (1, 1, 16, 2, 2), (2, 1, 4, 1, 1), (2, 1, 4, 2, 1), (2, 1, 8, 2, 2), (4, 1, 4, 2, 1)]


def main(modes: list[str], sweep: bool = False) -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for mode in modes:
        if mode == "mxfp8":
            fp8(g, sweep)
            continue
        group = 32 if mode == "mxfp4" else 16
        gs = 0.75 if mode == "nvfp4" else None  # nvfp4 with a global scale (the GEMV's too)
        for name, (n, k) in SHAPES.items():
            nrot = max(1, -(-2 * L2_BYTES // (n * k // 2)))
            x = torch.randn(k, generator=g, device=dev).bfloat16()
            words = [torch.randint(-(2**31), 2**31, (n, k // 8), generator=g, device=dev,
                                   dtype=torch.int64).to(torch.int32) for _ in range(nrot)]
            lo, hi = (118, 126) if mode == "mxfp4" else (0x30, 0x50)
            sbytes = [torch.randint(lo, hi, (n, k // group), generator=g, device=dev,
                                    dtype=torch.int32).to(torch.uint8) for _ in range(nrot)]
            s = [scale_table(mode, dev)[b.long()].bfloat16() for b in sbytes]
            fp4 = [(fp4_bits(repack(w)), pair_scales(si, torch.zeros_like(si)))
                   for w, si in zip(words, s)]
            aff = [(repack(w), pair_scales(si, (si * -8).bfloat16())) for w, si in zip(words, s)]
            y = q4tc(x, *fp4[0], group=group, fp4=True, gs=gs)
            twin = q4tc_ref(x, *fp4[0], group=group, fp4=True, gs=gs)
            err = float((y.float() - twin.float()).abs().max() / twin.float().abs().max())
            t_fp4 = graph_time_us([lambda c=c: q4tc(x, *c, group=group, fp4=True, gs=gs)
                                   for c in fp4])
            t_aff = (graph_time_us([lambda c=c: q4tc(x, *c, group=group) for c in aff])
                     if group in GROUPS else float("nan"))
            gst = None if gs is None else torch.tensor(gs * 2688.0, device=dev)
            t_gen = graph_time_us([lambda w=w, e=e: qgemv(x[None], w, e, None, gst, mode=mode,
                                                           bits=4, group=group)
                                   for w, e in zip(words, sbytes)])
            gb_fp4 = n * k * (0.5 + 1 / group) / 1e3
            print(f"{mode} {name:12s} fp4 q4tc {t_fp4:7.1f} us ({gb_fp4 / t_fp4:5.0f} GB/s)  "
                  f"affine g{group} q4tc {t_aff:7.1f} us  generic {mode} GEMV {t_gen:7.1f} us"
                  f"  fp4 vs twin {err:.1e}", flush=True)


def fp8(g, sweep: bool) -> None:
    dev = "cuda"
    for name, (n, k) in SHAPES.items():
        nrot = max(1, -(-2 * L2_BYTES // (n * k)))
        x = torch.randn(k, generator=g, device=dev).bfloat16()
        codes = []
        for _ in range(nrot):  # every E4M3 code but the NaN ones
            c = torch.randint(0, 254, (n, k), generator=g, device=dev, dtype=torch.int32)
            codes.append((c + (c >= 0x7F).int()).to(torch.uint8))
        sbytes = [torch.randint(118, 126, (n, k // 32), generator=g, device=dev,
                                dtype=torch.int32).to(torch.uint8) for _ in range(nrot)]
        s = [scale_table("mxfp8", dev)[b.long()].bfloat16() for b in sbytes]
        cp = [(fp8_words(c), pair_scales(si, torch.zeros_like(si))) for c, si in zip(codes, s)]
        y = q4tc(x, *cp[0], group=32, fp8=True)
        twin = q4tc_ref(x, *cp[0], group=32, fp8=True)
        err = float((y.float() - twin.float()).abs().max() / twin.float().abs().max())
        t_fp8 = graph_time_us([lambda c=c: q4tc(x, *c, group=32, fp8=True) for c in cp])
        t_gen = graph_time_us([lambda c=c, e=e: qgemv(x[None], c.view(torch.int32), e, None,
                                                       None, mode="mxfp8", bits=8, group=32)
                               for c, e in zip(codes, sbytes)])
        gb = n * k * (1 + 1 / 32) / 1e3
        print(f"mxfp8 {name:12s} fp8 q4tc {t_fp8:7.1f} us ({gb / t_fp8:5.0f} GB/s)  "
              f"generic mxfp8 GEMV {t_gen:7.1f} us ({gb / t_gen:5.0f} GB/s)  "
              f"fp8 vs twin {err:.1e}", flush=True)
        for rt, u, nw, pf, un in SWEEP if sweep else []:
            cfg = TcConfig(rt=rt, u=u, num_warps=nw, pf=pf, unroll=un)
            if (k // 64) % (cfg.wt // 128):
                continue
            yc = q4tc(x, *cp[0], group=32, fp8=True, config=cfg)
            e = float((yc.float() - twin.float()).abs().max() / twin.float().abs().max())
            t = graph_time_us([lambda c=c: q4tc(x, *c, group=32, fp8=True, config=cfg)
                               for c in cp])
            print(f"    {cfg.label():22s} {t:7.1f} us ({gb / t:5.0f} GB/s)  vs twin {e:.1e}",
                  flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--sweep"]
    main(args or ["mxfp4", "nvfp4", "mxfp8"], "--sweep" in sys.argv)
