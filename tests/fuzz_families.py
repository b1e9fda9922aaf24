"""The folder fuzzer's families beyond the dense qwen3 (tests/fuzz_hostile.py `--family F`):
tiny real folders of the MoE families (mlx_ref: qwen3_moe, mixtral, gpt_oss, laguna) and the
hybrids (mlx_ref_hybrid: qwen3_5, qwen3_5_moe, qwen3_next, gemma4_text, gemma4, gemma4_moe),
made, quantized and saved by mlx-lm in the format each ships in, plus mutations aimed at each
family's own config keys and tensor headers.

The mutations here edit the config where the family reads it (gemma4 / qwen3_5 nest the text
model under text_config), rewrite one tensor's shape or dtype in the safetensors header (a
valid header, so the checks behind the parser are reached), per-layer quantization overrides
and per-layer-type rope parameters.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

# family -> its quantization (an mlx_ref QUANTS name or an mlx_ref_hybrid dict): the format
# its checkpoints ship in, at tiny sizes
MOE = {"qwen3_moe": "q4g64", "mixtral": "q4g64", "gpt_oss": "mxfp4_q8",
       "laguna": "laguna_nvfp4"}
HYBRID = {"qwen3_5": dict(bits=4, group_size=64), "qwen3_5_moe": dict(bits=4, group_size=64),
          "qwen3_next": dict(bits=4, group_size=64), "gemma4_text": dict(bits=4, group_size=64),
          "gemma4": dict(bits=4, group_size=64), "gemma4_moe": dict(mode="mxfp4")}
FAMILIES = ["qwen3", *MOE, *HYBRID]

# the keys only these families read (mlx-lm 0.32.2's ModelArgs), each with plausible-but-wrong
# values besides the generic hostile ones
FAMILY_KEYS = [
    "num_experts", "num_local_experts", "num_experts_per_tok", "top_k_experts",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers", "mlp_layer_types", "norm_topk_prob", "moe_routed_scaling_factor",
    "gating", "layer_types", "linear_num_value_heads", "linear_num_key_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "full_attention_interval", "sliding_window", "sliding_window_pattern",
    "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
    "head_dim", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
    "final_logit_softcapping", "swiglu_limit", "num_attention_heads_per_layer",
    "enable_moe_block", "partial_rotary_factor", "rope_theta", "num_hidden_layers",
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "tie_word_embeddings", "attention_bias", "router_aux_loss_coef",
    "use_double_wide_mlp", "attn_logit_softcapping", "query_pre_attn_scalar",
]
NUMBERS = [0, 1, 2, 3, 5, 7, 64, 65, 100, 4096, 10**6, 2**31, -2, 1.5, 1e-9, float("inf")]
LISTS = [[], [0], [99], [-1], [0, 0], ["x"], [1, 2, 3, 4, 5, 6, 7, 8, 9],
         ["full_attention"] * 2, ["linear_attention"] * 9, ["sliding_attention"] * 5,
         ["dense", "sparse", "weird", "sparse"], [4, 4, 4, 4], [0, 6, 6, 6], [2**31] * 4]
LAYER_TYPES = ["full_attention", "sliding_attention", "linear_attention", "chunked", 7, None]
QUANT_MODES = ["affine", "mxfp4", "nvfp4", "mxfp8", "int4", "", None]
DTYPES = ["F16", "BF16", "F32", "F64", "U8", "I8", "U32", "I32", "I64", "BOOL", "F8_E4M3",
          "F8_E5M2", "U64", "C64", "x"]
EXPERTISH = ("experts", "switch_mlp", "linear_attn", "per_layer", "router", "gate", "sinks",
             "e_score", "conv1d", "A_log", "dt_bias", "layer_scalar")


def build_base(family: str, out: Path) -> Path:
    """The family's tiny folder with the tokenizer files and sampling defaults of
    hostile_models."""
    from hostile_models import write_tokenizer

    if family in MOE:
        import mlx_ref

        d = mlx_ref.make_model(out, family, MOE[family])
    else:
        import mlx_ref_hybrid

        d = mlx_ref_hybrid.make_model(out, family, HYBRID[family])
    write_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "eos_token_id": [262]}))
    return d


def _text(cfg: dict, rng: random.Random) -> dict:
    """Where the family reads its text keys: text_config when nested (mostly), else the top."""
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) and rng.random() < 0.85 else cfg


def _value(key: str, old, rng: random.Random, hostile):
    return copy.deepcopy(_pick(key, old, rng, hostile))  # (a later step may mutate it)


def _pick(key: str, old, rng: random.Random, hostile):
    r = rng.random()
    if r < 0.3:
        return hostile(rng)
    if isinstance(old, list) or key.endswith(("_types", "_layers", "_per_layer")):
        if r < 0.6 and isinstance(old, list) and old:
            v = list(old)
            op = rng.randrange(4)
            if op == 0:
                v.pop(rng.randrange(len(v)))
            elif op == 1:
                v.append(rng.choice(v))
            elif op == 2:
                v[rng.randrange(len(v))] = rng.choice(LAYER_TYPES + NUMBERS)
            else:
                rng.shuffle(v)
            return v
        return rng.choice(LISTS)
    if isinstance(old, (int, float)) and not isinstance(old, bool) and r < 0.6:
        return rng.choice([old + 1, old - 1, old * 2, old // 2 if isinstance(old, int)
                           else old / 2, -old, old * 1000])
    return rng.choice(NUMBERS + LISTS[:3] + [True, "x"])


def mutate_family_keys(d: Path, rng: random.Random, edit_json, hostile) -> str:
    """Set, delete or skew 1-3 of the family's own keys (where it reads them)."""
    def fn(cfg):
        for _ in range(rng.randint(1, 3)):
            t = _text(cfg, rng)
            present = [k for k in FAMILY_KEYS if k in t]
            key = rng.choice(present) if present and rng.random() < 0.7 else \
                rng.choice(FAMILY_KEYS)
            if key in t and rng.random() < 0.15:
                del t[key]
            else:
                t[key] = _value(key, t.get(key), rng, hostile)
        return cfg
    edit_json(d / "config.json", rng, fn)
    return "family_keys"


def mutate_rope_parameters(d: Path, rng: random.Random, edit_json, hostile) -> str:
    """rope_parameters flat or per layer type (laguna, gemma4), with skewed fields."""
    fields = ["rope_type", "rope_theta", "factor", "partial_rotary_factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "mrope_section",
              "low_freq_factor", "high_freq_factor", "truncate", "mscale"]

    def one():
        s = {"rope_type": rng.choice(["default", "yarn", "proportional", "llama3", "linear",
                                      "weird"]), "rope_theta": rng.choice([1e4, 1e6, 0, -1])}
        for key in rng.sample(fields, rng.randint(1, 4)):
            s[key] = hostile(rng) if rng.random() < 0.5 else rng.choice(
                [0.0, 0.25, 1.0, 8.0, 32, 4096, [2, 1, 1], [99, 99, 99], True])
        return s

    def fn(cfg):
        t = _text(cfg, rng)
        if rng.random() < 0.5:
            t["rope_parameters"] = {k: one() if rng.random() < 0.8 else hostile(rng)
                                    for k in rng.sample(["full_attention", "sliding_attention",
                                                         "linear_attention", "x"],
                                                        rng.randint(1, 3))}
        else:
            t["rope_parameters"] = one()
        return cfg
    edit_json(d / "config.json", rng, fn)
    return "rope_parameters"


def _tensor_names(d: Path) -> list[str]:
    header = _read_header(d / "model.safetensors")
    return [k for k in (header or {}) if k != "__metadata__"]


def mutate_layer_quant(d: Path, rng: random.Random, edit_json, hostile) -> str:
    """A per-layer override under quantization (and quantization_config), often on an expert
    or recurrent module, with an fp mode or odd bits / group size."""
    names = _tensor_names(d) or ["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    modules = sorted({n.rsplit(".", 1)[0] for n in names})

    def fn(cfg):
        key = "quantization" if rng.random() < 0.7 else "quantization_config"
        q = cfg.setdefault(key, {})
        if not isinstance(q, dict):
            q = cfg[key] = {}
        path = rng.choice(modules)
        if rng.random() < 0.3 and path.startswith("model."):
            path = "language_model." + path
        r = rng.random()
        if r < 0.6:
            q[path] = {"mode": rng.choice(QUANT_MODES), "bits": rng.choice([2, 3, 4, 5, 6, 8,
                                                                            16, 0, 1, -4]),
                       "group_size": rng.choice([16, 32, 64, 128, 0, 7, 96, 2**31])}
            if rng.random() < 0.3:
                del q[path][rng.choice(list(q[path]))]
        elif r < 0.8:
            q[path] = rng.choice([False, True, hostile(rng)])
        else:
            q[rng.choice(["mode", "bits", "group_size"])] = rng.choice(
                QUANT_MODES + [3, 8, 32, 128])
        return cfg
    edit_json(d / "config.json", rng, fn)
    return "layer_quant"


def _read_header(path: Path) -> dict | None:
    try:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        return json.loads(raw[8:8 + n])
    except (OSError, ValueError):
        return None


def mutate_tensor_header(d: Path, rng: random.Random, edit_json, hostile) -> str:
    """A valid safetensors header with one tensor's shape, dtype or offsets rewritten (mostly
    an expert's or a recurrent layer's); the data bytes stay as they were."""
    path = d / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = _read_header(path)
    if not header:
        return "tensor_header(skipped)"
    names = [k for k in header if k != "__metadata__"]
    picks = [k for k in names if any(s in k for s in EXPERTISH)]
    name = rng.choice(picks if picks and rng.random() < 0.8 else names)
    t = header[name]
    shape = list(t["shape"])
    r = rng.random()
    if r < 0.45 and shape:
        i = rng.randrange(len(shape))
        shape[i] = rng.choice([0, 1, shape[i] * 2, shape[i] // 2, shape[i] + 1, 2**40, 3])
        t["shape"] = shape
    elif r < 0.6:
        t["shape"] = rng.choice([shape[::-1], shape + [1], shape[1:], [1] + shape, []])
    elif r < 0.85:
        t["dtype"] = rng.choice(DTYPES)
    else:  # a shape and dtype that fit its bytes: reinterpretation, not a size error
        size = t["data_offsets"][1] - t["data_offsets"][0]
        t["dtype"], t["shape"] = rng.choice([("U8", [size]), ("F32", [size // 4]),
                                             ("U32", [1, size // 4]), ("BF16", [size // 2])])
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])
    return "tensor_header"


MUTATIONS = [mutate_family_keys, mutate_family_keys, mutate_rope_parameters,
             mutate_layer_quant, mutate_tensor_header, mutate_tensor_header]

