"""Host work of a Gemma 4 prefill and decode step, counted on the CPU: the ops a CUDA run
issues (Triton launches, torch ops, allocations), per forward and per layer.

    PYTHONPATH=. python benchmarks/cpu/gemma4_host_ops.py [--model DIR] [--tokens 64]

The small ops take their CUDA path (`ops._fast` forced on, the kernels run by the Triton
interpreter), so each Triton launch and each torch op is one a CUDA forward would issue;
"kernels" also counts the torch ops that launch one (not views, allocations, no-op casts). The
quantized projections and embeddings (CPU kernels here, one CUDA kernel each: qgemm / q4tc /
embed_rows) and the prefill's attention (`ops.attention`: SDPA on CUDA, another branch on the
CPU; on CUDA its sliding-window layers also build a mask, ~7 small ops) count as one launch
each, their own ops uncounted. A warm-up forward runs first (RoPE tables, compiles). Without
--model it writes a random checkpoint with Gemma-4-E2B's structure (35 layers, the last 20
KV-shared, every fifth a full-attention layer, per-layer embeddings, the double-wide MLP of the
shared layers, 4-bit g64) at small widths; the counts do not depend on the widths.
"allocations": the explicit empties plus each out-of-place torch kernel's output. The last line
is JSON.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make_checkpoint, hybrid_tables
import hybrid_tables  # noqa: E402
import make_checkpoint  # noqa: E402

import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.ops.layer import norm_rope_act  # noqa: E402
from mlxr.quant.weight import QuantWeight  # noqa: E402

class Counter(TorchDispatchMode):
    """Counts aten ops by name, and Triton launches / quantized kernels by kind; ops issued
    inside a counted kernel (the interpreter's copies, the CPU matmul) are not counted."""

    def __init__(self):
        super().__init__()
        self.aten: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.aten[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def kernel(self, name: str):
        if not self.paused:
            self.kernels[name] += 1
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _patch(counter: Counter) -> contextlib.ExitStack:
    """Route the quantized kernels and every Triton launch through `counter`."""
    import triton.runtime.interpreter as interp

    stack = contextlib.ExitStack()
    mp = stack.enter_context(_Patcher())

    def wrap(owner, name, label):
        orig = getattr(owner, name)

        def counted(self, *a, **k):
            with counter.kernel(label(self)):
                return orig(self, *a, **k)
        mp.set(owner, name, counted)

    wrap(interp.InterpretedFunction, "run",
         lambda f: "triton:" + getattr(f.fn, "__name__", "?"))
    wrap(QuantWeight, "linear", lambda w: "qmatmul")
    wrap(QuantWeight, "embed", lambda w: "qembed")
    attention = ops.attention

    def attend(*a, **k):  # its CPU branch is not the CUDA one (SDPA): counted as one kernel
        with counter.kernel("attention"):
            return attention(*a, **k)
    mp.set(ops, "attention", attend)
    mp.set(ops, "_fast", lambda x: True)
    mp.set(ops, "_fused", norm_rope_act)
    return stack


class _Patcher:
    """setattr with undo on exit (a tiny monkeypatch)."""

    def __enter__(self):
        self.undo = []
        return self

    def set(self, owner, name, value) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __exit__(self, *exc):
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)


def count(fn) -> Counter:
    counter = Counter()
    with _patch(counter), counter, torch.inference_mode():
        fn()
    return counter


# aten ops that launch nothing on a GPU: views, metadata, allocations, no-op casts
NO_KERNEL = {"reshape", "view", "slice", "select", "transpose", "alias", "unsqueeze", "squeeze",
             "expand", "chunk", "split", "as_strided", "t", "detach", "empty", "empty_like",
             "empty_strided", "promote_types", "to", "contiguous", "permute", "flatten",
             "_unsafe_view", "split_with_sizes", "unbind", "lift_fresh", "result_type"}


def summary(c: Counter, layers: int) -> dict:
    torch_kernels = sum(v for k, v in c.aten.items() if k not in NO_KERNEL)
    launches = sum(c.kernels.values()) + torch_kernels
    aten = sum(c.aten.values())
    empty = sum(c.aten[k] for k in ("empty", "empty_like", "empty_strided")) + sum(
        v for k, v in c.aten.items() if k not in NO_KERNEL and not k.endswith("_"))
    return {"kernels": launches, "triton": sum(v for k, v in c.kernels.items()
                                               if k.startswith("triton:")),
            "quant_kernels": c.kernels["qmatmul"] + c.kernels["qembed"],
            "attention": c.kernels["attention"], "torch_kernels": torch_kernels,
            "torch_ops": aten, "allocations": empty,
            "per_layer": {"kernels": round(launches / layers, 1),
                          "torch_ops": round(aten / layers, 1),
                          "allocations": round(empty / layers, 1)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a gemma4 checkpoint (default: a small one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12, help="op names listed")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32 keeps the weights' MLX words, which the per-layer-input "
                         "kernels (on CUDA by default) read; bf16 on the CPU drops them")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or make_checkpoint.write_hybrid(
            hybrid_tables.narrow_gemma4(make_checkpoint.SHAPES["gemma-4-e2b"]), Path(tmp),
            (4, 64, "affine"))
        m = mlxr.load(path, device="cpu", dtype=a.dtype)
    dec = m.decoder
    n_layers = dec.config.num_layers
    ids = torch.randint(0, m.config.vocab_size, (a.tokens,), generator=torch.Generator()
                        .manual_seed(0))
    with _patch(Counter()), torch.inference_mode():  # warm: RoPE tables, compiled kernels
        dec.forward(ids, new_cache(dec, 2 * a.tokens + 8), last_only=True)
    cache = new_cache(dec, 2 * a.tokens + 8)
    prefill = count(lambda: dec.forward(ids, cache, last_only=True))
    tables = {id(r.spec): r.cos_sin(0, cache.capacity) for r in dec.ropes}
    pos = torch.tensor([a.tokens])
    step = count(lambda: dec.forward_static(ids[:1], pos, cache.pool, tables))
    out = {"layers": n_layers, "prefill_tokens": a.tokens,
           "prefill": summary(prefill, n_layers), "decode_step": summary(step, n_layers)}
    for name, c in (("prefill", prefill), ("decode step", step)):
        print(f"{name}: {summary(c, n_layers)}")
        print("  kernels:", dict(c.kernels.most_common(a.top)))
        print("  torch ops:", dict(c.aten.most_common(a.top)))
        print("  torch kernels:", {k: v for k, v in c.aten.most_common() if k not in NO_KERNEL})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
