"""The gated DeltaNet mixer of qwen3_5's linear-attention layers (mlx-lm's GatedDeltaNet).

x -> [qkv | z | b | a] (one projection) -> causal conv + SiLU over qkv (rolling state of the last
W-1 inputs) -> q, k L2-normalised -> gated delta rule (float32 state [Hv, Dv, Dk]) ->
RMSNormGated(y, z) -> out_proj. The states live in the caller's cache and are updated in place.
A decode step (T = 1) runs everything between the two projections as one op
(`ops.gated_delta_decode`: one Triton launch on CUDA); MLXR_GDN_FUSED=0 (read at each call)
keeps the op-by-op path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config.hybrid import GatedDeltaSpec
from ..layers import Linear
from .. import ops
from ..ops.recurrent import reference as recurrent
from .decoder import Fused


@dataclass
class GatedDeltaMixer:
    """One layer's weights. in_proj: [qkv (C) | z (Hv*Dv) | b (Hv) | a (Hv)] outputs; conv
    [C, W]; a_log [Hv] float32; dt_bias [Hv] and norm [Dv] in the compute dtype."""

    spec: GatedDeltaSpec
    in_proj: Linear | Fused
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out_proj: Linear
    eps: float

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 last: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, E] (B sequences of T new tokens each) -> [B, T, E]. conv_state
        [B, W-1, C] (x's dtype) and ssm_state [B, Hv, Dv, Dk] (float32, contiguous) are the
        sequences' states before these tokens; both are overwritten with the states after
        them. last [1] (device long, a padded prompt: `Qwen35Decoder.forward_padded`): rows
        after it are padding, and the states are left as row `last` leaves them."""
        s = self.spec
        bsz, t, _ = x.shape
        proj = self.in_proj(x.reshape(bsz * t, -1)).reshape(bsz, t, -1)
        if t == 1 and last is None and os.environ.get("MLXR_GDN_FUSED", "1") != "0":
            heads = (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim)
            out = ops.gated_delta_decode(proj[:, 0], conv_state, ssm_state, self.conv,
                                         self.a_log, self.dt_bias, self.norm, heads, self.eps)
            return self.out_proj(out).reshape(bsz, 1, -1)
        qkv, z, b, a = proj.split([s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], -1)
        if last is not None:  # the inputs of positions last-W+2..last (state before them)
            seq = torch.cat((conv_state, qkv.to(conv_state.dtype)), 1)  # [B, W-1+T, C]
            tail = seq.index_select(1, last + 1 + torch.arange(conv_state.shape[1],
                                                               device=x.device))
        mixed, new_conv = ops.conv1d_silu(qkv, conv_state, self.conv)
        conv_state.copy_(new_conv if last is None else tail)
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], -1)
        q, k = recurrent.l2norm_qk(q.reshape(bsz, t, s.num_k_heads, s.k_head_dim),
                                   k.reshape(bsz, t, s.num_k_heads, s.k_head_dim))
        g, beta = recurrent.delta_gates(a, b, self.a_log, self.dt_bias)
        if last is not None:  # padding rows: decay 1, no update (S * 1 + 0 k^T: S exactly)
            pad = (torch.arange(t, device=x.device) > last)[None, :, None]
            g = g.masked_fill(pad, 1.0)
            beta = beta.masked_fill(pad, 0.0)
        y = ops.gated_delta(q, k, v.reshape(bsz, t, s.num_v_heads, s.v_head_dim), g, beta,
                            ssm_state)
        out = recurrent.rms_norm_gated(y, z.reshape(bsz, t, s.num_v_heads, s.v_head_dim),
                                       self.norm, self.eps)
        return self.out_proj(out.reshape(bsz * t, s.value_dim)).reshape(bsz, t, -1)

    def decode_rows(self, x: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
        """One decode token of each row of x [B, E], whose states are rows `rows` [B]
        (device long) of the pools conv_pool [S, W-1, C] / ssm_pool [S, Hv, Dv, Dk], updated
        there -> [B, E]. The fused step reads and writes the pools in place; with
        MLXR_GDN_FUSED=0 the op-by-op path runs on gathered states, scattered back."""
        if os.environ.get("MLXR_GDN_FUSED", "1") == "0":
            cs, ss = conv_pool.index_select(0, rows), ssm_pool.index_select(0, rows)
            out = self(x[:, None], cs, ss)[:, 0]
            conv_pool.index_copy_(0, rows, cs)
            ssm_pool.index_copy_(0, rows, ss)
            return out
        s = self.spec
        heads = (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim)
        out = ops.gated_delta_decode(self.in_proj(x), conv_pool, ssm_pool, self.conv,
                                     self.a_log, self.dt_bias, self.norm, heads, self.eps, rows)
        return self.out_proj(out)
