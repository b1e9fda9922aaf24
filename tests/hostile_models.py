"""A tiny real model folder for hostile-input tests and the fuzzer: an mlx-lm-saved 4-bit qwen3
(vocab 320, built by mlx_ref) plus a byte-level BPE tokenizer.json of 256 byte tokens, a few
merges and ChatML control tokens, a tokenizer_config.json with a chat template and a
generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(d: Path, vocab_size: int = 320) -> None:
    """tokenizer.json + tokenizer_config.json with ids < `vocab_size` (the embedding rows)."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]:
        if len(vocab) >= vocab_size - len(CONTROL):
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(CONTROL)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False}))


def make_folder(mlx_ref, out: Path) -> Path:
    """The tiny 4-bit qwen3 with its tokenizer files and sampling defaults."""
    d = mlx_ref.make_model(out, "qwen3", "mixed")
    write_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "eos_token_id": [262]}))
    return d
