"""Split-K / pair-parallel variants of the decode MoE kernels (`decode_experts`), and their
launch configuration.

The fused decode kernels give each program a whole row of K (gate/up: grid P x F/BLOCK_N;
down: grid T x E/BLOCK_N, the k slots looped inside): at b = 1 (P = 8) that is a few hundred
programs, each streaming K serially. Here each (pair, row tile, K chunk) is one program that
writes fp32 partial sums [S, P, N]; a second, small launch sums the S chunks in a fixed order
(s = 0..S-1: deterministic, no atomics) and applies what the fused kernels apply after their
sums: gate/up the rounding, bias and activation; down the rounding, bias, routing weight and
the sum over slots in slot order (`moe_reference.combine`'s order), the routed scale.
The only numeric difference to the fused kernels is the fp32 summation order of each row.

Config (`DecodeConfig`, env per projection, "block_n,split,num_warps"):
MLXR_MOE_GATE_UP (default 32,4,4; split 1: the fused kernel) and MLXR_MOE_DOWN (default
32,1,4; split 0: the fused kernel; 1: pair-parallel without a K split);
MLXR_MOE_DECODE=split puts decode steps on these kernels (the default is `decode_onepass`);
MLXR_MOE_DECODE_MAX_PAIRS: the most pairs served by the decode kernels (default
`decode_experts.MAX_PAIRS` here, `ONEPASS_MAX_PAIRS` for onepass). Twins:
`decode_experts.moe_gate_up_ref` and `moe_down_ref` (same signatures but the config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from . import decode_experts as D
from .operands import ExpertQuant, check_pair
from ..matmul.codes import HAVE_TRITON
from ..matmul.generic_qmm import _next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .decode_experts import _act, _biased, _expert_gs, _expert_rows


@dataclass(frozen=True)
class DecodeConfig:
    """block_n: rows per program (None: `decode_experts._block`); split: K chunks (gate/up:
    1 = the fused kernel; down: 0 = the fused kernel, >= 1 pair-parallel); num_warps."""
    block_n: int | None = None
    split: int = 1
    num_warps: int = 4


# Measured on the H200 (scripts/moe_gpu_perf.py, Qwen3-30B-A3B experts, 4-bit g64, bf16, in
# CUDA graphs): b=1 gate/up+down 0.033 ms/layer fused -> 0.027 with down pair-parallel (32,1,4);
# b=2 0.047 -> 0.040 with gate/up split 4 (32,4,4); the 8-layer decode 1,384 -> 1,578 tok/s.
# Laguna's shape (nvfp4, 256 experts) was not swept: it takes the same launch.
GATE_UP_DEFAULT = DecodeConfig(32, 4, 4)
DOWN_DEFAULT = DecodeConfig(32, 1, 4)


def _parse(name: str, default: DecodeConfig) -> DecodeConfig:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    bn, split, warps = (int(v) for v in raw.split(","))
    return DecodeConfig(bn or None, split, warps)


def gate_up_config() -> DecodeConfig:
    return _parse("MLXR_MOE_GATE_UP", GATE_UP_DEFAULT)


def down_config() -> DecodeConfig:
    return _parse("MLXR_MOE_DOWN", DOWN_DEFAULT)


# The most (token, slot) pairs the onepass kernels serve by default: on an H100 (session 23,
# scripts/moe_decode_gpu.py) they beat the engine's dispatch of the time up to 64 pairs
# (Qwen3-30B-A3B layer, k = 8: T = 1 22.4 -> 19.7 us, T = 4 127.1 -> 59.8, T = 8 152.9 ->
# 111.4, where the grouped GEMM served past 16 pairs) and lost at 128 (192.4 -> 210.1).
ONEPASS_MAX_PAIRS = 64


def decode_kernels() -> str:
    """The decode kernels (MLXR_MOE_DECODE, read at each call): "onepass" (the default:
    `decode_onepass`, one launch per projection) or "split" (this module: partials, then a
    finishing launch; at the default configs the same sums, bit for bit)."""
    return os.environ.get("MLXR_MOE_DECODE", "onepass").lower()


def decode_max_pairs(kernels: str | None = None) -> int:
    """The most (token, slot) pairs the decode kernels serve (MLXR_MOE_DECODE_MAX_PAIRS;
    default `ONEPASS_MAX_PAIRS` for onepass, `decode_experts.MAX_PAIRS` for split);
    `kernels`: `decode_kernels()` where the caller has read it already."""
    kernels = decode_kernels() if kernels is None else kernels
    default = ONEPASS_MAX_PAIRS if kernels == "onepass" else D.MAX_PAIRS
    return int(os.environ.get("MLXR_MOE_DECODE_MAX_PAIRS", str(default)))


def chunks(k: int, group: int, split: int) -> int:
    """The K chunks used: the largest divisor of the K / group groups not above split."""
    ng = k // group
    s = max(1, min(split, ng))
    while ng % s:
        s -= 1
    return s


if HAVE_TRITON:

    @triton.jit
    def _partial_kernel(
        x_ptr, ids_ptr, part_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, N, P, stride_x,
        K: tl.constexpr, KC: tl.constexpr, ROW_DIV: tl.constexpr, BITS: tl.constexpr,
        GROUP: tl.constexpr, MODE: tl.constexpr, HAS_GS: tl.constexpr,
        BLOCK_N: tl.constexpr, GT: tl.constexpr,
    ):
        """part[s, p, rn] = rows rn of expert ids.flat[p] over K chunk s, dotted with the
        chunk of x[p // ROW_DIV] (fp32)."""
        p = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        sk = tl.program_id(2)
        e = tl.load(ids_ptr + p).to(tl.int64)
        WX: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        k0 = sk * KC
        xrow = x_ptr + (p // ROW_DIV).to(tl.int64) * stride_x + k0
        so = e * N * NG + k0 // GROUP
        acc = _expert_rows(xrow, w_ptr + e * N * WX + k0 * BITS // 32, s_ptr + so, b_ptr + so,
                           _expert_gs(gs_ptr, e, HAS_GS), rn, N, K, BITS, GROUP, MODE,
                           BLOCK_N, GT, KC)
        tl.store(part_ptr + (sk * P + p).to(tl.int64) * N + rn, acc, mask=rn < N)

    @triton.jit
    def _gate_up_finish(gp_ptr, up_ptr, ids_ptr, h_ptr, gbias_ptr, ubias_ptr, F, P, alpha,
                        limit, S: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        """h[p] = act(round(sum_s gate part) + bias, ...) as `_gate_up_kernel`'s epilogue."""
        p = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < F
        e = tl.load(ids_ptr + p).to(tl.int64)
        DT: tl.constexpr = h_ptr.dtype.element_ty
        g = tl.zeros([BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(S):  # fixed order: deterministic
            off = (s * P + p).to(tl.int64) * F + rn
            g += tl.load(gp_ptr + off, mask=nmask, other=0.0)
            u += tl.load(up_ptr + off, mask=nmask, other=0.0)
        g = _biased(g, gbias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
        u = _biased(u, ubias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
        h = _act(g, u, alpha, limit, ACT, DT)
        tl.store(h_ptr + p.to(tl.int64) * F + rn, h.to(DT), mask=nmask)

    @triton.jit
    def _down_finish(part_ptr, h_ptr, ids_ptr, rw_ptr, y_ptr, bias_ptr, E, P, routed_scale,
                     S: tl.constexpr, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ROUND_PROD: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr):
        """y[t] = sum over slots j (in order) of round(sum_s part[s, t*k + j]) (+ bias) times
        the routing weight, as `_down_kernel`'s epilogue."""
        t = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < E
        DT: tl.constexpr = h_ptr.dtype.element_ty  # the activation dtype (h is not read)
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            pj = t * TOPK + j
            e = tl.load(ids_ptr + pj).to(tl.int64)
            wt = tl.load(rw_ptr + pj).to(tl.float32)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(S):
                acc += tl.load(part_ptr + (s * P + pj) * E + rn, mask=nmask, other=0.0)
            y = _biased(acc, bias_ptr, e * E + rn, nmask, HAS_BIAS, DT) * wt
            if ROUND_PROD:
                y = y.to(DT).to(tl.float32)
            out += y
        ODT: tl.constexpr = y_ptr.dtype.element_ty
        if SCALED:
            out = out.to(ODT).to(tl.float32) * routed_scale
        tl.store(y_ptr + t * E + rn, out.to(ODT), mask=nmask)


# ====================================================================== launchers
def _partials(x: Tensor, ids: Tensor, q: ExpertQuant, row_div: int, cfg: DecodeConfig,
              out: Tensor) -> None:
    """out [S, P, N] fp32 <- the K-chunk partial sums of each pair's rows (x row p // row_div)."""
    _, n, k = q.shape
    s, p = out.shape[0], out.shape[1]
    kc = k // s
    bn = cfg.block_n or D._block(n, p * s, x.device)
    b, gs, _ = D._gs_bias(q, D._scales(q))
    _partial_kernel[(p, triton.cdiv(n, bn), s)](
        x, ids, out, D._words_i32(q.w), D._scales(q), b, gs, n, p, x.stride(0), K=k, KC=kc,
        ROW_DIV=row_div, BITS=q.bits, GROUP=q.group, MODE=D.KERNEL_MODE[q.mode],
        HAS_GS=q.global_scale is not None, BLOCK_N=bn, GT=D._gt(kc, q.bits, q.group),
        num_warps=cfg.num_warps)


def _finish_block(n: int) -> int:
    return min(256, _next_pow2(n))


def moe_gate_up_split(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant, act: str,
                      alpha: float = 1.702, limit: float = 7.0,
                      config: DecodeConfig | None = None) -> Tensor:
    """`decode_experts.moe_gate_up` with the launch config (split <= 1: the fused kernel;
    else K in `chunks` parts, fp32 partials, then the ordered sum and the epilogue)."""
    cfg = config or gate_up_config()
    check_pair(gate, up)
    if act not in D.ACTS:
        raise ValueError(f"unknown expert activation {act!r}")
    _, f, k = gate.shape
    s = chunks(k, gate.group, cfg.split)
    if s <= 1:
        return D.moe_gate_up(x, ids, gate, up, act, alpha, limit, cfg.block_n, cfg.num_warps)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"moe_gate_up: x {tuple(x.shape)} does not match K = {k}")
    t, topk = ids.shape
    p = t * topk
    x, ids = x.contiguous(), ids.contiguous()
    h = torch.empty(p, f, device=x.device, dtype=x.dtype)
    if p == 0:
        return h
    part = torch.empty(2, s, p, f, device=x.device, dtype=torch.float32)
    _partials(x, ids, gate, topk, cfg, part[0])
    _partials(x, ids, up, topk, cfg, part[1])
    _, _, gbias = D._gs_bias(gate, D._scales(gate))
    _, _, ubias = D._gs_bias(up, D._scales(up))
    fb = _finish_block(f)
    _gate_up_finish[(p, triton.cdiv(f, fb))](
        part[0], part[1], ids, h, gbias, ubias, f, p, float(alpha), float(limit), S=s,
        HAS_BIAS=gate.bias is not None, ACT=D.ACTS[act], BLOCK_N=fb, num_warps=4)
    return h


def moe_down_split(h: Tensor, ids: Tensor, weights: Tensor, down: ExpertQuant,
                   out_dtype: torch.dtype, routed_scale: float = 1.0,
                   config: DecodeConfig | None = None) -> Tensor:
    """`decode_experts.moe_down` with the launch config (split 0: the fused kernel; else one
    program per (pair, row tile, K chunk), then the ordered sums over chunks and slots)."""
    cfg = config or down_config()
    if cfg.split <= 0:
        return D.moe_down(h, ids, weights, down, out_dtype, routed_scale, cfg.block_n,
                          cfg.num_warps)
    h, ids, weights, y = D.down_operands(h, ids, weights, down, out_dtype)
    _, e, f = down.shape
    t, topk = ids.shape
    if t == 0:
        return y
    s, p = chunks(f, down.group, cfg.split), t * topk
    part = torch.empty(s, p, e, device=h.device, dtype=torch.float32)
    _partials(h, ids, down, 1, cfg, part)
    _, _, bias = D._gs_bias(down, D._scales(down))
    fb = _finish_block(e)
    _down_finish[(t, triton.cdiv(e, fb))](
        part, h, ids, weights, y, bias, e, p, float(routed_scale), S=s, TOPK=topk,
        HAS_BIAS=down.bias is not None, ROUND_PROD=weights.dtype == h.dtype != torch.float32,
        SCALED=routed_scale != 1.0, BLOCK_N=fb, num_warps=4)
    return y
