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

`attention_at`: the same kernel with each query row's position instead of a mask (key slot j
at position j; causal, optionally windowed): the decode graph's step builds no mask and the
kernel loads none before a tile's K.

The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts; CUDA rounds to nearest.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..layer.norm_rope_act import HAVE_TRITON, _interpret, _p2, _warps, pdl

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
        Shared by every attention kernel (here and mlxr.ops.kv_attention.paged)."""
        if DOT_F32:  # fp32 inputs, or the interpreter (its bf16 dot is broken)
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        return _score_scale(sc, qk_scale, inv_cap, cap2, SOFTCAP)

    @triton.jit
    def _tile_scores(q, qp, qmask, kp, kmask, d, dmask, qk_scale, inv_cap, cap2,
                     SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_S: tl.constexpr, D: tl.constexpr, DK: tl.constexpr,
                     NDK: tl.constexpr):
        """One tile's scores fp32 [BLOCK_M, BLOCK_S] in log2 units: q [BLOCK_M, BLOCK_D]
        (rows at pointers qp [BLOCK_M, 1], live where qmask) against the keys at kp
        [BLOCK_S, 1] (read where kmask). NDK == 1: one dot over the whole head (K loaded
        [BLOCK_S, BLOCK_D]). NDK > 1 (head dims over 256): NDK dots over DK-wide slices of q
        and K, summed in fp32, so no [*, 512] operand of the dot is live across the key loop
        (q's slices are re-read from L1 per tile; the preloaded q is then dead code)."""
        if NDK == 1:
            k = tl.load(kp + d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
            sc = _scores(q, k, qk_scale, inv_cap, cap2, SOFTCAP, DOT_F32)
        else:
            raw = tl.zeros([BLOCK_M, BLOCK_S], tl.float32)
            for c in tl.static_range(NDK):
                dd = c * DK + tl.arange(0, DK)
                ddm = dd < D
                qc = tl.load(qp + dd[None, :], mask=qmask[:, None] & ddm[None, :], other=0.0)
                kc = tl.load(kp + dd[None, :], mask=kmask[:, None] & ddm[None, :], other=0.0)
                if DOT_F32:
                    raw += tl.dot(qc.to(tl.float32), tl.trans(kc.to(tl.float32)),
                                  input_precision="ieee")
                else:
                    raw += tl.dot(qc, tl.trans(kc))
            sc = _score_scale(raw, qk_scale, inv_cap, cap2, SOFTCAP)
        return sc

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
    def _sink_start(sink_ptr, head, rmask, first, m_i, l_i, HAS_SINKS: tl.constexpr):
        """The running (max, sum) before the first key: the head's sink logit (log2 domain)
        as one key of weight exp(sink) and no value, in the first split only (the merge of
        the splits then counts it once); else unchanged."""
        if HAS_SINKS:
            s = tl.load(sink_ptr + head, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_i = tl.where(first, s, m_i)
            l_i = tl.where(first, 1.0, l_i)
        return m_i, l_i

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
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, pos_ptr, sink_ptr, o_ptr, pacc_ptr,
                           pml_ptr,
                           S, sq0, sq1, sk0, sk1, sv0, sv1, svis, window, qk_scale, inv_cap,
                           cap2, T: tl.constexpr, REP: tl.constexpr, H: tl.constexpr,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr, TILES: tl.constexpr, NSPLIT: tl.constexpr,
                           SOFTCAP: tl.constexpr, SINGLE: tl.constexpr, DOT_F32: tl.constexpr,
                           POS: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                           DK: tl.constexpr, NDK: tl.constexpr):
        """POS: no mask in memory; query row t sits at position pos[t] and sees key slot j iff
        j <= pos[t] (and pos[t] - j < window with WINDOW): the decode graph's visibility with
        no mask to build per step, and no mask load before each tile's K."""
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
        qp = q_ptr + t.to(tl.int64)[:, None] * sq0 + head.to(tl.int64)[:, None] * sq1
        q = tl.load(qp + d[None, :], mask=qm, other=0.0)
        kbase = k_ptr + g.to(tl.int64) * sk0
        vbase = v_ptr + g.to(tl.int64) * sv0
        if POS:
            qpos = tl.load(pos_ptr + t, mask=rmask, other=-1)[:, None]  # [BLOCK_M, 1]
        else:
            vrow = vis_ptr + t.to(tl.int64)[:, None] * svis
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        m_i, l_i = _sink_start(sink_ptr, head, rmask, sp == 0, m_i, l_i, HAS_SINKS)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for i in range(TILES):
            s_idx = (sp * TILES + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            smask = s_idx < S
            if POS:
                vis = (s_idx[None, :] <= qpos) & smask[None, :]
                if WINDOW:
                    vis = vis & (qpos - s_idx[None, :] < window)
            else:
                vis = tl.load(vrow + s_idx[None, :], mask=rmask[:, None] & smask[None, :],
                              other=0) != 0
            if tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0:
                kv_off = s_idx.to(tl.int64)[:, None]
                # keys no row sees are not read (0): stale NaN/inf there cannot leak via 0 * v
                kvis = tl.max(vis.to(tl.int32), axis=0) > 0
                km = (smask & kvis)[:, None] & dmask[None, :]
                sc = _tile_scores(q, qp, rmask, kbase + kv_off * sk1, smask & kvis, d, dmask,
                                  qk_scale, inv_cap, cap2, SOFTCAP, DOT_F32, BLOCK_M, BLOCK_S,
                                  D, DK, NDK)
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


def attention_masked(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float,
                     softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    return attention_masked_split(q, k, v, visible, scale, softcap, sinks=sinks)


def score_consts(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """`_scores`' (qk_scale, inv_cap, cap2): log2-domain scale, or the soft-cap's constants."""
    if softcap is not None:
        inv_cap = 2.0 * scale / softcap
        return 0.0, inv_cap * LOG2E, softcap * LOG2E
    return scale * LOG2E, 0.0, 0.0


def attn_block_s(block_d: int) -> int:
    """Keys per tile of `attention_masked`: 64 (32 for head dims over 128, 16 over 256). Env
    `MLXR_ATTN_BLOCK_S` (read at each call, i.e. when a decode graph is captured) sets it, for
    A/B runs."""
    env = os.environ.get("MLXR_ATTN_BLOCK_S")
    if env:
        return int(env)
    return 64 if block_d <= 128 else (32 if block_d <= 256 else 16)


def wide_head(block_d: int) -> tuple[int, int, int]:
    """(DK, NDK, warps) for a head of block_d (a power of two) features. Up to 256: one dot
    over the head (DK = block_d, NDK = 1) and 4 warps, the launch every dense model has run.
    Over 256 (Gemma 4's 512-wide full-attention heads), per program with 16 query rows and 16
    keys per tile: the P.V accumulator [16, 512] fp32 is 8192 values, 64 registers per thread
    at 4 warps; the K and V tiles [16, 512] bf16 add 16 KB each. The q.k dot goes by DK = 128
    slices (q [16, 128] and K [16, 128] per slice, re-read from L1), and 8 warps halve the
    accumulator's share per thread (32 registers), so nothing spills on Hopper's 255
    registers a thread. Env `MLXR_ATTN_DK` sets DK (A/B runs; 0: one dot as below 256)."""
    env = os.environ.get("MLXR_ATTN_DK")
    dk = int(env) if env else (128 if block_d > 256 else block_d)
    dk = block_d if dk <= 0 else min(dk, block_d)
    return dk, block_d // dk, 8 if dk < block_d else 4


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


def attention_at(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, window: int | None,
                 scale: float, softcap: float | None = None,
                 sinks: Tensor | None = None) -> Tensor:
    """`reference.attention_at`: query row t at position positions[t] (device long [T]) over
    key slots whose positions are their indices; the visibility is computed in the kernel."""
    return attention_masked_split(q, k, v, None, scale, softcap, positions=positions,
                                  window=window, sinks=sinks)


def attention_masked_split(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                           scale: float, softcap: float | None = None,
                           block_s: int | None = None, splits: int | None = None,
                           positions: Tensor | None = None,
                           window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """attention_masked with the launch policy exposed (tests force split / single pass), or
    with `positions` (and `window`) instead of `visible`: `attention_at`. sinks [H]: one
    more logit per head (gpt-oss), as `reference.attention_masked`."""
    t, h, d = q.shape
    kh, s, _ = k.shape
    rep = h // kh
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if positions is not None:
        if positions.shape != (t,) or positions.dtype != torch.int64 or (
                window is not None and window < 1):
            raise ValueError(f"attention_at: positions {tuple(positions.shape)} "
                             f"{positions.dtype} for {t} rows, window {window}")
        pos = vis = positions.contiguous()
        svis = 0
    else:
        vis = visible if visible.stride(-1) == 1 else visible.contiguous()
        vis = vis.view(torch.uint8) if vis.dtype == torch.bool else (vis != 0).view(torch.uint8)
        svis = 0 if vis.dim() == 1 or vis.shape[0] == 1 else vis.stride(0)
        pos, window = vis, None  # unused
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
    dk, ndk, warps = wide_head(block_d)
    _attn_split_kernel[(kh, nsplit, mblocks)](
        q, k, v, vis, pos, sinks if sinks is not None else q, out, pacc, pml, s, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), svis, window or 0,
        qk_scale, inv_cap, cap2,
        T=t, REP=rep, H=h, D=d, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=block_s, TILES=per,
        NSPLIT=nsplit, SOFTCAP=softcap is not None, SINGLE=single, DOT_F32=dot_f32,
        POS=positions is not None, WINDOW=window is not None, HAS_SINKS=sinks is not None,
        DK=dk, NDK=ndk, num_warps=warps)
    if not single:
        _attn_combine_kernel[(kh * rt,)](
            pacc, pml, out, T=t, REP=rep, H=h, D=d, NSPLIT=nsplit, BLOCK_N=_p2(nsplit),
            BLOCK_D=block_d, TRIGGER=pdl(out.device), num_warps=_warps(_p2(nsplit) * block_d))
    return out
