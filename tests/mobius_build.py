"""Build tiny random-weight ONNX decoders with Mobius (PyPI `mobius-onnx`), the second exporter
mlxr's ONNX path is checked against.

Run by the ONNX tests as a subprocess (`python mobius_build.py OUT [NAME ...]`), like
onnx_build.py. Mobius builds graphs from a model definition rather than tracing one: `build`
reads a Hugging Face folder (float weights: plain MatMul projections), and `build-gguf
--keep-quantized` reads a GGUF file and keeps its Q4_0 / Q4_1 blocks as MatMulNBits /
GatherBlockQuantized (int4 block 32; Q4_1 with zero points). Mobius does not quantize float
weights itself, so the GGUF is written here from the same tiny checkpoint onnx_build.py makes,
with the gguf package's own quantizers. (Qwen3 comes only from `build`: mobius-onnx 0.1.0's
GGUF path skips the q/k norm tensors of a qwen3 GGUF, so its graph would be Llama's.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from onnx_build import checkpoint  # noqa: E402

# name -> (checkpoint, how it is built, GGUF quantization or None, execution provider, dtype)
EXPORTS = {
    "mobius_llama_f32": ("llama", "build", None, "cpu", "f32"),
    "mobius_qwen3_f32": ("qwen3", "build", None, "cpu", "f32"),
    "mobius_llama_q4_0": ("llama", "gguf", "q4_0", "cpu", "f32"),
    "mobius_llama_q4_1": ("llama", "gguf", "q4_1", "cpu", "f32"),
    "mobius_llama_q4_0_fp16": ("llama", "gguf", "q4_0", "cuda", "f16"),
}
# HF module path (after model.layers.N.) -> GGUF tensor name (after blk.N.)
LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def rotary_rows_to_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """Llama's q/k rows in GGUF's order. HF rotates half-split pairs (i, i + D/2) of each head;
    GGUF (llama.cpp) keeps the original checkpoint's adjacent pairs (2i, 2i + 1): row i of a
    head's first half goes to 2i, row i of its second half to 2i + 1. Qwen3 GGUFs keep HF's
    order (its runtime rotates half-split pairs)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def write_gguf(hf: Path, out: Path, quant: str) -> None:
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf / "config.json").read_text())
    arch = cfg["model_type"]
    qtype = {"q4_0": gguf.GGMLQuantizationType.Q4_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1}[quant]
    tensors = load_file(hf / "model.safetensors")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
    w.add_rope_freq_base(float(rope))
    w.add_file_type({"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[quant])
    tokenizer_metadata(w, hf, cfg["vocab_size"])

    def add(name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim == 1:  # norm weights stay float, as llama.cpp's converter leaves them
            w.add_tensor(name, value)
            return
        q = gguf.quants.quantize(value, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_TENSORS.items():
            key = f"model.layers.{i}.{hf_name}.weight"
            if key not in tensors:
                continue
            value = tensors[key]
            if arch == "llama" and hf_name in ("self_attn.q_proj", "self_attn.k_proj"):
                value = rotary_rows_to_gguf(value, heads if "q_proj" in hf_name else kv_heads)
            add(f"blk.{i}.{gguf_name}.weight", value)
    add("output_norm.weight", tensors["model.norm.weight"])
    add("output.weight", tensors["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenizer_metadata(w, hf: Path, vocab: int) -> None:
    """The byte-level BPE of tokenizer.json as GGUF 'gpt2' tokenizer metadata, padded with
    unused tokens to the embedding's rows (GGUF readers expect one token per row)."""
    import json

    import gguf

    tok = json.loads((hf / "tokenizer.json").read_text())["model"]
    ids = sorted(tok["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in ids] + [f"<unused{i}>" for i in range(vocab - len(ids))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(ids)
                      + [gguf.TokenType.UNUSED] * (vocab - len(ids)))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def build(root: Path, names: list[str]) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    from mobius.__main__ import main
    for name in names:
        kind, how, quant, ep, dtype = EXPORTS[name]
        src = root / "hf" / kind
        if not (src / "config.json").is_file():
            checkpoint(kind, src)
        out = root / name
        if how == "build":
            cmd = ["build", "--config", str(src), "--ep", ep, "--dtype", dtype,
                   "--runtime", "ort-genai", str(out)]
        else:
            path = root / f"{kind}_{quant}.gguf"
            if not path.is_file():
                write_gguf(src, path, quant)
            cmd = ["build-gguf", str(path), "--keep-quantized", "--ep", ep, "--dtype", dtype,
                   "-o", str(out)]
        main(cmd)  # Mobius' CLI in this process (one import for every export)


if __name__ == "__main__":
    build(Path(sys.argv[1]), sys.argv[2:] or list(EXPORTS))
