"""Where two settings of a decode switch part ways: is it a near-tie? Greedy graph decode of a
checkpoint with SWITCH=OFF (the reference path) writes its token sequence; the same sequence
is then teacher-forced through the decode graph with SWITCH=ON and, as a third opinion, with
the float32 model (generic fp32 kernels). Per step: max |logit diff| over the row's range, and
at every step where an argmax differs, each path's gap between the two candidate tokens
over the row's range (a gap of a few 1e-4 is a tie that fp32 summation order can flip).

    python benchmarks/gpu/gpu_ab_logits.py MODEL_DIR SWITCH [ON OFF] [PROMPT_LEN N]
"""

from __future__ import annotations

import json
import os
import sys

import torch

import mlxr
from mlxr.engine.cuda_graph import GraphDecoder
from mlxr.engine.kv_cache import new_cache


def decode(path: str, env: dict, ids: torch.Tensor, n: int, forced: list[int] | None = None,
           dtype: str | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy (or teacher-forced on `forced`) graph decode after the prompt ids: the tokens
    and the [n, V] fp32 logits that chose them."""
    os.environ.update(env)
    m = mlxr.load(path, device="cuda", dtype=dtype)
    dec = m.decoder
    cache = new_cache(dec, max(1024, 1 << (len(ids) + n).bit_length()))
    graph = GraphDecoder(dec, cache)
    rows, toks = [], []
    with torch.inference_mode():
        row = dec.forward(ids, cache, last_only=True).float().reshape(-1)
        for i in range(n):
            rows.append(row.cpu())
            toks.append(int(row.argmax()) if forced is None else forced[i])
            row = graph.logits_for(toks[-1], len(ids) + i).float().reshape(-1)
    del m, dec, cache, graph
    torch.cuda.empty_cache()
    return toks, torch.stack(rows)


def main(path: str, switch: str, on: str = "1", off: str = "0", prompt_len: int = 300,
         n: int = 200) -> None:
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ids = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))
    toks, ref = decode(path, {switch: off}, ids, n)
    _, got = decode(path, {switch: on}, ids, n, forced=toks)
    _, f32 = decode(path, {switch: off}, ids, n, forced=toks, dtype="float32")
    rng = ref.max(-1).values - ref.min(-1).values
    rel = (got - ref).abs().max(-1).values / rng
    print(f"{switch}={on} vs {off}: max |diff| / range per step: median {rel.median():.2e}, "
          f"max {rel.max():.2e}; vs float32: {switch}={off} "
          f"{((ref - f32).abs().max(-1).values / rng).max():.2e}, {switch}={on} "
          f"{((got - f32).abs().max(-1).values / rng).max():.2e}")
    for i in (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist():
        a, b = int(ref[i].argmax()), int(got[i].argmax())
        gaps = [float((r[i, a] - r[i, b]) / rng[i]) for r in (ref, got, f32)]
        print(f"step {i}: {switch}={off} picks {a}, {switch}={on} picks {b}; gap (logit[{a}] - "
              f"logit[{b}]) / range: {off} {gaps[0]:+.2e}, {on} {gaps[1]:+.2e}, "
              f"float32 {gaps[2]:+.2e}")
    print(f"argmax differs at {int((got.argmax(-1) != ref.argmax(-1)).sum())} of {n} steps")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:5], *map(int, sys.argv[5:7]))
