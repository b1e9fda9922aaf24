"""Does a decode-path switch (MLXR_PDL, MLXR_DECODE_FUSED, ...) change greedy tokens or logits?
Greedy graph decode of a checkpoint with the environment as set; writes the token ids and the
last step's logits.

    MLXR_PDL=1 python benchmarks/gpu/gpu_ab_check.py MODEL_DIR on.pt
    MLXR_PDL=0 python benchmarks/gpu/gpu_ab_check.py MODEL_DIR off.pt
    python benchmarks/gpu/gpu_ab_check.py --compare on.pt off.pt   # exit 1 unless identical
    ... gpu_ab_check.py MODEL_DIR out.pt PROMPT_LEN   # a longer prompt (default 300 tokens)

Each run is its own process (the graphs are captured once per process).
"""

from __future__ import annotations

import sys

import torch

import mlxr
from mlxr.engine.cuda_graph import GraphDecoder
from mlxr.engine.kv_cache import new_cache


def run(path: str, out: str, prompt_len: int = 300, n: int = 200) -> None:
    m = mlxr.load(path, device="cuda")
    dec = m.decoder
    cache = new_cache(dec, max(1024, 1 << (prompt_len + n - 1).bit_length()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (prompt_len,), generator=g)
    graph = GraphDecoder(dec, cache)  # before the prompt: its warm-up steps write slots 0, 1
    with torch.inference_mode():
        logits = dec.forward(ids, cache, last_only=True)
        first = int(logits.reshape(-1).argmax())
        toks = list(graph.greedy(first, prompt_len, n))
        last = graph.logits_for(toks[-1], prompt_len + n).float().cpu()
    torch.save({"tokens": toks, "logits": last}, out)
    print(out, toks[:8], len(toks))


def compare(a: str, b: str) -> None:
    x, y = torch.load(a), torch.load(b)
    same_t = x["tokens"] == y["tokens"]
    same_l = torch.equal(x["logits"], y["logits"])
    lead = next((i for i, (a, b) in enumerate(zip(x["tokens"], y["tokens"])) if a != b),
                len(x["tokens"]))
    diff = float((x["logits"] - y["logits"]).abs().max())
    print(f"tokens identical: {same_t} (first {lead} of {len(x['tokens'])} equal), last logits "
          f"bit-identical: {same_l} (max |diff| {diff:.3g})")
    sys.exit(0 if same_t and same_l else 1)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
