"""Prefill / large-batch MoE: a grouped GEMM that dequantizes the experts' packed words in its
K loop (no dense bf16 copy of the experts), built on the dense prefill GEMM's weight tiles
(`matmul.prefill_gemm`). MLXR_MOE_GROUPED=fused selects it (`ops.moe_experts`).

Why the older grouped kernel (`grouped_experts._grouped_kernel`) takes 5-16 ms per layer on
the H200 where ~0.1 ms is the bound: its weight tile comes from `codes._dequant_tile`, one
int32 load per code at word (k // 8). Those addresses have no contiguity along K, so Triton
lays the [BLOCK_N, BLOCK_K] load out with the 32 threads of a warp along N (sm_90 TTGIR:
`sizePerThread [1, 1], threadsPerWarp [32, 1], order [0, 1]`): every load instruction
touches 32 rows (32 sectors), each word is fetched once per code (8x for 4-bit) and the
pipeliner turns them into 4-byte cp.async copies: ~64 L1 wavefronts per useful word, so
its programs wait on the load unit, not on HBM or the tensor cores.

Here each tile's words are one [BLOCK_N, BLOCK_K / PER] load, contiguous along K (16-byte
vectors), unpacked in registers (`weight_tiles._affine_tile`: affine 2/4/8-bit;
`prefill_dequant._fp_tile`: mxfp4, nvfp4, mxfp8; dense experts loaded as they are), rounded
once to the activation dtype, tl.dot with fp32 accumulation; scales / biases are loaded once
per group and prefetched a tile ahead. Optional `w_as_a`: W @ x^T (the weight the wgmma's
register operand, the block's few rows its narrow N side), as `prefill_gemm`.

Grouping: `grouped_experts.align_pairs` (pairs sorted by expert, each expert's run padded to
BLOCK_M, unused blocks -1; nothing read back on the host, capturable). Grid (blocks, column
tiles), blocks fastest: the blocks of one expert run side by side and share its weight
tiles through L2. Two launches:
* gate/up: x's rows gathered (pair // k), two accumulators, bias and the gated activation in
  the epilogue (`decode_experts._act`), h written in block order [B*BLOCK_M, F] (padding rows
  too: finite, never used), so down reads its rows without a gather;
* down: h's rows in block order, bias, the routing weight multiplied in the epilogue in
  torch's promotion (bf16 y by bf16 w rounds to bf16, else fp32), the products scattered
  to pair order; `reference.combine_products` sums the k slots with the same torch op as
  `reference.combine` (so the sum is bit for bit the other grouped paths').
Torch twins (`grouped_experts`): `moe_grouped_gate_up_ref`, `moe_grouped_down_ref`,
`moe_grouped_ref`. Under TRITON_INTERPRET the dot runs in fp32 on the exact bf16 values and
roundings use integer ops (the interpreter's cast truncates), as `prefill_gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import reference as moe_reference
from .decode_experts import ACTS, KERNEL_MODE, _gs_bias, _scales, _words_i32
from .grouped_experts import align_pairs
from .operands import ExpertQuant, check_pair
from ..matmul.codes import HAVE_TRITON
from ..matmul.generic_qmm import _interpret

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .decode_experts import _act, _expert_gs
    from ..matmul.prefill_dequant import _fp_tile
    from ..matmul.weight_tiles import _affine_tile, _round

FUSED_BITS = {"affine": (2, 4, 8), "mxfp4": (4,), "nvfp4": (4,), "mxfp8": (8,), "dense": (32,)}


@dataclass(frozen=True)
class FusedConfig:
    """Launch shape: BLOCK_M pairs of one expert x BLOCK_N output features, K tiles of
    BLOCK_K (a power of two >= 32; taken down to a divisor of K), warps, pipeline depth,
    operand order (w_as_a: W @ x^T, acc [BLOCK_N, BLOCK_M])."""
    block_m: int = 32
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    w_as_a: bool = True

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}{'_wa' if self.w_as_a else ''}")


def default_config(pairs: int, experts: int, mode: str = "affine") -> FusedConfig:
    """The H200 sweep's winners (`scripts/moe_gpu_perf.py --only grouped`, session 20; one
    Qwen3-30B-A3B MoE layer, ms): affine, few pairs per used expert (T = 16 / 64 at top-8 of
    128: 1-4): 16 x 128 x 128 at 4 warps (0.231 / 0.340 against 0.240 / 0.355 at BLOCK_K 64);
    more (T = 512 / 2048: 32-128): 64 x 128 x 64 at 8 warps (0.462 / 1.031; 32 rows: 0.501 /
    1.329). mxfp4 / nvfp4 / mxfp8: 32 x 128 x 64 at 8 warps, the one shape measured for them
    (0.28-0.59 ms against mm's 0.79-1.0 up to T = 512). 8 warps from 32 rows: sm_90 ptxas
    gives gate/up 32 x 128 x 64 254 registers a thread at 4 warps, 126 at 8."""
    if mode != "affine" and mode != "dense":
        return FusedConfig(block_m=32, num_warps=8)
    mean = pairs / max(1, min(experts, pairs))
    if mean <= 16:
        return FusedConfig(block_m=16, block_k=128, num_warps=4)
    return FusedConfig(block_m=64, num_warps=8)


def fused_takes(q: ExpertQuant) -> bool:
    """Whether the fused kernel reads this stack (whole words per tile: 2/4/8-bit codes,
    or dense experts); 3/5/6-bit stay on `grouped_experts`."""
    return q.bits in FUSED_BITS.get(q.mode, ()) and q.shape[2] % 32 == 0


# ====================================================================== Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _groups(s_ptr, b_ptr, sp, g, nmask, valid, NG: tl.constexpr, MODE: tl.constexpr):
        """Scales (and affine biases) [BN, NGT] of groups g [NGT] at offsets sp; valid:
        scalar, False -> nothing is read (the prefetch past the last tile). Dense experts:
        none (zeros, unused)."""
        if MODE == 4:
            s = tl.zeros_like(sp).to(tl.float32)
            b = s
        else:
            gmask = (nmask[:, None] & (g < NG)[None, :]) & valid
            s = tl.load(s_ptr + sp, mask=gmask, other=0)
            if MODE == 0:
                b = tl.load(b_ptr + sp, mask=gmask, other=0)
            else:
                b = s
        return s, b

    @triton.jit
    def _weight_tile(w_row, s, b, gs, k0, nmask, N, BITS: tl.constexpr, GROUP: tl.constexpr,
                     MODE: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, INTERPRET: tl.constexpr):
        """Weights [BLOCK_N, BLOCK_K] in DT at K offset k0 of rows w_row [BLOCK_N, 1] (word
        pointers; dense: value pointers): one [BLOCK_N, BLOCK_K / PER] load contiguous along
        K, unpacked in registers with the tile's scales / biases s, b [BN, NGT]."""
        PER: tl.constexpr = 32 // BITS if MODE != 4 else 1
        BW: tl.constexpr = BLOCK_K // PER
        NGT: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
        wp = w_row + (k0 // PER + tl.arange(0, BW))[None, :]
        if EVEN_N:
            wd = tl.load(wp)
        else:
            wd = tl.load(wp, mask=nmask[:, None], other=0)
        if MODE == 4:  # dense experts: the values as stored, rounded to DT
            wt = _round(wd.to(tl.float32), DT, INTERPRET)
        elif MODE == 0:
            wt = _affine_tile(wd, s, b, DT, BITS, BLOCK_N, BLOCK_K, NGT, INTERPRET, N)
        else:
            wt = _fp_tile(wd, s, gs, DT, MODE, BITS, BLOCK_N, BLOCK_K, NGT, INTERPRET)
        return wt

    @triton.jit
    def _dot(xt, wt, acc, W_AS_A: tl.constexpr, IEEE: tl.constexpr):
        """acc += x @ W^T ([BM, BN]) or, W_AS_A, W @ x^T ([BN, BM]). IEEE: fp32 products
        (fp32 activations, or the interpreter: its bf16 dot is broken)."""
        if IEEE:
            if W_AS_A:
                acc = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc,
                             input_precision="ieee")
        elif W_AS_A:
            acc = tl.dot(wt, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
        return acc

    @triton.jit
    def _rounded_plus_bias(acc, bias_ptr, off, mask, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                           INTERPRET: tl.constexpr):
        """fp32 sums rounded to DT, plus the expert bias rounded again (torch's y + bias)."""
        y = _round(acc, DT, INTERPRET).to(tl.float32)
        if HAS_BIAS:
            bb = tl.load(bias_ptr + off, mask=mask, other=0.0).to(tl.float32)
            y = _round(y + bb, DT, INTERPRET).to(tl.float32)
        return y

    @triton.jit
    def _fused_kernel(
        x_ptr, pairs_ptr, bexp_ptr, out_ptr, rw_ptr,
        aw_ptr, as_ptr, ab_ptr, ags_ptr, abias_ptr,
        bw_ptr, bs_ptr, bb_ptr, bgs_ptr, bbias_ptr,
        N, P, stride_x, alpha, limit,
        K: tl.constexpr, ROW_DIV: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        MODE: tl.constexpr, HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
        ACT: tl.constexpr, IN_BLOCKS: tl.constexpr, OUT_BLOCKS: tl.constexpr,
        WEIGHTED: tl.constexpr, ROUND_PROD: tl.constexpr, W_AS_A: tl.constexpr,
        EVEN_N: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(bexp_ptr + pid_b).to(tl.int64)
        if e < 0:  # a block past the used ones (their number is known only on the device)
            return
        PER: tl.constexpr = 32 // BITS if MODE != 4 else 1
        KW: tl.constexpr = K // PER  # words (dense: values) per weight row
        NG: tl.constexpr = K // GROUP
        NGT: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
        NT: tl.constexpr = K // BLOCK_K
        DT: tl.constexpr = x_ptr.dtype.element_ty
        slot = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + slot)
        valid = pairs < P
        if IN_BLOCKS:  # down: h already in block order
            rows = slot.to(tl.int64)
        else:  # padding rows read row 0
            rows = tl.where(valid, pairs // ROW_DIV, 0).to(tl.int64)
        x_row = x_ptr + rows[:, None] * stride_x
        rk = tl.arange(0, BLOCK_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        w_off = e * N * KW + rn[:, None].to(tl.int64) * KW
        wa_row = aw_ptr + w_off
        wb_row = bw_ptr + w_off
        s_base = e * N * NG
        gs_a = _expert_gs(ags_ptr, e, HAS_GS)
        gs_b = _expert_gs(bgs_ptr, e, HAS_GS)
        if W_AS_A:
            acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros_like(acc_a)
        # scales / biases: 2-byte loads the pipeliner leaves synchronous, so the next tile's
        # are loaded into registers while this one is computed (as prefill_gemm)
        g = tl.arange(0, NGT)
        sp = s_base + rn[:, None] * NG + g[None, :]
        sa, ba = _groups(as_ptr, ab_ptr, sp, g, nmask, True, NG, MODE)
        sb, bb = _groups(bs_ptr, bb_ptr, sp, g, nmask, GLU, NG, MODE)
        for t in range(NT):
            k0 = t * BLOCK_K
            if BLOCK_K >= GROUP:
                step = NGT
            else:
                step = ((k0 + BLOCK_K) % GROUP == 0).to(tl.int32)
            g += step
            sp += step
            sa_next, ba_next = _groups(as_ptr, ab_ptr, sp, g, nmask, t + 1 < NT, NG, MODE)
            sb_next, bb_next = _groups(bs_ptr, bb_ptr, sp, g, nmask, GLU and t + 1 < NT, NG,
                                       MODE)
            xt = tl.load(x_row + (k0 + rk)[None, :])
            wt = _weight_tile(wa_row, sa, ba, gs_a, k0, nmask, N, BITS, GROUP, MODE, DT,
                              BLOCK_N, BLOCK_K, EVEN_N, INTERPRET)
            acc_a = _dot(xt, wt, acc_a, W_AS_A, IEEE)
            if GLU:
                wt = _weight_tile(wb_row, sb, bb, gs_b, k0, nmask, N, BITS, GROUP, MODE, DT,
                                  BLOCK_N, BLOCK_K, EVEN_N, INTERPRET)
                acc_b = _dot(xt, wt, acc_b, W_AS_A, IEEE)
            sa, ba, sb, bb = sa_next, ba_next, sb_next, bb_next
        if W_AS_A:
            acc_a = tl.trans(acc_a)
            acc_b = tl.trans(acc_b)
        boff = (e * N + rn)[None, :]
        y = _rounded_plus_bias(acc_a, abias_ptr, boff, nmask[None, :], HAS_BIAS, DT, INTERPRET)
        if GLU:
            u = _rounded_plus_bias(acc_b, bbias_ptr, boff, nmask[None, :], HAS_BIAS, DT,
                                   INTERPRET)
            y = _act(y, u, alpha, limit, ACT, DT)
        if WEIGHTED:  # y * w in torch's promotion: rounded to DT when w is DT too
            w = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            y = y * w[:, None]
            if ROUND_PROD:
                y = _round(y, DT, INTERPRET).to(tl.float32)
        ODT: tl.constexpr = out_ptr.dtype.element_ty
        if OUT_BLOCKS:
            op = out_ptr + slot[:, None].to(tl.int64) * N + rn[None, :]
            tl.store(op, _round(y, ODT, INTERPRET), mask=nmask[None, :])
        else:
            op = out_ptr + pairs[:, None].to(tl.int64) * N + rn[None, :]
            tl.store(op, _round(y, ODT, INTERPRET), mask=valid[:, None] & nmask[None, :])


# ====================================================================== launchers
def _block_k(k: int, want: int) -> int:
    """The largest power of two <= want dividing K (K is a multiple of 32)."""
    bk = want
    while k % bk:
        bk //= 2
    return bk


def _launch(x: Tensor, align: tuple[Tensor, Tensor], a: ExpertQuant, b: ExpertQuant | None,
            rows: int, p: int, row_div: int, act: str, alpha: float, limit: float,
            cfg: FusedConfig, out_blocks: bool = False, weights: Tensor | None = None) -> Tensor:
    """One grouped launch -> out [rows, N] in pair order (rows = P) or block order
    (out_blocks). row_div: x's row of pair p is p // row_div (0: x in block order)."""
    _, n, k = a.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"moe_grouped_fused: input {tuple(x.shape)} does not match K = {k}")
    if not fused_takes(a):
        raise ValueError(f"moe_grouped_fused: {a.mode} {a.bits}-bit experts are not fused")
    x = x.contiguous()
    odt = x.dtype if weights is None else torch.promote_types(x.dtype, weights.dtype)
    out = torch.empty(rows, n, device=x.device, dtype=odt)
    if p == 0:
        return out
    pairs, experts = align
    ab, ags, abias = _gs_bias(a, _scales(a))
    bq = b if b is not None else a
    bb, bgs, bbias = _gs_bias(bq, _scales(bq))
    rw = weights.contiguous() if weights is not None else out
    grid = (experts.shape[0], triton.cdiv(n, cfg.block_n))
    _fused_kernel[grid](
        x, pairs, experts, out, rw, _words_i32(a.w), _scales(a), ab, ags, abias,
        _words_i32(bq.w), _scales(bq), bb, bgs, bbias, n, p, x.stride(0), float(alpha),
        float(limit), K=k, ROW_DIV=max(1, row_div),
        BITS=a.bits, GROUP=a.group, MODE=KERNEL_MODE[a.mode],
        HAS_GS=a.global_scale is not None, HAS_BIAS=a.bias is not None, GLU=b is not None,
        ACT=ACTS[act], IN_BLOCKS=row_div == 0, OUT_BLOCKS=out_blocks,
        WEIGHTED=weights is not None, ROUND_PROD=odt == x.dtype != torch.float32,
        W_AS_A=cfg.w_as_a, EVEN_N=n % cfg.block_n == 0,
        IEEE=_interpret() or x.dtype == torch.float32, INTERPRET=_interpret(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=_block_k(k, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _checked(ids: Tensor, gate: ExpertQuant, up: ExpertQuant | None, act: str,
             config: FusedConfig | None) -> FusedConfig:
    if up is not None:
        check_pair(gate, up)
    if act not in ACTS:
        raise ValueError(f"unknown expert activation {act!r}")
    return config or default_config(ids.numel(), gate.shape[0], gate.mode)


def moe_fused_gate_up(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant, act: str,
                      alpha: float = 1.702, limit: float = 7.0,
                      config: FusedConfig | None = None) -> Tensor:
    """h [T*k, F] in pair order, as `grouped_experts.moe_grouped_gate_up` (twin:
    `moe_grouped_gate_up_ref`)."""
    cfg = _checked(ids, gate, up, act, config)
    align = align_pairs(ids, gate.shape[0], cfg.block_m)
    p = ids.numel()
    return _launch(x, align, gate, up, p, p, ids.shape[1], act, alpha, limit, cfg)


def moe_fused_down(h: Tensor, ids: Tensor, down: ExpertQuant,
                   config: FusedConfig | None = None) -> Tensor:
    """y [T*k, E]: row p of h [T*k, F] through expert ids.flat[p] (+ its bias), h.dtype
    (twin: `moe_grouped_down_ref`)."""
    cfg = _checked(ids, down, None, "silu", config)
    align = align_pairs(ids, down.shape[0], cfg.block_m)
    p = ids.numel()
    return _launch(h, align, down, None, p, p, 1, "silu", 0.0, 0.0, cfg)


def moe_grouped_fused(x: Tensor, ids: Tensor, weights: Tensor, gate: ExpertQuant,
                      up: ExpertQuant, down: ExpertQuant, act: str, alpha: float, limit: float,
                      out_dtype: torch.dtype, routed_scale: float = 1.0,
                      config: FusedConfig | None = None) -> Tensor:
    """The routed experts' weighted sum [T, E] for x [T, E_in], ids / weights [T, k]:
    `grouped_experts.moe_grouped`'s contract (twin: `moe_grouped_ref`). One alignment, the
    two launches (h in block order between them), the slot sum of the weighted products."""
    cfg = _checked(ids, gate, up, act, config)
    if down.shape[2] != gate.shape[1] or weights.shape != ids.shape:
        raise ValueError(f"moe_grouped_fused: down {down.shape}, weights "
                         f"{tuple(weights.shape)} do not fit F = {gate.shape[1]}, ids "
                         f"{tuple(ids.shape)}")
    t, k = ids.shape
    align = align_pairs(ids, gate.shape[0], cfg.block_m)
    p = t * k
    if p == 0:
        return torch.zeros(t, down.shape[1], device=x.device, dtype=out_dtype)
    h = _launch(x, align, gate, up, align[0].shape[0], p, k, act, alpha, limit, cfg,
                out_blocks=True)
    prod = _launch(h, align, down, None, p, p, 0, "silu", 0.0, 0.0, cfg, weights=weights)
    return moe_reference.combine_products(prod.view(t, k, -1), out_dtype, routed_scale)
