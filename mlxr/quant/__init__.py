"""MLX quantization formats: reference dequantizers and quantized matrices (`QuantWeight`)."""

from .affine import unpack_codes
from .dequant import check_spec, dequantize, validate
from .weight import QuantWeight

__all__ = ["QuantWeight", "check_spec", "dequantize", "unpack_codes", "validate"]
