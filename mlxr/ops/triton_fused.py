"""Triton twins of the small per-layer ops (`mlxr.ops.reference`): one launch each.

Same signatures and numerics as the reference (the spec): float32 math, results rounded to the
dtype the reference produces, at the same points:

* `rms_norm`: y = (x32 * rsqrt(mean(x32^2) + eps)) rounded to x.dtype, times (weight + offset)
  formed (and rounded) in the weight dtype; the product is rounded to promote(x, weight). Rows
  are [BLOCK_M, BLOCK_E] tiles (a whole row per tile, E <= 16384 in one tile; several short
  rows, e.g. per-head q/k norms, per program). x may be a strided [N, E] or [N, H, D] view
  (last dim contiguous), e.g. q/k straight out of the fused qkv split.
* `rope`: one program per (token, block of heads); rotate-half or interleaved pairs in fp32,
  the unrotated tail copied.
* `gated_act`: act(gate) in fp32 rounded to gate.dtype (as F.silu / F.gelu return it), then
  the product with up in fp32 rounded once more, exactly the two roundings torch makes. gelu_tanh
  uses 0.5x(1 + tanh(z)) = x * sigmoid(2z) (an identity, no tanh intrinsic needed).
* `attention_masked`: flash decoding. Grid (kv head, split of S, block of query rows): a program
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

import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - torch-only installs
    HAVE_TRITON = False

ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
LOG2E = 1.4426950408889634
# attention_masked launch policy (the lead may tune these on the GPU)
ATTN_TARGET_PROGRAMS = 256  # aim for about this many (kv head x split) programs, and
ATTN_LONG_S = 4096  # twice that from this many keys (`attn_splits`)
ATTN_MAX_BLOCK_M = 64  # query rows (rep * T) per program; more rows -> another grid dim


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for the single-request decode chain, opt-in (env
    MLXR_PDL=1, read at every call, i.e. when a CUDA graph is captured): the norm, gated-act
    and attention-combine kernels let the next grid launch early
    (`griddepcontrol.launch_dependents`), and `triton_q4gemv` / `triton_q4tc` launch with
    PDL, stream their first weight tile, then wait for that grid (`griddepcontrol.wait`: all
    its writes visible) before touching anything else. Hopper and later, never in the
    interpreter. H200 (docs/perf.md): greedy tokens and logits bit-identical, but decode
    with q4gemv +1.4% (Qwen3-0.6B) / -1% (Llama-8B), with q4tc a tie / -2.2%, so off by
    default."""
    return (device.type == "cuda" and not _interpret() and os.environ.get("MLXR_PDL", "") == "1"
            and _hopper(device.index if device.index is not None else torch.cuda.current_device()))


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _warps(elems: int) -> int:
    return (1 if elems <= 256 else 2 if elems <= 512 else 4 if elems <= 2048
            else 8 if elems <= 8192 else 16)


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, n_rows, n1, s0, s1, eps, offset,
                         E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         HAS_OFFSET: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_E)
        cmask = cols < E
        m = (rows < n_rows)[:, None] & cmask[None, :]
        base = (rows // n1).to(tl.int64) * s0 + (rows % n1).to(tl.int64) * s1
        x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)  # before the reduction's barriers
        r = tl.rsqrt(tl.sum(x * x, axis=1) / E + eps)
        y = (x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_OFFSET:
            w = (w.to(tl.float32) + offset).to(w_ptr.dtype.element_ty)
        out = (y * w.to(tl.float32)[None, :]).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], out, mask=m)

    @triton.jit
    def _rope_kernel(x_ptr, c_ptr, s_ptr, o_ptr, H, sx0, sx1, sc0,
                     R: tl.constexpr, D: tl.constexpr, TRAD: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK_R)
        hm = h < H
        im = i < R
        m = hm[:, None] & im[None, :]
        xrow = x_ptr + t * sx0 + h.to(tl.int64)[:, None] * sx1
        orow = o_ptr + (t * H + h.to(tl.int64)[:, None]) * D
        if TRAD:
            lo = 2 * i
            hi = 2 * i + 1
        else:
            lo = i
            hi = i + R
        x1 = tl.load(xrow + lo[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + hi[None, :], mask=m, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * sc0 + i, mask=im, other=0.0)[None, :]
        s = tl.load(s_ptr + t * sc0 + i, mask=im, other=0.0)[None, :]
        tl.store(orow + lo[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
        tl.store(orow + hi[None, :], (x1 * s + x2 * c).to(o_ptr.dtype.element_ty), mask=m)
        if BLOCK_P > 0:  # unrotated tail (partial rotary)
            j = 2 * R + tl.arange(0, BLOCK_P)
            pm = hm[:, None] & (j < D)[None, :]
            tl.store(orow + j[None, :], tl.load(xrow + j[None, :], mask=pm), mask=pm)

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        """act(g) in fp32 for g fp32 (ACTS: silu, gelu with exact erf, gelu_tanh)."""
        if ACT == 0:  # silu: x / (1 + exp(-x))
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # gelu, exact erf
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        else:  # gelu_tanh: 0.5 x (1 + tanh(z)) == x / (1 + exp(-2z))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = g / (1.0 + tl.exp(-2.0 * z))
        return a

    @triton.jit
    def _gated(g, u, ACT: tl.constexpr, DT: tl.constexpr):
        """act(g) rounded to DT, times u, in fp32 (not rounded): `ops.gated_act`'s arithmetic
        for g, u fp32 holding DT values. Shared by `_gated_act_kernel`, q4gemv's act prologue
        and q4tc's act epilogue, so the three round alike."""
        return _act(g, ACT).to(DT).to(tl.float32) * u

    @triton.jit
    def _gated_act_kernel(g_ptr, u_ptr, o_ptr, sg, su, F, ACT: tl.constexpr,
                          BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:  # the next grid (a PDL-launched GEMV) may start streaming its weights
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < F
        g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
        y = _gated(g, u, ACT, g_ptr.dtype.element_ty)
        tl.store(o_ptr + row * F + c, y.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _scores(q, k, qk_scale, inv_cap, cap2, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
        """q [M, D] . k [S, D]^T in log2 units (scale, or softcap, applied): fp32 [M, S].
        Shared by every attention kernel (here and mlxr.ops.triton_paged)."""
        if DOT_F32:  # fp32 inputs, or the interpreter (its bf16 dot is broken)
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        if SOFTCAP:  # cap * tanh(s / cap), tanh(z) = 1 - 2 / (exp(2z) + 1); log2 units
            sc = cap2 - 2.0 * cap2 / (tl.exp2(sc * inv_cap) + 1.0)  # inv_cap = 2 log2(e) s/cap
        else:
            sc = sc * qk_scale  # scale * log2(e)
        return sc

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


# ============================================================================ host wrappers
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    e = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    if x.dim() == 3:
        n1, s0, s1 = x.shape[1], x.stride(0), x.stride(1)
    elif x.dim() == 2:
        n1, s0, s1 = 1, x.stride(0), 0
    else:
        n1, s0, s1 = 1, e, 0
    n_rows = x.numel() // e if e else 0
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    if n_rows == 0:
        return out
    block_e = _p2(e)
    block_m = max(1, min(_p2(n_rows), 4096 // block_e))
    _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        x, w, out, n_rows, n1, s0, s1, float(eps), float(offset), E=e, BLOCK_M=block_m,
        BLOCK_E=block_e, HAS_OFFSET=bool(offset), num_warps=_warps(block_m * block_e))
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor, traditional: bool) -> Tensor:
    t, h, d = x.shape
    r = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    sc0 = 0 if cos.shape[0] == 1 else cos.stride(0)
    block_r = _p2(r)
    block_h = max(1, min(_p2(h), 2048 // (2 * block_r)))
    p = d - 2 * r
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, cos, sin, out, h, x.stride(0), x.stride(1), sc0, R=r, D=d, TRAD=bool(traditional),
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=_p2(p) if p > 0 else 0,
        num_warps=_warps(block_h * block_r * 2))
    return out


def gated_act(gate: Tensor, up: Tensor, act: str) -> Tensor:
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r}")
    shape, f = gate.shape, gate.shape[-1]
    if gate.dim() != 2 or gate.stride(-1) != 1:
        gate = gate.reshape(-1, f).contiguous()
    if up.dim() != 2 or up.stride(-1) != 1:
        up = up.reshape(-1, f).contiguous()
    n = gate.shape[0]
    out = torch.empty((n, f), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if out.numel():
        block = min(1024, _p2(f))
        _gated_act_kernel[(n, triton.cdiv(f, block))](
            gate, up, out, gate.stride(0), up.stride(0), f, ACT=ACTS[act], BLOCK=block,
            TRIGGER=pdl(out.device), num_warps=_warps(block))
    return out.reshape(shape)


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
                           splits: int | None = None) -> Tensor:
    """attention_masked with the launch policy exposed (tests force split / single pass)."""
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
    _attn_split_kernel[(kh, nsplit, mblocks)](
        q, k, v, vis, out, pacc, pml, s, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), svis, qk_scale, inv_cap, cap2, T=t, REP=rep, H=h, D=d,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=block_s, TILES=per, NSPLIT=nsplit,
        SOFTCAP=softcap is not None, SINGLE=single, DOT_F32=dot_f32, num_warps=4)
    if not single:
        _attn_combine_kernel[(kh * rt,)](
            pacc, pml, out, T=t, REP=rep, H=h, D=d, NSPLIT=nsplit, BLOCK_N=_p2(nsplit),
            BLOCK_D=block_d, TRIGGER=pdl(out.device), num_warps=_warps(_p2(nsplit) * block_d))
    return out


__all__ = ["HAVE_TRITON", "attention_masked", "attention_masked_split", "gated_act", "rms_norm",
           "rope"]
