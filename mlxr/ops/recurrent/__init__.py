"""Recurrent (linear-attention) ops of the hybrid families.

`reference.py`: the plain-torch gated DeltaNet ops (causal conv1d + SiLU with its rolling state,
q/k L2 norm, the beta / g gates, the gated delta rule with a float32 state, the gated RMSNorm):
the spec, the CPU path and the test oracle. `gated_delta_scan.py`: their Triton twins (the
recurrence and the conv), dispatched from `mlxr.ops`. `gated_delta_decode.py`: the mixer's whole
decode step (conv, norms, gates, recurrence, gated norm) in one launch.
`gated_delta_chunked.py`: the recurrence in the chunked (WY) form for prefill, two launches per
call, taken by `ops.gated_delta` with MLXR_GDN_CHUNKED=1 from 64 tokens (its twin:
`reference.gated_delta_chunked`). Softmax attention stays in `mlxr.ops.kv_attention`.
"""
