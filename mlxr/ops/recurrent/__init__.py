"""Recurrent (linear-attention) kernels of hybrid families (a slot, empty for now).

What goes here: the state-space / linear-attention mixers that replace attention in some layers
of hybrid models (chunked scans for prefill, one-step state updates for decode, their short
convolutions), each a Triton kernel with its plain-torch twin, dispatched from `mlxr.ops`.
Softmax attention stays in `mlxr.ops.kv_attention`.
"""
