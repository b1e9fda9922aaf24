"""Prefill / large-batch MoE: (token, slot) pairs grouped by expert, one grouped GEMM launch
for gate/up (activation fused) and one for down; the weighted sum over top-k in torch.

Grouping (`align_pairs`, torch ops on the device, in the spirit of vLLM's moe_align_block_size):
the T*k pairs sorted by expert (stable: token order inside an expert), each expert's run padded
to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert. The number of
blocks is bounded by shapes alone, B = ceil(P / BLOCK_M) + min(X, P) (each used expert wastes
at most one partial block): the buffers have fixed sizes, nothing is read back on the host and
the whole step can be captured in a CUDA graph (the serving engine's batched decode buckets
take this path once T*k exceeds `decode_experts.MAX_PAIRS`). Unused blocks carry expert -1
and their programs return at once.

The kernel (`_grouped_kernel`): program (block b, column tile n) loads its expert id, gathers
its BLOCK_M pairs' input rows (x[pair // k] for gate/up, h[pair] for down), and runs the K loop
of `generic_qmm._qgemm_kernel`: each weight tile dequantized by the shared `_dequant_tile` (every
quant mode), rounded once to the activation dtype, tl.dot with fp32 accumulation. gate/up keep
two accumulators and apply the bias and activation in the epilogue (`decode_experts._act`),
so h is written once. Rows are scattered back to pair order; `moe_reference.combine` then sums
the k slots (the reference's order, deterministic, no atomics).

Why a kernel and not dequant + torch matmul per expert: not measured against each other on the
H200 yet. The per-expert loop needs each expert's row count on the host (one sync per layer)
and ~3 launches per used expert (qwen3-30b-a3b prefill: ~128 experts x 48 layers ~ 18k
launches); it also cannot be captured. The kernel reads each used expert's weights once per
column tile and row block, like the dense prefill GEMM.

Torch twins with the same signatures: `moe_grouped_gate_up_ref`, `moe_grouped_down_ref`,
`moe_grouped_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import reference as moe_reference
from .operands import ExpertQuant, check_pair
from .decode_experts import ACTS, KERNEL_MODE, _gs_bias, _scales, _words_i32, expert_matmul_ref
from ..matmul.codes import HAVE_TRITON
from ..matmul.generic_qmm import _interpret

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .decode_experts import _act, _biased, _expert_gs
    from ..matmul.codes import _dequant_tile


@dataclass(frozen=True)
class GroupedConfig:
    """Launch shape: BLOCK_M pairs of one expert x BLOCK_N output features, K tiles of BLOCK_K
    (64: a multiple or a divisor of every group size 16..128)."""
    block_m: int = 32
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(pairs: int, experts: int) -> GroupedConfig:
    """BLOCK_M near the mean pairs per used expert (16..64): few padding rows at decode-sized
    batches, full tensor-core tiles at long prompts. Untuned (no H200 sweep yet)."""
    mean = pairs / max(1, min(experts, pairs))
    bm = 16 if mean <= 16 else (32 if mean <= 48 else 64)
    return GroupedConfig(block_m=bm)


def align_pairs(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """ids [T, k] (device long) -> (pairs int32 [B*block_m]: pair indices grouped by expert,
    each expert's run padded to whole blocks with the sentinel P = T*k; experts int32 [B]:
    each block's expert, -1 past the used blocks). B = ceil(P/block_m) + min(X, P)."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    nb = -(-p // block_m) + min(num_experts, p)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount without its host read of max(ids)
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)  # [P] the sorted pairs' experts
    blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)  # [X] each expert's end, in blocks
    first = torch.cumsum(counts, 0) - counts  # [X] each expert's first sorted pair
    dest = ((ends - blocks).index_select(0, expert) * block_m
            + torch.arange(p, device=dev) - first.index_select(0, expert))
    pairs = torch.full((nb * block_m,), p, dtype=torch.int32, device=dev)
    pairs.index_copy_(0, dest, order.to(torch.int32))
    b = torch.arange(nb, device=dev)
    owner = torch.searchsorted(ends, b, right=True)
    experts = torch.where(b < ends[-1], owner, -1).to(torch.int32)
    return pairs, experts


# ====================================================================== torch twins
def moe_grouped_gate_up_ref(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant,
                            act: str, alpha: float = 1.702, limit: float = 7.0,
                            config: GroupedConfig | None = None) -> Tensor:
    """Twin of `moe_grouped_gate_up` (config ignored): the decode twin with the weights
    rounded to x.dtype before the fp32 matmul."""
    k = ids.shape[1]
    xs = x.repeat_interleave(k, dim=0)
    pe = ids.reshape(-1)
    g = expert_matmul_ref(xs, pe, gate, x.dtype, round_weights=True)
    u = expert_matmul_ref(xs, pe, up, x.dtype, round_weights=True)
    return moe_reference.expert_act(g, u, act, alpha, limit)


def moe_grouped_down_ref(h: Tensor, ids: Tensor, down: ExpertQuant,
                         config: GroupedConfig | None = None) -> Tensor:
    """Twin of `moe_grouped_down`: y [T*k, E], row p through expert ids.flat[p]."""
    return expert_matmul_ref(h, ids.reshape(-1), down, h.dtype, round_weights=True)


def moe_grouped_ref(x: Tensor, ids: Tensor, weights: Tensor, gate: ExpertQuant,
                    up: ExpertQuant, down: ExpertQuant, act: str, alpha: float, limit: float,
                    out_dtype: torch.dtype, routed_scale: float = 1.0,
                    config: GroupedConfig | None = None) -> Tensor:
    """Twin of `moe_grouped`."""
    h = moe_grouped_gate_up_ref(x, ids, gate, up, act, alpha, limit)
    y = moe_grouped_down_ref(h, ids, down).reshape(*ids.shape, -1)
    return moe_reference.combine(y, weights, out_dtype, routed_scale)


# ====================================================================== Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _weight_tile(wrow, srow, s_ptr, b_ptr, gs, kk, k0, nmask, kmask, K: tl.constexpr,
                     BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The [BLOCK_N, BLOCK_K] weight tile at K offset k0: `_dequant_tile` of packed codes,
        or (MODE 4, dense experts: wrow at float rows of K values) the values as stored."""
        if MODE == 4:
            w = tl.load(wrow + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        else:
            w = _dequant_tile(wrow, srow, s_ptr, b_ptr, gs, kk, k0, nmask,
                              kmask, K, BITS, GROUP, MODE, BLOCK_N, BLOCK_K)
        return w

    @triton.jit
    def _grouped_kernel(
        x_ptr, pairs_ptr, bexp_ptr, out_ptr,
        aw_ptr, as_ptr, ab_ptr, ags_ptr, abias_ptr,
        bw_ptr, bs_ptr, bb_ptr, bgs_ptr, bbias_ptr,
        N, P, stride_x, alpha, limit,
        K: tl.constexpr, ROW_DIV: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        MODE: tl.constexpr, HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr,
        GLU: tl.constexpr, ACT: tl.constexpr, DOT_IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(bexp_ptr + pid_b).to(tl.int64)
        if e < 0:  # a block past the used ones (their number is known only on the device)
            return
        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        NT: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        DT: tl.constexpr = out_ptr.dtype.element_ty
        pairs = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < P
        rows = tl.where(valid, pairs // ROW_DIV, 0).to(tl.int64)  # padding rows read row 0
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rk = tl.arange(0, BLOCK_K)
        wrow_a = aw_ptr + e * N * KWORDS + rn[:, None].to(tl.int64) * KWORDS
        wrow_b = bw_ptr + e * N * KWORDS + rn[:, None].to(tl.int64) * KWORDS
        srow = e * N * NG + rn[:, None].to(tl.int64) * NG
        gs_a = _expert_gs(ags_ptr, e, HAS_GS)
        gs_b = _expert_gs(bgs_ptr, e, HAS_GS)
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(NT):
            k0 = t * BLOCK_K
            kk = k0 + rk
            kmask = kk < K
            xt = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=kmask[None, :],
                         other=0.0)
            wa = _weight_tile(wrow_a, srow, as_ptr, ab_ptr, gs_a, kk, k0, nmask, kmask, K,
                              BITS, GROUP, MODE, BLOCK_N, BLOCK_K).to(xt.dtype)
            if DOT_IEEE:  # fp32 activations, or the interpreter (its bf16 dot is broken)
                acc_a = tl.dot(xt.to(tl.float32), tl.trans(wa.to(tl.float32)), acc_a,
                               input_precision="ieee")
            else:
                acc_a = tl.dot(xt, tl.trans(wa), acc_a)
            if GLU:
                wb = _weight_tile(wrow_b, srow, bs_ptr, bb_ptr, gs_b, kk, k0, nmask, kmask, K,
                                  BITS, GROUP, MODE, BLOCK_N, BLOCK_K).to(xt.dtype)
                if DOT_IEEE:
                    acc_b = tl.dot(xt.to(tl.float32), tl.trans(wb.to(tl.float32)), acc_b,
                                   input_precision="ieee")
                else:
                    acc_b = tl.dot(xt, tl.trans(wb), acc_b)
        boff = (e * N + rn)[None, :]
        y = _biased(acc_a, abias_ptr, boff, nmask[None, :], HAS_BIAS, DT)
        if GLU:
            u = _biased(acc_b, bbias_ptr, boff, nmask[None, :], HAS_BIAS, DT)
            y = _act(y, u, alpha, limit, ACT, DT)
        op = out_ptr + pairs[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(op, y.to(DT), mask=valid[:, None] & nmask[None, :])


# ====================================================================== launchers
def _launch(x: Tensor, align: tuple[Tensor, Tensor], a: ExpertQuant, b: ExpertQuant | None,
            row_div: int, p: int, act: str, alpha: float, limit: float,
            cfg: GroupedConfig) -> Tensor:
    _, n, k = a.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"moe_grouped: input {tuple(x.shape)} does not match K = {k}")
    x = x.contiguous()
    out = torch.empty(p, n, device=x.device, dtype=x.dtype)
    if p == 0:
        return out
    pairs, experts = align
    ab, ags, abias = _gs_bias(a, _scales(a))
    bq = b if b is not None else a
    bb, bgs, bbias = _gs_bias(bq, _scales(bq))
    grid = (experts.shape[0], triton.cdiv(n, cfg.block_n))
    _grouped_kernel[grid](
        x, pairs, experts, out, _words_i32(a.w), _scales(a), ab, ags, abias,
        _words_i32(bq.w), _scales(bq), bb, bgs, bbias, n, p, x.stride(0), float(alpha),
        float(limit), K=k, ROW_DIV=row_div, BITS=a.bits, GROUP=a.group, MODE=KERNEL_MODE[a.mode],
        HAS_GS=a.global_scale is not None, HAS_BIAS=a.bias is not None, GLU=b is not None,
        ACT=ACTS[act], DOT_IEEE=x.dtype == torch.float32 or _interpret(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _config(ids: Tensor, q: ExpertQuant, config: GroupedConfig | None) -> GroupedConfig:
    return config or default_config(ids.numel(), q.shape[0])


def moe_grouped_gate_up(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant, act: str,
                        alpha: float = 1.702, limit: float = 7.0,
                        config: GroupedConfig | None = None) -> Tensor:
    """h [T*k, F] as `decode_experts.moe_gate_up` (pair order), by the grouped GEMM."""
    check_pair(gate, up)
    if act not in ACTS:
        raise ValueError(f"unknown expert activation {act!r}")
    cfg = _config(ids, gate, config)
    align = align_pairs(ids, gate.shape[0], cfg.block_m)
    return _launch(x, align, gate, up, ids.shape[1], ids.numel(), act, alpha, limit, cfg)


def moe_grouped_down(h: Tensor, ids: Tensor, down: ExpertQuant,
                     config: GroupedConfig | None = None) -> Tensor:
    """y [T*k, E]: row p of h [T*k, F] through expert ids.flat[p] (+ its bias), h.dtype."""
    cfg = _config(ids, down, config)
    align = align_pairs(ids, down.shape[0], cfg.block_m)
    return _launch(h, align, down, None, 1, ids.numel(), "silu", 0.0, 0.0, cfg)


def moe_grouped(x: Tensor, ids: Tensor, weights: Tensor, gate: ExpertQuant, up: ExpertQuant,
                down: ExpertQuant, act: str, alpha: float, limit: float,
                out_dtype: torch.dtype, routed_scale: float = 1.0,
                config: GroupedConfig | None = None) -> Tensor:
    """The routed experts' weighted sum [T, E] for x [T, E_in], ids / weights [T, k]: one
    alignment, the two grouped launches, `moe_reference.combine`."""
    check_pair(gate, up)
    if act not in ACTS:
        raise ValueError(f"unknown expert activation {act!r}")
    cfg = _config(ids, gate, config)
    align = align_pairs(ids, gate.shape[0], cfg.block_m)
    p, k = ids.numel(), ids.shape[1]
    h = _launch(x, align, gate, up, k, p, act, alpha, limit, cfg)
    y = _launch(h, align, down, None, 1, p, "silu", 0.0, 0.0, cfg)
    return moe_reference.combine(y.reshape(*ids.shape, -1), weights, out_dtype, routed_scale)
