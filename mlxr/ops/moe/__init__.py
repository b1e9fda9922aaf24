"""Mixture-of-experts kernels (a slot, empty for now).

What goes here: the routed expert matmuls of MoE families (top-k gating, the per-expert
gather/scatter of token rows, grouped quantized GEMV/GEMM over the experts' MLX weights), each a
Triton kernel with its plain-torch twin in `mlxr.ops.reference` (or beside it, same signature),
dispatched from `mlxr.ops`. The dense quantized matmuls they build on are in `mlxr.ops.matmul`.
"""
