"""Weight-tile math shared by the prefill GEMM (`prefill_gemm`) and the dequantizers
(`prefill_dequant`): a [BLOCK_N, BLOCK_K] tile of w = s * q + b in fp32, rounded once to the
compute dtype, from the MLX words (`_affine_tile`, both) or from q4tc's lane-ordered decode
copy (`_copy_tile`, the dequantizer of weights whose words were dropped:
`QuantWeight.drop_words`). Both give the same values for the same weight, so every prefill
path feeds the tensor cores the same bf16 matrix. (A fused GEMM built on `_copy_tile` was
measured 1.4-2.2x slower than the words' and removed: docs/perf.md.)
"""

from __future__ import annotations

from .generic_qmm import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codes import _code_value

    @triton.jit
    def _round(v, DT: tl.constexpr, EXACT_ROUND: tl.constexpr):
        """fp32 -> DT, round to nearest even. EXACT_ROUND (interpreter, bf16 only): with integer
        ops, because the interpreter's cast truncates."""
        if EXACT_ROUND and DT == tl.bfloat16:  # (NaN/inf never occur here)
            u = v.to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            r = (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            r = v.to(DT)
        return r

    @triton.jit
    def _affine_tile(wd, s, b, DT: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NGT: tl.constexpr, EXACT_ROUND: tl.constexpr, opaque):
        """words [BLOCK_N, BLOCK_K/PER] int32, scales/biases [BLOCK_N, NGT] (NGT groups in the
        tile) -> weights [BLOCK_N, BLOCK_K] in DT: w = s*q + b in fp32, rounded once.
        opaque: any runtime int >= 0 (see below)."""
        PER: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = BLOCK_K // PER // NGT  # words per group inside the tile
        w4 = tl.reshape(wd, [BLOCK_N, NGT, WPG, 1])
        # code j sits at bits [SH, SH + BITS), SH = j*BITS. If SH + BITS <= 23 it is masked in
        # place and OR'ed with the exponent of 2^(23-SH): that fp32 is exactly 2^(23-SH) + q, and
        # one subtraction leaves q (no shift, no int->float conversion). Higher codes do the same
        # from the word shifted right by 9 (one shift per word, shared by them).
        sh = tl.arange(0, PER) * BITS  # [PER], constants per register after layout
        hi = sh + BITS > 23
        sh = tl.where(hi, sh - 9, sh)
        src = tl.where(hi[None, None, None, :], w4 >> 9, w4)  # [BN, NGT, WPG, PER]
        # fp32 bits of 2^(23-SH), made opaque to the compiler (a select on a runtime value that
        # is always true): held in registers, so ptxas fuses mask-and-or into ONE lop3 (which
        # takes a single immediate; with two literal constants it emits two)
        expo = tl.where(opaque >= 0, (150 - sh) << 23, 0)
        f = ((src & (((1 << BITS) - 1) << sh)) | expo).to(tl.float32, bitcast=True)
        qf = f - expo.to(tl.float32, bitcast=True)
        sf = s.to(tl.float32)[:, :, None, None]
        bf = b.to(tl.float32)[:, :, None, None]
        v = tl.reshape(qf * sf + bf, [BLOCK_N, BLOCK_K])
        return _round(v, DT, EXACT_ROUND)

    @triton.jit
    def _nib_f32(w, w9, SH: tl.constexpr):
        """The code at bits SH..SH+3 (SH in 0, 8, 16, 24) of words w (w9 = w >> 9) as an exact
        fp32: masked in place and OR'ed with the exponent of 2^(23 - SH), that float is
        2^(23 - SH) + q, and one subtraction leaves q (`prefill_gemm._affine_tile`'s trick:
        no shift, no int -> float conversion)."""
        if SH == 24:  # past the mantissa: from the word shifted by 9 (bits 15..18)
            f = ((w9 & (15 << 15)) | (135 << 23)).to(tl.float32, bitcast=True)
            return f - 256.0
        f = ((w & (15 << SH)) | ((150 - SH) << 23)).to(tl.float32, bitcast=True)
        return f - (8388608.0 / (1 << SH))

    @triton.jit
    def _copy_codes4(w, l, h4, R: tl.constexpr, P: tl.constexpr):
        """The 4 codes of lane-ordered words w that are consecutive in k for a row with h4 =
        4h (nibbles h, h + 4, h + 2, h + 6: bits 0, 16, 8, 24 of w >> h4) as exact fp32; with
        two planes h * R + l (`affine.planes`), l the second plane's words."""
        ws = w >> h4
        ws9 = ws >> 9
        c0 = _nib_f32(ws, ws9, 0)
        c1 = _nib_f32(ws, ws9, 16)
        c2 = _nib_f32(ws, ws9, 8)
        c3 = _nib_f32(ws, ws9, 24)
        if P == 2:
            ls = l >> h4
            ls9 = ls >> 9
            c0 = c0 * R + _nib_f32(ls, ls9, 0)
            c1 = c1 * R + _nib_f32(ls, ls9, 16)
            c2 = c2 * R + _nib_f32(ls, ls9, 8)
            c3 = c3 * R + _nib_f32(ls, ls9, 24)
        return c0, c1, c2, c3

    @triton.jit
    def _fp4_codes4(w, hh):
        """The 4 E2M1 codes (int32) of an fp4 copy's words w (`decode_gemv_tc_layout.fp4_bits`)
        that `_copy_codes4` would take from a plain copy (nibbles h, h + 4, h + 2, h + 6 for
        hh = h, the row's half): fragment register h's values 0, 1 and register h + 2's."""
        a0 = tl.where(hh == 0, ((w >> 15) & 1) << 3 | ((w >> 6) & 7),
                      ((w >> 12) & 1) << 3 | ((w >> 3) & 7))
        a1 = tl.where(hh == 0, ((w >> 31) & 1) << 3 | ((w >> 22) & 7),
                      ((w >> 28) & 1) << 3 | ((w >> 19) & 7))
        b0 = tl.where(hh == 0, ((w >> 9) & 1) << 3 | (w & 7),
                      ((w >> 14) & 1) << 3 | ((w >> 9) & 6) | ((w >> 13) & 1))
        b1 = tl.where(hh == 0, ((w >> 25) & 1) << 3 | ((w >> 16) & 7),
                      ((w >> 30) & 1) << 3 | ((w >> 25) & 6) | ((w >> 29) & 1))
        return a0, a1, b0, b1

    @triton.jit
    def _fp8_codes4(w, v, hh):
        """The 4 E4M3 codes (int32) of an fp8 copy's words (`decode_gemv_tc_layout.fp8_words`: w
        of the first half, v of the second) that `_copy_codes4` would take from a plain copy:
        fragment register hh's two values (w) and register hh + 2's (v), each in a word's low
        and high 16 bits: register A (hh = 0) or B (hh = 1)."""
        a0 = tl.where(hh == 0, _fp8_a(w), _fp8_b(w))
        a1 = tl.where(hh == 0, _fp8_a(w >> 16), _fp8_b(w >> 16))
        b0 = tl.where(hh == 0, _fp8_a(v), _fp8_b(v))
        b1 = tl.where(hh == 0, _fp8_a(v >> 16), _fp8_b(v >> 16))
        return a0, a1, b0, b1

    @triton.jit
    def _fp8_a(w):
        """Register A's code in the low 16 bits of w: sign 15, e-m 10..4."""
        return (((w >> 15) & 1) << 7) | ((w >> 4) & 0x7F)

    @triton.jit
    def _fp8_b(w):
        """Register B's code in the low 16 bits of w: sign 11, e3e2e1 14..12, e0 3, m 2..0
        (`decode_gemv_tc_layout.FP8_B`)."""
        return (((w >> 11) & 1) << 7) | (((w >> 12) & 7) << 4) | (((w >> 3) & 1) << 3) | (w & 7)

    @triton.jit
    def _copy_tile(w_ptr, rn, k0, s, b, nmask, K: tl.constexpr, P: tl.constexpr,
                   R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NGT: tl.constexpr, DT: tl.constexpr, EXACT_ROUND: tl.constexpr,
                   MODE: tl.constexpr = 0):
        """Weights [BLOCK_N, BLOCK_K] in DT of copy rows rn [BN] (nmask: rn < N) and codes
        k0 .. k0 + BLOCK_K from q4tc's lane-ordered copy [N / 16, 2PK] (`decode_gemv_tc`
        docstring), scales and biases s, b [BN, NGT] (NGT groups in the tile, the rows' own):
        w = s * q + b in fp32, rounded once, as `_affine_tile` (q = h * R + l over two planes,
        `affine.planes`). The 8 codes 8c .. 8c + 7 of a row are two adjacent words of its row
        tile (block c // 8, lane 4g + c % 4, mma steps 2((c % 8) // 4) and + 1), nibbles h,
        h + 4, h + 2, h + 6 of each (h = the row's half of its tile): a thread's 16-byte run of
        output is two word loads (four with two planes), no gather across threads.
        MODE > 0 (mxfp4 / nvfp4, `codes.MODES`): the copy is an fp4 copy, s the
        groups' `_group_scale` multipliers (fp32), b unused: w = value * s, as `dequant_fp`;
        mxfp8 (MODE 3, P = 2: its two halves lie as two planes do): an fp8 copy."""
        CPG: tl.constexpr = BLOCK_K // 8 // NGT  # chunks of 8 codes per group in the tile
        c = k0 // 8 + tl.arange(0, NGT)[:, None] * CPG + tl.arange(0, CPG)[None, :]
        ri = rn % 16
        cw = (c // 8) * 128 + 4 * (c % 4) + 2 * ((c % 8) // 4)  # [NGT, CPG]
        rw = (rn // 16).to(tl.int64) * (2 * P * K) + 16 * (ri % 8)  # [BN]
        h4 = ((ri // 8) * 4)[:, None, None]  # [BN, NGT, CPG]
        wo = rw[:, None, None] + cw[None]
        m = nmask[:, None, None] & (c < K // 8)[None]
        sf = s.to(tl.float32)[:, :, None]
        bf = b.to(tl.float32)[:, :, None]
        w0 = tl.load(w_ptr + wo, mask=m, other=0)
        w1 = tl.load(w_ptr + wo + 1, mask=m, other=0)
        if MODE > 0:
            hh = (ri // 8)[:, None, None]
            if MODE == 3:
                v0 = tl.load(w_ptr + wo + 2 * K, mask=m, other=0)
                v1 = tl.load(w_ptr + wo + 2 * K + 1, mask=m, other=0)
                q0, q1, q2, q3 = _fp8_codes4(w0, v0, hh)
                q4, q5, q6, q7 = _fp8_codes4(w1, v1, hh)
            else:
                q0, q1, q2, q3 = _fp4_codes4(w0, hh)
                q4, q5, q6, q7 = _fp4_codes4(w1, hh)
            v = tl.join(tl.join(tl.join(_code_value(q0, MODE) * sf, _code_value(q4, MODE) * sf),
                                tl.join(_code_value(q2, MODE) * sf, _code_value(q6, MODE) * sf)),
                        tl.join(tl.join(_code_value(q1, MODE) * sf, _code_value(q5, MODE) * sf),
                                tl.join(_code_value(q3, MODE) * sf, _code_value(q7, MODE) * sf)))
            return _round(tl.reshape(v, [BLOCK_N, BLOCK_K]), DT, EXACT_ROUND)
        l0 = w0
        l1 = w1
        if P == 2:  # the second plane's blocks follow the first's: 2K words on
            l0 = tl.load(w_ptr + wo + 2 * K, mask=m, other=0)
            l1 = tl.load(w_ptr + wo + 2 * K + 1, mask=m, other=0)
        q0, q1, q2, q3 = _copy_codes4(w0, l0, h4, R, P)  # codes 8c + j, word j // 4
        q4, q5, q6, q7 = _copy_codes4(w1, l1, h4, R, P)
        # joined so that the last dim is the lowest bit of j: a row-major reshape of
        # [BN, NGT, CPG, 2, 2, 2] is k order
        v = tl.join(tl.join(tl.join(q0 * sf + bf, q4 * sf + bf),
                            tl.join(q2 * sf + bf, q6 * sf + bf)),
                    tl.join(tl.join(q1 * sf + bf, q5 * sf + bf),
                            tl.join(q3 * sf + bf, q7 * sf + bf)))
        return _round(tl.reshape(v, [BLOCK_N, BLOCK_K]), DT, EXACT_ROUND)

    @triton.jit
    def _copy_orig(rn, N, GLU: tl.constexpr):
        """The original row of each copy row rn: copy row 16t + j of a glu copy is gate row
        8t + j (j < 8) or up row F + 8t + j - 8 (`glu_rows`); else itself."""
        if GLU:
            return (rn // 16) * 8 + rn % 8 + ((rn % 16) // 8) * (N // 2)
        return rn
