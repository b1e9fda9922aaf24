"""Batch-1 decode GEMV for MLX affine 4-bit weights: y[N] = x[K] @ dequant(W)[N, K]^T.

Why another GEMV: single-request decode reads every weight once, so this kernel is the decode
speed. The earlier Triton GEMVs (`decode_gemv`, a fused-prologue GEMV) reach 0.5-1.2 TB/s on
the H200; their compiled code (benchmarks/gpu/sass_report.py) shows why: Triton gives the x loads
and the scale loads other register layouts than the weight tile, so every tile goes through
shared memory (decode_gemv at an 8B shape: 22 barriers, ~10 instructions per code). This
kernel is written so that x and the scales get the weight tile's own layout (16-byte weight
loads, one small shared-memory exchange per tile, 3.3-3.8 instructions per code with fixed
costs):

* **Load-time repack** (`repack`, once per weight; same bytes): within each run of 32 codes,
  word e (0..3) holds codes k = 32c + 4j + e at nibble j. A thread owns 4 consecutive words
  (one 16-byte load); with the repack, the x of its nibble j is 4 consecutive values (one 8-byte
  load) whose natural layout is the word tile's own column layout.
* **One logic op per code**: a 4-bit field at bits [P, P+4) with P + 4 <= 23 is masked in place
  and OR'ed with the fp32 exponent of 2^(23-P); the float is exactly 2^E + q. Every field is
  taken at P = 12 or 16 (E = 11 or 7) of the word or of the word shifted by 4 or 12 (four
  shifts per 8 codes). The 2^E terms are not subtracted per code: the word's sum is
  sum_j (2^E_j + q_j) x_j - sum_j 2^E_j x_j, whose second term depends only on the column, so
  it is computed once per column for all rows; the fp32 running sum carries offsets of up to
  2^11 |x|, i.e. ~2^-13 |x| of rounding per word (tests bound it against fp64). Rejected:
  fields at P = 8 too (E = 15, two shifts fewer): up to 15% faster on the smallest 8B matrix
  but 16x the rounding, 98.5% instead of 99.9% of bf16 outputs equal to the fp32 twin's.
* Scale and bias once per 32-code chunk: s * dot(q, x) + b * sum(x).
* (scale, bias) pairs repacked into one 32-bit word (`pair_scales`); weights loaded `.cg`.
* A program owns BLOCK_N whole rows and walks K in tiles of WT words (4 per thread: WT = 128 x
  num_warps), the next tile's words loaded before the current tile's arithmetic; no split-K,
  so one launch and a fixed summation order. Rejected on the H200 (docs/perf.md): a
  grid-stride form (programs walk row blocks with the next step in flight; slower at every 8B
  shape but one, +0.8% there) and a gated-act epilogue over [gate | up] (no gain on the 8B,
  -2% on the 0.6B).
* Prologues (the op before the projection, one launch fewer each; `mlxr.models.fused_decode`):
  `norm`: x = rms_norm(h + r) (program 0 writes h + r to `h_out`, the new residual stream),
  `act`: x = act(gate) * up from an MLP's [gate | up] output. Each program recomputes its x
  tiles in the weight tile's layout (and the norm's statistic over the whole row: K values);
  x is rounded where the unfused ops round (`reference.add_rms_norm`, `gated_act`), except
  that the norm's sum of squares is reduced in another order.
* Programmatic dependent launch (`norm_rope_act.pdl`, opt-in MLXR_PDL=1): the kernel is
  launched before the previous grid ends, issues its first tile's weight loads (the weights
  are never written), then waits for that grid before reading x or the scales.

`q4gemv_ref` is the plain-torch twin with the same signature (the tests' oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import reference
from ..layer.norm_rope_act import ACTS, HAVE_TRITON, _interpret, pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..layer.norm_rope_act import _gated

GROUPS = (32, 64, 128)
WORDS_PER_THREAD = 4  # one 16-byte load


@dataclass(frozen=True)
class Q4Config:
    """Launch shape: BLOCK_N rows per program, WT words of a row per tile (num_warps =
    WT / 128, so that each thread owns 4 words of every row of the tile)."""
    block_n: int = 16
    wt: int = 512
    cg: bool = False

    @property
    def num_warps(self) -> int:
        return self.wt // (32 * WORDS_PER_THREAD)

    def label(self) -> str:
        return f"bn{self.block_n}_wt{self.wt}_cg{int(self.cg)}"


def supported(group: int, k: int, dtype: torch.dtype) -> bool:
    """Formats and shapes the kernel takes: affine 4-bit, group 32/64/128, K a multiple of
    1024 (one 128-word tile), bf16/fp16 activations."""
    return group in GROUPS and k % 1024 == 0 and dtype in (torch.bfloat16, torch.float16)


def default_config(n: int, k: int, sm_count: int = 132) -> Q4Config:
    """The H200 sweeps' winners (benchmarks/gpu/gpu_q4gemv_sweep.py, docs/perf.md): the largest
    tile (<= 512 words) that divides a row, 128 for LM heads (N >= 65536); .cg weight loads;
    8 rows per program, 4 for small matrices (<= 8M weights) or fewer than two programs per
    SM, 16 for very tall, short matrices (a 0.6B-style LM head)."""
    kw = k // 8
    wt = 128 if n >= 65536 else next(t for t in (512, 256, 128) if kw % t == 0)
    block_n = 16 if n >= 65536 and k <= 2048 else 8
    if n * k <= 8 << 20 or -(-n // block_n) < 2 * sm_count:
        block_n = 4
    if _interpret():  # the interpreter runs programs one by one: few, large ones keep CI fast
        block_n = max(block_n, 64)
    return Q4Config(block_n=block_n, wt=wt, cg=True)


# ====================================================================== repack (load time)
def repack(packed: Tensor, chunk_bytes: int = 64 << 20) -> Tensor:
    """MLX 4-bit words [N, K/8] (code k at nibble k % 8 of word k // 8) -> the same codes with
    code 32c + 4j + e at nibble j of word 4c + e. int32 [N, K/8], on packed's device. Rows go
    through in slices whose unpacked codes take ~chunk_bytes (8 int32 per word), so loading
    an LM head does not need 8x its size of scratch."""
    n, kw = packed.shape
    if kw % 4:
        raise ValueError(f"q4gemv.repack: K/8 = {kw} words per row is not a multiple of 4")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    w = packed.view(torch.int32)
    out = torch.empty(n, kw, dtype=torch.int32, device=packed.device)
    step = max(1, chunk_bytes // (kw * 8 * 4))
    for r in range(0, n, step):
        q = (w[r:r + step].unsqueeze(-1) >> shifts) & 15  # [rows, K/8, 8]: code 8*word + nibble
        q = q.reshape(-1, kw // 4, 8, 4).transpose(2, 3)  # [rows, chunk, e, j] from [., j, e]
        out[r:r + step] = (q << shifts).sum(-1, dtype=torch.int32).reshape(-1, kw)
    return out


def unrepack(words: Tensor) -> Tensor:
    """Inverse of `repack`: back to MLX order (tests, reference)."""
    n, kw = words.shape
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    q = (words.unsqueeze(-1) >> shifts) & 15  # [N, chunk*4 + e, j]
    q = q.reshape(n, kw // 4, 4, 8).transpose(2, 3)  # [N, chunk, j, e] = code 32c + 4j + e
    q = q.reshape(n, kw, 8)  # k order, split into MLX words: code k at nibble k % 8 of word k // 8
    return (q << shifts).sum(-1, dtype=torch.int32).reshape(n, kw).contiguous()


def pair_scales(scales: Tensor, biases: Tensor) -> Tensor:
    """(scale, bias) pairs [N, NG, 2] in the scales' 16-bit dtype: one 32-bit load per pair."""
    if scales.dtype not in (torch.bfloat16, torch.float16) or biases.dtype != scales.dtype:
        raise ValueError(f"q4gemv: 16-bit scales and biases, got {scales.dtype}/{biases.dtype}")
    return torch.stack([scales, biases], -1).contiguous()


# ====================================================================== torch twin (oracle)
def q4gemv_ref(x: Tensor, words: Tensor, scales: Tensor, biases: Tensor, *, group: int,
               out: Tensor | None = None, config: Q4Config | None = None,
               sb: Tensor | None = None, r: Tensor | None = None, norm: Tensor | None = None,
               eps: float = 0.0, offset: float = 0.0, h_out: Tensor | None = None,
               act: str | None = None) -> Tensor:
    """y [N] = f(x) @ (scales * q + biases)^T in fp32, rounded to x.dtype; `words` are
    `repack`'s output (`sb` and `config` change nothing here). f: with `norm` [K] (an RMSNorm
    weight), rms_norm(x + r) (r [K] or None; h_out [K] receives x + r); with `act`,
    act(x[:K]) * x[K:] for x = an MLP's [gate | up] output [2K]; else x. `out` is written and
    returned when given."""
    from .generic_qmm import dequant_f32

    k = words.shape[1] * 8
    xv = x.reshape(-1)
    if act is not None:
        xv = reference.gated_act(xv[:k], xv[k:], act)
    elif norm is not None:
        s = xv if r is None else (xv + r).to(xv.dtype)
        if h_out is not None:
            h_out.copy_(s)
        xv = reference.rms_norm(s, norm, eps, offset)
    w = dequant_f32(unrepack(words), scales, biases, None, "affine", 4, group)
    y = (xv.float() @ w.t()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


# ====================================================================== Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _f(src, P: tl.constexpr, expo):
        """2^E + q for the 4-bit field at bits [P, P+4) of src (expo: the exponent bits of
        2^(23-P), a run-time value so that mask-and-or is one LOP3)."""
        return ((src & (15 << P)) | expo).to(tl.float32, bitcast=True)

    @triton.jit
    def _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, k, rstd, offset, write_h, K: tl.constexpr,
              PRO: tl.constexpr, HAS_R: tl.constexpr, HAS_OFFSET: tl.constexpr,
              ACT: tl.constexpr):
        """The prologue's x at indices k (any shape), fp32 holding x.dtype values."""
        dt = x_ptr.dtype.element_ty
        v = tl.load(x_ptr + k).to(tl.float32)
        if PRO == 1:  # rms_norm(h + r): the rounding points of reference.add_rms_norm
            if HAS_R:
                v = (v + tl.load(r_ptr + k).to(tl.float32)).to(dt).to(tl.float32)
                tl.store(h_ptr + k, v.to(dt), mask=write_h)
            nw = tl.load(nw_ptr + k)
            if HAS_OFFSET:  # gemma's (1 + w), formed in the weight's dtype
                nw = (nw.to(tl.float32) + offset).to(nw_ptr.dtype.element_ty)
            v = ((v * rstd).to(dt).to(tl.float32) * nw.to(tl.float32)).to(dt).to(tl.float32)
        elif PRO == 2:  # act(gate) * up over [gate | up]: reference.gated_act's roundings
            u = tl.load(x_ptr + K + k).to(tl.float32)
            v = _gated(v, u, ACT, dt).to(dt).to(tl.float32)
        return v

    @triton.jit
    def _tile(w, x_ptr, r_ptr, nw_ptr, h_ptr, k0, rstd, offset, write_h, s_ptr, b_ptr, so,
              wm, e11, e7, K: tl.constexpr, PRO: tl.constexpr, HAS_R: tl.constexpr,
              HAS_OFFSET: tl.constexpr, ACT: tl.constexpr, SB: tl.constexpr,
              MASKED: tl.constexpr, BLOCK_N: tl.constexpr, WT: tl.constexpr):
        """One tile's contribution [BLOCK_N, WT/4] (per 32-code chunk: s * dot(q, x) + b *
        sum(x)). w [BLOCK_N, WT] words of codes k0 ..; so [BLOCK_N, WT/4] the chunks' scale
        offsets, wm the row mask."""
        if SB:  # (scale, bias) pairs [N, NG, 2] read as one 32-bit word
            sdt = s_ptr.dtype.element_ty
            sbp = s_ptr.to(tl.pointer_type(tl.int32)) + so
            if MASKED:
                sb = tl.load(sbp, mask=wm, other=0)
            else:
                sb = tl.load(sbp)
            s = (sb & 0xFFFF).to(tl.int16).to(sdt, bitcast=True).to(tl.float32)
            b = (sb >> 16).to(tl.int16).to(sdt, bitcast=True).to(tl.float32)
        elif MASKED:
            s = tl.load(s_ptr + so, mask=wm, other=0).to(tl.float32)
            b = tl.load(b_ptr + so, mask=wm, other=0).to(tl.float32)
        else:
            s = tl.load(s_ptr + so).to(tl.float32)
            b = tl.load(b_ptr + so).to(tl.float32)
        cw = tl.arange(0, WT)
        kx = k0 + (cw // 4) * 32 + cw % 4  # + 4j: the x of nibble j of each word
        x0 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x1 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 4, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x2 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 8, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x3 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 12, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x4 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 16, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x5 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 20, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x6 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 24, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        x7 = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, kx + 28, rstd, offset, write_h, K, PRO, HAS_R,
                   HAS_OFFSET, ACT)
        # fields at P = 12 or 16 (E = 11, 7) of w, w << 4, w << 12, w >> 4, w >> 12;
        # per column: -sum_j 2^E_j x_j (E per nibble: 11 7 11 11 7 7 11 7)
        cneg = -(2048.0 * ((x0 + x2) + (x3 + x6)) + 128.0 * ((x1 + x4) + (x5 + x7)))
        dq = _f(w << 12, 12, e11) * x0[None, :] + cneg[None, :]
        dq += _f(w << 4, 12, e11) * x2[None, :]
        dq += _f(w, 12, e11) * x3[None, :]
        dq += _f(w >> 12, 12, e11) * x6[None, :]
        dq += _f(w << 12, 16, e7) * x1[None, :]
        dq += _f(w, 16, e7) * x4[None, :]
        dq += _f(w >> 4, 16, e7) * x5[None, :]
        dq += _f(w >> 12, 16, e7) * x7[None, :]
        xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        xs = tl.sum(tl.reshape(xs, [WT // 4, 4]), axis=1)  # per chunk
        dqc = tl.sum(tl.reshape(dq, [BLOCK_N, WT // 4, 4]), axis=2)  # per chunk
        return s * dqc + b * xs[None, :]

    @triton.jit
    def _q4gemv_kernel(x_ptr, r_ptr, nw_ptr, h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, eps,
                       offset, zero, K: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, WT: tl.constexpr, EVEN_N: tl.constexpr,
                       SB: tl.constexpr, CG: tl.constexpr, GDC: tl.constexpr,
                       PRO: tl.constexpr, HAS_R: tl.constexpr, HAS_OFFSET: tl.constexpr,
                       ACT: tl.constexpr):
        """y[pid * BLOCK_N + i] for i < BLOCK_N. PRO: 0 x as given, 1 rms_norm(x + r), 2
        act(gate) * up (see `_x_at`); program 0 also stores the residual x + r."""
        pid = tl.program_id(0)
        write_h = pid == 0
        KW: tl.constexpr = K // 8  # words per row
        NG: tl.constexpr = K // GROUP
        CPG: tl.constexpr = GROUP // 32  # 32-code chunks per group
        NT: tl.constexpr = KW // WT
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cw = tl.arange(0, WT)  # word of the tile (chunk cw // 4, word e = cw % 4 in it)
        ch = tl.arange(0, WT // 4)  # chunk of the tile
        wp = w_ptr + rn[:, None] * KW + cw[None, :]  # [BLOCK_N, WT], int32 offsets (launcher)
        sp = rn[:, None] * NG + (ch // CPG)[None, :]  # [BLOCK_N, WT/4]
        wm = (rn < N)[:, None]
        e11 = ((127 + 11) << 23) + zero
        e7 = ((127 + 7) << 23) + zero
        WCM: tl.constexpr = ".cg" if CG else ""  # weights: read once, L2 only
        if EVEN_N:
            w = tl.load(wp, cache_modifier=WCM)
        else:
            w = tl.load(wp, mask=wm, other=0, cache_modifier=WCM)
        if GDC:  # launched early (PDL): the weights above stream in while the previous grid
            # finishes; x, scales and the output are touched only after it completed
            tl.extra.cuda.gdc_wait()
        rstd = 0.0
        if PRO == 1:  # the norm's statistic over the whole row of h + r, in tiles of 8 * WT
            sq = tl.zeros([8 * WT], dtype=tl.float32)
            for e0 in tl.static_range(0, K, 8 * WT):
                e = e0 + tl.arange(0, 8 * WT)
                hv = tl.load(x_ptr + e).to(tl.float32)
                if HAS_R:
                    hv = (hv + tl.load(r_ptr + e).to(tl.float32))
                    hv = hv.to(x_ptr.dtype.element_ty).to(tl.float32)
                sq += hv * hv
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N, WT // 4], dtype=tl.float32)
        for t in range(NT):  # a run-time loop: unrolled tiles would not fit in registers
            # the next tile's words go out before this tile's arithmetic (none past the row)
            wn = tl.load(wp + (t + 1) * WT, mask=wm & (t + 1 < NT), other=0, cache_modifier=WCM)
            acc += _tile(w, x_ptr, r_ptr, nw_ptr, h_ptr, t * WT * 8, rstd, offset, write_h,
                         s_ptr, b_ptr, sp + t * (WT // 4 // CPG), wm, e11, e7, K, PRO, HAS_R,
                         HAS_OFFSET, ACT, SB, not EVEN_N, BLOCK_N, WT)
            w = wn
        y = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty)
        if EVEN_N:
            tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)

def q4gemv(x: Tensor, words: Tensor, scales: Tensor, biases: Tensor, *, group: int,
           out: Tensor | None = None, config: Q4Config | None = None,
           sb: Tensor | None = None, r: Tensor | None = None, norm: Tensor | None = None,
           eps: float = 0.0, offset: float = 0.0, h_out: Tensor | None = None,
           act: str | None = None) -> Tensor:
    """See `q4gemv_ref` (same signature and results up to fp32 summation order). x [K] (or
    [1, K]; [2K] with `act`) contiguous; words = `repack(packed)`; sb = `pair_scales(scales,
    biases)` or None (then the kernel reads scales and biases apart); returns [N] (or writes
    `out`, any float dtype: the sums are rounded to x.dtype first). With `norm` and `r`,
    `h_out` [K] must be given and must not alias x or r."""
    xv = x.reshape(-1)
    n, kw = words.shape
    k = kw * 8
    if xv.shape[0] != (2 * k if act is not None else k) or not supported(group, k, x.dtype):
        raise ValueError(f"q4gemv: x {tuple(x.shape)}, words {tuple(words.shape)}, group "
                         f"{group}, {x.dtype} (K={k})")
    if scales.shape != (n, k // group) or biases.shape != scales.shape:
        raise ValueError(f"q4gemv: scales/biases {tuple(scales.shape)} != {(n, k // group)}")
    if sb is not None and (sb.shape != (n, k // group, 2) or not sb.is_contiguous()):
        raise ValueError(f"q4gemv: sb {tuple(sb.shape)} != {(n, k // group, 2)}")
    if n * kw >= 2**31:
        raise ValueError("q4gemv: the weight has >= 2^31 words (int32 offsets)")
    if act is not None and (act not in ACTS or norm is not None):
        raise ValueError(f"q4gemv: act {act!r}: a known activation, and one prologue at a time")
    has_r = norm is not None and r is not None
    if norm is not None and (norm.shape != (k,) or (has_r and (
            r.shape != (k,) or h_out is None or h_out.shape != (k,)
            or h_out.data_ptr() in (xv.data_ptr(), r.data_ptr())))):
        raise ValueError("q4gemv: norm [K], r [K] and a separate h_out [K] for the residual")
    cfg = config or default_config(n, k)
    if kw % cfg.wt:
        raise ValueError(f"q4gemv: tile {cfg.wt} words must divide K/8 = {kw}")
    y = out if out is not None else torch.empty(n, dtype=x.dtype, device=x.device)
    gdc = pdl(x.device)
    pro = 2 if act is not None else (1 if norm is not None else 0)
    _q4gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        xv, r if has_r else xv, norm if pro == 1 else xv, h_out if has_r else xv, words,
        scales if sb is None else sb, biases, y, n, float(eps), float(offset), 0, K=k,
        GROUP=group, BLOCK_N=cfg.block_n, WT=cfg.wt, EVEN_N=n % cfg.block_n == 0,
        SB=sb is not None, CG=cfg.cg, GDC=gdc, PRO=pro, HAS_R=has_r,
        HAS_OFFSET=pro == 1 and bool(offset), ACT=ACTS[act] if act else 0,
        num_warps=cfg.num_warps, num_stages=1, **({"launch_pdl": True} if gdc else {}))
    return y
