"""The compiled CPU kernels (`kernels.c`, the `_kernels` extension), typed over torch tensors.

`available()` says whether the extension was built (setup.py compiles it at install time, and
skips it where no compiler is present); `enabled()` adds env `MLXR_CPU_KERNELS` ("0" selects the
torch paths, read at each call: weights choose their storage when they load, so flip it before
loading for a clean A/B). Every wrapper checks shapes, dtypes and contiguity before passing raw
pointers: the C side trusts them. Threads: torch's count (`torch.get_num_threads`, which
`--threads` sets); the extension links the libgomp torch has already loaded (same soname), so
both share one OpenMP pool.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
MODES = {"affine": 0, "mxfp4": 1, "nvfp4": 2, "mxfp8": 3}


@functools.cache
def _module():
    try:
        from . import _kernels
    except ImportError:
        return None
    return _kernels


def available() -> bool:
    """The extension was built and imports."""
    return _module() is not None


def enabled() -> bool:
    return available() and os.environ.get("MLXR_CPU_KERNELS", "") != "0"


def attend_enabled(served: bool) -> bool:
    """Whether the decode attention kernel runs for a layer (`served`: its projections run
    mlxr's own matmul kernels). Env `MLXR_CPU_ATTEND`: "1" on, "0" off; unset, on for served
    layers only. The kernel sums q.K and P.V in another order than the reference's float32
    bmm (MKL's, not reproducible), which moved a near-tie greedy token of the bundled
    stories260K in bf16 (its published text, tests/test_cli_run.py): where the step is the
    reference's bit for bit (weights on torch's kernels) it stays so by default. Where i4mm /
    qmm serve, the logits already follow mlxr's summation order (within 5e-3 of the range of
    the torch path's); the kernel adds a divergence of the same kind and size (docs/perf.md,
    session 21) and saves ~4-5 ms of a ~50 ms 0.6B step on the dev box."""
    env = os.environ.get("MLXR_CPU_ATTEND", "")
    return enabled() and (env == "1" or (served and env != "0"))


def prefill_attend_enabled(served: bool) -> bool:
    """Whether a whole bf16 prompt's attention in a layer runs `prefill_attend` (torch's bf16
    flash kernel, is_causal) instead of the reference's float32 SDPA with a mask (`served`:
    the layer's projections run mlxr's own matmul kernels). Env `MLXR_CPU_PREFILL_ATTEND`:
    "1" on, "0" off; unset, on for served layers only, as `attend_enabled` (its bf16
    probabilities move ~40 % of the outputs by one bf16 step: docs/perf.md, session 21)."""
    env = os.environ.get("MLXR_CPU_PREFILL_ATTEND", "")
    return enabled() and (env == "1" or (served and env != "0"))


def features() -> dict[str, int]:
    """How the extension was compiled: {"avx512": 0/1, "openmp": 0/1, "i4mm": 0/1} ({} when
    absent)."""
    m = _module()
    return dict(m.features()) if m is not None else {}


def fast_matmul(mode: str, bits: int, group: int, in_features: int) -> bool:
    """Whether `qmm` has a vectorised path for this format with bf16 x (the rest run its
    portable loop, slower than torch's int4 kernel over nibble planes): 4-bit affine / mxfp4
    / nvfp4 and 8-bit affine (as two nibbles) with a row of a multiple of 128 nibbles, and
    mxfp8."""
    if not features().get("avx512") or group & (group - 1):
        return False
    if bits == 4 and mode in ("affine", "mxfp4", "nvfp4"):
        return in_features % 128 == 0
    if bits == 8 and mode == "affine":
        return in_features % 64 == 0
    return bits == 8 and mode == "mxfp8" and group % 16 == 0


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"mlxr.ops.cpu: {what}")


def qmm(x: Tensor, words: Tensor, scales: Tensor, biases: Tensor | None, mode: str, bits: int,
        group: int, global_mul: float, out_dtype: torch.dtype) -> Tensor:
    """y [M, N] = x [M, K] @ W^T for W in MLX's packed layout: words [N, K * bits / 32] (int32 /
    uint32 / uint8 bytes of the same rows), scales [N, K / group] (affine: float dtypes, with
    biases alike; mx*/nvfp4: uint8 E8M0 / E4M3 bytes, no biases), nvfp4's per-tensor
    multiplier `global_mul` (global_scale / 2688 in float32; 1.0 otherwise). Float32
    accumulation, rounded to `out_dtype` once."""
    m, k = x.shape
    n = words.shape[0]
    _check(x.dtype in DTYPES and x.dtype != torch.uint8 and x.is_contiguous(), "x")
    _check(k % group == 0 and k * bits % 32 == 0, f"K={k} vs group {group}, {bits} bits")
    _check(words.is_contiguous() and words.numel() * words.element_size() == n * k * bits // 8,
           f"words {tuple(words.shape)} for [{n}, {k}] x {bits} bits")
    _check(scales.is_contiguous() and tuple(scales.shape) == (n, k // group), "scales")
    if mode == "affine":
        _check(biases is not None and biases.is_contiguous() and biases.shape == scales.shape
               and scales.dtype in DTYPES and biases.dtype in DTYPES, "biases")
    else:
        _check(scales.dtype == torch.uint8, "scale bytes")
    y = torch.empty(m, n, dtype=out_dtype)
    b = biases if biases is not None else scales
    _module().qmm(x.data_ptr(), DTYPES[x.dtype], m, k, words.data_ptr(), n, MODES[mode], bits,
                  group, scales.data_ptr(), DTYPES[scales.dtype], b.data_ptr(),
                  DTYPES[b.dtype], global_mul, y.data_ptr(), DTYPES[out_dtype],
                  torch.get_num_threads())
    return y


def i4mm_serves(out_features: int, in_features: int, group: int) -> bool:
    """Whether `i4mm` can read a weight's torch int4 copy: built with its vector path, this
    torch packing 64-row blocks (`int4pack.block`), N a multiple of 64, the group even."""
    from mlxr.quant import int4pack

    return (enabled() and bool(features().get("i4mm")) and int4pack.block() == 64
            and out_features % 64 == 0 and group % 4 == 0 and in_features % group == 0)


I4_PAIRS = {"biases": 0, "zeros": 1, "tiles": 2}  # i4mm's modes (i4mm.c)


def i4mm(x: Tensor, packed: Tensor, sb: Tensor, group: int, out_dtype: torch.dtype,
         pairs: str = "zeros") -> Tensor:
    """y [M, N] = x [M, K] (bf16) @ W^T for W in torch's packed int4 CPU copy (`packed`:
    uint8 [N / 64, K, 32] bytes as `int4pack.pack` makes them, 64-row blocks) and pairs `sb`
    [K / G, N, 2] bf16. `pairs` "zeros": torch's scale and zero (`int4pack.scales_and_zeros`,
    w = (q - 8) * scale + zero: the values of `torch._weight_int4pack_mm_for_cpu`, float32
    sums in another order); "biases": MLX's scale and bias (`int4pack.scales_and_biases`,
    w = q * scale + bias), both per group s * (x . q) + b * sum(x) in float32 (b = zero -
    8 s); "tiles": MLX's scale and bias, each weight formed as the tiles and mlx's CPU backend
    form it, bf16(bf16(q * s) + b) (`i4deq`), then x . w in float32. The output rounds to
    `out_dtype` (bf16 / float32) once. Callers check `i4mm_serves` first."""
    m, k = x.shape
    kg, n, two = sb.shape
    _check(x.dtype == torch.bfloat16 and x.is_contiguous(), "x")
    _check(two == 2 and sb.dtype == torch.bfloat16 and sb.is_contiguous() and kg * group == k
           and n % 64 == 0 and group % 4 == 0, f"scales/biases {tuple(sb.shape)} for K={k}")
    _check(packed.dtype == torch.uint8 and packed.is_contiguous()
           and packed.numel() * 2 == n * k, f"int4 copy {tuple(packed.shape)} for [{n}, {k}]")
    _check(out_dtype in (torch.bfloat16, torch.float32), "out dtype")
    y = torch.empty(m, n, dtype=out_dtype)
    _module().i4mm(x.data_ptr(), m, k, packed.data_ptr(), sb.data_ptr(), n, group,
                   I4_PAIRS[pairs],
                   y.data_ptr(), DTYPES[out_dtype], torch.get_num_threads())
    return y


def i4deq_serves(scales: Tensor, biases: Tensor | None, group: int,
                 compute_dtype: torch.dtype) -> bool:
    """Whether `i4deq` reproduces `QuantWeight.dequant_rows` for an affine weight's int4 copy:
    built with AVX-512, 64-row blocks, bf16 scales and biases and bf16 compute (the two bf16
    ops it mirrors), a group of a multiple of 32."""
    from mlxr.quant import int4pack

    return (enabled() and bool(features().get("avx512")) and int4pack.block() == 64
            and biases is not None and scales.dtype == biases.dtype == torch.bfloat16
            and compute_dtype == torch.bfloat16 and group % 32 == 0)


def i4deq(packed: Tensor, scales: Tensor, biases: Tensor, group: int, r0: int,
          r1: int) -> Tensor:
    """bf16 rows r0..r1 (multiples of 64) [r1 - r0, K] of an affine weight held as torch's
    int4 copy (`packed` uint8 [N / 64, K, 32], `int4pack.pack`), w = bf16(bf16(q * s) + b)
    with its bf16 scales / biases [N, K / G]: `QuantWeight.dequant_rows`' values bit for bit.
    Callers check `i4deq_serves` first."""
    n, kg = scales.shape
    k = kg * group
    _check(scales.is_contiguous() and biases.is_contiguous() and biases.shape == scales.shape
           and scales.dtype == biases.dtype == torch.bfloat16 and group % 32 == 0,
           "scales / biases")
    _check(packed.dtype == torch.uint8 and packed.is_contiguous()
           and packed.numel() * 2 == n * k, f"int4 copy {tuple(packed.shape)} for [{n}, {k}]")
    _check(r0 % 64 == 0 and r1 % 64 == 0 and 0 <= r0 < r1 <= n, f"rows {r0}..{r1}")
    y = torch.empty(r1 - r0, k, dtype=torch.bfloat16)
    _module().i4deq(packed.data_ptr(), scales.data_ptr(), biases.data_ptr(), y.data_ptr(), k,
                    r0 // 64, r1 // 64, group, torch.get_num_threads())
    return y


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor | None, start: int,
           length: int, scale: float) -> Tensor:
    """One token's attention: q [H, D] over cache positions of k_cache / v_cache [KH, P, D]
    (slots long [length] or, when None, start .. start + length) -> [H, D] in q's dtype.
    Query head h reads kv head h // (H / KH); float32 scores, softmax and sum."""
    h, d = q.shape
    kh, p, d2 = k_cache.shape
    _check(q.is_contiguous() and q.dtype in (torch.float32, torch.bfloat16), "q")
    _check(d2 == d and h % kh == 0 and k_cache.shape == v_cache.shape
           and k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
           and k_cache.is_contiguous() and v_cache.is_contiguous(), "k/v cache")
    if slots is not None:
        _check(slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == length
               and (length == 0 or (0 <= int(slots.min()) and int(slots.max()) < p)), "slots")
    else:
        _check(0 <= start and start + length <= p, "slot range")
    _check(length > 0, "no positions")
    out = torch.empty(h, d, dtype=q.dtype)
    _module().attend(q.data_ptr(), DTYPES[q.dtype], h, d, k_cache.data_ptr(),
                     v_cache.data_ptr(), DTYPES[k_cache.dtype], kh, p * d,
                     0 if slots is None else slots.data_ptr(), start, length, scale,
                     out.data_ptr(), torch.get_num_threads())
    return out


class QMatmul:
    """`qmm` bound to one weight: its checks done once, so a call costs a dispatch, an output
    allocation and the kernel (~the per-op cost of one torch call)."""

    def __init__(self, words: Tensor, scales: Tensor, biases: Tensor | None, mode: str,
                 bits: int, group: int, in_features: int, global_mul: float,
                 out_dtype: torch.dtype, max_m: int):
        x = torch.zeros(1, in_features, dtype=out_dtype)
        qmm(x, words, scales, biases, mode, bits, group, global_mul, out_dtype)  # the checks
        self.keep = (words, scales, biases)  # the pointers below stay valid while we live
        self.words = words  # what it reads beside the weight's storage (QuantWeight.nbytes)
        self.n, self.k, self.out_dtype = words.shape[0], in_features, out_dtype
        self.max_m = max_m  # the caller's cutoff: rows of x up to which this serves
        b = biases if biases is not None else scales
        self.args = (words.data_ptr(), self.n, MODES[mode], bits, group, scales.data_ptr(),
                     DTYPES[scales.dtype], b.data_ptr(), DTYPES[b.dtype], global_mul)
        self.fn = _module().qmm

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, in] (bf16 / f32 / f16) -> [M, out] in the weight's compute dtype."""
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype not in DTYPES:
            raise ValueError(f"mlxr.ops.cpu: x {tuple(x.shape)} {x.dtype} for in={self.k}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=self.out_dtype)
        self.fn(x.data_ptr(), DTYPES[x.dtype], x.shape[0], self.k, *self.args, y.data_ptr(),
                DTYPES[self.out_dtype], torch.get_num_threads())
        return y


class I4Matmul:
    """`i4mm` bound to a weight's torch int4 copy (`QuantWeight.i4`, `planes` nibble planes of
    its codes side by side: x repeated once per plane, as torch's kernel is called over them)
    and pairs `sb` (`i4mm`: the weight's own `i4_sz` for "zeros", else its planes' scales and
    biases, kept here: what it reads beside the weight's storage), its checks done once;
    serves up to `max_m` rows of x."""

    def __init__(self, packed: Tensor, sb: Tensor, group: int, planes: int, max_m: int,
                 pairs: str = "zeros"):
        kp = sb.shape[0] * group
        i4mm(torch.zeros(1, kp, dtype=torch.bfloat16), packed, sb, group, torch.bfloat16, pairs)
        self.keep = (packed, sb)
        self.words = None if pairs == "zeros" else sb  # nbytes counts what is not its own
        self.n, self.k, self.planes, self.max_m = sb.shape[1], kp // planes, planes, max_m
        self.group, self.pairs = group, pairs
        self.args = (packed.data_ptr(), sb.data_ptr(), self.n, group, I4_PAIRS[pairs])
        self.fn = _module().i4mm

    def __call__(self, x: Tensor) -> Tensor:
        """x [M, in] bf16 -> [M, out] bf16."""
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.bfloat16:
            raise ValueError(f"mlxr.ops.cpu: x {tuple(x.shape)} {x.dtype} for in={self.k}")
        # planes: x once per plane, side by side (cat: ~1.5 µs against repeat's ~6 per call)
        x = x.contiguous() if self.planes == 1 else torch.cat([x] * self.planes, dim=1)
        y = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        p, sb, n, g, z = self.args
        self.fn(x.data_ptr(), x.shape[0], x.shape[1], p, sb, n, g, z, y.data_ptr(), 1,
                torch.get_num_threads())
        return y
