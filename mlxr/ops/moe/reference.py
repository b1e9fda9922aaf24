"""Plain-torch mixture-of-experts ops: routing, the experts' activation, the weighted combine.

The executable spec (and CPU path) of the MoE block, in mlx-lm 0.32.2's dtypes and order.
Shapes: N tokens, X experts, k selected per token, E model dim, F expert dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) as mlx's nn.softplus (logaddexp(x, 0): no threshold, unlike F.softplus)."""
    return torch.logaddexp(x, torch.zeros((), dtype=x.dtype, device=x.device))


def route(logits: torch.Tensor, router: str, top_k: int, norm_topk: bool = False,
          softcap: float = 0.0, score_func: str = "sigmoid",
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, X] (the router's output dtype) -> expert ids [N, k] long and their
    weights [N, k] (see `config_moe.MoeSpec.router`). Weights come in the dtype mlx-lm's
    block multiplies by: the logits' dtype for the softmax routers (its precise softmax
    runs in float32 and rounds back), float32 for the sigmoid router."""
    if router == "softmax_topk":  # qwen3_moe
        gates = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
        w, ids = gates.topk(top_k, dim=-1)
        if norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w
    if router == "topk_softmax":  # mixtral, gpt-oss: softmax over the k largest logits only
        v, ids = logits.topk(top_k, dim=-1)
        return ids, torch.softmax(v.float(), dim=-1).to(logits.dtype)
    if router != "sigmoid_topk":
        raise ValueError(f"unknown router {router!r}")
    s = logits.float()
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    scores = torch.sigmoid(s) if score_func == "sigmoid" else torch.sqrt(softplus(s))
    select = scores if correction_bias is None else scores + correction_bias.float()
    ids = select.topk(top_k, dim=-1).indices  # the bias steers the selection only
    w = scores.gather(-1, ids)
    return ids, w / w.sum(dim=-1, keepdim=True)


def expert_act(gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float = 1.702,
               limit: float = 7.0) -> torch.Tensor:
    """The experts' gated activation: silu(gate) * up, gelu_tanh(gate) * up (gemma4's GeGLU
    experts), or gpt-oss's clamped SwiGLU (up clipped to [-limit, limit] plus one, times
    gate * sigmoid(alpha * gate) of the gate clipped from above at limit)."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if act != "swiglu_oai":
        raise ValueError(f"unknown expert activation {act!r}")
    g = torch.clamp(gate, max=limit)
    return (torch.clamp(up, -limit, limit) + 1.0) * (g * torch.sigmoid(alpha * g))


def combine(y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
            routed_scale: float = 1.0) -> torch.Tensor:
    """The experts' outputs y [N, k, E] weighted by w [N, k] and summed over k, in torch's
    (= mlx's) type promotion (bf16 y by float32 w sums in float32), cast to out_dtype, then
    times the routed scaling factor (laguna multiplies after the cast)."""
    return combine_products(y * w.unsqueeze(-1), out_dtype, routed_scale)


def combine_products(prod: torch.Tensor, out_dtype: torch.dtype,
                     routed_scale: float = 1.0) -> torch.Tensor:
    """`combine` from the weighted outputs prod [N, k, E] (y * w in torch's promotion, as a
    kernel's epilogue may compute them): summed over k, cast, times the routed scale."""
    out = prod.sum(dim=-2).to(out_dtype)
    return out if routed_scale == 1.0 else out * routed_scale


def head_gate(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Laguna's per-head output gate: o [N, H*D] times softplus(g [N, H]) per head, the
    softplus in float32 and rounded to o's dtype."""
    n, h = g.shape
    gate = softplus(g.float()).to(o.dtype)
    return (o.reshape(n, h, -1) * gate.unsqueeze(-1)).reshape(n, -1)
