"""The qwen3_5 decoder (mlx-lm's qwen3_5, qwen3_5_moe and qwen3_next): gated DeltaNet layers
beside gated softmax-attention layers, each followed by a SwiGLU MLP or the MoE block
(`moe.MoeBlock`: softmax router, shared expert under a sigmoid gate).

Full-attention layers (mlx-lm's Qwen3NextAttention): q_proj gives per head [q | gate] (the halves
interleaved per head, not all q first); q/k RMSNorm over D, partial rotate-half RoPE, causal
attention, then o_proj(out * sigmoid(gate)). Norm weights are used as stored (mlx-community
files already hold HF's 1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..config import ModelConfig
from ..config.hybrid import GatedDeltaSpec
from ..layers import Embedding, Linear, Rope
from ..quant import QuantWeight
from . import cpu_hybrid_decode
from .decoder import Fused, _gated_act
from .gated_delta import GatedDeltaMixer
from .hybrid_cache import HybridCache, LayerShape, layer_shapes
from .moe import MoeBlock
from .padded_attention import padded_decode_attention
from .slot_pool import SlotPool


@dataclass
class GatedAttention:
    """qkv: [q|gate per head (2*H*D) | k (K*D) | v (K*D)]; q_norm / k_norm [D]."""

    qkv: Linear | Fused
    o_proj: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass
class HybridLayer:
    input_norm: torch.Tensor
    mixer: GatedDeltaMixer | GatedAttention
    mlp_norm: torch.Tensor
    gate_up: Linear | Fused | None  # [gate | up] (None: a MoE layer)
    down_proj: Linear | None
    moe: MoeBlock | None = None


def linears(parts: list) -> list[Linear]:
    """The Linears of projections (a Fused one's parts)."""
    out = []
    for p in parts:
        out.extend(p.parts if isinstance(p, Fused) else [p])
    return out


def _delta_rows(m: GatedDeltaMixer, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                states: torch.Tensor) -> torch.Tensor:
    """A gated DeltaNet decode step of rows x [B, E] whose states are rows `states` [B] of
    the pools conv [S, W-1, C] / ssm [S, Hv, Dv, Dk] (`GatedDeltaMixer.decode_rows`; the C
    extension's CPU step on gathered states, scattered back)."""
    if not cpu_hybrid_decode.enabled(x):
        return m.decode_rows(x, conv, ssm, states)
    cs, ss = conv.index_select(0, states), ssm.index_select(0, states)
    out = cpu_hybrid_decode.delta_step(m, x, cs, ss)
    conv.index_copy_(0, states, cs)
    ssm.index_copy_(0, states, ss)
    return out


class Qwen35Decoder:
    """Embedding -> hybrid layers -> final norm -> LM head over one sequence's HybridCache.
    The single-sequence decode step (`forward_static`: conv and recurrent states updated in
    place, position on the device) can be captured in a CUDA graph (`graphable`; the MoE
    families where their blocks run the MoE kernels)."""

    graphable = True
    cache_snapshots = True  # HybridCache.copy: prefix caching in the engine
    _qkv_cols: torch.Tensor | None = None  # `_split_gate`'s columns, made at the first call

    def __init__(self, config: ModelConfig, embed: Embedding, layers: list[HybridLayer],
                 norm: torch.Tensor, lm_head: Linear | None, dtype: torch.dtype,
                 device: torch.device):
        self.config, self.embed, self.layers, self.norm = config, embed, layers, norm
        self.lm_head, self.dtype, self.device = lm_head, dtype, device
        self.spec: GatedDeltaSpec = config.arch
        self.ropes = [Rope(config.layer_rope[0], device)]

    @property
    def head(self) -> Linear:
        return self.lm_head if self.lm_head is not None else self.embed.as_linear

    def quant_weights(self) -> list[QuantWeight]:
        """Every quantized weight the forward multiplies by, once each."""
        lins = [self.head]
        for layer in self.layers:
            m = layer.mixer
            mix = [m.in_proj, m.out_proj] if isinstance(m, GatedDeltaMixer) else [m.qkv,
                                                                                  m.o_proj]
            mlp = [layer.gate_up, layer.down_proj] if layer.moe is None else layer.moe.linears()
            lins += linears(mix + mlp)
        return list({id(ln.weight): ln.weight for ln in lins
                     if isinstance(ln.weight, QuantWeight)}.values())

    def layer_shapes(self) -> list[LayerShape]:
        return layer_shapes(self.config)

    def new_cache(self, capacity: int = 256) -> HybridCache:
        return HybridCache(self.layer_shapes(), self.dtype, self.device, capacity)

    def _split_gate(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the qkv projection proj [T, 2HD + 2KD] -> (qkv [T, HD + 2KD] with the
        gate halves taken out: one gather of fixed columns, gate [T, H, D]: a view)."""
        c = self.config
        t, h, d = proj.shape[0], c.num_heads, c.head_dim
        if self._qkv_cols is None or self._qkv_cols.device != proj.device:
            q = (torch.arange(h)[:, None] * 2 * d + torch.arange(d)).reshape(-1)
            kv = torch.arange(2 * h * d, proj.shape[1])
            self._qkv_cols = torch.cat((q, kv)).to(proj.device)
        gate = proj[:, :2 * h * d].reshape(t, h, 2 * d)[..., d:]
        return proj.index_select(1, self._qkv_cols), gate

    def _gated_out(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output out [T, H, D] times sigmoid(gate [T, H, D]) -> [T, H*D] (one
        `ops.gated_act`; for T = 1 the gate rows are a strided view, not copied)."""
        t, h, d = gate.shape
        return ops.gated_act(gate.reshape(t * h, d), out.reshape(t * h, d),
                             "sigmoid").reshape(t, h * d)

    def _q_write(self, m: GatedAttention, qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """q/k norm and RoPE of qkv [T, HD + 2KD]; K/V written to slots `slots` [T] of the
        buffers k / v [K, slots, D]; returns q [T, H, D] (`ops.qkv_rope_write`; positions:
        cos / sin are whole tables)."""
        c = self.config
        return ops.qkv_rope_write(qkv, c.num_heads, c.num_kv_heads, c.head_dim, m.q_norm,
                                  m.k_norm, c.rms_norm_eps, 0.0, self.ropes[0].scale, cos, sin,
                                  False, k, v, slots, positions)

    def _gated_attention(self, m: GatedAttention, proj: torch.Tensor, cache: HybridCache,
                         i: int, start: int, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
        """One sequence's rows of the qkv projection proj [T, 2HD + 2KD] at positions
        [start, +T) -> attention output times sigmoid(gate) [T, H*D] (before o_proj); K/V
        written to the cache."""
        c = self.config
        t = proj.shape[0]
        qkv, gate = self._split_gate(proj)
        k, v, slots = cache.write_target(i, start, t)
        q = self._q_write(m, qkv, k, v, cos, sin, slots)
        out = ops.attention(q, *cache.visible(i, start + t), start, 0, c.attn_scale)
        return self._gated_out(out, gate)

    def _layers(self, h: torch.Tensor, mixer, last_only: bool) -> torch.Tensor:
        """The layers over rows h [N, E]; mixer(i, layer, x) -> the mixer's output [N, E].
        Returns the final-normed rows (the last one only with last_only)."""
        c = self.config
        eps = c.rms_norm_eps
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            h, x = ops.add_rms_norm(h, mixer(i, layer, x), layer.mlp_norm, eps)
            r = (layer.moe(x) if layer.moe is not None else
                 layer.down_proj(_gated_act(layer.gate_up, x, c.hidden_act)))
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            if nxt is self.norm and last_only:
                h, r = h[-1:], r[-1:]
            h, x = ops.add_rms_norm(h, r, nxt, eps)
        return x

    def _step_layers(self, h: torch.Tensor, mixer) -> torch.Tensor:
        """`_layers` for a decode step (one row per sequence): the CPU's lean loop where it
        serves (`cpu_hybrid_decode.layers`: the same values in fewer calls)."""
        x = cpu_hybrid_decode.layers(self, h, mixer) if cpu_hybrid_decode.enabled(h) else None
        return self._layers(h, mixer, False) if x is None else x

    def forward(self, ids: torch.Tensor, cache: HybridCache,
                last_only: bool = False) -> torch.Tensor:
        """Run ids [T] at positions [cache.length, +T) and return logits float32 [T|1, V]. A
        forward from position 0 starts from zero recurrent state."""
        t, start = ids.shape[0], cache.length
        cache.reserve(start + t)
        if start == 0:
            cache.clear_states()
        cos, sin = self.ropes[0].cos_sin(start, t)

        def mixer(i: int, layer: HybridLayer, x: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if isinstance(m, GatedDeltaMixer):
                if t == 1 and cpu_hybrid_decode.enabled(x):
                    return cpu_hybrid_decode.delta_step(m, x, cache.conv[i], cache.ssm[i])
                return m(x[None], cache.conv[i], cache.ssm[i])[0]
            return m.o_proj(self._gated_attention(m, m.qkv(x), cache, i, start, cos, sin))

        h = self.embed(ids.to(self.device))
        x = self._step_layers(h, mixer) if t == 1 else self._layers(h, mixer, last_only)
        cache.length = start + t
        return self.head(x).float()

    def pads_fit(self, cache: HybridCache, bucket: int) -> bool:
        """Whether a prompt padded to `bucket` tokens may prefill `cache` (`forward_padded`):
        no MoE layer (the experts' torch path groups tokens on the host) and room for
        `bucket` positions in the attention layers' K/V."""
        return all(ly.moe is None for ly in self.layers) and bucket <= cache.capacity

    def forward_padded(self, ids: torch.Tensor, row: torch.Tensor,
                       cache: HybridCache) -> torch.Tensor:
        """A prompt padded at its end to ids [B] (device), at positions [0, B) of a cache
        started over, with no host value read (the prefill graph, `PaddedPrefillGraph`):
        logits float32 [1, V] of row [1] (device long; the prompt's last). Attention is
        causal, so the padding is invisible to the rows before it; its K/V lands in slots
        >= n, which decode steps overwrite before any query sees them; the gated DeltaNet
        layers leave their states as row `row` leaves them (`GatedDeltaMixer`'s `last`)."""
        t = ids.shape[0]
        cache.length = 0
        cache.reserve(t)
        cache.clear_states()
        cos, sin = self.ropes[0].cos_sin(0, t)

        def mixer(i: int, layer: HybridLayer, x: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if isinstance(m, GatedDeltaMixer):
                return m(x[None], cache.conv[i], cache.ssm[i], row)[0]
            return m.o_proj(self._gated_attention(m, m.qkv(x), cache, i, 0, cos, sin))

        x = self._layers(self.embed(ids), mixer, False)
        cache.length = t
        return self.head(x.index_select(0, row)).float()

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, pool: HybridCache,
                       tables: dict) -> torch.Tensor:
        """One decode token ids [1] at position pos [1] (device long) with every shape fixed
        and no host value read, so the step can be captured in a CUDA graph (the cache's
        length is the caller's; the prefill before it started the states). The conv and
        recurrent states are updated in place; K/V written at slot pos, attention over the
        whole capacity with its visibility from pos. tables: rope spec id -> (cos, sin)
        [capacity, R], indexed by pos in the RoPE kernel. Logits float32 [1, V]."""
        c = self.config
        cos, sin = tables[id(self.ropes[0].spec)]

        def mixer(i: int, layer: HybridLayer, x: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if isinstance(m, GatedDeltaMixer):
                return m(x[None], pool.conv[i], pool.ssm[i])[0]
            qkv, gate = self._split_gate(m.qkv(x))
            q = self._q_write(m, qkv, pool.k[i], pool.v[i], cos, sin, pos, pos)
            out = ops.attention_at(q, pool.k[i], pool.v[i], pos, None, c.attn_scale)
            return m.o_proj(self._gated_out(out, gate))

        return self.head(self._layers(self.embed(ids), mixer, False)).float()

    def forward_batch_static(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                             states: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                             pool: SlotPool, rope: dict) -> torch.Tensor:
        """One decode token for each of B sequences of a SlotPool, every shape fixed and no
        host value read (the serving engine captures it per batch bucket: engine.hybrid_graphs).
        ids, pos [B] long; slots [B]: the token's K/V slot in the full layers' paged pool;
        states [B]: the sequence's state slot; tables [B, W] int32 block tables; lens [B] =
        pos + 1; rope: spec id -> (cos, sin) whole tables. Logits float32 [B, V]."""
        c = self.config
        cos, sin = rope[id(self.ropes[0].spec)]

        def mixer(i: int, layer: HybridLayer, x: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if isinstance(m, GatedDeltaMixer):
                return _delta_rows(m, x, pool.conv[i], pool.ssm[i], states)
            qkv, gate = self._split_gate(m.qkv(x))
            q = self._q_write(m, qkv, pool.k[i], pool.v[i], cos, sin, slots, pos)
            out = ops.paged_attention(q, pool.k[i], pool.v[i], tables, lens, pool.block_size,
                                      c.attn_scale)
            return m.o_proj(self._gated_out(out, gate))

        return self.head(self._layers(self.embed(ids), mixer, False)).float()

    def forward_batch(self, ids: torch.Tensor, caches: list[HybridCache]) -> torch.Tensor:
        """One new token for each of B sequences (ids [B], the next position of each cache):
        projections, MLPs, the recurrence (states gathered and written back) and the attention
        (`padded_decode_attention`) batched; each sequence's K/V written to its own cache.
        Returns logits float32 [B, V]."""
        starts = [c.length for c in caches]
        for c in caches:
            c.reserve(c.length + 1)
            if c.length == 0:
                c.clear_states()
        cs = [self.ropes[0].cos_sin(s, 1) for s in starts]
        cos, sin = torch.cat([a for a, _ in cs]), torch.cat([b for _, b in cs])

        def mixer(i: int, layer: HybridLayer, x: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if isinstance(m, GatedDeltaMixer):
                conv = torch.cat([c.conv[i] for c in caches])
                ssm = torch.cat([c.ssm[i] for c in caches])
                out = (cpu_hybrid_decode.delta_step(m, x, conv, ssm)
                       if cpu_hybrid_decode.enabled(x) else m(x[:, None], conv, ssm)[:, 0])
                for b, c in enumerate(caches):
                    c.conv[i].copy_(conv[b:b + 1])
                    c.ssm[i].copy_(ssm[b:b + 1])
                return out
            qkv, gate = self._split_gate(m.qkv(x))
            q = torch.cat([self._q_write(m, qkv[b:b + 1], c.k[i], c.v[i], cos[b:b + 1],
                                         sin[b:b + 1],
                                         torch.tensor([starts[b]], device=self.device))
                           for b, c in enumerate(caches)])  # each K/V into its own cache
            ctx = [s + 1 for s in starts]
            out = padded_decode_attention(q, [c.k[i][:, :n] for c, n in zip(caches, ctx)],
                                          [c.v[i][:, :n] for c, n in zip(caches, ctx)],
                                          self.config.attn_scale)
            return m.o_proj(self._gated_out(out, gate))

        x = self._step_layers(self.embed(ids.to(self.device)), mixer)
        for c, s in zip(caches, starts):
            c.length = s + 1
        return self.head(x).float()
