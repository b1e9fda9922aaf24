"""Mixture-of-experts ops.

`reference.py`: the plain-torch router (softmax / sigmoid top-k variants), expert activations
(SiLU-GLU, gpt-oss's clamped SwiGLU), the weighted combine and the attention head gate: the spec,
the CPU path and the test oracle. Triton kernels for the routed expert matmuls (grouped quantized
GEMV / GEMM over the stacked expert weights) go beside it, same signatures, dispatched from
`mlxr.ops`. The dense quantized matmuls they build on are in `mlxr.ops.matmul`.
"""
