"""Mixture-of-experts ops.

`reference.py`: the plain-torch router (softmax / sigmoid top-k variants), expert activations
(SiLU-GLU, gpt-oss's clamped SwiGLU), the weighted combine and the attention head gate: the spec,
the CPU path and the test oracle. The Triton kernels for the routed experts, dispatched from
`mlxr.ops.moe_experts`, each with its torch twin: `decode_experts.py` (a few tokens: gate/up
with the activation fused, down with the routing weights summed over top-k, experts indexed on
the device), `decode_split.py` (their split-K / pair-parallel variants, the launch configs
and the decode crossover from the env), `grouped_experts.py` (pairs grouped by expert, a
grouped GEMM per projection), `grouped_mm.py` (bf16 batches: every expert dequantized, then
torch._grouped_mm over the pairs sorted by expert), `grouped_fused.py` (the grouped GEMM
with the words dequantized in its K loop, MLXR_MOE_GROUPED=fused);
`operands.py`: the stacked expert operands they take (free of triton). The dense quantized
matmuls they build on are in `mlxr.ops.matmul`.
"""
