"""Text embeddings from decoder embedding models (Qwen3-Embedding and kin, as mlx-community
ships them): the final norm's hidden states pooled per text (last token, as Qwen3-Embedding's
authors specify, or mean / first when the sentence-transformers pooling config says so), then
L2-normalised.

An embedding model is recognised from its files: the sentence-transformers files
(modules.json, config_sentence_transformers.json, 1_Pooling/config.json), an `architectures`
entry that is a bare encoder (`...Model`, no LM head), or "embedding" in its directory or Hub
repository name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from . import bounded_json
from .errors import MlxrError

ST_FILES = ("modules.json", "config_sentence_transformers.json", "1_Pooling/config.json")
MAX_BATCH_TOKENS = 8192  # tokens per forward pass (the batch is split beyond it)
# and at most this much scratch K/V per pass (Qwen3-Embedding-0.6B keeps 112 KiB per token in
# bfloat16: 8192 tokens would be 0.9 GiB; ~2300 fit). A longer text still runs, alone. The pass
# size does not move CPU throughput (8 x 512 tokens in one pass or two: equal, docs/perf.md).
MAX_SCRATCH_BYTES = 256 << 20


def is_embedding_model(path: Path) -> bool:
    path = Path(path)
    if any((path / f).is_file() for f in ST_FILES):
        return True
    try:
        archs = bounded_json.read_file(path / "config.json").get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    if any(isinstance(a, str) and a.endswith("Model") and "For" not in a for a in archs):
        return True
    return any("embedding" in part.lower() for part in path.resolve().parts[-3:])


def pooling(path: Path) -> str:
    """"last" (the default for decoders), "mean" or "cls", from 1_Pooling/config.json."""
    f = Path(path) / "1_Pooling" / "config.json"
    if not f.is_file():
        return "last"
    cfg = bounded_json.read_file(f)
    for key, mode in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                      ("pooling_mode_cls_token", "cls")):
        if cfg.get(key):
            return mode
    raise MlxrError(f"{f}: no pooling mode this server supports (lasttoken, mean_tokens, "
                    "cls_token)")


def with_instruction(text: str, instruction: str | None) -> str:
    """Qwen3-Embedding's query format: `Instruct: {task}\\nQuery:{text}` (documents go bare)."""
    return text if not instruction else f"Instruct: {instruction}\nQuery:{text}"


def _forward(decoder, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Final-norm hidden states of each sequence [L_i, E], in one forward pass over a scratch
    KV pool (each sequence its own slot range, attending to itself only)."""
    from .engine.kv_cache import KVPool
    from .models.decoder import SeqSpan, Step

    c, dev = decoder.config, decoder.device
    total = sum(len(s) for s in seqs)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 1, total, decoder.dtype, dev)
    spans, a = [], 0
    for s in seqs:
        spans.append(SeqSpan(0, len(s), slot_range=(a, a + len(s))))
        a += len(s)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
    step = Step(spans, torch.arange(total, device=dev))
    h = decoder.forward_step(ids, step, pool, hidden=True).float()
    return list(h.split([len(s) for s in seqs]))


def tokens_per_pass(decoder) -> int:
    """Tokens of one forward pass: MAX_BATCH_TOKENS, fewer where their scratch K/V (every
    layer's K and V per token) would pass MAX_SCRATCH_BYTES."""
    c = decoder.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * \
        torch.empty((), dtype=decoder.dtype).element_size()
    return max(1, min(MAX_BATCH_TOKENS, MAX_SCRATCH_BYTES // per_token))


def embed_ids(model, seqs: Sequence[Sequence[int]], mode: str = "last",
              normalize: bool = True) -> torch.Tensor:
    """Token id lists -> embeddings float32 [B, E]."""
    decoder = model.decoder
    if decoder is None or hasattr(decoder, "new_cache"):
        raise MlxrError(f"{model.path.name}: embeddings need a plain decoder (loaded with "
                        "weights, not a hybrid family)")
    ctx = model.config.context_length
    for i, s in enumerate(seqs):
        if not s:
            raise MlxrError(f"input[{i}] is empty")
        if len(s) > ctx:
            raise MlxrError(f"input[{i}] has {len(s)} tokens; the model's context is {ctx}")
    out: list[torch.Tensor] = []
    batch: list[list[int]] = []

    def run() -> None:
        for h in _forward(decoder, batch):
            out.append(h[-1] if mode == "last" else h[0] if mode == "cls" else h.mean(0))
        batch.clear()

    cap = tokens_per_pass(decoder)
    with torch.inference_mode():
        for s in seqs:
            if batch and sum(map(len, batch)) + len(s) > cap:
                run()
            batch.append(list(s))
        if batch:
            run()
    e = torch.stack(out)
    return torch.nn.functional.normalize(e, dim=-1) if normalize else e


def embed(model, texts: Sequence[str], instruction: str | None = None) -> torch.Tensor:
    """Texts -> L2-normalised embeddings float32 [B, E] (the tokenizer's special tokens
    added as the model's tokenizer.json specifies, e.g. Qwen3-Embedding's end-of-text)."""
    tok = model.tokenizer
    ids = [tok.encode(with_instruction(t, instruction), add_special_tokens=True) for t in texts]
    return embed_ids(model, ids, pooling(model.path))
