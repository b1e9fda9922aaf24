"""ONNX decoders (ONNX Runtime GenAI builder / Mobius exports) on mlxr's decoder and kernels.

`mlxr.load(path)` reads an ONNX folder or .onnx through `mlxr.onnx.load`; code written against
onnxruntime uses `mlxr.onnx.InferenceSession`. Needs the `onnx` extra (onnx, onnxruntime).
Nothing here is imported until used (`mlxr.onnx.folder` needs neither), so the MLX path never
imports onnx.
"""

from __future__ import annotations

__all__ = ["InferenceSession", "describe", "inspect", "load_onnx"]


def __getattr__(name: str):
    if name == "InferenceSession":
        from .session import InferenceSession

        return InferenceSession
    if name in ("describe", "inspect", "load_onnx"):
        from . import load

        return getattr(load, name)
    raise AttributeError(f"module 'mlxr.onnx' has no attribute {name!r}")
