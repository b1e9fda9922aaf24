"""Triton decode attention over the paged KV cache: one new token for each of B sequences.

The serving engine's decode step (`Decoder.forward_paged`, captured in a CUDA graph per batch
bucket) cannot slice each sequence's context on the host, so this kernel reads it through the
block table. Grid (sequence, kv head, split of the context): a program holds the REP query heads
of its kv group (padded to 16 rows for tl.dot) so each K/V tile is read once, walks the tiles of
BLOCK_S positions its split owns with an online softmax (exp2 domain, fp32), and gathers each
tile's slots as block_tables[b, p // block_size] * block_size + p % block_size. The context
length is read on the device, so the loop bound is a runtime value (a while loop: the tiles of a
short sequence cost nothing however large the captured capacity). Splits exist for small
batches (few programs, long contexts); their fp32 partials are merged by `_paged_combine_kernel`.
Numerics are `masked.attention_masked`'s, through the same score, online-softmax and
split-merge helpers (scores and softmax in fp32, p rounded to v's dtype for the P.V dot);
`reference.paged_attention` is the spec.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import prefill_tile
from .masked import (_merge_splits, _online_softmax, _sink_start, _tile_scores, score_consts,
                     wide_head)

TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs
MAX_SPLITS = 32


@triton.jit
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, sink_ptr, o_ptr, pacc_ptr,
                       pml_ptr,
                       sq0, sq1, sk0, sk1, sv0, sv1, stab, window, qk_scale, inv_cap, cap2,
                       REP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                       NSPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                       SINGLE: tl.constexpr, DOT_F32: tl.constexpr, HAS_SINKS: tl.constexpr,
                       DK: tl.constexpr, NDK: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    r = tl.arange(0, BLOCK_M)
    rmask = r < REP
    head = g * REP + r
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qm = rmask[:, None] & dmask[None, :]
    qp = q_ptr + b.to(tl.int64) * sq0 + head.to(tl.int64)[:, None] * sq1
    q = tl.load(qp + d[None, :], mask=qm, other=0.0)
    n = tl.load(len_ptr + b)
    lo = n * 0
    if HAS_WINDOW:
        lo = tl.maximum(n - window, 0)
    t_lo = lo // BLOCK_S
    t_hi = tl.cdiv(n, BLOCK_S)
    per = tl.cdiv(t_hi - t_lo, NSPLIT)
    t = t_lo + sp * per
    t_end = tl.minimum(t + per, t_hi)
    kbase = k_ptr + g.to(tl.int64) * sk0
    vbase = v_ptr + g.to(tl.int64) * sv0
    tab = tab_ptr + b.to(tl.int64) * stab
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i = _sink_start(sink_ptr, head, rmask, sp == 0, m_i, l_i, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    while t < t_end:
        pos = t * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = (pos >= lo) & (pos < n)
        blk = tl.load(tab + pos // BS, mask=valid, other=0)
        slot = (blk.to(tl.int64) * BS + pos % BS)[:, None]
        km = valid[:, None] & dmask[None, :]
        sc = _tile_scores(q, qp, rmask, kbase + slot * sk1, valid, d, dmask, qk_scale, inv_cap,
                          cap2, SOFTCAP, DOT_F32, BLOCK_M, BLOCK_S, D, DK, NDK)
        sc = tl.where(valid[None, :], sc, float("-inf"))
        v = tl.load(vbase + slot * sv1 + d[None, :], mask=km, other=0.0)
        m_i, l_i, acc = _online_softmax(sc, v, m_i, l_i, acc, DOT_F32)
        t += 1
    if SINGLE:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        optr = o_ptr + (b.to(tl.int64) * H + head[:, None]) * D + d[None, :]
        tl.store(optr, out.to(o_ptr.dtype.element_ty), mask=qm)
    else:
        prow = ((b.to(tl.int64) * tl.num_programs(1) + g) * NSPLIT + sp) * REP + r
        tl.store(pacc_ptr + prow[:, None] * D + d[None, :], acc, mask=qm)
        tl.store(pml_ptr + prow * 2, m_i, mask=rmask)
        tl.store(pml_ptr + prow * 2 + 1, l_i, mask=rmask)


@triton.jit
def _paged_combine_kernel(pacc_ptr, pml_ptr, o_ptr, REP: tl.constexpr, H: tl.constexpr,
                          D: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # b * H + head
    b = pid // H
    head = pid % H
    g = head // REP
    j = tl.arange(0, BLOCK_N)
    jm = j < NSPLIT
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    prow = ((b.to(tl.int64) * (H // REP) + g) * NSPLIT + j) * REP + head % REP
    out = _merge_splits(pacc_ptr, pml_ptr, prow, jm, d, dmask, D)
    tl.store(o_ptr + pid.to(tl.int64) * D + d, out.to(o_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, item_ptr, o_ptr,
                          sq0, sq1, sk0, sk1, sv0, sv1, stab, window, qk_scale, inv_cap, cap2,
                          REP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                          TQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_S: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                          DOT_F32: tl.constexpr, DK: tl.constexpr, NDK: tl.constexpr):
    it = tl.program_id(0)
    g = tl.program_id(1)
    seq = tl.load(item_ptr + it * 4)
    row0 = tl.load(item_ptr + it * 4 + 1)
    pos0 = tl.load(item_ptr + it * 4 + 2)
    nq = tl.load(item_ptr + it * 4 + 3)
    r = tl.arange(0, BLOCK_M)  # rows ordered (token, rep)
    t = r // REP
    rmask = (t < nq) & (r < TQ * REP)
    head = g * REP + r % REP
    qpos = pos0 + t
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qm = rmask[:, None] & dmask[None, :]
    qrow = (row0 + t).to(tl.int64)
    qp = q_ptr + qrow[:, None] * sq0 + head.to(tl.int64)[:, None] * sq1
    q = tl.load(qp + d[None, :], mask=qm, other=0.0)
    lo = pos0 * 0
    if HAS_WINDOW:
        lo = tl.maximum(pos0 - window + 1, 0)
    tt = lo // BLOCK_S
    t_end = tl.cdiv(pos0 + nq, BLOCK_S)
    kbase = k_ptr + g.to(tl.int64) * sk0
    vbase = v_ptr + g.to(tl.int64) * sv0
    tab = tab_ptr + seq.to(tl.int64) * stab
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    while tt < t_end:
        pos = tt * BLOCK_S + tl.arange(0, BLOCK_S)
        live = (pos >= lo) & (pos < pos0 + nq)
        blk = tl.load(tab + pos // BS, mask=live, other=0)
        slot = (blk.to(tl.int64) * BS + pos % BS)[:, None]
        km = live[:, None] & dmask[None, :]
        sc = _tile_scores(q, qp, rmask, kbase + slot * sk1, live, d, dmask, qk_scale, inv_cap,
                          cap2, SOFTCAP, DOT_F32, BLOCK_M, BLOCK_S, D, DK, NDK)
        vis = live[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (qpos[:, None] - pos[None, :] < window)
        sc = tl.where(vis, sc, float("-inf"))
        v = tl.load(vbase + slot * sv1 + d[None, :], mask=km, other=0.0)
        m_i, l_i, acc = _online_softmax(sc, v, m_i, l_i, acc, DOT_F32)
        tt += 1
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (qrow[:, None] * H + head[:, None]) * D + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qm)


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block_s(block_d: int) -> int:
    """Positions per tile: 64, 32 for heads over 128 wide, 16 over 256 (`wide_head`)."""
    return 64 if block_d <= 128 else (32 if block_d <= 256 else 16)


def paged_attention(q: Tensor, k: Tensor, v: Tensor, block_tables: Tensor, ctx_lens: Tensor,
                    block_size: int, scale: float, window: int | None = None,
                    softcap: float | None = None, splits: int | None = None,
                    block_s: int | None = None, num_warps: int | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """See `mlxr.ops.reference.paged_attention` (sinks [H]: gpt-oss's extra logit per head,
    counted once in the first split); `splits`, `block_s` (keys per tile) and
    `num_warps` override the launch policy (tests, benchmarks/gpu/gpu_paged_attn_sweep.py).
    block_tables [B, W] and ctx_lens [B] are int32 or int64 on q's device."""
    bsz, h, d = q.shape
    kh = k.shape[0]
    rep = h // kh
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty((bsz, h, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    block_d = max(16, _p2(d))
    block_s = block_s or _block_s(block_d)
    dk, ndk, wide_warps = wide_head(block_d)
    # H200 sweep (benchmarks/gpu/gpu_paged_attn_sweep.py, docs/perf.md): with >= 512 (sequence,
    # kv head) programs, 2 warps per program beat 4 by 9-26% (more programs resident per SM);
    # heads over 256 wide take wide_head's 8 (its register budget)
    num_warps = num_warps or (wide_warps if ndk > 1 else (2 if bsz * kh >= 512 else 4))
    if splits is None:
        splits = min(MAX_SPLITS, max(1, triton.cdiv(TARGET_PROGRAMS, bsz * kh)))
    single = splits == 1
    if single:
        pacc = pml = out  # unused
    else:
        pacc = torch.empty((bsz * kh * splits * rep, d), dtype=torch.float32, device=q.device)
        pml = torch.empty((bsz * kh * splits * rep, 2), dtype=torch.float32, device=q.device)
    qk_scale, inv_cap, cap2 = score_consts(scale, softcap)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _paged_attn_kernel[(bsz, kh, splits)](
        q, k, v, block_tables, ctx_lens, sinks if sinks is not None else q, out, pacc, pml,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0),
        int(window or 0), qk_scale, inv_cap, cap2, REP=rep, H=h, D=d, BS=block_size,
        BLOCK_M=max(16, _p2(rep)), BLOCK_D=block_d, BLOCK_S=block_s, NSPLIT=splits,
        HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, SINGLE=single,
        DOT_F32=q.dtype == torch.float32 or interpret, HAS_SINKS=sinks is not None,
        DK=dk, NDK=ndk, num_warps=num_warps)
    if not single:
        _paged_combine_kernel[(bsz * h,)](pacc, pml, out, REP=rep, H=h, D=d, NSPLIT=splits,
                                          BLOCK_N=_p2(splits), BLOCK_D=block_d, num_warps=4)
    return out


def paged_prefill_attention(q: Tensor, k: Tensor, v: Tensor, block_tables: Tensor,
                            items: Tensor, block_size: int, scale: float,
                            window: int | None = None, softcap: float | None = None) -> Tensor:
    """Causal attention of a mixed batch (prefill chunks and decodes) over the paged cache.

    q [N, H, D]: the step's new tokens, flattened. items [I, 4] int32: one row per program tile
    (sequence index into block_tables [S, W], first row of q, position of that row, number of
    tokens <= prefill_tile(H, K)); tokens of a tile are consecutive rows and positions of one
    sequence, whose K/V (these tokens' included) are already in the cache. Returns [N, H, D]."""
    n, h, d = q.shape
    kh = k.shape[0]
    rep = h // kh
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    if n == 0 or items.shape[0] == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tq = prefill_tile(h, kh)  # items hold at most this many rows
    block_d = max(16, _p2(d))
    qk_scale, inv_cap, cap2 = score_consts(scale, softcap)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    dk, ndk, warps = wide_head(block_d)
    _paged_prefill_kernel[(items.shape[0], kh)](
        q, k, v, block_tables, items, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), block_tables.stride(0), int(window or 0), qk_scale, inv_cap,
        cap2, REP=rep, H=h, D=d, BS=block_size, TQ=tq, BLOCK_M=max(16, _p2(tq * rep)),
        BLOCK_D=block_d, BLOCK_S=_block_s(block_d), HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None, DOT_F32=q.dtype == torch.float32 or interpret,
        DK=dk, NDK=ndk, num_warps=warps)
    return out
