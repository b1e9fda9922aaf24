"""Block-quantized ONNX weights -> MLX affine layout (what mlxr's quantized matmuls take).

MatMulNBits stores W[n, k] = (q - zp) * scale with q packed LSB first in bytes
B [N, k_blocks, block_size*bits/8]; MLX affine stores W = q * scale + bias with q packed LSB
first in little-endian uint32 words [N, K*bits/32]. The codes are therefore the same bits: the
bytes of one row, read as uint32, are MLX's words (no unpacking), and the zero point moves into
MLX's per-group bias: bias = -scale * zp. GatherBlockQuantized tables [V, H*bits/8] are the
same layout with the gathered axis as rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import ModelFormatError


MAX_GROUP = 128  # mlxr's largest affine group


def group_size(block: int) -> int:
    """The MLX group size a block of `block` elements repacks to."""
    return min(block, MAX_GROUP)


class AffineWeight(NamedTuple):
    """MLX affine tensors of one [out, in] weight: words int32 [out, in*bits/32] (uint32 bits),
    scales and biases float32 [out, in/group]."""

    words: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor

    def rows(self, a: int, b: int) -> AffineWeight:
        return AffineWeight(self.words[a:b], self.scales[a:b], self.biases[a:b])


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Unsigned codes [rows, count] from bytes [rows, ceil(count*bits/8)], LSB first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, bytes, 8/bits]
    return codes.reshape(packed.shape[0], -1)[:, :count]


def block_affine(data: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 bits: int, block: int, default_zp: float, what: str) -> AffineWeight:
    """data uint8 [rows, cols*bits/8] (codes LSB first), scales [rows, cols/block], zero points
    None (every block `default_zp`), uint8 packed [rows, ceil(blocks*bits/8)] or float
    [rows, blocks] -> AffineWeight. `cols` is a multiple of `block` (the claim checks it)."""
    rows = data.shape[0]
    data = data.reshape(rows, -1).contiguous()
    if (data.shape[1] * 8) % 32:
        raise ModelFormatError(f"{what}: rows of {data.shape[1]} bytes do not fill uint32 words")
    blocks = data.shape[1] * 8 // bits // block
    zp_size = None if zero_points is None else rows * (
        -(-blocks * bits // 8) if zero_points.dtype == torch.uint8 else blocks)
    for part, t, size in (("scales", scales, rows * blocks), ("zero points", zero_points, zp_size)):
        if t is not None and t.numel() != size:  # another initializer wired in
            raise ModelFormatError(f"{what}: {part} {list(t.shape)} do not fit {rows} rows of "
                                   f"{blocks} blocks")
    s = scales.reshape(rows, blocks).float()
    if zero_points is None:
        bias = s * -default_zp
    elif zero_points.dtype == torch.uint8:
        bias = -s * unpack_codes(zero_points.reshape(rows, -1), bits, blocks)
    else:
        bias = -s * zero_points.reshape(rows, blocks).float()
    words = data.view(torch.int32)  # little-endian bytes -> uint32 words, same bit order
    if block > MAX_GROUP:  # one block = block/128 MLX groups sharing its scale and bias
        s, bias = (t.repeat_interleave(block // MAX_GROUP, dim=1) for t in (s, bias))
    return AffineWeight(words, s.contiguous(), bias.contiguous())


def signed_int4_to_unsigned(data: torch.Tensor) -> torch.Tensor:
    """Packed two's-complement int4 bytes -> offset-binary codes q + 8 (flip each nibble's
    top bit), so the table reads as unsigned codes with zero point 8."""
    return data ^ 0x88
