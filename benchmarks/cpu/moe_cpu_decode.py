"""CPU decode of a MoE checkpoint against its DRAM bound.

    python benchmarks/make_checkpoint.py qwen3-30b-a3b /tmp/q30 --layers 8
    python benchmarks/cpu/moe_cpu_decode.py /tmp/q30 [--tokens 32] [--prompt 16]

Prints decode tok/s (bf16 compute, greedy, after a short prompt), the bytes one token reads
(every non-expert projection, the LM head, the router, and top-k experts per MoE layer at
their stored size), the measured read bandwidth (a large bf16 sum) and the resulting bound
and fraction of it. The expert bytes assume k distinct experts per layer, which is what a
single sequence's token reads.
"""

from __future__ import annotations

import argparse
import time

import torch

import mlxr
from mlxr.layers import Linear
from mlxr.quant import QuantWeight


def _bytes(lin) -> int:
    """Stored bytes one matmul with this projection reads."""
    parts = getattr(lin, "parts", None) or [lin]
    total = 0
    for p in parts:
        w = p.weight
        if isinstance(w, QuantWeight):
            total += sum(t.numel() * t.element_size() for t in (w.i4, w.i4_sz, w.packed,
                                                                  w.codes, w.dense, w.scales,
                                                                  w.biases) if t is not None
                         and not (w.i4 is not None and t is w.packed))
        else:
            total += w.numel() * w.element_size()
        if isinstance(p, Linear) and p.bias is not None:
            total += p.bias.numel() * p.bias.element_size()
    return total


def bytes_per_token(dec) -> int:
    total = _bytes(dec.head)
    for layer in dec.layers:
        total += sum(_bytes(p) for p in (layer.qkv, layer.o_proj, layer.head_gate) if p)
        if layer.moe is None:
            total += _bytes(layer.gate_up) + _bytes(layer.down_proj)
            continue
        m = layer.moe
        per_expert = (sum(_bytes(g) for g in m.gate_up) + sum(_bytes(d) for d in m.down)) \
            / m.spec.num_experts
        total += _bytes(m.router) + m.spec.top_k * per_expert
        if m.shared_down is not None:
            total += _bytes(m.shared_gate_up) + _bytes(m.shared_down)
    return int(total)


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second of a bf16 sum over a buffer far larger than the caches."""
    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 2 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    a = ap.parse_args()
    t = time.perf_counter()
    model = mlxr.load(a.model, device="cpu")
    print(f"load {time.perf_counter() - t:.1f} s")
    ids = list(range(100, 100 + a.prompt))
    list(model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True))  # warm-up

    def run(n: int) -> float:
        t = time.perf_counter()
        list(model.generate(ids, max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t

    # the decode steps alone: a long run minus a one-token run (the same prefill)
    tok_s = a.tokens / (run(a.tokens + 1) - run(1))
    per_tok = bytes_per_token(model.decoder)
    bw = read_bandwidth()
    bound = bw / per_tok
    print(f"decode {tok_s:.2f} tok/s; {per_tok / 1e6:.1f} MB read per token; read bandwidth "
          f"{bw / 1e9:.1f} GB/s; bound {bound:.2f} tok/s; {100 * tok_s / bound:.0f}% of it")


if __name__ == "__main__":
    main()
