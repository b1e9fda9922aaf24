"""The single dispatch point for compute ops.

Today every op is the plain-torch reference (CPU, and CUDA through torch). Triton kernels
replace entries here behind the same signatures.
"""

from .reference import attention, attention_masked, gated_act, rms_norm, rope

__all__ = ["attention", "attention_masked", "gated_act", "rms_norm", "rope"]
