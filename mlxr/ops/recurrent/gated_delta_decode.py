"""The gated DeltaNet mixer's decode step (T = 1 per sequence) as one Triton launch: from the
input projection's row to the input of out_proj (`reference.gated_delta_decode` is its twin,
the reference ops composed).

One program per (sequence, key head): it owns the conv channels of its q and k head and of the
REP value heads that read them (contiguous channels), so it alone reads and rewrites their
rolling conv state; a program per value head would race on the shared q/k channels (one
rewriting the state another has not read yet); and RMSNormGated needs a value head's whole
Dv row, so the rows are not split across programs either (B = 1 at the 0.8b / 2b shapes: 16
programs, each streaming its head's 64 KB state in and out). Steps, each rounded where the
reference rounds:

1. conv1d + SiLU over the owned channels (taps summed in order in float32, rounded to the
   dtype, SiLU in float32 rounded again); with REP > 1 the conv'd v goes to the program's own
   slice of `out` (exact: already in the dtype) and is read back per value head after the
   barrier (REP = 1: it stays in registers, and the state tile's load is issued first);
2. the q / k unit RMS in float32, rounded, times Dk^-1 / Dk^-0.5 rounded to the dtype;
3. a barrier (every old conv state value read), then the rolled state [old rows 1.. | x];
4. per value head: gates (softplus in the dtype, g float32, beta = sigmoid(b) in the dtype),
   the delta rule on the float32 state tile [Dv, Dk] (all of it in registers, updated in
   place), y rounded to the dtype, then RMSNormGated: rms_norm(y) rounded, times the weight
   rounded, times SiLU(z) in float32, rounded. softplus is max(a, 0) + log(1 + exp(-|a|))
   (torch: log1p; they differ only where exp(-|a|) is below float32's epsilon, by < 2^-23
   absolute: g = exp(-A sp) moves by < A 2^-23 relative, a few float32 ulps).

Capturable: no host reads, fixed addresses, states written in place.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - torch-only installs
    HAVE_TRITON = False

from .gated_delta_scan import _DTYPES

# The state tile [Dv, Dk] of a value head is held in registers: beyond this many elements it
# would spill (the mixer keeps the unfused path there; the 0.8b/2b/next shapes are 128 x 128).
MAX_TILE = 128 * 128
MAX_KERNEL = 8  # conv taps unrolled in the kernel


def supported(proj: Tensor, conv_state: Tensor, ssm_state: Tensor, conv_w: Tensor,
              heads: tuple[int, int, int, int]) -> bool:
    """Whether the fused step takes these operands (else the composed ops): head dims whose
    state tile fits, a conv width it unrolls, states it can update in place."""
    dk, dv = heads[2], heads[3]
    return (triton.next_power_of_2(dk) * triton.next_power_of_2(dv) <= MAX_TILE
            and 2 <= conv_w.shape[1] <= MAX_KERNEL and proj.dtype in _DTYPES
            and conv_state.dtype == proj.dtype and conv_state.stride(-1) == 1
            and ssm_state.dtype == torch.float32 and ssm_state.is_contiguous())


def qk_norm_constants(dk: int) -> tuple[float, float, float]:
    """(eps added to the mean square, q's scale, k's scale) of `reference.l2norm_qk`."""
    inv = dk**-0.5  # the same float64 expressions, rounded alike
    return 1e-6 * inv**2, inv**2, inv


@functools.cache
def _rounded(x: float, dtype: torch.dtype) -> float:
    """x rounded to dtype, as the reference multiplies by a scalar of the dtype (cached: no
    tensor made per step)."""
    return torch.tensor(x, dtype=dtype).item()


if HAVE_TRITON:

    @triton.jit
    def _cast(x, kind: tl.constexpr):
        """float32 x rounded to the output dtype (kind: `_DTYPES`). bf16 is rounded to nearest
        even by hand: the same result as the GPU's cast, and the interpreter's cast truncates
        (the bf16 twin check would otherwise see 1-ulp differences at every rounding)."""
        if kind == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact
        elif kind == 2:
            y = x.to(tl.float16)
        else:
            y = x
        return y

    @triton.jit
    def _conv_roll(x_row, state, s_cw, w, ch, n, BLOCK: tl.constexpr, W: tl.constexpr,
                   BLOCK_W: tl.constexpr, OUT: tl.constexpr):
        """Channels ch [BLOCK] (first n valid) of one sequence: silu(conv) as float32 values
        of the dtype, and the rolled state rows [BLOCK_W, BLOCK] (row r: old row r+1, the
        last one x). Loads only: the caller stores the rows after its barrier."""
        m = tl.arange(0, BLOCK) < n
        x = tl.load(x_row + ch, mask=m, other=0.0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(W):
            if j < W - 1:
                tap = tl.load(state + j * s_cw + ch, mask=m, other=0.0).to(tl.float32)
            else:
                tap = x.to(tl.float32)
            acc = acc + tap * tl.load(w + ch * W + j, mask=m, other=0.0).to(tl.float32)
        a = _cast(acc, OUT).to(tl.float32)
        y = _cast(a * tl.sigmoid(a), OUT).to(tl.float32)
        rw = tl.arange(0, BLOCK_W)
        older = tl.load(state + (rw + 1)[:, None] * s_cw + ch[None, :],
                        mask=(rw + 1 < W - 1)[:, None] & m[None, :], other=0.0)
        rolled = tl.where((rw == W - 2)[:, None], x[None, :], older)
        return y, rolled

    @triton.jit
    def _store_rows(state, s_cw, ch, n, rolled, BLOCK: tl.constexpr, W: tl.constexpr,
                    BLOCK_W: tl.constexpr):
        rw = tl.arange(0, BLOCK_W)
        m = (rw < W - 1)[:, None] & (tl.arange(0, BLOCK) < n)[None, :]
        tl.store(state + rw[:, None] * s_cw + ch[None, :], rolled, mask=m)

    @triton.jit
    def _unit_rms_scaled(x, n, eps, scale, OUT: tl.constexpr):
        """_cast(x * rsqrt(mean(x^2) + eps)) * scale (a value of the dtype), as float32 values
        of the dtype; x [BLOCK] float32, zero beyond n."""
        r = _cast(x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps), OUT).to(tl.float32)
        return _cast(r * scale, OUT).to(tl.float32)

    @triton.jit
    def _gdn_decode_kernel(proj, s_pb, conv_state, s_cb, s_cw, conv_w, ssm, a_log, dt_bias,
                           norm_w, out, s_ob, qk_eps, q_scale, k_scale, eps, rows,
                           HAS_ROWS: tl.constexpr,
                           HK: tl.constexpr, HV: tl.constexpr, REP: tl.constexpr,
                           DK: tl.constexpr,
                           DV: tl.constexpr, W: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_V: tl.constexpr, BLOCK_RV: tl.constexpr,
                           BLOCK_W: tl.constexpr, OUT: tl.constexpr):
        b, hk = tl.program_id(0), tl.program_id(1)
        RV = REP * DV  # the program's value channels
        CONV = 2 * HK * DK + HV * DV  # conv channels; then z, b, a
        x_row = proj + b * s_pb
        sb = tl.load(rows + b) if HAS_ROWS else b  # the sequence's rows of the state pools
        st = conv_state + sb * s_cb
        rk, rrv, rv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_RV), tl.arange(0, BLOCK_V)
        mv, mk = rv < DV, rk < DK
        m2 = mv[:, None] & mk[None, :]
        if REP == 1:  # the state tile's load issued first: its latency hides under the conv
            s_first = tl.load(ssm + ((sb * HV + hk) * DV + rv[:, None]) * DK + rk[None, :],
                              mask=m2, other=0.0)
        q_ch = hk * DK + rk
        k_ch = HK * DK + hk * DK + rk
        v_ch = 2 * HK * DK + hk * RV + rrv
        q, q_rows = _conv_roll(x_row, st, s_cw, conv_w, q_ch, DK, BLOCK_K, W, BLOCK_W, OUT)
        k, k_rows = _conv_roll(x_row, st, s_cw, conv_w, k_ch, DK, BLOCK_K, W, BLOCK_W, OUT)
        v, v_rows = _conv_roll(x_row, st, s_cw, conv_w, v_ch, RV, BLOCK_RV, W, BLOCK_W, OUT)
        o_row = out + b * s_ob + hk * RV
        if REP > 1:  # read back per value head below (REP = 1: v is the head's already)
            tl.store(o_row + rrv, _cast(v, OUT), mask=rrv < RV)
        q = _unit_rms_scaled(q, DK, qk_eps, q_scale, OUT)
        k = _unit_rms_scaled(k, DK, qk_eps, k_scale, OUT)
        tl.debug_barrier()  # every old conv state value and the v stores above are done
        _store_rows(st, s_cw, q_ch, DK, q_rows, BLOCK_K, W, BLOCK_W)
        _store_rows(st, s_cw, k_ch, DK, k_rows, BLOCK_K, W, BLOCK_W)
        _store_rows(st, s_cw, v_ch, RV, v_rows, BLOCK_RV, W, BLOCK_W)
        for j in tl.static_range(REP):
            hv = hk * REP + j
            a = tl.load(x_row + CONV + HV * DV + HV + hv).to(tl.float32)
            dt = tl.load(dt_bias + hv).to(tl.float32)
            a = _cast(a + dt, OUT).to(tl.float32)
            sp = _cast(tl.maximum(a, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(a))), OUT)
            g = tl.exp(-tl.exp(tl.load(a_log + hv).to(tl.float32)) * sp.to(tl.float32))
            bt = tl.load(x_row + CONV + HV * DV + hv).to(tl.float32)
            beta = _cast(tl.sigmoid(bt), OUT).to(tl.float32)
            if REP > 1:
                vj = tl.load(o_row + j * DV + rv, mask=mv, other=0.0).to(tl.float32)
            else:
                vj = v
            s_ptr = ssm + ((sb * HV + hv) * DV + rv[:, None]) * DK + rk[None, :]
            if REP == 1:
                s = s_first * g  # [BLOCK_V, BLOCK_K] float32
            else:
                s = tl.load(s_ptr, mask=m2, other=0.0) * g
            delta = (vj - tl.sum(s * k[None, :], axis=1)) * beta
            s = s + k[None, :] * delta[:, None]
            tl.store(s_ptr, s, mask=m2)
            y = _cast(tl.sum(s * q[None, :], axis=1), OUT).to(tl.float32)
            nrm = _cast(y * tl.rsqrt(tl.sum(y * y, axis=0) / DV + eps), OUT).to(tl.float32)
            wt = tl.load(norm_w + rv, mask=mv, other=0.0).to(tl.float32)
            nrm = _cast(nrm * wt, OUT).to(tl.float32)
            z = tl.load(x_row + 2 * HK * DK + HV * DV + hv * DV + rv, mask=mv,
                        other=0.0).to(tl.float32)
            tl.store(o_row + j * DV + rv, _cast(z * tl.sigmoid(z) * nrm, OUT), mask=mv)


def gated_delta_decode(proj: Tensor, conv_state: Tensor, ssm_state: Tensor, conv_w: Tensor,
                       a_log: Tensor, dt_bias: Tensor, norm_w: Tensor,
                       heads: tuple[int, int, int, int], eps: float,
                       rows: Tensor | None = None) -> Tensor:
    """See `reference.gated_delta_decode` (proj [B, P] with a contiguous last dim; the states
    are updated in place; with `rows` [B] long, row b's states are rows[b] of the state pools,
    read and written there: no gather / scatter copies)."""
    hk, hv, dk, dv = heads
    bsz = proj.shape[0]
    width = conv_w.shape[1]
    if conv_state.stride(-1) != 1 or conv_state.dtype != proj.dtype:
        raise ValueError("gated_delta_decode: the conv state must be in the projection's "
                         "dtype with a contiguous last dim")
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("gated_delta_decode: the state must be a contiguous float32 tensor")
    proj = proj if proj.stride(-1) == 1 else proj.contiguous()
    out = torch.empty((bsz, hv * dv), dtype=proj.dtype, device=proj.device)
    block_k, block_v = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    qk_eps, q_scale, k_scale = qk_norm_constants(dk)
    # the scales rounded to the dtype first, as the reference multiplies by a dtype scalar
    q_scale, k_scale = _rounded(q_scale, proj.dtype), _rounded(k_scale, proj.dtype)
    _gdn_decode_kernel[(bsz, hk)](
        proj, proj.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1),
        conv_w.contiguous(), ssm_state, a_log, dt_bias, norm_w, out, out.stride(0), qk_eps,
        q_scale, k_scale, eps, proj if rows is None else rows, HAS_ROWS=rows is not None,
        HK=hk, HV=hv, REP=hv // hk, DK=dk, DV=dv, W=width, BLOCK_K=block_k, BLOCK_V=block_v,
        BLOCK_RV=triton.next_power_of_2(hv // hk * dv),
        BLOCK_W=triton.next_power_of_2(width - 1), OUT=_DTYPES[proj.dtype],
        num_warps=8 if block_k * block_v >= 8192 else 4)
    return out
