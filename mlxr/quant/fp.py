"""Floating-point quantization modes (mxfp4, mxfp8, nvfp4): code and scale decoding.

docs/mlx-formats.md §4: E2M1 / E4M3 element codes, E8M0 (mx*) or E4M3 (nvfp4) scale bytes,
optional nvfp4 per-tensor `global_scale` (decode multiplies by global_scale / 2688).
All products code*scale are exact in fp32, so any evaluation order is bit-exact there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .affine import planes, unpack_codes

FP_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1_table() -> Tensor:
    return torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float32)


def _e4m3_table() -> Tensor:
    """All 256 E4M3 ("fn", bias 7) bytes -> fp32; 0x7F/0xFF are NaN (mlx 0.32.4 CPU)."""
    b = torch.arange(256, dtype=torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).to(torch.float64)
    e = (b >> 3) & 15
    m = (b & 7).to(torch.float64)
    sub = m / 8 * 2.0**-6
    norm = (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float64))
    v = sign * torch.where(e == 0, sub, norm)
    v[(b & 0x7F) == 0x7F] = float("nan")
    return v.to(torch.float32)


def _e8m0_table() -> Tensor:
    """E8M0 byte -> 2^(byte-127) in fp32; byte 0 is the fp32 subnormal 2^-127, 255 is +inf."""
    bits = torch.arange(256, dtype=torch.int32) << 23
    bits[0] = 0x00400000
    return bits.view(torch.float32)


E2M1 = _e2m1_table()
E4M3 = _e4m3_table()
E8M0 = _e8m0_table()

_TABLES: dict[tuple[str, str], Tensor] = {}


def table(name: str, device: torch.device | str = "cpu") -> Tensor:
    key = (name, str(device))
    if key not in _TABLES:
        _TABLES[key] = {"e2m1": E2M1, "e4m3": E4M3, "e8m0": E8M0}[name].to(device)
    return _TABLES[key]


def code_table(mode: str, device="cpu") -> Tensor:
    return table("e4m3" if mode == "mxfp8" else "e2m1", device)


def scale_table(mode: str, device="cpu") -> Tensor:
    return table("e4m3" if mode == "nvfp4" else "e8m0", device)


def fp_scales(scales: Tensor, mode: str, global_scale: Tensor | None = None) -> Tensor:
    """uint8 scale bytes -> fp32 group scales (times global_scale/2688 for nvfp4)."""
    s = scale_table(mode, scales.device)[scales.to(torch.int64)]
    if global_scale is not None:
        g = global_scale.to(torch.float32)
        # per leading index (e.g. per expert): broadcast over the trailing [out, groups] dims
        g = g.reshape(*g.shape, *([1] * (s.dim() - g.dim()))) if g.dim() else g
        s = s * (g / 2688.0)
    return s


def fp_dequantize_codes(
    q: Tensor, scales: Tensor, mode: str, group_size: int, *, global_scale: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """codes uint8 [..., out, in] -> value(code) * scale, in fp32, cast to out_dtype."""
    lead = q.shape[:-1]
    n = q.shape[-1]
    v = code_table(mode, q.device)[q.to(torch.int64)].reshape(*lead, n // group_size, group_size)
    s = fp_scales(scales, mode, global_scale).unsqueeze(-1)
    return (v * s).reshape(*lead, n).to(out_dtype)


def fp_dequantize(
    weight: Tensor, scales: Tensor, mode: str, *, global_scale: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    bits, group_size = FP_MODES[mode]
    q = unpack_codes(weight, bits, scales.shape[-1] * group_size)
    return fp_dequantize_codes(q, scales, mode, group_size, global_scale=global_scale,
                               out_dtype=out_dtype)


# E2M1 code -> 2 v + 12 in [0, 24] (v the code's value), and back (an unused entry -> 0)
_TWICE_PLUS_12 = torch.tensor([int(2 * v) + 12 for v in _E2M1] + [12 - int(2 * v) for v in _E2M1],
                              dtype=torch.uint8)
_FROM_TWICE = torch.zeros(25, dtype=torch.uint8)
_FROM_TWICE[_TWICE_PLUS_12.long().flip(0)] = torch.arange(15, -1, -1, dtype=torch.uint8)


def fp4_planes(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """E2M1 codes [N, K] with fp32 group scales s [N, K/G] -> two nibble planes [N, 2K] and
    fp32 scales, biases [N, 2K/G] whose affine 4-bit GEMV over x repeated twice is the fp4
    GEMV: w = 2v + 12 (in [0, 24]) splits into p1 = min(w, 15) and p2 = w - p1, both planes
    at scale s / 2, the first with bias -6s: s/2 (p1 + p2) - 6s = s v. s / 2 and 6s are exact
    for mx's power-of-two scales. Non-finite scales (E8M0 byte 255) raise ValueError."""
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("fp4_planes: non-finite scales")
    w = _TWICE_PLUS_12.to(codes.device)[codes.long()]
    p1 = w.clamp(max=15)
    half = scales / 2
    return (torch.cat([p1, w - p1], dim=1), torch.cat([half, half], dim=1),
            torch.cat([-6 * scales, torch.zeros_like(scales)], dim=1))


def fp4_codes(twice_plus_12: Tensor) -> Tensor:
    """The E2M1 codes back from p1 + p2 of `fp4_planes` (a zero comes back as +0)."""
    return _FROM_TWICE.to(twice_plus_12.device)[twice_plus_12.long()]


def nibble_planes(spec, packed: Tensor, scales: Tensor, biases: Tensor | None,
                  in_features: int) -> tuple[Tensor, Tensor, Tensor]:
    """The nibble planes of packed rows (the int4 kernels' input on both devices): affine
    codes by `affine.planes`, mxfp4 by `fp.fp4_planes` (fp32 scales and biases). Raises
    ValueError where a plane's scale overflows or is not finite."""
    q = unpack_codes(packed, spec.bits, in_features)
    if spec.mode == "mxfp4":
        return fp4_planes(q, fp_scales(scales, spec.mode))
    return planes(q, scales, biases, spec.bits)
