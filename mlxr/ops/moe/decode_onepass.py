"""One-launch split-K decode MoE kernels: gate/up (+ activation) in one launch, down + the
weighted combine over top-k in one launch, the K reduction spread over many programs.

`decode_split` spreads each pair's rows over K chunks too, but needs a second launch to sum the
chunks (and gate and up go as two launches): 3 + 2 launches per MoE block, each a bubble in a
CUDA graph at batch 1. Here every program (pair p, row tile, K chunk s) stores its fp32 partial
sums [BLOCK_N] and then takes a ticket from an int32 counter of its output tile (an integer
atomic, acq_rel at GPU scope, after a CTA barrier: the threadfence-reduction pattern). The
program that draws the last ticket reads every chunk's partials of the tile in the fixed order
s = 0..S-1 (and, for down, the slots j = 0..k-1 in order), applies the fused kernels' epilogue
and resets the counter to zero for the next launch. The sums are therefore deterministic and
independent of which program finished last, of the other tokens in the batch (a tile holds
one token's pairs only) and of the launch order: no float atomics.

* `moe_gate_up_onepass`: grid (P, F / BLOCK_N, S); a program reads gate and up rows of its
  chunk in one tile loop (`decode_rows`); counter per (pair, tile), S tickets; S = 1 stores
  h directly (no counter).
* `moe_down_onepass`: grid (P, E / BLOCK_N, S); counter per (token, tile), k * S tickets; the
  last sums each slot's chunks, rounds (+ bias), times the routing weight, adds the slots in
  slot order, the routed scale after the cast (`decode_experts._down_kernel`'s epilogue).
* `shared=`: a shared expert (one-expert stacks of the routed format and shape,
  `shared_fits`) rides along as T more rows of h (grid P + T) and one more ticket per down
  tile; down's last program adds its output as `MoeBlock` does.

The counters are `mlxr.ops.tickets`' (a region per kernel; `fits` says whether a step's tiles
fit); every launch leaves its counters at zero.
Numerics equal `decode_split`'s at the same config (the same sums per chunk, the same ordered
chunk sum: bit-equal in the interpreter tests), so the decode tests' bounds hold. Twins:
`decode_experts.moe_gate_up_ref` and `moe_down_ref`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import decode_experts as D
from .decode_split import DecodeConfig, chunks
from .operands import ExpertQuant, check_pair
from .. import tickets
from ..matmul.codes import HAVE_TRITON
from ..tickets import counters  # noqa: F401 (the tests read the counters here)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .decode_experts import _act, _biased, _expert_gs
    from .decode_rows import _pair_quant_rows, _rows

# gate and up in one tile loop (`decode_rows`; False: two `_rows` loops, for A/B)
PAIRED = True
TILES = tickets.REGION  # output tiles a launch may count (its region's counters)


if HAVE_TRITON:

    @triton.jit
    def _last_ticket(ctr_ptr, TICKETS: tl.constexpr):
        """Whether this program drew the last of its counter's TICKETS tickets (its partial
        sums stored before: a CTA barrier, then the acq_rel atomic at GPU scope)."""
        tl.debug_barrier()
        done = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")
        return done == TICKETS - 1

    @triton.jit
    def _pair_rows(xrow, e, rn, k0, gw_ptr, gsc_ptr, gb_ptr, ggs_ptr, uw_ptr, usc_ptr, ub_ptr,
                   ugs_ptr, F, K: tl.constexpr, KC: tl.constexpr, BITS: tl.constexpr,
                   GROUP: tl.constexpr, MODE: tl.constexpr, HAS_GS: tl.constexpr,
                   BLOCK_N: tl.constexpr, GT: tl.constexpr, PAIRED: tl.constexpr):
        """fp32 gate and up sums [BLOCK_N] of rows rn of expert e over K chunk k0.. (PAIRED:
        in one tile loop, `decode_rows`; dense experts always apart)."""
        WX: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        wo = e * F * WX + k0 * BITS // 32
        so = e * F * NG + k0 // GROUP
        ggs = _expert_gs(ggs_ptr, e, HAS_GS)
        ugs = _expert_gs(ugs_ptr, e, HAS_GS)
        if PAIRED and MODE != 4:
            g, u = _pair_quant_rows(xrow, gw_ptr + wo, gsc_ptr + so, gb_ptr + so, ggs,
                                    uw_ptr + wo, usc_ptr + so, ub_ptr + so, ugs, rn, F, K,
                                    BITS, GROUP, MODE, BLOCK_N, GT, KC)
        else:
            g = _rows(xrow, gw_ptr + wo, gsc_ptr + so, gb_ptr + so, ggs, rn, F, K, BITS, GROUP,
                      MODE, BLOCK_N, GT, KC)
            u = _rows(xrow, uw_ptr + wo, usc_ptr + so, ub_ptr + so, ugs, rn, F, K, BITS, GROUP,
                      MODE, BLOCK_N, GT, KC)
        return g, u

    @triton.jit
    def _gate_up_onepass_kernel(
        x_ptr, ids_ptr, part_ptr, ctr_ptr, h_ptr,
        gw_ptr, gsc_ptr, gb_ptr, ggs_ptr, gbias_ptr,
        uw_ptr, usc_ptr, ub_ptr, ugs_ptr, ubias_ptr,
        sgw_ptr, sgsc_ptr, sgb_ptr, sggs_ptr, suw_ptr, susc_ptr, sub_ptr, sugs_ptr,
        F, P, stride_x, alpha, limit,
        K: tl.constexpr, KC: tl.constexpr, S: tl.constexpr, TOPK: tl.constexpr,
        BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_GS: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, GT: tl.constexpr,
        SHARED: tl.constexpr, PAIRED: tl.constexpr,
    ):
        """h[p, rn] = act(gate, up) of pair p's rows rn (SHARED: rows P + t are token t's
        shared expert, the s* stacks of one expert); part [2, S, rows of h, F] fp32."""
        p = tl.program_id(0)
        tile = tl.program_id(1)
        sk = tl.program_id(2)
        NP = tl.num_programs(0)  # rows of h
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < F
        DT: tl.constexpr = h_ptr.dtype.element_ty
        k0 = sk * KC
        if SHARED and p >= P:
            e = tl.zeros([], dtype=tl.int64)
            xrow = x_ptr + (p - P).to(tl.int64) * stride_x + k0
            g, u = _pair_rows(xrow, e, rn, k0, sgw_ptr, sgsc_ptr, sgb_ptr, sggs_ptr, suw_ptr,
                              susc_ptr, sub_ptr, sugs_ptr, F, K, KC, BITS, GROUP, MODE,
                              HAS_GS, BLOCK_N, GT, PAIRED)
        else:
            e = tl.load(ids_ptr + p).to(tl.int64)
            xrow = x_ptr + (p // TOPK).to(tl.int64) * stride_x + k0
            g, u = _pair_rows(xrow, e, rn, k0, gw_ptr, gsc_ptr, gb_ptr, ggs_ptr, uw_ptr,
                              usc_ptr, ub_ptr, ugs_ptr, F, K, KC, BITS, GROUP, MODE, HAS_GS,
                              BLOCK_N, GT, PAIRED)
        hp = h_ptr + p.to(tl.int64) * F + rn
        if S == 1:
            g = _biased(g, gbias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
            u = _biased(u, ubias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
            tl.store(hp, _act(g, u, alpha, limit, ACT, DT).to(DT), mask=nmask)
        else:
            off = (sk * NP + p).to(tl.int64) * F + rn
            tl.store(part_ptr + off, g, mask=nmask)
            tl.store(part_ptr + S * NP * F + off, u, mask=nmask)
            cp = ctr_ptr + p * tl.num_programs(1) + tile
            if _last_ticket(cp, S):
                g = tl.zeros([BLOCK_N], dtype=tl.float32)
                u = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(S):  # fixed order: deterministic
                    o = (s * NP + p).to(tl.int64) * F + rn
                    g += tl.load(part_ptr + o, mask=nmask, other=0.0, cache_modifier=".cg")
                    u += tl.load(part_ptr + S * NP * F + o, mask=nmask, other=0.0,
                                 cache_modifier=".cg")
                g = _biased(g, gbias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
                u = _biased(u, ubias_ptr, e * F + rn, nmask, HAS_BIAS, DT)
                tl.store(hp, _act(g, u, alpha, limit, ACT, DT).to(DT), mask=nmask)
                tl.store(cp, 0)

    @triton.jit
    def _down_rows(hrow, e, rn, k0, w_ptr, s_ptr, b_ptr, gs_ptr, E, F: tl.constexpr,
                   FC: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   MODE: tl.constexpr, HAS_GS: tl.constexpr, BLOCK_N: tl.constexpr,
                   GT: tl.constexpr):
        """fp32 sums [BLOCK_N] of down rows rn of expert e over F chunk k0.. with hrow."""
        WX: tl.constexpr = F * BITS // 32
        NG: tl.constexpr = F // GROUP
        so = e * E * NG + k0 // GROUP
        return _rows(hrow, w_ptr + e * E * WX + k0 * BITS // 32, s_ptr + so, b_ptr + so,
                     _expert_gs(gs_ptr, e, HAS_GS), rn, E, F, BITS, GROUP, MODE, BLOCK_N, GT,
                     FC)

    @triton.jit
    def _down_onepass_kernel(
        h_ptr, ids_ptr, rw_ptr, y_ptr, part_ptr, ctr_ptr,
        w_ptr, s_ptr, b_ptr, gs_ptr, bias_ptr, sw_ptr, ss_ptr, sb_ptr, sgs_ptr,
        E, P, routed_scale,
        F: tl.constexpr, FC: tl.constexpr, S: tl.constexpr, TOPK: tl.constexpr,
        BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_GS: tl.constexpr,
        HAS_BIAS: tl.constexpr, ROUND_PROD: tl.constexpr, SCALED: tl.constexpr,
        BLOCK_N: tl.constexpr, GT: tl.constexpr, SHARED: tl.constexpr,
    ):
        """y[t, rn] = sum over slots of weight * down_e(h[t*k + j]) (SHARED: plus token t's
        shared expert, row P + t of h through the s* stack); part [S, rows of h, E] fp32."""
        p = tl.program_id(0)
        tile = tl.program_id(1)
        sk = tl.program_id(2)
        NP = tl.num_programs(0)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < E
        k0 = sk * FC
        hrow = h_ptr + p.to(tl.int64) * F + k0
        if SHARED and p >= P:
            t = p - P
            acc = _down_rows(hrow, tl.zeros([], dtype=tl.int64), rn, k0, sw_ptr, ss_ptr, sb_ptr,
                             sgs_ptr, E, F, FC, BITS, GROUP, MODE, HAS_GS, BLOCK_N, GT)
        else:
            t = p // TOPK
            acc = _down_rows(hrow, tl.load(ids_ptr + p).to(tl.int64), rn, k0, w_ptr, s_ptr,
                             b_ptr, gs_ptr, E, F, FC, BITS, GROUP, MODE, HAS_GS, BLOCK_N, GT)
        tl.store(part_ptr + (sk * NP + p).to(tl.int64) * E + rn, acc, mask=nmask)
        cp = ctr_ptr + t * tl.num_programs(1) + tile
        if _last_ticket(cp, (TOPK + SHARED) * S):
            DT: tl.constexpr = h_ptr.dtype.element_ty
            out = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(TOPK):
                pj = t * TOPK + j
                ej = tl.load(ids_ptr + pj).to(tl.int64)
                wt = tl.load(rw_ptr + pj).to(tl.float32)
                a = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(S):
                    a += tl.load(part_ptr + (s * NP + pj).to(tl.int64) * E + rn, mask=nmask,
                                 other=0.0, cache_modifier=".cg")
                y = _biased(a, bias_ptr, ej * E + rn, nmask, HAS_BIAS, DT) * wt
                if ROUND_PROD:  # bf16 y times bf16 weights: torch rounds each product
                    y = y.to(DT).to(tl.float32)
                out += y
            ODT: tl.constexpr = y_ptr.dtype.element_ty
            if SCALED:  # laguna: the routed scale multiplies after the cast
                out = out.to(ODT).to(tl.float32) * routed_scale
            if SHARED:  # out + shared: the shared down's output rounded, the sum rounded
                a = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(S):
                    a += tl.load(part_ptr + (s * NP + P + t).to(tl.int64) * E + rn, mask=nmask,
                                 other=0.0, cache_modifier=".cg")
                out = out.to(ODT).to(tl.float32) + a.to(DT).to(tl.float32)
            tl.store(y_ptr + t.to(tl.int64) * E + rn, out.to(ODT), mask=nmask)
            tl.store(cp, 0)


# ====================================================================== launchers
def _tiles_fit(pairs: int, n: int, bn: int) -> bool:
    return pairs * -(-n // bn) <= TILES


def fits(ids: Tensor, gate: ExpertQuant, down: ExpertQuant, shared: bool = False) -> bool:
    """Whether a step of ids [T, k] fits the counters at the default configs (the dispatch
    falls back to `decode_split` where it does not: many pairs of small row blocks)."""
    t, k = ids.shape
    rows = t * k + (t if shared else 0)
    return (_tiles_fit(rows, gate.shape[1], ONEPASS_GATE_UP.block_n or 2)
            and _tiles_fit(t, down.shape[1], ONEPASS_DOWN.block_n or 2))


def shared_fits(routed: ExpertQuant, shared: ExpertQuant) -> bool:
    """Whether a one-expert stack (the shared expert's projection) rides in the routed
    projection's launch: the same shape but X and the same storage, no expert bias."""
    return (shared.shape[0] == 1 and shared.shape[1:] == routed.shape[1:]
            and shared.mode == routed.mode and shared.bits == routed.bits
            and shared.group == routed.group and shared.bias is None and routed.bias is None
            and (shared.global_scale is None) == (routed.global_scale is None)
            and (shared.biases is None) == (routed.biases is None)
            and shared.w.dtype == routed.w.dtype
            and (shared.scales is None or shared.scales.dtype == routed.scales.dtype))


def _quant_args(q: ExpertQuant) -> tuple:
    """(words, scales, affine biases, global scale) pointers of a stack (unused: dummies)."""
    b, gs, _ = D._gs_bias(q, D._scales(q))
    return D._words_i32(q.w), D._scales(q), b, gs


def moe_gate_up_onepass(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant, act: str,
                        alpha: float = 1.702, limit: float = 7.0,
                        config: DecodeConfig | None = None,
                        shared: tuple[ExpertQuant, ExpertQuant] | None = None) -> Tensor:
    """`decode_experts.moe_gate_up` in one launch, K in `chunks(K, group, config.split)`
    parts (config: rows per program, split, warps; default `ONEPASS_GATE_UP`). shared: the
    shared expert's (gate, up) as one-expert stacks (`shared_fits`): h gets T more rows,
    row T*k + t = act(gate(x_t), up(x_t)) of the shared expert."""
    cfg = config or ONEPASS_GATE_UP
    check_pair(gate, up)
    if act not in D.ACTS:
        raise ValueError(f"unknown expert activation {act!r}")
    if shared is not None and not all(shared_fits(gate, q) for q in shared):
        raise ValueError("moe_gate_up_onepass: the shared expert does not fit the launch")
    _, f, k = gate.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"moe_gate_up: x {tuple(x.shape)} does not match K = {k}")
    t, topk = ids.shape
    p = t * topk
    rows = p + (t if shared is not None else 0)
    x, ids = x.contiguous(), ids.contiguous()
    h = torch.empty(rows, f, device=x.device, dtype=x.dtype)
    if p == 0:
        return h
    s = chunks(k, gate.group, cfg.split)
    bn = cfg.block_n or D._block(f, rows * s, x.device)
    if not _tiles_fit(rows, f, bn):
        raise ValueError(f"moe_gate_up_onepass: {rows} pairs x {f} rows exceed the counters")
    part = torch.empty(2 * s * rows * f if s > 1 else 1, device=x.device, dtype=torch.float32)
    _, _, gbias = D._gs_bias(gate, D._scales(gate))
    _, _, ubias = D._gs_bias(up, D._scales(up))
    sg, su = shared if shared is not None else (gate, up)
    kc = k // s
    _gate_up_onepass_kernel[(rows, triton.cdiv(f, bn), s)](
        x, ids, part, counters(x.device, tickets.MOE_GATE_UP), h, *_quant_args(gate), gbias,
        *_quant_args(up), ubias, *_quant_args(sg), *_quant_args(su),
        f, p, x.stride(0), float(alpha), float(limit), K=k, KC=kc, S=s, TOPK=topk,
        BITS=gate.bits, GROUP=gate.group, MODE=D.KERNEL_MODE[gate.mode],
        HAS_GS=gate.global_scale is not None, HAS_BIAS=gate.bias is not None,
        ACT=D.ACTS[act], BLOCK_N=bn, GT=D._gt(kc, gate.bits, gate.group),
        SHARED=shared is not None, PAIRED=PAIRED, num_warps=cfg.num_warps)
    return h


def moe_down_onepass(h: Tensor, ids: Tensor, weights: Tensor, down: ExpertQuant,
                     out_dtype: torch.dtype, routed_scale: float = 1.0,
                     config: DecodeConfig | None = None,
                     shared: ExpertQuant | None = None) -> Tensor:
    """`decode_experts.moe_down` in one launch: one program per (pair, row tile, F chunk), the
    last of a token's tile adds the slots (default config `ONEPASS_DOWN`). shared: the
    shared expert's down as a one-expert stack, h's rows T*k.. its activations (as
    `moe_gate_up_onepass(shared=...)` makes them): y = routed + shared, as `MoeBlock`
    adds them (each rounded to out_dtype, the sum rounded)."""
    cfg = config or ONEPASS_DOWN
    t, topk = ids.shape
    p = t * topk
    full = None  # h with the shared expert's rows
    if shared is not None:
        if not shared_fits(down, shared) or h.dim() != 2 or h.shape[0] != p + t:
            raise ValueError(f"moe_down_onepass: h {tuple(h.shape)} or the shared expert "
                             "does not fit")
        full = h.contiguous()
        h = full[:p]
    h, ids, weights, y = D.down_operands(h, ids, weights, down, out_dtype)
    if t == 0:
        return y
    full = h if full is None else full
    rows = full.shape[0]
    _, e, f = down.shape
    s = chunks(f, down.group, max(1, cfg.split))
    bn = cfg.block_n or D._block(e, rows * s, h.device)
    if not _tiles_fit(t, e, bn):
        raise ValueError(f"moe_down_onepass: {t} tokens x {e} rows exceed the counters")
    part = torch.empty(s * rows * e, device=h.device, dtype=torch.float32)
    _, _, bias = D._gs_bias(down, D._scales(down))
    fc = f // s
    _down_onepass_kernel[(rows, triton.cdiv(e, bn), s)](
        full, ids, weights, y, part, counters(h.device, tickets.MOE_DOWN), *_quant_args(down), bias,
        *_quant_args(down if shared is None else shared), e, p, float(routed_scale),
        F=f, FC=fc, S=s, TOPK=topk, BITS=down.bits, GROUP=down.group,
        MODE=D.KERNEL_MODE[down.mode], HAS_GS=down.global_scale is not None,
        HAS_BIAS=down.bias is not None,
        ROUND_PROD=weights.dtype == h.dtype != torch.float32, SCALED=routed_scale != 1.0,
        BLOCK_N=bn, GT=D._gt(fc, down.bits, down.group), SHARED=shared is not None,
        num_warps=cfg.num_warps)
    return y


# Before measurement (scripts/moe_decode_gpu.py sweeps these): decode_split's defaults
# (`GATE_UP_DEFAULT`, `DOWN_DEFAULT`), so that the onepass kernels sum exactly what today's
# kernels sum (bit-equal in the interpreter tests; the GPU script checks CUDA).
ONEPASS_GATE_UP = DecodeConfig(32, 4, 4)
ONEPASS_DOWN = DecodeConfig(32, 1, 4)
