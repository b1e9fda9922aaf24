"""MoE on CUDA, one invocation, three parts:

1. kernels: every MoE kernel against its torch twin on random stacked experts of every
   expert quant mode, float32 and bf16 (scripts/moe_gpu_kernels.py states the tolerances),
   and the decode kernels replayed in a CUDA graph;
2. parity: tiny mlx-lm-made models of every MoE test case, loaded on both devices in float32,
   teacher-forced logits compared (1e-3 of each position's range, the CPU parity bound; split
   experts = the torch path, stacked = the MoE kernels), a bf16 CUDA load checked for finite
   logits; the decode CUDA graph's logits vs the eager step's (same bound), and the serving
   engine's batched greedy tokens vs each request alone (float32, captured paged decode);
3. bench: a qwen3-30b-a3b-shaped checkpoint (benchmarks/make_checkpoint.py, its first
   --layers layers), bf16: prefill of 512 tokens, greedy decode of 128 in the CUDA graph,
   tok/s and GB/s of the bytes one token touches (the top-k experts' share, as `mlxr bench`
   counts them); the MoE kernels alone per layer (decode GB/s, prefill TFLOP/s).

    PYTHONPATH=. python scripts/moe_gpu_check.py DIR [--layers 4] [--skip kernels,parity,bench]

Models already in DIR/<family>-<quant> are used as they are (made elsewhere, e.g. where mlx
is installed); the others are made there (mlx-lm needed). The bench checkpoint is written to
DIR/qwen3-30b-a3b-L<layers> once.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

os.environ.setdefault("MLXR_MOE_GRAPHS", "1")  # the MoE decode graph is under test
import mlxr  # noqa: E402
from decode_checks import run_ids  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.engine.cuda_graph import GraphDecoder, graphable  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

# test_parity_moe.CASES (imported from there where mlx is installed)
CASES = [("qwen3_moe", q) for q in ("bf16", "q4g64", "q8g64", "mxfp4")] + [
    ("mixtral", "bf16"), ("mixtral", "q4g64")] + [
    ("gpt_oss", q) for q in ("bf16", "q4g64", "mxfp4", "mxfp4_q8")] + [
    ("laguna", q) for q in ("bf16", "laguna_nvfp4", "q4g64", "nvfp4_gs", "mxfp8")]
GRAPH_CASES = [("qwen3_moe", "q4g64"), ("gpt_oss", "mxfp4"), ("laguna", "nvfp4_gs"),
               ("laguna", "laguna_nvfp4")]
VOCAB = 320  # mlx_ref.BASE["vocab_size"]
TOL = 1e-3


def model_dir(out: Path, family: str, quant: str) -> Path:
    path = out / f"{family}-{quant}"
    if not (path / "config.json").is_file():
        import mlx_ref

        mlx_ref.make_model(path, family, quant)
    return path


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got - want).max(-1) / (want.max(-1) - want.min(-1))).max())


def parity(out: Path) -> float:
    worst = 0.0
    for mode in ("split", "stacked"):
        os.environ["MLXR_MOE"] = mode
        print(f"-- experts {mode} ({'torch path' if mode == 'split' else 'MoE kernels'})")
        for family, quant in CASES:
            path = model_dir(out, family, quant)
            rng = random.Random(0)
            seq = [rng.randrange(VOCAB) for _ in range(40)]
            cpu = mlxr.load(path, device="cpu", dtype="float32").logits(seq).numpy()
            gpu = mlxr.load(path, device="cuda", dtype="float32").logits(seq).numpy()
            err = rel_err(gpu, cpu)
            bf16 = mlxr.load(path, device="cuda").logits(seq)
            worst = max(worst, err)
            print(f"{family:10s} {quant:13s} cuda-vs-cpu f32 {err:.2e}  bf16 finite "
                  f"{bool(torch.isfinite(bf16).all())}", flush=True)
    os.environ["MLXR_MOE"] = "stacked"
    print("-- decode CUDA graph vs eager step (float32)")
    for family, quant in GRAPH_CASES:
        worst = max(worst, graph_vs_eager(model_dir(out, family, quant), family, quant))
    print("-- serving engine: batched == alone (float32, captured paged decode)")
    for family, quant in (("gpt_oss", "mxfp4"), ("qwen3_moe", "q4g64")):
        worst = max(worst, engine_batch(model_dir(out, family, quant), family, quant))
    return worst


def graph_vs_eager(path: Path, family: str, quant: str) -> float:
    model = mlxr.load(path, device="cuda", dtype="float32")
    dec = model.decoder
    if not graphable(dec):
        print(f"{family:10s} {quant:13s} NOT graphable: FAIL")
        return float("inf")
    rng = random.Random(1)
    seq = [rng.randrange(VOCAB) for _ in range(30)]
    eager, static = new_cache(dec, 256), new_cache(dec, 256)
    graph = GraphDecoder(dec, static)
    err = 0.0
    with torch.inference_mode():
        dec.forward(torch.tensor(seq[:20], device="cuda"), eager, last_only=True)
        dec.forward(torch.tensor(seq[:20], device="cuda"), static, last_only=True)
        for p in range(20, 30):
            want = dec.forward(torch.tensor([seq[p]], device="cuda"), eager,
                               last_only=True)[0].cpu().numpy()
            got = graph.logits_for(seq[p], p).cpu().numpy()
            err = max(err, rel_err(got[None], want[None]))
    print(f"{family:10s} {quant:13s} graph-vs-eager {err:.2e} "
          f"({'ok' if err <= TOL else 'FAIL'})", flush=True)
    return err


def engine_batch(path: Path, family: str, quant: str) -> float:
    model = mlxr.load(path, device="cuda", dtype="float32")
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 11, 23, 8, 30)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batched = run_ids(LLMEngine(model, max_num_seqs=8, max_num_batched_tokens=64),
                      [EngineRequest(p, params) for p in prompts])
    alone = [run_ids(LLMEngine(model, max_num_seqs=1), [EngineRequest(p, params)])[0]
             for p in prompts]
    same = sum(a == b for a, b in zip(batched, alone))
    print(f"{family:10s} {quant:13s} engine batched == alone: {same}/{len(prompts)} "
          f"({'ok' if same == len(prompts) else 'FAIL'})", flush=True)
    return 0.0 if same == len(prompts) else float("inf")


def _time(fn, reps: int = 5, warm: int = 2) -> float:
    """Median seconds of fn() (CUDA events)."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def bench(out: Path, layers: int) -> None:
    from mlxr.cli.bench import expert_note, memory_bandwidth, weight_bytes_per_token

    path = out / f"qwen3-30b-a3b-L{layers}"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_checkpoint.py"),
                        "qwen3-30b-a3b", str(path), "--layers", str(layers)], check=True)
    os.environ["MLXR_MOE"] = "stacked"
    model = mlxr.load(path, device="cuda")
    dec = model.decoder
    wbytes = weight_bytes_per_token(model)
    bw = memory_bandwidth(dec.device)
    print(f"-- bench qwen3-30b-a3b shape, {layers} layers, bf16: {wbytes / 1e9:.3f} GB/token "
          f"touched ({expert_note(model)}); copy bandwidth {bw / 1e9:.0f} GB/s")
    rng = random.Random(0)
    prompt = torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(512)],
                          device="cuda")
    cache = new_cache(dec, 1024)

    def prefill():
        cache.length = 0
        with torch.inference_mode():
            return dec.forward(prompt, cache, last_only=True)

    t = _time(prefill)
    print(f"  prefill 512: {512 / t:10.1f} tok/s ({t * 1e3:.1f} ms)", flush=True)
    graph = GraphDecoder(dec, cache)
    first = int(prefill()[0].argmax())
    n = 128

    def decode():
        for _ in graph.greedy(first, 512, n):
            pass

    t = _time(decode, reps=3, warm=1)
    print(f"  decode {n} (CUDA graph): {n / t:10.1f} tok/s  {wbytes * n / t / 1e9:7.1f} GB/s "
          f"({100 * wbytes * n / t / bw:.1f}% of copy bandwidth)", flush=True)

    def eager():
        for _ in range(16):
            with torch.inference_mode():
                dec.forward(torch.tensor([first], device="cuda"), cache, last_only=True)
            cache.length -= 1

    prefill()
    t = _time(eager, reps=3, warm=1)
    print(f"  decode eager: {16 / t:10.1f} tok/s", flush=True)
    kernels_alone(dec, bw)


def kernels_alone(dec, bw: float) -> None:
    """One MoE layer's expert kernels (no router, no attention): decode T=1 in GB/s of the k
    experts' bytes, prefill T=512 in TFLOP/s (3 matmuls of 2*E*F per pair)."""
    from mlxr import ops

    blk = next(layer.moe for layer in dec.layers if layer.moe is not None)
    gate, up, down = blk.quant
    s = blk.spec
    x_, f, e = gate.shape
    per_expert = sum(t.nbytes for q in (gate, up, down)
                     for t in (q.w, q.scales, q.biases, q.global_scale, q.bias)
                     if t is not None) / x_
    for t in (1, 4, 512):
        x = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(x_, device="cuda")[:s.top_k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, s.top_k, device="cuda"), -1).bfloat16()

        def run():
            return ops.moe_experts(x, ids, w, gate, up, down, s.expert_act, s.act_alpha,
                                   s.act_limit, torch.bfloat16)

        sec = _time(run, reps=20, warm=3)
        touched = per_expert * len(torch.unique(ids))
        flops = 3 * 2 * e * f * t * s.top_k
        print(f"  MoE kernels T={t:3d}: {sec * 1e6:8.1f} us  {touched / sec / 1e9:7.1f} GB/s of "
              f"touched experts  {flops / sec / 1e12:6.2f} TFLOP/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4, help="bench checkpoint layers")
    ap.add_argument("--skip", default="", help="comma list of kernels,parity,bench")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    a.out.mkdir(parents=True, exist_ok=True)
    worst = 0.0
    if "kernels" not in skip:
        import moe_gpu_kernels

        print("-- MoE kernels vs torch twins (err/tol <= 1)")
        k = moe_gpu_kernels.run(torch.device("cuda"))
        print(f"kernels worst err/tol {k:.3f} ({'ok' if k <= 1 else 'FAIL'})")
    if "parity" not in skip:
        worst = parity(a.out)
        print(f"parity worst {worst:.2e} ({'ok' if worst <= TOL else 'FAIL'})")
    if "bench" not in skip:
        bench(a.out, a.layers)


if __name__ == "__main__":
    main()
