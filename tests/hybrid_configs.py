"""Tiny hybrid-family configs (mlx-lm's keys), without mlx: `mlx_ref_hybrid` builds them with
mlx-lm, and `scripts/hybrid_gpu_check.py` writes random checkpoints of them where mlx is not
installed (the GPU host).
"""

from __future__ import annotations

_QWEN35_TEXT = dict(
    model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=320, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25,
                         mrope_section=[2, 1, 1]))

_GEMMA4_TEXT = dict(
    model_type="gemma4_text", hidden_size=64, num_hidden_layers=5, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
    vocab_size=320, vocab_size_per_layer_input=320, hidden_size_per_layer_input=64,
    num_kv_shared_layers=2, sliding_window=8, sliding_window_pattern=2, rms_norm_eps=1e-6,
    final_logit_softcapping=30.0, max_position_embeddings=4096)

# the MoE block's keys: 4 experts, 2 per token, 64-wide (quantizable at group 64), a shared
# expert under its sigmoid gate
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64)

_QWEN3_NEXT = dict(
    model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=320, rms_norm_eps=1e-6,
    rope_theta=1e6, partial_rotary_factor=0.25, max_position_embeddings=4096,
    decoder_sparse_step=1, mlp_only_layers=[2], tie_word_embeddings=False, **_QWEN_MOE)

FAMILIES: dict[str, dict] = {
    # text_config wrapper, 2 gated DeltaNet + 2 gated-attention layers, Hv = 2 Hk
    "qwen3_5": dict(model_type="qwen3_5", text_config=_QWEN35_TEXT),
    "qwen3_5_untied": dict(model_type="qwen3_5", text_config=dict(
        _QWEN35_TEXT, tie_word_embeddings=False, linear_num_key_heads=4,
        attention_bias=True)),
    # sliding, full (512-style wide head, proportional rope), sliding, then two KV-shared
    # layers (full, sliding; double-wide MLPs) that read layers 1 and 2
    "gemma4_text": _GEMMA4_TEXT,
    # the wrapper with k = v on full layers and their own kv head count
    "gemma4": dict(model_type="gemma4", vocab_size=320, text_config=dict(
        _GEMMA4_TEXT, model_type="gemma4_text", attention_k_eq_v=True,
        num_global_key_value_heads=2, num_attention_heads=4)),
    # every layer sparse, norm_topk_prob at its qwen3_5 default (true)
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(
        _QWEN35_TEXT, model_type="qwen3_5_moe_text", **_QWEN_MOE)),
    # grouped in_proj_qkvz / in_proj_ba (Hv = 2 Hk), layer 2 a dense MLP (mlp_only_layers),
    # norm_topk_prob at its qwen3_next default (false)
    "qwen3_next": _QWEN3_NEXT,
    # the 26B-A4B shape in small: experts beside every dense MLP, k = v on full layers, no
    # per-layer embeddings or KV sharing
    "gemma4_moe": dict(model_type="gemma4", vocab_size=320, text_config=dict(
        _GEMMA4_TEXT, model_type="gemma4_text", attention_k_eq_v=True,
        num_global_key_value_heads=2, num_attention_heads=4, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=64)),
}
