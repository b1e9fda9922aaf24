"""The gemma4_text decoder (mlx-lm 0.32.2's gemma4_text; also the text part of gemma4).

Per layer: sandwich-normed attention (scale 1.0; q/k RMSNorm with weights, v RMSNorm without;
sliding layers rotate all head_dim features, full layers use a 512-wide head with proportional
RoPE), a sandwich-normed GeGLU MLP, then the per-layer-embedding (PLE) gate
h += norm(proj(gelu_tanh(gate(h)) * ple_i)), and the layer scalar. The MoE variant adds routed
GeGLU experts beside the MLP (`Gemma4Experts`), each branch with its own post-norm. The last
num_kv_shared_layers layers compute no K/V: they attend the cache of the last unshared layer of
their type (stored once). Logits are soft-capped. Every Python-float scale multiplies in the
activations' dtype, as mlx does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..config import ModelConfig
from ..config.hybrid import Gemma4Spec
from ..layers import Embedding, Linear, Rope
from ..ops.recurrent.reference import _scalar
from ..quant import QuantWeight
from . import cpu_gemma4_decode
from .decoder import Fused, _gated_act
from .hybrid_cache import HybridCache, LayerShape, layer_shapes
from .moe import MoeBlock
from .padded_attention import padded_decode_attention
from .qwen3_5 import linears
from .slot_pool import SlotPool


@dataclass
class Gemma4Layer:
    """One layer's weights; kv is None on KV-shared layers ([k | v], or k alone with k = v)."""

    input_norm: torch.Tensor
    q_proj: Linear
    kv: Linear | Fused | None
    o_proj: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor
    pre_mlp_norm: torch.Tensor
    gate_up: Linear | Fused
    down_proj: Linear
    post_mlp_norm: torch.Tensor
    scalar: torch.Tensor  # [1]
    ple_gate: Linear | None = None  # E -> P
    ple_proj: Linear | None = None  # P -> E
    ple_norm: torch.Tensor | None = None
    moe: Gemma4Experts | None = None  # the MoE variant (26B-A4B): experts beside the MLP


@dataclass
class Gemma4Experts:
    """The MoE variant's extra per-layer weights: the block (router proj, GeGLU experts),
    the router's norm weight (scale [E] times E^-0.5, rounded in its dtype as mlx-lm
    computes it), per_expert_scale [X], and the three extra norms [E]."""

    block: MoeBlock
    router_norm: torch.Tensor
    per_expert_scale: torch.Tensor
    pre_norm: torch.Tensor  # pre_feedforward_layernorm_2 (the experts' input)
    post_mlp_norm: torch.Tensor  # post_feedforward_layernorm_1 (the dense MLP's output)
    post_norm: torch.Tensor  # post_feedforward_layernorm_2 (the experts' output)

    def capturable(self, device: torch.device) -> bool:
        """As its block's (the routing, scaling and combine around it are device ops)."""
        return self.block.capturable(device)

    def __call__(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """The routed experts' output for residual rows h [N, E] (router on h itself,
        experts on their own norm of h): post_norm(sum_k w_k expert_k(pre_norm(h)))."""
        logits = self.block.router(ops.rms_norm(h, self.router_norm, eps))
        ids, w = ops.moe_route(logits, "topk_softmax", self.block.spec.top_k)
        w = w * self.per_expert_scale[ids]
        x = ops.rms_norm(h, self.pre_norm, eps)
        blk = self.block
        if blk.use_kernels(x.device):  # the GeGLU experts on the MoE kernels (CUDA)
            s = blk.spec
            y = ops.moe_experts(x, ids, w, *blk.quant, s.expert_act, s.act_alpha, s.act_limit,
                                x.dtype)
        else:
            y = ops.moe_combine(blk.experts(x, ids), w, x.dtype)
        return ops.rms_norm(y, self.post_norm, eps)


@dataclass
class PerLayerEmbedding:
    """table [V, L*P] (gathered), model_proj E -> L*P, norm [P]."""

    table: Embedding
    model_proj: Linear
    norm: torch.Tensor


class Gemma4Decoder:
    """Embedding (+ PLE) -> layers -> final norm -> LM head -> soft-cap, over one sequence's
    HybridCache. The single-sequence decode step (`forward_static`) can be captured in a CUDA
    graph (`graphable`; the MoE variant where its block runs the MoE kernels)."""

    graphable = True
    cache_snapshots = True  # HybridCache.copy: prefix caching in the engine

    def __init__(self, config: ModelConfig, embed: Embedding, ple: PerLayerEmbedding | None,
                 layers: list[Gemma4Layer], norm: torch.Tensor, lm_head: Linear | None,
                 dtype: torch.dtype, device: torch.device):
        self.config, self.embed, self.ple, self.layers = config, embed, ple, layers
        self.norm, self.lm_head, self.dtype, self.device = norm, lm_head, dtype, device
        self.spec: Gemma4Spec = config.arch
        # one Rope (one device table) per distinct spec; the config shares a spec per layer type
        kinds = {id(r): Rope(r, device) for r in config.layer_rope}
        self.ropes = [kinds[id(r)] for r in config.layer_rope]
        self._rope_kinds = list(kinds.values())
        self._ones = {d: torch.ones(d, dtype=dtype, device=device)
                      for d in set(self.spec.head_dims)}

    @property
    def head(self) -> Linear:
        return self.lm_head if self.lm_head is not None else self.embed.as_linear

    def quant_weights(self) -> list[QuantWeight]:
        lins = [self.head] + ([self.ple.model_proj] if self.ple else [])
        for ly in self.layers:
            lins += linears([p for p in (ly.q_proj, ly.kv, ly.o_proj, ly.gate_up, ly.down_proj,
                                         ly.ple_gate, ly.ple_proj) if p is not None]
                            + (ly.moe.block.linears() if ly.moe is not None else []))
        return list({id(ln.weight): ln.weight for ln in lins
                     if isinstance(ln.weight, QuantWeight)}.values())

    def layer_shapes(self) -> list[LayerShape]:
        return layer_shapes(self.config)

    def new_cache(self, capacity: int = 256) -> HybridCache:
        return HybridCache(self.layer_shapes(), self.dtype, self.device, capacity)

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: (norm(model_proj(h) * E^-0.5) + table[ids] * sqrt(P)) * 2^-0.5."""
        c, p = self.config, self.ple
        t, n, dim = ids.shape[0], c.num_layers, self.spec.ple_dim
        table = _scalar(p.table(ids), dim**0.5).reshape(t, n, dim)
        proj = _scalar(p.model_proj(h), c.hidden_size**-0.5).reshape(t, n, dim)
        proj = ops.rms_norm(proj, p.norm, c.rms_norm_eps)
        return _scalar(proj + table, 2.0**-0.5)

    def _qkv(self, i: int, ly: Gemma4Layer, q: torch.Tensor, kv: torch.Tensor | None,
             cos: torch.Tensor, sin: torch.Tensor, norm=ops.rms_norm) -> tuple:
        """One sequence's rows of the q projection q [T, H*D] (and of [k | v], None on a
        KV-shared layer) -> q [T, H, D] normed (by norm(x, w, eps): `ops.rms_norm`'s values)
        and rotated, and the layer's own K/V [K, T, D] (None on a KV-shared layer)."""
        c, s = self.config, self.spec
        t, d, kh = q.shape[0], s.head_dims[i], s.kv_heads[i]
        eps = c.rms_norm_eps
        q = ops.rope(norm(q.reshape(t, c.num_heads, d), ly.q_norm, eps), cos, sin, False)
        if kv is None:
            return q, None, None
        k = kv[:, :kh * d].reshape(t, kh, d)
        v = k if s.k_eq_v[i] else kv[:, kh * d:].reshape(t, kh, d)
        k = ops.rope(norm(k, ly.k_norm, eps), cos, sin, False)
        v = norm(v, self._ones[d], eps)
        return q, k.transpose(0, 1), v.transpose(0, 1)

    def _qkv_write(self, i: int, ly: Gemma4Layer, q: torch.Tensor, kv: torch.Tensor | None,
                   rope: tuple, pool, slots: torch.Tensor | None) -> torch.Tensor:
        """`_qkv`'s values for a decode step's rows, the layer's own K/V written to
        pool.k / pool.v[i] [K, S, D] at slots [N] (device long; kv None on a KV-shared layer:
        nothing written): `ops.split_qkv_norm_rope_write`, one launch with
        MLXR_GEMMA4_QKV_FUSED=1. Returns q [N, H, D]."""
        s, d = self.spec, self.spec.head_dims[i]
        own = kv is not None
        return ops.split_qkv_norm_rope_write(
            q, kv, self.config.num_heads, s.kv_heads[i], d, ly.q_norm, ly.k_norm,
            self._ones[d], self.config.rms_norm_eps, *rope, False, s.k_eq_v[i],
            pool.k[i] if own else None, pool.v[i] if own else None, slots)

    def _attend_rows(self, i: int, ly: Gemma4Layer, q: torch.Tensor, kv: torch.Tensor | None,
                     cache: HybridCache, start: int, cos: torch.Tensor, sin: torch.Tensor,
                     seen: dict, norm=ops.rms_norm, attention=ops.attention) -> torch.Tensor:
        """One sequence's rows at positions [start, +T) -> attention output [T, H*D] (before
        o_proj). The layer's own K/V go to the cache; seen[i] keeps the K/V this forward
        attends (the window's earlier positions and the new ones, in order), which the
        KV-shared layers reading layer i attend too (a ring may no longer hold a long chunk's
        first positions)."""
        c, s = self.config, self.spec
        q, k, v = self._qkv(i, ly, q, kv, cos, sin, norm)
        if k is not None:
            seen[i] = cache.extend(i, k, v, start)
        keys, values, lo = seen[s.kv_source[i]]
        out = attention(q, keys, values, start, lo, c.attn_scale, c.layer_window[i])
        return out.reshape(q.shape[0], c.num_heads * s.head_dims[i])

    def _layers(self, ids: torch.Tensor, attend) -> torch.Tensor:
        """Embedding and the layers over rows ids [N]; attend(i, layer, x) -> the attention
        output [N, E] (after o_proj). Returns h [N, E] before the final norm."""
        lean = cpu_gemma4_decode.plan(self, ids.shape[0])
        if lean is not None:  # a CPU decode step: the same values in fewer calls
            return cpu_gemma4_decode.layers(self, lean, ids, attend)
        c = self.config
        eps = c.rms_norm_eps
        h = _scalar(self.embed(ids), c.embed_scale)
        ple = self._per_layer_inputs(ids, h) if self.ple is not None else None
        # Each branch's output is normed, added, (the layer's last one) scaled, and normed for
        # the next branch: one `residual_norm` each (one launch on CUDA), x the next input.
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        nexts = [ly.input_norm for ly in self.layers[1:]] + [None]
        for i, (ly, nxt) in enumerate(zip(self.layers, nexts)):
            h, x = ops.residual_norm(h, attend(i, ly, x), ly.post_attn_norm, eps,
                                     next_weight=ly.pre_mlp_norm)
            m = ly.down_proj(_gated_act(ly.gate_up, x, c.hidden_act))
            if ly.moe is not None:  # norm(m) + experts(h), added in the other order: the same
                m, _ = ops.residual_norm(ly.moe(h, eps), m, ly.moe.post_mlp_norm, eps)
            if ple is None:
                h, x = ops.residual_norm(h, m, ly.post_mlp_norm, eps, ly.scalar, nxt)
                continue
            # the per-layer-input branch: residual norm, gate GEMV and act, projection GEMV
            # and residual norm (two launches at decode on CUDA; MLXR_GEMMA4_PLE_FUSED=0: five)
            h, g = ops.residual_linear_act(h, m, ly.post_mlp_norm, eps, ly.ple_gate,
                                           ple[:, i], c.hidden_act)
            h, x = ops.linear_residual_norm(g, ly.ple_proj, h, ly.ple_norm, eps, ly.scalar, nxt)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        lean = cpu_gemma4_decode.plan(self, h.shape[0])
        head = self.head if lean is None else lean.head
        norm = cpu_gemma4_decode.norm_fn(lean)
        logits = head(norm(h, self.norm, self.config.rms_norm_eps)).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, ids: torch.Tensor, cache: HybridCache,
                last_only: bool = False) -> torch.Tensor:
        """Run ids [T] at positions [cache.length, +T); logits float32 [T|1, V]."""
        h = self._rows(ids, cache)
        return self._logits(h[-1:] if last_only else h)

    def pads_fit(self, cache: HybridCache, bucket: int) -> bool:
        """Whether a prompt padded to `bucket` tokens may prefill `cache` (`forward_padded`):
        no MoE layer (the experts' torch path groups tokens on the host), and room for
        `bucket` positions (the full layers' buffers; a ring takes any bucket:
        `HybridCache.write_padded` keeps each slot's last real position)."""
        return all(ly.moe is None for ly in self.layers) and bucket <= cache.capacity

    def forward_padded(self, ids: torch.Tensor, row: torch.Tensor,
                       cache: HybridCache) -> torch.Tensor:
        """A prompt padded at its end to ids [B] (device), at positions [0, B) of an emptied
        cache, with no host value read (the prefill graph, `PaddedPrefillGraph`): logits
        float32 [1, V] of row [1] (device long; the prompt's last). The padding is invisible
        to the rows before it (causal), every row attends the forward's own K/V (not the
        rings, which a long prompt wraps), and the cache keeps what an unpadded prefill
        leaves there (`HybridCache.padded_sources`); the pad K/V that full layers store at
        positions >= n are overwritten by decode steps before any query sees them. Every
        tensor made here is made anew in each call (a capture owns it): nothing is cached on
        the HybridCache by host values (`_ring_slots`)."""
        c, s = self.config, self.spec
        t = ids.shape[0]
        cache.length = 0
        cache.reserve(t)
        tables = {id(r.spec): r.cos_sin(0, t) for r in self._rope_kinds}
        sources = cache.padded_sources(row, t)
        seen: dict = {}

        def attend(i: int, ly: Gemma4Layer, x: torch.Tensor) -> torch.Tensor:
            kv = ly.kv(x) if ly.kv is not None else None
            q, k, v = self._qkv(i, ly, ly.q_proj(x), kv, *tables[id(self.ropes[i].spec)])
            if k is not None:
                cache.write_padded(i, k, v, sources)
                seen[i] = k, v
            keys, values = seen[s.kv_source[i]]
            out = ops.attention(q, keys, values, 0, 0, c.attn_scale, c.layer_window[i])
            return ly.o_proj(out.reshape(t, c.num_heads * s.head_dims[i]))

        h = self._layers(ids, attend)
        cache.length = t
        return self._logits(h.index_select(0, row))

    def _rows(self, ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """The layers over ids [T] at positions [cache.length, +T), the cache extended: the
        hidden rows [T, E] before the final norm."""
        t, start = ids.shape[0], cache.length
        cache.reserve(start + t)
        tables = {id(r.spec): r.cos_sin(start, t) for r in self._rope_kinds}
        lean = cpu_gemma4_decode.plan(self, t)
        pj = self.layers if lean is None else lean.layers  # the layers' own, or direct calls
        norm, attn = cpu_gemma4_decode.norm_fn(lean), cpu_gemma4_decode.attention_fn(lean)

        def attend(i: int, ly: Gemma4Layer, x: torch.Tensor) -> torch.Tensor:
            p = pj[i]
            kv = p.kv(x) if p.kv is not None else None
            return p.o_proj(self._attend_rows(i, ly, p.q_proj(x), kv, cache, start,
                                              *tables[id(self.ropes[i].spec)], seen, norm,
                                              attn))

        seen: dict = {}

        h = self._layers(ids.to(self.device), attend)
        cache.length = start + t
        return h

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, pool: HybridCache,
                       tables: dict) -> torch.Tensor:
        """One decode token ids [1] at position pos [1] (device long) with every shape fixed
        and no host value read, so the step can be captured in a CUDA graph (the cache's
        length is the caller's). tables: rope spec id -> (cos, sin) [capacity, R], gathered
        at pos. K/V are written at slot pos % slots; attention covers the layer's whole
        buffer, its visibility computed from pos. Logits float32 [1, V]."""
        c, s = self.config, self.spec
        rows = {key: (cos.index_select(0, pos), sin.index_select(0, pos))
                for key, (cos, sin) in tables.items()}
        slots = pool.step_slots(pos)  # buffer length -> (write slot, last visible slot)

        def attend(i: int, ly: Gemma4Layer, x: torch.Tensor) -> torch.Tensor:
            own = ly.kv is not None
            q = self._qkv_write(i, ly, ly.q_proj(x), ly.kv(x) if own else None,
                                rows[id(self.ropes[i].spec)], pool,
                                slots[pool.k[i].shape[1]][0] if own else None)
            src = s.kv_source[i]
            out = ops.attention_at(q, pool.k[src], pool.v[src], slots[pool.k[src].shape[1]][1],
                                   None, c.attn_scale)
            return ly.o_proj(out.reshape(1, c.num_heads * s.head_dims[i]))

        return self._logits(self._layers(ids, attend))

    def forward_batch_static(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                             states: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                             pool: SlotPool, rope: dict) -> torch.Tensor:
        """One decode token for each of B sequences of a SlotPool, every shape fixed and no
        host value read (Qwen35Decoder.forward_batch_static's arguments). Full layers write
        and attend through the block tables; a sliding layer's ring of R slots is read as a
        paged cache of block size R whose block is the sequence's state slot (its lens
        min(pos + 1, R): a wrapped ring holds only visible positions). Logits float32 [B, V]."""
        c, s = self.config, self.spec
        rows = {key: (cos.index_select(0, pos), sin.index_select(0, pos))
                for key, (cos, sin) in rope.items()}
        # where each layer kind writes and what it reads: (write slots, tables, lens, bs)
        at = {None: (slots, tables, lens, pool.block_size)}
        for r in {r for r in pool.ring if r}:
            at[r] = (states * r + torch.remainder(pos, r), states[:, None].to(torch.int32),
                     torch.clamp(lens, max=r), r)

        def attend(i: int, ly: Gemma4Layer, x: torch.Tensor) -> torch.Tensor:
            src = s.kv_source[i]
            put, tab, ctx, bs = at[pool.ring[src]]
            own = ly.kv is not None
            q = self._qkv_write(i, ly, ly.q_proj(x), ly.kv(x) if own else None,
                                rows[id(self.ropes[i].spec)], pool, put if own else None)
            out = ops.paged_attention(q, pool.k[src], pool.v[src], tab, ctx, bs, c.attn_scale)
            return ly.o_proj(out.reshape(q.shape[0], c.num_heads * s.head_dims[i]))

        return self._logits(self._layers(ids, attend))

    def forward_batch(self, ids: torch.Tensor, caches: list[HybridCache]) -> torch.Tensor:
        """One new token for each of B sequences (ids [B]): projections, MLPs, PLE and the
        attention batched (`padded_decode_attention` over each sequence's visible K/V), the
        K/V written to each sequence's own cache. Logits float32 [B, V]."""
        starts = [c.length for c in caches]
        for c in caches:
            c.reserve(c.length + 1)
        tables = {}
        for r in self._rope_kinds:
            cs = [r.cos_sin(s, 1) for s in starts]
            tables[id(r.spec)] = (torch.cat([a for a, _ in cs]), torch.cat([b for _, b in cs]))
        pj = cpu_gemma4_decode.projections(self, len(caches))
        norm = cpu_gemma4_decode.norm_fn(cpu_gemma4_decode.plan(self, len(caches)))

        def attend(i: int, ly: Gemma4Layer, x: torch.Tensor) -> torch.Tensor:
            p = pj[i]
            kv = p.kv(x) if p.kv is not None else None
            # B rows: norms and RoPE row by row, each row its own position's angles
            q, k, v = self._qkv(i, ly, p.q_proj(x), kv, *tables[id(self.ropes[i].spec)], norm)
            src = self.spec.kv_source[i]
            for b, c in enumerate(caches):  # each sequence's K/V into its own cache
                if k is not None:
                    seen[b][i] = c.extend(i, k[:, b:b + 1], v[:, b:b + 1], starts[b])
            out = padded_decode_attention(q, [s[src][0] for s in seen],
                                          [s[src][1] for s in seen], self.config.attn_scale)
            return p.o_proj(out.reshape(len(caches), -1))

        seen: list[dict] = [{} for _ in caches]

        h = self._layers(ids.to(self.device), attend)
        for c, s in zip(caches, starts):
            c.length = s + 1
        return self._logits(h)
