"""The mixture-of-experts keys of config.json: one `MoeSpec` for every family's MoE block.

Every key is typed and bounded here, before the loader reads a tensor: expert counts, top-k in
1..experts, the per-layer lists against the layer count. Defaults are mlx-lm 0.32.2's
(`mlx_lm/models/<model_type>.py`). The reader `r` is `config._Reader` (typed access whose
errors name the file and the key).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelFormatError

MOE_TYPES = ("qwen3_moe", "mixtral", "gpt_oss", "laguna")
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
SCORE_FUNCS = ("sigmoid", "sqrtsoftplus")


@dataclass(frozen=True)
class MoeSpec:
    """One family's sparse MLP block (`mlxr.models.moe.MoeBlock` computes it).

    router: how logits [N, E] become (expert ids, weights) [N, k]:
      softmax_topk  softmax over all experts, the k largest (qwen3_moe), renormalised iff
                    norm_topk;
      topk_softmax  the k largest logits, softmax over those (mixtral, gpt-oss);
      sigmoid_topk  float32 score_func(logits) (after the optional tanh soft-cap), plus
                    e_score_correction_bias for the selection only, weights renormalised
                    (laguna; DeepSeek-style routers without expert groups).
    """

    num_experts: int
    top_k: int
    expert_size: int  # F of one expert: gate/up [F, E], down [E, F]
    sparse_layers: tuple[bool, ...]  # layer i has this block (else the dense MLP)
    router: str = "softmax_topk"
    norm_topk: bool = False
    routed_scale: float = 1.0  # multiplies the weighted expert sum (after its cast)
    router_softcap: float = 0.0
    score_func: str = "sigmoid"
    router_bias: bool = False  # gpt-oss: the router Linear has a bias
    correction_bias: bool = False  # laguna: <router>.e_score_correction_bias [E]
    expert_act: str = "silu"  # silu | swiglu_oai (gpt-oss's clamped SwiGLU) | gelu_tanh
    act_alpha: float = 1.702
    act_limit: float = 7.0
    expert_bias: bool = False  # gpt-oss: gate/up/down biases [E, out]
    shared_size: int = 0  # an always-on shared expert MLP of this width (0: none)
    shared_gate: bool = False  # qwen2_moe-style sigmoid(shared_expert_gate(x)) on it
    # module paths: model.layers.i.<block>.<router> / .<experts>.* ("" : no block level)
    block: str = "mlp"
    router_path: str = "gate"
    experts_path: str = "switch_mlp"


def layer_list(r, key: str, layers: int, default: list) -> list:
    """A per-layer list of config.json: exactly one entry per layer."""
    v = r.raw.get(key)
    if v is None:
        return default
    if not isinstance(v, list) or len(v) != layers:
        raise ModelFormatError(f"{r.source}: key '{key}' must list {layers} entries "
                               f"(num_hidden_layers), got {_describe(v)}")
    return v


def _describe(v) -> str:
    return f"{len(v)} entries" if isinstance(v, list) else type(v).__name__


def layer_kinds(r, key: str, layers: int, kinds: tuple[str, ...], default: list) -> list[str]:
    """A per-layer list of names, each one of `kinds`."""
    v = layer_list(r, key, layers, default)
    bad = [x for x in v if x not in kinds]
    if bad:
        raise ModelFormatError(f"{r.source}: key '{key}' has {bad[0]!r}; expected one of "
                               f"{', '.join(kinds)}")
    return v


def _experts(r, count_key: str, e_default: int | None,
             k_default: int | None) -> tuple[int, int]:
    """(experts, top-k); a None default: the key is required."""
    experts = r.int(count_key) if e_default is None else r.int(count_key, e_default)
    top_k = (r.int("num_experts_per_tok") if k_default is None
             else r.int("num_experts_per_tok", k_default))
    if top_k > experts:
        raise ModelFormatError(f"{r.source}: key 'num_experts_per_tok' = {top_k} exceeds "
                               f"'{count_key}' = {experts}")
    return experts, top_k


def _qwen3_sparse(r, layers: int) -> tuple[bool, ...]:
    step = r.int("decoder_sparse_step")
    only = r.raw.get("mlp_only_layers")
    if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only):
        raise ModelFormatError(f"{r.source}: key 'mlp_only_layers' must list layer indices "
                               f"in [0, {layers})")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(layers))


def _hybrid_counts(r, count_key: str, k_key: str) -> tuple[int, int]:
    """(experts, top-k), both required; r's errors name nested keys in full."""
    experts, top_k = r.int(count_key), r.int(k_key)
    if top_k > experts:
        raise r._fail(k_key, f"= {top_k} exceeds {count_key} = {experts}")
    return experts, top_k


def parse_hybrid_moe(r, family: str, layers: int) -> MoeSpec | None:
    """The MoE block of a hybrid family, None where it has none (r: `config.hybrid.Nested`).

    qwen3_5 (and qwen3_5_moe): every layer sparse once num_experts > 0; qwen3_next: layers
    by decoder_sparse_step and mlp_only_layers (all keys required, as its ModelArgs has no
    default). Both: softmax router, a shared SwiGLU expert under a sigmoid gate. gemma4
    (enable_moe_block): every layer keeps its dense GeGLU MLP and adds this block beside it
    (router RMSNorm + top-k softmax times a per-expert scale, GeGLU experts), module paths
    layers.i.router.proj / layers.i.experts.switch_glu."""
    if family == "gemma4":
        if not r.bool("enable_moe_block", False):
            return None
        experts, top_k = _hybrid_counts(r, "num_experts", "top_k_experts")
        return MoeSpec(experts, top_k, r.int("moe_intermediate_size"), (True,) * layers,
                       router="topk_softmax", expert_act="gelu_tanh", block="",
                       router_path="router.proj", experts_path="experts.switch_glu")
    if family == "qwen3_next":
        if not r.int("num_experts", minimum=0):
            return None
        sparse = _qwen3_sparse(r, layers)
    else:
        if not r.int("num_experts", 0, minimum=0):
            return None
        sparse = (True,) * layers
    experts, top_k = _hybrid_counts(r, "num_experts", "num_experts_per_tok")
    return MoeSpec(experts, top_k, r.int("moe_intermediate_size"), sparse,
                   router="softmax_topk", norm_topk=r.bool("norm_topk_prob",
                                                            family == "qwen3_5"),
                   shared_size=r.int("shared_expert_intermediate_size"), shared_gate=True)


def parse_moe(r, model_type: str, layers: int, inter: int) -> MoeSpec:
    """The MoeSpec of a MoE family (`inter`: the family's intermediate_size, already read)."""
    if model_type == "qwen3_moe":
        experts, top_k = _experts(r, "num_experts", None, None)
        return MoeSpec(experts, top_k, r.int("moe_intermediate_size"), _qwen3_sparse(r, layers),
                       router="softmax_topk", norm_topk=r.bool("norm_topk_prob"))
    if model_type == "mixtral":
        experts, top_k = _experts(r, "num_local_experts", 8, 2)
        return MoeSpec(experts, top_k, inter, (True,) * layers, router="topk_softmax",
                       block="block_sparse_moe")
    if model_type == "gpt_oss":
        experts, top_k = _experts(r, "num_local_experts", 128, 4)
        return MoeSpec(experts, top_k, inter, (True,) * layers, router="topk_softmax",
                       router_bias=True, expert_act="swiglu_oai", expert_bias=True,
                       router_path="router", experts_path="experts")
    if model_type == "laguna":
        experts, top_k = _experts(r, "num_experts", 256, 8)
        kinds = layer_kinds(r, "mlp_layer_types", layers, ("dense", "sparse"),
                            ["dense"] + ["sparse"] * (layers - 1))
        score = r.raw.get("moe_router_score_func", "sigmoid")
        if score not in SCORE_FUNCS:
            raise ModelFormatError(f"{r.source}: key 'moe_router_score_func' = {score!r} is "
                                   f"not one of {', '.join(SCORE_FUNCS)}")
        softcap = r.float("moe_router_logit_softcapping", 0.0)
        if softcap < 0:
            raise ModelFormatError(f"{r.source}: key 'moe_router_logit_softcapping' must be "
                                   f">= 0, got {softcap}")
        return MoeSpec(experts, top_k, r.int("moe_intermediate_size", 512),
                       tuple(k == "sparse" for k in kinds), router="sigmoid_topk",
                       norm_topk=True, routed_scale=r.float("moe_routed_scaling_factor", 1.0),
                       router_softcap=softcap, score_func=score, correction_bias=True,
                       shared_size=r.int("shared_expert_intermediate_size", 512),
                       router_path="gate.proj")
    raise ModelFormatError(f"{r.source}: model_type {model_type!r} is not a MoE family")
