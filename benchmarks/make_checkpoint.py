"""Write a random-weight, real-shape MLX-quantized checkpoint, so anyone can reproduce the
benchmark numbers without downloading a model.

    python benchmarks/make_checkpoint.py qwen3-0.6b OUT_DIR [--bits 4] [--group-size 64]
    python benchmarks/make_checkpoint.py llama-3.1-8b OUT_DIR --bits 2
    python benchmarks/make_checkpoint.py qwen3-0.6b OUT_DIR --tokenizer TOKENIZER_DIR

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
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlxr.errors import TokenizerError
from mlxr.tokenizer import TOKENIZER_FILES, check_tokenizer_files

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
    "mistral-7b-v0.3": dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32,
                            intermediate_size=14336, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False,
                            rope_theta=1000000.0, rms_norm_eps=1e-5,
                            max_position_embeddings=32768),
}
FP_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def quantized(out: int, inp: int, bits: int, group: int, mode: str, g: torch.Generator) -> dict:
    words = inp * bits // 32
    w = torch.randint(-(2**31), 2**31, (out, words), dtype=torch.int64, generator=g)
    w = w.to(torch.int32)
    if mode == "mxfp8":  # E4M3 bytes 0x7F / 0xFF are NaN, which mlx's quantizer never writes
        b = w.view(torch.uint8)
        b[(b & 0x7F) == 0x7F] -= 1
    t = {"weight": w.view(torch.uint32)}
    if mode == "affine":
        # w = s*q + b with q uniform in [0, 2^bits): centre on zero, std ~ 0.02/sqrt(in/1024)
        s = (0.04 / (2**bits) * (1024 / inp) ** 0.5) * (1 + 0.1 * torch.rand(out, inp // group,
                                                                              generator=g))
        t["scales"] = s.to(torch.bfloat16)
        t["biases"] = (-s * (2**bits - 1) / 2).to(torch.bfloat16)
    else:
        # E8M0 (mxfp4: 2^-9, mxfp8: 2^-14) or E4M3 (nvfp4: 0x02, 2^-8) scale bytes giving
        # element magnitudes of ~0.006 rms (random E2M1 codes: 2.9 rms, E4M3: 100; nvfp4 had
        # 0x08, 2^-6, and mxfp8 2^-9, 34x mxfp4's: the 8B's random activations grew until its
        # bf16 logits were noise, docs/perf.md)
        byte = {"mxfp4": 127 - 9, "mxfp8": 127 - 14, "nvfp4": 0x02}[mode]
        t["scales"] = torch.full((out, inp // group), byte, dtype=torch.uint8)
    return t


def write(name: str, out_dir: Path, bits: int, group: int, mode: str, seed: int = 0) -> Path:
    cfg = dict(SHAPES[name])
    if mode != "affine":
        bits, group = FP_MODES[mode]
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
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--mode", default="affine", choices=["affine", *FP_MODES])
    ap.add_argument("--tokenizer", type=Path,
                    help="copy this folder's tokenizer files (not its weights or config) in")
    a = ap.parse_args()
    if a.tokenizer:
        try:
            check_tokenizer_files(a.tokenizer)  # before minutes of writing weights
        except TokenizerError as e:
            raise SystemExit(f"error: {e}") from None
    out = write(a.shape, a.out, a.bits, a.group_size, a.mode)
    if a.tokenizer:
        copy_tokenizer(a.tokenizer, out)
    print(out)


if __name__ == "__main__":
    main()
