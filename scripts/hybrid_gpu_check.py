"""Hybrid families on CUDA against the CPU float32 path, then a short bench of the hybrid MoE
shapes. Needs torch and triton, not mlx.

    PYTHONPATH=. python scripts/hybrid_gpu_check.py DIR [--layers 4] [--no-bench]

0. Kernels (scripts/hybrid_gpu_kernels.py): the attention kernels at head widths 512 / 256
   (decode graph, paged decode and prefill, the batched padded decode) and the MoE kernels'
   GeGLU on quantized and dense bf16 experts, CUDA vs the torch twins, one line per check.
1. Parity, for every tiny config of tests/hybrid_configs.py (qwen3_5, qwen3_5_untied,
   qwen3_5_moe, qwen3_next, gemma4_text, gemma4, gemma4_moe) in q4g64, mxfp4 and bf16. A model
   already in DIR/<family>-<quant> is used as it is (e.g. made by mlx-lm elsewhere with
   tests/mlx_ref_hybrid.make_model); the others are written with make_checkpoint's random
   real-format tensors. Checked, MoE models with the experts split and stacked (MLXR_MOE):
   - CUDA float32 teacher-forced logits vs CPU float32: 1e-3 of each position's range (the
     CPU-vs-mlx-lm parity bound);
   - CUDA prefill of 20 tokens then 20 single-token steps vs CUDA's whole forward: 1e-4;
   - the serving engine on CUDA, 4 concurrent greedy requests (float32) == each alone;
   - a bf16 CUDA load gives finite logits.
2. Decode graphs (every family whose single-sequence decode step is captured; a MoE family
   whose blocks run the torch path is reported eager): in
   bf16, greedy tokens of `generate` with the graph on == off (a first difference allowed only
   at a near-tie of the eager logits: top-2 margin under 2x the tolerance) and the captured
   step's logits vs the eager step's within 5% of the range (test_parity_hybrid's bf16 bound
   for incremental paths: the same math, summed in another order); then decode tok/s of the
   qwen3.5-0.8b, qwen3.5-2b and gemma-4-e2b shapes (make_checkpoint, 4-bit g64, full depth,
   DIR/graph-<shape>) with the graph on and off, prompt 512, 128 tokens, median of 3.
3. Bench: qwen3.5-35b-a3b and qwen3-next-80b-a3b cut to --layers layers (written once to
   DIR/bench-<shape>-L<n> by make_checkpoint, 4-bit g64, routers 8-bit), bf16 on CUDA:
   prefill 512 and decode 128 tokens, median of 3 after a warm-up, in tok/s. The full-depth
   figure printed beside it scales the whole step time by layers (embedding and head
   counted as if per layer): a lower-bound estimate, not a measurement.

Exit status 1 if any parity check fails.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("MLXR_HYBRID_GRAPHS", "1")  # the hybrid decode graph is under test
os.environ.setdefault("MLXR_MOE_GRAPHS", "1")
sys.path.insert(0, str(ROOT / "scripts"))
import hybrid_gpu_kernels  # noqa: E402
import mlxr  # noqa: E402
from decode_checks import run_ids  # noqa: E402
from hybrid_configs import FAMILIES  # noqa: E402
from mlxr import generate  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.engine.cuda_graph import GraphDecoder, graphable  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

QUANTS = {"q4g64": (4, 64, "affine"), "mxfp4": (4, 32, "mxfp4"), "bf16": None}
VOCAB = 320  # hybrid_configs' vocab_size
F32_TOL, STEP_TOL, BF16_STEP_TOL = 1e-3, 1e-4, 0.05
BENCH_SHAPES = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")
GRAPH_FAMILIES = ("qwen3_5", "qwen3_5_untied", "gemma4_text", "gemma4", "qwen3_5_moe",
                  "qwen3_next", "gemma4_moe")
GRAPH_SHAPES = ("qwen3.5-0.8b", "qwen3.5-2b", "gemma-4-e2b")


def _make_checkpoint():
    spec = importlib.util.spec_from_file_location("make_checkpoint",
                                                  ROOT / "benchmarks" / "make_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(a - ref).max(-1) / (ref.max(-1) - ref.min(-1))).max())


def _steps(model, seq: list[int]) -> np.ndarray:
    """Prefill seq[:20], then one token per step: the logits of positions 19.. [N, V]."""
    dec = model.decoder
    cache = new_cache(dec, 8)
    with torch.inference_mode():
        out = [dec.forward(torch.tensor(seq[:20]), cache, last_only=True)[0]]
        out += [dec.forward(torch.tensor([t]), cache)[0] for t in seq[20:]]
    return torch.stack(out).cpu().numpy()


def _engine_equals_single(model, n: int = 8) -> bool:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in (5, 23, 11, 17)]
    engine = LLMEngine(model, max_num_seqs=4, block_size=16)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    got = run_ids(engine, [EngineRequest(p, params) for p in prompts])
    want = [list(model.generate(p, max_tokens=n, ignore_eos=True)) for p in prompts]
    return got == want


def check(path: Path) -> tuple[float, float, bool, bool]:
    rng = random.Random(0)
    seq = [rng.randrange(VOCAB) for _ in range(40)]
    cpu = mlxr.load(path, device="cpu", dtype="float32").logits(seq).numpy()
    gpu_model = mlxr.load(path, device="cuda", dtype="float32")
    gpu = gpu_model.logits(seq).cpu().numpy()
    step = _rel(_steps(gpu_model, seq), gpu[19:])
    engine_ok = _engine_equals_single(gpu_model)
    bf16 = mlxr.load(path, device="cuda").logits(seq)
    return _rel(gpu, cpu), step, engine_ok, bool(torch.isfinite(bf16).all())


def parity(out: Path, mc) -> bool:
    ok = True
    for family, quant in [(f, q) for f in sorted(FAMILIES) for q in QUANTS]:
        path = out / f"{family}-{quant}"
        if not (path / "config.json").is_file():
            mc.write_hybrid(copy.deepcopy(FAMILIES[family]), path, QUANTS[quant])
        moe = "moe" in family or family == "qwen3_next"
        for mode in ("split", "stacked") if moe else ("-",):
            os.environ["MLXR_MOE"] = mode if moe else "stacked"
            err, step, engine_ok, finite = check(path)
            good = err <= F32_TOL and step <= STEP_TOL and engine_ok and finite
            ok &= good
            print(f"{family:15s} {quant:6s} experts {mode:8s} cuda-vs-cpu f32 {err:.2e}  "
                  f"steps-vs-whole {step:.2e}  engine==single {engine_ok}  bf16 finite "
                  f"{finite}  {'ok' if good else 'FAIL'}", flush=True)
    os.environ.pop("MLXR_MOE", None)
    return ok


def _graph_mode(model, on: bool) -> None:
    """Decode graphs on / off for `model` (the flag `cuda_graph.graphable` reads; graphs
    captured so far dropped)."""
    generate._graphs.pop(model.decoder, None)
    model.decoder.graphable = on


def _graph_vs_eager(model, seq: list[int], n0: int = 20) -> tuple[bool, float]:
    """(greedy tokens of `generate` graph-on == graph-off, up to a near-tie; the captured
    step's worst logits error vs the eager step over seq[n0:], of each position's range)."""
    dec = model.decoder
    n = len(seq) - n0
    _graph_mode(model, True)
    on = list(model.generate(seq[:n0], max_tokens=n, ignore_eos=True))
    _graph_mode(model, False)
    off = list(model.generate(seq[:n0], max_tokens=n, ignore_eos=True))
    _graph_mode(model, True)
    graph_cache, eager = new_cache(dec, 64), new_cache(dec, 64)
    graph = GraphDecoder(dec, graph_cache)
    graph_cache.length = 0  # the capture ran steps at position 0: a fresh sequence
    errs, ties = [], []
    with torch.inference_mode():
        dec.forward(torch.tensor(seq[:n0]), graph_cache, last_only=True)
        dec.forward(torch.tensor(seq[:n0]), eager, last_only=True)
        for p in range(n0, len(seq)):
            got = graph.logits_for(seq[p], p).float().cpu().numpy()[None]
            want = dec.forward(torch.tensor([seq[p]]), eager)[0].float().cpu().numpy()[None]
            errs.append(_rel(got, want))
        # near-ties along the graph-off path: eager logits of its own tokens
        tied = new_cache(dec, 64)
        logits = dec.forward(torch.tensor(seq[:n0]), tied, last_only=True)[0]
        for t in off:
            top = logits.float().topk(2).values
            ties.append(float(top[0] - top[1]) < 2 * BF16_STEP_TOL * float(logits.max()
                                                                            - logits.min()))
            logits = dec.forward(torch.tensor([t]), tied)[0]
    first = next((i for i, (a, b) in enumerate(zip(on, off)) if a != b), None)
    same = (on == off) or (first is not None and ties[first])
    return same, max(errs)


def graph_checks(out: Path, mc) -> bool:
    ok = True
    rng = random.Random(1)
    seq = [rng.randrange(VOCAB) for _ in range(44)]
    for family, quant in [(f, q) for f in GRAPH_FAMILIES for q in ("q4g64", "bf16")]:
        path = out / f"{family}-{quant}"
        if not (path / "config.json").is_file():
            mc.write_hybrid(copy.deepcopy(FAMILIES[family]), path, QUANTS[quant])
        model = mlxr.load(path, device="cuda")
        if not graphable(model.decoder):  # a MoE block on the torch path: eager, not a failure
            moe = any(ly.moe is not None for ly in model.decoder.layers)
            print(f"{family:15s} {quant:6s} decode graph: not graphable  "
                  f"{'(MoE torch path) ok' if moe else 'FAIL'}", flush=True)
            ok &= moe
            continue
        same, err = _graph_vs_eager(model, seq)
        good = same and err <= BF16_STEP_TOL
        ok &= good
        print(f"{family:15s} {quant:6s} bf16 decode graph vs eager: greedy same {same}  "
              f"step logits {err:.2e}  {'ok' if good else 'FAIL'}", flush=True)
    return ok


def graph_bench(out: Path, mc, prompt_len: int = 512, new: int = 128) -> None:
    for shape in GRAPH_SHAPES:
        path = out / f"graph-{shape}"
        if not (path / "config.json").is_file():
            print(f"writing {path} ...", flush=True)
            mc.write(shape, path, 4, 64, "affine")
        model = mlxr.load(path, device="cuda")
        rng = random.Random(0)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]
        line = []
        for on in (True, False):
            _graph_mode(model, on)
            runs, toks = [], None
            for k in range(4):
                ids, stats = [], None
                for chunk in model.stream(prompt, max_tokens=new, temperature=0,
                                          ignore_eos=True):
                    ids += chunk.token_ids
                    stats = chunk.stats
                toks = toks or ids
                if k:
                    runs.append(stats.decode_tps)
            line.append((statistics.median(runs), toks))
        same = line[0][1] == line[1][1]
        print(f"{shape} (bf16, 4-bit g64): decode {new} graph on {line[0][0]:8.1f} tok/s, "
              f"off {line[1][0]:8.1f} tok/s; greedy tokens on == off: {same}", flush=True)
        del model
        torch.cuda.empty_cache()


def bench(out: Path, mc, layers: int, prompt_len: int = 512, new: int = 128) -> None:
    for shape in BENCH_SHAPES:
        path = out / f"bench-{shape}-L{layers}"
        if not (path / "config.json").is_file():
            print(f"writing {path} ...", flush=True)
            mc.write_hybrid(dict(mc.HYBRID_MOE[shape]), path, (4, 64, "affine"), layers)
        model = mlxr.load(path, device="cuda")
        rng = random.Random(0)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]

        def once(m):
            stats = None
            for chunk in m.stream(prompt, max_tokens=new, temperature=0, ignore_eos=True):
                stats = chunk.stats
            return stats

        once(model)
        runs = [once(model) for _ in range(3)]
        pre = statistics.median(r.prefill_tps for r in runs)
        dec = statistics.median(r.decode_tps for r in runs)
        full = mc.hybrid_tables.text_config(mc.HYBRID_MOE[shape])["num_hidden_layers"]
        print(f"{shape} ({layers} of {full} layers, bf16, 4-bit g64): prefill {prompt_len} "
              f"{pre:10.1f} tok/s, decode {new} {dec:8.1f} tok/s; full depth, step time scaled "
              f"by layers (lower-bound estimate): prefill >~{pre * layers / full:.0f}, decode "
              f">~{dec * layers / full:.0f} tok/s", flush=True)
        del model
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=4, help="bench shapes: layers kept")
    ap.add_argument("--no-bench", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    a.dir.mkdir(parents=True, exist_ok=True)
    mc = _make_checkpoint()
    kernels_ok = hybrid_gpu_kernels.main()  # the kernel paths against their twins, per line
    print(f"kernels {'ok' if kernels_ok else 'FAIL'}", flush=True)
    ok = parity(a.dir, mc) & kernels_ok
    print(f"parity {'ok' if ok else 'FAIL'}", flush=True)
    graphs_ok = graph_checks(a.dir, mc)
    print(f"decode graphs {'ok' if graphs_ok else 'FAIL'}", flush=True)
    ok &= graphs_ok
    if not a.no_bench:
        graph_bench(a.dir, mc)
        bench(a.dir, mc, a.layers)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
