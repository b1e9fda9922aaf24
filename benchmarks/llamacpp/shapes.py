"""The shapes the side by side runs, one config per shape for both sides.

The MLX config is make_checkpoint's own table entry (cut to `layers`), so mlxr's checkpoint
and llama.cpp's GGUF are the same shape by construction; the HF config llama.cpp's converter
reads is that entry's text model, completed by transformers' own config class (every default
key written out, as `save_pretrained` writes it). Wrapper checkpoints (qwen3_5, gemma4) are
written as their text model alone on both sides: llama.cpp converts the text model, and
make_checkpoint writes no vision or audio tower either.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # make_checkpoint and hybrid_tables: benchmarks/ is no package
import hybrid_tables  # noqa: E402
import make_checkpoint  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """How one named shape is made on the llama.cpp side.

    tokenizer: folder (under the tokenizers root) whose real tokenizer the GGUF carries; the
    converter pads a smaller vocabulary to the config's (`pad_vocab`: we pad it ourselves,
    for converters that do not). quant: llama-quantize's type and the per-tensor overrides
    that give every tensor the bytes mlxr's checkpoint has (4.5 bits/weight for MLX affine
    4-bit g64 = Q4_0, embeddings and head included; gpt-oss: mxfp4 experts, 8-bit rest).
    convert_flags: for convert_hf_to_gguf.py (Qwen3.5: no multi-token-prediction layer, which
    mlx-lm drops and make_checkpoint does not write)."""

    tokenizer: str
    quant: tuple[str, ...]
    pad_vocab: bool = False
    convert_flags: tuple[str, ...] = ()


Q4_0_EVERYWHERE = ("--output-tensor-type", "q4_0", "--token-embedding-type", "q4_0", "Q4_0")
SHAPES = {
    "qwen3-0.6b": Shape("qwen3-0.6b-base", Q4_0_EVERYWHERE),
    "llama-3.1-8b": Shape("llama3-tokenizer-json", Q4_0_EVERYWHERE),
    "qwen3-30b-a3b": Shape("qwen3-0.6b-base", Q4_0_EVERYWHERE),
    # mlx-community's MXFP4-Q8: mxfp4 experts, affine 8-bit everything else (= Q8_0's bytes)
    "gpt-oss-20b": Shape("qwen3-0.6b-base", ("--output-tensor-type", "q8_0",
                                             "--token-embedding-type", "q8_0", "MXFP4_MOE")),
    "qwen3.5-0.8b": Shape("qwen3-0.6b-base", Q4_0_EVERYWHERE, convert_flags=("--no-mtp",)),
    "qwen3.5-2b": Shape("qwen3-0.6b-base", Q4_0_EVERYWHERE, convert_flags=("--no-mtp",)),
    # Gemma 4's converter takes an SPM-style BPE tokenizer.json and does not pad: Phi-3's
    # (Llama 2's vocabulary), padded with unused tokens to Gemma's 262,144
    "gemma-4-e2b": Shape("phi-3-mini-4k", Q4_0_EVERYWHERE, pad_vocab=True),
}


def full_layers(name: str) -> int:
    """The shape's layer count uncut."""
    return hybrid_tables.text_config(mlx_config(name, None))["num_hidden_layers"]


def mlx_config(name: str, layers: int | None) -> dict:
    """make_checkpoint's config of the shape, with its first `layers` layers (None: all)."""
    if name in make_checkpoint.MOE_SHAPES:
        cfg = dict(make_checkpoint.MOE_SHAPES[name])
        return make_checkpoint.cut_layers(cfg, layers) if layers else cfg
    cfg = dict(make_checkpoint.SHAPES[name])
    if not layers:
        return cfg
    if "text_config" not in cfg:
        return dict(cfg, num_hidden_layers=layers)
    cfg = hybrid_tables.cut(cfg, layers)
    t = cfg["text_config"]
    if "num_kv_shared_layers" in t:
        # Gemma 4: about the shared fraction (20 of 35), leaving at least one whole sliding
        # pattern unshared, so each layer type has a layer producing the cache it reads
        full = make_checkpoint.SHAPES[name]["text_config"]
        scaled = layers * full["num_kv_shared_layers"] // full["num_hidden_layers"]
        t["num_kv_shared_layers"] = min(scaled, max(0, layers - t["sliding_window_pattern"]))
    return cfg


def hf_config(name: str, layers: int | None) -> dict:
    """The HF config.json (as a dict) of the shape's text model, every key transformers
    defines, `architectures` naming the causal-LM class llama.cpp's converter dispatches on."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = mlx_config(name, layers)
    text = dict(hybrid_tables.text_config(cfg))
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
    if "sliding_window_pattern" in text:  # Gemma: every pattern-th layer is full attention
        n = text["sliding_window_pattern"]
        text["layer_types"] = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                               for i in range(text["num_hidden_layers"])]
    mt = text.pop("model_type")
    out = AutoConfig.for_model(mt, **text).to_dict()
    out["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]]
    out["torch_dtype"] = out["dtype"] = "bfloat16"
    if mt == "gpt_oss":  # shipped with mxfp4 experts; the converter repacks them losslessly
        out["quantization_config"] = {"quant_method": "mxfp4"}
    return out


def write_mlx(name: str, layers: int | None, out: Path) -> Path:
    """mlxr's checkpoint of the shape, by make_checkpoint's writers (4-bit g64, or the
    shape's shipped recipe for the MoE shapes)."""
    cfg = mlx_config(name, layers)
    if name in make_checkpoint.MOE_SHAPES:
        return make_checkpoint.write_moe_config(cfg, out)
    if "text_config" in cfg:
        return make_checkpoint.write_hybrid(cfg, out, (4, 64, "affine"))
    return make_checkpoint.write_dense(cfg, out, 4, 64, "affine")
