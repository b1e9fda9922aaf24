"""The frozen configuration types: a model's quantization (`QuantSpec`, `QuantConfig`), the
rotary embedding of a layer (`RopeSpec`) and the one configurable decoder's flags
(`ModelConfig`). Parsed and checked by the rest of `mlxr.config`; read by the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .moe import MoeSpec

# mode -> (bits, group_size) defaults, as mlx writes them (null/missing keys take these).
QUANT_DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


@dataclass(frozen=True)
class QuantSpec:
    """How one module's weight is quantized (mlx `to_quantized` kwargs)."""

    mode: str = "affine"  # affine | mxfp4 | nvfp4 | mxfp8
    bits: int = 4
    group_size: int = 64
    global_scale: bool = False  # nvfp4 only: a per-tensor fp32 `global_scale` tensor exists


@dataclass(frozen=True)
class QuantConfig:
    """The config's `quantization` block: defaults plus per-module overrides.

    `overrides` maps a module path (e.g. "model.layers.3.mlp.down_proj") to its QuantSpec, or to
    None for a module the file marks `false` (kept in float). As in mlx-lm, modules without an
    entry have their bits/group/mode inferred from tensor shapes at load time.
    """

    default: QuantSpec
    overrides: dict[str, QuantSpec | None]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: rotate the first `dims` features of each head."""

    dims: int
    base: float
    traditional: bool = False  # True: interleaved pairs; False: rotate-half (HF/NeoX layout)
    scaling: dict | None = None  # normalised rope_scaling dict ("rope_type" always set)
    max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """One configurable decoder: every dense family is a set of these flags."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    # None: tied iff the checkpoint has no lm_head (gemma3_text); resolved by the loader.
    tie_word_embeddings: bool | None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3, gemma3)
    norm_offset: float = 0.0  # gemma family: RMSNorm weight is (1 + w)
    embed_scale: float | None = None  # gemma family: embeddings multiplied by sqrt(hidden)
    embed_scale_bf16: bool = False  # gemma3: that scalar is rounded to bf16 first
    hidden_act: str = "silu"  # silu | gelu (exact erf) | gelu_tanh
    sandwich_norm: bool = False  # gemma2/3: post-attention and pre/post-feedforward norms
    attn_scale: float = 1.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    fused_qkv: bool = False  # phi3: self_attn.qkv_proj
    fused_gate_up: bool = False  # phi3: mlp.gate_up_proj (gate rows first)
    clip_residual_fp16: bool = False  # gemma3: fp16 residual adds clipped to the fp16 range
    layer_rope: tuple[RopeSpec, ...] = field(default=(), repr=False)
    # sliding window per layer (None = global attention)
    layer_window: tuple[int | None, ...] = field(default=(), repr=False)
    # query heads per layer (laguna); () = num_heads everywhere (num_heads is their maximum)
    layer_heads: tuple[int, ...] = ()
    attn_sinks: bool = False  # gpt-oss: self_attn.sinks [H], one extra logit per head
    attn_head_gate: bool = False  # laguna: o *= softplus(self_attn.g_proj(x)) [N, H] per head
    moe: MoeSpec | None = None  # the sparse MLP of the MoE families (its layers: sparse_layers)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant: QuantConfig | None = None
    torch_dtype: str | None = None
    # hybrid / new-generation families: their per-layer structure (mlxr.config.hybrid's
    # GatedDeltaSpec or Gemma4Spec); None for the dense families
    arch: object | None = field(default=None, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def heads(self, layer: int) -> int:
        """Query heads of one layer."""
        return self.layer_heads[layer] if self.layer_heads else self.num_heads

    @property
    def context_length(self) -> int:
        """Longest sequence we accept: max_position_embeddings, times the factor for dynamic
        NTK scaling (which exists to run past the trained length)."""
        s = max((r.scaling or {} for r in self.layer_rope), key=len, default={})
        if s.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * s["factor"])
        return self.max_position_embeddings
