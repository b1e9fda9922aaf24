"""CUDA matmul paths for QuantWeight, chosen by batch size (measured on the H200, docs/perf.md).

- single-request decode (M = 1), affine 4-bit, bf16/fp16: `mlxr.ops.matmul.decode_gemv_tc` (the
  tensor-core GEMV, on its own load-time repack `tc`) where `q4tc_preferred` says it was
  measured faster, else `mlxr.ops.matmul.decode_gemv_q4` (on `q4`); both read the scales and biases
  repacked into pairs (`q4_sb`). H200 (benchmarks/gpu/gpu_q4gemv_sweep.py, q4tc_probe.py): q4gemv
  beats tinygemm at every Llama-8B / Qwen3-0.6B shape (8B gate_up 26.0 vs 38.9 us, LM head
  92.4 vs 150.6 us), q4tc beats q4gemv on the tall, the long and the 4096 x 4096 matrices
  (8B gate_up 22.1 vs 26.0 us, LM head 81.6 vs 96.6). Env `MLXR_Q4TC=0` at load builds
  q4gemv's copy everywhere; `MLXR_Q4GEMV=0` (read at every call) sends M = 1 to tinygemm (set
  at load, it also makes the load build tinygemm's copy).
- an MLP's gate_up (loaded with `glu=True`): its q4tc copy interleaves gate and up rows, and
  `gated` runs act(gate) * up in the GEMV's epilogue for 1-16 rows (0.6B decode +4.6%, 8B
  +0.3%; `MLXR_Q4TC_GLU=0` at load keeps the plain copy and the separate act launch).
- decode of 2-16 rows (2-8 on the 4096-row matrices; half that for group 32), affine 4-bit:
  `decode_gemv_tc` on `tc` (`q4tc_rows`; launches of 8 rows). The batching engine
  (`QuantWeight.add_batch_copy`) builds `tc` where a weight has only q4gemv's copy.
- the other rows up to 32, affine 4-bit bf16: torch's tinygemm kernel
  (`_weight_int4pack_mm`) where its copy exists: a one-time repack of the mlx codes (nibble
  order swapped, torch's tiled layout). It computes `x @ ((q - 8) * s + z)^T` per group, so
  mlx's `w = s*q + b` maps to `z = b + 8*s`. The copy is built at load only where neither
  q4gemv nor q4tc serves M = 1, and by the batching engine only where `tinygemm_rows` (or
  with `MLXR_Q4TC_ROWS=0`); without it these rows take the prefill paths below.
- prefill and large decode batches (M > 16; > 32 for 4-bit), affine 2/3/4/5/6/8-bit: one
  Triton pass (`prefill_dequant.dequant_affine`) dequantizes the packed words to a bf16 scratch
  matrix (4-bit: read 0.5 B, write 2 B per weight), then cuBLAS does the GEMM on tensor
  cores. The scratch is per call, never stored. The fp modes likewise by `dequant_fp`
  (`fp_dequant_on`; env `MLXR_FP_DEQUANT=0` keeps the generic Triton GEMM).
- 8-128 rows (2-128 where tinygemm's copy is absent) of a 4-bit weight of >= 4096 x 4096,
  and 8-32 rows (2-32) of an LM head of >= 65536 rows: the fused tensor-core GEMM of
  `mlxr.ops.matmul.prefill_gemm` on the packed words (no scratch). H200 sweeps (docs/perf.md): 8B
  gate_up at M = 128 101 vs 160 us (dequant + cuBLAS), at M = 32 82 vs 275 us (tinygemm);
  it loses at M >= 512, to tinygemm at 2-4 rows, and on small weights at 33+ rows. Env
  `MLXR_PREFILL_GEMM` (read at every call): `fused` for every call of 2+ rows of a 2/4/8-bit
  weight (the fused GEMM's widths), `dequant` for none, else (auto) this rule. Its fp32
  summation order differs from cuBLAS's and tinygemm's, so greedy tokens may differ at
  near-ties between the settings.
- everything else: the Triton GEMV/GEMM kernels of `mlxr.ops.matmul.generic_qmm`.

- decode (1-16 rows, as for 4-bit) of affine 2/3/5/6/8-bit weights: `decode_gemv_tc` over their
  nibble planes (`planes_supported`, `planes_pack`: a load-time copy; 2/3-bit codes widened to
  nibbles, 5/6/8-bit split into a high and a low plane read against the same x). Env
  `MLXR_PLANES=0` at load keeps the paths below: affine 2/3-bit at M = 1 (bf16/fp16) then
  use `mlxr.ops.matmul.decode_gemv` (measured faster than `generic_qmm`'s GEMV).
- decode (1-16 rows) of mxfp4 / nvfp4 weights (bf16): `decode_gemv_tc` over their fp4 copy
  (`fp4_tc_supported`; the file's E2M1 codes, each code's bits moved within its word), 1.8-1.9x
  the generic GEMV on the 8B. Env `MLXR_FP4_TC=0` at load keeps the generic GEMV.
- decode (1-16 rows) of mxfp8 weights (bf16): `decode_gemv_tc` over their fp8 copy
  (`fp8_tc_supported`; the E4M3 codes, 1 B each, two words per mma step). Env
  `MLXR_FP8_TC=0` at load keeps the generic GEMV.
The copies are built at load (`build_copies`, by `mlxr.quant.cuda_copies`' packers).
Env `MLXR_GEMV=triton` (read at every call, so A/B runs need no reload) routes decode (M <= 16) of
every format, affine 4-bit included, to the GEMV of `mlxr.ops.matmul.decode_gemv` instead of
tinygemm / `generic_qmm` (benchmarks/gpu/gpu_gemv_sweep.py measures both).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import cuda_copies
from .affine import PLANE_BITS, planes_on
from .cuda_copies import INNER_K_TILES, fp4_tc_on, fp8_tc_on, plane_count

DECODE_MAX_M = 16
# tinygemm beats dequant + cuBLAS up to 32 rows (H200, benchmarks/gpu/gpu_mid_m.py: 8B gate_up at
# M=32 268 vs 630 us, 0.6B o 12 vs 17 us; at 64 rows the 0.6B shapes already favour cuBLAS)
TINYGEMM_MAX_M = 32


def tinygemm_supported(qw) -> bool:
    sp = qw.spec
    return (hasattr(torch, "_weight_int4pack_mm") and sp.mode == "affine" and sp.bits == 4
            and qw.compute_dtype == torch.bfloat16 and sp.group_size in (32, 64, 128, 256)
            and qw.out_features % 8 == 0 and qw.in_features % (INNER_K_TILES * 16) == 0)


def q4gemv_supported(qw) -> bool:
    """Whether `linear` serves M = 1 with decode_gemv_q4 (and the load builds its repack)."""
    from ..ops.matmul import decode_gemv_q4

    sp = qw.spec
    return (sp.mode == "affine" and sp.bits == 4 and qw.packed is not None
            and decode_gemv_q4.supported(sp.group_size, qw.in_features, qw.compute_dtype)
            and qw.scales.dtype in (torch.bfloat16, torch.float16)
            and qw.biases.dtype == qw.scales.dtype
            and qw.out_features * qw.in_features // 8 < 2**31)


def q4tc_supported(qw) -> bool:
    """Whether decode_gemv_tc can serve this weight: its shapes and dtypes, scales in the
    compute dtype (the kernel reads the pairs in x's dtype), sm_80+ (bf16 mma.sync)."""
    from ..ops.matmul import decode_gemv_tc

    sp, dev = qw.spec, qw.device
    return (sp.mode == "affine" and sp.bits == 4 and qw.packed is not None
            and qw.biases is not None and qw.biases.dtype == qw.scales.dtype
            and decode_gemv_tc.supported(qw.spec.group_size, qw.out_features, qw.in_features,
                                      qw.compute_dtype)
            and qw.scales.dtype == qw.compute_dtype
            and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] >= 8))


def q4tc_preferred(qw) -> bool:
    """Whether single-row decode of this weight takes decode_gemv_tc rather than decode_gemv_q4:
    where the H200 sweeps measured it faster (benchmarks/gpu/q4tc_probe.py, docs/perf.md): more
    than 4096 rows (8B qkv 8.3 vs 8.7 us, gate_up 22.1 vs 26.0, the LM heads), K >= 3N
    (N >= 1024: 8B down 16.3 vs 18.8, 0.6B down 3.0 vs 3.9) or N >= 4K (0.6B qkv 2.8 vs
    3.3), and 4096 x 4096 and up (8B o 6.1 vs 6.4, 16 warps per row tile). q4gemv keeps the
    smaller squarish ones (its 8-row programs fill the GPU better there: 0.6B o 2.7 vs 3.0).
    `MLXR_Q4TC=0` (at load) turns it off, and so does the opt-in fused decode step
    (`MLXR_DECODE_FUSED=1` at load: it needs q4gemv's copy)."""
    n, k = qw.out_features, qw.in_features
    return (os.environ.get("MLXR_Q4TC", "") != "0" and os.environ.get("MLXR_DECODE_FUSED") != "1"
            and q4tc_supported(qw)
            and (n > 4096 or (k >= 3 * n and n >= 1024) or n >= 4 * k
                 or (n >= 4096 and k >= 4096)))


def q4tc_rows(qw, m: int) -> bool:
    """Whether m (>= 2) rows of x take decode_gemv_tc (on `tc`, built at load or by
    `QuantWeight.add_batch_copy`). H200 (q4tc_probe.py --rows, us per call against tinygemm
    and the fused GEMM): one launch (2-8 rows; 2-4 for group 32) wins on every 8B / 0.6B
    shape (at 8 rows: 8B gate_up 27.3 vs 81.6 / 83.9, down 22.2 vs 42.6 / 39.0, 0.6B o 4.7
    vs 5.5 / 7.2, 0.6B LM head 39.8 vs 109.8 / 96.0). Two launches (9-16; 5-8) only on the
    tall matrices (N > 4096: 8B gate_up at 16 rows 51.1 vs 137.4 / 78.5, qkv 19.5 vs 36.4 /
    24.0); on the 4096-row ones the fused GEMM (8B o 16.4 vs 20.8) or tinygemm (0.6B o 5.7 vs
    7.8, down 7.6 vs 10.5) is faster. Env `MLXR_Q4TC_ROWS=0` (read at every call, and at
    `add_batch_copy`) keeps 2+ rows on the paths below."""
    from ..ops.matmul import decode_gemv_tc

    most = decode_gemv_tc.max_rows(qw.spec.group_size)
    return (qw.tc is not None and 2 <= m <= 2 * most
            and (m <= most or qw.out_features > 4096) and several_rows_on())


def tinygemm_rows(qw) -> bool:
    """Whether the batching engine's 9-32 rows of a weight that has q4tc's copy want
    tinygemm's too (where `tinygemm_supported`): where neither q4tc (N <= 4096) nor the fused
    GEMM (min(N, K) < 4096) takes them, i.e. the squarish matrices of small models (0.6B
    qkv, o, down: ~0.15 GB)."""
    return qw.out_features <= 4096 and min(qw.out_features, qw.in_features) < FUSED_MIN_DIM


def fp4_tc_supported(qw) -> bool:
    """Whether decode (1-16 rows) of this mxfp4 / nvfp4 weight takes decode_gemv_tc over its fp4
    copy (`fp4_tc_pack`: the file's codes, bits moved within each word, at about the 4-bit
    kernel's speed; the Triton GEMV served them at ~1 TB/s, docs/perf.md): bf16 compute,
    q4tc's shapes (nvfp4's group 16 too), a scalar global scale, sm_80+. Env
    `MLXR_FP4_TC=0` at load keeps the Triton GEMV (for A/B runs). (Two affine nibble planes
    of 2v + 12 were the first way onto q4tc: 263 tok/s on the 8B against this copy's 421,
    at twice its bytes; removed, docs/perf.md.)"""
    from ..ops.matmul import decode_gemv_tc

    sp, dev = qw.spec, qw.device
    return (fp4_tc_on(sp) and qw.packed is not None and qw.compute_dtype == torch.bfloat16
            and (qw.global_scale is None or qw.global_scale.numel() == 1)
            and decode_gemv_tc.supported(sp.group_size, qw.out_features, qw.in_features,
                                      torch.bfloat16, fp4=True)
            and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] >= 8))


def fp8_tc_supported(qw) -> bool:
    """Whether decode (1-16 rows) of this mxfp8 weight takes decode_gemv_tc over its fp8 copy
    (`fp8_tc_pack`): bf16 compute, q4tc's shapes, sm_80+. Env `MLXR_FP8_TC=0` at load keeps
    the Triton GEMV (A/B runs)."""
    from ..ops.matmul import decode_gemv_tc

    sp, dev = qw.spec, qw.device
    return (fp8_tc_on(sp) and qw.packed is not None and qw.compute_dtype == torch.bfloat16
            and decode_gemv_tc.supported(sp.group_size, qw.out_features, qw.in_features,
                                      torch.bfloat16, fp8=True)
            and qw.out_features * qw.in_features // 4 < 2**31
            and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] >= 8))


def planes_supported(qw) -> bool:
    """Whether decode (1-16 rows) of this 2/3/5/6/8-bit affine weight takes decode_gemv_tc over
    its nibble planes (`mlxr.quant.affine.planes`: 2/3-bit codes widened to nibbles, 5/6/8-bit
    split into two planes), a copy built at load (`planes_pack`). The Triton GEMVs that served
    these widths ran at 0.3-1.1 TB/s (docs/perf.md); q4tc reads the planes' 0.5 B per code
    (1 B for two planes) at its 4-bit rate. Env `MLXR_PLANES=0` at load keeps them."""
    from ..ops.matmul import decode_gemv_tc

    sp, dev = qw.spec, qw.device
    affine = (sp.mode == "affine" and sp.bits in PLANE_BITS and qw.biases is not None
              and qw.scales.dtype == qw.biases.dtype == qw.compute_dtype)
    return (planes_on() and affine and qw.packed is not None
            and decode_gemv_tc.supported(sp.group_size, qw.out_features, qw.in_features,
                                      qw.compute_dtype)
            and qw.out_features * qw.in_features * plane_count(sp) // 8 < 2**31
            and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] >= 8))


def several_rows_on() -> bool:
    """Env `MLXR_Q4TC_ROWS=0` keeps several rows off q4tc (`q4tc_rows`,
    `QuantWeight.add_batch_copy`)."""
    return os.environ.get("MLXR_Q4TC_ROWS", "") != "0"


def fp_dequant_on() -> bool:
    """The fp modes' prefill (mxfp4 / nvfp4 / mxfp8, 17+ rows) goes to `dequant_fp` +
    cuBLAS, as the affine widths go: H200, 8B shape, 128 tokens, 11.7k (mxfp4) and 10.9k
    (mxfp8) tok/s against the generic Triton GEMM's 1.1k, greedy tokens identical
    (docs/perf.md). Env `MLXR_FP_DEQUANT=0` keeps the generic GEMM."""
    return os.environ.get("MLXR_FP_DEQUANT", "") != "0"


def dequant_supported(qw) -> bool:
    sp = qw.spec
    if qw.packed is None:  # from the q4tc copy if the words were dropped
        return qw.words_dropped and (sp.mode == "affine" or qw.tc_fp4 or qw.tc_fp8)
    if sp.mode == "affine":
        return sp.bits in (2, 3, 4, 5, 6, 8)
    return fp_dequant_on()


def dequantize(qw, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The full weight [N, K] in `dtype`, dequantized by one Triton pass (2/3/4/5/6/8-bit
    affine; the fp modes)."""
    # on first use
    from ..ops.matmul.prefill_dequant import dequant_affine, dequant_copy, dequant_fp

    sp = qw.spec
    if qw.words_dropped:
        return dequant_copy(qw.tc, qw.scales, qw.biases, sp.bits, sp.group_size, qw.planes,
                            qw.tc_glu, dtype, sp.mode, qw.global_scale)
    if sp.mode != "affine":
        return dequant_fp(qw.packed, qw.scales, qw.global_scale, sp.mode, dtype)
    return dequant_affine(qw.packed, qw.scales, qw.biases, qw.in_features, sp.bits,
                          sp.group_size, dtype)


def gemv_v2_default(qw, m: int) -> bool:
    """Where decode_gemv was measured faster than generic_qmm's GEMV without any switch: affine
    2- and 3-bit at M = 1 in bf16/fp16 (H200 sweep, docs/perf.md: 8B shapes 2-bit 1.2-1.5x,
    3-bit qkv 1.1x; other widths and M were not measured, and the float32 exact mode keeps the
    kernel its parity runs used)."""
    sp = qw.spec
    return (m == 1 and sp.mode == "affine" and sp.bits in (2, 3) and qw.tc is None
            and qw.compute_dtype != torch.float32)


def _gemv_v2_config(qw, m: int):
    """The sweep's best launch for large 2-bit matrices (32 rows per program: x loaded once
    for more rows); the default launch elsewhere (measured equal to the best at 0.6B shapes)."""
    from ..ops.matmul import decode_gemv

    n, k, sp = qw.out_features, qw.in_features, qw.spec
    if sp.bits == 2 and m == 1 and n >= 4096 and k >= 4096:
        return decode_gemv.fill_split(decode_gemv.GemvConfig(block_n=32), n, k, sp.bits,
                                      sp.group_size, 256)
    return None


FUSED_MAX_M = 128  # the sweep's crossover (fused GEMM vs dequant + cuBLAS, 8B shapes)
FUSED_BITS = (2, 4, 8)  # prefill_gemm.qgemm's widths (codes inside one word)
FUSED_MIN_DIM = 4096  # the 8B shapes it won on; K = 1024 (0.6B, its LM head too) was slower
# ... at 33-128 rows. At 2-32 rows (benchmarks/gpu/gpu_mid_m.py, H200, 4-bit g64, us per call):
# tinygemm wins at 2-4 rows, ties at 8 (8B layer 173 vs 171 us), and loses from 16 (8B layer
# 280 vs 171; at 32: 526 vs 170, dequant + cuBLAS 308); a 0.6B-style LM head (N >= 65536,
# K = 1024) is the fused GEMM's from 8 rows too (at 16: 84 vs tinygemm 187, dequant 207)
FUSED_MIN_M = 8  # below this, tinygemm's copy (where built) serves
FUSED_MIN_HEAD = 65536


def fused_gemm(qw, m: int) -> bool:
    """Whether a call of m (>= 2) rows takes prefill_gemm's fused GEMM instead of tinygemm
    (where its copy exists) or dequant + cuBLAS (see the module docstring and the table
    above: env MLXR_PREFILL_GEMM = fused | dequant | auto). Never for widths the GEMM does
    not take, nor for a weight whose words were dropped (`QuantWeight.drop_words`): it
    dequantizes from its copy (the fused GEMM built on the copy's tiles measured 1.4-2.2x
    the words' GEMM and slower than dequant + cuBLAS, docs/perf.md)."""
    if qw.spec.mode != "affine" or qw.spec.bits not in FUSED_BITS or qw.packed is None:
        return False
    mode = os.environ.get("MLXR_PREFILL_GEMM", "").lower()
    if mode in ("fused", "dequant"):
        return mode == "fused"
    if qw.spec.bits != 4 or m > FUSED_MAX_M:
        return False
    if m < FUSED_MIN_M and qw.i4 is not None:
        return False
    if min(qw.out_features, qw.in_features) >= FUSED_MIN_DIM:
        return True
    return qw.out_features >= FUSED_MIN_HEAD and m <= TINYGEMM_MAX_M


def _gemv_v2(qw, m: int) -> bool:
    return m <= DECODE_MAX_M and qw.packed is not None and (
        os.environ.get("MLXR_GEMV", "").lower() == "triton" or gemv_v2_default(qw, m))


def _one_row(m: int) -> bool:
    return m == 1 and os.environ.get("MLXR_Q4GEMV", "") != "0"


def _takes_q4tc(qw, m: int) -> bool:
    """Whether `linear` sends m rows to decode_gemv_tc (after decode_gemv and q4gemv decline)."""
    one = _one_row(m) or (m == 1 and qw.words_dropped)  # the copy is all such a weight has
    return (not _gemv_v2(qw, m) and not (_one_row(m) and qw.q4 is not None)
            and ((one and qw.tc is not None) or q4tc_rows(qw, m)))


def _q4tc(qw, x: Tensor, act: str | None = None) -> Tensor:
    from ..ops.matmul import decode_gemv_tc

    if x.data_ptr() % 16 or not x.is_contiguous():  # its 16-byte x loads: a fresh copy
        x = x.clone(memory_format=torch.contiguous_format)
    return decode_gemv_tc.q4tc(x, qw.tc, qw.q4_sb, group=qw.spec.group_size, act=act,
                            planes=qw.planes, fp4=qw.tc_fp4, gs=qw.tc_gs,
                            fp8=qw.tc_fp8).view(x.shape[0], -1)


def gated(qw, x: Tensor, act: str) -> Tensor | None:
    """act(gate) * up [M, N / 2] of x [M, K] in one launch (the GEMV's epilogue), where
    `linear` would take decode_gemv_tc and the weight's copy is a glu copy (`qw.tc_glu`); else
    None. The same sums and roundings as `linear` followed by `ops.gated_act`."""
    if not qw.tc_glu or not _takes_q4tc(qw, x.shape[0]):
        return None
    return _q4tc(qw, x, act)


def linear(qw, x: Tensor) -> Tensor | None:
    """x [M, K] -> [M, N] by the fastest measured path, or None to use the generic kernels."""
    m = x.shape[0]
    if _gemv_v2(qw, m):
        from ..ops.matmul import decode_gemv

        sp = qw.spec
        return decode_gemv.qgemv(x, qw.packed, qw.scales, qw.biases, qw.global_scale,
                                 mode=sp.mode, bits=sp.bits, group=sp.group_size,
                                 config=_gemv_v2_config(qw, m))
    if _one_row(m) and qw.q4 is not None:  # q4gemv's copy: q4tc's (if any) is for 2+ rows
        from ..ops.matmul import decode_gemv_q4

        return decode_gemv_q4.q4gemv(x, qw.q4, qw.scales, qw.biases, group=qw.spec.group_size,
                                    sb=qw.q4_sb).view(1, -1)
    if _takes_q4tc(qw, m):
        from ..ops.matmul import decode_gemv_tc

        y = _q4tc(qw, x)  # a glu copy's rows come back in [gate | up] order
        return decode_gemv_tc.glu_order(y) if qw.tc_glu else y
    if m <= TINYGEMM_MAX_M and qw.i4 is not None and not fused_gemm(qw, m):
        return torch._weight_int4pack_mm(x, qw.i4, qw.spec.group_size, qw.i4_sz)
    # 2-16 rows of a 4-bit weight with a decode copy (q4gemv's or tinygemm's) that tinygemm
    # does not serve take the prefill paths, which read the packed words once; the generic
    # kernels below re-read them per few rows (H200, Llama-8B, a 16-token prompt: 292 tok/s
    # that way, 1,709 with tinygemm, 2,711 with the fused GEMM)
    decode_copy = qw.q4 is not None or qw.tc is not None or qw.i4 is not None
    if ((m > DECODE_MAX_M or (m > 1 and decode_copy)) and qw.compute_dtype != torch.float32
            and dequant_supported(qw)):
        if fused_gemm(qw, m):
            from ..ops.matmul import prefill_gemm

            sp = qw.spec
            return prefill_gemm.qgemm(x, qw.packed, qw.scales, qw.biases, bits=sp.bits,
                                      group=sp.group_size)
        return x @ dequantize(qw, x.dtype).t()
    return None


def build_copies(qw, glu: bool, keep_words: bool) -> None:
    """The decode copies a CUDA weight gets at load (its MLX words in `qw.packed`): q4tc's
    (affine 4-bit, in `glu_rows` order if glu) or q4gemv's, the fp4 / fp8 copies, the nibble
    planes of the other affine widths, and tinygemm's where none serves one row (or
    `MLXR_Q4GEMV=0`). keep_words=False (the loader's budget or `MLXR_WORDS=drop`): q4tc's
    copy also where q4gemv would serve, so that the words can go."""
    if qw.matmul and q4gemv_supported(qw):  # single-request decode (M = 1)
        # the tensor-core GEMV; also where q4gemv was measured faster if the words are to go
        # (prefill can dequantize from q4tc's layout only; 0.6B o: 3.0 vs 2.7 us)
        if q4tc_preferred(qw) or (not keep_words and q4tc_supported(qw)):
            qw.tc_glu = glu
            qw.tc, qw.q4_sb = cuda_copies.q4tc_pack(qw.packed, qw.scales, qw.biases, glu=glu)
        else:
            qw.q4, qw.q4_sb = cuda_copies.q4gemv_pack(qw.packed, qw.scales, qw.biases)
    elif qw.matmul and fp4_tc_supported(qw):  # mxfp4 / nvfp4 decode
        tc = cuda_copies.fp4_tc_pack(qw, glu=glu)
        if tc is not None:
            qw.tc, qw.q4_sb, qw.tc_gs = tc
            qw.tc_glu = glu
    elif qw.matmul and fp8_tc_supported(qw):  # mxfp8 decode
        tc = cuda_copies.fp8_tc_pack(qw, glu=glu)
        if tc is not None:
            qw.tc, qw.q4_sb = tc
            qw.tc_glu = glu
    elif qw.matmul and planes_supported(qw):  # the other widths' decode
        tc = cuda_copies.planes_pack(qw, glu=glu)
        if tc is not None:
            qw.tc, qw.q4_sb, qw.planes = tc
            qw.tc_glu = glu
    # tinygemm serves M = 1 where q4gemv / q4tc do not (or are switched off for an A/B run:
    # MLXR_Q4GEMV=0 at load); else its copy is built on demand
    one_row = qw.q4 is not None or qw.tc is not None
    if qw.matmul and (not one_row or os.environ.get("MLXR_Q4GEMV") == "0"):
        qw.add_batch_copy()
