"""Compile a decode GEMV for sm_90 without a GPU and report its resources and instruction mix: a
workbench for sessions without device time (registers, spills, shared memory, SASS opcodes per
code of the program's tile, load widths, barriers, and the layout conversions Triton inserted).

    PYTHONPATH=. python benchmarks/gpu/sass_report.py q4gemv K GROUP BLOCK_N WT [PRO]
    PYTHONPATH=. python benchmarks/gpu/sass_report.py gemv K BITS GROUP BLOCK_N GT [num_warps]
    PYTHONPATH=. python benchmarks/gpu/sass_report.py qgemm M N K

(PRO: q4gemv's prologue, 0 none, 1 rms_norm(h + r), 2 silu(gate) * up. qgemm: the fused
prefill GEMM's default launch for M rows of a 4-bit g64 weight N x K.)

Pointer arguments are compiled as 16-byte aligned, as Triton specializes them at a real launch
(without that, no load is vectorized and the report misleads). Uses the ptxas/cuobjdump that
Triton ships.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, sig: dict, const: dict, num_warps: int, num_stages: int = 1):
    sig = dict(sig)
    sig.update(dict.fromkeys(const, "constexpr"))
    names = [n for n in fn.arg_names if n in sig]  # the kernel's own argument order
    sig = {n: sig[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if str(sig[n]).startswith("*")}
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def report(ck, codes_per_thread: int) -> None:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    ops: collections.Counter = collections.Counter()
    mem: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?", line)
        if m:
            ops[m.group(2)] += 1
            if m.group(2) in ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "BAR", "SHFL"):
                mem[m.group(2) + (m.group(3) or "")] += 1
    total = sum(ops.values())
    converts = ck.asm["ttgir"].count("ttg.convert_layout")
    print(usage.strip().splitlines()[-1].strip())
    print(f"{total} SASS instructions, {codes_per_thread} codes per thread per tile "
          f"({total / codes_per_thread:.2f} per code incl. fixed costs); "
          f"{converts} convert_layout ops in the TTGIR (equivalent layouts compile to nothing; "
          f"the BAR and LDS/STS counts show the real ones)")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
    print("memory/sync:", ", ".join(f"{op} {n}" for op, n in sorted(mem.items())))


def main(argv: list[str]) -> None:
    kind, args = argv[0], [int(a) for a in argv[1:]]
    if kind == "q4gemv":
        from mlxr.ops.matmul import decode_gemv_q4 as Q

        k, group, block_n, wt = args[:4]
        pro = args[4] if len(args) > 4 else 0
        sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16", "h_ptr": "*bf16",
               "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
               "N": "i32", "eps": "fp32", "offset": "fp32", "zero": "i32"}
        const = {"K": k, "GROUP": group, "BLOCK_N": block_n, "WT": wt, "EVEN_N": True,
                 "SB": True, "CG": True, "GDC": False, "PRO": pro, "HAS_R": pro == 1,
                 "HAS_OFFSET": False, "ACT": 0}
        nw = wt // 128
        report(compile_sm90(Q._q4gemv_kernel, sig, const, nw), block_n * wt * 8 // (32 * nw))
    elif kind == "gemv":
        from mlxr.ops.matmul import decode_gemv as G

        k, bits, group, block_n, gt = args[:5]
        nw = args[5] if len(args) > 5 else 4
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16",
               "gs_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
               "stride_ym": "i32", "stride_ys": "i32"}
        const = {"K": k, "BITS": bits, "GROUP": group, "MODE": 0, "HAS_GS": False, "MP": 1,
                 "SPLIT_K": 1, "BLOCK_N": block_n, "GT": gt, "PREFETCH": 1, "EVEN_N": True}
        report(compile_sm90(G._gemv_kernel, sig, const, nw), block_n * gt * group // (32 * nw))
    elif kind == "qgemm":
        from mlxr.ops.matmul import prefill_gemm as Q

        m, n, k = args[:3]
        cfg = Q.default_config(m, n, k, 4, 64)
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16",
               "y_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
               "stride_ym": "i32", "stride_ys": "i32"}
        const = {"K": k, "BITS": 4, "GROUP": 64, "BLOCK_M": cfg.block_m,
                 "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
                 "W_AS_A": cfg.w_as_a, "SPLIT_K": cfg.split_k, "EVEN_N": True, "EVEN_K": True,
                 "INTERPRET": False}
        print(cfg.label())
        report(compile_sm90(Q._qgemm_kernel, sig, const, cfg.num_warps, cfg.num_stages),
               cfg.block_n * cfg.block_k * (k // cfg.block_k // cfg.split_k)
               // (32 * cfg.num_warps))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
