"""Triton decode GEMV (M <= 16) over MLX packed weights: y[M, N] = x[M, K] @ W[N, K]^T.

Same operands and numerics as `generic_qmm.qgemv` (torch twin: `generic_qmm.qgemv_ref`): int32
words w [N, K*bits/32] exactly as the file stores them, scales/biases [N, K/G], optional nvfp4
global scale; fp32 products and sums. What differs is the cost per weight element, which is
what bounds batch-1 decode once the loads are wide enough (docs/perf.md):

* Tile = [BLOCK_N rows, GT groups, UPG units] (a unit = PER codes filling UW whole words, see
  `codes.unit_codes`; UPG = GROUP/PER units per group). For 2/4/8-bit a row's tile words
  are one contiguous run, so the [BLOCK_N, GT, UPG] word load is 16-byte vectors per thread.
* Affine codes become floats with ONE logic op: a code at bits [SH, SH+BITS) of its word, with
  SH + BITS <= 23, is masked in place and OR'ed with the fp32 exponent of 2^(23-SH); the float is
  then exactly 2^(23-SH) + q, and one subtraction of that constant gives q. Codes above bit 22
  take the same path from `word >> 9` (one shift shared by all of them); only codes that
  straddle two words (3/5/6-bit) pay shift/or. (The old kernel shifted every code down first.)
* Scale and bias once per group: sum_k (s q_k + b) x_k = s * dot(q, x_g) + b * sum(x_g); the
  x group sums come from the same x loads as the products.
* x[m, u*PER + c] is loaded per code position c as a [MP, GT, UPG] tile (L1 hits), reused by
  every row a thread holds: more rows per thread (BLOCK_N / num_warps) means fewer x loads.
* PREFETCH=1 issues the next tile's word loads before the current tile's arithmetic (register
  double buffering), so each program keeps two tiles of bytes in flight without relying on the
  compiler's software pipelining (num_stages).
* Split-K (SPLIT_K programs per row block) writes fp32 partials [SPLIT_K, M, N] that one small
  kernel (`prefill_gemm`'s) sums in a fixed order (deterministic, CUDA-graph capturable,
  no zeroing launch).

fp modes decode each extracted code with `codes._code_value` (table-free fp16 bit tricks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .codes import HAVE_TRITON, MODES, unit_codes
from .generic_qmm import _check, _next_pow2, _sm_count, qgemv_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codes import _code_value, _group_scale, _pick
    from .generic_qmm import _interpret
    from .prefill_gemm import _sum_splits_kernel

__all__ = ["MAX_M", "GemvConfig", "default_config", "qgemv", "qgemv_ref"]

MAX_M = 16


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: BLOCK_N rows x GT groups per tile, SPLIT_K programs along K."""
    block_n: int = 16
    gt: int = 8
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    prefetch: int = 1

    def label(self) -> str:
        return (f"bn{self.block_n}_gt{self.gt}_w{self.num_warps}_s{self.num_stages}"
                f"_k{self.split_k}_p{self.prefetch}")


def default_config(m: int, n: int, k: int, bits: int, group: int,
                   sm_count: int = 132) -> GemvConfig:
    """A reasonable launch before measurement: ~256 words of a row per tile (1 KiB, 16-byte
    vectors over 64 threads), 4 rows per thread at M = 1 (fewer as M grows: the accumulators
    scale with M), and split-K as `fill_split` decides."""
    block_n = 16 if m <= 2 else (8 if m <= 4 else 4)
    return fill_split(GemvConfig(block_n=block_n), n, k, bits, group,
                      256 if m <= 8 else 128, sm_count)


def fill_split(cfg: GemvConfig, n: int, k: int, bits: int, group: int, tile_words: int,
               sm_count: int = 132) -> GemvConfig:
    """`cfg` with GT set to ~tile_words words of a row per tile and split-K doubled (halving the
    tile when a row has too few tiles to split) until there are >= 4 programs per SM."""
    per = unit_codes(bits)
    gw = group // per * (per * bits // 32)  # words per group
    ng = k // group
    gt = max(1, min(_next_pow2(ng), _prev_pow2(max(1, tile_words // gw))))
    rows = -(-n // cfg.block_n)
    split = 1
    while rows * split < 4 * sm_count and split < 16:
        if -(-ng // gt) >= 2 * split:
            split *= 2
        elif gt > 1 and gt * gw > 64:
            gt //= 2
        else:
            break
    return replace(cfg, gt=gt, split_k=split)


def _prev_pow2(v: int) -> int:
    return 1 << (v.bit_length() - 1)


# ====================================================================== Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _ld(p, mask, MASKED: tl.constexpr):
        if MASKED:
            r = tl.load(p, mask=mask, other=0)
        else:
            r = tl.load(p)
        return r

    @triton.jit
    def _words(wp, mask, UW: tl.constexpr, MASKED: tl.constexpr):
        """The UW consecutive words of each unit (w1..w4 alias w0 when unused)."""
        w0 = _ld(wp, mask, MASKED)
        w1 = w0
        w2 = w0
        w3 = w0
        w4 = w0
        if UW > 1:
            w1 = _ld(wp + 1, mask, MASKED)
            w2 = _ld(wp + 2, mask, MASKED)
        if UW > 3:
            w3 = _ld(wp + 3, mask, MASKED)
            w4 = _ld(wp + 4, mask, MASKED)
        return w0, w1, w2, w3, w4

    @triton.jit
    def _value(w0, w1, w2, w3, w4, C: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr):
        """fp32 value of code C (static) of each unit: affine q exactly; fp modes as
        `_code_value` (value / 2^14 or / 2^8, the power folded into the group scale)."""
        O: tl.constexpr = C * BITS
        SH: tl.constexpr = O % 32
        MASK: tl.constexpr = (1 << BITS) - 1
        lo = _pick(w0, w1, w2, w3, w4, O // 32)
        if SH + BITS > 32:  # straddles two words
            LOW: tl.constexpr = 32 - SH
            hi = _pick(w0, w1, w2, w3, w4, O // 32 + 1)
            q = ((lo >> SH) & ((1 << LOW) - 1)) | ((hi << LOW) & MASK)
            v = _code_value(q, MODE)
        elif MODE == 0:
            # in-place field of an fp32 mantissa: bits(field | exp(2^E)) = 2^E + q, E = 23 - P
            P: tl.constexpr = SH if SH + BITS <= 23 else SH - 9
            E: tl.constexpr = 23 - P
            src = lo if SH + BITS <= 23 else lo >> 9
            f = (src & (MASK << P)) | ((127 + E) << 23)
            v = f.to(tl.float32, bitcast=True) - (1 << E)
        else:
            v = _code_value((lo >> SH) & MASK, MODE)
        return v

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, y_ptr, M, N, stride_xm, stride_ym, stride_ys,
        K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
        HAS_GS: tl.constexpr, MP: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_N: tl.constexpr, GT: tl.constexpr, PREFETCH: tl.constexpr,
        EVEN_N: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        PER: tl.constexpr = 32 // BITS if BITS == 2 or BITS == 4 or BITS == 8 else (
            16 if BITS == 6 else 32)
        UW: tl.constexpr = PER * BITS // 32  # words per unit
        UPG: tl.constexpr = GROUP // PER  # units per group
        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        NT: tl.constexpr = (NG + GT - 1) // GT  # tiles per row
        TPS: tl.constexpr = (NT + SPLIT_K - 1) // SPLIT_K  # tiles per split
        EVEN_K: tl.constexpr = TPS * SPLIT_K * GT == NG

        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rg = tl.arange(0, GT)
        rm = tl.arange(0, MP)
        mmask = rm < M
        u2 = rg[:, None] * UPG + tl.arange(0, UPG)[None, :]  # unit in tile [GT, UPG]
        wrow = w_ptr + rn[:, None, None].to(tl.int64) * KWORDS + u2[None, :, :] * UW
        srow = rn[:, None].to(tl.int64) * NG + rg[None, :]  # [BLOCK_N, GT]
        xrow = x_ptr + rm[:, None, None] * stride_xm + u2[None, :, :] * PER  # [MP, GT, UPG]
        nmask3 = rn[:, None, None] < N
        gs = 1.0
        if HAS_GS:
            gs = tl.load(gs_ptr).to(tl.float32) / 2688.0

        MASKED: tl.constexpr = not (EVEN_N and EVEN_K)
        if PREFETCH:  # tile 0 of this split; the loop loads tile t+1 before using tile t
            g_first = pid_k * TPS * GT
            m_first = nmask3 & ((g_first + rg) < NG)[None, :, None]
            nw0, nw1, nw2, nw3, nw4 = _words(wrow + g_first * UPG * UW, m_first, UW, True)
        acc = tl.zeros([MP, BLOCK_N, GT], dtype=tl.float32)
        for t in range(TPS):
            g0 = (pid_k * TPS + t) * GT
            gmask = (g0 + rg) < NG  # [GT]
            if PREFETCH:
                w0, w1, w2, w3, w4 = nw0, nw1, nw2, nw3, nw4
                pmask = nmask3 & ((g0 + GT + rg) < NG)[None, :, None] & (t + 1 < TPS)
                nw0, nw1, nw2, nw3, nw4 = _words(wrow + (g0 + GT) * UPG * UW, pmask, UW, True)
            else:
                w0, w1, w2, w3, w4 = _words(wrow + g0 * UPG * UW,
                                            nmask3 & gmask[None, :, None], UW, MASKED)
            smask = (rn[:, None] < N) & gmask[None, :]
            sc = _group_scale(tl.load(s_ptr + srow + g0, mask=smask, other=0), gs, MODE)
            xmask = mmask[:, None, None] & gmask[None, :, None]
            xp = xrow + g0 * GROUP
            p = tl.zeros([MP, BLOCK_N, GT, UPG], dtype=tl.float32)
            xs = tl.zeros([MP, GT, UPG], dtype=tl.float32)
            for c in tl.static_range(PER):
                v = _value(w0, w1, w2, w3, w4, c, BITS, MODE)  # [BLOCK_N, GT, UPG]
                xc = tl.load(xp + c, mask=xmask, other=0.0).to(tl.float32)
                p += xc[:, None, :, :] * v[None, :, :, :]
                if MODE == 0:
                    xs += xc
            acc += tl.sum(p, axis=3) * sc[None, :, :]
            if MODE == 0:
                bb = tl.load(b_ptr + srow + g0, mask=smask, other=0.0).to(tl.float32)
                acc += bb[None, :, :] * tl.sum(xs, axis=2)[:, None, :]
        out = tl.sum(acc, axis=2)  # [MP, BLOCK_N]
        yp = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]
        tl.store(yp, out, mask=mmask[:, None] & (rn < N)[None, :])


# ====================================================================== launcher
def qgemv(x: Tensor, w: Tensor, s: Tensor, b: Tensor | None, gs: Tensor | None, *, mode: str,
          bits: int, group: int, out_dtype: torch.dtype | None = None,
          config: GemvConfig | None = None) -> Tensor:
    """y [M, N] = x [M, K] @ W^T (M <= 16); w int32/uint32 [N, K*bits/32]; scales/biases
    [N, K/group]; gs: nvfp4 global scale (0-d fp32) or None. Output dtype: out_dtype or
    x.dtype. `config` defaults to `default_config` for this shape."""
    m, k = _check(x, w, s, mode, bits, group)
    if m > MAX_M:
        raise ValueError(f"decode_gemv.qgemv serves M <= {MAX_M}, got M = {m}")
    n = w.shape[0]
    x = x.contiguous()
    w = w.view(torch.int32) if w.dtype == torch.uint32 else w
    cfg = config or default_config(m, n, k, bits, group, _sm_count(x.device))
    odt = out_dtype or x.dtype
    split = cfg.split_k
    if split == 1:
        y = torch.empty(m, n, device=x.device, dtype=odt)
    else:
        y = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg.block_n), split)
    _gemv_kernel[grid](
        x, w, s, b if b is not None else s, gs if gs is not None else s, y, m, n, x.stride(0),
        n, m * n, K=k, BITS=bits, GROUP=group, MODE=MODES[mode], HAS_GS=gs is not None,
        MP=_next_pow2(max(m, 1)), SPLIT_K=split, BLOCK_N=cfg.block_n, GT=cfg.gt,
        PREFETCH=cfg.prefetch, EVEN_N=n % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split == 1:
        return y
    out = torch.empty(m, n, device=x.device, dtype=odt)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](y, out, m * n, SPLIT_K=split, BLOCK=block,
                                                     INTERPRET=_interpret(), num_warps=4)
    return out
