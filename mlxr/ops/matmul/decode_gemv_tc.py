"""Batch-1 decode GEMV for MLX affine 4-bit weights on the tensor cores: y[N] = x[K] @ W^T.

Why: `decode_gemv_q4` (one LOP3 + one FFMA per code) is issue-bound on the H200 at 8B shapes:
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
* The mma and the lane loads are PTX (`tl.inline_asm_elementwise`, in `decode_gemv_tc_ptx`
  with their interpreter twins) on per-lane tensors: the word tile is loaded 16 bytes per
  thread and split into its 4 steps in registers, so element u of every operand is lane
  u % 32 whatever layout Triton picks. The GPU tests check the results;
  `benchmarks/gpu/q4tc_probe.py` prints the layouts and the SASS offline.
* Loads run ahead of their use: the words `pf` iterations in registers (or `stages` deep
  through shared memory by TMA), x one iteration, the pairs one window. Measured
  (docs/perf.md): 1-23% faster than q4gemv on the tall, the long and the 4096 x 4096
  matrices (8B gate_up 22.1 vs 26.0 us, LM head 81.6 vs 96.6, down with 16 warps 16.3 vs
  18.8, o 6.1 vs 6.4), slower on the smaller squarish ones, which keep q4gemv
  (`mlxr.quant.cuda.q4tc_preferred`).
* Several rows of x (batched decode, short prompts) share the words: the B columns are rows
  x 8/M group slots. At 2-8 rows it is 1.1-3.0x faster than tinygemm and the fused GEMM at
  the 8B / 0.6B shapes (`mlxr.quant.cuda.q4tc_rows`).
* An MLP's gate_up can run with its gated activation in the epilogue (`act=`): its copy's
  rows interleaved (`glu_rows`: tile t = gate rows 8t.. over up rows 8t..), a lane's rows g
  and g + 8 are one output's gate and up. Same sums and roundings as the GEMV followed by
  `ops.gated_act`, one launch fewer (0.6B decode +4.6%, docs/perf.md).

* mxfp4 / nvfp4 (`fp4=True`, bf16): the copy holds E2M1 codes, each code's bits moved within
  its word at load (`fp4_bits`) so that a fragment register's two values x 2^-126 come out by
  masks and shifts (1-6 per register, `decode_gemv_tc_ptx`) and one exact bf16x2 multiply by
  2^126; the E8M0 / E4M3 scale multiplies each group's sum at the flush (nvfp4's 16-code
  groups: 4 columns per block, a lane's column by its tig), the global scale the fp32 sums,
  and there are no x sums (no bias). Same bytes as the file's codes, at 0.9-1.1x the affine
  kernel's time (docs/perf.md).

* mxfp8 (`fp8=True`, bf16): the copy holds the E4M3 codes (`fp8_words`), 1 B each, so a
  step's 8 codes are two words (the copy's two halves, loaded as two tiles); register A by
  one AND, B by two shifted pieces, then one exact bf16x2 multiply by 2^120, scales as fp4's
  (1.6-1.7x the generic GEMV on the 8B shapes, docs/perf.md).

`q4tc_ref` is the plain-torch twin with the same signature (the tests' oracle); it and the
load-time layouts (`repack`, `glu_rows`) are in `decode_gemv_tc_layout`, the launch policy
(`supported`, `TcConfig`, `default_config`, `max_rows`) in `decode_gemv_tc_config`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..layer.norm_rope_act import ACTS, HAVE_TRITON, _hopper, _interpret, pdl
from .decode_gemv_tc_config import (  # noqa: F401 (API)
    GROUPS, TcConfig, default_config, max_rows, supported)
from .decode_gemv_tc_layout import (  # noqa: F401 (API)
    fp4_bits, fp8_words, glu_order, glu_rows, q4tc_ref, repack, unrepack)

if HAVE_TRITON:
    import triton
    import triton.language as tl

# ====================================================================== Triton kernel
if HAVE_TRITON:
    from ..layer.norm_rope_act import _gated
    from .decode_gemv_tc_ptx import _ld32, _ldx, _mma4, _mma4_fp8, _ones4, _split4

    @triton.jit
    def _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, E: tl.constexpr, NT: tl.constexpr,
            NS: tl.constexpr, CPB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
            GPW: tl.constexpr, INTERP: tl.constexpr):
        """The (scale, bias) pair of fragment value E of every lane for the window starting at
        iteration it0: row 16 rt + g + 8 (E // 2), column 2tig + E % 2, whose group slot
        (column % GPW) is iteration it0 + slot // CPB, part slot % CPB of its block (0 past
        K)."""
        col = 2 * tig + E % 2
        if GPW < 8:  # several rows of x: the column's slot among its row's GPW
            col = col % GPW
        itc = it0 + col // CPB
        grp = ((itc * NS + slot) * 64 + (col % CPB) * (64 // CPB)) // GROUP
        row = rt[:, None] * 16 + (lg + 8 * (E // 2))[None, :]
        return _ld32(sb_ptr, sbaddr, row * NG + grp[None, :], rm & (itc < NT)[None, :], INTERP)

    @triton.jit
    def _sb4(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, NT: tl.constexpr, NS: tl.constexpr,
             CPB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, GPW: tl.constexpr,
             INTERP: tl.constexpr):
        """`_sb` for the 4 fragment values."""
        return (_sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, 0, NT, NS, CPB, GROUP, NG, GPW,
                    INTERP),
                _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, 1, NT, NS, CPB, GROUP, NG, GPW,
                    INTERP),
                _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, 2, NT, NS, CPB, GROUP, NG, GPW,
                    INTERP),
                _sb(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it0, 3, NT, NS, CPB, GROUP, NG, GPW,
                    INTERP))

    @triton.jit
    def _window(RT: tl.constexpr, NU: tl.constexpr):
        """A window's accumulators, zeroed: the 4 fragment values [RT, NU] (group sums of codes
        x x) and the 2 columns' x sums [NU]."""
        a = tl.zeros([RT, NU], dtype=tl.float32)
        s = tl.zeros([NU], dtype=tl.float32)
        return a, a, a, a, s, s

    @triton.jit
    def _scaled(sbv, acc, xs, OFF: tl.constexpr, F16: tl.constexpr, FP4: tl.constexpr):
        """s * (acc - OFF * xs) + b * xs for the packed (scale, bias) pairs sbv; FP4 (bf16):
        s * acc (the sums are of the values themselves, no bias)."""
        if FP4:
            return (sbv << 16).to(tl.float32, bitcast=True) * acc
        if F16:
            s = (sbv & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = (sbv >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            s = (sbv << 16).to(tl.float32, bitcast=True)
            b = (sbv & -65536).to(tl.float32, bitcast=True)
        return s * (acc - OFF * xs[None, :]) + b * xs[None, :]

    @triton.jit
    def _q4tc_kernel(x_ptr, w_ptr, w_desc, sb_ptr, y_ptr, xaddr, sbaddr, NRT, gs,
                     K: tl.constexpr, GROUP: tl.constexpr, RT: tl.constexpr, WT: tl.constexpr,
                     PF: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
                     M: tl.constexpr, ACT: tl.constexpr, P: tl.constexpr,
                     F16: tl.constexpr, GDC: tl.constexpr, INTERP: tl.constexpr,
                     FP4: tl.constexpr, HAS_GS: tl.constexpr, FP8: tl.constexpr):
        """y [M, N] for row tiles pid * RT .. + RT (16 rows each) of x [M, K] (M = 1, 2, 4, 8:
        the B columns are M rows of x x GPW = 8 / M group slots, so a window holds GPW
        slots). STAGES > 0: the word tiles come through shared memory by TMA (w_desc over the
        words as [NRT, 2K / 256, 256]), which Triton's pipeliner keeps STAGES deep in flight;
        else by register loads PF ahead. GDC: launched with PDL (`norm_rope_act.pdl`; register
        loads only). ACT >= 0 (`ACTS`): the rows are a glu copy (`glu_rows`) and y [M, N / 2]
        is act(gate) * up of each lane's rows g (gate) and g + 8 (up). P planes
        (`mlxr.quant.affine.planes`): K is P x x's length, x is read P times over. FP4: the
        words are E2M1 codes (`fp4_bits`, bf16): no x sums, y = s * sum(value * x), times
        the fp32 global scale gs if HAS_GS (nvfp4). Group 16 (nvfp4): 4 columns per block;
        a lane's x of steps (0, 1) is codes 8 tig .. + 7 of the block, i.e. 16-group tig // 2,
        so its column mask depends on tig (for 32 / 64 / 128 it does not). FP8: the words
        are an fp8 copy (`fp8_words`, 4K words per row tile: each iteration's tile from both
        halves), y = s * sum(value * x) as for FP4."""
        pid = tl.program_id(0)
        NS: tl.constexpr = WT // 128  # blocks (of 64 codes) per iteration
        NU: tl.constexpr = WT // 4  # lanes x slots
        NT: tl.constexpr = K // 64 // NS  # iterations
        NTP: tl.constexpr = NT // P  # iterations per plane (x's period)
        CPB: tl.constexpr = 64 // GROUP if GROUP < 64 else 1  # columns per block
        GPW: tl.constexpr = 8 // M  # group slots (columns) per row of x in a window
        W: tl.constexpr = GPW // CPB  # iterations per window
        NG: tl.constexpr = K // GROUP
        OFF: tl.constexpr = 1024.0 if F16 else 128.0
        FPV: tl.constexpr = FP4 or FP8  # float codes: y = s * sum, no x sums
        KW: tl.constexpr = 4 * K if FP8 else 2 * K  # words per row tile
        rt = pid * RT + tl.arange(0, RT)  # row tiles
        u = tl.arange(0, NU)  # lane u % 32 of slot u // 32
        slot = u // 32
        lg = (u // 4) % 8  # lane's g: its B column, and its rows g, g + 8
        tig = u % 4
        rm = (rt < NRT)[:, None]
        wp = w_ptr + rt[:, None] * KW + tl.arange(0, WT)[None, :]
        vp = wp + 2 * K  # FP8: the second half's words (registers 2, 3)
        # x of (slot, lane, step s): k = 64 blk + 32 (s // 2) + 8 tig + 4 (s % 2), in int64
        # units: xo + (s // 2) * 8 + s % 2 for block 0
        xo = slot * 16 + tig * 2
        if M == 1:
            ls = lg  # the lane's column is its group slot
        else:  # column lg: row lg // GPW of x, slot lg % GPW
            ls = lg % GPW
            xo += (lg // GPW) * (K // P // 4)
        # the column of a block's first group that carries a lane's x for steps (0, 1) is
        # jn + t2, for steps (2, 3) jn + CPB // 2 + t2 (jn: the block's first column)
        if CPB == 4:
            t2 = tig // 2
        else:
            t2 = 0
        # loads run ahead of their use: words PF iterations, x one iteration, the (scale,
        # bias) pairs one window (8 columns)
        if STAGES == 0:
            w = tl.load(wp, mask=rm, other=0, cache_modifier=".cg")
            if PF == 2:
                w1 = tl.load(wp + WT, mask=rm & (1 < NT), other=0, cache_modifier=".cg")
            if FP8:
                v = tl.load(vp, mask=rm, other=0, cache_modifier=".cg")
                if PF == 2:
                    v1 = tl.load(vp + WT, mask=rm & (1 < NT), other=0, cache_modifier=".cg")
        sb0, sb1, sb2, sb3 = _sb4(sb_ptr, sbaddr, rt, lg, tig, slot, rm, 0, NT, NS, CPB,
                                  GROUP, NG, GPW, INTERP)
        if GDC:  # launched early (PDL): the weights above stream in while the previous grid
            # finishes; x and the output are touched only after it completed
            tl.extra.cuda.gdc_wait()
        x0, x1, x2, x3 = _ldx(x_ptr, xaddr, xo, ls == t2, ls == CPB // 2 + t2, INTERP, GDC)
        a0, a1, a2, a3, s0, s1 = _window(RT, NU)
        y0 = tl.zeros([RT, NU], dtype=tl.float32)
        y1 = tl.zeros([RT, NU], dtype=tl.float32)
        if M == 8:  # a lane's two columns are two rows of x: apart
            y2 = tl.zeros([RT, NU], dtype=tl.float32)
            y3 = tl.zeros([RT, NU], dtype=tl.float32)
        for it in tl.range(NT, num_stages=max(STAGES, 1), loop_unroll_factor=UNROLL):
            j = it % W  # column (pair, for g32) of this iteration in the window
            if STAGES > 0:  # rows past NRT come back as zeros
                w = tl.reshape(w_desc.load([pid * RT, it * (WT // 256), 0]), [RT, WT])
            else:
                wn = tl.load(wp + (it + PF) * WT, mask=rm & (it + PF < NT), other=0,
                             cache_modifier=".cg")
                if FP8:
                    vn = tl.load(vp + (it + PF) * WT, mask=rm & (it + PF < NT), other=0,
                                 cache_modifier=".cg")
            jn = ((it + 1) % W) * CPB
            ok = it + 1 < NT
            itx = it + 1 if P == 1 else (it + 1) % NTP  # x's block of the next iteration
            n0, n1, n2, n3 = _ldx(x_ptr, xaddr, xo + itx * (NS * 16), (ls == jn + t2) & ok,
                                  (ls == jn + CPB // 2 + t2) & ok, INTERP, GDC)
            q0, q1, q2, q3 = _split4(w, NU)
            if FP8:
                r0, r1, r2, r3 = _split4(v, NU)
                a0, a1, a2, a3 = _mma4_fp8(q0, q1, q2, q3, r0, r1, r2, r3, x0, x1, x2, x3,
                                           a0, a1, a2, a3, RT, NU, INTERP)
            else:
                a0, a1, a2, a3 = _mma4(q0, q1, q2, q3, x0, x1, x2, x3, a0, a1, a2, a3, RT,
                                       NU, F16, INTERP, FP4)
            if not FPV:
                s0, s1 = _ones4(x0, x1, x2, x3, s0, s1, NU, F16, INTERP)
            if STAGES == 0:
                if PF == 2:
                    w, w1 = w1, wn
                    if FP8:
                        v, v1 = v1, vn
                else:
                    w = wn
                    if FP8:
                        v = vn
            x0, x1, x2, x3 = n0, n1, n2, n3
            if (j == W - 1) | (it == NT - 1):  # flush the window's columns
                if M == 8:
                    y0 += _scaled(sb0, a0, s0, OFF, F16, FPV)  # row g, x row 2tig
                    y2 += _scaled(sb1, a1, s1, OFF, F16, FPV)  # row g, x row 2tig + 1
                    y1 += _scaled(sb2, a2, s0, OFF, F16, FPV)  # row g + 8
                    y3 += _scaled(sb3, a3, s1, OFF, F16, FPV)
                else:  # row g (y0), g + 8 (y1); both columns belong to x row 2tig // GPW
                    y0 += (_scaled(sb0, a0, s0, OFF, F16, FPV)
                           + _scaled(sb1, a1, s1, OFF, F16, FPV))
                    y1 += (_scaled(sb2, a2, s0, OFF, F16, FPV)
                           + _scaled(sb3, a3, s1, OFF, F16, FPV))
                a0, a1, a2, a3, s0, s1 = _window(RT, NU)
                sb0, sb1, sb2, sb3 = _sb4(sb_ptr, sbaddr, rt, lg, tig, slot, rm, it + 1, NT, NS,
                                          CPB, GROUP, NG, GPW, INTERP)
        if HAS_GS:
            y0 = y0 * gs
            y1 = y1 * gs
            if M == 8:
                y2 = y2 * gs
                y3 = y3 * gs
        # lane (slot, g, tig): rows 16 rt + g (y0) and + 8 (y1), x row (2tig + e2) // GPW
        dt = y_ptr.dtype.element_ty
        if M == 1:
            y0 = tl.sum(tl.sum(tl.reshape(y0, [RT, NS, 8, 4]), axis=3), axis=1)  # [RT, 8]
            y1 = tl.sum(tl.sum(tl.reshape(y1, [RT, NS, 8, 4]), axis=3), axis=1)
            if ACT >= 0:  # output 8 rt + g: rounded as the GEMV, then `gated_act`, round
                y = _gated(y0.to(dt).to(tl.float32), y1.to(dt).to(tl.float32), ACT, dt)
                y = tl.reshape(y, [RT * 8])
                rows = pid * RT * 8 + tl.arange(0, RT * 8)
                tl.store(y_ptr + rows, y.to(dt), mask=rows < NRT * 8)
            else:
                y = tl.reshape(tl.permute(tl.join(y0, y1), [0, 2, 1]), [RT * 16])
                rows = pid * RT * 16 + tl.arange(0, RT * 16)
                tl.store(y_ptr + rows, y.to(dt), mask=rows < NRT * 16)
        else:
            if M == 8:  # x row 2tig + e2
                y0 = tl.reshape(tl.join(y0, y2), [RT, NS, 8, 8, 1])
                y1 = tl.reshape(tl.join(y1, y3), [RT, NS, 8, 8, 1])
            else:  # x row tig // (4 / M)
                y0 = tl.reshape(y0, [RT, NS, 8, M, 4 // M])
                y1 = tl.reshape(y1, [RT, NS, 8, M, 4 // M])
            y0 = tl.sum(tl.sum(y0, axis=4), axis=1)  # [RT, 8 (g), M]
            y1 = tl.sum(tl.sum(y1, axis=4), axis=1)
            mi = tl.arange(0, M)[:, None]
            if ACT >= 0:
                y = _gated(y0.to(dt).to(tl.float32), y1.to(dt).to(tl.float32), ACT, dt)
                y = tl.reshape(tl.permute(y, [2, 0, 1]), [M, RT * 8])
                rows = pid * RT * 8 + tl.arange(0, RT * 8)
                tl.store(y_ptr + mi * (NRT * 8) + rows[None, :], y.to(dt),
                         mask=(rows < NRT * 8)[None, :])
            else:
                y = tl.reshape(tl.permute(tl.join(y0, y1), [2, 0, 3, 1]), [M, RT * 16])
                rows = pid * RT * 16 + tl.arange(0, RT * 16)
                tl.store(y_ptr + mi * (NRT * 16) + rows[None, :], y.to(dt),
                         mask=(rows < NRT * 16)[None, :])


def q4tc(x: Tensor, words: Tensor, sb: Tensor, *, group: int, out: Tensor | None = None,
         config: TcConfig | None = None, act: str | None = None, planes: int = 1,
         fp4: bool = False, gs: float | None = None, fp8: bool = False) -> Tensor:
    """See `q4tc_ref` (same results up to fp32 summation order). x [K] or [M, K], contiguous
    and 16-byte aligned (one launch per `max_rows` rows; a launch's rows are padded to 2, 4
    or 8); words = `repack(packed)`; sb = `pair_scales(scales, biases)`. Returns [N] for one
    row, else [M, N] (or writes `out` of that shape). act: words and sb are a glu copy
    (`glu_rows`), and the result is act(gate) * up, [F] or [M, F] (F = N / 2), in the same
    launch: the same GEMV sums, rounded, then `ops.gated_act`'s arithmetic. planes (1 or 2):
    words and sb hold the nibble planes of another affine width
    (`mlxr.quant.affine.planes`) over K = planes x x's length, x read once per plane. fp4:
    words are `fp4_bits(repack(packed))` of mxfp4's / nvfp4's E2M1 codes and sb pairs each
    group's scale (bf16) with an unused bias; bf16 x, one plane; gs: nvfp4's global scale (a
    Python float: it is a launch argument, so graph capture reads no device value). fp8:
    words are `fp8_words` of mxfp8's E4M3 codes ([N/16, 4K]), sb as for fp4."""
    nrt, k2 = words.shape
    n, k = nrt * 16, k2 // (4 if fp8 else 2)
    if (planes not in (1, 2) or ((fp4 or fp8) and (planes != 1 or x.dtype != torch.bfloat16))
            or (gs is not None and not fp4) or (fp4 and fp8)):
        raise ValueError(f"q4tc: planes = {planes} (1 or 2; fp4 / fp8: 1 and bf16 x), "
                         f"{x.dtype}, global scale {gs} (fp4 only), fp4 {fp4} / fp8 {fp8}")
    kx = k // planes  # x's length
    xm = x.reshape(-1, kx) if x.dim() <= 2 and x.shape[-1] == kx else None
    if (xm is None or not supported(group, n, kx, x.dtype, fp4, fp8) or not xm.is_contiguous()
            or xm.data_ptr() % 16 or kx * planes != k):
        raise ValueError(f"q4tc: x {tuple(x.shape)} ({x.dtype}), words {tuple(words.shape)}, "
                         f"group {group}: x must be [K] or [M, K], contiguous, 16-byte aligned")
    if sb.shape != (n, k // group, 2) or not sb.is_contiguous() or sb.dtype != x.dtype:
        raise ValueError(f"q4tc: sb {tuple(sb.shape)} {sb.dtype} != {(n, k // group, 2)}")
    if nrt * k2 >= 2**31:  # (fp8: k2 = 4K)
        raise ValueError("q4tc: the weight has >= 2^31 words (int32 offsets)")
    if act is not None and act not in ACTS:
        raise ValueError(f"q4tc: unknown activation {act!r}")
    m = xm.shape[0]
    cfg = config or default_config(n, k, m, fp8)
    while config is None and (kx // 64) % (cfg.wt // 128) and cfg.num_warps > 1:
        cfg = dataclasses.replace(cfg, num_warps=cfg.num_warps // 2)  # planes of odd K/512
    if (kx // 64) % (cfg.wt // 128):  # (an iteration stays inside one plane)
        raise ValueError(f"q4tc: {cfg.wt // 128} blocks per iteration must divide K/64")
    n_out = n if act is None else n // 2
    shape = (n_out,) if m == 1 else (m, n_out)
    if out is not None and out.shape != shape:
        raise ValueError(f"q4tc: out {tuple(out.shape)} != {shape}")
    if m > max_rows(group):  # launches of max_rows rows (K * 2 bytes apart: still aligned)
        y = out if out is not None else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
        for i in range(0, m, max_rows(group)):
            part = y[i:i + max_rows(group)]
            q4tc(xm[i:i + max_rows(group)], words, sb, group=group, config=config, act=act,
                 out=part.view(n_out) if part.shape[0] == 1 else part, planes=planes, fp4=fp4,
                 gs=gs, fp8=fp8)
        return y
    mp = 1 << (m - 1).bit_length()  # the kernel's 1, 2, 4 or 8 rows: pad with zero rows
    if mp != m:
        xm = torch.cat([xm, xm.new_zeros(mp - m, kx)])
    y = out if out is not None and mp == m else torch.empty(mp, n_out, dtype=x.dtype,
                                                            device=x.device)
    desc = None  # TMA needs Hopper: elsewhere the same sums come by register loads
    stages = 0 if fp8 or _interpret() or not _hopper(x.device.index or 0) else cfg.stages
    if stages:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(words.view(nrt, k2 // 256, 256), [nrt, k2 // 256, 256],
                                [k2, 256, 1], [cfg.rt, cfg.wt // 256, 256])
    gdc = not stages and pdl(x.device)  # opt-in MLXR_PDL=1: the word tiles before the wait
    _q4tc_kernel[(triton.cdiv(nrt, cfg.rt),)](
        xm, words, desc, sb, y, xm.data_ptr(), sb.data_ptr(), nrt, 1.0 if gs is None else gs,
        K=k, GROUP=group,
        RT=cfg.rt, WT=cfg.wt, PF=cfg.pf, STAGES=stages, UNROLL=cfg.unroll, M=mp,
        ACT=-1 if act is None else ACTS[act], P=planes, F16=x.dtype == torch.float16, GDC=gdc,
        INTERP=_interpret(), FP4=fp4, HAS_GS=gs is not None, FP8=fp8, num_warps=cfg.num_warps,
        num_stages=max(stages, 1),
        **({"launch_pdl": True} if gdc else {}),
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not _interpret() else {}))
    if mp != m:
        y = y[:m]
        if out is not None:
            return out.copy_(y)
    return y.view(shape)
