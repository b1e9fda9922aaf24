"""A random-weight HF bf16 checkpoint of a config, for llama.cpp's convert_hf_to_gguf.py.

The tensor names and shapes are transformers' own: the model is built on the meta device (no
memory), and each tensor of its state dict is then filled and written in turn, in safetensors
shards of ~2 GB, so an 8B model (16 GB in bf16) never sits whole in RAM. gpt-oss is written
as it ships, its experts in mxfp4 (`*_blocks` uint8 [E, out, in/32, 16] and `*_scales` E8M0
uint8 [E, out, in/32]), which the converter repacks without dequantizing.

Values: matrices N(0, 0.02) like make_checkpoint's, vectors 1 (norms, layer scalars) or 0
(biases, sinks, A_log, dt_bias): finite activations, nothing else matters for speed.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 2 << 30
MXFP4_SCALE = 127 - 9  # E8M0 2^-9: elements of ~0.006 rms, as make_checkpoint's mxfp4


def meta_state(cfg: dict) -> dict[str, torch.Tensor]:
    """The model's state dict on the meta device: name -> tensor of the right shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    cfg.pop("quantization_config", None)  # the layout is written by hand (random_tensors)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def random_tensors(cfg: dict, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint, one at a time."""
    g = torch.Generator().manual_seed(seed)
    mxfp4 = cfg.get("quantization_config", {}).get("quant_method") == "mxfp4"
    for name, meta in meta_state(cfg).items():
        if mxfp4 and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers holds [E, in, out]; the file holds [E, out, in/32, 16] codes
            e, k, n = meta.shape
            codes = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
            yield name + "_blocks", codes
            yield name + "_scales", torch.full((e, n, k // 32), MXFP4_SCALE, dtype=torch.uint8)
        elif meta.dim() >= 2:
            t = torch.empty(meta.shape, dtype=torch.bfloat16)
            yield name, t.normal_(0.0, 0.02, generator=g)
        else:
            one = "norm" in name or "scalar" in name
            yield name, (torch.ones if one else torch.zeros)(meta.shape, dtype=torch.bfloat16)


def write_hf(cfg: dict, out: Path, seed: int = 0) -> Path:
    """config.json, the safetensors shards and their index in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size, n, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, n
        n += 1
        fname = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        shard, size = {}, 0

    for name, t in random_tensors(cfg, seed):
        shard[name] = t
        size += t.numel() * t.element_size()
        if size > SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


def copy_tokenizer(src: Path, out: Path, vocab_size: int | None = None) -> list[str]:
    """Copy a tokenizer folder's files into `out` (X.gz unpacked to X, its config.json
    left out: the model's is written beside); `vocab_size`: pad tokenizer.json's vocabulary
    to it (pad_vocab). Returns the names written."""
    names = []
    for f in sorted(src.iterdir()):
        name = f.name.removesuffix(".gz")
        if not f.is_file() or name == "config.json":
            continue
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rb") as i, open(out / name, "wb") as o:
            shutil.copyfileobj(i, o)
        names.append(name)
    if vocab_size is not None:
        pad_vocab(out / "tokenizer.json", vocab_size)
    return names


def pad_vocab(path: Path, vocab_size: int) -> None:
    """Fill a BPE tokenizer.json's vocabulary to `vocab_size` ids: its added tokens become
    vocabulary entries at their ids (so transformers appends none past `vocab_size`), the
    free ids `<unused_N>`."""
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    for a in tok["added_tokens"]:
        vocab.setdefault(a["content"], a["id"])
    taken = set(vocab.values())
    vocab.update({f"<unused_{i}>": i for i in range(vocab_size) if i not in taken})
    path.write_text(json.dumps(tok, ensure_ascii=False))
