"""Triton quantized matmul over MLX packed weights: y[M, N] = x[M, K] @ W[N, K]^T.

W stays exactly as the file stores it (docs/mlx-formats.md §3-4): int32 words [N, K*bits/32]
(a little-endian bit stream per row), scales [N, K/G] (affine: float, fp modes: uint8 E8M0/E4M3),
biases [N, K/G] (affine only), optional nvfp4 fp32 global_scale. No repack, no dequantized copy.

Two kernels (both fp32 accumulation):

* `_qgemv_kernel` (decode, M <= GEMV_MAX_M): CUDA-core FMA. The K axis is cut into *units* of
  PER codes that fill whole words (2/4/8-bit: one word, PER = 32/bits; 3/5-bit: `bits` words =
  32 codes; 6-bit: 3 words = 16 codes). A tile is [BLOCK_N rows, UB units]; its words are
  loaded once as UW contiguous-per-row tensors (for 2/4/8-bit a plain [BLOCK_N, UB] int32 tile:
  128-bit vector loads), then for each code position c (static loop) the code is shifted/masked
  out of its word(s) (straddling codes OR two words), turned into fp32 with the 2^23 magic
  (no int->float conversion instruction), multiplied by x[k = u*PER + c] (a strided load of x,
  L1 resident) and summed per unit. Scale and bias are applied per unit, with the bias folded:
  y = sum_u s_u * (sum_c q_c x_c) + b_u * (sum_c x_c). Split-K over a deterministic fp32
  partial buffer (summed by torch) when N is small.
* `_qgemm_kernel` (prefill and small batches, M > GEMV_MAX_M): tensor cores. Each [BLOCK_N,
  BLOCK_K] weight tile is dequantized in registers in natural K order (2/4/8-bit: word tile
  gathered per element (word k//PER, L1-served duplicates; a [BN, KW] word tile expanded to
  [BN, KW, PER] and reshaped spilled registers on sm_90); 3/5/6-bit: two-word gather),
  `q*s + b` in fp32 rounded once to the activation dtype, then `tl.dot` with the x tile.

Codes are decoded by `codes` (fp modes without tables).

K (in_features) is a constexpr: loop trip counts are static (the Triton interpreter needs
that, and the GPU compiler drops the K masks). Real models have 2-3 distinct K values.

Every kernel has a plain-torch twin with the same signature (`qgemv_ref`, `qgemm_ref`,
`qmatmul_ref`): fp32 dequant (mlxr.quant reference unpack) + fp32 matmul.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .codes import HAVE_TRITON, MODES, unit_codes

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codes import _code_value, _dequant_tile, _group_scale, _unit_code



def gemv_max_m() -> int:
    """Largest batch that takes the FMA GEMV kernel (env MLXR_QMM_GEMV_MAX_M, default 4)."""
    return int(os.environ.get("MLXR_QMM_GEMV_MAX_M", "4"))


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ====================================================================== torch twins (oracles)
def dequant_f32(w: Tensor, s: Tensor, b: Tensor | None, gs: Tensor | None, mode: str, bits: int,
                group: int) -> Tensor:
    """fp32 [N, K] weights as the kernels see them: affine q*s+b in fp32 (no rounding to the
    scale dtype), fp modes value*scale (exact)."""
    from mlxr.quant.affine import unpack_codes
    from mlxr.quant.fp import code_table, fp_scales

    k = s.shape[-1] * group
    q = unpack_codes(w, bits, k)
    n = q.shape[0]
    if mode == "affine":
        qf = q.to(torch.float32).view(n, k // group, group)
        out = qf * s.float().unsqueeze(-1) + b.float().unsqueeze(-1)
    else:
        v = code_table(mode, q.device)[q.to(torch.int64)].view(n, k // group, group)
        out = v * fp_scales(s, mode, gs).unsqueeze(-1)
    return out.reshape(n, k)


def qgemv_ref(x: Tensor, w: Tensor, s: Tensor, b: Tensor | None, gs: Tensor | None, *,
              mode: str, bits: int, group: int, out_dtype: torch.dtype | None = None) -> Tensor:
    """Torch twin of `qgemv`: fp32 dequant, fp32 matmul, cast to out_dtype (default x.dtype)."""
    y = x.float() @ dequant_f32(w, s, b, gs, mode, bits, group).t()
    return y.to(out_dtype or x.dtype)


def qgemm_ref(x: Tensor, w: Tensor, s: Tensor, b: Tensor | None, gs: Tensor | None, *,
              mode: str, bits: int, group: int, out_dtype: torch.dtype | None = None) -> Tensor:
    """Torch twin of `qgemm` (weights rounded once to x.dtype, as the kernel feeds tl.dot)."""
    wd = dequant_f32(w, s, b, gs, mode, bits, group).to(x.dtype)
    y = x.float() @ wd.float().t()
    return y.to(out_dtype or x.dtype)


def qmatmul_ref(x: Tensor, qw, out_dtype: torch.dtype | None = None) -> Tensor:
    """Torch twin of `qmatmul` (GEMV numerics: unrounded fp32 weights)."""
    w, s, b, gs, mode, bits, group = _operands(qw)
    return qgemv_ref(x, w, s, b, gs, mode=mode, bits=bits, group=group, out_dtype=out_dtype)


def _operands(qw):
    if qw.packed is None:
        raise ValueError(f"{qw.name}: Triton qmatmul needs the packed words (QuantWeight.packed)")
    sp = qw.spec
    return qw.packed, qw.scales, qw.biases, qw.global_scale, sp.mode, sp.bits, sp.group_size


def supported(qw) -> bool:
    sp = qw.spec
    return (HAVE_TRITON and qw.packed is not None and sp.mode in MODES
            and qw.in_features % 32 == 0)


# ====================================================================== Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _qgemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, y_ptr, M, N, stride_xm, stride_ym, stride_ys,
        K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
        HAS_GS: tl.constexpr, PER: tl.constexpr, MP: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        UW: tl.constexpr = PER * BITS // 32  # words per unit
        UB: tl.constexpr = BLOCK_K // PER  # units per tile
        KU: tl.constexpr = K // PER  # units per row
        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        NT: tl.constexpr = (KU + UB - 1) // UB
        TPS: tl.constexpr = (NT + SPLIT_K - 1) // SPLIT_K

        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rm = tl.arange(0, MP)
        mmask = rm < M
        ru = tl.arange(0, UB)
        gs = 1.0
        if HAS_GS:
            gs = tl.load(gs_ptr).to(tl.float32) / 2688.0

        acc = tl.zeros([MP, BLOCK_N, UB], dtype=tl.float32)
        for t in range(TPS):
            u = (pid_k * TPS + t) * UB + ru  # unit index [UB]
            umask = u < KU
            wmask = nmask[:, None] & umask[None, :]
            wp = w_ptr + rn[:, None].to(tl.int64) * KWORDS + u[None, :] * UW
            w0 = tl.load(wp, mask=wmask, other=0)
            w1 = w0
            w2 = w0
            w3 = w0
            w4 = w0
            if UW > 1:
                w1 = tl.load(wp + 1, mask=wmask, other=0)
                w2 = tl.load(wp + 2, mask=wmask, other=0)
            if UW > 3:
                w3 = tl.load(wp + 3, mask=wmask, other=0)
                w4 = tl.load(wp + 4, mask=wmask, other=0)
            g = (u * PER) // GROUP
            sp = rn[:, None].to(tl.int64) * NG + g[None, :]
            sc = _group_scale(tl.load(s_ptr + sp, mask=wmask, other=0), gs, MODE)
            xp = x_ptr + rm[:, None] * stride_xm + u[None, :] * PER
            xmask = mmask[:, None] & umask[None, :]
            p = tl.zeros([MP, BLOCK_N, UB], dtype=tl.float32)
            xs = tl.zeros([MP, UB], dtype=tl.float32)
            for c in tl.static_range(PER):
                q = _unit_code(w0, w1, w2, w3, w4, c, BITS)
                v = _code_value(q, MODE)
                xc = tl.load(xp + c, mask=xmask, other=0.0).to(tl.float32)
                p += v[None, :, :] * xc[:, None, :]
                if MODE == 0:
                    xs += xc
            acc += p * sc[None, :, :]
            if MODE == 0:
                bb = tl.load(b_ptr + sp, mask=wmask, other=0.0).to(tl.float32)
                acc += bb[None, :, :] * xs[:, None, :]
        out = tl.sum(acc, axis=2)  # [MP, BLOCK_N]
        yp = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]
        tl.store(yp, out, mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _qgemm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, y_ptr, M, N, stride_xm, stride_ym, stride_ys,
        K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
        HAS_GS: tl.constexpr, SPLIT_K: tl.constexpr, DOT_IEEE: tl.constexpr,
        M_BUCKET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        gid = pid // width
        first_m = gid * GROUP_M
        gm = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gm
        pid_n = (pid % width) // gm

        KWORDS: tl.constexpr = K * BITS // 32
        NG: tl.constexpr = K // GROUP
        NT: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        TPS: tl.constexpr = (NT + SPLIT_K - 1) // SPLIT_K

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        rk = tl.arange(0, BLOCK_K)
        wrow = w_ptr + rn[:, None].to(tl.int64) * KWORDS
        srow = rn[:, None].to(tl.int64) * NG
        gs = 1.0
        if HAS_GS:
            gs = tl.load(gs_ptr).to(tl.float32) / 2688.0

        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(TPS):
            k0 = (pid_k * TPS + t) * BLOCK_K
            kk = k0 + rk
            kmask = kk < K
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                         mask=mmask[:, None] & kmask[None, :], other=0.0)
            wf = _dequant_tile(wrow, srow, s_ptr, b_ptr, gs, kk, k0, nmask, kmask, K, BITS,
                               GROUP, MODE, BLOCK_N, BLOCK_K)
            wt = wf.to(xt.dtype)
            if DOT_IEEE:  # fp32 activations, or the interpreter (its bf16 dot is broken)
                acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        yp = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]
        tl.store(yp, acc, mask=mmask[:, None] & nmask[None, :])

    # ------------------------------------------------------------------ autotune configs
    def _gemv_configs(full: bool):
        if _interpret():
            return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4)]
        cfgs = [(8, 512, 4, 2), (16, 512, 4, 2), (16, 256, 4, 3), (32, 256, 4, 2),
                (8, 1024, 4, 1), (16, 1024, 8, 2), (32, 512, 8, 2), (4, 1024, 4, 2)]
        if not full:
            cfgs = cfgs[:2]
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk, w, s in cfgs]

    def _gemv_prune(configs, named_args, **kw):
        a = {**named_args, **kw}
        mp, per, k = a["MP"], a["PER"], a["K"]
        keep = []
        for c in configs:
            bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            if bk < per or bk > max(per, k) * 2:
                continue
            regs = mp * bn * (bk // per) * 2 / (32 * c.num_warps)  # acc + p per thread
            if regs <= 96:
                keep.append(c)
        return keep or configs[:1]

    def _gemm_configs(full: bool):
        if _interpret():
            return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8},
                                  num_warps=4)]
        cfgs = [  # BM, BN, BK, warps, stages (no register spills on sm_90 for 4-bit g64)
            (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 32, 8, 4),
            (64, 128, 32, 4, 4), (128, 256, 32, 8, 3),
            (16, 128, 64, 4, 4), (16, 64, 64, 4, 4), (16, 128, 32, 4, 4), (32, 128, 64, 4, 3),
        ]
        if not full:
            cfgs = [cfgs[0], cfgs[1], cfgs[5], cfgs[6]]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                              num_warps=w, num_stages=s) for bm, bn, bk, w, s in cfgs]

    def _gemm_prune(configs, named_args, **kw):
        a = {**named_args, **kw}
        mb = a["M_BUCKET"]
        keep = []
        for c in configs:
            bm = c.kwargs["BLOCK_M"]
            if mb <= 16:
                ok = bm == 16
            elif mb <= 64:
                ok = bm in (16, 32, 64)
            else:
                ok = bm >= 64
            if ok and c.kwargs["BLOCK_K"] <= max(64, a["K"]):
                keep.append(c)
        return keep or configs[:1]

    _GEMV_KEY = ["N", "K", "BITS", "GROUP", "MODE", "MP", "SPLIT_K"]
    _GEMM_KEY = ["N", "K", "BITS", "GROUP", "MODE", "M_BUCKET", "SPLIT_K"]

    def _gemv_tuned(full: bool):
        return triton.autotune(configs=_gemv_configs(full), key=_GEMV_KEY,
                               prune_configs_by={"early_config_prune": _gemv_prune})(
            _qgemv_kernel)

    def _gemm_tuned(full: bool):
        return triton.autotune(configs=_gemm_configs(full), key=_GEMM_KEY,
                               prune_configs_by={"early_config_prune": _gemm_prune})(
            _qgemm_kernel)

    _TUNED: dict[tuple[str, bool], object] = {}

    def _tuned(kind: str):
        full = os.environ.get("MLXR_QMM_TUNE", "full") != "quick"
        key = (kind, full)
        if key not in _TUNED:
            _TUNED[key] = _gemv_tuned(full) if kind == "gemv" else _gemm_tuned(full)
        return _TUNED[key]


# ====================================================================== launchers
_SM_COUNT: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 132
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(x: Tensor, w: Tensor, s: Tensor, mode: str, bits: int, group: int) -> tuple[int, int]:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError("qmatmul kernels take x [M, K] and packed w [N, K*bits/32]")
    k = s.shape[-1] * group
    if x.shape[1] != k or w.shape[1] * 32 != k * bits or k % 32:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"scales {tuple(s.shape)}, {mode} {bits}b g{group}")
    return x.shape[0], k


def _split_k(n_tiles: int, k: int, dev: torch.device, forced: int | None) -> int:
    if forced is not None:
        return forced
    split = 1
    target = 2 * _sm_count(dev)
    while n_tiles * split < target and k // (split * 2) >= 1024 and split < 8:
        split *= 2
    return split


def _out(m: int, n: int, split: int, odt: torch.dtype, dev) -> tuple[Tensor, int]:
    """The output [M, N], or fp32 split-K partials [split, M, N] (summed by `_finish`), and the
    partials' stride."""
    if split == 1:
        return torch.empty(m, n, device=dev, dtype=odt), 0
    return torch.empty(split, m, n, device=dev, dtype=torch.float32), m * n


def _finish(y: Tensor, split: int, odt: torch.dtype) -> Tensor:
    return y.sum(0).to(odt) if split > 1 else y


def qgemv(x: Tensor, w: Tensor, s: Tensor, b: Tensor | None, gs: Tensor | None, *, mode: str,
          bits: int, group: int, out_dtype: torch.dtype | None = None,
          split_k: int | None = None) -> Tensor:
    """FMA GEMV / small-batch kernel. x [M, K] (M <= 16 sensible), w int32 [N, K*bits/32]."""
    m, k = _check(x, w, s, mode, bits, group)
    n = w.shape[0]
    x = x.contiguous()
    w = w.view(torch.int32) if w.dtype == torch.uint32 else w
    mp = _next_pow2(max(m, 1))
    split = _split_k(-(-n // 16), k, x.device, split_k)
    odt = out_dtype or x.dtype
    y, ys = _out(m, n, split, odt, x.device)
    dummy = s
    kern = _tuned("gemv")
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)
    kern[grid](x, w, s, b if b is not None else dummy, gs if gs is not None else dummy, y,
               m, n, x.stride(0), n, ys, K=k, BITS=bits, GROUP=group, MODE=MODES[mode],
               HAS_GS=gs is not None, PER=unit_codes(bits), MP=mp, SPLIT_K=split)
    return _finish(y, split, odt)


def qgemm(x: Tensor, w: Tensor, s: Tensor, b: Tensor | None, gs: Tensor | None, *, mode: str,
          bits: int, group: int, out_dtype: torch.dtype | None = None,
          split_k: int | None = None) -> Tensor:
    """Tensor-core dequant GEMM. x [M, K] bf16/fp16 (fp32 -> ieee fp32 dot)."""
    m, k = _check(x, w, s, mode, bits, group)
    n = w.shape[0]
    x = x.contiguous()
    w = w.view(torch.int32) if w.dtype == torch.uint32 else w
    mb = 16 if m <= 16 else (64 if m <= 64 else 512)
    # split-K only for the small-M buckets, where the grid is just N tiles
    split = _split_k(-(-n // 64), k, x.device, split_k) if mb <= 16 else (split_k or 1)
    odt = out_dtype or x.dtype
    y, ys = _out(m, n, split, odt, x.device)
    dummy = s
    kern = _tuned("gemm")
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
                         split)
    kern[grid](x, w, s, b if b is not None else dummy, gs if gs is not None else dummy, y,
               m, n, x.stride(0), n, ys, K=k, BITS=bits, GROUP=group, MODE=MODES[mode],
               HAS_GS=gs is not None, SPLIT_K=split,
               DOT_IEEE=x.dtype == torch.float32 or _interpret(), M_BUCKET=mb)
    return _finish(y, split, odt)


def qmatmul(x: Tensor, qw, out_dtype: torch.dtype | None = None) -> Tensor:
    """y [M, N] = x [M, K] @ W^T for a `QuantWeight`; GEMV kernel for M <= gemv_max_m(),
    tensor-core GEMM otherwise. Output dtype = out_dtype or x.dtype."""
    w, s, b, gs, mode, bits, group = _operands(qw)
    fn = qgemv if x.shape[0] <= gemv_max_m() else qgemm
    return fn(x, w, s, b, gs, mode=mode, bits=bits, group=group, out_dtype=out_dtype)
