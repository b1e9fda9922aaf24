"""Offline workbench (no GPU): how many SASS instructions per 4-bit code a tensor-core decode
GEMV would take when Triton compiles it for sm_90, against q4gemv's FFMA design (3.4-3.8 per
code, which the H200 runs issue-bound: docs/perf.md, "Tensor-core decode GEMV probe").

The probe kernel (not a product kernel; its numerics are unverified) dequantizes a [BLOCK_N, BK]
tile of MLX 4-bit words in registers with the bf16 magic-number trick (one LOP3 per pair of
codes: (w >> 4i) & 0x000F000F | 0x43004300 holds 128 + q for nibbles i and i + 4), and gets
the per-group sums from one tl.dot by giving each group of the tile its own column of the x
operand (B[k, j] = x[k] if k is in the tile's group j, else 0; up to 16 groups per tile):
y += s * (D - 128 xs) + b * xs per (row, group).

    PYTHONPATH=. python benchmarks/gpu/q4mma_probe.py [K GROUP BLOCK_N NUM_WARPS BK]
    PYTHONPATH=. python benchmarks/gpu/q4mma_probe.py --gpu      (on the H200)

prints the registers and the instruction mix of one K-loop iteration (Triton's ptxas and
cuobjdump; sass_report.compile_sm90). `--gpu` checks the kernel against the fp32 reference and
times it at the Llama-8B decode shapes against q4gemv's default launch (CUDA graphs over weight
copies larger than the L2, as benchmarks/gpu/gpu_q4gemv_sweep.py).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from sass_report import compile_sm90  # noqa: E402


@triton.jit
def _bf(v):
    return v.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _q4mma_kernel(x_ptr, w_ptr, sb_ptr, y_ptr, zero, K: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BK: tl.constexpr):
    KW: tl.constexpr = K // 8
    NG: tl.constexpr = K // GROUP
    WT: tl.constexpr = BK // 8  # words per row per tile
    GT: tl.constexpr = BK // GROUP  # groups per tile: column j of the dot = group j
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wp = w_ptr + rn[:, None] * KW + tl.arange(0, WT)[None, :]
    mag = 0x43004300 + zero  # a register, so that mask-and-or is one LOP3
    kp = tl.arange(0, BK)
    kx = (kp // 8) * 8 + (kp % 8) // 2 + 4 * (kp % 2)  # dot index 8w + 2i + h = code 8w + i + 4h
    col = tl.arange(0, 16)
    gsel = (kx // GROUP)[:, None] == col[None, :]  # [BK, 16]
    sbp = sb_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * NG + col[None, :]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for t in range(K // BK):
        w = tl.load(wp + t * WT, cache_modifier=".cg")  # [BLOCK_N, WT]
        p0 = (w & 0x000F000F) | mag
        p1 = ((w >> 4) & 0x000F000F) | mag
        p2 = ((w >> 8) & 0x000F000F) | mag
        p3 = ((w >> 12) & 0x000F000F) | mag
        lo = tl.join(tl.join(_bf(p0), _bf(p2)), tl.join(_bf(p1), _bf(p3)))
        hi = tl.join(tl.join(_bf(p0 >> 16), _bf(p2 >> 16)), tl.join(_bf(p1 >> 16), _bf(p3 >> 16)))
        a = tl.reshape(tl.join(lo, hi), [BLOCK_N, BK])
        xk = tl.load(x_ptr + t * BK + kx)
        xv = tl.where(gsel, xk[:, None], 0.0).to(x_ptr.dtype.element_ty)
        d = tl.dot(a, xv)  # [BLOCK_N, 16]
        xs = tl.sum(xv.to(tl.float32), axis=0)
        sb = tl.load(sbp + t * GT, mask=(col < GT)[None, :], other=0)
        s = _bf(sb & 0xFFFF).to(tl.float32)
        b = _bf(sb >> 16).to(tl.float32)
        acc += s * d + (b - 128.0 * s) * xs[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def loop_mix(cubin: bytes) -> tuple[str, int, collections.Counter]:
    """The resource line, and the instructions of the K loop's body (between the backward
    branch and its target; code the loop jumps to out of line, such as q4tc's window flush,
    is not counted)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (subprocess.run([f"{tools}/cuobjdump", flag, f.name], capture_output=True,
                                      text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "--dump-sass"))
    code = [(int(m.group(1), 16), m.group(2), m.group(3))
            for m in re.finditer(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([.\w]*)"
                                 r"(?:\s+0x([0-9a-f]+))?", sass)]
    # the first backward conditional branch (a forward one skips a branch inside the loop)
    branches = re.finditer(r"/\*([0-9a-f]+)\*/\s+@!?P\d\s+BRA\s+0x([0-9a-f]+)", sass)
    hi, lo = next(((int(m.group(1), 16), int(m.group(2), 16)) for m in branches
                   if int(m.group(2), 16) < int(m.group(1), 16)), (-1, 0))  # (-1, 0): none
    ops = collections.Counter(op for a, op, _ in code if lo <= a <= hi)
    return usage.strip().splitlines()[-1].strip(), sum(ops.values()), ops


def gpu(launches=((128, 4, 256), (256, 8, 256), (64, 4, 256))) -> None:
    """Max error over sum |x||w| against the fp32 reference, and us per call against q4gemv."""
    import torch
    from gpu_timing import L2_BYTES, graph_time_us

    from mlxr.ops.matmul import decode_gemv_q4 as Q
    from mlxr.ops.matmul.generic_qmm import dequant_f32

    g = 64
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                         "down": (4096, 14336)}.items():
        nbytes = n * k // 2 + 4 * n * (k // g)
        ws = []
        for _ in range(max(1, min(16, -(-2 * L2_BYTES // nbytes)))):
            w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
            sc = (torch.randn(n, k // g, device="cuda") * 0.02).bfloat16()
            b = (torch.randn(n, k // g, device="cuda") * 0.1).bfloat16()
            ws.append((w, sc, b, Q.pair_scales(sc, b), Q.repack(w)))
        x = torch.randn(k, device="cuda").bfloat16()
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        w, sc, b = ws[0][:3]
        deq = dequant_f32(w, sc, b, None, "affine", 4, g)
        exact = x.double() @ deq.double().t()
        scale = x.double().abs() @ deq.double().abs().t()
        base = graph_time_us([lambda a=a: Q.q4gemv(x, a[4], a[1], a[2], group=g, sb=a[3], out=y)
                              for a in ws])
        print(f"{name}: q4gemv {base:.2f} us ({nbytes / base / 1e3:.0f} GB/s)")
        for bn, nw, bk in launches:
            if n % bn or k % bk or bk // g > 16:
                continue

            def run(a, bn=bn, nw=nw, bk=bk):
                _q4mma_kernel[(n // bn,)](x, a[0], a[3], y, 0, K=k, GROUP=g, BLOCK_N=bn, BK=bk,
                                          num_warps=nw, num_stages=1)

            run(ws[0])
            err = float(((y.double() - exact).abs() / scale).max())
            us = graph_time_us([lambda a=a: run(a) for a in ws])
            print(f"  mma {bn} rows, {nw} warps, {bk} codes: {us:.2f} us "
                  f"({nbytes / us / 1e3:.0f} GB/s), max err / sum|x||w| {err:.1e}")


def main(argv: list[str]) -> None:
    if argv == ["--gpu"]:
        return gpu()
    k, group, block_n, nw, bk = (int(a) for a in argv) if argv else (4096, 64, 128, 4, 256)
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "sb_ptr": "*bf16", "y_ptr": "*bf16",
           "zero": "i32"}
    ck = compile_sm90(_q4mma_kernel, sig, dict(K=k, GROUP=group, BLOCK_N=block_n, BK=bk), nw)
    usage, n, ops = loop_mix(ck.asm["cubin"])
    codes = block_n * bk // (32 * nw)
    print(usage)
    print(f"loop body: {n} instructions for {codes} codes per thread, {n / codes:.2f} per code")
    print(", ".join(f"{op} {c}" for op, c in ops.most_common(14)))


if __name__ == "__main__":
    main(sys.argv[1:])
