"""Decode MoE kernels (a few tokens): the selected experts' gate/up with the activation fused,
then down with the routing weights applied and summed over top-k. Two launches per MoE block.

Experts stay as the file stacks them (`ExpertQuant`: int32 words [X, N, K*bits/32], scales
[X, N, K/G], affine biases, nvfp4 per-expert global scale [X], expert biases [X, N]); each
program reads its expert id from the device-side ids and offsets into the stack, so nothing
crosses to the host and the launches can be captured in a CUDA graph.

* `moe_gate_up`: grid (P = T*k pairs, F / BLOCK_N). Pair p = (token p // k, slot p % k):
  rows of expert ids[p]'s gate and up matrices dotted with x[token], fp32 sums, rounded to the
  activation dtype, plus the expert bias (rounded), then the activation (`_act`, rounding where
  the reference's torch ops round) -> h [P, F].
* `moe_down`: grid (T, E / BLOCK_N). For each of the token's k slots (a static loop), the rows
  of expert ids[t, j]'s down matrix dotted with h[t*k + j], rounded (+ bias), times the routing
  weight (rounded to the activation dtype when the weight is, as torch's promotion does) and
  summed in fp32 in slot order; rounded once, then times the routed scale -> [T, E].

The per-row dot (`_expert_rows`) is `decode_gemv._gemv_kernel`'s tile with M = 1: the same
word loads (`_words`), code extraction (`_value`) and group scales (`codes`), so every
quant mode of the dense GEMV works here (affine 2-8 bit, mxfp4, nvfp4 with global scale, mxfp8).
Torch twins with the same signatures: `moe_gate_up_ref`, `moe_down_ref` (fp32 dequant, fp32
matmul, then `moe_reference.expert_act` / `combine`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference as moe_reference
from .operands import ExpertQuant, check_pair, kernels_take
from ..matmul.codes import HAVE_TRITON, MODES, unit_codes
from ..matmul.generic_qmm import _next_pow2, _sm_count, dequant_f32

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..matmul.decode_gemv import _value, _words
    from ..matmul.codes import _group_scale

ACTS = {"silu": 0, "swiglu_oai": 1, "gelu_tanh": 2}
# the kernels' MODE: codes.MODES, and 4 for unquantized ("dense") float experts
KERNEL_MODE = {**MODES, "dense": 4}
MAX_PAIRS = 16  # (token, slot) pairs the decode kernels serve; more go to the grouped GEMM


def supported(q: ExpertQuant) -> bool:
    """Whether the MoE kernels take this stacked projection (and triton is there)."""
    return HAVE_TRITON and kernels_take(q)


def _words_i32(w: Tensor) -> Tensor:
    return w.view(torch.int32) if w.dtype == torch.uint32 else w


def _scales(q: ExpertQuant) -> Tensor:
    """The scales pointer (dense experts have none: their weights stand in, never read)."""
    return q.w if q.scales is None else q.scales


def expert_f32(q: ExpertQuant, e: Tensor) -> Tensor:
    """Expert e [1] of q as the kernels see it: fp32 [N, K] (dense weights widened exactly)."""
    if q.mode == "dense":
        return q.w.index_select(0, e)[0].float()
    gs = None if q.global_scale is None else q.global_scale.index_select(0, e)[0]
    return dequant_f32(q.w.index_select(0, e)[0], q.scales.index_select(0, e)[0],
                       None if q.biases is None else q.biases.index_select(0, e)[0], gs,
                       q.mode, q.bits, q.group)


# ====================================================================== torch twins
def expert_matmul_ref(x: Tensor, pe: Tensor, q: ExpertQuant, out_dtype: torch.dtype,
                      round_weights: bool = False) -> Tensor:
    """Row r of x [P, K] through expert pe[r] of q: fp32 dequantized weights (rounded to
    x.dtype first with `round_weights`, as the tensor-core kernel feeds its dot), fp32 sums,
    rounded to out_dtype, plus the expert bias (rounded) -> [P, N]."""
    rows = []
    for r in range(x.shape[0]):
        wf = expert_f32(q, pe[r:r + 1])
        if round_weights:
            wf = wf.to(x.dtype).float()
        rows.append(x[r:r + 1].float() @ wf.t())
    y = torch.cat(rows).to(out_dtype) if rows else x.new_empty(0, q.shape[1], dtype=out_dtype)
    if q.bias is not None:
        y = y + q.bias.index_select(0, pe).to(out_dtype)
    return y


def moe_gate_up_ref(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant, act: str,
                    alpha: float = 1.702, limit: float = 7.0,
                    block_n: int | None = None) -> Tensor:
    """Twin of `moe_gate_up`: h [T*k, F] in x.dtype, pairs in (token, slot) order."""
    k = ids.shape[1]
    xs = x.repeat_interleave(k, dim=0)
    pe = ids.reshape(-1)
    g = expert_matmul_ref(xs, pe, gate, x.dtype)
    u = expert_matmul_ref(xs, pe, up, x.dtype)
    return moe_reference.expert_act(g, u, act, alpha, limit)


def moe_down_ref(h: Tensor, ids: Tensor, weights: Tensor, down: ExpertQuant,
                 out_dtype: torch.dtype, routed_scale: float = 1.0,
                 block_n: int | None = None) -> Tensor:
    """Twin of `moe_down`: [T, E] = combine over k of expert ids[t, j]'s down(h[t*k + j])."""
    t, k = ids.shape
    y = expert_matmul_ref(h, ids.reshape(-1), down, h.dtype).reshape(t, k, -1)
    return moe_reference.combine(y, weights, out_dtype, routed_scale)


# ====================================================================== Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _expert_rows(x_ptr, w_ptr, s_ptr, b_ptr, gs, rn, N, K: tl.constexpr,
                     BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
                     BLOCK_N: tl.constexpr, GT: tl.constexpr, KC: tl.constexpr):
        """fp32 [BLOCK_N]: rows rn of one expert's packed matrix (w_ptr, s_ptr, b_ptr at that
        expert's [N, ...] slice; rows of K values) dotted with the KC values at x_ptr (KC = K,
        or a split-K chunk of whole groups: the caller offsets every pointer to its start).
        `_gemv_kernel`'s tile [BLOCK_N, GT groups, UPG units] at M = 1, scale and bias once
        per group; dense experts (MODE 4): float rows [BLOCK_N, K] read in tiles of GT
        values."""
        if MODE == 4:
            res = _dense_rows(x_ptr, w_ptr, rn, N, K, KC, BLOCK_N, GT)
        else:
            res = _quant_rows(x_ptr, w_ptr, s_ptr, b_ptr, gs, rn, N, K, BITS, GROUP, MODE,
                              BLOCK_N, GT, KC)
        return res

    @triton.jit
    def _dense_rows(x_ptr, w_ptr, rn, N, K: tl.constexpr, KC: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 [BLOCK_N]: float rows rn of one expert's [N, K] weight dotted with x_ptr's KC
        values, fp32 products summed per tile, then over the tiles."""
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        wrow = w_ptr + rn[:, None].to(tl.int64) * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, KC, BLOCK_K):
            kk = k0 + rk
            kmask = kk < KC
            w = tl.load(wrow + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            xv = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * xv[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _quant_rows(x_ptr, w_ptr, s_ptr, b_ptr, gs, rn, N, K: tl.constexpr,
                    BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
                    BLOCK_N: tl.constexpr, GT: tl.constexpr, KC: tl.constexpr):
        """`_expert_rows` of packed codes."""
        PER: tl.constexpr = 32 // BITS if BITS == 2 or BITS == 4 or BITS == 8 else (
            16 if BITS == 6 else 32)
        UW: tl.constexpr = PER * BITS // 32  # words per unit
        UPG: tl.constexpr = GROUP // PER  # units per group
        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        NGC: tl.constexpr = KC // GROUP  # the groups this call sums
        NT: tl.constexpr = (NGC + GT - 1) // GT
        rg = tl.arange(0, GT)
        u2 = rg[:, None] * UPG + tl.arange(0, UPG)[None, :]  # [GT, UPG]
        wrow = w_ptr + rn[:, None, None].to(tl.int64) * KWORDS + u2[None, :, :] * UW
        srow = rn[:, None].to(tl.int64) * NG + rg[None, :]  # [BLOCK_N, GT]
        nmask = rn < N
        acc = tl.zeros([BLOCK_N, GT], dtype=tl.float32)
        for t in range(NT):
            g0 = t * GT
            gmask = (g0 + rg) < NGC  # [GT]
            wmask = nmask[:, None, None] & gmask[None, :, None]
            w0, w1, w2, w3, w4 = _words(wrow + g0 * UPG * UW, wmask, UW, True)
            smask = nmask[:, None] & gmask[None, :]
            sc = _group_scale(tl.load(s_ptr + srow + g0, mask=smask, other=0), gs, MODE)
            xp = x_ptr + g0 * GROUP + u2 * PER  # [GT, UPG]
            xmask = gmask[:, None]
            p = tl.zeros([BLOCK_N, GT, UPG], dtype=tl.float32)
            xs = tl.zeros([GT, UPG], dtype=tl.float32)
            for c in tl.static_range(PER):
                v = _value(w0, w1, w2, w3, w4, c, BITS, MODE)  # [BLOCK_N, GT, UPG]
                xc = tl.load(xp + c, mask=xmask, other=0.0).to(tl.float32)
                p += xc[None, :, :] * v
                if MODE == 0:
                    xs += xc
            acc += tl.sum(p, axis=2) * sc
            if MODE == 0:
                bb = tl.load(b_ptr + srow + g0, mask=smask, other=0.0).to(tl.float32)
                acc += bb * tl.sum(xs, axis=1)[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _expert_gs(gs_ptr, e, HAS_GS: tl.constexpr):
        """nvfp4 expert e's global scale / 2688 (what `_group_scale` multiplies by)."""
        gs = 1.0
        if HAS_GS:
            gs = tl.load(gs_ptr + e).to(tl.float32) / 2688.0
        return gs

    @triton.jit
    def _biased(acc, bias_ptr, off, mask, HAS_BIAS: tl.constexpr, DT: tl.constexpr):
        """fp32 sums rounded to DT, plus the expert bias rounded again (torch's y + bias in
        DT); returned in fp32 holding DT values."""
        y = acc.to(DT).to(tl.float32)
        if HAS_BIAS:
            bb = tl.load(bias_ptr + off, mask=mask, other=0.0).to(tl.float32)
            y = (y + bb).to(DT).to(tl.float32)
        return y

    @triton.jit
    def _act(g, u, alpha, limit, ACT: tl.constexpr, DT: tl.constexpr):
        """`moe_reference.expert_act` on fp32 g, u holding DT values, each torch op's result
        rounded to DT; returned in fp32 (rounded by the caller's store)."""
        if ACT == 0:  # silu(g) * up
            h = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * u
        elif ACT == 2:  # gemma4's GeGLU: gelu_tanh(g) * up, gelu in fp32 rounded once (torch)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi)
            th = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)  # tanh(z), saturating to +-1
            h = (0.5 * g * (1.0 + th)).to(DT).to(tl.float32) * u
        else:  # gpt-oss: (clip(up, +-limit) + 1) * (gc * sigmoid(alpha * gc)), gc = min(g, limit)
            gc = tl.minimum(g, limit)
            uc = (tl.minimum(tl.maximum(u, -limit), limit) + 1.0).to(DT).to(tl.float32)
            z = (alpha * gc).to(DT).to(tl.float32)
            sig = (1.0 / (1.0 + tl.exp(-z))).to(DT).to(tl.float32)
            h = uc * (gc * sig).to(DT).to(tl.float32)
        return h

    @triton.jit
    def _gate_up_kernel(
        x_ptr, ids_ptr, h_ptr,
        gw_ptr, gsc_ptr, gb_ptr, ggs_ptr, gbias_ptr,
        uw_ptr, usc_ptr, ub_ptr, ugs_ptr, ubias_ptr,
        F, stride_x, alpha, limit,
        K: tl.constexpr, TOPK: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        MODE: tl.constexpr, HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr,
        ACT: tl.constexpr, BLOCK_N: tl.constexpr, GT: tl.constexpr,
    ):
        p = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < F
        e = tl.load(ids_ptr + p).to(tl.int64)
        DT: tl.constexpr = h_ptr.dtype.element_ty
        WX: tl.constexpr = K * BITS // 32  # words of one row
        NG: tl.constexpr = K // GROUP
        xrow = x_ptr + (p // TOPK).to(tl.int64) * stride_x
        wo = e * F * WX  # the expert's slice of the stacks
        so = e * F * NG
        g = _expert_rows(xrow, gw_ptr + wo, gsc_ptr + so, gb_ptr + so,
                         _expert_gs(ggs_ptr, e, HAS_GS), rn, F, K, BITS, GROUP, MODE,
                         BLOCK_N, GT, K)
        u = _expert_rows(xrow, uw_ptr + wo, usc_ptr + so, ub_ptr + so,
                         _expert_gs(ugs_ptr, e, HAS_GS), rn, F, K, BITS, GROUP, MODE,
                         BLOCK_N, GT, K)
        g = _biased(g, gbias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
        u = _biased(u, ubias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
        h = _act(g, u, alpha, limit, ACT, DT)
        tl.store(h_ptr + p.to(tl.int64) * F + rn, h.to(DT), mask=nmask)

    @triton.jit
    def _down_kernel(
        h_ptr, ids_ptr, rw_ptr, y_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, bias_ptr,
        E, routed_scale,
        F: tl.constexpr, TOPK: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        MODE: tl.constexpr, HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROUND_PROD: tl.constexpr, SCALED: tl.constexpr,
        BLOCK_N: tl.constexpr, GT: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < E
        DT: tl.constexpr = h_ptr.dtype.element_ty
        WX: tl.constexpr = F * BITS // 32
        NG: tl.constexpr = F // GROUP
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            e = tl.load(ids_ptr + t * TOPK + j).to(tl.int64)
            wt = tl.load(rw_ptr + t * TOPK + j).to(tl.float32)
            y = _expert_rows(h_ptr + (t * TOPK + j) * F, w_ptr + e * E * WX,
                             s_ptr + e * E * NG, b_ptr + e * E * NG,
                             _expert_gs(gs_ptr, e, HAS_GS), rn, E, F, BITS, GROUP, MODE,
                             BLOCK_N, GT, F)
            y = _biased(y, bias_ptr, e * E + rn, nmask, HAS_BIAS, DT) * wt
            if ROUND_PROD:  # bf16 y times bf16 weights: torch rounds each product
                y = y.to(DT).to(tl.float32)
            out += y
        ODT: tl.constexpr = y_ptr.dtype.element_ty
        if SCALED:  # laguna: the routed scale multiplies after the cast
            out = out.to(ODT).to(tl.float32) * routed_scale
        tl.store(y_ptr + t * E + rn, out.to(ODT), mask=nmask)


# ====================================================================== launchers
def _block(n: int, pairs: int, device: torch.device) -> int:
    """Rows per program: 16, on CUDA halved while the grid has fewer than ~2 programs per SM
    (the interpreter takes up to 128 rows at once: its cost is per program)."""
    if device.type != "cuda":
        return min(128, _next_pow2(n))
    bn = 16
    sm_count = _sm_count(device)
    while bn > 2 and pairs * -(-n // bn) < 2 * sm_count:
        bn //= 2
    return bn


def _gt(k: int, bits: int, group: int) -> int:
    """Groups per tile (a power of two): ~256 words of a row (as
    `matmul.decode_gemv.default_config`); dense experts (bits 32, one group per row): values
    per tile, 256 at most (the same row bytes in flight as 128 words of codes, twice that
    for fp32)."""
    if bits == 32:
        return min(256, _next_pow2(k))
    per = unit_codes(bits)
    gw = group // per * (per * bits // 32)  # words per group
    fit = 1 << (max(1, 256 // gw).bit_length() - 1)
    return max(1, min(_next_pow2(k // group), fit))


def _gs_bias(q: ExpertQuant, dummy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (dummy if q.biases is None else q.biases,
            dummy if q.global_scale is None else q.global_scale,
            dummy if q.bias is None else q.bias)


def moe_gate_up(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant, act: str,
                alpha: float = 1.702, limit: float = 7.0, block_n: int | None = None,
                num_warps: int = 4) -> Tensor:
    """h [T*k, F] = act(gate_e(x_t), up_e(x_t)) for each (token t, slot) pair with expert
    e = ids[t, slot]; x [T, K], ids [T, k] (device int). Output in x.dtype. block_n: rows
    per program (default `_block`)."""
    check_pair(gate, up)
    if act not in ACTS:
        raise ValueError(f"unknown expert activation {act!r}")
    _, f, k = gate.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"moe_gate_up: x {tuple(x.shape)} does not match K = {k}")
    t, topk = ids.shape
    p = t * topk
    x = x.contiguous()
    ids = ids.contiguous()
    h = torch.empty(p, f, device=x.device, dtype=x.dtype)
    if p == 0:
        return h
    bn = block_n or _block(f, p, x.device)
    gb, ggs, gbias = _gs_bias(gate, _scales(gate))
    ub, ugs, ubias = _gs_bias(up, _scales(up))
    _gate_up_kernel[(p, triton.cdiv(f, bn))](
        x, ids, h, _words_i32(gate.w), _scales(gate), gb, ggs, gbias,
        _words_i32(up.w), _scales(up), ub, ugs, ubias, f, x.stride(0), float(alpha),
        float(limit), K=k, TOPK=topk, BITS=gate.bits, GROUP=gate.group,
        MODE=KERNEL_MODE[gate.mode], HAS_GS=gate.global_scale is not None,
        HAS_BIAS=gate.bias is not None, ACT=ACTS[act], BLOCK_N=bn,
        GT=_gt(k, gate.bits, gate.group), num_warps=num_warps)
    return h


def down_operands(h: Tensor, ids: Tensor, weights: Tensor, down: ExpertQuant,
                  out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The down launches' checked, contiguous operands and their output y [T, E] (shared by
    the fused kernel and `decode_split`)."""
    _, e, f = down.shape
    t, topk = ids.shape
    if h.dim() != 2 or h.shape != (t * topk, f) or weights.shape != ids.shape:
        raise ValueError(f"moe_down: h {tuple(h.shape)}, ids {tuple(ids.shape)}, weights "
                         f"{tuple(weights.shape)} do not fit F = {f}")
    y = torch.empty(t, e, device=h.device, dtype=out_dtype)
    return h.contiguous(), ids.contiguous(), weights.contiguous(), y


def moe_down(h: Tensor, ids: Tensor, weights: Tensor, down: ExpertQuant,
             out_dtype: torch.dtype, routed_scale: float = 1.0,
             block_n: int | None = None, num_warps: int = 4) -> Tensor:
    """[T, E] = sum over slots j of weights[t, j] * down_e(h[t*k + j]), e = ids[t, j]
    (`moe_reference.combine`'s order and roundings), times routed_scale after the cast."""
    h, ids, weights, y = down_operands(h, ids, weights, down, out_dtype)
    _, e, f = down.shape
    t, topk = ids.shape
    if t == 0:
        return y
    bn = block_n or _block(e, t, h.device)
    b, gs, bias = _gs_bias(down, _scales(down))
    _down_kernel[(t, triton.cdiv(e, bn))](
        h, ids, weights, y, _words_i32(down.w), _scales(down), b, gs, bias, e,
        float(routed_scale), F=f, TOPK=topk, BITS=down.bits, GROUP=down.group,
        MODE=KERNEL_MODE[down.mode], HAS_GS=down.global_scale is not None,
        HAS_BIAS=down.bias is not None,
        ROUND_PROD=weights.dtype == h.dtype != torch.float32,
        SCALED=routed_scale != 1.0, BLOCK_N=bn, GT=_gt(f, down.bits, down.group),
        num_warps=num_warps)
    return y
