"""A seeded mutation fuzzer for mlxr's ONNX path (issue 30): hostile decoder graphs, external
data, genai_config.json and tokenizer files, each case run in a worker subprocess under the
memory limit and per-case timeout of tests/fuzz_hostile.py (whose worker and outcome
classification it reuses: ok, error = an mlxr error, crash, hang, oom).

Seeds are tiny random-weight exports built at run time (tests/onnx_build.py: builder int4 CPU
llama, fp16 qwen3, tied/shared embeddings (GatherBlockQuantized), asymmetric zero points, a
QMoE gpt-oss; tests/mobius_build.py: a Mobius GGUF Q4_0 llama). Each case copies one seed and
applies 1-3 mutations (node attributes, initializer dims / dtypes / raw bytes, external-data
entries, the data file, op types / domains / opset imports, rewired or dropped node inputs and
outputs, graph I/O shapes and dtypes, genai_config.json, tokenizer files). The worker loads the
folder with `mlxr.load`, generates 3 greedy tokens, then runs one step of
`mlxr.onnx.InferenceSession`.

    python tests/fuzz_onnx.py N SEED [KIND ...]   # N cases per seed kind; one JSON line out
(tests/test_fuzz_onnx.py runs a small count in CI; MLXR_FUZZ_ONNX / MLXR_FUZZ_SEED make a
longer run.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fuzz_hostile
from fuzz_hostile import CASE_TIMEOUT, _edit_json, _hostile, _mutate_tree

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MS = "com.microsoft"

# seed kind -> (build script, export name); the cheap exports, one per graph family
SEEDS = {
    "llama_int4_cpu": ("onnx_build.py", "llama_int4_cpu"),
    "qwen3_fp16": ("onnx_build.py", "qwen3_fp16"),
    "llama_tied_shared": ("onnx_build.py", "llama_tied_shared"),
    "llama_int4_zp128": ("onnx_build.py", "llama_int4_zp128"),
    "gptoss_int4_cpu": ("onnx_build.py", "gptoss_int4_cpu"),
    "mobius_llama_q4_0": ("mobius_build.py", "mobius_llama_q4_0"),
}
# attribute names worth mutating, with values of their own type and others
INT_ATTRS = ["bits", "block_size", "K", "N", "accuracy_level", "num_heads", "kv_num_heads",
             "local_window_size", "do_rotary", "rotary_interleaved", "causal", "k",
             "expert_weight_bits", "swiglu_fusion", "normalize_routing_weights",
             "sliding_window_cache", "smooth_softmax", "qk_output", "interleaved",
             "rotary_embedding_dim", "gather_axis", "quantize_axis", "weights_prepacked",
             "weight_prepacked", "axis", "stash_type", "use_sparse_mixer", "kv_cache_bit_width",
             "fc1_expert_weight_bits", "is_packed_batching", "to", "keepdims",
             "noop_with_empty_axes"]
FLOAT_ATTRS = ["scale", "softcap", "epsilon", "activation_alpha", "activation_beta",
               "swiglu_limit", "q_norm_epsilon", "k_norm_epsilon"]
STR_ATTRS = ["activation_type", "quant_type", "k_quant_type", "v_quant_type"]
INTS = [0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 48, 64, 127, 128, 256, 1 << 20, 1 << 31,
        2**62, -1, -2, -(2**63)]
FLOATS = [0.0, -1.0, 1.0, 0.5, 1e-30, 1e30, float("nan"), float("inf"), -float("inf"), 7.0]
STRS = [b"", b"NONE", b"FP2", b"swiglu", b"relu", b"silu", b"int", b"fp4", b"PER_TENSOR",
        b"\xff\xfe", b"x" * 300]
OPS = ["MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization", "QMoE",
       "RotaryEmbedding", "GatherBlockQuantized", "SimplifiedLayerNormalization", "MatMul",
       "Gather", "Add", "Identity", "Frobnicate", "Reshape", "Cast", "Softmax"]
DOMAINS = ["", "ai.onnx", MS, "com.example", "com.microsoft.nchwc"]
ELEMS = [1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17, 21, 22, 23, 0, 99]


def _attr(n, rng: random.Random) -> None:
    import onnx

    present = [a.name for a in n.attribute]
    name = rng.choice(present) if present and rng.random() < 0.7 else rng.choice(
        INT_ATTRS + FLOAT_ATTRS + STR_ATTRS)
    r = rng.random()
    if r < 0.1:
        for a in list(n.attribute):
            if a.name == name:
                n.attribute.remove(a)
        return
    if name in FLOAT_ATTRS:
        value = rng.choice(FLOATS)
    elif name in STR_ATTRS:
        value = rng.choice(STRS)
    else:
        value = rng.choice(INTS)
    if r > 0.85:  # a value of the wrong attribute type
        value = rng.choice([rng.choice(FLOATS), rng.choice(STRS), [1, 2], rng.choice(INTS)])
    for a in list(n.attribute):
        if a.name == name:
            n.attribute.remove(a)
    n.attribute.append(onnx.helper.make_attribute(name, value))


def _nodes(m, rng: random.Random, contrib: bool = False):
    nodes = [n for n in m.graph.node if not contrib or n.domain == MS]
    return rng.choice(nodes or list(m.graph.node))


def _values(m) -> list[str]:
    g = m.graph
    return ([v.name for v in g.input] + [t.name for t in g.initializer]
            + [o for n in g.node for o in n.output if o])


def _g_attr(m, rng):
    _attr(_nodes(m, rng, contrib=rng.random() < 0.8), rng)
    return "attribute"


def _g_init(m, rng):
    t = rng.choice(list(m.graph.initializer))
    r = rng.random()
    if r < 0.35:
        dims = list(t.dims)
        if dims and rng.random() < 0.7:
            dims[rng.randrange(len(dims))] = rng.choice(INTS[:20] + [1 << 40, 1 << 45, -4])
        elif dims and rng.random() < 0.5:
            dims.pop(rng.randrange(len(dims)))
        else:
            dims.insert(rng.randrange(len(dims) + 1), rng.choice([1, 2, 3, 1 << 30]))
        del t.dims[:]
        t.dims.extend(dims)
    elif r < 0.6:
        t.data_type = rng.choice(ELEMS)
    elif r < 0.8 and t.data_location == 1:  # external data entries
        keys = {e.key: e for e in t.external_data}
        key = rng.choice(["location", "offset", "length", "checksum", "basepath", "junk"])
        value = rng.choice({"location": ["model.onnx", "", ".", "x/../model.onnx.data",
                                         "genai_config.json", "model.onnx.data\0", "a" * 300],
                            "offset": ["0", "-1", "1", "17", str(1 << 62), "1e3", " 0", ""],
                            "length": ["0", "1", "-5", str(1 << 62), "x"]}.get(key, ["1"]))
        if key in keys and rng.random() < 0.3:
            t.external_data.remove(keys[key])
        elif key in keys:
            keys[key].value = value
        else:
            e = t.external_data.add()
            e.key, e.value = key, value
    else:  # data moved into the proto, with a hostile length
        n = rng.choice([0, 1, 3, 64, 4096])
        del t.external_data[:]
        t.data_location = 0
        t.raw_data = bytes(rng.randrange(256) for _ in range(n))
    return "initializer"


def _g_op(m, rng):
    r = rng.random()
    if r < 0.25:
        o = rng.choice(list(m.opset_import))
        o.version = rng.choice([0, 1, 2, 7, 13, 17, 21, 22, 23, 99, -1])
    elif r < 0.35:
        o = m.opset_import.add()
        o.domain, o.version = rng.choice(DOMAINS[2:]), rng.choice([1, 2])
    elif r < 0.65:
        _nodes(m, rng).op_type = rng.choice(OPS)
    else:
        _nodes(m, rng).domain = rng.choice(DOMAINS)
    return "op"


def _g_wire(m, rng):
    g = m.graph
    n = _nodes(m, rng)
    r = rng.random()
    if r < 0.15:
        g.node.remove(n)
    elif r < 0.45 and n.input:
        n.input[rng.randrange(len(n.input))] = rng.choice(_values(m) + ["", "nowhere"])
    elif r < 0.6 and n.input:
        del n.input[rng.randrange(len(n.input)):]
    elif r < 0.7:
        n.input.append(rng.choice(_values(m)))
    elif r < 0.85 and n.output:
        n.output[rng.randrange(len(n.output))] = rng.choice(_values(m) + ["", "fresh"])
    else:  # a node moved: topological order broken
        g.node.remove(n)
        g.node.insert(rng.randrange(len(g.node) + 1), n)
    return "wiring"


def _g_io(m, rng):
    g = m.graph
    vals = list(g.input) + list(g.output)
    v = rng.choice(vals)
    tt = v.type.tensor_type
    r = rng.random()
    if r < 0.3:
        tt.elem_type = rng.choice(ELEMS)
    elif r < 0.7 and tt.shape.dim:
        d = tt.shape.dim[rng.randrange(len(tt.shape.dim))]
        if rng.random() < 0.5:
            d.dim_value = rng.choice([0, 1, 2, 3, 5, 64, 1 << 20, 1 << 40, 1 << 50])
        else:
            d.dim_param = rng.choice(["batch_size", "x", "", "sequence_length"])
    elif r < 0.85:
        tt.shape.dim.add().dim_value = rng.choice([1, 2])
    else:
        (g.input if v in g.input else g.output).remove(v)
    return "graph io"


GRAPH_MUTATIONS = [_g_attr, _g_attr, _g_init, _g_op, _g_wire, _g_io]


def _graph(d: Path, rng: random.Random) -> str:
    import onnx

    path = d / "model.onnx"
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 -- an earlier mutation broke it
        return "graph (unreadable)"
    kind = rng.choice(GRAPH_MUTATIONS)(m, rng)
    onnx.save(m, str(path))
    return kind


def _data_file(d: Path, rng: random.Random) -> str:
    path = d / "model.onnx.data"
    if not path.is_file():
        return "data file (none)"
    data = bytearray(path.read_bytes())
    r = rng.random()
    if r < 0.4:
        data = data[:rng.randrange(len(data))]
    elif r < 0.6:
        data += bytes(rng.randrange(1, 1 << 16))
    else:
        for _ in range(rng.randint(1, 64)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return "data file"


def _genai_config(d: Path, rng: random.Random) -> str:
    def fn(doc):
        if rng.random() < 0.5 and isinstance(doc.get("model"), dict):
            m = doc["model"]
            dec = m.get("decoder") if isinstance(m.get("decoder"), dict) else m
            key = rng.choice(["context_length", "vocab_size", "eos_token_id", "bos_token_id",
                              "type", "head_size", "hidden_size", "num_attention_heads",
                              "num_key_value_heads", "num_hidden_layers", "filename",
                              "inputs", "outputs"])
            target = m if key in ("context_length", "vocab_size", "eos_token_id",
                                  "bos_token_id", "type") else dec
            target[key] = _hostile(rng) if rng.random() < 0.7 else rng.choice(
                [1 << 24, 1 << 40, 3, [2, 1 << 40], "model.onnx.data", {"logits": "x"},
                 {"past_key_names": "p.%d.%d"}])
            return doc
        return _mutate_tree(doc, rng, rng.randint(1, 3))
    if not (d / "genai_config.json").is_file():
        return "genai_config.json (none)"
    _edit_json(d / "genai_config.json", rng, fn)
    return "genai_config.json"


def _tokenizer(d: Path, rng: random.Random) -> str:
    if not (d / "tokenizer.json").is_file():
        return "tokenizer (none)"
    fn = rng.choice([fuzz_hostile._tokenizer_json, fuzz_hostile._tokenizer_config])
    return fn(d, rng)


def _mutate(fn, d: Path, rng: random.Random) -> str:
    try:
        return fn(d, rng)
    except ValueError as e:  # fuzz_hostile's _mutate_tree can nest a JSON doc in itself
        if "Circular reference" not in str(e):
            raise
        return f"{fn.__name__} (skipped: a JSON cycle)"


# graph mutations dominate: they are what the ONNX path adds
MUTATIONS = [_graph] * 6 + [_data_file, _genai_config, _tokenizer]


def _feed(info, c) -> "object":
    """A one-step feed for a session input: 3 new tokens, an empty past (ints from the graph's
    dims, symbolic ones from the model config; absurd declared dims clipped, so the feed is
    small and the session must say it does not fit)."""
    import numpy as np

    dt = {"tensor(float32)": np.float32, "tensor(float16)": np.float16,
          "tensor(int32)": np.int32, "tensor(int64)": np.int64}.get(info.type, np.float32)
    if info.name.startswith("past_key_values") and len(info.shape) == 4:
        # window-sized buffers (gpt-oss's sliding layers) hold the seeds' window of 8
        fill = [1, c.num_kv_heads, 0, c.head_dim]
        shape = [d if isinstance(d, int) else 8 if "sliding" in d else f
                 for d, f in zip(info.shape, fill)]
        return np.zeros([min(d, 64) for d in shape], dt)
    shape = [d if isinstance(d, int) else (1 if i == 0 else 3) for i, d in enumerate(info.shape)]
    return np.ones([min(d, 64) for d in shape], dt)


def _case(d: Path) -> dict:
    import mlxr
    from mlxr.onnx import InferenceSession

    m = mlxr.load(d, device="cpu", dtype="float32")
    list(m.generate([1, 2, 3], max_tokens=3))
    if (d / "tokenizer.json").is_file():
        m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    s = InferenceSession(d)
    s.run(None, {i.name: _feed(i, m.config) for i in s.get_inputs()})
    return {"outcome": "ok", "claimed": s.claimed}


def _worker() -> None:
    """Worker: one folder per stdin line -> one JSON outcome per stdout line."""
    import logging

    from mlxr.errors import MlxrError

    logging.disable(logging.WARNING)
    for line in sys.stdin:
        d = Path(line.strip())
        try:
            out = _case(d)
        except MlxrError as e:
            msg = str(e)
            out = {"outcome": "error", "error": type(e).__name__, "message": msg[:300]}
            if "\n" in msg.strip():
                out["multiline"] = True
        except MemoryError:
            out = {"outcome": "oom"}
        except RecursionError as e:
            out = {"outcome": "crash", "error": f"RecursionError: {str(e)[:200]}"}
        except Exception as e:  # noqa: BLE001 -- what the fuzzer looks for
            import traceback

            tb = traceback.extract_tb(e.__traceback__)[-1]
            out = {"outcome": "crash", "error": f"{type(e).__name__}: {str(e)[:200]}",
                   "at": f"{Path(tb.filename).name}:{tb.lineno}"}
        print(json.dumps(out), flush=True)


class _Worker(fuzz_hostile._Worker):
    """fuzz_hostile's worker process (memory limit, timeout, restart), running this file."""

    def start(self):
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=fuzz_hostile._limit_memory)


def build_seeds(work: Path, kinds: list[str]) -> dict[str, Path]:
    """The seed exports (one subprocess per build script)."""
    out = {}
    for script in sorted({SEEDS[k][0] for k in kinds}):
        names = [SEEDS[k][1] for k in kinds if SEEDS[k][0] == script]
        root = work / script.split(".")[0]
        r = subprocess.run([sys.executable, str(HERE / script), str(root), *names],
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise RuntimeError(f"{script} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        for k in kinds:
            if SEEDS[k][0] == script:
                out[k] = root / SEEDS[k][1]
    return out


def fuzz_onnx(n: int, seed: int, kinds: list[str] | None = None) -> dict:
    """n cases per seed kind; a summary with outcomes by kind and every finding."""
    kinds = kinds or list(SEEDS)
    keep = os.environ.get("MLXR_FUZZ_KEEP")  # a folder to copy each finding's case into
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="mlxr-fuzz-onnx-"))
    worker = _Worker("onnx")
    tally: dict[str, dict[str, int]] = {}
    findings = []
    start = time.monotonic()
    try:
        seeds = build_seeds(work, kinds)
        for kind in kinds:
            base = seeds[kind]
            warm = worker.ask(str(base), 180)  # imports, first load; the seed itself must run
            if warm["outcome"] != "ok":
                findings.append({"seed": kind, "unmutated": True, **warm})
            counts = tally.setdefault(kind, {})
            for i in range(n):
                d = work / f"case-{kind}-{i}"
                shutil.copytree(base, d)
                done = [_mutate(rng.choice(MUTATIONS), d, rng)
                        for _ in range(rng.randint(1, 3))]
                out = worker.ask(str(d), CASE_TIMEOUT)
                counts[out["outcome"]] = counts.get(out["outcome"], 0) + 1
                if out["outcome"] not in ("ok", "error") or out.get("multiline"):
                    findings.append({"seed": kind, "case": i, "mutations": done, **out})
                    if keep:  # the folder, for a regression test
                        shutil.copytree(d, Path(keep) / f"{kind}-{i}", dirs_exist_ok=True)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        worker.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"kind": "onnx", "per_seed": n, "seed": seed, "outcomes": tally,
            "findings": findings, "seconds": round(time.monotonic() - start, 1)}


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        _worker()
    else:
        sys.path[:0] = [str(ROOT), str(HERE)]
        print(json.dumps(fuzz_onnx(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] or None)))
