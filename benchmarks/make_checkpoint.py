"""Write a random-weight, real-shape MLX-quantized checkpoint, so anyone can reproduce the
benchmark numbers without downloading a model.

    python benchmarks/make_checkpoint.py qwen3-0.6b OUT_DIR [--bits 4] [--group-size 64]
    python benchmarks/make_checkpoint.py llama-3.1-8b OUT_DIR --bits 2
    python benchmarks/make_checkpoint.py llama-3.1-70b OUT_DIR   (~40 GB at 4-bit g64)
    python benchmarks/make_checkpoint.py qwen3-0.6b OUT_DIR --tokenizer TOKENIZER_DIR
    python benchmarks/make_checkpoint.py qwen3-30b-a3b OUT_DIR [--layers 24]
    python benchmarks/make_checkpoint.py laguna-xs-2.1 OUT_DIR
    python benchmarks/make_checkpoint.py gpt-oss-20b OUT_DIR

The MoE shapes carry their shipped recipes (`--bits/--group-size/--mode` do not apply):
qwen3-30b-a3b 4-bit g64 with the router (mlp.gate) 8-bit, as mlx_lm.convert quantizes it;
laguna-xs-2.1 as Poolside's NVFP4 export (nvfp4 routed and shared experts, everything else
bf16, e_score_correction_bias float32, no global scales); gpt-oss-20b as mlx-community's
MXFP4-Q8 conversion (mxfp4 experts, everything else affine 8-bit g64). `--layers` keeps the
first N layers (the laguna pattern and its per-layer lists cut to match).

    python benchmarks/make_checkpoint.py qwen3.5-0.8b OUT_DIR   (also qwen3.5-2b, gemma-4-e2b)
    python benchmarks/make_checkpoint.py qwen3.5-35b-a3b OUT_DIR [--layers 4]
    python benchmarks/make_checkpoint.py qwen3-next-80b-a3b OUT_DIR [--layers 4]

    python benchmarks/make_checkpoint.py qwen3-embedding-0.6b OUT_DIR   (or qwen3-embedding-tiny)

The embedding shapes also write the sentence-transformers files (modules.json,
config_sentence_transformers.json, 1_Pooling/config.json with last-token pooling) by which mlxr
recognises an embedding model, as Qwen/Qwen3-Embedding-0.6B ships them.

The hybrid MoE shapes (text weights only) are 4-bit g64 with the routers (mlp.gate) and the
shared-expert gates 8-bit, as mlx_lm.convert quantizes them; `--layers 4` keeps three gated
DeltaNet layers and one gated-attention layer.

`--tokenizer` copies a real tokenizer's files (e.g. Qwen3's vocab.json, merges.txt,
tokenizer_config.json; any model folder works, only its tokenizer files are taken) next to the
weights, for benchmarks that need text (the server).

The files are exactly what mlx-lm writes (uint32 packed codes, bf16 scales and biases, the same
tensor names and config keys), filled with random codes and scales chosen so activations stay
finite. Generation is meaningless; shapes, bytes and kernels are real.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlxr.errors import TokenizerError
from mlxr.text.tokenizer import TOKENIZER_FILES, check_tokenizer_files

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hybrid_tables beside this file
import hybrid_tables  # noqa: E402
from embedding_files import write_sentence_transformers  # noqa: E402
from hybrid_tables import HYBRID_MOE_SHAPES as HYBRID_MOE  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                         intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # the 70B-class dense shape of the tensor-parallel targets (docs/tensor_parallel.md)
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80,
                          intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                          rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=8192)),
    "mistral-7b-v0.3": dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32,
                            intermediate_size=14336, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False,
                            rope_theta=1000000.0, rms_norm_eps=1e-5,
                            max_position_embeddings=32768),
    # Qwen3.5 (hybrid: 3 gated DeltaNet layers per full-attention layer), text_config shapes
    "qwen3.5-0.8b": dict(model_type="qwen3_5", tie_word_embeddings=True, text_config=dict(
        model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24,
        intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=248320, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=262144, rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
            mrope_section=[11, 11, 10]))),
    # Gemma 4 E2B: mlx-lm's gemma4_text defaults (per-layer embeddings, 20 KV-shared layers)
    "gemma-4-e2b": dict(model_type="gemma4", vocab_size=262144, tie_word_embeddings=True,
                        text_config=dict(
        model_type="gemma4_text", hidden_size=1536, num_hidden_layers=35,
        intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, sliding_window=512, sliding_window_pattern=5,
        num_kv_shared_layers=20, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, vocab_size=262144, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
        tie_word_embeddings=True)),
}
_LAGUNA_L = 40
MOE_SHAPES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          rope_theta=1000000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=40960),
    "laguna-xs-2.1": dict(
        model_type="laguna", hidden_size=2048, num_hidden_layers=_LAGUNA_L,
        intermediate_size=8192, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
        num_attention_heads_per_layer=[48, 64, 64, 64] * (_LAGUNA_L // 4),
        layer_types=["full_attention"] + ["sliding_attention"] * 3, sliding_window=512,
        mlp_layer_types=["dense"] + ["sparse"] * (_LAGUNA_L - 1), num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=0.0, norm_topk_prob=True,
        gating="per-head", vocab_size=100352, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=262144, bos_token_id=2, eos_token_id=[2, 24],
        rope_parameters={
            "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=32.0,
                                   original_max_position_embeddings=8192, beta_fast=64.0,
                                   beta_slow=1.0, attention_factor=1.3465735902799727,
                                   partial_rotary_factor=0.5),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0,
                                      partial_rotary_factor=1.0)}),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
                        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        vocab_size=201088, sliding_window=128, rope_theta=150000.0,
                        rms_norm_eps=1e-5, max_position_embeddings=131072,
                        layer_types=["sliding_attention", "full_attention"] * 12,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, original_max_position_embeddings=4096,
                                          truncate=False)),
}
# Qwen3-Embedding-0.6B: Qwen3-0.6B's body, its own vocabulary and context; and a tiny one
SHAPES["qwen3-embedding-0.6b"] = dict(SHAPES["qwen3-0.6b"], vocab_size=151669,
                                      max_position_embeddings=32768)
SHAPES["qwen3-embedding-tiny"] = dict(SHAPES["qwen3-0.6b"], hidden_size=64,
                                      num_hidden_layers=2, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      vocab_size=384, max_position_embeddings=1024)
FP_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
SHAPES["qwen3.5-2b"] = dict(SHAPES["qwen3.5-0.8b"], text_config=dict(
    SHAPES["qwen3.5-0.8b"]["text_config"], hidden_size=2048, intermediate_size=6144))




def quantized(out: int, inp: int, bits: int, group: int, mode: str, g: torch.Generator,
              lead: tuple[int, ...] = ()) -> dict:
    """A quantized module's tensors [*lead, out, ...] (lead: stacked experts)."""
    words = inp * bits // 32
    w = torch.randint(-(2**31), 2**31, (*lead, out, words), dtype=torch.int64, generator=g)
    w = w.to(torch.int32)
    if mode == "mxfp8":  # E4M3 bytes 0x7F / 0xFF are NaN, which mlx's quantizer never writes
        b = w.view(torch.uint8)
        b[(b & 0x7F) == 0x7F] -= 1
    t = {"weight": w.view(torch.uint32)}
    if mode == "affine":
        # w = s*q + b with q uniform in [0, 2^bits): centre on zero, std ~ 0.02/sqrt(in/1024)
        s = (0.04 / (2**bits) * (1024 / inp) ** 0.5) * (
            1 + 0.1 * torch.rand(*lead, out, inp // group, generator=g))
        t["scales"] = s.to(torch.bfloat16)
        t["biases"] = (-s * (2**bits - 1) / 2).to(torch.bfloat16)
    else:
        # E8M0 (mxfp4: 2^-9, mxfp8: 2^-14) or E4M3 (nvfp4: 0x02, 2^-8) scale bytes giving
        # element magnitudes of ~0.006 rms (random E2M1 codes: 2.9 rms, E4M3: 100; nvfp4 had
        # 0x08, 2^-6, and mxfp8 2^-9, 34x mxfp4's: the 8B's random activations grew until its
        # bf16 logits were noise, docs/perf.md)
        byte = {"mxfp4": 127 - 9, "mxfp8": 127 - 14, "nvfp4": 0x02}[mode]
        t["scales"] = torch.full((*lead, out, inp // group), byte, dtype=torch.uint8)
    return t


def dense(out: int, inp: int, g: torch.Generator, lead: tuple[int, ...] = ()) -> dict:
    """A bf16 module's weight, std 0.02 / sqrt(in / 1024) like the quantized ones."""
    w = torch.randn(*lead, out, inp, generator=g) * (0.02 * (1024 / inp) ** 0.5)
    return {"weight": w.to(torch.bfloat16)}


def moe_modules(cfg: dict) -> tuple[dict, dict, dict]:
    """A MoE shape's modules: path -> (out, in, lead, recipe), with recipe a (bits, group,
    mode) or None (bf16); its norms (path -> size) and other tensors (name -> tensor)."""
    mt, e, L = cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"]
    d, kv = cfg["head_dim"], cfg["num_key_value_heads"]
    q8, q4 = (8, 64, "affine"), (4, 64, "affine")
    if mt == "gpt_oss":
        other, experts = q8, (4, 32, "mxfp4")
    elif mt == "laguna":
        other, experts = None, (4, 16, "nvfp4")
    else:
        other, experts = q4, q4
    router = q8 if mt == "qwen3_moe" else other
    x = cfg.get("num_experts") or cfg["num_local_experts"]
    f = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    mods = {"model.embed_tokens": (cfg["vocab_size"], e, (), other),
            "lm_head": (cfg["vocab_size"], e, (), other)}
    norms, extra = {"model.norm": e}, {}
    for i in range(L):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h = cfg.get("num_attention_heads_per_layer", [cfg["num_attention_heads"]] * L)[i]
        for name, o, n in (("q_proj", h * d, e), ("k_proj", kv * d, e), ("v_proj", kv * d, e),
                           ("o_proj", e, h * d)):
            mods[a + name] = (o, n, (), other)
        norms.update({p + "input_layernorm": e, p + "post_attention_layernorm": e})
        if mt in ("qwen3_moe", "laguna"):
            norms.update({a + "q_norm": d, a + "k_norm": d})
        if mt == "laguna":
            mods[a + "g_proj"] = (h, e, (), other)
        if mt == "gpt_oss":
            extra[a + "sinks"] = torch.zeros(h, dtype=torch.bfloat16)
            for name, o in (("q_proj", h * d), ("k_proj", kv * d), ("v_proj", kv * d),
                            ("o_proj", e)):
                extra[a + name + ".bias"] = torch.zeros(o, dtype=torch.bfloat16)
        if mt == "laguna" and cfg["mlp_layer_types"][i] == "dense":
            fi = cfg["intermediate_size"]
            mods.update({p + "mlp.gate_proj": (fi, e, (), other),
                         p + "mlp.up_proj": (fi, e, (), other),
                         p + "mlp.down_proj": (e, fi, (), other)})
            continue
        ex = p + ("mlp.experts." if mt == "gpt_oss" else "mlp.switch_mlp.")
        mods.update({ex + "gate_proj": (f, e, (x,), experts), ex + "up_proj": (f, e, (x,), experts),
                     ex + "down_proj": (e, f, (x,), experts)})
        if mt == "gpt_oss":
            mods[p + "mlp.router"] = (x, e, (), router)
            extra[p + "mlp.router.bias"] = torch.zeros(x, dtype=torch.bfloat16)
            for name, o in (("gate_proj", f), ("up_proj", f), ("down_proj", e)):
                extra[ex + name + ".bias"] = torch.zeros(x, o, dtype=torch.bfloat16)
        elif mt == "laguna":
            mods[p + "mlp.gate.proj"] = (x, e, (), router)
            extra[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(x, dtype=torch.float32)
            s = cfg["shared_expert_intermediate_size"]
            sp = p + "mlp.shared_expert."
            mods.update({sp + "gate_proj": (s, e, (), experts), sp + "up_proj": (s, e, (), experts),
                         sp + "down_proj": (e, s, (), experts)})
        else:
            mods[p + "mlp.gate"] = (x, e, (), router)
    return mods, norms, extra


def cut_layers(cfg: dict, n: int) -> dict:
    """The shape with its first n layers (per-layer lists cut to match)."""
    cfg = dict(cfg, num_hidden_layers=n)
    for key in ("num_attention_heads_per_layer", "mlp_layer_types", "layer_types"):
        if key in cfg:
            v = cfg[key]
            cfg[key] = (v * (-(-n // len(v))))[:n]
    return cfg


def write_moe(name: str, out_dir: Path, layers: int | None, seed: int = 0) -> Path:
    """A MoE shape with its shipped recipe (see the module docstring)."""
    cfg = dict(MOE_SHAPES[name])
    return write_moe_config(cut_layers(cfg, layers or cfg["num_hidden_layers"]), out_dir, seed)


def write_moe_config(cfg: dict, out_dir: Path, seed: int = 0) -> Path:
    """A MoE config (a MOE_SHAPES entry, cut or not) with its family's shipped recipe."""
    g = torch.Generator().manual_seed(seed)
    default = {"qwen3_moe": (4, 64, "affine"), "laguna": (4, 16, "nvfp4"),
               "gpt_oss": (8, 64, "affine")}[cfg["model_type"]]
    return write_modules(cfg, *moe_modules(cfg), default, g, out_dir)


def write_hybrid(cfg: dict, out_dir: Path, recipe: tuple | None, layers: int | None = None,
                 seed: int = 0) -> Path:
    """A hybrid config (qwen3_5, qwen3_5_moe, qwen3_next, gemma4 and its MoE variant; see
    hybrid_tables), every module at `recipe` (bits, group, mode) but the routers (8-bit), or
    all bf16 (recipe None)."""
    if layers:
        cfg = hybrid_tables.cut(cfg, layers)
    g = torch.Generator().manual_seed(seed)
    return write_modules(cfg, *hybrid_tables.tables(cfg, g, recipe), recipe, g, out_dir)


def write_modules(cfg: dict, mods: dict, norms: dict, extra: dict, default: tuple,
                  g: torch.Generator, out_dir: Path) -> Path:
    """Modules (path -> (out, in, lead, recipe)) with random codes, unit norms, the extra
    tensors, and config.json's quantization (`default`, plus each module of another recipe,
    as mlx_lm.convert records them)."""
    cfg = dict(cfg)

    def tensors():  # generated module by module: the file is never whole in memory
        for path, (o, i, lead, recipe) in mods.items():
            t = dense(o, i, g, lead) if recipe is None else quantized(o, i, *recipe, g, lead)
            yield from ((f"{path}.{k}", v) for k, v in t.items())
        yield from extra.items()
        yield from ((f"{p}.weight", torch.ones(n, dtype=torch.bfloat16))
                    for p, n in norms.items())

    if default is not None:  # (None: a bf16 file, no quantization key)
        quant = dict(zip(("bits", "group_size", "mode"), default))
        for path, (_, _, _, recipe) in mods.items():
            if recipe is not None and recipe != default:
                quant[path] = dict(zip(("bits", "group_size", "mode"), recipe))
        cfg["quantization"] = cfg["quantization_config"] = quant
    return save_sharded(tensors(), cfg, out_dir)


def save_sharded(tensors, cfg: dict, out_dir: Path) -> Path:
    """Write (name, tensor) pairs in shards of ~2 GB, the index and config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shard, shards, size, weight_map = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, shards
        shards += 1
        fname = f"model-{shards:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "mlx"})
        weight_map.update({k: fname for k in shard})
        shard, size = {}, 0

    for name, t in tensors:
        shard[name] = t
        size += t.numel() * t.element_size()
        if size > 2 << 30:
            flush()
    if shard:
        flush()
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                      "weight_map": weight_map}))
    return out_dir


def write(name: str, out_dir: Path, bits: int, group: int, mode: str, seed: int = 0) -> Path:
    cfg = dict(SHAPES[name])
    if mode != "affine":
        bits, group = FP_MODES[mode]
    if cfg["model_type"] in ("qwen3_5", "gemma4"):
        return write_hybrid(cfg, out_dir, (bits, group, mode), seed=seed)
    return write_dense(cfg, out_dir, bits, group, mode, seed)


def write_dense(cfg: dict, out_dir: Path, bits: int, group: int, mode: str,
                seed: int = 0) -> Path:
    """A dense config (a SHAPES entry, cut or not), every module at one recipe."""
    g = torch.Generator().manual_seed(seed)
    e, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", e // h)
    mods = {"model.embed_tokens": (cfg["vocab_size"], e)}
    if not cfg["tie_word_embeddings"]:
        mods["lm_head"] = (cfg["vocab_size"], e)
    norms = {"model.norm": e}
    for i in range(L):
        p = f"model.layers.{i}."
        mods.update({p + "self_attn.q_proj": (h * d, e), p + "self_attn.k_proj": (k * d, e),
                     p + "self_attn.v_proj": (k * d, e), p + "self_attn.o_proj": (e, h * d),
                     p + "mlp.gate_proj": (f, e), p + "mlp.up_proj": (f, e),
                     p + "mlp.down_proj": (e, f)})
        norms.update({p + "input_layernorm": e, p + "post_attention_layernorm": e})
        if cfg["model_type"] == "qwen3":
            norms.update({p + "self_attn.q_norm": d, p + "self_attn.k_norm": d})
    return _save(cfg, out_dir, bits, group, mode, g, mods, norms, {})


def _save(cfg: dict, out_dir: Path, bits: int, group: int, mode: str, g: torch.Generator,
          mods: dict, norms: dict, raw: dict) -> Path:
    """Write the quantized modules, the (unit) norms and the raw float tensors, in shards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Shards of <= ~2 GB keep peak memory low while writing.
    shard, shards, size, weight_map = {}, [], 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            shards.append(shard)
            fname = f"model-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata={"format": "mlx"})
            weight_map.update({n: fname for n in shard})
            shard, size = {}, 0

    for path, (o, i) in mods.items():
        for kname, t in quantized(o, i, bits, group, mode, g).items():
            shard[f"{path}.{kname}"] = t
            size += t.numel() * t.element_size()
        if size > 2 << 30:
            flush()
    for path, n in norms.items():
        shard[f"{path}.weight"] = torch.ones(n, dtype=torch.bfloat16)
    shard.update(raw)
    flush()
    cfg["quantization"] = {"group_size": group, "bits": bits, "mode": mode}
    cfg["quantization_config"] = cfg["quantization"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                      "weight_map": weight_map}))
    return out_dir


def copy_tokenizer(src: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files of folder `src` (a tokenizer or a whole model folder: its
    config and weights stay behind) into `out_dir`; returns the names copied."""
    check_tokenizer_files(src)
    names = sorted(f.name for f in src.iterdir()
                   if f.is_file() and any(fnmatch(f.name, pat) for pat in TOKENIZER_FILES))
    for name in names:
        shutil.copy(src / name, out_dir / name)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES) + sorted(HYBRID_MOE))
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--mode", default="affine", choices=["affine", *FP_MODES])
    ap.add_argument("--tokenizer", type=Path,
                    help="copy this folder's tokenizer files (not its weights or config) in")
    ap.add_argument("--layers", type=int, help="MoE shapes: keep the first N layers")
    a = ap.parse_args()
    if a.tokenizer:
        try:
            check_tokenizer_files(a.tokenizer)  # before minutes of writing weights
        except TokenizerError as e:
            raise SystemExit(f"error: {e}") from None
    if a.shape in MOE_SHAPES:
        out = write_moe(a.shape, a.out, a.layers)
    elif a.shape in HYBRID_MOE:
        out = write_hybrid(dict(HYBRID_MOE[a.shape]), a.out, (4, 64, "affine"), a.layers)
    else:
        out = write(a.shape, a.out, a.bits, a.group_size, a.mode)
        if "embedding" in a.shape:
            write_sentence_transformers(out, SHAPES[a.shape]["hidden_size"])
    if a.tokenizer:
        copy_tokenizer(a.tokenizer, out)
    print(out)


if __name__ == "__main__":
    main()
