"""CPU matmul strategies for `QuantWeight.linear`.

* mlxr's compiled kernel (`mlxr.ops.cpu`, built at install where a C compiler is there), for
  the formats and row counts where it measured faster (`KERNEL_ROWS`: mxfp4, nvfp4) in bf16:
  it reads MLX's words as shipped (kept beside the storage below: mxfp4 +0.5 B per weight;
  nvfp4 keeps them anyway). Env `MLXR_CPU_KERNELS=0` at load builds nothing for it.
* affine 4-bit, bf16, M < `i4_max_m`: torch's packed-int4 kernel (reads 0.5 B/weight); the
  other affine widths through it too, over their nibble planes (`affine.planes`: 2/3-bit
  codes as nibbles, 5/6/8-bit as two planes against x repeated twice; `MLXR_PLANES=0` at load
  keeps them on the tiles below). Up to `I4MM_MAX_M` rows mlxr's compiled GEMV reads that
  same copy instead (`native.i4mm`, `i4_kernel_for`): the same weights, float32 sums in
  another order, faster.
* nvfp4 and mxfp8 (no int4 form), bf16/fp16: a dense copy dequantized once at load
  (`QuantWeight.dense`, 2 B/weight, within the loader's RAM budget).
* everything else: dequantize tiles of output rows to the compute dtype and matmul them
  (bf16 GEMM is ~2x faster than the int4 kernel for prefill). Small matrices (< SMALL_BYTES
  dequantized) are done in one tile. The full dequantized matrix is never held otherwise.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from mlxr.ops.cpu import native

from . import int4pack
from .affine import plane_scales, unpack_codes

# Rows of x from which the tiles beat torch's int4 kernel, by its planes. The tiles pay a
# fixed cost per call (every code decoded from the int4 copy and dequantized), the kernel a
# cost per row that grows with the planes. Qwen3-0.6B prefill on the 2-core box, int4 vs
# tiles, tok/s (docs/perf.md): 4-bit 128 rows 260 vs 230, 192 rows 229 vs 296; 8-bit 64 rows
# 152 vs 121, 96 rows 139 vs 157; mxfp4 (two planes) 64 rows 87 vs 97, 128 rows 115 vs 124.
I4_MAX_M = {1: 160, 2: 80}
# With the tiles from mlxr's compiled dequant (`deq_serves`) their fixed cost falls ~4x and
# they beat torch's int4 kernel and i4mm from 16 rows on (docs/perf.md, "Session 21": 0.6B
# qkv 4096 x 1024, 1 thread, M=16: tiles 1.34 ms, int4 1.59, i4mm 1.62; M=32: 1.41 vs 2.98):
# above I4MM_MAX_M rows an affine weight can go straight to the tiles. Opt-in
# (`MLXR_CPU_DEQ_ROWS=1`, read per call): the tiles round each weight to bf16 as MLX's
# dequantization does (bf16(bf16(q * s) + b)) where torch's int4 kernel and i4mm compute with
# the unrounded q * s + b in float32, so prompts of 17-159 rows would prefill with other
# weights than the decode steps that follow (bf16 prefill-then-decode vs a full recompute of
# the tiny hybrid MoE models: 0.19 of the logit range, tests/test_parity_hybrid.py; with
# i4mm on the tiles' weights too, `i4_pairs` "tiles", it passes, but decode is 2.7x slower:
# docs/perf.md "Session 21: i4mm on the exact weights"); by default the tiles start where
# they did before (I4_MAX_M), where i4deq gives the torch-built tiles' values.
# Weights repacked from ONNX MatMulNBits (`QuantWeight.tiles_early`, set by mlxr.onnx.load)
# take the tiles from 17 rows by default: their reference is onnxruntime, whose float32
# (q - zp) * s neither path reproduces in bf16; dense decoders only (no expert routing to
# amplify the prefill / decode difference); env "0" keeps them at I4_MAX_M too.
I4_MAX_M_DEQ = 16


def i4_max_m(qw) -> int:
    """Rows of x from which `linear` takes the tiles instead of the int4 kernel."""
    env = os.environ.get("MLXR_CPU_DEQ_ROWS", "")
    if (env == "1" or (qw.tiles_early and env != "0")) and deq_serves(qw):
        return I4_MAX_M_DEQ
    return I4_MAX_M[qw.planes]


SMALL_BYTES = 8 << 20
TILE_BYTES = 4 << 20


# Formats the compiled kernel serves, and the rows of x up to which it beats the storage
# torch's path reads (docs/perf.md "CPU decode", 6144 x 1024, 1 thread, kernel vs torch µs:
# mxfp4 M=1 222 vs 646, M=4 619 vs 1040, M=16 2463 vs 4017 (torch: two int4 planes, 1 B per
# weight); nvfp4 M=1 348 vs 1256, M=4 755 vs 857, M=16 2683 vs 1260 (torch: the bf16 dense
# copy). Not served by qmm, measured: affine 4-bit (M=1 321 vs 255: torch's int4 kernel reads
# the same 0.5 B per weight and is faster here), affine 8-bit (M=1 541 vs 658 but M=4 1419 vs
# 984: not worth keeping the words beside the int4 planes, +1 B per weight); the affine widths
# get `i4mm` over the int4 copy instead (`i4_kernel_for`). mxfp8 (E4M3 through a gather: 2659
# vs 1179).
KERNEL_ROWS = {("mxfp4", 4): 16, ("nvfp4", 4): 4}


def kernel_serves(spec, in_features: int, compute_dtype: torch.dtype) -> bool:
    """Whether a CPU weight of this format gets the compiled kernel (beside torch's storage:
    the kernel reads MLX's words, kept for it)."""
    return (compute_dtype == torch.bfloat16 and (spec.mode, spec.bits) in KERNEL_ROWS
            and native.enabled()
            and native.fast_matmul(spec.mode, spec.bits, spec.group_size, in_features))


def kernel_for(qw, words: Tensor) -> native.QMatmul:
    """The compiled kernel bound to a weight's MLX words (`kernel_serves`)."""
    gm = 1.0
    if qw.global_scale is not None:  # nvfp4: as `fp.fp_scales` forms it, in float32
        gm = float(qw.global_scale.to(torch.float32) / 2688.0)
    return native.QMatmul(words.contiguous(), qw.scales, qw.biases, qw.spec.mode, qw.spec.bits,
                          qw.spec.group_size, qw.in_features, gm, qw.compute_dtype,
                          KERNEL_ROWS[(qw.spec.mode, qw.spec.bits)])


# Rows of x up to which `native.i4mm` (over torch's int4 copy) serves affine weights: it beat
# torch's int4 kernel on the same copy at every M measured up to 16 (docs/perf.md, "Session
# 20": qwen3-0.6b's 6144 x 1024 M=1 ... us).
I4MM_MAX_M = 16


def i4_pairs() -> str:
    """i4mm's weights (`native.i4mm`'s `pairs`), env `MLXR_CPU_I4_PAIRS` read at load:
    "zeros" (the default: the int4 copy's zeros, torch's int4 kernel's weights), "biases"
    (MLX's scales and biases, w = q * s + b; +4 B per group of a row) or "tiles" (w =
    bf16(bf16(q * s) + b): the prefill tiles' and mlx's CPU backend's weights; the same
    bytes): docs/perf.md, "Session 21: i4mm on the exact weights"."""
    mode = os.environ.get("MLXR_CPU_I4_PAIRS", "zeros")
    return mode if mode in native.I4_PAIRS else "zeros"


class SplitI4:
    """`i4mm` over a 4-bit weight's whole 64-row blocks, read in place in its int4 copy
    (`int4pack.head_blocks`), and torch's int4 kernel over the last N % 64 rows, outputs side
    by side. For the N % 64 != 0 matrices that i4mm cannot read whole, such as qwen3_5's
    DeltaNet in_proj (8224 = 128 x 64 + 32 rows: [qkv | z | b | a]); 0.8B shape, 1 thread:
    642 -> ~510 us per call (docs/perf.md, session 22). `words`: what it holds beside the
    weight's storage (the blocks' zeros laid out for i4mm, the tail's own int4 copy and
    zeros: 1/16 of the int4 copy's bytes), one buffer that the three tensors view."""

    def __init__(self, qw, codes_tail: Tensor):
        n, k, g = qw.out_features, qw.in_features, qw.spec.group_size
        n64 = n // 64 * 64
        parts = (qw.i4_sz[:, :n64].contiguous(), int4pack.pack(codes_tail),
                 qw.i4_sz[:, n64:].contiguous())
        self.words = torch.cat([t.reshape(-1).view(torch.uint8) for t in parts])
        views, at = [], 0
        for t in parts:
            nb = t.numel() * t.element_size()
            views.append(self.words[at:at + nb].view(t.dtype).view(t.shape))
            at += nb
        self.head = native.I4Matmul(qw.i4.reshape(-1)[:n64 * k // 2].view(n64 // 64, k, 32),
                                    views[0], g, 1, I4MM_MAX_M)
        self.tail, self.g, self.max_m = (views[1], views[2]), g, I4MM_MAX_M

    def __call__(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        tail = int4pack.mm(x, self.tail[0], self.g, self.tail[1])
        return torch.cat((self.head(x), tail), dim=1)


def i4_kernel_for(qw) -> native.I4Matmul | SplitI4 | None:
    """The compiled GEMV bound to an affine weight's torch int4 copy (`qw.i4`, with its zeros
    `i4_sz` or its planes' own scales and biases: `i4_pairs`), or None where it cannot read
    it (`native.i4mm_serves`: not built, another packing); N % 64 != 0: `SplitI4` for 4-bit
    weights whose MLX words are at hand (zeros pairs), else None."""
    if qw.out_features % 64 and qw.out_features > 64 and i4_pairs() == "zeros":
        if (qw.planes == 1 and qw.spec.bits == 4 and qw.packed is not None
                and int4pack.head_blocks()
                and native.i4mm_serves(qw.out_features // 64 * 64, qw.in_features,
                                       qw.spec.group_size)):
            n64 = qw.out_features // 64 * 64
            return SplitI4(qw, unpack_codes(qw.packed[n64:], 4, qw.in_features))
        return None
    if not native.i4mm_serves(qw.out_features, qw.in_features * qw.planes, qw.spec.group_size):
        return None
    g, mode = qw.spec.group_size, i4_pairs()
    if mode == "tiles" and not deq_serves(qw):  # the tiles' weights come from dequant_rows
        mode = "zeros"
    if mode == "zeros":
        return native.I4Matmul(qw.i4, qw.i4_sz, g, qw.planes, I4MM_MAX_M)
    sb = int4pack.scales_and_biases(*plane_scales(qw.scales, qw.biases, qw.spec.bits))
    return native.I4Matmul(qw.i4, sb, g, qw.planes, I4MM_MAX_M, mode)


def linear(qw, x: Tensor) -> Tensor:
    if qw.ckern is not None and x.shape[0] <= qw.ckern.max_m and native.enabled():
        return qw.ckern(x)
    if qw.dense is not None:  # nvfp4 / mxfp8: the weight dequantized once, at load
        return x @ qw.dense.t()
    if qw.i4 is not None and x.shape[0] < i4_max_m(qw):  # two planes read x twice
        x = x.contiguous() if qw.planes == 1 else x.repeat(1, qw.planes)
        return int4pack.mm(x, qw.i4, qw.spec.group_size, qw.i4_sz)
    return tiled_linear(qw, x)


def deq_serves(qw) -> bool:
    """Whether the tiles come from mlxr's compiled dequant (`native.i4deq`: the int4 copy's
    codes, the weight's own bf16 scales and biases, `dequant_rows`' values bit for bit; ~10x
    faster than torch's decode + two bf16 ops, docs/perf.md "Session 21"). Env
    `MLXR_CPU_DEQ=0` keeps torch's (read per call, for the A/B)."""
    return (qw.i4 is not None and qw.planes == 1 and qw.spec.mode == "affine"
            and qw.dense is None and qw.out_features % 64 == 0
            and os.environ.get("MLXR_CPU_DEQ", "") != "0"
            and native.i4deq_serves(qw.scales, qw.biases, qw.spec.group_size,
                                    qw.compute_dtype))


def _tile(qw, r0: int, r1: int, fast: bool) -> Tensor:
    """Dequantized rows r0..r1 [r1 - r0, in] in the compute dtype."""
    if not fast:
        return qw.dequant_rows(slice(r0, r1))
    a0, a1 = r0 // 64 * 64, -(-r1 // 64) * 64
    w = native.i4deq(qw.i4, qw.scales, qw.biases, qw.spec.group_size, a0, a1)
    return w[r0 - a0: r1 - a0]


def tiled_linear(qw, x: Tensor) -> Tensor:
    cd = qw.compute_dtype
    isz = torch.empty((), dtype=cd).element_size()
    n_out = qw.out_features
    fast = deq_serves(qw)
    if n_out * qw.in_features * isz <= SMALL_BYTES and not qw.exact:
        return x @ _tile(qw, 0, n_out, fast).t()
    # exact mode: fp32 tiles of ~TILE_BYTES regardless of matrix size (correctness > speed)
    step = qw.tile_rows(isz, TILE_BYTES)
    if step >= n_out:
        return x @ _tile(qw, 0, n_out, fast).t()
    y = torch.empty(x.shape[0], n_out, dtype=cd, device=x.device)
    for r0 in range(0, n_out, step):
        r1 = min(r0 + step, n_out)
        y[:, r0:r1] = x @ _tile(qw, r0, r1, fast).t()
    return y
