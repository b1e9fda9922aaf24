"""Affine (mlx `mode="affine"`) bit unpacking and reference dequantization.

Layout (docs/mlx-formats.md §3.2): each row of the packed uint32 weight is a little-endian bit
stream; element j is stream bits [j*bits, j*bits+bits), LSB first. 3/5/6-bit codes straddle
words, so we treat each run of `bits` words (= 32 elements) as one chunk.

Torch cannot right-shift uint32, so everything works on int32 views (arithmetic shift + mask).
"""

from __future__ import annotations

import torch
from torch import Tensor

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)

_CHUNK_CACHE: dict[tuple[int, str], tuple[Tensor, Tensor, Tensor]] = {}


def _as_int32(weight: Tensor) -> Tensor:
    if weight.dtype == torch.int32:
        return weight
    if weight.dtype == torch.uint32:
        return weight.view(torch.int32)
    raise TypeError(f"packed weight must be uint32/int32, got {weight.dtype}")


def _chunk_index(bits: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    key = (bits, str(device))
    if key not in _CHUNK_CACHE:
        o = torch.arange(32, device=device) * bits  # bit offset of each element in its chunk
        w0 = o >> 5
        w1 = (w0 + 1).clamp(max=bits - 1)
        _CHUNK_CACHE[key] = (w0, w1, (o & 31).to(torch.int64))
    return _CHUNK_CACHE[key]


def unpack_codes(weight: Tensor, bits: int, in_features: int) -> Tensor:
    """Packed weight [..., out, in*bits/32] (int32 or uint32) -> codes uint8 [..., out, in]."""
    w = _as_int32(weight)
    if in_features % 32 or w.shape[-1] * 32 != in_features * bits:
        raise ValueError(f"packed shape {tuple(w.shape)} does not hold {in_features} x {bits}-bit")
    lead = w.shape[:-1]
    mask = (1 << bits) - 1
    if 32 % bits == 0:  # 2/4/8 bits: codes never straddle words
        per = 32 // bits
        shifts = torch.arange(per, device=w.device, dtype=torch.int32) * bits
        q = (w.unsqueeze(-1) >> shifts) & mask
        return q.to(torch.uint8).reshape(*lead, in_features)
    # 3/5/6 bits: 32 elements per `bits` words; combine the two words an element may touch.
    w0i, w1i, sh = _chunk_index(bits, w.device)
    c = w.reshape(*lead, in_features // 32, bits).to(torch.int64) & 0xFFFFFFFF
    both = c[..., w0i] | (c[..., w1i] << 32)
    q = (both >> sh) & mask
    return q.to(torch.uint8).reshape(*lead, in_features)


def affine_dequantize_codes(
    q: Tensor, scales: Tensor, biases: Tensor, group_size: int, out_dtype: torch.dtype | None = None
) -> Tensor:
    """codes [..., out, in] -> `R(R(q*s)+b)` where R rounds to the scale dtype (mlx CPU rounding).

    Arithmetic is fp32; with fp32 scales both roundings are plain fp32 roundings. Result is cast
    to `out_dtype` (default: scales dtype) at the end.
    """
    sd = scales.dtype
    lead = q.shape[:-1]
    n = q.shape[-1]
    qf = q.reshape(*lead, n // group_size, group_size).to(torch.float32)
    s = scales.to(torch.float32).unsqueeze(-1)
    b = biases.to(torch.float32).unsqueeze(-1)
    t = qf * s
    if sd != torch.float32:
        t = t.to(sd).to(torch.float32)
    t = t + b
    out = t.to(sd).reshape(*lead, n)
    if out_dtype is not None and out_dtype != sd:
        out = out.to(out_dtype)
    return out


def affine_dequantize(
    weight: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    in_features = scales.shape[-1] * group_size
    q = unpack_codes(weight, bits, in_features)
    return affine_dequantize_codes(q, scales, biases, group_size, out_dtype)
