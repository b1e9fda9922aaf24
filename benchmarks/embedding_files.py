"""The sentence-transformers files of an embedding model folder (make_checkpoint's embedding
shapes write them next to the random weights)."""

from __future__ import annotations

import json
from pathlib import Path


def write_sentence_transformers(out_dir: Path, dim: int) -> None:
    """The files that make a folder a sentence-transformers model with last-token pooling and
    L2 normalisation (what mlxr.embed reads)."""
    mods = [("0", "", "Transformer"), ("1", "1_Pooling", "Pooling"), ("2", "2_Normalize",
                                                                       "Normalize")]
    (out_dir / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": n, "path": p, "type": f"sentence_transformers.models.{t}"}
         for i, (n, p, t) in enumerate(mods)], indent=2))
    (out_dir / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages "
                              "that answer the query\nQuery:", "document": ""},
         "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dim, "pooling_mode_lasttoken": True,
         "include_prompt": True}, indent=2))
