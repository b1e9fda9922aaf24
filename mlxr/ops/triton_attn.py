"""Decode attention over a KV cache under a key-visibility mask (`mlxr.ops.reference.
attention_masked`), in Triton: what the single request's CUDA-graph decode step and the
cached-prefix prefill run.

`attention_masked`: flash decoding. Grid (kv head, split of S, block of query rows): a program
holds every query row of its kv head ((rep, T) rows, padded to >= 16 for tl.dot) so K/V are
read once, walks TILES tiles of BLOCK_S keys with an online softmax (exp2 domain, fp32),
skips a tile whose keys are all invisible (no K/V traffic: at decode most of a CUDA graph's
fixed capacity is beyond the current position), and writes fp32 partials (acc, max, sum) that
`_attn_combine_kernel` merges per row. A single split writes the output directly. Masked keys
get p = 0 exactly; a row with no visible key gives 0 (not NaN). Scores and the softmax are fp32
(the reference rounds q*scale and q.k to q.dtype first, so for bf16 this kernel is the more
exact of the two); p is rounded to v.dtype for the P.V dot as the reference does.

The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts; CUDA rounds to nearest.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .triton_fused import HAVE_TRITON, _interpret, _p2, _warps, pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

LOG2E = 1.4426950408889634
# attention_masked launch policy (the lead may tune these on the GPU)
ATTN_TARGET_PROGRAMS = 256  # aim for about this many (kv head x split) programs, and
ATTN_LONG_S = 4096  # twice that from this many keys (`attn_splits`)
ATTN_MAX_BLOCK_M = 64  # query rows (rep * T) per program; more rows -> another grid dim


if HAVE_TRITON:
    @triton.jit
    def _scores(q, k, qk_scale, inv_cap, cap2, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
        """q [M, D] . k [S, D]^T in log2 units (scale, or softcap, applied): fp32 [M, S].
        Shared by every attention kernel (here and mlxr.ops.triton_paged)."""
        if DOT_F32:  # fp32 inputs, or the interpreter (its bf16 dot is broken)
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        return _score_scale(sc, qk_scale, inv_cap, cap2, SOFTCAP)

    @triton.jit
    def _score_scale(sc, qk_scale, inv_cap, cap2, SOFTCAP: tl.constexpr):
        """Raw q.k scores (fp32) -> log2 units, scale or softcap applied."""
        if SOFTCAP:  # cap * tanh(s / cap), tanh(z) = 1 - 2 / (exp(2z) + 1); log2 units
            return cap2 - 2.0 * cap2 / (tl.exp2(sc * inv_cap) + 1.0)  # inv_cap = 2 log2(e) s/cap
        return sc * qk_scale  # scale * log2(e)

    @triton.jit
    def _online_softmax(sc, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
        """One tile of the online softmax: scores sc [M, S] (-inf where invisible), values v
        [S, D]; returns the new running max, sum and accumulator. p is rounded to v's dtype
        for the P.V dot, as the reference rounds its probabilities."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p.to(v.dtype)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, v)
        return m_new, l_i, acc

    @triton.jit
    def _merge_splits(pacc_ptr, pml_ptr, prow, jm, d, dmask, D: tl.constexpr):
        """One row's output [BLOCK_D] fp32 from its splits' partials: acc at pacc[prow, :D],
        (max, sum) at pml[prow, 0:2], for the splits jm marks (empty splits weigh 0)."""
        m = tl.load(pml_ptr + prow * 2, mask=jm, other=float("-inf"))
        lsum = tl.load(pml_ptr + prow * 2 + 1, mask=jm, other=0.0)
        mx = tl.max(m, axis=0)
        w = tl.exp2(m - tl.where(mx == float("-inf"), 0.0, mx))
        l_tot = tl.sum(w * lsum, axis=0)
        acc = tl.load(pacc_ptr + prow[:, None] * D + d[None, :],
                      mask=jm[:, None] & dmask[None, :], other=0.0)
        return tl.sum(acc * w[:, None], axis=0) / tl.where(l_tot > 0.0, l_tot, 1.0)

    @triton.jit
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, o_ptr, pacc_ptr, pml_ptr,
                           S, sq0, sq1, sk0, sk1, sv0, sv1, svis, qk_scale, inv_cap, cap2,
                           T: tl.constexpr, REP: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                           TILES: tl.constexpr, NSPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                           SINGLE: tl.constexpr, DOT_F32: tl.constexpr):
        g = tl.program_id(0)
        sp = tl.program_id(1)
        RT: tl.constexpr = REP * T
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows ordered (rep, T)
        rmask = rows < RT
        t = rows % T
        head = g * REP + rows // T
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        qm = rmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + t.to(tl.int64)[:, None] * sq0 + head.to(tl.int64)[:, None] * sq1
                    + d[None, :], mask=qm, other=0.0)
        kbase = k_ptr + g.to(tl.int64) * sk0
        vbase = v_ptr + g.to(tl.int64) * sv0
        vrow = vis_ptr + t.to(tl.int64)[:, None] * svis
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for i in range(TILES):
            s_idx = (sp * TILES + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            smask = s_idx < S
            vis = tl.load(vrow + s_idx[None, :], mask=rmask[:, None] & smask[None, :], other=0) != 0
            if tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0:
                kv_off = s_idx.to(tl.int64)[:, None]
                # keys no row sees are not read (0): stale NaN/inf there cannot leak via 0 * v
                kvis = tl.max(vis.to(tl.int32), axis=0) > 0
                km = (smask & kvis)[:, None] & dmask[None, :]
                k = tl.load(kbase + kv_off * sk1 + d[None, :], mask=km, other=0.0)
                sc = _scores(q, k, qk_scale, inv_cap, cap2, SOFTCAP, DOT_F32)
                sc = tl.where(vis, sc, float("-inf"))
                v = tl.load(vbase + kv_off * sv1 + d[None, :], mask=km, other=0.0)
                m_i, l_i, acc = _online_softmax(sc, v, m_i, l_i, acc, DOT_F32)
        if SINGLE:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            optr = o_ptr + (t.to(tl.int64)[:, None] * H + head[:, None]) * D + d[None, :]
            tl.store(optr, out.to(o_ptr.dtype.element_ty), mask=qm)
        else:
            prow = (g * NSPLIT + sp).to(tl.int64) * RT + rows
            tl.store(pacc_ptr + prow[:, None] * D + d[None, :], acc, mask=qm)
            tl.store(pml_ptr + prow * 2, m_i, mask=rmask)
            tl.store(pml_ptr + prow * 2 + 1, l_i, mask=rmask)

    @triton.jit
    def _attn_combine_kernel(pacc_ptr, pml_ptr, o_ptr, T: tl.constexpr, REP: tl.constexpr,
                             H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             TRIGGER: tl.constexpr):
        if TRIGGER:  # the next grid (a PDL-launched GEMV) may start streaming its weights
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        RT: tl.constexpr = REP * T
        g = pid // RT
        row = pid % RT
        j = tl.arange(0, BLOCK_N)
        jm = j < NSPLIT
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        prow = (g * NSPLIT + j).to(tl.int64) * RT + row
        out = _merge_splits(pacc_ptr, pml_ptr, prow, jm, d, dmask, D)
        t = row % T
        head = g * REP + row // T
        tl.store(o_ptr + (t * H + head).to(tl.int64) * D + d, out.to(o_ptr.dtype.element_ty),
                 mask=dmask)


    @triton.jit
    def _attn_row_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, o_ptr, pacc_ptr, pml_ptr, S, sq1, sk0,
                         sk1, sv0, sv1, qk_scale, inv_cap, cap2, REP: tl.constexpr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         TILES: tl.constexpr, NSPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                         SINGLE: tl.constexpr):
        """One query row (T = 1: decode) per program: grid (head, split). The split kernel's
        math on CUDA cores instead of tl.dot: q.k and p.v as fp32 sums of exact products,
        so K and V need no staging through shared memory for the mma and both are loaded
        as soon as the tile's visibility is (masked: invisible keys are not read); no tile
        skip, so no block-wide reduction before the loads. Partials in the split kernel's
        layout (row = head % REP of kv head head // REP), for `_attn_combine_kernel`."""
        hd = tl.program_id(0)
        sp = tl.program_id(1)
        g = hd // REP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + hd.to(tl.int64) * sq1 + d, mask=dmask, other=0.0).to(tl.float32)
        kbase = k_ptr + g.to(tl.int64) * sk0
        vbase = v_ptr + g.to(tl.int64) * sv0
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for i in range(TILES):
            s_idx = (sp * TILES + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            vis = tl.load(vis_ptr + s_idx, mask=s_idx < S, other=0) != 0
            kv_off = s_idx.to(tl.int64)[:, None]
            km = vis[:, None] & dmask[None, :]  # invisible keys are not read (stale NaN)
            k = tl.load(kbase + kv_off * sk1 + d[None, :], mask=km, other=0.0)
            v = tl.load(vbase + kv_off * sv1 + d[None, :], mask=km, other=0.0)
            sc = _score_scale(tl.sum(k.to(tl.float32) * q[None, :], axis=1), qk_scale,
                              inv_cap, cap2, SOFTCAP)
            sc = tl.where(vis, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            pv = p.to(v.dtype).to(tl.float32)  # rounded as the reference rounds p
            acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), axis=0)
            m_i = m_new
        if SINGLE:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)
            tl.store(o_ptr + hd.to(tl.int64) * D + d, out.to(o_ptr.dtype.element_ty),
                     mask=dmask)
        else:
            prow = (g * NSPLIT + sp).to(tl.int64) * REP + hd % REP
            tl.store(pacc_ptr + prow * D + d, acc, mask=dmask)
            tl.store(pml_ptr + prow * 2, m_i)
            tl.store(pml_ptr + prow * 2 + 1, l_i)


def row_kernel_on() -> bool:
    """Env `MLXR_ATTN_ROWS=1` (read at each call: a decode graph's capture) sends one-token
    attention to `_attn_row_kernel` (CUDA-core dots, a program per head) instead of the split
    kernel's tl.dot over each kv head's rows. Opt-in until measured on the GPU."""
    return os.environ.get("MLXR_ATTN_ROWS") == "1"


def attention_masked(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float,
                     softcap: float | None = None) -> Tensor:
    return attention_masked_split(q, k, v, visible, scale, softcap)


def score_consts(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """`_scores`' (qk_scale, inv_cap, cap2): log2-domain scale, or the soft-cap's constants."""
    if softcap is not None:
        inv_cap = 2.0 * scale / softcap
        return 0.0, inv_cap * LOG2E, softcap * LOG2E
    return scale * LOG2E, 0.0, 0.0


def attn_block_s(block_d: int) -> int:
    """Keys per tile of `attention_masked`: 64 (32 for head dims over 128). Env
    `MLXR_ATTN_BLOCK_S` (read at each call, i.e. when a decode graph is captured) sets it, for
    A/B runs."""
    env = os.environ.get("MLXR_ATTN_BLOCK_S")
    if env:
        return int(env)
    return 64 if block_d <= 128 else 32


def attn_splits(s: int, kh: int, mblocks: int) -> int:
    """Splits of the s keys (the decode graph's capacity) for kh kv heads x mblocks row
    blocks: about ATTN_TARGET_PROGRAMS programs, twice that from ATTN_LONG_S keys. H200
    (`gpu_attn_decode_sweep.py --loads`, 8 kv heads, 64-key tiles, us per layer): 4096 /
    8192 / 16384 slots 12.85 / 20.54 / 35.95 with 32 splits, 11.38 / 16.03 / 26.54 with 64;
    below 4096 slots a split is a tile at either target (16 / 32 splits), so shorter contexts
    keep their launch. Env `MLXR_ATTN_PROGRAMS` (read at each call) sets the target."""
    env = os.environ.get("MLXR_ATTN_PROGRAMS")
    target = int(env) if env else ATTN_TARGET_PROGRAMS * (2 if s >= ATTN_LONG_S else 1)
    return max(1, -(-target // (kh * mblocks)))


def attention_masked_split(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float,
                           softcap: float | None = None, block_s: int | None = None,
                           splits: int | None = None, rows: bool | None = None) -> Tensor:
    """attention_masked with the launch policy exposed (tests force split / single pass, and
    rows: one token's attention by `_attn_row_kernel`, default `row_kernel_on()`)."""
    t, h, d = q.shape
    kh, s, _ = k.shape
    rep = h // kh
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    vis = visible if visible.stride(-1) == 1 else visible.contiguous()
    vis = vis.view(torch.uint8) if vis.dtype == torch.bool else (vis != 0).view(torch.uint8)
    svis = 0 if vis.dim() == 1 or vis.shape[0] == 1 else vis.stride(0)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    rt = rep * t
    block_m = min(ATTN_MAX_BLOCK_M, max(16, _p2(rt)))
    mblocks = triton.cdiv(rt, block_m)
    block_d = max(16, _p2(d))
    if block_s is None:
        block_s = attn_block_s(block_d)
    tiles = max(1, triton.cdiv(s, block_s))
    if splits is None:
        splits = attn_splits(s, kh, mblocks)
    per = triton.cdiv(tiles, min(tiles, splits))
    nsplit = triton.cdiv(tiles, per)
    single = nsplit == 1
    if single:
        pacc = pml = out  # unused
    else:
        pacc = torch.empty((kh * nsplit * rt, d), dtype=torch.float32, device=q.device)
        pml = torch.empty((kh * nsplit * rt, 2), dtype=torch.float32, device=q.device)
    qk_scale, inv_cap, cap2 = score_consts(scale, softcap)
    dot_f32 = q.dtype == torch.float32 or _interpret()
    if t == 1 and (row_kernel_on() if rows is None else rows):
        _attn_row_kernel[(h, nsplit)](
            q, k, v, vis, out, pacc, pml, s, q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), qk_scale, inv_cap, cap2, REP=rep, D=d, BLOCK_D=block_d,
            BLOCK_S=block_s, TILES=per, NSPLIT=nsplit, SOFTCAP=softcap is not None,
            SINGLE=single, num_warps=8)  # 8: 40 registers, the K loads without staging (SASS)
    else:
        _attn_split_kernel[(kh, nsplit, mblocks)](
            q, k, v, vis, out, pacc, pml, s, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), svis, qk_scale, inv_cap, cap2, T=t, REP=rep,
            H=h, D=d, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=block_s, TILES=per,
            NSPLIT=nsplit, SOFTCAP=softcap is not None, SINGLE=single, DOT_F32=dot_f32,
            num_warps=4)
    if not single:
        _attn_combine_kernel[(kh * rt,)](
            pacc, pml, out, T=t, REP=rep, H=h, D=d, NSPLIT=nsplit, BLOCK_N=_p2(nsplit),
            BLOCK_D=block_d, TRIGGER=pdl(out.device), num_warps=_warps(_p2(nsplit) * block_d))
    return out
