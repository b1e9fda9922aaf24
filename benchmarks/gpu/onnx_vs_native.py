"""mlxr on an ONNX int4 export vs mlxr on the MLX checkpoint of the same shape (and onnxruntime's
CPU provider on the same ONNX file): prefill and decode b=1.

usage: python benchmarks/gpu/onnx_vs_native.py WORK [--device cuda] [--shape 0.6b|8b|tiny]
           [-p 512] [-n 64] [--repeats 3] [--ort-threads 16] [--ort-tokens 16] [--no-ort]

For the shape (qwen3-0.6b or llama-3.1-8b of benchmarks/make_checkpoint.py; `tiny` is a
2-layer hidden-128 Qwen3 for a check run on a CPU box), builds once into WORK:
* the MLX 4-bit g64 checkpoint (make_checkpoint.py's random codes and scales);
* a random-weight Hugging Face checkpoint of the same shape (bf16) and its ONNX Runtime GenAI
  builder export `-p int4 -e cpu --extra_options block_size=64` (+ shared_embeddings=true
  when tied): MatMulNBits block 64 like the MLX groups, fp32 I/O, accuracy_level=4.
Then measures, `mlxr bench`-style (greedy stream of -p prompt tokens + -n decode tokens,
EOS ignored; one warm-up run, median of --repeats): mlxr on the ONNX folder and mlxr on the
MLX folder, both bf16 on --device; and onnxruntime's CPU provider (--ort-threads) on the same
model.onnx (prefill = one forward of the prompt; decode = median step of --ort-tokens greedy
steps, growing KV cache; median of --repeats). One JSON line per engine, then a summary line
with the ONNX/native ratios (the issue's target: within 10% of native).

Weights differ between the two formats (both random): the comparison is of kernels and
layout on the same shape, not of outputs.

On the lent H200 (onnx 1.23.1, onnxruntime 1.30.0, transformers 5.17, torch 2.11, Python
3.12; no onnxruntime-genai): the builder needs onnxruntime-genai, which needs onnxruntime >=
1.31, and onnx-ir 1.1 (the image has 1.0). Carry three wheels (38 MB together), downloaded in
the repository root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl \
        onnxruntime-genai==0.18.0 onnxruntime==1.32.0 onnx-ir==1.1.0

and run with `carry: [".whl"]`:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
    python3 benchmarks/gpu/onnx_vs_native.py /tmp/work --device cuda --shape 0.6b

(0.6b: the HF checkpoint, export and MLX checkpoint take ~2 min on 16 cores, the measurements
~1 min. --shape 8b adds a 16 GB bf16 checkpoint and a longer export: a second call.)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"0.6b": "qwen3-0.6b", "8b": "llama-3.1-8b", "tiny": "tiny"}
TINY = dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
            tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
            max_position_embeddings=2048)


def make_checkpoint_module():
    spec = importlib.util.spec_from_file_location("make_checkpoint",
                                                  ROOT / "benchmarks" / "make_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.SHAPES.setdefault("tiny", TINY)
    return mod


def native_checkpoint(mc, name: str, work: Path) -> Path:
    out = work / f"{name}_mlx_4bit_g64"
    if not (out / "config.json").is_file():
        mc.write(name, out, 4, 64, "affine")
    return out


def hf_checkpoint(cfg: dict, work: Path, name: str) -> Path:
    """Random bf16 weights of the shape, as transformers writes them (the builder's input)."""
    out = work / f"{name}_hf"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers as T

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    kw.update(bos_token_id=1, eos_token_id=2)
    config = (T.Qwen3Config if cfg["model_type"] == "qwen3" else T.LlamaConfig)(**kw)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = T.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(out)
    word_level_tokenizer(cfg["vocab_size"]).save_pretrained(out)
    return out


def word_level_tokenizer(vocab: int):
    """A tokenizer of the shape's vocabulary (word i is "t<i>"; 0-2 unk / bos / eos), which
    the builder loads and copies into the export: without one it tries to convert a slow
    tokenizer (Llama's needs sentencepiece) and fails. The benchmark feeds token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    words.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    del words["t0"], words["t1"], words["t2"]
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def onnx_export(hf: Path, work: Path, name: str, tied: bool) -> Path:
    out = work / f"{name}_onnx_int4_cpu_b64"
    if (out / "model.onnx").is_file():
        return out
    extra = ["block_size=64"] + (["shared_embeddings=true"] if tied else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                    "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(work / "cache"),
                    "--extra_options", *extra], check=True, env=env)
    return out


def mlxr_bench(path: Path, device: str, prompt: list[int], n: int, repeats: int) -> dict:
    """What `mlxr bench` measures: tok/s of prefill and decode from the stream's stats."""
    import mlxr

    t0 = time.perf_counter()
    model = mlxr.load(path, device=device, dtype="bfloat16")
    load = time.perf_counter() - t0

    def once():
        stats = None
        for chunk in model.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
            stats = chunk.stats
        return stats

    once()  # warm-up: kernels compiled, graphs captured, caches allocated
    runs = [once() for _ in range(repeats)]
    out = dict(load_s=round(load, 2),
               prefill_tok_s=round(statistics.median(r.prefill_tps for r in runs), 1),
               decode_tok_s=round(statistics.median(r.decode_tps for r in runs), 1),
               decode_tok_s_all=[round(r.decode_tps, 1) for r in runs])
    if path.joinpath("genai_config.json").is_file():  # the ONNX folder: all on mlxr's kernels?
        ins = mlxr.onnx.inspect(path)
        out["claim"] = ins.report.summary(len(ins.graph.nodes))
    return out  # the model goes with this frame: the caller frees its memory


def ort_bench(folder: Path, prompt: list[int], n: int, repeats: int, threads: int,
              head_dim: int) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    t0 = time.perf_counter()
    sess = ort.InferenceSession(str(folder / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    load = time.perf_counter() - t0
    names = [o.name for o in sess.get_outputs()]
    # the exports name the KV head size symbolically (kv_cache_dim): the shape's head dim
    empty = {i.name: np.zeros((1, i.shape[1], 0, head_dim), np.float32)
             for i in sess.get_inputs() if i.name.startswith("past_key_values.")}

    def run(ids, past, start):
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, start + len(ids)), np.int64), **past}
        out = dict(zip(names, sess.run(names, feeds)))
        return out, {k.replace("present.", "past_key_values."): v for k, v in out.items()
                     if k.startswith("present.")}

    def once():
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

    once()
    runs = [once() for _ in range(repeats)]
    p = statistics.median(r[0] for r in runs)
    d = statistics.median(r[1] for r in runs)
    return dict(load_s=round(load, 2), threads=threads, prefill_tok_s=round(len(prompt) / p, 1),
                decode_tok_s=round(1 / d, 1), decode_tokens=n, ort_version=ort.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ort-threads", type=int, default=16)
    ap.add_argument("--ort-tokens", type=int, default=16)
    ap.add_argument("--no-ort", action="store_true", help="skip onnxruntime's CPU provider")
    ap.add_argument("--build-only", action="store_true",
                    help="write the checkpoints and the export, measure nothing (CPU only: "
                    "overlaps another call's GPU work)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    mc = make_checkpoint_module()
    name = SHAPES[a.shape]
    cfg = mc.SHAPES[name]
    t0 = time.perf_counter()
    native = native_checkpoint(mc, name, a.work)
    onnx_dir = onnx_export(hf_checkpoint(cfg, a.work, name), a.work, name,
                           cfg["tie_word_embeddings"])
    print(json.dumps(dict(built_s=round(time.perf_counter() - t0, 1), native=str(native),
                          onnx=str(onnx_dir))), flush=True)
    if a.build_only:
        return
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, cfg["vocab_size"] - 1,
                                                                a.prompt)]
    rows = {}
    for engine, path in (("mlxr-onnx", onnx_dir), ("mlxr-native", native)):
        rows[engine] = dict(engine=engine, device=a.device, shape=name, prompt=a.prompt,
                            tokens=a.tokens, **mlxr_bench(path, a.device, prompt, a.tokens,
                                                          a.repeats))
        print(json.dumps(rows[engine]), flush=True)
        gc.collect()
        if a.device == "cuda":
            import torch

            torch.cuda.empty_cache()
    if not a.no_ort:
        rows["ort"] = dict(engine="onnxruntime-cpu", shape=name, prompt=a.prompt,
                           **ort_bench(onnx_dir, prompt, a.ort_tokens, a.repeats,
                                       a.ort_threads, cfg.get("head_dim") or
                                       cfg["hidden_size"] // cfg["num_attention_heads"]))
        print(json.dumps(rows["ort"]), flush=True)
    o, nt = rows["mlxr-onnx"], rows["mlxr-native"]
    summary = dict(summary=name, device=a.device,
                   onnx_over_native_prefill=round(o["prefill_tok_s"] / nt["prefill_tok_s"], 3),
                   onnx_over_native_decode=round(o["decode_tok_s"] / nt["decode_tok_s"], 3))
    if "ort" in rows:
        summary.update(
            onnx_over_ort_prefill=round(o["prefill_tok_s"] / rows["ort"]["prefill_tok_s"], 2),
            onnx_over_ort_decode=round(o["decode_tok_s"] / rows["ort"]["decode_tok_s"], 2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
