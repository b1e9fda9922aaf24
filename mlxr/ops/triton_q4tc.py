"""Batch-1 decode GEMV for MLX affine 4-bit weights on the tensor cores: y[N] = x[K] @ W^T.

Why: `triton_q4gemv` (one LOP3 + one FFMA per code) is issue-bound on the H200 at 8B shapes:
3.8 instructions per code at 0.57 issued per scheduler-cycle, ~2.25 TB/s (docs/perf.md).
Here the multiply-adds go to `mma.sync.m16n8k16` (bf16/fp16 in, fp32 accumulate) and the
dequantization to 3 shifts + 4 LOP3 per 8 codes, while the grid keeps q4gemv's shape (many
small programs, each with its whole tile of words in flight):

* **Load-time repack** (`repack`, same bytes): rows in tiles of 16, K in blocks of 64. For row
  tile R and block b, 128 words in lane order: word 4t + s is lane t's A fragment of mma step
  s (t = 4g + tig). Its nibble i + 4hi (i = h + 2m) holds the code of row 16R + 8h + g at
  k = 64b + 32(s // 2) + 8tig + 4(s % 2) + 2m + hi, so `(w >> 4i) & 0x000F000F | MAGIC` is
  the fragment register a_i: two codes as 16-bit floats MAGIC + q (128 + q in bf16, 1024 + q
  in fp16, both exact). A lane's x for steps (0, 1) and (2, 3) is then 8 consecutive values
  each (two 16-byte loads), and every mma step stays inside one 32-code half of the block.
* **Groups in columns**: only the B column of the current group slot carries x (lanes
  4c..4c+3 load it, the others hold zeros), so one fp32 accumulator tile keeps up to 8 group
  sums per row apart: D[row, c]. Every 8 slots (the window flush) each lane scales its four
  accumulators once: s * (D - MAGIC * xs) + b * xs, with xs (the x sums per slot) from the
  same mma on an all-ones A. The multiply is fp32 over exact bf16/fp16 products, as mlx-lm's
  qmv computes s * dot(q, x) + b * sum(x).
* The mma and the lane loads are PTX (`tl.inline_asm_elementwise`) on per-lane tensors: the
  word tile is loaded 16 bytes per thread and split into its 4 steps in registers, so element
  u of every operand is lane u % 32 whatever layout Triton picks (see the comment above
  `_STEP`). The GPU tests check the results; `benchmarks/q4tc_probe.py` prints the layouts
  and the SASS offline. Under TRITON_INTERPRET (no PTX) the mma and the loads are emulated
  with the same lane semantics.
* Loads run ahead of their use: the words `pf` iterations, x one, the pairs one window.
  Measured (docs/perf.md): half q4gemv's instructions per code, 3-16% faster on the tall and
  long matrices (8B gate_up 22.1 vs 26.0 us, LM head 81.6 vs 96.6), slower on the squarish
  ones of <= 4096 rows, which keep q4gemv (`mlxr.quant.cuda.q4tc_preferred`).

`q4tc_ref` is the plain-torch twin with the same signature (the tests' oracle).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .triton_fused import HAVE_TRITON, _interpret

if HAVE_TRITON:
    import triton
    import triton.language as tl

GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class TcConfig:
    """Launch shape: RT row tiles of 16 per program; each of num_warps warps takes U blocks of
    64 codes per iteration (WT = 128 * num_warps * U words of a row tile per iteration); the
    words of pf iterations ahead are in flight."""
    rt: int = 2
    u: int = 2
    num_warps: int = 4
    pf: int = 1  # word tiles in flight ahead of the one computed (1 or 2)
    stages: int = 0  # > 0: word tiles by TMA through shared memory, this many in flight

    @property
    def wt(self) -> int:
        return 128 * self.num_warps * self.u

    def label(self) -> str:
        return f"rt{self.rt}_u{self.u}_w{self.num_warps}_pf{self.pf}_s{self.stages}"


def supported(group: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Affine 4-bit, group 32/64/128, N a multiple of 16, K a multiple of 512, bf16/fp16."""
    return (group in GROUPS and n % 16 == 0 and k % 512 == 0
            and dtype in (torch.bfloat16, torch.float16))


def default_config(n: int, k: int) -> TcConfig:
    """The H200 sweeps' winners (benchmarks/q4tc_probe.py, docs/perf.md, 8B / 0.6B shapes):
    LM heads 4 (K >= 4096) or 2 row tiles per program, 4 warps, two word tiles in flight;
    other tall matrices (gate_up) 2 row tiles, 4 warps; long rows (K >= 3N: down) 1 row tile,
    8 warps of 2 blocks, the word tiles by TMA 4 stages deep; the rest 1 row tile, 8 warps,
    two tiles in flight. Env MLXR_Q4TC_STAGES=S sets S TMA stages (0: none) for every shape.
    Blocks per iteration (num_warps * u) divide K / 64 (K is a multiple of 512)."""
    if _interpret():  # the interpreter runs programs one by one: few, large ones keep CI fast
        return TcConfig(rt=1 << max(0, min(8, n // 16).bit_length() - 1), u=1, num_warps=4)
    env = os.environ.get("MLXR_Q4TC_STAGES")  # an A/B switch: this many TMA stages for all
    if n >= 65536:
        cfg = TcConfig(rt=4 if k >= 4096 else 2, u=1, num_warps=4, pf=2)
    elif n >= 16384:
        cfg = TcConfig(rt=2, u=1, num_warps=4, pf=1)
    elif k >= 3 * n and (k // 64) % 16 == 0:  # TMA, 4 stages: 8B down 17.0 vs 18.7 us
        cfg = TcConfig(rt=1, u=2, num_warps=8, pf=1, stages=4)
    else:
        cfg = TcConfig(rt=1, u=1, num_warps=8, pf=2)
    return cfg if env is None else dataclasses.replace(cfg, stages=int(env))


# ====================================================================== repack (load time)
def _codes(packed: Tensor) -> Tensor:
    """MLX words [N, K/8] -> codes [N, K] int32 (code k at nibble k % 8 of word k // 8)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.view(torch.int32).unsqueeze(-1) >> shifts) & 15).reshape(packed.shape[0], -1)


def repack(packed: Tensor, chunk_rows: int = 4096) -> Tensor:
    """MLX 4-bit words [N, K/8] -> the lane-ordered words [N/16, 2K] int32 (module docstring).
    Rows go through in slices so an LM head does not need 8x its size of scratch."""
    n, kw = packed.shape
    k = kw * 8
    if n % 16 or k % 64:
        raise ValueError(f"q4tc.repack: N = {n} must be a multiple of 16, K = {k} of 64")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    out = torch.empty(n // 16, 2 * k, dtype=torch.int32, device=packed.device)
    for r in range(0, n, chunk_rows):
        q = _codes(packed[r:r + chunk_rows])
        rt = q.shape[0] // 16
        # [R, h, g, blk, sh, tig, sl, m, hi] -> [R, blk, g, tig, sh, sl | hi, m, h]
        q = q.reshape(rt, 2, 8, k // 64, 2, 4, 2, 2, 2).permute(0, 3, 2, 5, 4, 6, 8, 7, 1)
        q = q.reshape(rt, 2 * k, 8)
        out[r // 16:r // 16 + rt] = (q << shifts).sum(-1, dtype=torch.int32)
    return out


def unrepack(words: Tensor) -> Tensor:
    """Inverse of `repack`: back to MLX words [N, K/8] (tests, reference)."""
    rt, k2 = words.shape
    k = k2 // 2
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    q = (words.unsqueeze(-1) >> shifts) & 15  # [R, 2K, nibble (hi, m, h)]
    q = q.reshape(rt, k // 64, 8, 4, 2, 2, 2, 2, 2).permute(0, 8, 2, 1, 4, 3, 5, 7, 6)
    q = q.reshape(rt * 16, k // 8, 8)  # [N, K/8, 8]: code k at nibble k % 8 of word k // 8
    return (q << shifts).sum(-1, dtype=torch.int32)


# ====================================================================== torch twin (oracle)
def q4tc_ref(x: Tensor, words: Tensor, sb: Tensor, *, group: int, out: Tensor | None = None,
             config: TcConfig | None = None) -> Tensor:
    """y [N] = x @ (s * q + b)^T in fp32, rounded to x.dtype; `words` are `repack`'s output,
    sb = `triton_q4gemv.pair_scales(scales, biases)` [N, K/group, 2]."""
    from .triton_qmm import dequant_f32

    w = dequant_f32(unrepack(words), sb[..., 0], sb[..., 1], None, "affine", 4, group)
    y = (x.reshape(-1).float() @ w.t()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


# ====================================================================== Triton kernel
# The PTX works on per-lane tensors (pack 1): element u of a [RT, WT/4] or [WT/4] tensor is
# lane u % 32 of warp u // 32 % num_warps, which is how Triton lays such tensors out (the word
# tile is loaded 16 bytes per thread as [RT, WT] and split into its 4 steps in registers).
# A pack of 4 elements would depend on which elements Triton puts in one thread, and Triton
# may lay a pure op out twice (seen: the x loads, in [1, 4] and [1, 1] layouts).
#
# _MMA4: one lane's mma chain over a block's 4 steps: $0-3 out (the D fragment: rows g, g + 8
# x columns 2tig, 2tig + 1), $4-7 the words of steps 0-3, $8-11 the masked x (b0 | b1 << 32),
# $12-15 C.
_STEP = """
shr.u32 t0, {w}, 4;
shr.u32 t1, {w}, 8;
shr.u32 t2, {w}, 12;
lop3.b32 a0, {w}, 0x000F000F, {magic}, 0xEA;
lop3.b32 a1, t0, 0x000F000F, {magic}, 0xEA;
lop3.b32 a2, t1, 0x000F000F, {magic}, 0xEA;
lop3.b32 a3, t2, 0x000F000F, {magic}, 0xEA;
mov.b64 {{b0, b1}}, {x};
mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32
  {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};
"""
# _ONES4: the column sums of the masked x over the 4 steps (A = 1): $0-1 out (columns 2tig,
# 2tig + 1), $2-5 x, $6-7 C.
_ONES = """
mov.b64 {{b0, b1}}, ${x};
mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32
  {{$0, $1, z2, z3}}, {{a0, a0, a0, a0}}, {{b0, b1}}, {{$0, $1, z2, z3}};
"""


def _asm_mma4(ty: str) -> str:
    magic = "0x43004300" if ty == "bf16" else "0x64006400"
    body = "".join(_STEP.format(w=f"${4 + s}", x=f"${8 + s}", magic=magic, ty=ty)
                   for s in range(4))
    return ("{\n.reg .b32 t0, t1, t2, a0, a1, a2, a3, b0, b1;\n"
            "mov.f32 $0, $12;\nmov.f32 $1, $13;\nmov.f32 $2, $14;\nmov.f32 $3, $15;\n"
            + body + "}")


def _asm_ones4(ty: str) -> str:
    one = "0x3F803F80" if ty == "bf16" else "0x3C003C00"
    body = "".join(_ONES.format(x=2 + s, ty=ty) for s in range(4))
    return ("{\n.reg .b32 a0, b0, b1;\n.reg .f32 z2, z3;\nmov.b32 a0, %s;\n" % one
            + "mov.f32 $0, $6;\nmov.f32 $1, $7;\nmov.f32 z2, 0f00000000;\nmov.f32 z3, 0f00000000;\n"
            + body + "}")


# a lane's x: 16 bytes at $4 (steps 0, 1) where $6 is set and 16 bytes at $5 (steps 2, 3)
# where $7 is set; zeros elsewhere
_LDX = """{
.reg .pred p, q;
setp.ne.b32 p, $6, 0;
setp.ne.b32 q, $7, 0;
mov.b64 $0, 0;
mov.b64 $1, 0;
mov.b64 $2, 0;
mov.b64 $3, 0;
@p ld.global.nc.v2.b64 {$0, $1}, [$4];
@q ld.global.nc.v2.b64 {$2, $3}, [$5];
}"""
# one 32-bit (scale, bias) pair at $1 where $2 is set, else 0
_LD32 = """{
.reg .pred p;
setp.ne.b32 p, $2, 0;
mov.b32 $0, 0;
@p ld.global.nc.b32 $0, [$1];
}"""

if HAVE_TRITON:
    # the PTX as constexpr globals (a jit function reads no other globals)
    MMA4_BF16 = tl.constexpr(_asm_mma4("bf16"))
    MMA4_F16 = tl.constexpr(_asm_mma4("f16"))
    ONES4_BF16 = tl.constexpr(_asm_ones4("bf16"))
    ONES4_F16 = tl.constexpr(_asm_ones4("f16"))
    LDX = tl.constexpr(_LDX)
    LD32 = tl.constexpr(_LD32)

    @triton.jit
    def _join4(a0, a1, a2, a3):
        """[..., n] x 4 -> [..., n, 4] (interpreter only)."""
        return tl.join(tl.join(a0, a2), tl.join(a1, a3)).reshape(a0.shape + [4])

    @triton.jit
    def _split4(t, NU: tl.constexpr):
        """[..., 4 NU] -> its elements 4u + s for s = 0..3, each [..., NU] (in registers: a
        thread holds 4 consecutive elements)."""
        a, b = tl.split(tl.reshape(t, t.shape[:-1] + [NU, 2, 2]))
        a0, a2 = tl.split(a)
        a1, a3 = tl.split(b)
        return a0, a1, a2, a3

    @triton.jit
    def _half(v, sh: tl.constexpr, F16: tl.constexpr):
        """The 16-bit float at bits [sh, sh + 16) of int64 v, as fp32 (interpreter only)."""
        bits = ((v >> sh) & 0xFFFF).to(tl.int32)
        if F16:
            return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return (bits << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _emu_bx(xm, NS: tl.constexpr, F16: tl.constexpr):
        """Masked x [WT] int64 (lane t = 4 col + tig, step (sh, sl); b0 | b1 << 32, each two
        16-bit values) -> B [NS, 8 (col), 64] in the k order (tig, sh, sl, m, hi)."""
        v = tl.reshape(xm, [NS, 8, 4, 2, 2])
        m0 = tl.join(_half(v, 0, F16), _half(v, 16, F16))  # [.., hi]
        m1 = tl.join(_half(v, 32, F16), _half(v, 48, F16))
        b = tl.permute(tl.join(m0, m1), [0, 1, 2, 3, 4, 6, 5])  # [.., m, hi]
        return tl.reshape(b, [NS, 8, 64])

    @triton.jit
    def _mma4(w0, w1, w2, w3, x0, x1, x2, x3, c0, c1, c2, c3, RT: tl.constexpr,
              NU: tl.constexpr, F16: tl.constexpr, INTERP: tl.constexpr):
        """c + the D fragments of each lane's 4-step mma chain: words w [RT, NU] and masked x
        [NU] per step; returns the 4 fragment values [RT, NU]."""
        if INTERP:
            NS: tl.constexpr = NU // 32
            OFF: tl.constexpr = 1024.0 if F16 else 128.0
            w = tl.reshape(_join4(w0, w1, w2, w3), [RT, 4 * NU])
            sh = tl.arange(0, 8) * 4
            q = ((w[:, :, None] >> sh[None, None, :]) & 15).to(tl.float32) + OFF
            # [RT, NS, g, tig, sh, sl, hi, m, h] -> [RT, NS, g, h, (tig, sh, sl, m, hi)]
            q = tl.reshape(q, [RT, NS, 8, 4, 2, 2, 2, 2, 2])
            q = tl.permute(q, [0, 1, 2, 8, 3, 4, 5, 7, 6])
            a = tl.reshape(q, [RT, NS, 8, 2, 1, 64])
            b = _emu_bx(tl.reshape(_join4(x0, x1, x2, x3), [4 * NU]), NS, F16)
            d = tl.sum(a * b[None, :, None, None, :, :], axis=5)  # [RT, NS, g, h, col]
            d = tl.reshape(d, [RT, NS, 8, 2, 4, 2])  # col = 2tig + e2
            d = tl.permute(d, [0, 1, 2, 4, 3, 5])  # [RT, NS, g, tig, h, e2]
            d0, d1, d2, d3 = _split4(tl.reshape(d, [RT, 4 * NU]), NU)
            return c0 + d0, c1 + d1, c2 + d2, c3 + d3
        else:
            return tl.inline_asm_elementwise(
                MMA4_F16 if F16 else MMA4_BF16, "=f,=f,=f,=f,r,r,r,r,l,l,l,l,f,f,f,f",
                [w0, w1, w2, w3, x0, x1, x2, x3, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _ones4(x0, x1, x2, x3, c0, c1, NU: tl.constexpr, F16: tl.constexpr,
               INTERP: tl.constexpr):
        """c + each lane's sums of the masked x [NU] over the 4 steps, for its columns 2tig
        and 2tig + 1."""
        if INTERP:
            NS: tl.constexpr = NU // 32
            b = _emu_bx(tl.reshape(_join4(x0, x1, x2, x3), [4 * NU]), NS, F16)
            xs = tl.reshape(tl.sum(b, axis=2), [NS, 1, 4, 2])  # col = 2tig + e2, any g
            z = tl.zeros([NS, 8, 4, 2], dtype=tl.float32)
            s0, s1 = tl.split(tl.reshape(z + xs, [NU, 2]))
            return c0 + s0, c1 + s1
        else:
            return tl.inline_asm_elementwise(
                ONES4_F16 if F16 else ONES4_BF16, "=f,=f,l,l,l,l,f,f",
                [x0, x1, x2, x3, c0, c1], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _ldx(x_ptr, xaddr, xo, on0, on1, INTERP: tl.constexpr):
        """A lane's masked x (int64: 4 values) for steps 0-3 at int64 offsets xo, xo + 1 (where
        on0) and xo + 8, xo + 9 (where on1): one 16-byte load per pair on the GPU."""
        if INTERP:
            xi = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + xo
            return (tl.load(xi, mask=on0, other=0), tl.load(xi + 1, mask=on0, other=0),
                    tl.load(xi + 8, mask=on1, other=0), tl.load(xi + 9, mask=on1, other=0))
        else:
            a = xaddr + xo.to(tl.int64) * 8
            return tl.inline_asm_elementwise(
                LDX, "=l,=l,=l,=l,l,l,r,r", [a, a + 64, on0.to(tl.int32), on1.to(tl.int32)],
                dtype=(tl.int64, tl.int64, tl.int64, tl.int64), is_pure=True, pack=1)

    @triton.jit
    def _ld32(p_ptr, paddr, idx, on, INTERP: tl.constexpr):
        """int32 at p + idx where `on`, else 0."""
        if INTERP:
            return tl.load(p_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + idx, mask=on,
                           other=0)
        else:
            return tl.inline_asm_elementwise(
                LD32, "=r,l,r", [paddr + idx.to(tl.int64) * 4, on.to(tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, E: tl.constexpr, NT: tl.constexpr,
            NS: tl.constexpr, CPB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
            INTERP: tl.constexpr):
        """The (scale, bias) pair of fragment value E of every lane for the window starting at
        iteration it0: row 16 rt + g + 8 (E // 2), column 2tig + E % 2, i.e. iteration
        it0 + column // CPB, half column % CPB of its block (0 past K)."""
        col = 2 * tig + E % 2
        itc = it0 + col // CPB
        grp = ((itc * NS + slot) * 64 + (col % CPB) * 32) // GROUP
        row = rt[:, None] * 16 + (lg + 8 * (E // 2))[None, :]
        return _ld32(sb_ptr, sbaddr, row * NG + grp[None, :], rm & (itc < NT)[None, :], INTERP)

    @triton.jit
    def _scaled(sbv, acc, xs, OFF: tl.constexpr, F16: tl.constexpr):
        """s * (acc - OFF * xs) + b * xs for the packed (scale, bias) pairs sbv."""
        if F16:
            s = (sbv & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = (sbv >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            s = (sbv << 16).to(tl.float32, bitcast=True)
            b = (sbv & -65536).to(tl.float32, bitcast=True)
        return s * (acc - OFF * xs[None, :]) + b * xs[None, :]

    @triton.jit
    def _q4tc_kernel(x_ptr, w_ptr, w_desc, sb_ptr, y_ptr, xaddr, sbaddr, NRT,
                     K: tl.constexpr, GROUP: tl.constexpr, RT: tl.constexpr, WT: tl.constexpr,
                     PF: tl.constexpr, STAGES: tl.constexpr, F16: tl.constexpr,
                     INTERP: tl.constexpr):
        """y for row tiles pid * RT .. + RT (16 rows each). STAGES > 0: the word tiles come
        through shared memory by TMA (w_desc over the words as [NRT, 2K / 256, 256]), which
        Triton's pipeliner keeps STAGES deep in flight; else by register loads PF ahead."""
        pid = tl.program_id(0)
        NS: tl.constexpr = WT // 128  # blocks (of 64 codes) per iteration
        NU: tl.constexpr = WT // 4  # lanes x slots
        NT: tl.constexpr = K // 64 // NS  # iterations
        CPB: tl.constexpr = 2 if GROUP == 32 else 1  # mma chains (columns) per block
        W: tl.constexpr = 8 // CPB  # iterations per window of 8 columns
        NG: tl.constexpr = K // GROUP
        OFF: tl.constexpr = 1024.0 if F16 else 128.0
        rt = pid * RT + tl.arange(0, RT)  # row tiles
        u = tl.arange(0, NU)  # lane u % 32 of slot u // 32
        slot = u // 32
        lg = (u // 4) % 8  # lane's g: its B column, and its rows g, g + 8
        tig = u % 4
        rm = (rt < NRT)[:, None]
        wp = w_ptr + rt[:, None] * (2 * K) + tl.arange(0, WT)[None, :]
        # x of (slot, lane, step s): k = 64 blk + 32 (s // 2) + 8 tig + 4 (s % 2), in int64
        # units: xo + (s // 2) * 8 + s % 2 for block 0
        xo = slot * 16 + tig * 2
        # loads run ahead of their use: words PF iterations, x one iteration, the (scale,
        # bias) pairs one window (8 columns)
        if STAGES == 0:
            w = tl.load(wp, mask=rm, other=0, cache_modifier=".cg")
            if PF == 2:
                w1 = tl.load(wp + WT, mask=rm & (1 < NT), other=0, cache_modifier=".cg")
        x0, x1, x2, x3 = _ldx(x_ptr, xaddr, xo, lg == 0, lg == CPB - 1, INTERP)
        sb0 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, 0, 0, NT, NS, CPB, GROUP, NG, INTERP)
        sb1 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, 0, 1, NT, NS, CPB, GROUP, NG, INTERP)
        sb2 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, 0, 2, NT, NS, CPB, GROUP, NG, INTERP)
        sb3 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, 0, 3, NT, NS, CPB, GROUP, NG, INTERP)
        a0 = tl.zeros([RT, NU], dtype=tl.float32)
        a1 = tl.zeros([RT, NU], dtype=tl.float32)
        a2 = tl.zeros([RT, NU], dtype=tl.float32)
        a3 = tl.zeros([RT, NU], dtype=tl.float32)
        s0 = tl.zeros([NU], dtype=tl.float32)
        s1 = tl.zeros([NU], dtype=tl.float32)
        y0 = tl.zeros([RT, NU], dtype=tl.float32)
        y1 = tl.zeros([RT, NU], dtype=tl.float32)
        for it in tl.range(NT, num_stages=max(STAGES, 1)):
            j = it % W  # column (pair, for g32) of this iteration in the window
            if STAGES > 0:  # rows past NRT come back as zeros
                w = tl.reshape(w_desc.load([pid * RT, it * (WT // 256), 0]), [RT, WT])
            else:
                wn = tl.load(wp + (it + PF) * WT, mask=rm & (it + PF < NT), other=0,
                             cache_modifier=".cg")
            jn = ((it + 1) % W) * CPB
            ok = it + 1 < NT
            n0, n1, n2, n3 = _ldx(x_ptr, xaddr, xo + (it + 1) * (NS * 16), (lg == jn) & ok,
                                  (lg == jn + CPB - 1) & ok, INTERP)
            q0, q1, q2, q3 = _split4(w, NU)
            a0, a1, a2, a3 = _mma4(q0, q1, q2, q3, x0, x1, x2, x3, a0, a1, a2, a3, RT, NU,
                                   F16, INTERP)
            s0, s1 = _ones4(x0, x1, x2, x3, s0, s1, NU, F16, INTERP)
            if STAGES == 0:
                if PF == 2:
                    w = w1
                    w1 = wn
                else:
                    w = wn
            x0, x1, x2, x3 = n0, n1, n2, n3
            if (j == W - 1) | (it == NT - 1):  # flush the window's columns
                y0 += _scaled(sb0, a0, s0, OFF, F16) + _scaled(sb1, a1, s1, OFF, F16)  # row g
                y1 += _scaled(sb2, a2, s0, OFF, F16) + _scaled(sb3, a3, s1, OFF, F16)  # g + 8
                a0 = tl.zeros([RT, NU], dtype=tl.float32)
                a1 = tl.zeros([RT, NU], dtype=tl.float32)
                a2 = tl.zeros([RT, NU], dtype=tl.float32)
                a3 = tl.zeros([RT, NU], dtype=tl.float32)
                s0 = tl.zeros([NU], dtype=tl.float32)
                s1 = tl.zeros([NU], dtype=tl.float32)
                sb0 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it + 1, 0, NT, NS, CPB, GROUP,
                          NG, INTERP)
                sb1 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it + 1, 1, NT, NS, CPB, GROUP,
                          NG, INTERP)
                sb2 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it + 1, 2, NT, NS, CPB, GROUP,
                          NG, INTERP)
                sb3 = _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it + 1, 3, NT, NS, CPB, GROUP,
                          NG, INTERP)
        # lane (slot, g, tig): rows 16 rt + g (y0) and + 8 (y1)
        y0 = tl.sum(tl.sum(tl.reshape(y0, [RT, NS, 8, 4]), axis=3), axis=1)  # [RT, 8]
        y1 = tl.sum(tl.sum(tl.reshape(y1, [RT, NS, 8, 4]), axis=3), axis=1)
        y = tl.reshape(tl.permute(tl.join(y0, y1), [0, 2, 1]), [RT * 16])
        rows = pid * RT * 16 + tl.arange(0, RT * 16)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < NRT * 16)


def q4tc(x: Tensor, words: Tensor, sb: Tensor, *, group: int, out: Tensor | None = None,
         config: TcConfig | None = None) -> Tensor:
    """See `q4tc_ref` (same results up to fp32 summation order). x [K] or [1, K] contiguous and
    16-byte aligned; words = `repack(packed)`; sb = `pair_scales(scales, biases)`."""
    xv = x.reshape(-1)
    nrt, k2 = words.shape
    n, k = nrt * 16, k2 // 2
    if xv.shape[0] != k or not supported(group, n, k, x.dtype) or xv.data_ptr() % 16:
        raise ValueError(f"q4tc: x {tuple(x.shape)} ({x.dtype}), words {tuple(words.shape)}, "
                         f"group {group}: x must be [K], 16-byte aligned")
    if sb.shape != (n, k // group, 2) or not sb.is_contiguous() or sb.dtype != x.dtype:
        raise ValueError(f"q4tc: sb {tuple(sb.shape)} {sb.dtype} != {(n, k // group, 2)}")
    if nrt * k2 >= 2**31:
        raise ValueError("q4tc: the weight has >= 2^31 words (int32 offsets)")
    cfg = config or default_config(n, k)
    if (k // 64) % (cfg.wt // 128):
        raise ValueError(f"q4tc: {cfg.wt // 128} blocks per iteration must divide K/64")
    y = out if out is not None else torch.empty(n, dtype=x.dtype, device=x.device)
    desc = None
    stages = 0 if _interpret() else cfg.stages
    if stages:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(words.view(nrt, k2 // 256, 256), [nrt, k2 // 256, 256],
                                [k2, 256, 1], [cfg.rt, cfg.wt // 256, 256])
    _q4tc_kernel[(triton.cdiv(nrt, cfg.rt),)](
        xv, words, desc, sb, y, xv.data_ptr(), sb.data_ptr(), nrt, K=k, GROUP=group,
        RT=cfg.rt, WT=cfg.wt, PF=cfg.pf, STAGES=stages, F16=x.dtype == torch.float16,
        INTERP=_interpret(), num_warps=cfg.num_warps, num_stages=max(stages, 1))
    return y
