"""MLX quantized codes as the Triton kernels read them, shared by `generic_qmm`, `decode_gemv`
and `prefill_dequant`: the format modes, the word-aligned unit of each width (`unit_codes`),
the @triton.jit helpers that pick a code out of its word(s) and turn it into fp32, and a
GEMM's weight tile dequantized in natural K order (`_dequant_tile`, for `generic_qmm` and the
grouped MoE GEMM).

fp modes decode codes without tables: E2M1 / E4M3 bits are moved into an fp16 bit pattern
(exponent/mantissa aligned; subnormals come out right) and the missing power of two (2^14 for
E2M1, 2^8 for E4M3) is folded into the group scale. E4M3 0x7F/0xFF decode to +-480 here (mlx CPU
says NaN; mlx's quantizer never writes them). E8M0 byte b -> bits b<<23 (b=0 -> 2^-127).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - torch-only installs
    HAVE_TRITON = False

MODES = {"affine": 0, "mxfp4": 1, "nvfp4": 2, "mxfp8": 3}


def unit_codes(bits: int) -> int:
    """Codes per word-aligned unit (PER): 32/bits for 2/4/8, 32 for 3/5, 16 for 6."""
    if bits in (2, 4, 8):
        return 32 // bits
    return 16 if bits == 6 else 32


if HAVE_TRITON:

    @triton.jit
    def _pick(w0, w1, w2, w3, w4, I: tl.constexpr):
        if I == 0:
            r = w0
        elif I == 1:
            r = w1
        elif I == 2:
            r = w2
        elif I == 3:
            r = w3
        else:
            r = w4
        return r

    @triton.jit
    def _unit_code(w0, w1, w2, w3, w4, C: tl.constexpr, BITS: tl.constexpr):
        """Code C (static) of each unit; w0..w4 are the unit's consecutive int32 words."""
        O: tl.constexpr = C * BITS
        WI: tl.constexpr = O // 32
        SH: tl.constexpr = O % 32
        MASK: tl.constexpr = (1 << BITS) - 1
        lo = _pick(w0, w1, w2, w3, w4, WI)
        if SH + BITS <= 32:
            q = (lo >> SH) & MASK
        else:
            LOW: tl.constexpr = 32 - SH
            hi = _pick(w0, w1, w2, w3, w4, WI + 1)
            q = ((lo >> SH) & ((1 << LOW) - 1)) | ((hi << LOW) & MASK)
        return q

    @triton.jit
    def _code_value(q, MODE: tl.constexpr):
        """int32 codes -> fp32 values (fp modes: value / 2^14 (E2M1) or / 2^8 (E4M3))."""
        if MODE == 0:  # affine: q + 2^23 as fp32 bits, minus 2^23 (exact for q < 2^23)
            v = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        elif MODE == 3:  # E4M3 -> fp16 bit pattern, value * 2^-8
            h = ((q & 0x7F) << 7) | ((q & 0x80) << 8)
            v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:  # E2M1 -> fp16 bit pattern, value * 2^-14
            h = ((q & 7) << 9) | ((q & 8) << 12)
            v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return v

    @triton.jit
    def _group_scale(sraw, gs, MODE: tl.constexpr):
        """Loaded scale (affine: float; fp: uint8) -> fp32 multiplier for `_code_value`."""
        if MODE == 0:
            s = sraw.to(tl.float32)
        elif MODE == 2:  # nvfp4: E4M3 scale (x2^8 undone) x E2M1 2^14 x global/2688
            si = sraw.to(tl.int32)
            s = _code_value(si, 3) * 4194304.0  # undo E4M3 2^-8 and E2M1 2^-14: 2^22
            s = s * gs
        else:  # E8M0 2^(b-127); b = 0 -> 2^-127
            si = sraw.to(tl.int32)
            s = tl.where(si == 0, 0x00400000, si << 23).to(tl.float32, bitcast=True)
            if MODE == 1:
                s = s * 16384.0
            else:
                s = s * 256.0
        return s

    @triton.jit
    def _dequant_tile(wrow, srow, s_ptr, b_ptr, gs, kk, k0, nmask, kmask, K: tl.constexpr,
                      BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 weights [BLOCK_N, BLOCK_K] of rows nmask at columns kk = k0 + arange(BLOCK_K)
        (valid: kmask): wrow / srow the rows' word pointers and scale offsets [BLOCK_N, 1].
        Shared by `generic_qmm._qgemm_kernel` and the grouped MoE GEMM
        (`moe.grouped_experts`)."""
        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        MASK: tl.constexpr = (1 << BITS) - 1
        wmask = nmask[:, None] & kmask[None, :]
        if BITS == 2 or BITS == 4 or BITS == 8:
            EPW: tl.constexpr = 32 // BITS
            wd = tl.load(wrow + (kk // EPW)[None, :], mask=wmask, other=0)
            q = (wd >> ((kk % EPW) * BITS)[None, :]) & MASK
        else:
            o = kk * BITS
            wi = o >> 5
            sh = o & 31
            lo = tl.load(wrow + wi[None, :], mask=wmask, other=0).to(tl.uint32, bitcast=True)
            hi = tl.load(wrow + wi[None, :] + 1, mask=wmask & (wi + 1 < KWORDS)[None, :],
                         other=0).to(tl.uint32, bitcast=True)
            shu = sh.to(tl.uint32)[None, :]
            his = tl.where(shu == 0, 0, hi << ((32 - shu) & 31))
            q = (((lo >> shu) | his) & MASK).to(tl.int32)
        v = _code_value(q, MODE)
        # group params: load [BN, groups in tile] (or [BN, 1]) and broadcast along K
        if BLOCK_K > GROUP:
            NGT: tl.constexpr = BLOCK_K // GROUP
            gi = k0 // GROUP + tl.arange(0, NGT)
            sp = srow + gi[None, :]
            smask = nmask[:, None] & (gi < NG)[None, :]
            sc = _group_scale(tl.load(s_ptr + sp, mask=smask, other=0), gs, MODE)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, NGT, GROUP]),
                            [BLOCK_N, BLOCK_K])
            wf = v * sc
            if MODE == 0:
                bb = tl.load(b_ptr + sp, mask=smask, other=0.0).to(tl.float32)
                bb = tl.reshape(tl.broadcast_to(bb[:, :, None], [BLOCK_N, NGT, GROUP]),
                                [BLOCK_N, BLOCK_K])
                wf += bb
        else:  # the tile lies inside one group
            sp = srow + k0 // GROUP
            smask = nmask[:, None]
            sc = _group_scale(tl.load(s_ptr + sp, mask=smask, other=0), gs, MODE)
            wf = v * sc
            if MODE == 0:
                wf += tl.load(b_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        return wf
