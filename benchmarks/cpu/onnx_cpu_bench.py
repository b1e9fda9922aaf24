"""CPU prefill/decode of one ONNX int4 decoder export: mlxr (translated onto its decoder) vs
onnxruntime's CPU provider on the same file.

usage: python benchmarks/cpu/onnx_cpu_bench.py WORKDIR [--prompt 128] [--tokens 32] [--threads N]
                                           [--native MLX_DIR]

Builds (once, into WORKDIR) a Qwen3-0.6B-shaped checkpoint with random weights (28 layers,
hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936, tied) and its ONNX Runtime GenAI
builder export (`-p int4 -e cpu`: MatMulNBits block 32, accuracy_level=4), then times on the
same model.onnx: ORT (int8-activation MatMulNBits, as exported) and mlxr.load (bf16 and fp32).
Prefill = one forward of the prompt; decode = median per-token time of greedy steps with a
growing KV cache. Engines are loaded once and measured in alternating rounds (--rounds); on a
shared box the median round of each is reported (prefill: one prompt per round; decode: the
median step of each round, then the median over rounds). One JSON line per engine (with the load
average over the run: torch's parallel regions wait on a descheduled thread when the box is
oversubscribed, see docs/onnx.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build(work: Path) -> Path:
    out = work / "qwen3_0p6b_int4_cpu"
    if (out / "model.onnx").is_file():
        return out
    hf = work / "qwen3_0p6b_hf"
    if not (hf / "config.json").is_file():
        import torch
        import transformers as T

        torch.manual_seed(0)
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**SHAPE)).eval()
        model.save_pretrained(hf)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                    "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(work / "cache")],
                   check=True, env=env)
    return out


def ort_engine(folder: Path, prompt: list[int], n: int, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    t0 = time.perf_counter()
    sess = ort.InferenceSession(str(folder / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    load = time.perf_counter() - t0
    names = [o.name for o in sess.get_outputs()]
    kv = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]

    def run(ids, past, start):
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, start + len(ids)), np.int64), **past}
        out = dict(zip(names, sess.run(names, feeds)))
        return out, {k.replace("present.", "past_key_values."): v for k, v in out.items()
                     if k.startswith("present.")}

    empty = {i.name: np.zeros((1, SHAPE["num_key_value_heads"], 0, SHAPE["head_dim"]),
                              np.float32) for i in kv}
    run(prompt[:8], empty, 0)  # warm-up

    def measure() -> tuple[float, float]:
        t0 = time.perf_counter()
        out, past = run(prompt, empty, 0)
        prefill = time.perf_counter() - t0
        tok, steps = int(out["logits"][0, -1].argmax()), []
        for i in range(n):
            t0 = time.perf_counter()
            out, past = run([tok], past, len(prompt) + i)
            steps.append(time.perf_counter() - t0)
            tok = int(out["logits"][0, -1].argmax())
        return prefill, statistics.median(steps)

    return "onnxruntime-cpu", load, measure


def mlxr_engine(folder: Path, prompt: list[int], n: int, dtype: str, label: str = "mlxr"):
    import torch

    import mlxr
    from mlxr.engine.kv_cache import new_cache

    t0 = time.perf_counter()
    model = mlxr.load(folder, device="cpu", dtype=dtype)
    load = time.perf_counter() - t0
    dec = model.decoder
    with torch.inference_mode():
        dec.forward(torch.tensor(prompt[:8]), new_cache(dec, 16), last_only=True)  # warm-up

    def measure() -> tuple[float, float]:
        with torch.inference_mode():
            cache = new_cache(dec, len(prompt) + n + 1)
            t0 = time.perf_counter()
            logits = dec.forward(torch.tensor(prompt), cache, last_only=True)
            prefill = time.perf_counter() - t0
            tok, steps = int(logits[0].argmax()), []
            for _ in range(n):
                t0 = time.perf_counter()
                logits = dec.forward(torch.tensor([tok]), cache, last_only=True)
                steps.append(time.perf_counter() - t0)
                tok = int(logits[0].argmax())
        return prefill, statistics.median(steps)

    return f"{label}-{dtype}", load, measure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads of both engines (default: each its own choice)")
    ap.add_argument("--engines", default="ort,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--native", type=Path, help="an MLX checkpoint of the same shape (e.g. "
                    "benchmarks/make_checkpoint.py qwen3-0.6b DIR --group-size 32): mlxr on "
                    "its own format, measured in the same rounds")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    folder = build(a.work)
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 150000, a.prompt)]
    engines = [ort_engine(folder, prompt, a.tokens, a.threads) if e == "ort" else
               mlxr_engine(folder, prompt, a.tokens, e) for e in a.engines.split(",")]
    if a.native:
        engines.append(mlxr_engine(a.native, prompt, a.tokens, "bfloat16", "mlxr-native"))
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(a.rounds):
        for name, _, measure in engines:
            runs.setdefault(name, []).append(measure())
    for name, load, _ in engines:
        p = statistics.median(r[0] for r in runs[name])
        d = statistics.median(r[1] for r in runs[name])
        print(json.dumps(dict(engine=name, load_s=round(load, 2), prompt=a.prompt,
                              prefill_s=round(p, 3), prefill_tok_s=round(a.prompt / p, 1),
                              best_prefill_tok_s=round(a.prompt / min(r[0] for r in runs[name]),
                                                       1),
                              decode_ms=round(1e3 * d, 1), decode_tok_s=round(1 / d, 2),
                              rounds=a.rounds, threads=a.threads or "default",
                              loadavg=round(os.getloadavg()[0], 1))), flush=True)


if __name__ == "__main__":
    main()
