"""One configurable decoder for the dense families (flags in ModelConfig select the variant).

Module names follow the checkpoint (HF names); see `mlxr.models.loader` for how tensors map in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..config import ModelConfig
from ..kv_cache import KVCache
from ..layers import Embedding, Linear, Rope


class Fused:
    """Several projections of the same input: one Linear when their weights could be stacked at
    load (one matmul), else a list whose outputs are concatenated. Output [N, sum(sizes)]."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.sizes = [p.out_features for p in parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([p(x) for p in self.parts], dim=-1)


@dataclass
class Layer:
    """Weights of one block. Norm weights are [E] (q/k norms [D]) in the compute dtype."""

    input_norm: torch.Tensor
    qkv: Fused  # -> [N, H*D + 2*K*D]
    o_proj: Linear
    mlp_norm: torch.Tensor  # post_attention_layernorm (llama) / pre_feedforward_layernorm (gemma2/3)
    gate_up: Fused  # -> [N, 2F], gate first
    down_proj: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # sandwich norms (gemma2/3)
    post_mlp_norm: torch.Tensor | None = None


class Decoder:
    """Embedding -> layers -> final norm -> LM head, over one sequence with a KV cache."""

    def __init__(self, config: ModelConfig, embed: Embedding, layers: list[Layer],
                 norm: torch.Tensor, lm_head: Linear | None, dtype: torch.dtype,
                 device: torch.device):
        self.config, self.embed, self.layers, self.norm = config, embed, layers, norm
        self.lm_head, self.dtype, self.device = lm_head, dtype, device
        self.ropes = [Rope(spec, device) for spec in config.layer_rope]
        scale = config.embed_scale
        if scale is not None:
            t = torch.tensor(scale, dtype=torch.bfloat16 if config.embed_scale_bf16 else dtype)
            self._embed_scale = t.to(dtype).to(device)
        else:
            self._embed_scale = None

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device, capacity)

    def _residual(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if self.config.clip_residual_fp16 and h.dtype == torch.float16:
            bound = torch.finfo(torch.float16).max
            return (h.float() + r.float()).clamp(-bound, bound).half()
        return h + r

    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Run tokens ids [T] at positions [cache.length, +T); return logits float32 [T|1, V]."""
        c = self.config
        t, start = ids.shape[0], cache.length
        cache.reserve(start + t)
        h = self.embed(ids.to(self.device))
        if self._embed_scale is not None:
            h = h * self._embed_scale
        eps, off = c.rms_norm_eps, c.norm_offset
        tables: dict[int, tuple] = {}
        for i, layer in enumerate(self.layers):
            rope = self.ropes[i]
            if id(rope.spec) not in tables:
                tables[id(rope.spec)] = rope.cos_sin(start, t)
            cos, sin = tables[id(rope.spec)]
            x = ops.rms_norm(h, layer.input_norm, eps, off)
            q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.reshape(t, c.num_heads, c.head_dim)
            k = k.reshape(t, c.num_kv_heads, c.head_dim)
            v = v.reshape(t, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, eps, off)
                k = ops.rms_norm(k, layer.k_norm, eps, off)
            if rope.scale != 1.0:  # yarn / longrope scale the rotated features of q and k
                r = rope.spec.dims
                q = torch.cat((q[..., :r] * rope.scale, q[..., r:]), dim=-1)
                k = torch.cat((k[..., :r] * rope.scale, k[..., r:]), dim=-1)
            q = ops.rope(q, cos, sin, rope.spec.traditional)
            k = ops.rope(k, cos, sin, rope.spec.traditional)
            keys, values = cache.write(i, start, k, v)
            window = c.layer_window[i]
            lo = 0 if window is None else max(0, start - window + 1)
            o = ops.attention(q, keys[:, lo:], values[:, lo:], start, lo, c.attn_scale, window,
                              c.attn_logit_softcap)
            o = layer.o_proj(o.reshape(t, c.q_size))
            if layer.post_attn_norm is not None:
                o = ops.rms_norm(o, layer.post_attn_norm, eps, off)
            h = self._residual(h, o)
            x = ops.rms_norm(h, layer.mlp_norm, eps, off)
            gate, up = layer.gate_up(x).split(c.intermediate_size, dim=-1)
            m = layer.down_proj(ops.gated_act(gate, up, c.hidden_act))
            if layer.post_mlp_norm is not None:
                m = ops.rms_norm(m, layer.post_mlp_norm, eps, off)
            h = self._residual(h, m)
        cache.length = start + t
        if last_only:
            h = h[-1:]
        h = ops.rms_norm(h, self.norm, eps, off)
        logits = (self.lm_head(h) if self.lm_head is not None else self.embed.as_linear(h)).float()
        if c.final_logit_softcap is not None:
            cap = c.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
