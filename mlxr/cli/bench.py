"""`mlxr bench MODEL [-p 512] [-n 128] [--device cpu|cuda]`: prefill and decode speed.

Prefill p tokens, then decode n tokens greedily (EOS ignored), after a warm-up; median of
repeats. Without -p and -n, 512 + 128 are halved together until they fit the model's context
(a note says so: the bundled model has 512 tokens). Decoding one token reads every weight once,
so the report puts the decode rate next to its bound: weight bytes per token / measured memory
bandwidth. The last line is one JSON object. `--pair` runs a paired A/B comparison instead (see
`mlxr bench-pair`)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from ..harness.pairbench import add_pair_args, run_pair
from .common import add_model_flags, add_parallel_flag, resolve_model


DEFAULT_LENS = (512, 128)  # prompt, decode tokens


def fit_lengths(prompt_len: int | None, num_tokens: int | None,
                context: int) -> tuple[int, int, str | None]:
    """The -p / -n to run: given ones as they are; the defaults halved together until they fit
    the context (both stay powers of two). Returns (p, n, a note when defaults were cut)."""
    p = DEFAULT_LENS[0] if prompt_len is None else prompt_len
    n = DEFAULT_LENS[1] if num_tokens is None else num_tokens
    if p + n <= context or (prompt_len is not None and num_tokens is not None):
        return p, n, None
    want = (p, n)
    while p + n > context:
        cut_p, cut_n = prompt_len is None and p > 1, num_tokens is None and n > 2
        if not (cut_p or cut_n):
            break  # the given one alone exceeds the context: cmd_bench says so
        p, n = (max(1, p // 2) if cut_p else p), (max(2, n // 2) if cut_n else n)
    note = (f"note: -p {want[0]} -n {want[1]} exceed the model's {context}-token context; "
            f"using -p {p} -n {n}")
    return p, n, note


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode speed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model directory, bundled name, alias or pulled Hub "
                   "name (default: the bundled model)")
    p.add_argument("-p", "--prompt-len", type=int, default=None, help="prompt tokens (prefill; "
                   f"default: {DEFAULT_LENS[0]}, halved with -n to fit the context)")
    p.add_argument("-n", "--num-tokens", type=int, default=None, help="tokens to decode "
                   f"(default: {DEFAULT_LENS[1]}, halved with -p to fit the context)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    p.add_argument("--pair", action="store_true", help="paired A/B benchmark (bench-pair flags)")
    add_model_flags(p)
    add_parallel_flag(p)
    add_pair_args(p)
    p.set_defaults(func=cmd_bench)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every tensor once, except that an untied
    embedding table contributes one row (the LM head is then its own matrix) and a MoE
    layer's stacked experts contribute the top-k experts' share (k of X experts: one token
    reads k distinct experts' slices; `expert_note`). A tensor-parallel model: what rank 0
    reads (its shard), the bytes one device streams."""
    from ..checkpoint import open_checkpoint

    moe = model.config.moe
    world = getattr(model.decoder, "world", 1)
    with open_checkpoint(model.path) as ckpt:
        if world > 1:
            from ..parallel.plan import make_plan
            from ..parallel.sharded_checkpoint import ShardedCheckpoint

            ckpt = ShardedCheckpoint(ckpt, make_plan(model.config, world, 0))
        total = 0
        for name, t in ckpt.tensors.items():
            if moe is not None and f".{moe.block}.{moe.experts_path}." in name:
                total += t.nbytes * moe.top_k // moe.num_experts
            else:
                total += t.nbytes
        if model.decoder.lm_head is not None:
            emb = sum(t.nbytes for n, t in ckpt.tensors.items() if n.startswith("model.embed"))
            rows = ckpt.tensors["model.embed_tokens.weight"].shape[0]
            total -= emb - emb // rows
        # gemma4's per-layer-embedding table is only gathered: one row per token
        ple = [t for n, t in ckpt.tensors.items() if ".embed_tokens_per_layer." in n]
        if ple:
            nbytes = sum(t.nbytes for t in ple)
            total -= nbytes - nbytes // ple[0].shape[0]
    return total


def expert_note(model) -> str | None:
    """The bench line's note on what the byte count assumes, for a MoE model."""
    moe = model.config.moe
    if moe is None:
        return None
    return (f"MoE: bytes count the {moe.top_k} selected of {moe.num_experts} experts per "
            f"layer (what one token reads), not every expert")


def memory_bandwidth(device) -> float:
    """Measured bytes/s: device-to-device copy (read + write) on CUDA, read (a sum) on CPU."""
    import torch

    if device.type == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return 2 * src.numel() / statistics.median(times)
    src = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    src.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - t)
    return src.numel() * 4 / statistics.median(times)


def peak_memory_gb(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def cmd_bench(args) -> int:
    if args.pair:
        return run_pair(args)
    import mlxr

    if (args.prompt_len or 1) < 1 or (args.num_tokens or 2) < 2 or args.repeats < 1:
        raise mlxr.MlxrError("need -p >= 1, -n >= 2 and --repeats >= 1")
    model = mlxr.load(resolve_model(args.model), device=args.device, dtype=args.dtype,
                      tensor_parallel=args.tensor_parallel)
    c = model.config
    args.prompt_len, args.num_tokens, note = fit_lengths(args.prompt_len, args.num_tokens,
                                                         c.context_length)
    if note:
        print(note, file=sys.stderr)
    if args.prompt_len + args.num_tokens > c.context_length:
        raise mlxr.MlxrError(f"-p {args.prompt_len} + -n {args.num_tokens} exceed the model's "
                             f"context ({c.context_length} tokens): give smaller ones")
    rng = random.Random(0)
    prompt = [rng.randrange(c.vocab_size) for _ in range(args.prompt_len)]

    def once():
        stats = None
        for chunk in model.stream(prompt, max_tokens=args.num_tokens, temperature=0,
                                  ignore_eos=True):
            stats = chunk.stats
        return stats

    once()  # warm-up: kernels compiled/tuned, graphs captured, caches allocated
    runs = [once() for _ in range(args.repeats)]
    prefill = statistics.median(r.prefill_tps for r in runs)
    decode = statistics.median(r.decode_tps for r in runs)
    wbytes = weight_bytes_per_token(model)
    bw = memory_bandwidth(model.device)
    achieved = wbytes * decode
    out = {
        "model": str(model.path.name), "device": model.device.type, "dtype": str(model.dtype),
        "tensor_parallel": args.tensor_parallel,
        "prompt_tokens": args.prompt_len, "decode_tokens": args.num_tokens,
        "prefill_tok_s": round(prefill, 2), "decode_tok_s": round(decode, 2),
        "weight_gb_per_token": round(wbytes / 1e9, 4), "achieved_gb_s": round(achieved / 1e9, 2),
        "bandwidth_gb_s": round(bw / 1e9, 2), "bound_tok_s": round(bw / wbytes, 1),
        "pct_of_bound": round(100 * achieved / bw, 1),
        "peak_memory_gb": round(peak_memory_gb(model.device), 3),
        "prefill_tok_s_all": [round(r.prefill_tps, 2) for r in runs],
        "decode_tok_s_all": [round(r.decode_tps, 2) for r in runs],
        "bytes_note": expert_note(model),
    }
    print(f"{out['model']} on {out['device']} ({out['dtype']}), median of {args.repeats}")
    print(f"  prefill {args.prompt_len:>5} tokens: {prefill:10.1f} tok/s")
    print(f"  decode  {args.num_tokens:>5} tokens: {decode:10.1f} tok/s   "
          f"{out['achieved_gb_s']:.1f} GB/s of {out['bandwidth_gb_s']:.1f} measured "
          f"({out['pct_of_bound']:.1f}% of the bound {out['bound_tok_s']:.0f} tok/s; "
          f"{out['weight_gb_per_token']:.3f} GB/token)")
    if out["bytes_note"]:
        print(f"  {out['bytes_note']}")
    print(f"  peak memory {out['peak_memory_gb']:.2f} GB")
    print(json.dumps(out))
    sys.stdout.flush()
    return 0
