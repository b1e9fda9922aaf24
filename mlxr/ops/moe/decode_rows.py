"""The decode MoE kernels' row sums with every load of a tile ahead of its arithmetic
(`decode_onepass`, `router`): gate and up rows of one expert in one tile loop
(`_pair_quant_rows`), and one matrix's rows (`_rows`).

`decode_experts._expert_rows` called twice (gate, then up) gives each program two dependent
memory round trips: Triton issues up's word loads only after gate's arithmetic and its
cross-thread reduction (offline sm_90 SASS of the onepass gate/up kernel: the second tile's
LDGs follow the first tile's barriers). Here each tile's gate and up words (and scales) are
loaded before any arithmetic, so both are in flight together, and the x values of a code
position are loaded once for both matrices (they multiply the same x). Per row the sums are
`_quant_rows`' exactly (the same products, added in the same order), so results are bit-equal
to two `_expert_rows` calls; quantized codes only (dense experts keep `_expert_rows`).

`_quant_rows` also loads the affine biases after the code loop (its source order; the TTGIR
keeps it, so the LDG issues after the tile's products: another dependent round trip);
`_rows` is `_expert_rows` with that load ahead of the products, bit-equal.
"""

from __future__ import annotations

from ..matmul.codes import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..matmul.codes import _group_scale
    from ..matmul.decode_gemv import _value, _words
    from .decode_experts import _dense_rows

    @triton.jit
    def _rows(x_ptr, w_ptr, s_ptr, b_ptr, gs, rn, N, K: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
              GT: tl.constexpr, KC: tl.constexpr):
        """`decode_experts._expert_rows` (same arguments, same sums) with the tile's scale
        and bias loads issued before its products."""
        if MODE == 4:
            res = _dense_rows(x_ptr, w_ptr, rn, N, K, KC, BLOCK_N, GT)
        else:
            PER: tl.constexpr = 32 // BITS if BITS == 2 or BITS == 4 or BITS == 8 else (
                16 if BITS == 6 else 32)
            UW: tl.constexpr = PER * BITS // 32
            UPG: tl.constexpr = GROUP // PER
            KWORDS: tl.constexpr = K * BITS // 32
            NG: tl.constexpr = K // GROUP
            NGC: tl.constexpr = KC // GROUP
            NT: tl.constexpr = (NGC + GT - 1) // GT
            rg = tl.arange(0, GT)
            u2 = rg[:, None] * UPG + tl.arange(0, UPG)[None, :]
            wrow = w_ptr + rn[:, None, None].to(tl.int64) * KWORDS + u2[None, :, :] * UW
            srow = rn[:, None].to(tl.int64) * NG + rg[None, :]
            nmask = rn < N
            acc = tl.zeros([BLOCK_N, GT], dtype=tl.float32)
            for t in range(NT):
                g0 = t * GT
                gmask = (g0 + rg) < NGC
                wmask = nmask[:, None, None] & gmask[None, :, None]
                smask = nmask[:, None] & gmask[None, :]
                w0, w1, w2, w3, w4 = _words(wrow + g0 * UPG * UW, wmask, UW, True)
                sraw = tl.load(s_ptr + srow + g0, mask=smask, other=0)
                if MODE == 0:
                    bb = tl.load(b_ptr + srow + g0, mask=smask, other=0.0).to(tl.float32)
                xp = x_ptr + g0 * GROUP + u2 * PER
                xmask = gmask[:, None]
                p = tl.zeros([BLOCK_N, GT, UPG], dtype=tl.float32)
                xs = tl.zeros([GT, UPG], dtype=tl.float32)
                for c in tl.static_range(PER):
                    v = _value(w0, w1, w2, w3, w4, c, BITS, MODE)
                    xc = tl.load(xp + c, mask=xmask, other=0.0).to(tl.float32)
                    p += xc[None, :, :] * v
                    if MODE == 0:
                        xs += xc
                acc += tl.sum(p, axis=2) * _group_scale(sraw, gs, MODE)
                if MODE == 0:
                    acc += bb * tl.sum(xs, axis=1)[None, :]
            res = tl.sum(acc, axis=1)
        return res

    @triton.jit
    def _pair_quant_rows(x_ptr, gw_ptr, gs_ptr, gb_ptr, ggs, uw_ptr, us_ptr, ub_ptr, ugs, rn, N,
                         K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                         MODE: tl.constexpr, BLOCK_N: tl.constexpr, GT: tl.constexpr,
                         KC: tl.constexpr):
        """fp32 ([BLOCK_N], [BLOCK_N]): rows rn of the gate and up matrices at gw_ptr / uw_ptr
        (each pointer at the expert's slice, offset to the K chunk) dotted with the KC values
        at x_ptr: `decode_experts._quant_rows` of both, its tile [BLOCK_N, GT, UPG]."""
        PER: tl.constexpr = 32 // BITS if BITS == 2 or BITS == 4 or BITS == 8 else (
            16 if BITS == 6 else 32)
        UW: tl.constexpr = PER * BITS // 32
        UPG: tl.constexpr = GROUP // PER
        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        NGC: tl.constexpr = KC // GROUP
        NT: tl.constexpr = (NGC + GT - 1) // GT
        rg = tl.arange(0, GT)
        u2 = rg[:, None] * UPG + tl.arange(0, UPG)[None, :]
        wo = rn[:, None, None].to(tl.int64) * KWORDS + u2[None, :, :] * UW
        srow = rn[:, None].to(tl.int64) * NG + rg[None, :]
        nmask = rn < N
        ag = tl.zeros([BLOCK_N, GT], dtype=tl.float32)
        au = tl.zeros([BLOCK_N, GT], dtype=tl.float32)
        for t in range(NT):
            g0 = t * GT
            gmask = (g0 + rg) < NGC
            wmask = nmask[:, None, None] & gmask[None, :, None]
            smask = nmask[:, None] & gmask[None, :]
            # every load of the tile before any arithmetic: both matrices in flight
            g0w, g1w, g2w, g3w, g4w = _words(gw_ptr + wo + g0 * UPG * UW, wmask, UW, True)
            u0w, u1w, u2w, u3w, u4w = _words(uw_ptr + wo + g0 * UPG * UW, wmask, UW, True)
            gsr = tl.load(gs_ptr + srow + g0, mask=smask, other=0)
            usr = tl.load(us_ptr + srow + g0, mask=smask, other=0)
            if MODE == 0:
                gbb = tl.load(gb_ptr + srow + g0, mask=smask, other=0.0).to(tl.float32)
                ubb = tl.load(ub_ptr + srow + g0, mask=smask, other=0.0).to(tl.float32)
            xp = x_ptr + g0 * GROUP + u2 * PER
            xmask = gmask[:, None]
            pg = tl.zeros([BLOCK_N, GT, UPG], dtype=tl.float32)
            pu = tl.zeros([BLOCK_N, GT, UPG], dtype=tl.float32)
            xs = tl.zeros([GT, UPG], dtype=tl.float32)
            for c in tl.static_range(PER):
                xc = tl.load(xp + c, mask=xmask, other=0.0).to(tl.float32)
                pg += xc[None, :, :] * _value(g0w, g1w, g2w, g3w, g4w, c, BITS, MODE)
                pu += xc[None, :, :] * _value(u0w, u1w, u2w, u3w, u4w, c, BITS, MODE)
                if MODE == 0:
                    xs += xc
            ag += tl.sum(pg, axis=2) * _group_scale(gsr, ggs, MODE)
            au += tl.sum(pu, axis=2) * _group_scale(usr, ugs, MODE)
            if MODE == 0:
                xsum = tl.sum(xs, axis=1)[None, :]
                ag += gbb * xsum
                au += ubb * xsum
        return tl.sum(ag, axis=1), tl.sum(au, axis=1)
