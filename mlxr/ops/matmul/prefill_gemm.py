"""Tensor-core prefill GEMM of MLX affine 2/4/8-bit weights (Hopper-minded).

y[M, N] = x[M, K] @ W[N, K]^T with W as the file stores it: int32 words [N, K*bits/32] (code j of
a word at bits [j*bits, (j+1)*bits), PER = 32/bits codes per word), scales/biases [N, K/G]
(bf16/fp16/fp32). Every weight is w = s*q + b in fp32, rounded ONCE to x's dtype: q*s is exact in
fp32 (<= 8 + 11 significant bits), so fma or mul+add give the same w, and `qgemm` feeds tl.dot
exactly the bf16 matrix that `prefill_dequant.dequant_affine` writes for cuBLAS; only the
GEMM's summation order differs between the two prefill paths.

`qgemm` (the fused kernel, `_qgemm_kernel`): each program owns one output tile [BLOCK_M,
BLOCK_N] (grouped launch order: GROUP_M row tiles run next to each other so a weight tile is
fetched from HBM once and re-read from L2), K loop over BLOCK_K tiles (BLOCK_K a multiple or a
divisor of the group size, so a tile holds whole groups or lies in one):
  * words: one 2-D [BLOCK_N, BLOCK_K/PER] int32 load per tile (each row a contiguous run: 16-byte
    vector loads, pipelined over num_stages like the x tile; x rows past M are clamped to row
    M-1 instead of masked, their results are never stored);
  * codes: the word tile viewed as [BLOCK_N, NGT groups, WPG words, 1] and broadcast against
    per-code constants [PER] -> [BLOCK_N, NGT, WPG, PER] (no per-element gather or index math);
    each code is masked in place and OR'ed with an fp32 exponent, so the float is exactly
    2^e + q and one subtraction leaves q (no shift for most codes, no int->float conversion);
  * scale and bias loaded once per group ([BLOCK_N, NGT], prefetched one tile ahead) and
    broadcast, one fp32 fma, one rounding, reshape to [BLOCK_N, BLOCK_K];
  * tl.dot with fp32 accumulation, either x @ W^T (acc [BM, BN]) or, with `w_as_a`, W @ x^T
    (acc [BN, BM], stored transposed): the weight is then the register "A" operand of wgmma
    and x the shared-memory "B" one, whose N side may be as small as 8 (small M).
  Optional split-K writes fp32 partials [S, M, N], summed in a fixed order by one small
  kernel (small-M shapes whose output tiles cannot fill the GPU).
`mlxr.ops.matmul.prefill_dequant.dequant_affine` writes the same weights
(`weight_tiles._affine_tile`) to an [N, K] matrix for cuBLAS.

Under TRITON_INTERPRET (CPU tests) the interpreter's bf16 dot is broken and its fp32 -> bf16
cast truncates: the dot runs in fp32 (`input_precision="ieee"`, exact bf16 inputs) and the
weight rounding is done with integer ops (round to nearest even, what the GPU's cvt does).
K is a constexpr (static loop bounds for the interpreter; a model has 2-3 distinct K).
Torch twin: `generic_qmm.qgemm_ref` (bf16-rounded dequantized weight, fp32 matmul).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import Tensor

from .generic_qmm import HAVE_TRITON, _check, _interpret, _sm_count, qgemm_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .weight_tiles import _affine_tile, _round

__all__ = ["QgemmConfig", "default_config", "qgemm", "qgemm_ref"]

BITS = (2, 4, 8)


@dataclass(frozen=True)
class QgemmConfig:
    """Launch shape of `qgemm`: output tile, K tile, launch grouping, warps, pipeline depth,
    operand order (w_as_a: W @ x^T), split-K, and an optional register cap per thread
    (maxnreg: e.g. 128 lets two 8-warp programs share an SM's 64K registers)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    w_as_a: bool = False
    split_k: int = 1
    maxnreg: int | None = None

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}{'_wa' if self.w_as_a else ''}"
                f"{f'_k{self.split_k}' if self.split_k > 1 else ''}"
                f"{f'_r{self.maxnreg}' if self.maxnreg else ''}")


@lru_cache(maxsize=1024)  # per-call host cost matters for prefill (many small launches)
def default_config(m: int, n: int, k: int, bits: int, group: int,
                   sm_count: int = 132) -> QgemmConfig:
    """Launch table: the H200 sweep's winners (benchmarks/gpu/gpu_qgemm_sweep.py, 4-bit g64 bf16,
    docs/perf.md "Prefill GEMM sweep") as rules by M bucket (measured at 64, 128, 512, 2048;
    the cut between two buckets near their geometric mean) and weight size, split-K by
    `fill_split` (which gives the winners' splits). Roles: "big" = the 8B gate_up/down
    (N*K >= 32M), "deep" = K >= 2N (down).
    BLOCK_K is 64 or 128, a multiple or a divisor of every group (32/64/128), so each row is
    valid for 2/4/8 bits; other widths and groups were not swept."""
    big, deep = n * k >= 1 << 25, k >= 2 * n
    if m <= 96:  # at 64: W @ x^T everywhere (x's rows are the MMA's narrow N side)
        bm = 32 if m <= 32 else 64
        if big and deep:  # 8B down: wide tiles, split 8
            cfg = QgemmConfig(bm, 256, 64, num_warps=8, num_stages=3, w_as_a=True)
        elif k >= 4096:  # 8B o, gate_up (8B qkv measured 64x64x128_k2 ahead)
            cfg = QgemmConfig(bm, 128, 64, num_warps=4, num_stages=4, w_as_a=True)
        else:  # 0.6B qkv, down (0.6B gate_up measured 64x128x128 unsplit ahead)
            cfg = QgemmConfig(bm, 64, 128, num_warps=4, num_stages=4, w_as_a=True)
    elif m <= 256:  # at 128
        if big:  # 8B gate_up (4 warps), down (8 warps): x @ W^T
            cfg = QgemmConfig(128, 128, 64, num_warps=8 if deep else 4, num_stages=3)
        elif k >= 2048:  # 8B qkv, o; 0.6B down
            cfg = QgemmConfig(128, 64, 64, num_warps=4, num_stages=4, w_as_a=True)
        else:  # 0.6B qkv, gate_up
            cfg = QgemmConfig(64, 64, 128, num_warps=4, num_stages=4, w_as_a=True)
    elif m >= 512 and (k >= 4096 or -(-m // 256) * -(-n // 128) >= sm_count):
        # 8B at 512 (split 2 where the tiles are few) and 2048; 0.6B qkv/gate_up at 2048
        cfg = QgemmConfig(256, 128, 64, num_warps=8, num_stages=3, w_as_a=True)
    else:  # 0.6B at 512, 0.6B down at 2048 (and all of 256 < M < 512): 4 warps when the
        # tiles outnumber the SMs (0.6B gate_up at 512)
        tiles = -(-m // 128) * -(-n // 128)
        cfg = QgemmConfig(128, 128, 64, num_warps=4 if tiles > sm_count else 8, num_stages=3,
                          w_as_a=True)
    return fill_split(cfg, m, n, k, group, sm_count)


def fill_split(cfg: QgemmConfig, m: int, n: int, k: int, group: int,
               sm_count: int = 132) -> QgemmConfig:
    """`cfg` with split-K doubled while the grid is under one program per SM and every split
    keeps at least 4 K tiles (the pipeline needs a few iterations to pay off)."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    nt = -(-k // cfg.block_k)
    split = 1
    while tiles * split * 2 <= sm_count * 1.5 and nt // (split * 2) >= 4:
        split *= 2
    return replace(cfg, split_k=split)


# ====================================================================== Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _load_groups(s_ptr, b_ptr, sp, g, nmask, valid, NG: tl.constexpr, EVEN: tl.constexpr):
        """scales and biases [BN, NGT] at offsets sp [BN, NGT] (groups g [NGT] of rows nmask
        [BN]); valid: scalar, False -> nothing is read (a prefetch past the split's last tile)."""
        if EVEN:
            s = tl.load(s_ptr + sp, mask=valid, other=0.0)
            b = tl.load(b_ptr + sp, mask=valid, other=0.0)
        else:
            gmask = (nmask[:, None] & (g < NG)[None, :]) & valid
            s = tl.load(s_ptr + sp, mask=gmask, other=0.0)
            b = tl.load(b_ptr + sp, mask=gmask, other=0.0)
        return s, b

    @triton.jit
    def _qgemm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_ym, stride_ys,
        K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, W_AS_A: tl.constexpr, SPLIT_K: tl.constexpr,
        EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        # grouped order: GROUP_M row tiles x every column tile, row tile fastest, so programs
        # running together share each weight tile (re-read from L2) and the x row tiles
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        gm = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gm
        pid_n = (pid % width) // gm

        PER: tl.constexpr = 32 // BITS
        KW: tl.constexpr = K // PER  # words per weight row
        NG: tl.constexpr = K // GROUP  # groups per weight row
        BW: tl.constexpr = BLOCK_K // PER  # words per tile row
        NGT: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP  # groups per tile (1: inside one)
        NT: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        TPS: tl.constexpr = (NT + SPLIT_K - 1) // SPLIT_K  # K tiles per split
        DT: tl.constexpr = x_ptr.dtype.element_ty

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        rk = tl.arange(0, BLOCK_K)
        rw = tl.arange(0, BW)
        rg = tl.arange(0, NGT)
        # rows past M read row M-1 (results never stored): no masks on the x loads
        x_row = x_ptr + tl.minimum(rm, M - 1)[:, None] * stride_xm  # [BM, 1]
        w_row = w_ptr + rn[:, None].to(tl.int64) * KW  # [BN, 1]

        if W_AS_A:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # scales/biases are 2-byte loads the pipeliner does not make asynchronous: the next tile's
        # are prefetched into registers while this tile is computed. sp: int32 offsets of the
        # current tile's groups, advanced by NGT per tile (or by one every GROUP/BLOCK_K tiles)
        g = (pid_k * TPS * BLOCK_K) // GROUP + rg  # [NGT]
        sp = rn[:, None] * NG + g[None, :]  # [BN, NGT]
        s, b = _load_groups(s_ptr, b_ptr, sp, g, nmask, pid_k * TPS < NT, NG,
                            EVEN_N and EVEN_K)
        for t in range(TPS):
            k0 = (pid_k * TPS + t) * BLOCK_K
            if BLOCK_K >= GROUP:
                step = NGT
            else:
                step = ((k0 + BLOCK_K) % GROUP == 0).to(tl.int32)
            g += step
            sp += step
            s_next, b_next = _load_groups(s_ptr, b_ptr, sp, g, nmask, t + 1 < TPS, NG,
                                          EVEN_N and EVEN_K)
            xp = x_row + (k0 + rk)[None, :]  # [BM, BK]
            wp = w_row + (k0 // PER + rw)[None, :]  # [BN, BW]
            if EVEN_K:
                xt = tl.load(xp)
                if EVEN_N:
                    wd = tl.load(wp)
                else:
                    wd = tl.load(wp, mask=nmask[:, None], other=0)
            else:  # ragged K (whole groups) or a split past the end: masked words and x
                xt = tl.load(xp, mask=(k0 + rk < K)[None, :], other=0.0)
                wd = tl.load(wp, mask=nmask[:, None] & (k0 // PER + rw < KW)[None, :], other=0)
            wt = _affine_tile(wd, s, b, DT, BITS, BLOCK_N, BLOCK_K, NGT, INTERPRET, N)  # [BN, BK]
            if INTERPRET:  # exact bf16 values, fp32 products (the interpreter's bf16 dot)
                if W_AS_A:
                    acc = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), acc,
                                 input_precision="ieee")
                else:
                    acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc,
                                 input_precision="ieee")
            elif W_AS_A:
                acc = tl.dot(wt, tl.trans(xt), acc)  # [BN, BM]
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)  # [BM, BN]
            s, b = s_next, b_next
        if W_AS_A:
            acc = tl.trans(acc)
        yp = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]  # [BM, BN]
        out = _round(acc, y_ptr.dtype.element_ty, INTERPRET)
        tl.store(yp, out, mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _sum_splits_kernel(p_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                           INTERPRET: tl.constexpr):
        """y[i] = sum_s p[s, i] in a fixed order, rounded once to y's dtype; p fp32 [S, MN]."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        acc = tl.load(p_ptr + i, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
        tl.store(y_ptr + i, _round(acc, y_ptr.dtype.element_ty, INTERPRET), mask=mask)


# ====================================================================== launchers
def _validate(x: Tensor | None, w: Tensor, s: Tensor, b: Tensor, bits: int, group: int,
              widths: tuple[int, ...] = BITS) -> int:
    if bits not in widths or group not in (32, 64, 128):
        raise ValueError(f"prefill_gemm: affine {bits}-bit g{group} is not supported "
                         f"(bits {widths}, groups 32/64/128)")
    if b is None or b.shape != s.shape or s.shape[0] != w.shape[0]:
        raise ValueError("prefill_gemm: affine weights need scales and biases [N, K/G]")
    if x is not None:
        return _check(x, w, s, "affine", bits, group)[1]
    k = s.shape[1] * group
    if w.dim() != 2 or w.shape[1] * 32 != k * bits or k % 32:
        raise ValueError(f"shape mismatch: w {tuple(w.shape)}, scales {tuple(s.shape)}, "
                         f"{bits}b g{group}")
    return k


def qgemm(x: Tensor, w: Tensor, s: Tensor, b: Tensor, *, bits: int, group: int,
          out_dtype: torch.dtype | None = None, config: QgemmConfig | None = None,
          warmup: bool = False) -> Tensor | None:
    """y [M, N] = x [M, K] (bf16/fp16) @ W^T for affine words w int32 [N, K*bits/32] and
    scales/biases [N, K/G]; output in out_dtype (default x.dtype). config: launch override
    (default: `default_config`). warmup: compile only (returns None)."""
    k = _validate(x, w, s, b, bits, group)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"prefill_gemm.qgemm takes bf16/fp16 activations, not {x.dtype}")
    m, n = x.shape[0], w.shape[0]
    if m == 0:
        return torch.empty(0, n, device=x.device, dtype=out_dtype or x.dtype)
    x = x.contiguous()
    w = w.view(torch.int32) if w.dtype == torch.uint32 else w
    cfg = config or default_config(m, n, k, bits, group, _sm_count(x.device))
    bk = cfg.block_k
    if bk < 32 or bk & (bk - 1):
        raise ValueError(f"block_k must be a power of two >= 32, not {bk}")
    split = cfg.split_k
    nt = -(-k // bk)
    tps = -(-nt // split)
    odt = out_dtype or x.dtype
    if split == 1:
        y, ys = torch.empty(m, n, device=x.device, dtype=odt), 0
    else:
        y, ys = torch.empty(split, m, n, device=x.device, dtype=torch.float32), m * n
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    args = (x, w, s, b, y, m, n, x.stride(0), n, ys)
    kw = {"K": k, "BITS": bits, "GROUP": group, "BLOCK_M": cfg.block_m,
          "BLOCK_N": cfg.block_n, "BLOCK_K": bk, "GROUP_M": cfg.group_m, "W_AS_A": cfg.w_as_a,
          "SPLIT_K": split, "EVEN_N": n % cfg.block_n == 0,
          "EVEN_K": k % bk == 0 and tps * split == nt, "INTERPRET": _interpret(),
          "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg and not _interpret():
        kw["maxnreg"] = cfg.maxnreg
    if warmup:
        _qgemm_kernel.warmup(*args, grid=grid, **kw)
        return None
    _qgemm_kernel[grid](*args, **kw)
    if split == 1:
        return y
    out = torch.empty(m, n, device=x.device, dtype=odt)  # one launch: sum + rounding
    _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](y, out, m * n, SPLIT_K=split, BLOCK=1024,
                                                     INTERPRET=_interpret(), num_warps=4)
    return out
