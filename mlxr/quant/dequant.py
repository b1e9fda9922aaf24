"""Validation of quantized tensor triples and the reference (executable spec) dequantizer."""

from __future__ import annotations

import torch
from torch import Tensor

from mlxr.config import QuantSpec
from mlxr.errors import ModelFormatError

from .affine import AFFINE_BITS, AFFINE_GROUPS, affine_dequantize
from .fp import FP_MODES, fp_dequantize

_FLOAT_SCALES = (torch.bfloat16, torch.float16, torch.float32)


def check_spec(spec: QuantSpec, name: str = "weight") -> None:
    if spec.mode == "affine":
        if spec.bits not in AFFINE_BITS or spec.group_size not in AFFINE_GROUPS:
            raise ModelFormatError(
                f"{name}: unsupported affine quantization bits={spec.bits} "
                f"group_size={spec.group_size} (bits {AFFINE_BITS}, groups {AFFINE_GROUPS})")
    elif spec.mode in FP_MODES:
        if (spec.bits, spec.group_size) != FP_MODES[spec.mode]:
            b, g = FP_MODES[spec.mode]
            raise ModelFormatError(
                f"{name}: {spec.mode} needs bits={b} group_size={g}, "
                f"got bits={spec.bits} group_size={spec.group_size}")
    else:
        raise ModelFormatError(f"{name}: unknown quantization mode {spec.mode!r}")
    if spec.global_scale and spec.mode != "nvfp4":
        raise ModelFormatError(f"{name}: global_scale is only valid for nvfp4, not {spec.mode}")


def validate(
    weight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec,
    global_scale: Tensor | None = None, name: str = "weight",
) -> int:
    """Check shapes/dtypes of a quantized triple against `spec`; return in_features."""
    check_spec(spec, name)
    if weight.dtype not in (torch.uint32, torch.int32):
        raise ModelFormatError(f"{name}: packed weight must be uint32, got {weight.dtype}")
    if weight.dim() < 2:
        raise ModelFormatError(
            f"{name}: packed weight must be at least 2-D, got {tuple(weight.shape)}")
    if scales.dim() != weight.dim() or scales.shape[:-1] != weight.shape[:-1]:
        raise ModelFormatError(
            f"{name}: scales shape {tuple(scales.shape)} does not match weight "
            f"{tuple(weight.shape)}")
    in_features = scales.shape[-1] * spec.group_size
    if in_features == 0 or weight.shape[-1] * 32 != in_features * spec.bits:
        raise ModelFormatError(
            f"{name}: weight last dim {weight.shape[-1]} != in_features*bits/32 with "
            f"in_features={in_features} (scales {scales.shape[-1]} groups x {spec.group_size}), "
            f"bits={spec.bits}")
    if spec.mode == "affine":
        if scales.dtype not in _FLOAT_SCALES:
            raise ModelFormatError(f"{name}: affine scales must be float, got {scales.dtype}")
        if biases is None:
            raise ModelFormatError(f"{name}: affine quantization needs biases")
        if biases.shape != scales.shape or biases.dtype != scales.dtype:
            raise ModelFormatError(
                f"{name}: biases {tuple(biases.shape)} {biases.dtype} must match scales "
                f"{tuple(scales.shape)} {scales.dtype}")
    else:
        if scales.dtype != torch.uint8:
            raise ModelFormatError(f"{name}: {spec.mode} scales must be uint8, got {scales.dtype}")
        if biases is not None:
            raise ModelFormatError(f"{name}: {spec.mode} has no biases")
    if spec.global_scale != (global_scale is not None):
        raise ModelFormatError(
            f"{name}: global_scale tensor {'missing' if spec.global_scale else 'unexpected'} "
            f"(spec.global_scale={spec.global_scale})")
    if global_scale is not None:
        lead = tuple(weight.shape[:-2])
        if not global_scale.is_floating_point() or (
            tuple(global_scale.shape) != lead and global_scale.numel() != 1
        ):
            raise ModelFormatError(
                f"{name}: global_scale must be float of shape {lead} (or a scalar), got "
                f"{tuple(global_scale.shape)} {global_scale.dtype}")
    return in_features


def dequantize(
    weight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec, *,
    global_scale: Tensor | None = None, dtype: torch.dtype | None = None, name: str = "weight",
) -> Tensor:
    """Reference dequantization, bit-exact vs `mx.dequantize` on CPU. Returns [..., out, in].

    affine: `R(R(q*s)+b)` in fp32 with R = rounding to the scale dtype; default dtype = scales
    dtype (given `dtype`, that result is cast). fp modes: exact fp32 products rounded once to
    `dtype` (default bfloat16, like mlx; mlx CPU returns float32 whenever a global_scale is
    given, we honour `dtype`).
    """
    validate(weight, scales, biases, spec, global_scale, name)
    if spec.mode == "affine":
        return affine_dequantize(weight, scales, biases, spec.bits, spec.group_size, dtype)
    gs = global_scale
    if gs is not None and gs.numel() == 1 and weight.dim() > 2:
        gs = gs.reshape(())
    return fp_dequantize(weight, scales, spec.mode, global_scale=gs,
                         out_dtype=dtype or torch.bfloat16)
