"""One configurable decoder for every family (flags in ModelConfig select the variant; a
layer's MLP is dense or a `moe.MoeBlock`).

Module names follow the checkpoint (HF names); see `mlxr.models.loader` for how tensors map in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import ops
from ..config import ModelConfig
from ..layers import Embedding, Linear, Rope
from ..ops.cpu import native, prefill_attend
from ..quant import QuantWeight
from . import cpu_decode, fused_decode
from .moe import MoeBlock


class Fused:
    """Projections of the same input whose weights could not be stacked at load (different
    storage formats, e.g. an 8-bit v_proj beside 4-bit q/k): outputs concatenated."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _gated_act(gate_up: Linear | Fused, x: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of the MLP's [gate | up] projection (one launch where `Linear.gated`
    can)."""
    if isinstance(gate_up, Linear):
        return gate_up.gated(x, act)
    gate, up = gate_up(x).chunk(2, dim=-1)
    return ops.gated_act(gate, up, act)


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
class PagedBatch:
    """A step's sequences as the paged attention kernel reads them (the serving engine on CUDA):
    block_tables [S, W] int32, items [I, 4] int32 (`ops.paged_items`: row tiles of one sequence
    each), positions [N] long of the new tokens, and RoPE tables to gather them from (rope spec
    id -> (cos, sin) [positions, R])."""

    block_tables: torch.Tensor
    items: torch.Tensor
    positions: torch.Tensor
    rope: dict


@dataclass
class Step:
    """Per-step state for a batch of sequences whose new tokens are flattened to N rows. With
    `paged`, attention runs over the whole batch in one kernel and `spans` is not read."""

    spans: list[SeqSpan]
    write_slots: torch.Tensor  # [N] long: cache slot of each new token
    logits_rows: torch.Tensor | None = None  # rows of N whose logits are wanted (None = all)
    paged: PagedBatch | None = None


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
    gate_up: Linear | Fused | None  # -> [N, 2F], gate first (None: a MoE layer)
    down_proj: Linear | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # sandwich norms (gemma2/3)
    post_mlp_norm: torch.Tensor | None = None
    moe: MoeBlock | None = None  # the sparse MLP in place of gate_up / down_proj
    sinks: torch.Tensor | None = None  # [H] attention sinks (gpt-oss)
    head_gate: Linear | None = None  # -> [N, H], softplus-gated attention heads (laguna)
    # a layer computed outside mlxr's kernels (an ONNX layer left to onnxruntime, see
    # mlxr.onnx.regions): (x [N, E] normed input, h [N, E] stream, layer index, pool, slots)
    # -> (h after the attention's residual add, MLP output); only input_norm is set beside it
    external: Callable | None = None
    # parts of the dense MLP computed outside mlxr's kernels (mlxr.onnx.regions): mlp_input
    # maps the MLP norm's output x [N, E] to what gate/up read [N, E]; mlp_act maps gate/up's
    # two output halves [N, F] each to down's input [N, F]
    mlp_input: Callable | None = None
    mlp_act: Callable | None = None


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

    @property
    def head(self) -> Linear:
        """The LM head: lm_head, or the embedding as a linear when tied."""
        return self.lm_head if self.lm_head is not None else self.embed.as_linear

    def quant_weights(self) -> list[QuantWeight]:
        """Every quantized weight the forward multiplies by (projections, LM head), once each."""
        out: dict[int, QuantWeight] = {}
        lins = [self.head]
        for layer in self.layers:
            ps = [layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj, layer.head_gate]
            ps += layer.moe.linears() if layer.moe is not None else []
            for p in ps:
                lins.extend(p.parts if isinstance(p, Fused) else [] if p is None else [p])
        for lin in lins:
            if isinstance(lin.weight, QuantWeight):
                out.setdefault(id(lin.weight), lin.weight)
        return list(out.values())

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> h [N, E]: the embedding rows, times the family's embedding scale."""
        h = self.embed(ids.to(self.device))
        return h if self._embed_scale is None else h * self._embed_scale

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The final logit soft-cap (gemma2), if the family has one."""
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _add_norm(self, h: torch.Tensor, r: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add and the norm after it: (h + r, rms_norm(h + r, weight)), one fused op
        unless gemma3's fp16 residual clipping applies."""
        c = self.config
        if c.clip_residual_fp16 and h.dtype == torch.float16:
            bound = torch.finfo(torch.float16).max
            h = (h.float() + r.float()).clamp(-bound, bound).half()
            return h, ops.rms_norm(h, weight, c.rms_norm_eps, c.norm_offset)
        return ops.add_rms_norm(h, r, weight, c.rms_norm_eps, c.norm_offset)

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

    def forward_step(self, ids: torch.Tensor, step: Step, pool,
                     hidden: bool = False) -> torch.Tensor:
        """A batch step: ids [N] (all sequences' new tokens, flattened), KV in `pool`
        (k[layer], v[layer] [K, slots, D]). Returns logits float32 [rows, V], or with `hidden`
        the final norm's output [rows, E] (what embedding models pool)."""
        c = self.config
        if step.paged is not None:
            pb = step.paged

            def attend_paged(i: int, q):
                return ops.paged_prefill_attention(
                    q, pool.k[i], pool.v[i], pb.block_tables, pb.items, pool.block_size,
                    c.attn_scale, c.layer_window[i], c.attn_logit_softcap,
                    self.layers[i].sinks)

            return self._run(ids, pb.rope, pool, step.write_slots, attend_paged,
                             step.logits_rows, pb.positions, hidden)
        if (not hidden and self.device.type == "cpu" and all(sp.q_len == 1 for sp in step.spans)
                and cpu_decode.enabled() and cpu_decode.eligible(self)):
            return cpu_decode.run(self, ids, step, pool)
        tables: dict[int, tuple] = {}
        for rope in self.ropes:
            if id(rope.spec) not in tables:
                cs = [rope.cos_sin(sp.q_start, sp.q_len) for sp in step.spans]
                tables[id(rope.spec)] = (torch.cat([a for a, _ in cs]),
                                         torch.cat([b for _, b in cs]))

        def attend(i: int, q):
            kc, vc = pool.k[i], pool.v[i]
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
                qs = q[row:row + sp.q_len]
                if self._prefill_attend(i, qs, sp.q_start, lo, keys.shape[1]):
                    outs.append(prefill_attend.attention(qs, keys, values, c.attn_scale))
                else:
                    outs.append(ops.attention(qs, keys, values, sp.q_start, lo, c.attn_scale,
                                              window, c.attn_logit_softcap,
                                              self.layers[i].sinks))
                row += sp.q_len
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return self._run(ids, tables, pool, step.write_slots, attend, step.logits_rows,
                         hidden=hidden)

    def _prefill_attend(self, i: int, q: torch.Tensor, q_start: int, k_start: int,
                        s: int) -> bool:
        """Whether layer i's attention of this span runs `prefill_attend` (a whole bf16
        prompt on the CPU, where `native.prefill_attend_enabled` allows it)."""
        c, layer = self.config, self.layers[i]
        return (prefill_attend.takes(q, q_start, k_start, s, c.layer_window[i],
                                     c.attn_logit_softcap, layer.sinks)
                and native.prefill_attend_enabled(cpu_decode.served(layer.qkv)))

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, pool,
                       tables: dict) -> torch.Tensor:
        """One decode token of one sequence with every shape fixed and every index on the
        device, so the step can be captured in a CUDA graph. ids, pos [1] (device long); pool's
        slots are positions; tables: rope spec id -> (cos, sin) [capacity, R], indexed by pos
        in the RoPE kernel. Attention covers the whole capacity, its visibility computed from
        pos in the kernel (`ops.attention_at`)."""
        c = self.config

        def attend(i: int, q):
            return ops.attention_at(q, pool.k[i], pool.v[i], pos, c.layer_window[i],
                                    c.attn_scale, c.attn_logit_softcap, self.layers[i].sinks)

        if fused_decode.eligible(self):
            return fused_decode.run(self, ids, tables, pool, pos, attend)
        return self._run(ids, tables, pool, pos, attend, None, pos)

    def forward_paged(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      block_tables: torch.Tensor, ctx_lens: torch.Tensor, pool,
                      tables: dict) -> torch.Tensor:
        """One decode token for each of B sequences of a paged pool, every shape fixed and every
        index on the device (the serving engine captures it per batch bucket). ids, pos, slots
        [B] long (token, its position, its cache slot); block_tables [B, W] int32; ctx_lens [B]
        = pos + 1; tables: rope spec id -> (cos, sin) [positions, R]. Returns logits
        float32 [B, V]."""
        c = self.config

        def attend(i: int, q):
            return ops.paged_attention(q, pool.k[i], pool.v[i], block_tables, ctx_lens,
                                       pool.block_size, c.attn_scale, c.layer_window[i],
                                       c.attn_logit_softcap, self.layers[i].sinks)

        return self._run(ids, tables, pool, slots, attend, None, pos)

    def _run(self, ids: torch.Tensor, tables: dict, pool, slots: torch.Tensor, attend,
             rows, positions: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
        """Embedding, the layers, final norm and LM head (only for `rows` of N if given).
        Layer i writes the new tokens' k/v to cache slots `slots` [N] of pool.k/v[i], then
        attends through `attend(i, q [N, H, D]) -> [N, H, D]`. tables: rope spec id -> (cos,
        sin), the tokens' rows [N|1, R], or with `positions` [N] (device long) whole tables
        that the RoPE kernel indexes by them. Returns logits float32."""
        c = self.config
        n = ids.shape[0]
        h = self.embed_tokens(ids)  # [N, E]
        eps, off = c.rms_norm_eps, c.norm_offset
        # layer 0's input norm; every later norm runs fused with the residual add before it
        x = ops.rms_norm(h, self.layers[0].input_norm, eps, off)
        for i, layer in enumerate(self.layers):
            if layer.external is not None:
                h, m = layer.external(x, h, i, pool, slots)
                h, x = self._next_norm(i, h, m, rows)
                continue
            rope = self.ropes[i]
            cos, sin = tables[id(rope.spec)]  # [N|1, R], or [P, R] with positions
            heads = c.heads(i)
            q = ops.qkv_rope_write(layer.qkv(x), heads, c.num_kv_heads, c.head_dim,
                                   layer.q_norm, layer.k_norm, eps, off, rope.scale, cos, sin,
                                   rope.spec.traditional, pool.k[i], pool.v[i], slots,
                                   positions)
            a = attend(i, q).reshape(n, heads * c.head_dim)
            if layer.head_gate is not None:
                a = ops.head_gate(a, layer.head_gate(x))
            o = layer.o_proj(a)
            if layer.post_attn_norm is not None:
                o = ops.rms_norm(o, layer.post_attn_norm, eps, off)
            h, x = self._add_norm(h, o, layer.mlp_norm)
            m = layer.moe(x) if layer.moe is not None else self._mlp(layer, x)
            if layer.post_mlp_norm is not None:
                m = ops.rms_norm(m, layer.post_mlp_norm, eps, off)
            h, x = self._next_norm(i, h, m, rows)
        return x if hidden else self.cap_logits(self.head(x).float())

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP down(act(gate) * up), with the parts the layer computes elsewhere."""
        if layer.mlp_input is None and layer.mlp_act is None:
            return layer.down_proj(_gated_act(layer.gate_up, x, self.config.hidden_act))
        if layer.mlp_input is not None:
            x = layer.mlp_input(x)
        if layer.mlp_act is None:
            return layer.down_proj(_gated_act(layer.gate_up, x, self.config.hidden_act))
        return layer.down_proj(layer.mlp_act(*layer.gate_up(x).chunk(2, dim=-1)))

    def _next_norm(self, i: int, h: torch.Tensor, m: torch.Tensor,
                   rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's closing residual add and the norm after it: the next layer's input norm,
        or the final norm on the wanted rows only."""
        if i + 1 < len(self.layers):
            return self._add_norm(h, m, self.layers[i + 1].input_norm)
        if rows is not None:
            h, m = h.index_select(0, rows), m.index_select(0, rows)
        return self._add_norm(h, m, self.norm)
