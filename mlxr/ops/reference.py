"""Plain-torch versions of every op: the executable spec, the CPU path and the test oracle.

Each function has the signature its fast (Triton) twin implements. Shapes use one alphabet:
T tokens, S cached positions, H query heads, K kv heads, D head dim, E model dim, F MLP dim.
Numerics follow mlx: reductions and transcendentals in float32, results in the input dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    """x [..., E] -> x / rms(x) * (offset + weight), normalised in float32 as mx.fast.rms_norm."""
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # gemma's (1 + w) is formed in the weight's dtype, as mlx-lm does.
    w = weight + offset if offset else weight
    return y * w


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up; act is silu, gelu (exact erf) or gelu_tanh."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu":
        return F.gelu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if act == "sigmoid":
        return torch.sigmoid(gate) * up
    raise ValueError(f"unknown activation {act!r}")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, traditional: bool) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] features of x [T, H, D] by per-position angles.

    cos/sin: [T, R] float32 for R = rotated_dims / 2. traditional=True rotates interleaved pairs
    (2i, 2i+1); otherwise the rotate-half layout pairs (i, i + R).
    """
    r2 = 2 * cos.shape[-1]
    xr = x[..., :r2].float()
    c, s = cos[:, None, :], sin[:, None, :]
    if traditional:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    out = out.to(x.dtype)
    return out if r2 == x.shape[-1] else torch.cat((out, x[..., r2:]), dim=-1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention. q [T, H, D] at positions q_start.., k/v [K, S, D] at k_start...

    Key j is visible to query i iff j <= i and (window is None or i - j < window). `sinks`
    [H] (gpt-oss): one more logit per head in each softmax, attached to no value.
    Returns [T, H, D] in q's dtype.
    """
    t, h, d = q.shape
    kh, s, _ = k.shape
    # Every key visible to every query: the last key is not after the first query, and (with a
    # window) the last query still sees the first key. Decided on the host, and the mask is
    # built where q lives: a host-built mask copied per layer would synchronise the GPU.
    all_visible = k_start + s - 1 <= q_start and (
        window is None or q_start + t - 1 - k_start < window)
    qh = q.transpose(0, 1)  # [H, T, D]
    rep = h // kh
    if (q.is_cuda and softcap is None and sinks is None and window is None
            and q_start == k_start and t == s and t > 1):
        # a whole causal prompt: the flash kernel's own causal mask, no mask tensor
        out = F.scaled_dot_product_attention(qh[None], k[None], v[None], is_causal=True,
                                             scale=scale, enable_gqa=h != kh)[0]
        return out.transpose(0, 1)
    mask = None
    if not all_visible:
        qpos = torch.arange(q_start, q_start + t, device=q.device)
        kpos = torch.arange(k_start, k_start + s, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= qpos[:, None] - kpos[None, :] < window
    if softcap is None and sinks is None and (t * rep > 64 or q.is_cuda):
        attn_mask = mask
        # CPU: float32 SDPA, the reference's numbers (a whole bf16 prompt may instead take
        # torch's bf16 flash kernel, 3.6x faster on AVX-512 BF16: ops.cpu.prefill_attend)
        wide = torch.float32 if not q.is_cuda else q.dtype
        out = F.scaled_dot_product_attention(
            qh[None].to(wide), k[None].to(wide), v[None].to(wide), attn_mask=attn_mask,
            scale=scale, enable_gqa=h != kh,
        )[0]
        return out.transpose(0, 1).to(q.dtype)
    # Few queries (decode): plain batched matmuls per kv head beat the CPU flash kernel, which
    # parallelises over query blocks. On CPU the (bf16) cache slice is widened to float32 first:
    # bf16 batched matmuls are slow there (a 28-layer step at 540 positions: 11.0 ms in bf16,
    # 6.0 ms widened, 10.3 ms with a float32 cache). q rows of one kv group: [K, rep*T, D].
    if not k.is_cuda:
        k, v = k.float(), v.float()
    qg = qh.reshape(kh, rep * t, d).to(k.dtype)
    scores = torch.bmm(qg * scale, k.transpose(1, 2)).float()  # [K, rep*T, S]
    if softcap is not None:  # gemma2: tanh(s / cap) * cap before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if not all_visible:
        m = mask.repeat(rep, 1)  # rows ordered (rep, T) like qg
        scores = scores.masked_fill(~m, -math.inf)
    probs = _softmax_sinks(scores, sinks, t).to(v.dtype)
    out = torch.bmm(probs, v)  # [K, rep*T, D]
    return out.reshape(h, t, d).transpose(0, 1).to(q.dtype)


def _softmax_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, t: int) -> torch.Tensor:
    """Softmax over the last dim of float32 scores [K, rep*T, S] (rows (rep, T) of one kv
    group), with sinks [H] (head = kv * rep + r) as one more logit of every row."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    kh, rows, _ = scores.shape
    col = sinks.float().reshape(kh, -1, 1).repeat_interleave(t, dim=1)  # [K, rep*T, 1]
    return torch.softmax(torch.cat((scores, col), dim=-1), dim=-1)[..., :-1]


def attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """GQA attention with the visibility of each key given as a tensor (static shapes, no host
    values: CUDA-graph friendly). q [T, H, D], k/v [K, S, D], visible [S] or [T, S] bool;
    sinks [H] as in `attention`."""
    t, h, d = q.shape
    kh = k.shape[0]
    rep = h // kh
    qg = q.transpose(0, 1).reshape(kh, rep * t, d)  # rows of one kv group: (rep, T)
    scores = torch.bmm(qg * scale, k.transpose(1, 2)).float()  # [K, rep*T, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible if visible.dim() == 1 else visible.repeat(rep, 1)
    scores = scores.masked_fill(~mask, -math.inf)
    probs = _softmax_sinks(scores, sinks, t).to(v.dtype)
    return torch.bmm(probs, v).reshape(h, t, d).transpose(0, 1)


def attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 window: int | None, scale: float, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`attention_masked` of query rows at positions `positions` [T] (long, on q's device)
    over key slots 0..S-1 at positions equal to their slots: key j is visible to row t iff
    j <= positions[t] and (window is None or positions[t] - j < window)."""
    j = torch.arange(k.shape[1], device=k.device)
    p = positions[:, None]
    visible = (j <= p) if window is None else (j <= p) & (p - j < window)
    return attention_masked(q, k, v, visible, scale, softcap, sinks)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache, one new token per sequence.

    q [B, H, D]: row b is the token at position ctx_lens[b] - 1 of sequence b (ctx_lens [B] >= 1).
    Position p of sequence b lives in cache slot block_tables[b, p // block_size] * block_size
    + p % block_size of k/v [K, slots, D]; the token sees positions [max(0, n - window), n).
    Returns [B, H, D] in q's dtype, row by row exactly as `attention` computes it."""
    outs = []
    tables = block_tables.cpu().long()
    for b, n in enumerate(ctx_lens.tolist()):
        lo = 0 if window is None else max(0, n - window)
        p = torch.arange(lo, n)
        slots = (tables[b, p // block_size] * block_size + p % block_size).to(k.device)
        outs.append(attention(q[b:b + 1], k.index_select(1, slots), v.index_select(1, slots),
                              n - 1, lo, scale, window, softcap, sinks))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and the next norm: s = h + r in h's dtype, and rms_norm(s)."""
    s = (h + r).to(h.dtype)
    return s, rms_norm(s, weight, eps, offset)


def residual_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float,
                  scalar: torch.Tensor | None = None, next_weight: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sandwich-normed residual: h' = (h + rms_norm(a, weight)) [* scalar], and
    rms_norm(h', next_weight) (the next branch's input; None without next_weight)."""
    h = h + rms_norm(a, weight, eps)
    if scalar is not None:
        h = h * scalar
    return h, None if next_weight is None else rms_norm(h, next_weight, eps)


def residual_linear_act(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float,
                        linear, up: torch.Tensor, act: str,
                        norm=None, gate=None) -> tuple[torch.Tensor, torch.Tensor]:
    """h' = h + rms_norm(a, weight) and act(linear(h')) * up (Gemma 4's per-layer-input
    gate). norm / gate: the residual norm and gated activation to compose (default: this
    module's)."""
    h, _ = (norm or residual_norm)(h, a, weight, eps)
    return h, (gate or gated_act)(linear(h), up, act)


def linear_residual_norm(x: torch.Tensor, linear, h: torch.Tensor, weight: torch.Tensor,
                         eps: float, scalar: torch.Tensor | None = None,
                         next_weight: torch.Tensor | None = None, norm=None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """residual_norm(h, linear(x), weight, eps, scalar, next_weight) (Gemma 4's per-layer
    projection and the layer's last residual); norm: the residual norm to compose."""
    return (norm or residual_norm)(h, linear(x), weight, eps, scalar, next_weight)


def qkv_rope_write(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   offset: float, rope_scale: float, cos: torch.Tensor, sin: torch.Tensor,
                   traditional: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """From the fused projection qkv [N, (H + 2K) * D] to attention's inputs: q and k get the
    per-head RMSNorm (q_norm / k_norm [D], if given), the yarn/longrope pre-scale of their
    first 2R features and RoPE (cos/sin [N|1, R], see `rope`; with `positions` [N] (long)
    they are tables [P, R] and token t takes row positions[t]); k and v are written to
    k_cache / v_cache [K, S, D] at cache slots `slots` [N] (long). Returns q [N, H, D]."""
    if positions is not None:
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
    n = qkv.shape[0]
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], -1)
    q = q.reshape(n, n_heads, head_dim)
    k = k.reshape(n, n_kv_heads, head_dim)
    v = v.reshape(n, n_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps, offset)
        k = rms_norm(k, k_norm, eps, offset)
    if rope_scale != 1.0:
        r2 = 2 * cos.shape[-1]
        q = torch.cat((q[..., :r2] * rope_scale, q[..., r2:]), dim=-1)
        k = torch.cat((k[..., :r2] * rope_scale, k[..., r2:]), dim=-1)
    q = rope(q, cos, sin, traditional)
    k_cache.index_copy_(1, slots, rope(k, cos, sin, traditional).transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))
    return q


def split_qkv_norm_rope_write(q: torch.Tensor, kv: torch.Tensor | None, n_heads: int,
                              n_kv_heads: int, head_dim: int, q_norm: torch.Tensor,
                              k_norm: torch.Tensor | None, v_norm: torch.Tensor | None,
                              eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              traditional: bool, k_eq_v: bool,
                              k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                              slots: torch.Tensor | None, positions: torch.Tensor | None = None,
                              norm=rms_norm, rotate=rope) -> torch.Tensor:
    """Gemma 4's glue from its q and [k | v] projections to attention: q [N, H*D] and k get
    their per-head RMSNorm (q_norm / k_norm [D]) and RoPE (cos/sin as in `qkv_rope_write`),
    v its RMSNorm if v_norm [D] is given (Gemma passes ones: mlx-lm's weightless norm); k and
    v go to k_cache / v_cache [K, S, D] at `slots` [N]. kv [N, K*D] holds k alone where
    k_eq_v (v is the same projection, normed but not rotated), else [N, 2*K*D]; None on a
    KV-shared layer (q only, nothing written). norm / rotate: the ops composed (the CUDA
    composition passes `ops.rms_norm` / `ops.rope`). Returns q [N, H, D]."""
    if positions is not None:
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
    n, d = q.shape[0], head_dim
    out = rotate(norm(q.reshape(n, n_heads, d), q_norm, eps), cos, sin, traditional)
    if kv is None:
        return out
    k = kv[:, :n_kv_heads * d].reshape(n, n_kv_heads, d)
    v = k if k_eq_v else kv[:, n_kv_heads * d:].reshape(n, n_kv_heads, d)
    k = rotate(norm(k, k_norm, eps), cos, sin, traditional)
    if v_norm is not None:
        v = norm(v, v_norm, eps)
    k_cache.index_copy_(1, slots, k.transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))
    return out


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            block_tables: torch.Tensor, items: torch.Tensor, block_size: int,
                            scale: float, window: int | None = None,
                            softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a mixed batch over a paged KV cache (K/V of the new tokens already
    written). q [N, H, D]; items [I, 4] (sequence s, first row of q, its position, number of
    rows): rows [r, r+n) of q are positions [p, p+n) of sequence s, whose position x lives in
    slot block_tables[s, x // block_size] * block_size + x % block_size of k/v [K, slots, D].
    Returns [N, H, D] in q's dtype, computed tile by tile exactly as `attention` does."""
    out = torch.empty_like(q)
    tables = block_tables.cpu().long()
    for s, r, p, n in items.tolist():
        lo = 0 if window is None else max(0, p - window + 1)
        x = torch.arange(lo, p + n)
        slots = (tables[s, x // block_size] * block_size + x % block_size).to(k.device)
        out[r:r + n] = attention(q[r:r + n], k.index_select(1, slots), v.index_select(1, slots),
                                 p, lo, scale, window, softcap, sinks)
    return out


def prefill_tile(num_heads: int, num_kv_heads: int) -> int:
    """Rows per item of paged_prefill_attention: the Triton kernel's query tile (rep * rows <= 64
    query-head rows per program)."""
    return max(1, 64 // (num_heads // num_kv_heads))


def paged_items(spans: list[tuple[int, int, int]], tile: int) -> torch.Tensor:
    """Items of `paged_prefill_attention` for spans (sequence index, first row, first position,
    number of rows): each span cut into tiles of at most `tile` rows. int32 [I, 4] (host)."""
    items = [(s, r + i, p + i, min(tile, n - i)) for s, r, p, n in spans
             for i in range(0, n, tile)]
    return torch.tensor(items, dtype=torch.int32).reshape(-1, 4)
