"""`decode_gemv_tc`'s load-time layouts (plain torch): the lane-ordered repack of MLX 4-bit words
(the layout is described in `decode_gemv_tc`'s docstring) or of codes (`repack_codes`, for the
nibble planes of `mlxr.quant.affine.planes`), its inverse, the glu row order in which an
MLP's [gate; up] weight is repacked so that the kernel's epilogue can compute act(gate) * up
(`decode_gemv_tc.q4tc(act=...)`), and the kernel's torch twin (`q4tc_ref`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _codes(packed: Tensor) -> Tensor:
    """MLX words [N, K/8] -> codes [N, K] int32 (code k at nibble k % 8 of word k // 8)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.view(torch.int32).unsqueeze(-1) >> shifts) & 15).reshape(packed.shape[0], -1)


def repack(packed: Tensor, chunk_rows: int = 4096) -> Tensor:
    """MLX 4-bit words [N, K/8] -> the lane-ordered words [N/16, 2K] int32 (`decode_gemv_tc`'s
    docstring).
    Rows go through in slices so an LM head does not need 8x its size of scratch."""
    n, kw = packed.shape
    return _repack_rows(lambda r0, r1: _codes(packed[r0:r1]), n, kw * 8, packed.device,
                        chunk_rows)


def repack_codes(codes: Tensor, chunk_rows: int = 4096) -> Tensor:
    """`repack` of codes [N, K] (any integer dtype, each in [0, 16)) instead of MLX words."""
    n, k = codes.shape
    return _repack_rows(lambda r0, r1: codes[r0:r1].to(torch.int32), n, k, codes.device,
                        chunk_rows)


def lane_order(q: Tensor) -> Tensor:
    """Codes [16R, K] (any dtype) -> [R, 2K, 8]: element (tile, word w, nibble j) is the code
    `repack` puts at nibble j of word w."""
    n, k = q.shape
    # [R, h, g, blk, sh, tig, sl, m, hi] -> [R, blk, g, tig, sh, sl | hi, m, h]
    q = q.reshape(n // 16, 2, 8, k // 64, 2, 4, 2, 2, 2).permute(0, 3, 2, 5, 4, 6, 8, 7, 1)
    return q.reshape(n // 16, 2 * k, 8)


def _repack_rows(rows, n: int, k: int, device, chunk_rows: int) -> Tensor:
    """The lane-ordered words of N x K codes, `rows(r0, r1)` giving rows r0..r1 as int32."""
    if n % 16 or k % 64:
        raise ValueError(f"q4tc.repack: N = {n} must be a multiple of 16, K = {k} of 64")
    shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int32)
    out = torch.empty(n // 16, 2 * k, dtype=torch.int32, device=device)
    for r in range(0, n, chunk_rows):
        q = rows(r, r + chunk_rows)
        q = lane_order(q)
        rt = q.shape[0]
        out[r // 16:r // 16 + rt] = (q << shifts).sum(-1, dtype=torch.int32)
    return out


# E2M1 codes (sign, e1, e0, m) in a word of the fp4 copy (`fp4_bits`): (sign, em) bit positions
# of the code in fragment register i's low half (its high half: + 16), chosen so that register
# i's two bf16 values (x 2^-126: em lands on the exponent's low two bits and the mantissa's top
# bit) come out of the word by one AND (i = 0), a shift and an AND (i = 1, 2) or three shifts
# and three ANDs (i = 3: no layout gives all four registers one shift, see docs/perf.md)
FP4_SIGN = (15, 12, 9, 14)
FP4_EM = (6, 3, 0, None)  # register 3: e1 e0 at bits 11, 10 and m at bit 13


def fp4_bits(words: Tensor) -> Tensor:
    """`repack`'s words of E2M1 codes (mxfp4, nvfp4) -> the fp4 copy that
    `decode_gemv_tc.q4tc(fp4=True)` reads: the same words, each code's bits moved within its word
    (nibble i + 4 hi, register i's value hi, to `FP4_SIGN` / `FP4_EM` + 16 hi)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for j in range(8):
        c = (w >> (4 * j)) & 15
        i, base = j % 4, 16 * (j // 4)
        out |= (c >> 3) << (FP4_SIGN[i] + base)
        if FP4_EM[i] is None:
            out |= (((c >> 1) & 3) << (10 + base)) | ((c & 1) << (13 + base))
        else:
            out |= (c & 7) << (FP4_EM[i] + base)
    return (out - (out >> 31 << 32)).to(torch.int32)


def fp4_unbits(words: Tensor) -> Tensor:
    """Inverse of `fp4_bits` (tests, reference)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for j in range(8):
        i, base = j % 4, 16 * (j // 4)
        c = ((w >> (FP4_SIGN[i] + base)) & 1) << 3
        if FP4_EM[i] is None:
            c |= (((w >> (10 + base)) & 3) << 1) | ((w >> (13 + base)) & 1)
        else:
            c |= (w >> (FP4_EM[i] + base)) & 7
        out |= c << (4 * j)
    return (out - (out >> 31 << 32)).to(torch.int32)


# E4M3 codes (sign, e3..e0, m2..m0) in a word of the fp8 copy (`fp8_words`): a word holds the
# four codes of two fragment registers: register A's values (hi = 0, 1) at sign 15 + 16 hi and
# e/m at bits 10..4 + 16 hi, i.e. where a bf16's sign, exponent's low 4 bits and mantissa's top
# 3 bits are (the value x 2^-120, subnormals included: one AND, then one exact bf16x2 multiply
# by 2^120); register B's in the 16 bits left, so that ((w >> 4) & 0x07000700) | ((w << 4) &
# 0x80F080F0) puts them in the same places (no layout gives B one shift: it needs 7 adjacent
# free bits). B's (sign, e3e2e1, e0, m) bit positions for hi = 0; hi = 1 adds 16:
FP8_B = (11, 12, 3, 0)


def fp8_words(codes: Tensor, chunk_rows: int = 4096) -> Tensor:
    """mxfp8's E4M3 codes [N, K] (uint8) -> the fp8 copy `decode_gemv_tc.q4tc(fp8=True)` reads:
    int32 [N/16, 4K], two halves of `repack`'s lane order: word w of the first half holds
    fragment registers 0 and 1 of the step whose 4-bit word would be word w, the second half
    registers 2 and 3 (each register two codes; placed as `FP8_B` says)."""
    n, k = codes.shape
    if n % 16 or k % 64:
        raise ValueError(f"q4tc.fp8_words: N = {n} must be a multiple of 16, K = {k} of 64")
    out = torch.empty(n // 16, 4 * k, dtype=torch.int32, device=codes.device)
    for r in range(0, n, chunk_rows):
        q = codes[r:r + chunk_rows].to(torch.int64)
        q = lane_order(q)  # [R, 2K, code j = 4hi + i]
        rt = q.shape[0]
        halves = [_fp8_pack(q[..., a], q[..., a + 4], q[..., a + 1], q[..., a + 5])
                  for a in (0, 2)]
        out[r // 16:r // 16 + rt] = torch.cat(halves, dim=1)
    return out


def _fp8_pack(a0: Tensor, a1: Tensor, b0: Tensor, b1: Tensor) -> Tensor:
    """One fp8-copy word of register A's codes (hi 0, 1) and register B's (int64 in, int32)."""
    sg, e3, e0, m = FP8_B
    w = ((a0 >> 7) << 15) | ((a0 & 0x7F) << 4) | ((a1 >> 7) << 31) | ((a1 & 0x7F) << 20)
    for c, base in ((b0, 0), (b1, 16)):
        w |= (((c >> 7) << sg) | (((c >> 4) & 7) << e3) | (((c >> 3) & 1) << e0)
              | ((c & 7) << m)) << base
    return (w - (w >> 31 << 32)).to(torch.int32)


def fp8_unwords(words: Tensor) -> Tensor:
    """Inverse of `fp8_words`: the codes [N, K] uint8 (tests, reference)."""
    rt, k4 = words.shape
    k = k4 // 4
    w = words.to(torch.int64) & 0xFFFFFFFF
    sg, e3, e0, m = FP8_B
    codes = []
    for half in (w[:, :2 * k], w[:, 2 * k:]):
        for base in (0, 16):
            h = half >> base
            codes.append((((h >> 15) & 1) << 7) | ((h >> 4) & 0x7F))  # register A
        for base in (0, 16):
            h = half >> base
            codes.append((((h >> sg) & 1) << 7) | (((h >> e3) & 7) << 4)
                         | (((h >> e0) & 1) << 3) | ((h >> m) & 7))  # register B
    # codes: (reg 0 hi 0, reg 0 hi 1, reg 1 hi 0, reg 1 hi 1, reg 2 ..., reg 3 ...): j = 4hi + i
    q = torch.stack([codes[2 * i + hi] for hi in (0, 1) for i in range(4)], dim=-1)
    # [R, blk, g, tig, sh, sl, hi, m, h] back to [R, h, g, blk, sh, tig, sl, m, hi]
    q = q.reshape(rt, k // 64, 8, 4, 2, 2, 2, 2, 2).permute(0, 8, 2, 1, 4, 3, 5, 7, 6)
    return q.reshape(rt * 16, k).to(torch.uint8)


def unrepack(words: Tensor) -> Tensor:
    """Inverse of `repack`: back to MLX words [N, K/8] (tests, reference)."""
    rt, k2 = words.shape
    k = k2 // 2
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    q = (words.unsqueeze(-1) >> shifts) & 15  # [R, 2K, nibble (hi, m, h)]
    q = q.reshape(rt, k // 64, 8, 4, 2, 2, 2, 2, 2).permute(0, 8, 2, 1, 4, 3, 5, 7, 6)
    q = q.reshape(rt * 16, k // 8, 8)  # [N, K/8, 8]: code k at nibble k % 8 of word k // 8
    return (q << shifts).sum(-1, dtype=torch.int32)


def dequant_copy_ref(words: Tensor, scales: Tensor, biases: Tensor | None, bits: int,
                     group_size: int, planes: int = 1, glu: bool = False,
                     dtype: torch.dtype = torch.bfloat16, mode: str = "affine",
                     global_scale: Tensor | None = None) -> Tensor:
    """`prefill_dequant.dequant_copy`'s torch twin: the weight [N, K] in `dtype` from its q4tc
    copy (P planes, `glu_rows` order if glu) and the file's scales and biases, s * q + b in
    fp32 rounded once; mxfp4 / nvfp4: from an fp4 copy, value * scale (`fp.fp_scales`);
    mxfp8: from an fp8 copy (`fp8_words`)."""
    n = words.shape[0] * 16
    fp4 = mode != "affine"
    q = copy_rows_codes(words, torch.arange(n, device=words.device), planes, bits, glu,
                        fp4 and mode != "mxfp8", mode == "mxfp8")
    k = q.shape[1]
    if fp4:
        from ...quant.fp import code_table, fp_scales

        v = code_table(mode, q.device)[q.to(torch.int64)].view(n, k // group_size, group_size)
        w = v * fp_scales(scales, mode, global_scale).unsqueeze(-1)
    else:
        w = (q.float().view(n, k // group_size, group_size) * scales.float().unsqueeze(-1)
             + biases.float().unsqueeze(-1))
    return w.view(n, k).to(dtype)


def copy_rows_codes(words: Tensor, rows: Tensor, planes: int, bits: int, glu: bool,
                    fp4: bool = False, fp8: bool = False) -> Tensor:
    """The b-bit codes int32 [len(rows), K] of original rows of a weight from its q4tc copy
    (P planes: q = h * 2^(bits - 4) + l, `affine.planes`; `glu_rows` order if glu; fp4: an
    fp4 copy's E2M1 codes; fp8: an fp8 copy's E4M3 codes), each row tile needed decoded
    once."""
    r = copy_row(rows.to(words.device), words.shape[0] * 16, glu)
    tiles, inv = torch.unique(r // 16, return_inverse=True)
    tw = words[tiles]
    if fp8:
        return fp8_unwords(tw).view(tiles.numel(), 16, -1)[inv, r % 16].to(torch.int32)
    q = _codes(unrepack(fp4_unbits(tw) if fp4 else tw)).view(tiles.numel(), 16, -1)[inv, r % 16]
    if planes == 2:
        from ...quant.affine import merge_planes

        k = q.shape[1] // 2
        q = merge_planes(q[:, :k], q[:, k:], bits)
    return q


def copy_row(rows: Tensor, n: int, glu: bool) -> Tensor:
    """The copy row of each original row of an N-row weight (`glu_rows` inverted if glu)."""
    if not glu:
        return rows
    f = n // 2
    up = (rows >= f).to(rows.dtype)
    r = rows - up * f
    return (r // 8) * 16 + r % 8 + up * 8


def glu_rows(n: int) -> Tensor:
    """The row order of a glu copy of an MLP's [gate; up] weight (N = 2F rows, gate first):
    row 16t + j of the copy is gate row 8t + j for j < 8, up row 8t + j - 8 for j >= 8, so a
    lane's rows g and g + 8 are the gate and the up of one output (`q4tc(act=...)`)."""
    if n % 16:
        raise ValueError(f"q4tc.glu_rows: N = {n} must be a multiple of 16")
    f = n // 2
    idx = (torch.arange(f // 8)[:, None, None] * 8 + torch.arange(2)[None, :, None] * f
           + torch.arange(8)[None, None, :])
    return idx.reshape(n)


def glu_order(y: Tensor) -> Tensor:
    """Outputs [..., N] of a glu copy (`glu_rows`' order) back to [gate | up] order."""
    n = y.shape[-1]
    return y.reshape(*y.shape[:-1], n // 16, 2, 8).transpose(-3, -2).reshape(y.shape)


# ====================================================================== torch twin (oracle)
def q4tc_ref(x: Tensor, words: Tensor, sb: Tensor, *, group: int, out: Tensor | None = None,
             config=None, act: str | None = None, planes: int = 1, fp4: bool = False,
             gs: float | None = None, fp8: bool = False) -> Tensor:
    """y = x @ (s * q + b)^T in fp32, rounded to x.dtype: [N] for one row of x ([K] or
    [1, K]), else [M, N]; `words` are `repack`'s output, sb = `decode_gemv_q4.pair_scales(
    scales, biases)` [N, K/group, 2]. act (silu, gelu, gelu_tanh): words and sb are a glu
    copy (rows in `glu_rows` order) and the result is act(gate) * up, [F] or [M, F] for F =
    N / 2, each rounded to x.dtype as `ops.gated_act` rounds. planes: words and sb hold P
    nibble planes of another width (`mlxr.quant.affine.planes`), K = P x x's length. fp4:
    words are `fp4_bits` of E2M1 codes (mxfp4, nvfp4) and w = s * value (sb's biases unused),
    times gs (nvfp4's global scale) if given. fp8: words are `fp8_words` of mxfp8's E4M3
    codes, w = s * value. config changes nothing here."""
    from ..reference import gated_act
    from .generic_qmm import dequant_f32

    if fp4 or fp8:  # the pairs' scales: the E8M0 / E4M3 scales in x's dtype (exact)
        from ...quant.fp import code_table

        q = fp8_unwords(words) if fp8 else _codes(unrepack(fp4_unbits(words)))
        n, k = q.shape
        w = (code_table("mxfp8" if fp8 else "mxfp4", q.device)[q.to(torch.int64)]
             .view(n, k // group, group)
             * sb[..., 0].float().unsqueeze(-1)).view(n, k) * (1.0 if gs is None else gs)
    else:
        w = dequant_f32(unrepack(words), sb[..., 0], sb[..., 1], None, "affine", 4, group)
    xm = x.reshape(-1, words.shape[1] // (4 if fp8 else 2) // planes)
    y = (xm.float().repeat(1, planes) @ w.t()).to(x.dtype)
    if act is not None:
        gate, up = glu_order(y).chunk(2, dim=-1)
        y = gated_act(gate, up, act)
    if xm.shape[0] == 1:
        y = y[0]
    if out is None:
        return y
    out.copy_(y)
    return out
