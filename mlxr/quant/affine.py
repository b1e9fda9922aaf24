"""Affine (mlx `mode="affine"`) bit unpacking and reference dequantization.

Layout (docs/mlx-formats.md §3.2): each row of the packed uint32 weight is a little-endian bit
stream; element j is stream bits [j*bits, j*bits+bits), LSB first. 3/5/6-bit codes straddle
words (and bytes), so we unpack from the row's bytes: 8 codes always fill exactly `bits` bytes.

Torch cannot right-shift uint32, so nothing here shifts uint32: bytes are widened to
int16/int32/int64 first (shifts stay within non-negative values, masks do the rest).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
# widths whose decode runs the 4-bit kernels (CUDA: decode_gemv_tc; CPU: torch's int4 kernel) over
# nibble planes (`planes`)
PLANE_BITS = (2, 3, 5, 6, 8)

_SHIFT_CACHE: dict[tuple[int, str], Tensor] = {}


def _as_int32(weight: Tensor) -> Tensor:
    if weight.dtype == torch.int32:
        return weight
    if weight.dtype == torch.uint32:
        return weight.view(torch.int32)
    raise TypeError(f"packed weight must be uint32/int32, got {weight.dtype}")


def _shifts(bits: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (bits, str(device))
    if key not in _SHIFT_CACHE:
        _SHIFT_CACHE[key] = torch.arange(n, device=device, dtype=dtype) * bits
    return _SHIFT_CACHE[key]


def unpack_codes(weight: Tensor, bits: int, in_features: int) -> Tensor:
    """Packed weight [..., out, in*bits/32] (int32 or uint32) -> codes uint8 [..., out, in].

    Works on the little-endian bytes of each row (= the bit stream): 8 codes occupy exactly
    `bits` bytes, so every width is "combine `bits` bytes into one integer, shift, mask".
    4 and 2 bits use a widen-and-mask trick whose result bytes are the codes directly.
    """
    w = _as_int32(weight)
    if in_features % 32 or w.shape[-1] * 32 != in_features * bits:
        raise ValueError(f"packed shape {tuple(w.shape)} does not hold {in_features} x {bits}-bit")
    lead = w.shape[:-1]
    b = w.contiguous().view(torch.uint8)  # [..., in*bits/8], little-endian byte stream
    if bits == 8:
        return b.clone()
    if bits == 4:  # int16 lane = byte | byte << 4, masked: low byte = lo nibble, high = hi
        x = b.to(torch.int16)
        return ((x | (x << 4)) & 0x0F0F).view(torch.uint8).reshape(*lead, in_features)
    if bits == 2:
        x = b.to(torch.int32)
        x = (x | (x << 6) | (x << 12) | (x << 18)) & 0x03030303
        return x.view(torch.uint8).reshape(*lead, in_features)
    # 3/5/6 bits: 8 codes per `bits` bytes (6-bit: 4 codes per 3 bytes); combine those bytes
    # into one integer (int32 holds 24 bits; 5-bit needs 40 -> int64), then shift and mask.
    nbytes, ncodes = (3, 4) if bits == 6 else (bits, 8)
    dt = torch.int32 if nbytes * 8 < 31 else torch.int64
    g = b.reshape(*lead, in_features // ncodes, nbytes).to(dt)
    v = g[..., 0].clone()
    for k in range(1, nbytes):
        v |= g[..., k] << (8 * k)
    q = (v.unsqueeze(-1) >> _shifts(bits, ncodes, dt, w.device)) & ((1 << bits) - 1)
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


def planes_on() -> bool:
    """Env `MLXR_PLANES=0` (read at load) keeps 2/3/5/6/8-bit weights off the nibble planes
    (their previous decode kernels, for A/B runs or to save the copy's memory)."""
    return os.environ.get("MLXR_PLANES", "") != "0"


def planes(codes: Tensor, scales: Tensor, biases: Tensor, bits: int
           ) -> tuple[Tensor, Tensor, Tensor]:
    """b-bit affine codes [N, K] with scales, biases [N, K/G] -> nibble codes [N, P K] and
    scales, biases [N, P K/G] whose 4-bit GEMV over x repeated P times is the b-bit GEMV
    (`decode_gemv_tc.q4tc(planes=P)` on CUDA, torch's int4 kernel over [x, x] on the CPU).
    b <= 4 (P = 1): the codes as they are (a nibble holds them). b = 5, 6, 8 (P = 2):
    q = 2^(b-4) h + l, plane 0 holds h (4 bits) with scales 2^(b-4) s and the
    biases, plane 1 holds l (b - 4 bits) with scales s and zero biases, so
    s' h . x + b' sum(x) + s l . x = s q . x + b sum(x), mlx-lm's qmv sums (fp32 order aside).
    A power-of-two scale is exact in a float format; a scale that overflows there (no real
    checkpoint has one) raises ValueError, so the caller keeps its other decode path."""
    s, b = plane_scales(scales, biases, bits)
    if bits <= 4:
        return codes, s, b
    sh = bits - 4
    q = codes.to(torch.int32)
    return torch.cat([q >> sh, q & ((1 << sh) - 1)], dim=1), s, b


def plane_scales(scales: Tensor, biases: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """`planes`' scales and biases [N, P K/G] (without the codes). Raises ValueError where
    plane 0's scale overflows."""
    if bits <= 4:
        return scales, biases
    sh = bits - 4
    s_hi = scales * (1 << sh)
    if not bool(torch.isfinite(s_hi).all()):
        raise ValueError(f"planes: scales x {1 << sh} overflow {scales.dtype}")
    return torch.cat([s_hi, scales], dim=1), torch.cat([biases, torch.zeros_like(biases)], dim=1)


def merge_planes(hi: Tensor, lo: Tensor, bits: int) -> Tensor:
    """The b-bit codes (b = 5, 6, 8) from `planes`' high and low nibble planes: 2^(b-4) h + l."""
    return (hi << (bits - 4)) | lo
