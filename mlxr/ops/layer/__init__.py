"""Triton kernels of a decoder layer's small ops and glue: norms, RoPE, activations
(`norm_rope_act`), the residual add + norm and the qkv split + RoPE + cache write
(`add_norm_qkv_rope`), quantized embedding rows (`embed_rows`)."""
