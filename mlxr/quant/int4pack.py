"""torch's packed-int4 CPU matmul (`_weight_int4pack_mm_for_cpu`) for mlx affine 4-bit weights.

The kernel computes `x @ ((q - 8) * scale + zero)^T` per group, so mlx's `w = s*q + b` maps to
`zero = b + 8*s` (rounded to bf16: the one extra rounding of this path). Constraints measured on
torch 2.13 CPU: x/scales bf16, N (out_features) divisible by 16, group size 32/64/128/256, K a
multiple of the group size.

The packed layout is an implementation detail of torch that follows the CPU's ISA. For N % 64
== 0 the AVX-512 build uses bytes `[N/64, K, 32]` (low nibble = row r, high nibble = row r + 32
of each 64-row block), the AVX2 build `[N/32, K, 16]` (rows r and r + 16 of 32-row blocks). A
probe finds the block once (`block`); when one of them holds, codes are decoded from the packed
tensor (for prefill tiles and embedding rows) instead of keeping a second copy.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

INT4_GROUPS = (32, 64, 128)


def available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_convert_weight_to_int4pack_for_cpu")


def supported(out_features: int, in_features: int, group_size: int) -> bool:
    return (available() and out_features % 16 == 0 and group_size in INT4_GROUPS
            and in_features % group_size == 0)


def pack(codes: Tensor) -> Tensor:
    """codes uint8/int [N, K] in 0..15 -> torch's packed int4 CPU tensor."""
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def scales_and_zeros(scales: Tensor, biases: Tensor) -> Tensor:
    """mlx scales/biases [N, K/G] -> [K/G, N, 2] bf16 (scale, zero = bias + 8*scale)."""
    s = scales.to(torch.float32)
    z = biases.to(torch.float32) + 8.0 * s
    return torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def scales_and_biases(scales: Tensor, biases: Tensor) -> Tensor:
    """mlx scales/biases [N, K/G] -> [K/G, N, 2] bf16 (scale, bias): `scales_and_zeros`'
    layout with MLX's own values (exact where they are bf16), what `native.i4mm` reads."""
    return torch.stack([scales, biases], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def mm(x: Tensor, packed: Tensor, group_size: int, sz: Tensor) -> Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)


def _decode_blocks(packed: Tensor, k: int, b0: int, b1: int, blk: int) -> Tensor:
    """Codes uint8 [(b1 - b0) * blk, K] of blocks b0..b1 of `blk` rows."""
    # the bytes transposed first (half the data of the codes), then both nibbles: 2.2x faster
    # than splitting, then transposing the codes (3072 x 1024 on the 2-core box: 0.64 vs 1.44 ms)
    p = packed.view(-1, k, blk // 2)[b0:b1].transpose(1, 2).contiguous()  # [nb, blk/2, K]
    return torch.cat([p & 15, p >> 4], dim=1).reshape((b1 - b0) * blk, k)


def _decode_planes(packed: Tensor, k: int, b0: int, b1: int, blk: int, combine) -> Tensor:
    """Codes [(b1 - b0) * blk, K] of blocks b0..b1 of a two-plane copy (codes [N, 2K]: the
    high plane over the low one), combine(high nibbles, low nibbles) per code, taken from the
    bytes directly: an 8-bit 3072 x 1024 slice in 1.21 ms against 1.93 for decoding [N, 2K]
    and then combining."""
    p = packed.view(-1, 2 * k, blk // 2)[b0:b1]
    hi, lo = p[:, :k].transpose(1, 2), p[:, k:].transpose(1, 2)  # [nb, blk/2, K] each
    both = torch.cat([combine(hi & 15, lo & 15), combine(hi >> 4, lo >> 4)], dim=1)
    return both.reshape((b1 - b0) * blk, k)


def _gather(packed: Tensor, k: int, ids: Tensor, blk: int) -> Tensor:
    p = packed.view(-1, k, blk // 2)
    c = ids % blk
    b = p[ids // blk, :, c % (blk // 2)]  # [n, K]
    return (b >> (4 * (c >= blk // 2).to(torch.uint8)).unsqueeze(1)) & 15


@functools.cache
def block() -> int:
    """Rows per block of the layout this torch build packs (N % 64 == 0): 64 or 32, or 0 if
    it is neither (then the caller keeps its own copy of the codes)."""
    if not available():
        return 0
    try:
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (128, 96), generator=g, dtype=torch.uint8)
        p = pack(codes)
        ids = torch.tensor([0, 15, 16, 31, 32, 63, 64, 100, 127])
        if p.dtype != torch.uint8 or p.numel() * 2 != codes.numel():
            return 0
        return next((blk for blk in (64, 32)
                     if torch.equal(_decode_blocks(p, 96, 0, 128 // blk, blk), codes)
                     and torch.equal(_gather(p, 96, ids, blk), codes[ids])), 0)
    except Exception:  # noqa: BLE001 - any failure means "don't rely on the layout"
        return 0


@functools.cache
def head_blocks() -> bool:
    """Whether the copy of N % 64 != 0 rows starts with the bytes of its whole 64-row blocks
    as `pack` lays out those rows alone (so `i4mm` can read them in place), probed once."""
    if block() != 64:
        return False
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (160, 64), generator=g, dtype=torch.uint8)
    p, head = pack(codes).reshape(-1), pack(codes[:128]).reshape(-1)
    return p.numel() * 2 == codes.numel() and torch.equal(p[:head.numel()], head)


def layout_ok() -> bool:
    """True if this torch build packs N % 64 == 0 weights in a layout `decode_rows` reads."""
    return block() > 0


def decode_rows(packed: Tensor, k: int, r0: int, r1: int) -> Tensor:
    """Codes uint8 [r1-r0, K] of rows r0..r1 (both multiples of 64)."""
    blk = block()
    return _decode_blocks(packed, k, r0 // blk, r1 // blk, blk)


def decode_rows_planes(packed: Tensor, k: int, r0: int, r1: int, combine) -> Tensor:
    """`decode_rows` of a two-plane copy ([N, 2K] codes), the planes' nibbles of each code
    merged by combine(high, low) (uint8 tensors): [r1 - r0, K]."""
    blk = block()
    return _decode_planes(packed, k, r0 // blk, r1 // blk, blk, combine)


def decode_gather(packed: Tensor, k: int, ids: Tensor) -> Tensor:
    """Codes uint8 [len(ids), K] of arbitrary rows."""
    return _gather(packed, k, ids, block())
