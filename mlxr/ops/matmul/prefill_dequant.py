"""Dequantization of MLX affine weights (2/3/4/5/6/8-bit) and of the fp modes (mxfp4, nvfp4,
mxfp8: `dequant_fp`) to a dense [N, K] matrix on the GPU: the prefill path's first pass
(`mlxr.quant.cuda.dequantize`, then cuBLAS).

Bit-identical to `mlxr.quant.dequantize` in fp32, cast to the output dtype (round to nearest
even): w = s*q + b in fp32, rounded once (`weight_tiles._affine_tile`, the tile math the fused
GEMM feeds tl.dot). 2/4/8-bit: one 2-D word load per [BLOCK_N, BLOCK_K] tile, scales per group,
contiguous 16-byte stores. 3/5/6-bit codes straddle words: the row is cut into units of 32
codes (3 or 5 words) or 16 6-bit codes (3 words), a thread loads a unit's words and extracts
every code with static shifts (`codes._unit_code`), and `tl.join` lays the codes out in
order in its registers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .generic_qmm import HAVE_TRITON, _interpret
from .prefill_gemm import _validate

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codes import MODES, _code_value, _group_scale, _unit_code
    from .weight_tiles import _affine_tile, _copy_orig, _copy_tile, _round

__all__ = ["DEQUANT_BITS", "dequant_affine", "dequant_copy", "dequant_fp"]

DEQUANT_BITS = (2, 3, 4, 5, 6, 8)

if HAVE_TRITON:

    @triton.jit
    def _codes1(w0, w1, w2, w3, w4, BITS: tl.constexpr, C0: tl.constexpr, S: tl.constexpr):
        """fp32 codes C0, C0+S of each unit as [..., 2] (the words w0..w4 of `_unit_code`)."""
        return tl.join(_code_value(_unit_code(w0, w1, w2, w3, w4, C0, BITS), 0),
                       _code_value(_unit_code(w0, w1, w2, w3, w4, C0 + S, BITS), 0))

    # _codesL(C0, S) = codes C0 + i*S, i < 2^L, as [..., 2, ..., 2] (L dims): the even codes
    # joined with the odd ones, so the LAST dim is the lowest bit of i and a row-major reshape
    # of the L dims lists the codes in order. Every code has static shifts; join keeps them in
    # the thread (no data movement).
    @triton.jit
    def _codes2(w0, w1, w2, w3, w4, BITS: tl.constexpr, C0: tl.constexpr, S: tl.constexpr):
        return tl.join(_codes1(w0, w1, w2, w3, w4, BITS, C0, 2 * S),
                       _codes1(w0, w1, w2, w3, w4, BITS, C0 + S, 2 * S))

    @triton.jit
    def _codes3(w0, w1, w2, w3, w4, BITS: tl.constexpr, C0: tl.constexpr, S: tl.constexpr):
        return tl.join(_codes2(w0, w1, w2, w3, w4, BITS, C0, 2 * S),
                       _codes2(w0, w1, w2, w3, w4, BITS, C0 + S, 2 * S))

    @triton.jit
    def _codes4(w0, w1, w2, w3, w4, BITS: tl.constexpr, C0: tl.constexpr, S: tl.constexpr):
        return tl.join(_codes3(w0, w1, w2, w3, w4, BITS, C0, 2 * S),
                       _codes3(w0, w1, w2, w3, w4, BITS, C0 + S, 2 * S))

    @triton.jit
    def _codes5(w0, w1, w2, w3, w4, BITS: tl.constexpr, C0: tl.constexpr, S: tl.constexpr):
        return tl.join(_codes4(w0, w1, w2, w3, w4, BITS, C0, 2 * S),
                       _codes4(w0, w1, w2, w3, w4, BITS, C0 + S, 2 * S))

    @triton.jit
    def _unit_words(wp, mask, UW: tl.constexpr, MASKED: tl.constexpr):
        """The UW (3 or 5) consecutive words of each unit at wp (w3, w4 alias w0 when UW = 3)."""
        if MASKED:
            w0 = tl.load(wp, mask=mask, other=0)
            w1 = tl.load(wp + 1, mask=mask, other=0)
            w2 = tl.load(wp + 2, mask=mask, other=0)
        else:
            w0 = tl.load(wp)
            w1 = tl.load(wp + 1)
            w2 = tl.load(wp + 2)
        w3 = w0
        w4 = w0
        if UW == 5:
            if MASKED:
                w3 = tl.load(wp + 3, mask=mask, other=0)
                w4 = tl.load(wp + 4, mask=mask, other=0)
            else:
                w3 = tl.load(wp + 3)
                w4 = tl.load(wp + 4)
        return w0, w1, w2, w3, w4

    @triton.jit
    def _dequant_units(w_ptr, s_ptr, b_ptr, out_ptr, N, K: tl.constexpr, BITS: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN: tl.constexpr, EXACT_ROUND: tl.constexpr):
        """`_dequant_kernel`'s tile for 3/5/6-bit, whose codes straddle words: each row is cut
        into units of PER codes filling UW whole words (32 codes in 3 or 5 words, 16 6-bit codes
        in 3); the tile is [BLOCK_N, NGT groups, UPG units], each unit's codes held by one
        thread."""
        PER: tl.constexpr = 16 if BITS == 6 else 32
        UW: tl.constexpr = PER * BITS // 32
        NG: tl.constexpr = K // GROUP
        NGT: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
        UPG: tl.constexpr = BLOCK_K // NGT // PER  # units per group inside the tile
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rg = k0 // GROUP + tl.arange(0, NGT)
        rk = k0 + tl.arange(0, BLOCK_K)
        rows = rn[:, None].to(tl.int64)
        ru = (k0 // PER + tl.arange(0, NGT)[:, None] * UPG
              + tl.arange(0, UPG)[None, :])  # [NGT, UPG] unit index within the row
        wp = w_ptr + rn[:, None, None].to(tl.int64) * (K * BITS // 32) + ru[None] * UW
        umask = (rn[:, None, None] < N) & (ru < K // PER)[None]
        w0, w1, w2, w3, w4 = _unit_words(wp, umask, UW, not EVEN)  # [BN, NGT, UPG] each
        if EVEN:
            s = tl.load(s_ptr + rows * NG + rg[None, :])  # [BN, NGT]
            b = tl.load(b_ptr + rows * NG + rg[None, :])
        else:
            gmask = (rn[:, None] < N) & (rg < NG)[None, :]
            s = tl.load(s_ptr + rows * NG + rg[None, :], mask=gmask, other=0.0)
            b = tl.load(b_ptr + rows * NG + rg[None, :], mask=gmask, other=0.0)
        if PER == 16:
            q = _codes4(w0, w1, w2, w3, w4, BITS, 0, 1)  # [BN, NGT, UPG, 2, 2, 2, 2]
        else:
            q = _codes5(w0, w1, w2, w3, w4, BITS, 0, 1)  # [BN, NGT, UPG, 2, 2, 2, 2, 2]
        q = tl.reshape(q, [BLOCK_N, NGT, UPG * PER])
        v = q * s.to(tl.float32)[:, :, None] + b.to(tl.float32)[:, :, None]
        out = tl.reshape(_round(v, out_ptr.dtype.element_ty, EXACT_ROUND), [BLOCK_N, BLOCK_K])
        op = out_ptr + rows * K + rk[None, :]
        if EVEN:
            tl.store(op, out)
        else:
            tl.store(op, out, mask=(rn[:, None] < N) & (rk < K)[None, :])

    @triton.jit
    def _fp_tile(wd, sraw, gs, DT: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NGT: tl.constexpr,
                 EXACT_ROUND: tl.constexpr):
        """fp-mode words [BLOCK_N, BLOCK_K/PER] and scale bytes [BLOCK_N, NGT] -> weights
        [BLOCK_N, BLOCK_K] in DT: value * scale in fp32 (`codes` decodes both as the
        GEMVs do), rounded once."""
        PER: tl.constexpr = 32 // BITS
        w4 = tl.reshape(wd, [BLOCK_N, NGT, BLOCK_K // PER // NGT, 1])
        q = (w4 >> (tl.arange(0, PER) * BITS)) & ((1 << BITS) - 1)  # [BN, NGT, WPG, PER]
        v = _code_value(q, MODE) * _group_scale(sraw, gs, MODE)[:, :, None, None]
        return _round(tl.reshape(v, [BLOCK_N, BLOCK_K]), DT, EXACT_ROUND)

    @triton.jit
    def _copy_dequant_kernel(w_ptr, s_ptr, b_ptr, gs_ptr, out_ptr, N, K: tl.constexpr,
                             GROUP: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
                             GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EXACT_ROUND: tl.constexpr, MODE: tl.constexpr = 0,
                             HAS_GS: tl.constexpr = False):
        """out[n, k] = s[n, k // G] * q(n, k) + b[n, k // G] from q4tc's lane-ordered copy
        (`weight_tiles._copy_tile`), each row stored at its original index (`glu_rows`
        undone for GLU): a thread's 8 codes are one 16-byte store. MODE > 0 (mxfp4 / nvfp4):
        an fp4 copy, s the file's scale bytes, value * scale as `dequant_fp` (nvfp4 with
        HAS_GS: times the global scale at gs_ptr / 2688)."""
        NG: tl.constexpr = K // GROUP
        NGT: tl.constexpr = BLOCK_K // GROUP
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # copy rows
        rg = tl.program_id(1) * NGT + tl.arange(0, NGT)  # groups
        nmask = rn < N
        orig = _copy_orig(rn, N, GLU)
        so = orig.to(tl.int64)[:, None] * NG + rg[None, :]
        gm = nmask[:, None] & (rg < NG)[None, :]
        s = tl.load(s_ptr + so, mask=gm, other=0)
        if MODE > 0:
            gs = 1.0
            if HAS_GS:
                gs = tl.load(gs_ptr).to(tl.float32) / 2688.0
            s = _group_scale(s, gs, MODE)
            b = s
        else:
            b = tl.load(b_ptr + so, mask=gm, other=0)
        out = _copy_tile(w_ptr, rn, tl.program_id(1) * BLOCK_K, s, b, nmask, K, P, R, BLOCK_N,
                         BLOCK_K, NGT, out_ptr.dtype.element_ty, EXACT_ROUND, MODE)
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + orig.to(tl.int64)[:, None] * K + rk[None, :], out,
                 mask=nmask[:, None] & (rk < K)[None, :])

    @triton.jit(do_not_specialize=["stride_w"])
    def _dequant_kernel(w_ptr, s_ptr, b_ptr, gs_ptr, out_ptr, N, stride_w, K: tl.constexpr,
                        BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
                        HAS_GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN: tl.constexpr, EXACT_ROUND: tl.constexpr, GS_ROWS: tl.constexpr = 0):
        """out[n, k] = s[n, k // G] * code(n, k) + b[n, k // G] over a [BLOCK_N, BLOCK_K] tile:
        one 2-D word load (3/5/6-bit: `_dequant_units`), scales per group, contiguous 16-byte
        stores. MODE > 0 (`codes.MODES`): fp codes and scale bytes (`_fp_tile`; nvfp4
        with HAS_GS, the global scale at gs_ptr; GS_ROWS > 0: one per GS_ROWS rows, the
        stacked experts' [X] scales over their [X*N, K] rows), no biases."""
        if BITS == 3 or BITS == 5 or BITS == 6:
            _dequant_units(w_ptr, s_ptr, b_ptr, out_ptr, N, K, BITS, GROUP, BLOCK_N, BLOCK_K,
                           EVEN, EXACT_ROUND)
        else:
            PER: tl.constexpr = 32 // BITS
            KW: tl.constexpr = K // PER
            NG: tl.constexpr = K // GROUP
            BW: tl.constexpr = BLOCK_K // PER
            NGT: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
            rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            k0 = tl.program_id(1) * BLOCK_K
            rw = k0 // PER + tl.arange(0, BW)
            rg = k0 // GROUP + tl.arange(0, NGT)
            rk = k0 + tl.arange(0, BLOCK_K)
            rows = rn[:, None].to(tl.int64)
            if BITS == 4:
                # one word = 8 codes = exactly one 16-byte store of the output. With the row stride
                # a runtime value (stride_w = KW, not specialized) the compiler cannot vectorize the
                # word load, so each thread loads one word (a warp still reads 128 contiguous bytes)
                # and its codes are already where the coalesced store wants them: no shared-memory
                # round trip between unpacking and storing (sm_90: 19 -> 3 barriers per program)
                w_rows = w_ptr + rows * stride_w
            else:
                w_rows = w_ptr + rows * KW
            if EVEN:
                wd = tl.load(w_rows + rw[None, :])
                s = tl.load(s_ptr + rows * NG + rg[None, :])
                if MODE == 0:
                    b = tl.load(b_ptr + rows * NG + rg[None, :])
            else:
                nmask = rn[:, None] < N
                gmask = nmask & (rg < NG)[None, :]
                wd = tl.load(w_rows + rw[None, :], mask=nmask & (rw < KW)[None, :], other=0)
                s = tl.load(s_ptr + rows * NG + rg[None, :], mask=gmask, other=0)
                if MODE == 0:
                    b = tl.load(b_ptr + rows * NG + rg[None, :], mask=gmask, other=0)
            if MODE == 0:
                out = _affine_tile(wd, s, b, out_ptr.dtype.element_ty, BITS, BLOCK_N, BLOCK_K,
                                   NGT, EXACT_ROUND, N)
            else:
                gs = 1.0
                if HAS_GS:
                    if GS_ROWS > 0:  # [BLOCK_N, 1]: each row's expert's scale
                        gs = (tl.load(gs_ptr + rn // GS_ROWS, mask=rn < N, other=0.0)
                              .to(tl.float32) / 2688.0)[:, None]
                    else:
                        gs = tl.load(gs_ptr).to(tl.float32) / 2688.0
                out = _fp_tile(wd, s, gs, out_ptr.dtype.element_ty, MODE, BITS, BLOCK_N,
                               BLOCK_K, NGT, EXACT_ROUND)
            op = out_ptr + rows * K + rk[None, :]
            if EVEN:
                tl.store(op, out)
            else:
                tl.store(op, out, mask=(rn[:, None] < N) & (rk < K)[None, :])


def dequant_fp(packed: Tensor, scales: Tensor, global_scale: Tensor | None, mode: str,
               dtype: torch.dtype = torch.bfloat16, gs_rows: int = 0) -> Tensor:
    """fp-mode words int32 [N, K*bits/32] (mxfp4 / nvfp4: 4-bit E2M1 codes; mxfp8: 8-bit E4M3),
    scale bytes uint8 [N, K/G] (E8M0; nvfp4: E4M3, times global_scale / 2688 if given) -> [N, K] in
    `dtype`: value * scale in fp32, rounded once (bit for bit `mlxr.quant.fp.fp_dequantize`,
    except the E4M3 bytes 0x7F / 0xFF, NaN there and +-480 here as in the GEMVs; mlx's
    quantizer never writes them). gs_rows > 0 (stacked experts as [X*N, ...] rows): nvfp4's
    global_scale holds one scale [N_rows / gs_rows] per gs_rows rows."""
    from ...quant.fp import FP_MODES

    if mode not in FP_MODES:
        raise ValueError(f"dequant_fp: unknown mode {mode!r}")
    bits, group = FP_MODES[mode]
    n = packed.shape[0]
    k = scales.shape[-1] * group if scales.dim() == 2 else -1
    if (packed.dim() != 2 or scales.shape[0] != n or packed.shape[1] * 32 != k * bits
            or scales.dtype != torch.uint8 or (mode != "nvfp4" and global_scale is not None)
            or (gs_rows > 0 and (global_scale is None or n % gs_rows
                                 or global_scale.numel() != n // gs_rows))):
        raise ValueError(f"dequant_fp: {mode} words {tuple(packed.shape)}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, global scale "
                         f"{global_scale is not None}")
    packed = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    bn, bk = 32, 256  # as `dequant_affine`: 16 KiB of output per program
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](packed, scales, scales,
                          global_scale if global_scale is not None else scales, out, n,
                          k * bits // 32, K=k, BITS=bits, GROUP=group, MODE=MODES[mode],
                          HAS_GS=global_scale is not None, BLOCK_N=bn, BLOCK_K=bk,
                          EVEN=n % bn == 0 and k % bk == 0, EXACT_ROUND=_interpret(),
                          GS_ROWS=gs_rows, num_warps=4)
    return out


def dequant_affine(packed: Tensor, scales: Tensor, biases: Tensor, in_features: int, bits: int,
                   group_size: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """packed int32 [N, K*bits/32], scales/biases [N, K/G] -> [N, K] in `dtype`: s*q + b in
    fp32, rounded to `dtype` (bit for bit `mlxr.quant.dequantize` in fp32, then cast).
    Widths 2/3/4/5/6/8. K must be a multiple of the group (32/64/128), hence of 32: whole
    words per row for 2/4/8-bit, whole 32-code (3/5-bit) or 16-code (6-bit) units otherwise."""
    if in_features % group_size:
        raise ValueError(f"dequant_affine: in_features {in_features} is not a multiple of "
                         f"group_size {group_size}")
    k = _validate(None, packed, scales, biases, bits, group_size, DEQUANT_BITS)
    if k != in_features:
        raise ValueError(f"in_features {in_features} does not match scales {tuple(scales.shape)}")
    n = packed.shape[0]
    packed = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    # [32 rows, 256 columns] per program: 4-bit reads 32 B and writes 512 B per row (16-byte
    # vectors per thread), 16 KiB of output per program; 3/5/6-bit: 8 or 16 units per row
    bn, bk = 32, 256
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](packed, scales, biases, scales, out, n, k * bits // 32, K=k,
                          BITS=bits, GROUP=group_size, MODE=0, HAS_GS=False, BLOCK_N=bn,
                          BLOCK_K=bk, EVEN=n % bn == 0 and k % bk == 0,
                          EXACT_ROUND=_interpret(), num_warps=4)
    return out


def dequant_copy(words: Tensor, scales: Tensor, biases: Tensor | None, bits: int,
                 group_size: int, planes: int = 1, glu: bool = False,
                 dtype: torch.dtype = torch.bfloat16, mode: str = "affine",
                 global_scale: Tensor | None = None) -> Tensor:
    """`dequant_affine` from a weight's q4tc copy instead of its MLX words: words = the
    lane-ordered nibbles [N/16, 2PK] (`decode_gemv_tc.repack`; P = planes of
    `mlxr.quant.affine.planes` for 2/3/5/6/8-bit, rows in `glu_rows` order if glu), scales /
    biases the file's [N, K/G] -> [N, K] in `dtype`, bit for bit `dequant_affine`'s (the same
    codes: q = h * 2^(bits - 4) + l over two planes; the same s * q + b in fp32). Lets a
    loaded weight drop its MLX words (`QuantWeight.drop_words`). mode mxfp4 / nvfp4: words
    are an fp4 copy (`decode_gemv_tc.fp4_bits`), scales the file's bytes, no biases: bit for bit
    `dequant_fp`'s; mxfp8: an fp8 copy (`decode_gemv_tc.fp8_words`, [N/16, 4K]; planes 1)."""
    fp8 = mode == "mxfp8"
    if fp8:  # its two halves lie as two planes' words do
        if planes != 1 or bits != 8:
            raise ValueError(f"dequant_copy: mxfp8 has one copy, 8 bits (planes {planes})")
        planes, bits = 2, 4
    rt, k2 = words.shape
    n, k = rt * 16, k2 // 2 // planes
    fp = mode != "affine"  # mxfp4 / nvfp4 / mxfp8: scale bytes, no biases
    if (planes not in (1, 2) or (planes == 2) != (bits > 4 or fp8) or k2 != 2 * planes * k
            or k % 64 or k % group_size or scales.shape != (n, k // group_size)
            or (fp and (planes != 1 + fp8 or scales.dtype != torch.uint8 or biases is not None
                         or (mode == "nvfp4") == (group_size == 32)))
            or mode not in MODES
            or (not fp and (biases is None or biases.shape != scales.shape
                            or global_scale is not None))
            or (global_scale is not None and mode != "nvfp4") or words.dtype != torch.int32):
        raise ValueError(f"dequant_copy: words {tuple(words.shape)} {words.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, biases "
                         f"{None if biases is None else tuple(biases.shape)}, {mode} "
                         f"{bits}-bit g{group_size}, planes {planes}")
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    bn, bk = 32, 256  # as `dequant_affine`: 16 KiB of output per program (whole groups)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    scales = scales.contiguous()
    gs = global_scale if global_scale is not None else scales
    _copy_dequant_kernel[grid](words, scales, scales if fp else biases.contiguous(), gs, out,
                               n, K=k, GROUP=group_size, P=planes,
                               R=1 << max(0, bits - 4), GLU=glu, BLOCK_N=bn, BLOCK_K=bk,
                               EXACT_ROUND=_interpret(), MODE=MODES[mode] if fp else 0,
                               HAS_GS=global_scale is not None, num_warps=4)
    return out
