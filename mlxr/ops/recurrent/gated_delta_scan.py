"""Triton twins of the gated DeltaNet ops (`mlxr.ops.recurrent.reference`): same signatures,
same order of the time recurrence (sequential, one token after another, as mlx-lm runs it also
for prefill).

* `gated_delta`: one program per (sequence, value head, block of BLOCK_V value rows); the
  float32 state tile [BLOCK_V, Dk] stays in registers across the T tokens of the call (decode:
  T = 1; prefill: the whole prompt in one launch per layer). Per token: decay, k-readout, delta,
  rank-1 update, q-readout, exactly the reference's steps; the Dk sums are tree reductions
  (the reference's torch sums are too, in another order: float32 rounding differences only).
* `conv1d_silu`: one program per (sequence, block of tokens, block of channels); taps summed
  in the reference's order in float32, rounded to the input dtype, then SiLU in float32 rounded
  once more (as F.silu on that dtype). The new state (last W-1 inputs) is a torch slice.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - torch-only installs
    HAVE_TRITON = False

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

if HAVE_TRITON:

    @triton.jit
    def _cast(x, kind: tl.constexpr):
        # one return: the GPU compiler refuses returns of different types (the interpreter not)
        if kind == 1:
            y = x.to(tl.bfloat16)
        elif kind == 2:
            y = x.to(tl.float16)
        else:
            y = x
        return y

    @triton.jit
    def _step_inputs(q, k, v, g, beta, t, T, b, hv, hk, rk, rv, mk, mv, s_qb, s_qt, s_qh,
                     s_vb, s_vt, s_vh, s_gb, s_gt):
        """Token t's k, q [BLOCK_K], v [BLOCK_V] (float32), decay and beta (t >= T: zeros,
        never used)."""
        ok = t < T
        qk_off = b * s_qb + t * s_qt + hk * s_qh
        kt = tl.load(k + qk_off + rk, mask=mk & ok, other=0.0).to(tl.float32)
        qt = tl.load(q + qk_off + rk, mask=mk & ok, other=0.0).to(tl.float32)
        v_off = b * s_vb + t * s_vt + hv * s_vh
        vt = tl.load(v + v_off + rv, mask=mv & ok, other=0.0).to(tl.float32)
        gt = tl.load(g + b * s_gb + t * s_gt + hv, mask=ok, other=0.0)
        bt = tl.load(beta + b * s_gb + t * s_gt + hv, mask=ok, other=0.0).to(tl.float32)
        return kt, qt, vt, gt, bt

    @triton.jit
    def _gated_delta_kernel(q, k, v, g, beta, state, y, T, HV,
                            s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_gb, s_gt,
                            REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                            OUT: tl.constexpr, PREFETCH: tl.constexpr):
        b, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = hv // REP
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        rk = tl.arange(0, BLOCK_K)
        mv, mk = rv < DV, rk < DK
        m2 = mv[:, None] & mk[None, :]
        sp = state + ((b * HV + hv) * DV + rv[:, None]) * DK + rk[None, :]
        s = tl.load(sp, mask=m2, other=0.0)  # [BLOCK_V, BLOCK_K] float32
        kt, qt, vt, gt, bt = _step_inputs(q, k, v, g, beta, 0, T, b, hv, hk, rk, rv, mk, mv,
                                          s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_gb, s_gt)
        t = 0
        while t < T:  # a while loop: runtime bounds (the interpreter's `range` wants constants)
            if PREFETCH:  # token t+1's loads issued before token t's math (their latency
                # hides behind it; the same values and arithmetic either way)
                kn, qn, vn, gn, bn = _step_inputs(q, k, v, g, beta, t + 1, T, b, hv, hk, rk,
                                                  rv, mk, mv, s_qb, s_qt, s_qh, s_vb, s_vt,
                                                  s_vh, s_gb, s_gt)
            s = s * gt
            kv = tl.sum(s * kt[None, :], axis=1)  # [BLOCK_V]
            delta = (vt - kv) * bt
            s = s + kt[None, :] * delta[:, None]
            yt = tl.sum(s * qt[None, :], axis=1)
            tl.store(y + ((b * T + t) * HV + hv) * DV + rv, _cast(yt, OUT), mask=mv)
            if not PREFETCH:
                kn, qn, vn, gn, bn = _step_inputs(q, k, v, g, beta, t + 1, T, b, hv, hk, rk,
                                                  rv, mk, mv, s_qb, s_qt, s_qh, s_vb, s_vt,
                                                  s_vh, s_gb, s_gt)
            kt, qt, vt, gt, bt = kn, qn, vn, gn, bn
            t += 1
        tl.store(sp, s, mask=m2)

    @triton.jit
    def _conv1d_silu_kernel(x, state, w, y, T, C, s_xb, s_xt, s_sb, s_st, s_yb, s_yt,
                            W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                            OUT: tl.constexpr):
        b, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rt = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        rc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mt, mc = rt < T, rc < C
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(W):
            # tap j of output t reads position t + j of [state (W-1 rows) | x]
            pos = rt + j - (W - 1)
            from_x = pos >= 0
            xs = tl.load(x + b * s_xb + pos[:, None] * s_xt + rc[None, :],
                         mask=(mt & from_x)[:, None] & mc[None, :], other=0.0)
            ss = tl.load(state + b * s_sb + (pos + W - 1)[:, None] * s_st + rc[None, :],
                         mask=(mt & ~from_x)[:, None] & mc[None, :], other=0.0)
            inp = tl.where(from_x[:, None], xs.to(tl.float32), ss.to(tl.float32))
            wj = tl.load(w + rc * W + j, mask=mc, other=0.0).to(tl.float32)
            acc = acc + inp * wj[None, :]  # from zeros: 0 + x is x exactly (the compiler
            # needs acc defined before the loop; the interpreter did not)
        a = _cast(acc, OUT).to(tl.float32)
        out = _cast(a * tl.sigmoid(a), OUT)
        tl.store(y + b * s_yb + rt[:, None] * s_yt + rc[None, :], out,
                 mask=mt[:, None] & mc[None, :])


def gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                state: Tensor) -> Tensor:
    """See `recurrent.gated_delta` (same shapes; q, k, v may be strided views; `state`, float32
    and contiguous, is updated in place)."""
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g = g.float().contiguous()
    beta = beta.contiguous()
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("gated_delta: the state must be a contiguous float32 tensor")
    y = torch.empty((bsz, t, hv, dv), dtype=q.dtype, device=q.device)
    block_k = triton.next_power_of_2(dk)
    rows, warps = launch_shape(dk)
    block_v = min(triton.next_power_of_2(dv), rows)
    grid = (bsz, hv, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, state, y, t, hv, q.stride(0), q.stride(1), q.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), REP=hv // hk,
        DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, OUT=_DTYPES[q.dtype],
        PREFETCH=prefetch(), num_warps=warps)
    return y


def launch_shape(dk: int) -> tuple[int, int]:
    """`gated_delta`'s (value rows per program, warps) at key width dk: envs MLXR_GDN_BLOCK_V
    (a power of two) and MLXR_GDN_WARPS (read at each call) where set; else 2 rows over 1 warp
    at Dk 128, the only key width of the qwen3_5 / qwen3_next checkpoints (H100, T = 512, bf16,
    us a layer call incl. a 1 MB state copy: 231 (session 22) and 213 (session 23) against
    264 / 274 for 8 rows over 4 warps, y and state bit for bit the old launch's both times),
    and max(8, 1024 / Dk) rows over 4 warps at other widths (unmeasured there). An explicit row
    count keeps 4 warps unless MLXR_GDN_WARPS says otherwise (the sweep's old launch: 32 rows
    over 4 warps)."""
    block_k = triton.next_power_of_2(dk)
    env_rows = int(os.environ.get("MLXR_GDN_BLOCK_V") or 0)
    narrow = not env_rows and block_k == 128
    rows = env_rows or (2 if narrow else max(8, 1024 // block_k))
    return rows, int(os.environ.get("MLXR_GDN_WARPS") or 0) or (1 if narrow else 4)


def prefetch() -> bool:
    """Env `MLXR_GDN_PREFETCH` (read at each call; on unless "0"): `gated_delta`'s kernel
    loads token t+1's inputs before token t's math, so their latency overlaps it (the
    sequential prefill kernel is latency-bound: ~1.7 us a token on the H200, 857 us a layer at
    T = 512 with the old launch). The launch shape is `launch_shape`'s. Both come from the
    sweep of scripts/hybrid_prefill_gpu.py on an H100 (session 22, Hk = Hv = 16, Dk = Dv = 128,
    T = 512, bf16, us per layer call incl. a 1 MB state copy): the old launch (no prefetch, 32
    rows) 689, prefetch 482, prefetch with 8 rows 264, with 2 rows over 1 warp 231, every one of
    them bit for bit the old launch's y and state (of the 13 configurations swept, only 2 rows
    over 4 warps summed in another order)."""
    return os.environ.get("MLXR_GDN_PREFETCH", "") != "0"


def conv1d_silu(x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """See `recurrent.conv1d_silu` (x [B, T, C] with a contiguous last dim)."""
    bsz, t, c = x.shape
    w = weight.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    state = state.to(x.dtype).contiguous()
    weight = weight.contiguous()
    y = torch.empty((bsz, t, c), dtype=x.dtype, device=x.device)
    block_t, block_c = min(16, triton.next_power_of_2(t)), 128
    grid = (bsz, triton.cdiv(t, block_t), triton.cdiv(c, block_c))
    _conv1d_silu_kernel[grid](x, state, weight, y, t, c, x.stride(0), x.stride(1),
                              state.stride(0), state.stride(1), y.stride(0), y.stride(1),
                              W=w, BLOCK_T=block_t, BLOCK_C=block_c, OUT=_DTYPES[x.dtype])
    new_state = torch.cat((state, x), dim=1)[:, t:].contiguous()
    return y, new_state
