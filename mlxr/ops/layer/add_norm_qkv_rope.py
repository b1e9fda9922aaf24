"""Triton kernels that fuse a decoder layer's glue ops (`mlxr.ops.reference` is the spec).

* `add_rms_norm`: s = h + r (fp32 add rounded to h.dtype, as torch's `h + r` for equal dtypes),
  stored, then `rms_norm` of s with the same rounding points as `norm_rope_act.rms_norm`: y =
  (s32 * rsqrt(mean(s32^2) + eps)) rounded to s.dtype, times (weight + offset) formed in the
  weight dtype, the product rounded to promote(s, weight). [BLOCK_M, BLOCK_E] row tiles.
* `qkv_rope_write`: everything between the fused qkv projection and attention. Grid (token,
  q head or kv head): a q program loads its head's D features of qkv [N, (H + 2K) * D] (a
  strided view is fine) as the rotated pairs (lo, hi) and the unrotated tail, applies the
  optional per-head RMSNorm (rounded like rms_norm), the optional yarn/longrope pre-scale of
  the 2R rotated features (rounded to the dtype, as `x * scale` is), RoPE in fp32 (rounded
  once) and stores q [N, H, D]; a kv program does the same for its k head, writes it to
  k_cache[g, slots[t]] and copies the v head to v_cache[g, slots[t]]. With `positions`, cos
  and sin are whole tables and token t reads row positions[t] (the decode graphs' positions
  live on the device: the gather is a load in this kernel, not two index_select launches).
  Norm weights, q and the caches share qkv's dtype (what `index_copy_` in the reference
  composition requires).
* `split_qkv_norm_rope_write`: the same kernel for Gemma 4, whose q and [k | v] come from two
  projections (a second source pointer), whose v is RMS-normed too (V_NORM) and may be k's own
  columns (k = v layers); on a KV-shared layer only the q programs run.

The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts; CUDA rounds to nearest.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .norm_rope_act import _p2, _warps, pdl


@triton.jit
def _add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, s_ptr, y_ptr, n_rows, sh, sr, eps, offset,
                         E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         HAS_OFFSET: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:  # the next grid (a PDL-launched GEMV) may start streaming its weights
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    m = (rows < n_rows)[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    h = tl.load(h_ptr + r64 * sh + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + r64 * sr + cols[None, :], mask=m, other=0.0).to(tl.float32)
    # the weight goes out with h and r: a load after the reduction's barriers would cost a
    # second memory round trip
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    s = (h + r).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + r64 * E + cols[None, :], s, mask=m)
    x = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / E + eps)
    y = (x * inv[:, None]).to(s_ptr.dtype.element_ty).to(tl.float32)
    if HAS_OFFSET:
        w = (w.to(tl.float32) + offset).to(w_ptr.dtype.element_ty)
    out = (y * w.to(tl.float32)[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r64 * E + cols[None, :], out, mask=m)


@triton.jit
def _norm_rope(x_row, w_ptr, c, s, lo, hi, p, im, pm, eps, offset, scale, D: tl.constexpr,
               HAS_NORM: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr):
    """One head: rotated pairs (x[lo], x[hi]) [BLOCK_R] and tail x[p] [BLOCK_P], normed,
    pre-scaled and rotated; returned in fp32 holding values of the output dtype."""
    dt = x_row.dtype.element_ty
    x1 = tl.load(x_row + lo, mask=im, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + hi, mask=im, other=0.0).to(tl.float32)
    xt = tl.load(x_row + p, mask=pm, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
                        + tl.sum(xt * xt, axis=0)) / D + eps)
        w1 = tl.load(w_ptr + lo, mask=im, other=0.0)
        w2 = tl.load(w_ptr + hi, mask=im, other=0.0)
        wt = tl.load(w_ptr + p, mask=pm, other=0.0)
        if HAS_OFFSET:  # (weight + offset) rounded to the weight dtype
            w1 = (w1.to(tl.float32) + offset).to(dt)
            w2 = (w2.to(tl.float32) + offset).to(dt)
            wt = (wt.to(tl.float32) + offset).to(dt)
        x1 = ((x1 * inv).to(dt).to(tl.float32) * w1.to(tl.float32)).to(dt).to(tl.float32)
        x2 = ((x2 * inv).to(dt).to(tl.float32) * w2.to(tl.float32)).to(dt).to(tl.float32)
        xt = ((xt * inv).to(dt).to(tl.float32) * wt.to(tl.float32)).to(dt).to(tl.float32)
    if HAS_SCALE:  # yarn / longrope: x[..., :2R] * scale, rounded to the dtype
        x1 = (x1 * scale).to(dt).to(tl.float32)
        x2 = (x2 * scale).to(dt).to(tl.float32)
    return x1 * c - x2 * s, x1 * s + x2 * c, xt


@triton.jit
def _qkv_rope_write_kernel(qkv_ptr, kv_ptr, qw_ptr, kw_ptr, vw_ptr, c_ptr, s_ptr, slot_ptr, pos_ptr,
                           q_ptr, kc_ptr, vc_ptr, sx0, skv0, v_off, sc0, skc0, skc1, svc0, svc1,
                           eps, offset, scale,
                           H: tl.constexpr, K: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                           TRAD: tl.constexpr, HAS_NORM: tl.constexpr, HAS_OFFSET: tl.constexpr,
                           HAS_SCALE: tl.constexpr, GATHER: tl.constexpr, V_NORM: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    crow = t  # the cos / sin row of token t: its own, or (GATHER) its position's in the tables
    if GATHER:
        crow = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.program_id(1)  # q head j < H, else kv head j - H
    i = tl.arange(0, BLOCK_R)
    im = i < R
    if TRAD:
        lo = 2 * i
        hi = 2 * i + 1
    else:
        lo = i
        hi = i + R
    p = 2 * R + tl.arange(0, BLOCK_P)  # unrotated tail (partial rotary), may be empty
    pm = p < D
    c = tl.load(c_ptr + crow * sc0 + i, mask=im, other=0.0)
    s = tl.load(s_ptr + crow * sc0 + i, mask=im, other=0.0)
    if j < H:
        x_row = qkv_ptr + t * sx0 + j * D
        o1, o2, ot = _norm_rope(x_row, qw_ptr, c, s, lo, hi, p, im, pm, eps, offset, scale,
                                D, HAS_NORM, HAS_OFFSET, HAS_SCALE)
        dst = q_ptr + (t * H + j) * D
    else:
        g = (j - H).to(tl.int64)
        x_row = kv_ptr + t * skv0 + g * D
        o1, o2, ot = _norm_rope(x_row, kw_ptr, c, s, lo, hi, p, im, pm, eps, offset, scale,
                                D, HAS_NORM, HAS_OFFSET, HAS_SCALE)
        slot = tl.load(slot_ptr + t)
        dst = kc_ptr + g * skc0 + slot * skc1
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        v = tl.load(x_row + v_off + d, mask=dm, other=0.0)
        if V_NORM:  # v's RMSNorm (Gemma 4), rounded as rms_norm rounds
            v32 = v.to(tl.float32)
            vw = tl.load(vw_ptr + d, mask=dm, other=0.0).to(tl.float32)
            y = (v32 * tl.rsqrt(tl.sum(v32 * v32, axis=0) / D + eps)).to(v.dtype)
            v = (y.to(tl.float32) * vw).to(v.dtype)
        tl.store(vc_ptr + g * svc0 + slot * svc1 + d, v, mask=dm)
    dt = dst.dtype.element_ty
    tl.store(dst + lo, o1.to(dt), mask=im)
    tl.store(dst + hi, o2.to(dt), mask=im)
    tl.store(dst + p, ot.to(dt), mask=pm)


# ============================================================================ host wrappers
def add_rms_norm(h: Tensor, r: Tensor, weight: Tensor, eps: float,
                 offset: float = 0.0) -> tuple[Tensor, Tensor]:
    e = h.shape[-1]
    shape = h.shape
    if h.dim() != 2 or h.stride(-1) != 1:
        h = h.reshape(-1, e).contiguous()
    if r.dim() != 2 or r.stride(-1) != 1:
        r = r.reshape(-1, e).contiguous()
    n = h.shape[0]
    w = weight.contiguous()
    s = torch.empty((n, e), dtype=h.dtype, device=h.device)
    y = torch.empty((n, e), dtype=torch.promote_types(h.dtype, w.dtype), device=h.device)
    if n and e:
        block_e = _p2(e)
        block_m = max(1, min(_p2(n), 4096 // block_e))
        _add_rms_norm_kernel[(triton.cdiv(n, block_m),)](
            h, r, w, s, y, n, h.stride(0), r.stride(0), float(eps), float(offset), E=e,
            BLOCK_M=block_m, BLOCK_E=block_e, HAS_OFFSET=bool(offset), TRIGGER=pdl(y.device),
            num_warps=_warps(block_m * block_e))
    return s.reshape(shape), y.reshape(shape)


def qkv_rope_write(qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                   q_norm: Tensor | None, k_norm: Tensor | None, eps: float, offset: float,
                   rope_scale: float, cos: Tensor, sin: Tensor, traditional: bool,
                   k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                   positions: Tensor | None = None) -> Tensor:
    h, kh, d = n_heads, n_kv_heads, head_dim
    assert qkv.shape[1] == (h + 2 * kh) * d, (qkv.shape, h, kh, d)
    assert k_cache.dtype == v_cache.dtype == qkv.dtype, (k_cache.dtype, qkv.dtype)
    has_norm = q_norm is not None
    if has_norm:
        assert q_norm.dtype == k_norm.dtype == qkv.dtype, (q_norm.dtype, qkv.dtype)
        qw, kw = q_norm, k_norm
    else:
        qw = kw = qkv  # unused
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _launch(qkv, qkv[:, h * d:], kh * d, qw, kw, None, h, kh, d, cos, sin, traditional,
                   k_cache, v_cache, slots, positions, eps, offset if has_norm else 0.0,
                   rope_scale, has_norm)


def split_qkv_norm_rope_write(q: Tensor, kv: Tensor | None, n_heads: int, n_kv_heads: int,
                              head_dim: int, q_norm: Tensor, k_norm: Tensor | None,
                              v_norm: Tensor | None, eps: float, cos: Tensor, sin: Tensor,
                              traditional: bool, k_eq_v: bool,
                              k_cache: Tensor | None, v_cache: Tensor | None, slots: Tensor | None,
                              positions: Tensor | None = None) -> Tensor:
    """`reference.split_qkv_norm_rope_write` in one launch: the q programs as
    `qkv_rope_write`'s, the kv programs reading their head of kv (v at the same columns when
    k_eq_v, else K heads further) and norming v (V_NORM)."""
    h, kh, d = n_heads, (0 if kv is None else n_kv_heads), head_dim
    assert q.shape[1] == h * d, (q.shape, h, d)
    assert q_norm.dtype == q.dtype, (q_norm.dtype, q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv is None:  # a KV-shared layer: q programs only; the kv arguments are never read,
        # but the compiler types the kv branch too: the slots dummy must be an integer tensor
        kv, k_norm, v_norm, k_cache, v_cache = q, q_norm, None, q, q
        slots = _no_slots(q.device)
    else:
        width = kh * d if k_eq_v else 2 * kh * d
        assert kv.shape[1] == width and kv.dtype == q.dtype, (kv.shape, kv.dtype, width)
        assert k_cache.dtype == v_cache.dtype == q.dtype, (k_cache.dtype, q.dtype)
        assert k_norm.dtype == q.dtype, (k_norm.dtype, q.dtype)
        assert v_norm is None or v_norm.dtype == q.dtype, (v_norm.dtype, q.dtype)
        if kv.stride(-1) != 1:
            kv = kv.contiguous()
    return _launch(q, kv, 0 if k_eq_v else kh * d, q_norm, k_norm, v_norm, h, kh, d, cos, sin,
                   traditional, k_cache, v_cache, slots, positions, eps, 0.0, 1.0, True)


@functools.cache
def _no_slots(device: torch.device) -> Tensor:
    """A device's one-slot int64 dummy for launches whose kv programs do not run."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def _launch(q_src: Tensor, kv_src: Tensor, v_off: int, qw: Tensor, kw: Tensor,
            vw: Tensor | None, h: int, kh: int, d: int, cos: Tensor, sin: Tensor,
            traditional: bool, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
            positions: Tensor | None, eps: float, offset: float, scale: float,
            has_norm: bool) -> Tensor:
    """`_qkv_rope_write_kernel` over (n tokens, h q heads + kh kv heads): q heads read q_src
    [N, H*D], kv head g reads kv_src's columns [g*D, +D) and its v at v_off further (rows of
    both contiguous); vw: v's norm weight (None: v copied as it is). Returns q [N, H, D]."""
    n, r = q_src.shape[0], cos.shape[-1]
    assert 2 * r <= d, (d, r)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    gather = positions is not None
    sc0 = 0 if cos.shape[0] == 1 and not gather else cos.stride(0)
    out = torch.empty((n, h, d), dtype=q_src.dtype, device=q_src.device)
    if n == 0:
        return out
    qw, kw, slots = qw.contiguous(), kw.contiguous(), slots.contiguous()
    _qkv_rope_write_kernel[(n, h + kh)](
        q_src, kv_src, qw, kw, kw if vw is None else vw.contiguous(), cos, sin, slots,
        positions.contiguous() if gather else slots, out, k_cache, v_cache, q_src.stride(0),
        kv_src.stride(0), v_off, sc0, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), float(eps), float(offset), float(scale), H=h, K=kh, D=d, R=r,
        TRAD=bool(traditional), HAS_NORM=has_norm, HAS_OFFSET=has_norm and bool(offset),
        HAS_SCALE=scale != 1.0, GATHER=gather, V_NORM=vw is not None, BLOCK_R=_p2(r),
        BLOCK_P=_p2(max(1, d - 2 * r)), BLOCK_D=_p2(d), num_warps=_warps(_p2(d)))
    return out


__all__ = ["add_rms_norm", "qkv_rope_write", "split_qkv_norm_rope_write"]
