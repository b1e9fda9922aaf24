"""The load-time copies the CUDA decode kernels read (`mlxr.quant.cuda` routes the calls and,
in `build_copies`, picks which copies a weight gets): each built once per weight from its MLX
words, beside them or in their place (`QuantWeight.drop_words`).

- `q4tc_pack`: affine 4-bit words in `decode_gemv_tc`'s lane order (an MLP's gate_up in
  `glu_rows` order: `glu_order`) and (scale, bias) pairs;
- `planes_pack`: the nibble planes of affine 2/3/5/6/8-bit weights, in the same layout;
- `fp4_tc_pack`: mxfp4 / nvfp4 E2M1 codes with each code's bits moved (`fp4_bits`);
- `fp8_tc_pack`: mxfp8 E4M3 codes, two words per mma step (`fp8_words`);
- `q4gemv_pack`: `decode_gemv_q4`'s repack; `tinygemm_pack`: torch's int4 layout;
- `decode_copy_bytes`: what a load will build for a weight, for the loader's GPU budget.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import int4pack
from .affine import PLANE_BITS, planes_on
from .fp import nibble_planes

INNER_K_TILES = 8  # tinygemm's inner K tiles (its int4 layout)
FP4_TC_MODES = ("mxfp4", "nvfp4")  # E2M1 codes: q4tc's fp4 copy
COPY_MODES = ("affine", *FP4_TC_MODES, "mxfp8")  # whose q4tc copy can replace the words


def fp4_tc_on(spec) -> bool:
    """mxfp4 / nvfp4 get q4tc's fp4 copy at load unless env `MLXR_FP4_TC=0` (A/B runs)."""
    return spec.mode in FP4_TC_MODES and os.environ.get("MLXR_FP4_TC", "") != "0"


def fp8_tc_on(spec) -> bool:
    """mxfp8 gets q4tc's fp8 copy at load unless env `MLXR_FP8_TC=0` (A/B runs)."""
    return spec.mode == "mxfp8" and os.environ.get("MLXR_FP8_TC", "") != "0"


def tinygemm_pack(packed: Tensor, scales: Tensor, biases: Tensor) -> tuple[Tensor, Tensor]:
    """mlx 4-bit words [N, K/8] -> (torch int4pack tensor, scales_and_zeros [K/G, N, 2])."""
    b = packed.contiguous().view(torch.uint8)  # element 2j in the low nibble of byte j
    swapped = ((b << 4) | (b >> 4)).contiguous()  # torch wants element 2j in the high nibble
    w = torch._convert_weight_to_int4pack(swapped, INNER_K_TILES)
    return w, int4pack.scales_and_zeros(scales, biases)  # same (q - 8) * s + z form as the CPU



def q4tc_pack(packed: Tensor, scales: Tensor, biases: Tensor, sb: Tensor | None = None,
              glu: bool = False) -> tuple[Tensor, Tensor]:
    """The load-time copies decode_gemv_tc reads: lane-ordered words, (scale, bias) pairs (`sb`
    where the weight already has q4gemv's: the same pairs). glu: the rows stack an MLP's gate
    over its up, and both copies take `decode_gemv_tc.glu_rows`' order (so `gated` can run)."""
    from ..ops.matmul import decode_gemv_q4, decode_gemv_tc

    if glu:
        if sb is not None:
            raise ValueError("q4tc_pack: a glu copy cannot share q4gemv's pairs")
        packed, scales, biases = glu_order(packed, scales, biases)
    return decode_gemv_tc.repack(packed), (decode_gemv_q4.pair_scales(scales, biases)
                                        if sb is None else sb)


def glu_order(packed: Tensor, scales: Tensor, biases: Tensor | None
               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """A stacked [gate; up] weight's rows in `decode_gemv_tc.glu_rows`' order."""
    from ..ops.matmul import decode_gemv_tc

    perm = decode_gemv_tc.glu_rows(packed.shape[0]).to(packed.device)
    return packed[perm], scales[perm], None if biases is None else biases[perm]



def fp4_tc_pack(qw, glu: bool = False, chunk_rows: int = 4096
                ) -> tuple[Tensor, Tensor, float | None] | None:
    """q4tc's fp4 copy of an `fp4_tc_supported` weight: (`decode_gemv_tc.fp4_bits` of the
    lane-ordered words, pairs of each group's E8M0 / E4M3 scale in bf16 (exact) and 0, the
    global scale / 2688 as a float or None: `fp.fp_scales`' factor, which the kernel applies
    to its fp32 sums), built in row slices (bounded scratch); glu as `q4tc_pack`. None where
    a scale is not finite (the formats' NaN codes)."""
    from ..ops.matmul import decode_gemv_tc

    packed, scales = qw.packed, qw.scales
    if glu:
        packed, scales, _ = glu_order(packed, scales, None)
    sb = _scale_pairs(scales, qw.spec.mode)
    if sb is None:
        return None
    n, k = qw.out_features, qw.in_features
    words = torch.empty(n // 16, 2 * k, dtype=torch.int32, device=packed.device)
    for r in range(0, n, chunk_rows):
        words[r // 16:(r + chunk_rows) // 16] = decode_gemv_tc.fp4_bits(
            decode_gemv_tc.repack(packed[r:r + chunk_rows]))
    gs = None if qw.global_scale is None else float(qw.global_scale.float() / 2688.0)
    return words, sb, gs


def _scale_pairs(scales: Tensor, mode: str) -> Tensor | None:
    """q4tc's pairs for an fp mode's scale bytes: (the scale in bf16, exact, and 0); None where
    one is not finite or not exact in bf16."""
    from ..ops.matmul import decode_gemv_q4
    from .fp import fp_scales

    s = fp_scales(scales, mode, None)
    sb = s.to(torch.bfloat16)
    if not bool(torch.isfinite(sb).all()) or not torch.equal(sb.float(), s.float()):
        return None
    return decode_gemv_q4.pair_scales(sb, torch.zeros_like(sb))


def fp8_tc_pack(qw, glu: bool = False, chunk_rows: int = 4096) -> tuple[Tensor, Tensor] | None:
    """q4tc's fp8 copy of an `fp8_tc_supported` (mxfp8) weight: (`decode_gemv_tc.fp8_words` of its
    E4M3 codes, the E8M0 scales' pairs as `fp4_tc_pack`'s); glu as `q4tc_pack`. None where a
    code is NaN (0x7F / 0xFF: the copy's values are finite; the generic kernels keep mlx's NaN)
    or a scale is not finite."""
    from ..ops.matmul import decode_gemv_tc

    packed, scales = qw.packed, qw.scales
    if glu:
        packed, scales, _ = glu_order(packed, scales, None)
    codes = packed.contiguous().view(torch.uint8)  # [N, K]: code k at byte k of its row
    sb = _scale_pairs(scales, qw.spec.mode)
    if sb is None or bool(((codes & 0x7F) == 0x7F).any()):
        return None
    return decode_gemv_tc.fp8_words(codes, chunk_rows), sb



def plane_count(spec) -> int:
    """Nibble planes of a weight's q4tc copy: 2 for 5/6/8-bit affine, else 1."""
    return 2 if spec.mode == "affine" and spec.bits > 4 else 1



def decode_copy_bytes(spec, out: int, inp: int) -> int:
    """Bytes of the decode copy a CUDA load builds for a weight of this spec and shape: words
    at 0.5 B per code and plane and a 4-byte (scale, bias) pair per group and plane (q4tc's
    or q4gemv's at 4-bit, the nibble planes at 2/3/5/6/8-bit, mxfp4's and nvfp4's fp4 copy;
    mxfp8's fp8 copy: 1 B per code)."""
    if fp8_tc_on(spec):
        return out * inp + out * (inp // spec.group_size) * 4
    if not ((spec.mode == "affine" and (spec.bits == 4 or (spec.bits in PLANE_BITS
                                                            and planes_on())))
            or fp4_tc_on(spec)):
        return 0
    return plane_count(spec) * (out * inp // 2 + out * (inp // spec.group_size) * 4)



def planes_pack(qw, glu: bool = False, chunk_rows: int = 4096
                ) -> tuple[Tensor, Tensor, int] | None:
    """q4tc's copy of a `planes_supported` weight: (lane-ordered words of its nibble planes,
    their (scale, bias) pairs in the compute dtype, planes), built in row slices (an 8-bit LM
    head's codes would otherwise need ~4x its size of scratch); glu as `q4tc_pack`. None
    where a plane's scale overflows the dtype (`planes`); the pairs are in the scales' dtype,
    the compute dtype (`planes_supported`)."""
    from ..ops.matmul import decode_gemv_q4
    from ..ops.matmul.decode_gemv_tc_layout import repack_codes

    packed, scales, biases = qw.packed, qw.scales, qw.biases
    if glu:
        packed, scales, biases = glu_order(packed, scales, biases)
    sp, n, k = qw.spec, qw.out_features, qw.in_features
    words = torch.empty(n // 16, 2 * plane_count(sp) * k, dtype=torch.int32,
                        device=packed.device)
    pairs = []
    try:
        for r in range(0, n, chunk_rows):
            rows = slice(r, r + chunk_rows)
            c, s, b = nibble_planes(sp, packed[rows], scales[rows], biases[rows], k)
            words[r // 16:(r + c.shape[0]) // 16] = repack_codes(c)
            pairs.append(decode_gemv_q4.pair_scales(s, b))
    except ValueError:
        return None
    return words, torch.cat(pairs), plane_count(sp)



def q4gemv_pack(packed: Tensor, scales: Tensor, biases: Tensor) -> tuple[Tensor, Tensor]:
    """The load-time copies decode_gemv_q4 reads: repacked words, (scale, bias) pairs."""
    from ..ops.matmul import decode_gemv_q4

    return decode_gemv_q4.repack(packed), decode_gemv_q4.pair_scales(scales, biases)
