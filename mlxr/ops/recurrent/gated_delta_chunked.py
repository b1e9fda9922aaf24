"""Chunked gated delta rule for prefill (issue 29): the Triton twin of
`reference.gated_delta_chunked` (same signature, same math; see its docstring for the
formulation). Two launches per call:

* `_chunk_prepare_kernel`, one program per (sequence, value head, chunk of C = 64 tokens), all
  chunks at once: the in-chunk cumsum of log g, A = strictly-lower(beta_i e^(b_i - b_j)
  k_i.k_j) [C, C], T = (I + A)^-1 by forward substitution (row i of T = e_i - sum_{j<i} A_ij
  T_j), then W = T diag(beta e^b) K [C, Dk], U0 = T diag(beta) V [C, Dv] and the masked
  intra-chunk scores P = lower(Q K^T e^(b_i - b_j)) [C, C], written to float32 scratch.
* `_chunk_state_kernel`, one program per (sequence, value head, block of BLOCK_V value
  columns), sequential over the chunks: the state tile H = S^T [Dk, BLOCK_V] stays in
  registers; per chunk U = U0 - W H, O = e^b Q H + P U, H <- e^(b_last) H +
  K^T diag(e^(b_last - b)) U. Four [C|Dk, .] x [., BLOCK_V] matrix products per chunk.

Scratch per call: (W, U0, P, b) = 4 T_pad Hv (Dk + Dv + C + 1) bytes per sequence (T_pad: T
rounded up to C; ~4.4 MB for 512 tokens at 16 heads of 128). The matrix products run in
float32 (`input_precision` PRECISION: "ieee" by default; MLXR_GDN_CHUNK_PRECISION=tf32 or
tf32x3 for the tensor-core forms, measured by scripts/gdn_chunked_gpu.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .reference import LOG_G_MIN, CHUNK

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - torch-only installs
    HAVE_TRITON = False

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PRECISIONS = ("ieee", "tf32", "tf32x3")

if HAVE_TRITON:

    @triton.jit
    def _cast(x, kind: tl.constexpr):
        if kind == 1:
            y = x.to(tl.bfloat16)
        elif kind == 2:
            y = x.to(tl.float16)
        else:
            y = x
        return y

    @triton.jit
    def _chunk_prepare_kernel(q, k, v, g, beta, w_buf, u_buf, p_buf, b_buf, T, HV, TP,
                              s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_gb, s_gt,
                              REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
                              LOG_G_MIN: tl.constexpr, PRECISION: tl.constexpr):
        b, hv, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = hv // REP
        ri = tl.arange(0, C)
        rt = c * C + ri  # token rows of this chunk
        mt = rt < T
        rk, rv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_DV)
        mk, mv = rk < DK, rv < DV
        # gates: padded rows get log g = 0 and beta = 0 (no change to anything); g = 0 (an
        # underflowed decay) is taken as e^LOG_G_MIN (no log of 0)
        gt = tl.load(g + b * s_gb + rt * s_gt + hv, mask=mt, other=1.0)
        logg = tl.where(mt, tl.maximum(tl.log(tl.maximum(gt, 1e-35)), LOG_G_MIN), 0.0)
        bc = tl.cumsum(logg, 0)  # [C]
        bt = tl.load(beta + b * s_gb + rt * s_gt + hv, mask=mt, other=0.0).to(tl.float32)
        qk_rows = b * s_qb + rt[:, None] * s_qt + hk * s_qh + rk[None, :]
        m_qk = mt[:, None] & mk[None, :]
        kc = tl.load(k + qk_rows, mask=m_qk, other=0.0).to(tl.float32)  # [C, BLOCK_K]
        qc = tl.load(q + qk_rows, mask=m_qk, other=0.0).to(tl.float32)
        incl = ri[:, None] >= ri[None, :]
        strict = ri[:, None] > ri[None, :]
        decay = tl.exp(tl.where(incl, bc[:, None] - bc[None, :], 0.0))  # exponents <= 0
        kk = tl.dot(kc, tl.trans(kc), input_precision=PRECISION)  # [C, C]
        a = tl.where(strict, bt[:, None] * decay * kk, 0.0)
        # T = (I + A)^-1, row by row: T_i = e_i - sum_{j<i} A_ij T_j (rows j >= i of the
        # running T are still e_j, but A_ij = 0 there)
        tri = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
        for i in range(1, C):
            a_i = tl.sum(tl.where(ri[:, None] == i, a, 0.0), 0)  # row i of A, [C] over j
            row = tl.sum(a_i[:, None] * tri, 0)  # sum_j A_ij T_j, [C]
            tri = tri - tl.where(ri[:, None] == i, row[None, :], 0.0)
        wk = tl.dot(tri, kc * (bt * tl.exp(bc))[:, None], input_precision=PRECISION)
        vc = tl.load(v + b * s_vb + rt[:, None] * s_vt + hv * s_vh + rv[None, :],
                     mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
        u0 = tl.dot(tri, vc * bt[:, None], input_precision=PRECISION)  # [C, BLOCK_DV]
        p = tl.where(incl, tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * decay, 0.0)
        row0 = (b * HV + hv) * TP + c * C  # first scratch row of this (sequence, head, chunk)
        tl.store(w_buf + (row0 + ri)[:, None] * DK + rk[None, :], wk, mask=mk[None, :])
        tl.store(u_buf + (row0 + ri)[:, None] * DV + rv[None, :], u0, mask=mv[None, :])
        tl.store(p_buf + (row0 + ri)[:, None] * C + ri[None, :], p)
        tl.store(b_buf + row0 + ri, bc)

    @triton.jit
    def _chunk_state_kernel(q, k, w_buf, u_buf, p_buf, b_buf, state, y, T, HV, TP,
                            s_qb, s_qt, s_qh,
                            REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                            PRECISION: tl.constexpr, OUT: tl.constexpr):
        b, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = hv // REP
        ri = tl.arange(0, C)
        rk = tl.arange(0, BLOCK_K)
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        mk, mv = rk < DK, rv < DV
        m_kv = mk[:, None] & mv[None, :]
        # H = S^T: element [kk, vv] of the tile is state[b, hv, vv, kk]
        sp = state + ((b * HV + hv) * DV + rv[None, :]) * DK + rk[:, None]
        h = tl.load(sp, mask=m_kv, other=0.0)  # [BLOCK_K, BLOCK_V] float32
        base = (b * HV + hv) * TP
        c0 = 0
        while c0 < T:  # runtime bound (see gated_delta_scan)
            rows = base + c0 + ri  # scratch rows of this chunk
            rt = c0 + ri
            mt = rt < T
            bc = tl.load(b_buf + rows)
            last = tl.load(b_buf + base + c0 + C - 1)
            wk = tl.load(w_buf + rows[:, None] * DK + rk[None, :], mask=mk[None, :], other=0.0)
            u = tl.load(u_buf + rows[:, None] * DV + rv[None, :], mask=mv[None, :], other=0.0)
            u = u - tl.dot(wk, h, input_precision=PRECISION)  # [C, BLOCK_V]
            qk_rows = b * s_qb + rt[:, None] * s_qt + hk * s_qh + rk[None, :]
            m_qk = mt[:, None] & mk[None, :]
            qc = tl.load(q + qk_rows, mask=m_qk, other=0.0).to(tl.float32)
            p = tl.load(p_buf + rows[:, None] * C + ri[None, :])
            o = (tl.exp(bc)[:, None] * tl.dot(qc, h, input_precision=PRECISION)
                 + tl.dot(p, u, input_precision=PRECISION))
            tl.store(y + ((b * T + rt[:, None]) * HV + hv) * DV + rv[None, :], _cast(o, OUT),
                     mask=mt[:, None] & mv[None, :])
            kc = tl.load(k + qk_rows, mask=m_qk, other=0.0).to(tl.float32)
            ku = tl.dot(tl.trans(kc), u * tl.exp(last - bc)[:, None],
                        input_precision=PRECISION)
            h = tl.exp(last) * h + ku
            c0 += C
        tl.store(sp, h, mask=m_kv)


def precision() -> str:
    """The matrix products' float32 input precision (MLXR_GDN_CHUNK_PRECISION, read at each
    call; "ieee" unless set)."""
    p = os.environ.get("MLXR_GDN_CHUNK_PRECISION", "ieee")
    if p not in PRECISIONS:
        raise ValueError(f"MLXR_GDN_CHUNK_PRECISION={p!r}: expected one of {PRECISIONS}")
    return p


def gated_delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        state: Tensor, block_v: int = 32, warps: tuple[int, int] = (8, 4)
                        ) -> Tensor:
    """See `reference.gated_delta_chunked` (q, k, v may be strided views with a contiguous
    last dim; `state`, float32 and contiguous, is updated in place). block_v: value columns
    per program of the state pass; warps: (prepare, state) warps per program."""
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("gated_delta: the state must be a contiguous float32 tensor")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g = g.float().contiguous()
    beta = beta.contiguous()
    prec = precision()
    nt = triton.cdiv(t, CHUNK)
    tp = nt * CHUNK
    f32 = dict(dtype=torch.float32, device=v.device)
    w_buf = torch.empty((bsz, hv, tp, dk), **f32)
    u_buf = torch.empty((bsz, hv, tp, dv), **f32)
    p_buf = torch.empty((bsz, hv, tp, CHUNK), **f32)
    b_buf = torch.empty((bsz, hv, tp), **f32)
    block_k = max(16, triton.next_power_of_2(dk))
    _chunk_prepare_kernel[(bsz, hv, nt)](
        q, k, v, g, beta, w_buf, u_buf, p_buf, b_buf, t, hv, tp,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), REP=hv // hk, DK=dk, DV=dv, C=CHUNK, BLOCK_K=block_k,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), LOG_G_MIN=LOG_G_MIN, PRECISION=prec,
        num_warps=warps[0])
    y = torch.empty((bsz, t, hv, dv), dtype=q.dtype, device=q.device)
    block_v = max(16, min(block_v, triton.next_power_of_2(dv)))
    _chunk_state_kernel[(bsz, hv, triton.cdiv(dv, block_v))](
        q, k, w_buf, u_buf, p_buf, b_buf, state, y, t, hv, tp,
        q.stride(0), q.stride(1), q.stride(2), REP=hv // hk, DK=dk, DV=dv, C=CHUNK,
        BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=prec, OUT=_DTYPES[q.dtype],
        num_warps=warps[1])
    return y
