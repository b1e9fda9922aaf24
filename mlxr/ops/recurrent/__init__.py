"""Recurrent (linear-attention) ops of the hybrid families.

`reference.py`: the plain-torch gated DeltaNet ops (causal conv1d + SiLU with its rolling state,
q/k L2 norm, the beta / g gates, the gated delta rule with a float32 state, the gated RMSNorm):
the spec, the CPU path and the test oracle. `gated_delta_scan.py`: their Triton twins (the
recurrence and the conv), dispatched from `mlxr.ops`. `gated_delta_decode.py`: the mixer's whole
decode step (conv, norms, gates, recurrence, gated norm) in one launch. Softmax attention stays in
`mlxr.ops.kv_attention`.
"""
