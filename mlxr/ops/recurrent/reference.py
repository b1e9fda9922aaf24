"""Plain-torch ops of the gated DeltaNet layer (qwen3_5): the spec, the CPU path, the oracle of
the Triton twins. Numerics follow mlx-lm 0.32.2 (`gated_delta.py`, `qwen3_next.py`): the
recurrent state is float32 and the recurrence runs sequentially in time, also for prefill.

Shapes: B sequences, T new tokens each, C conv channels (2*Hk*Dk + Hv*Dv), W conv kernel width,
Hk / Hv key / value heads, Dk / Dv their dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _scalar(x: torch.Tensor, s: float) -> torch.Tensor:
    """x * s with s first rounded to x's dtype, as mlx multiplies by a Python float (a fill,
    not a host-to-device copy: capturable in a CUDA graph)."""
    return x * torch.full((), s, dtype=x.dtype, device=x.device)


def conv1d_silu(x: torch.Tensor, state: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over time, then SiLU. x [B, T, C] the new inputs, state [B, W-1, C]
    the previous W-1 inputs (zeros at the start), weight [C, W] (tap j reads the input j-W+1
    steps back). Returns (silu(conv) [B, T, C] in x's dtype, the new state [B, W-1, C]: the
    last W-1 inputs)."""
    w = weight.shape[1]
    seq = torch.cat((state.to(x.dtype), x), dim=1)  # [B, W-1+T, C]
    t = x.shape[1]
    acc = seq[:, 0:t].float() * weight[:, 0].float()
    for j in range(1, w):
        acc = acc + seq[:, j:j + t].float() * weight[:, j].float()
    return F.silu(acc.to(x.dtype)), seq[:, t:].contiguous()


def l2norm_qk(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """mlx-lm's `normalize_qk`: q [.., Dk] -> q / ||q|| * Dk^-0.5 and k -> k / ||k||, each
    with eps added to the squared norm, written as its rms_norm (eps * Dk^-1 added to the mean
    square) times a scalar in the inputs' dtype."""
    dk = q.shape[-1]
    inv = dk**-0.5
    rms_eps = eps * inv**2

    def unit_rms(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + rms_eps)).to(x.dtype)

    return _scalar(unit_rms(q), inv**2), _scalar(unit_rms(k), inv)


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head gates from a, b [.., Hv]: decay g = exp(-exp(A_log) *
    softplus(a + dt_bias)) in float32 (A_log [Hv] float32; softplus in a's dtype, as mlx), and
    beta = sigmoid(b) in b's dtype."""
    sp = torch.logaddexp(a + dt_bias.to(a.dtype), torch.zeros((), dtype=a.dtype, device=a.device))
    g = torch.exp(-torch.exp(a_log.float()) * sp.float())
    return g, torch.sigmoid(b)


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule, token by token. q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (float32)
    and beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32, contiguous, updated in place (value
    head h reads key head h // (Hv / Hk)). Per token: S <- S * g; d = (v - S k) * beta;
    S <- S + d k^T; y = S q. Returns y [B, T, Hv, Dv] in q's dtype.

    The readouts are batched matrix-vector products (one pass over the state each): the same
    float32 math as mlx-lm's step, its Dk sums in another order. Both take their vector as a
    transposed [1, Dk] row: torch's CPU bmm runs a [Dk, 1] column ~6x slower (docs/perf.md,
    "CPU decode of the hybrid and MoE families")."""
    bsz, t, hv, dv = v.shape
    dk = k.shape[-1]
    rep = hv // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    qf = q.float().reshape(bsz, t, hv, dk, 1)
    kf = k.float().reshape(bsz, t, hv, 1, dk)
    vf, bf, gf = v.float(), beta.float(), g.float()
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("gated_delta: the state must be a contiguous float32 tensor")
    s = state.view(bsz * hv, dv, dk)
    ys = []
    for i in range(t):
        kt = kf[:, i].reshape(bsz * hv, 1, dk)
        s.mul_(gf[:, i].reshape(bsz * hv, 1, 1))
        kv = torch.bmm(s, kt.transpose(1, 2))  # [B*Hv, Dv, 1]
        delta = (vf[:, i].reshape(bsz * hv, dv, 1) - kv) * bf[:, i].reshape(bsz * hv, 1, 1)
        s.baddbmm_(delta, kt)  # S + d k^T
        y = torch.bmm(s, qf[:, i].reshape(bsz * hv, 1, dk).transpose(1, 2))
        ys.append(y.reshape(bsz, hv, dv).to(q.dtype))
    return torch.stack(ys, 1)


CHUNK = 64  # tokens per chunk of the chunked form (the Triton kernel's tile height)
LOG_G_MIN = -80.0  # log of a decay that underflowed to 0: e^-80 of the state is kept, not 0


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """`gated_delta` (same arguments, result and in-place state) in the chunked form: the
    same recurrence, its float32 sums in another order. Per chunk of C = CHUNK tokens, with
    H = S^T [Dk, Dv] the state at the chunk's start, b the in-chunk cumsum of log g, and
    A [C, C] = strictly-lower(beta_i e^(b_i - b_j) k_i.k_j):
      T = (I + A)^-1 (a unit lower-triangular solve), W = T diag(beta e^b) K,
      U = T diag(beta) V - W H (each token's delta, from the chunk-start state),
      O = diag(e^b) Q H + (lower(Q K^T e^(b_i - b_j))) U,
      H' = e^(b_last) H + K^T diag(e^(b_last - b)) U.
    Every exponent is <= 0. T need not be a multiple of C: the last chunk's missing rows are
    zeros with log g = 0, beta = 0 (they change nothing)."""
    bsz, t, hv, dv = v.shape
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("gated_delta: the state must be a contiguous float32 tensor")
    rep = hv // k.shape[2]
    nt = -(-t // CHUNK)
    pad = nt * CHUNK - t

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, NT, C, ...]
        x = F.pad(x.float(), (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        return x.reshape(bsz, nt, CHUNK, *x.shape[2:]).movedim(3, 1)

    qc = chunks(q.repeat_interleave(rep, 2))  # [B, Hv, NT, C, Dk]
    kc = chunks(k.repeat_interleave(rep, 2))
    vc = chunks(v)  # [B, Hv, NT, C, Dv]
    bc = chunks(beta[..., None])[..., 0]  # [B, Hv, NT, C]
    logg = torch.log(g.float()).clamp_min(LOG_G_MIN)
    b = chunks(logg[..., None])[..., 0].cumsum(-1)
    incl = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).tril()
    strict = incl.tril(-1)
    decay = torch.exp(torch.where(incl, b[..., :, None] - b[..., None, :], 0.0))
    a = torch.where(strict, bc[..., :, None] * decay * (kc @ kc.transpose(-1, -2)), 0.0)
    eye = torch.eye(CHUNK, device=v.device).expand_as(a)
    tri = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    w = tri @ (kc * (bc * torch.exp(b))[..., None])  # [B, Hv, NT, C, Dk]
    u0 = tri @ (vc * bc[..., None])  # [B, Hv, NT, C, Dv]
    p = torch.where(incl, (qc @ kc.transpose(-1, -2)) * decay, 0.0)  # [B, Hv, NT, C, C]
    h = state.transpose(-1, -2)  # [B, Hv, Dk, Dv]
    ys = []
    for c in range(nt):
        bb = b[:, :, c]
        u = u0[:, :, c] - w[:, :, c] @ h
        ys.append(torch.exp(bb)[..., None] * (qc[:, :, c] @ h) + p[:, :, c] @ u)
        last = bb[..., -1:]
        h = (torch.exp(last)[..., None] * h
             + kc[:, :, c].transpose(-1, -2) @ (u * torch.exp(last - bb)[..., None]))
    state.copy_(h.transpose(-1, -2))
    y = torch.stack(ys, 2).reshape(bsz, hv, nt * CHUNK, dv)[:, :, :t]
    return y.transpose(1, 2).to(q.dtype)


def rms_norm_gated(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """mlx-lm's RMSNormGated: rms_norm(y) * weight (rounded to y's dtype), then times
    silu(z), both in float32, rounded to y's dtype. y, z [.., Dv]; weight [Dv]."""
    y32 = y.float()
    n = (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)).to(y.dtype) * weight
    return (F.silu(z.float()) * n.float()).to(y.dtype)


def gated_delta_decode(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       conv_w: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       norm_w: torch.Tensor, heads: tuple[int, int, int, int],
                       eps: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The gated DeltaNet mixer's decode step (one token for each of B sequences) from the
    input projection's rows proj [B, P] (P = C + Hv*Dv + 2*Hv: [qkv | z | b | a]) to the
    input of out_proj [B, Hv*Dv] in proj's dtype: the ops above composed. heads = (Hk, Hv,
    Dk, Dv); conv_state [B, W-1, C] and ssm_state [B, Hv, Dv, Dk] (float32) updated in place;
    conv_w [C, W], a_log [Hv], dt_bias [Hv], norm_w [Dv]. The twin of the one-launch kernel
    (`gated_delta_decode.gated_delta_decode`). With `rows` [B] long, row b's states are
    rows[b] of the state pools conv_state [S, W-1, C] / ssm_state [S, Hv, Dv, Dk]: gathered,
    stepped, written back."""
    if rows is not None:
        conv, ssm = conv_state.index_select(0, rows), ssm_state.index_select(0, rows)
        out = gated_delta_decode(proj, conv, ssm, conv_w, a_log, dt_bias, norm_w, heads, eps)
        conv_state.index_copy_(0, rows, conv)
        ssm_state.index_copy_(0, rows, ssm)
        return out
    hk, hv, dk, dv = heads
    bsz = proj.shape[0]
    key, val = hk * dk, hv * dv
    qkv, z, b, a = proj[:, None].split([2 * key + val, val, hv, hv], -1)
    mixed, new_conv = conv1d_silu(qkv, conv_state, conv_w)
    conv_state.copy_(new_conv)
    q, k, v = mixed.split([key, key, val], -1)
    q, k = l2norm_qk(q.reshape(bsz, 1, hk, dk), k.reshape(bsz, 1, hk, dk))
    g, beta = delta_gates(a, b, a_log, dt_bias)
    y = gated_delta(q, k, v.reshape(bsz, 1, hv, dv), g, beta, ssm_state)
    return rms_norm_gated(y, z.reshape(bsz, 1, hv, dv), norm_w, eps).reshape(bsz, val)
