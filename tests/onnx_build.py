"""Build tiny random-weight ONNX decoder exports with the ONNX Runtime GenAI model builder.

Run by the ONNX tests as a subprocess (`python onnx_build.py OUT [NAME ...]`): the builder puts
its own folder on sys.path, so it stays out of the test process. Each export comes from a tiny
Hugging Face checkpoint made here with transformers (random weights, a byte-level BPE
tokenizer with a chat template), exactly as a user's folder would: genai_config.json,
model.onnx + model.onnx.data, tokenizer files.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

# name -> (checkpoint, precision, execution provider, builder extra options)
EXPORTS = {
    "llama_int4_cpu": ("llama", "int4", "cpu", []),
    "qwen2_int4_cpu": ("qwen2", "int4", "cpu", []),
    "qwen3_int4_cpu": ("qwen3", "int4", "cpu", []),
    "llama_tied_shared": ("llama_tied", "int4", "cpu", ["shared_embeddings=true"]),
    "llama_int4_gather": ("llama", "int4", "cpu", ["op_types_to_quantize=MatMul/Gather"]),
    "llama_int4_zp128": ("llama", "int4", "cpu", ["is_symmetric=false", "block_size=128"]),
    "llama_fp32": ("llama", "fp32", "cpu", []),
    "llama_fp16": ("llama", "int4", "cuda", []),  # fp16 I/O and scales
    "llama_dml": ("llama", "int4", "dml", []),  # separate q/k/v + RotaryEmbedding, fp16
    "qwen3_fp16": ("qwen3", "int4", "cuda", []),  # q/k norms folded into GQA
    "gptoss_int4_cpu": ("gptoss", "int4", "cpu", []),  # QMoE, sinks, a sliding-window layer
}
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SHAPE = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["a tiny decoder says hello to the quick brown fox", "1 2 3 4 5 6 7 8 9 10"] * 30
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # what the builder's tokenizer copy expects
    cfg_path.write_text(json.dumps(cfg))


def checkpoint(kind: str, out: Path) -> None:
    import torch
    import transformers as T

    kw = dict(SHAPE, tie_word_embeddings=kind == "llama_tied")
    cls, cfg = {
        "llama": (T.LlamaForCausalLM, lambda: T.LlamaConfig(**kw)),
        "llama_tied": (T.LlamaForCausalLM, lambda: T.LlamaConfig(**kw)),
        "qwen2": (T.Qwen2ForCausalLM, lambda: T.Qwen2Config(**kw)),
        "qwen3": (T.Qwen3ForCausalLM, lambda: T.Qwen3Config(head_dim=32, **kw)),
        "gptoss": (T.GptOssForCausalLM, lambda: T.GptOssConfig(
            head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **dict(kw, intermediate_size=128))),
    }[kind]
    torch.manual_seed(1)
    model = cls(cfg()).eval()
    with torch.no_grad():  # default init is tiny (std 0.02): widen it so logits spread
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(2.5)
            else:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    if kind == "gptoss":
        mxfp4_experts(model.config, out)
    tokenizer(out)


def mxfp4_experts(cfg, out: Path) -> None:
    """The builder quantizes gpt-oss's experts from the original checkpoint's MXFP4 tensors
    (`<experts>.<proj>_blocks` uint8 [X, out, in/32, 16]: two e2m1 codes a byte;
    `_scales` uint8 [X, out, in/32]: e8m0 exponents): random ones beside the float weights."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    x, e, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator().manual_seed(2)
    for i in range(cfg.num_hidden_layers):
        base = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * f, e), ("down_proj", e, f)):
            tensors[base + name + "_blocks"] = torch.randint(
                0, 256, (x, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
            # exponents 2^-7 .. 2^-4: e2m1 codes up to 6 give weights up to ~0.4
            tensors[base + name + "_scales"] = torch.randint(
                120, 124, (x, rows, cols // 32), generator=gen, dtype=torch.uint8)
    save_file(tensors, path, metadata={"format": "pt"})


def build(root: Path, names: list[str]) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name in names:
        kind, precision, ep, extra = EXPORTS[name]
        src = root / "hf" / kind
        if not (src / "config.json").is_file():
            checkpoint(kind, src)
        argv = ["builder", "-i", str(src), "-o", str(root / name), "-p", precision, "-e", ep,
                "-c", str(root / "cache")]
        sys.argv = argv + (["--extra_options", *extra] if extra else [])
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")


if __name__ == "__main__":
    build(Path(sys.argv[1]), sys.argv[2:] or list(EXPORTS))
