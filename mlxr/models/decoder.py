"""One configurable decoder for the dense families (flags in ModelConfig select the variant).

Module names follow the checkpoint (HF names); see `mlxr.models.loader` for how tensors map in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..config import ModelConfig
from ..layers import Embedding, Linear, Rope


class Fused:
    """Projections of the same input whose weights could not be stacked at load (different
    storage formats, e.g. an 8-bit v_proj beside 4-bit q/k): outputs concatenated."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


@dataclass
class SeqSpan:
    """One sequence's share of a step: q_len new tokens at positions [q_start, q_start+q_len).

    Its context (positions [0, q_start+q_len)) lives in cache slots `slot_range` (a, b) when
    they are consecutive (read as a view), else in `slots` [S] (gathered)."""

    q_start: int
    q_len: int
    slot_range: tuple[int, int] | None = None
    slots: torch.Tensor | None = None


@dataclass
class Step:
    """Per-step state for a batch of sequences whose new tokens are flattened to N rows."""

    spans: list[SeqSpan]
    write_slots: torch.Tensor  # [N] long: cache slot of each new token
    logits_rows: torch.Tensor | None = None  # rows of N whose logits are wanted (None = all)


def span_for(block_table: list[int], block_size: int, q_start: int, q_len: int,
             device) -> SeqSpan:
    """The SeqSpan of a paged sequence (consecutive blocks become a plain slot range)."""
    ctx = q_start + q_len
    n = -(-ctx // block_size)
    table = block_table[:n]
    if table == list(range(table[0], table[0] + n)):
        a = table[0] * block_size
        return SeqSpan(q_start, q_len, slot_range=(a, a + ctx))
    t = torch.tensor(table, dtype=torch.long)
    slots = (t[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
    return SeqSpan(q_start, q_len, slots=slots.to(device))


def write_slots_for(block_table: list[int], block_size: int, start: int, n: int) -> list[int]:
    """Cache slots of positions [start, start+n) of a paged sequence."""
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, start + n)]


@dataclass
class Layer:
    """Weights of one block. Norm weights are [E] (q/k norms [D]) in the compute dtype."""

    input_norm: torch.Tensor
    qkv: Linear | Fused  # -> [N, H*D + 2*K*D]
    o_proj: Linear
    # post_attention_layernorm (llama) / pre_feedforward_layernorm (gemma2/3)
    mlp_norm: torch.Tensor
    gate_up: Linear | Fused  # -> [N, 2F], gate first
    down_proj: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # sandwich norms (gemma2/3)
    post_mlp_norm: torch.Tensor | None = None


class Decoder:
    """Embedding -> layers -> final norm -> LM head, over a batch of sequences whose KV lives in
    a cache pool (paged for serving, one contiguous range for a single request)."""

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

    def _residual(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if self.config.clip_residual_fp16 and h.dtype == torch.float16:
            bound = torch.finfo(torch.float16).max
            return (h.float() + r.float()).clamp(-bound, bound).half()
        return h + r

    def forward(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """One sequence: run ids [T] at positions [cache.length, +T) of a SequenceCache and
        return logits float32 [T|1, V]."""
        t, start = ids.shape[0], cache.length
        cache.reserve(start + t)
        step = Step([SeqSpan(start, t, slot_range=(0, start + t))],
                    torch.arange(start, start + t, device=self.device),
                    torch.tensor([t - 1], device=self.device) if last_only else None)
        logits = self.forward_step(ids, step, cache.pool)
        cache.length = start + t
        return logits

    def forward_step(self, ids: torch.Tensor, step: Step, pool) -> torch.Tensor:
        """A batch step: ids [N] (all sequences' new tokens, flattened), KV in `pool`
        (k[layer], v[layer] [K, slots, D]). Returns logits float32 [rows, V]."""
        c = self.config
        n = ids.shape[0]
        tables: dict[int, tuple] = {}
        for rope in self.ropes:
            if id(rope.spec) not in tables:
                cs = [rope.cos_sin(sp.q_start, sp.q_len) for sp in step.spans]
                tables[id(rope.spec)] = (torch.cat([a for a, _ in cs]),
                                         torch.cat([b for _, b in cs]))
        contiguous = len(step.spans) == 1 and step.spans[0].slot_range is not None

        def attend(i: int, q, k, v):
            kc, vc = pool.k[i], pool.v[i]
            if contiguous:  # one sequence in one range: plain slice writes
                a = step.spans[0].slot_range[0] + step.spans[0].q_start
                kc[:, a:a + n] = k.transpose(0, 1)
                vc[:, a:a + n] = v.transpose(0, 1)
            else:
                kc.index_copy_(1, step.write_slots, k.transpose(0, 1))
                vc.index_copy_(1, step.write_slots, v.transpose(0, 1))
            window = c.layer_window[i]
            outs, row = [], 0
            for sp in step.spans:
                ctx = sp.q_start + sp.q_len
                lo = 0 if window is None else max(0, sp.q_start - window + 1)
                if sp.slot_range is not None:
                    a = sp.slot_range[0]
                    keys, values = kc[:, a + lo:a + ctx], vc[:, a + lo:a + ctx]
                else:
                    sl = sp.slots[lo:ctx]
                    keys, values = kc.index_select(1, sl), vc.index_select(1, sl)
                outs.append(ops.attention(q[row:row + sp.q_len], keys, values, sp.q_start, lo,
                                          c.attn_scale, window, c.attn_logit_softcap))
                row += sp.q_len
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return self._run(ids, tables, attend, step.logits_rows)

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, pool, tables: dict,
                       key_pos: torch.Tensor) -> torch.Tensor:
        """One decode token of one sequence with every shape fixed and every index on the
        device, so the step can be captured in a CUDA graph. ids, pos [1] (device long); pool's
        slots are positions; tables: rope spec id -> (cos, sin) [capacity, R]; key_pos =
        arange(capacity). Attention covers the whole capacity under a visibility mask."""
        c = self.config
        step_tables = {k: (cs.index_select(0, pos), sn.index_select(0, pos))
                       for k, (cs, sn) in tables.items()}
        causal = key_pos <= pos

        def attend(i: int, q, k, v):
            kc, vc = pool.k[i], pool.v[i]
            kc.index_copy_(1, pos, k.transpose(0, 1))
            vc.index_copy_(1, pos, v.transpose(0, 1))
            window = c.layer_window[i]
            visible = causal if window is None else causal & (pos - key_pos < window)
            return ops.attention_masked(q, kc, vc, visible, c.attn_scale, c.attn_logit_softcap)

        return self._run(ids, step_tables, attend, None)

    def forward_paged(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      block_tables: torch.Tensor, ctx_lens: torch.Tensor, pool,
                      tables: dict) -> torch.Tensor:
        """One decode token for each of B sequences of a paged pool, every shape fixed and every
        index on the device (the serving engine captures it per batch bucket). ids, pos, slots
        [B] long (token, its position, its cache slot); block_tables [B, W] int32; ctx_lens [B]
        = pos + 1; tables: rope spec id -> (cos, sin) [positions, R]. Returns logits
        float32 [B, V]."""
        c = self.config
        step_tables = {k: (cs.index_select(0, pos), sn.index_select(0, pos))
                       for k, (cs, sn) in tables.items()}

        def attend(i: int, q, k, v):
            kc, vc = pool.k[i], pool.v[i]
            kc.index_copy_(1, slots, k.transpose(0, 1))
            vc.index_copy_(1, slots, v.transpose(0, 1))
            return ops.paged_attention(q, kc, vc, block_tables, ctx_lens, pool.block_size,
                                       c.attn_scale, c.layer_window[i], c.attn_logit_softcap)

        return self._run(ids, step_tables, attend, None)

    def _run(self, ids: torch.Tensor, tables: dict, attend, rows) -> torch.Tensor:
        """Embedding, the layers (attention through `attend(layer, q, k, v) -> [N, H, D]`),
        final norm and LM head (only for `rows` of N if given). Returns logits float32."""
        c = self.config
        n = ids.shape[0]
        h = self.embed(ids.to(self.device))
        if self._embed_scale is not None:
            h = h * self._embed_scale
        eps, off = c.rms_norm_eps, c.norm_offset
        for i, layer in enumerate(self.layers):
            rope = self.ropes[i]
            cos, sin = tables[id(rope.spec)]
            x = ops.rms_norm(h, layer.input_norm, eps, off)
            q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.reshape(n, c.num_heads, c.head_dim)
            k = k.reshape(n, c.num_kv_heads, c.head_dim)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, eps, off)
                k = ops.rms_norm(k, layer.k_norm, eps, off)
            if rope.scale != 1.0:  # yarn / longrope scale the rotated features of q and k
                r = rope.spec.dims
                q = torch.cat((q[..., :r] * rope.scale, q[..., r:]), dim=-1)
                k = torch.cat((k[..., :r] * rope.scale, k[..., r:]), dim=-1)
            q = ops.rope(q, cos, sin, rope.spec.traditional)
            k = ops.rope(k, cos, sin, rope.spec.traditional)
            o = layer.o_proj(attend(i, q, k, v).reshape(n, c.q_size))
            if layer.post_attn_norm is not None:
                o = ops.rms_norm(o, layer.post_attn_norm, eps, off)
            h = self._residual(h, o)
            x = ops.rms_norm(h, layer.mlp_norm, eps, off)
            gate, up = layer.gate_up(x).split(c.intermediate_size, dim=-1)
            m = layer.down_proj(ops.gated_act(gate, up, c.hidden_act))
            if layer.post_mlp_norm is not None:
                m = ops.rms_norm(m, layer.post_mlp_norm, eps, off)
            h = self._residual(h, m)
        if rows is not None:
            h = h.index_select(0, rows)
        h = ops.rms_norm(h, self.norm, eps, off)
        logits = (self.lm_head(h) if self.lm_head is not None else self.embed.as_linear(h)).float()
        if c.final_logit_softcap is not None:
            cap = c.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
