"""Triton attention kernels: decode over a KV cache under a visibility mask (`masked`: the single
request's graph decode and cached-prefix prefill) and over the paged cache (`paged`: the serving
engine's batched decode and paged prefill)."""
