"""The grouped MoE kernels compiled for sm_90a on a machine without a GPU: Triton's own
compiler and the ptxas of its wheel, at the Qwen3-30B-A3B expert shape (gate/up 2048 -> 768,
down 768 -> 2048, 4-bit g64, bf16), with the specialization a real launch gets (16-byte
aligned pointers, sizes divisible by 16). Per kernel and launch config: registers per
thread, spilled bytes, shared memory, the MMA the dot became (wgmma or mma.sync), the cp.async
copies the pipeliner made, and the layout of the weight-word load (threads along K or N).
What it cannot say is time: that is scripts/moe_gpu_perf.py --only grouped on the H200.

    PYTHONPATH=. python scripts/moe_sm90_report.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxr.ops.moe import grouped_experts as G  # noqa: E402
from mlxr.ops.moe import grouped_fused as F  # noqa: E402

PTR = {"x_ptr": "*bf16", "pairs_ptr": "*i32", "bexp_ptr": "*i32", "out_ptr": "*bf16",
       "rw_ptr": "*bf16", "aw_ptr": "*i32", "bw_ptr": "*i32", "ags_ptr": "*fp32",
       "bgs_ptr": "*fp32"}
SCALARS = {"N": "i32", "P": "i32", "stride_x": "i32", "alpha": "fp32", "limit": "fp32"}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile fn for sm_90a; its metadata and IR, with ptxas -v's register report."""
    names = list(fn.arg_names)
    sig = {n: constexprs.get(n) is not None and "constexpr" or PTR.get(n) or SCALARS.get(n)
           or "*bf16" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ("N", "stride_x")}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        rep = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o",
                              os.devnull], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return {"ttgir": k.asm["ttgir"], "smem": k.metadata.shared,
            "regs": int(regs.group(1)) if regs else -1,
            "spill": int(spill.group(1)) if spill else -1}


def word_layout(ttgir: str) -> str:
    """The layout of the first 2-D i32 (weight word) load: which way a warp's threads go."""
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<(\{[^}]*\})>", ttgir, re.M))
    for m in re.finditer(r"(?:tt\.load|async_copy_global_to_local) [^\n]*?"
                         r"tensor<(\d+)x(\d+)x!tt\.ptr<i32>, (#blocked\d*)>", ttgir):
        lay = layouts.get(m.group(3), "?")
        tpw = re.search(r"threadsPerWarp = \[([^]]*)\]", lay)
        spt = re.search(r"sizePerThread = \[([^]]*)\]", lay)
        return (f"{m.group(1)}x{m.group(2)} words, sizePerThread [{spt.group(1)}] "
                f"threadsPerWarp [{tpw.group(1)}]")
    return "? (no 2-D i32 load)"


def report(name: str, fn, constexprs: dict, num_warps: int, num_stages: int) -> None:
    try:
        r = compile_sm90(fn, constexprs, num_warps, num_stages)
    except Exception as exc:  # a config the compiler refuses (shared memory, layouts)
        print(f"{name:44s} FAIL {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return
    tt = r["ttgir"]
    mma = ("wgmma" if "warp_group_dot" in tt else
           "mma.sync" if "nvidia_mma<{versionMajor = 2" in tt else "fma")
    print(f"{name:44s} regs {r['regs']:3d} spill {r['spill']:4d} B smem "
          f"{r['smem'] // 1024:3d} KiB {mma:8s} cp.async {tt.count('async_copy_global'):2d} "
          f"cvt {tt.count('convert_layout'):2d} | {word_layout(tt)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one config of each kernel")
    a = ap.parse_args()
    common = dict(BITS=4, GROUP=64, MODE=0, HAS_GS=False, HAS_BIAS=False, ACT=0)
    old = [(32, 64, 64, 4, 3), (64, 128, 64, 4, 3)]
    for glu, k in ((True, 2048), (False, 768)):
        for bm, bn, bk, nw, ns in old[:1] if a.quick else old:
            report(f"old {'gate_up' if glu else 'down'} {bm}x{bn}x{bk}_w{nw}_s{ns}",
                   G._grouped_kernel, dict(common, K=k, ROW_DIV=8 if glu else 1, GLU=glu,
                                           DOT_IEEE=False, BLOCK_M=bm, BLOCK_N=bn,
                                           BLOCK_K=bk), nw, ns)
    cfgs = [F.FusedConfig(32, 128, 64, 4, 3, True), F.FusedConfig(16, 128, 128, 4, 3, True),
            F.FusedConfig(64, 128, 64, 8, 3, True), F.FusedConfig(64, 128, 64, 4, 3, False),
            F.FusedConfig(32, 128, 128, 4, 4, True)]
    for glu, k in ((True, 2048), (False, 768)):
        for c in cfgs[:1] if a.quick else cfgs:
            report(f"fused {'gate_up' if glu else 'down'} {c.label()}", F._fused_kernel,
                   dict(common, K=k, ROW_DIV=8 if glu else 1, GLU=glu, IN_BLOCKS=not glu,
                        OUT_BLOCKS=glu, WEIGHTED=not glu, ROUND_PROD=not glu,
                        W_AS_A=c.w_as_a, EVEN_N=True, IEEE=False, INTERPRET=False,
                        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k),
                   c.num_warps, c.num_stages)


if __name__ == "__main__":
    main()
