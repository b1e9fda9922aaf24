"""mlxr's own fuzzer (issue 34): seeded mutations of a tiny real model folder and of HTTP
requests, each run in a subprocess under a memory limit and a timeout.

Folders: the tiny 4-bit qwen3 of hostile_models (built at test time by mlx-lm; or with --family,
a tiny MoE or hybrid folder of fuzz_families, with mutations aimed at its keys) is copied and
mutated 1-3 times (safetensors header bytes, config values, rope_scaling, quantization, the
index, tokenizer.json, tokenizer_config.json, generation_config.json, the chat template), then
a worker process loads it, generates 3 tokens, computes the logits of 3 and renders +
tokenizes a chat. Outcomes: ok, error (an mlxr error: the promise), nan (loaded, but the logits
are not finite), crash (any other exception), hang (past the per-case timeout) or oom (past
the address-space limit).

Requests (tests/fuzz_requests.py): the bundled model served in-process gets mutated bodies on
every generation route beside a valid canary request; a 5xx, a hang or a failed canary is a
finding.

    python tests/fuzz_hostile.py folders N SEED    # one JSON summary line on stdout
    python tests/fuzz_hostile.py folders N SEED --family F[,F...]    # N each; F: qwen3 or one of
        fuzz_families.FAMILIES, or all (MLXR_FUZZ_LOG=file: every outcome, MLXR_FUZZ_KEEP=dir:
        the folders of the findings)
    python tests/fuzz_hostile.py sweep 0 0 --family F[,F...]    # tests/fuzz_sweep.py
    python tests/fuzz_hostile.py requests N SEED
(tests/test_fuzz_hostile.py runs both within the CI budget; MLXR_FUZZ_FOLDERS /
MLXR_FUZZ_REQUESTS / MLXR_FUZZ_SEED make a longer run.)
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MEMORY_LIMIT = 6 << 30  # address space of a worker process
CASE_TIMEOUT = 30.0  # seconds per folder, per request batch

DEEP = "__DEEP__"  # written as 3,000 nested brackets
HOSTILE_VALUES = [0, -1, 1, 2, 1e308, -1e308, 1e-300, 0.5, None, "", "x", "🙂\u0000", [], {},
                  True, False, 2**31, 2**32 - 1, 2**63, 10**400, [1.0] * 3, {"a": 1},
                  {"__float__": "x"}, {"__float__": "NaN"}, DEEP, "\ud800", "NaN"]
ROPE_TYPES = ["linear", "dynamic", "llama3", "yarn", "longrope", "su", "default", "weird", 7]
ROPE_FIELDS = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
               "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "long_factor",
               "short_factor", "long_mscale", "rope_type", "type"]


def _dumps(doc) -> str:
    text = json.dumps(doc, ensure_ascii=True)
    return text.replace(json.dumps(DEEP), "[" * 3000 + "]" * 3000)


def _hostile(rng: random.Random):
    # a copy: a later step may pick this value as a parent and mutate it (into itself)
    return copy.deepcopy(rng.choice(HOSTILE_VALUES))


def _mutate_tree(doc, rng: random.Random, steps: int = 1):
    """Replace, delete or wrap a random node of a JSON tree (in place where possible)."""
    for _ in range(steps):
        parents = []
        stack = [doc]
        while stack and len(parents) < 5000:
            node = stack.pop()
            if isinstance(node, dict) and node:
                parents.append(node)
                stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list) and node:
                parents.append(node)
                stack.extend(v for v in node[:50] if isinstance(v, (dict, list)))
        if not parents:
            return _hostile(rng)
        node = rng.choice(parents)
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        r = rng.random()
        if r < 0.7:
            node[key] = _hostile(rng)
        elif r < 0.85 and isinstance(node, dict):
            del node[key]
        else:
            node[key] = [node[key]] if rng.random() < 0.5 else {"v": node[key]}
    return doc


def _edit_json(path: Path, rng: random.Random, fn=None) -> None:
    try:  # (an earlier mutation may have left it unreadable)
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    try:
        doc = fn(doc) if fn is not None else _mutate_tree(doc, rng, rng.randint(1, 3))
    except (KeyError, TypeError, AttributeError):
        doc = _mutate_tree({"x": doc}, rng)
    path.write_text(_dumps(doc))


def _config(d: Path, rng: random.Random) -> str:
    _edit_json(d / "config.json", rng)
    return "config"


def _rope(d: Path, rng: random.Random) -> str:
    def fn(cfg):
        s = {"rope_type": rng.choice(ROPE_TYPES), "factor": rng.choice([2.0, 8.0, 0.5])}
        for key in rng.sample(ROPE_FIELDS, rng.randint(1, 4)):
            s[key] = _hostile(rng) if rng.random() < 0.7 else rng.choice([1.0, 4.0, 32, 4096,
                                                                           [1.0] * 4])
        cfg["rope_scaling"] = s
        return cfg
    _edit_json(d / "config.json", rng, fn)
    return "rope_scaling"


def _quant(d: Path, rng: random.Random) -> str:
    def fn(cfg):
        q = cfg.setdefault("quantization", {})
        key = rng.choice(["mode", "bits", "group_size", "global_scale",
                          "model.layers.0.mlp.down_proj", "model.embed_tokens"])
        q[key] = _hostile(rng) if rng.random() < 0.8 else rng.choice(
            ["mxfp4", "nvfp4", "mxfp8", {"bits": 8, "group_size": 32}, False])
        return cfg
    _edit_json(d / "config.json", rng, fn)
    return "quantization"


def _header(d: Path, rng: random.Random) -> str:
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    n = min(len(data), 8 + int.from_bytes(data[:8], "little"))
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(n)] = rng.randrange(256)
    if rng.random() < 0.2:
        data = data[:rng.randrange(len(data))]
    path.write_bytes(bytes(data))
    return "header"


def _index(d: Path, rng: random.Random) -> str:
    from safetensors import safe_open

    try:  # (an earlier mutation may have broken the header)
        with safe_open(str(d / "model.safetensors"), "np") as f:
            names = list(f.keys())
    except Exception:  # noqa: BLE001
        names = ["model.norm.weight", "model.embed_tokens.weight"]
    doc = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    name = rng.choice(names)
    doc["weight_map"][name] = rng.choice(["x" * 5000, "../config.json", "/etc/passwd", "",
                                          "model-2.safetensors", "model.safetensors\0", 7,
                                          "config.json"])
    if rng.random() < 0.3:
        doc = _mutate_tree(doc, rng)
    (d / "model.safetensors.index.json").write_text(_dumps(doc))
    return "index"


def _tokenizer_json(d: Path, rng: random.Random) -> str:
    def fn(doc):
        r = rng.random()
        if r < 0.3:
            node = {"type": rng.choice(["Replace", "Split"]),
                    "pattern": {rng.choice(["String", "Regex"]): rng.choice(["", "a", "("])},
                    "content": "x", "behavior": "Isolated", "invert": False}
            doc[rng.choice(["normalizer", "pre_tokenizer", "decoder"])] = node
        elif r < 0.5:
            doc["added_tokens"].append({"id": rng.choice([320, 2**32 - 1, -1, 5, "7"]),
                                        "content": rng.choice(["<x>", 7, "", None]),
                                        "special": True})
        elif r < 0.6:
            doc["model"]["vocab"][rng.choice(["zz", "a"])] = _hostile(rng)
        else:
            _mutate_tree(doc, rng, rng.randint(1, 3))
        return doc
    _edit_json(d / "tokenizer.json", rng, fn)
    return "tokenizer.json"


def _tokenizer_config(d: Path, rng: random.Random) -> str:
    from test_template_limits import HOSTILE

    def fn(doc):
        r = rng.random()
        if r < 0.4:
            doc["chat_template"] = rng.choice(list(HOSTILE.values()))[0]
        elif r < 0.6:
            doc["added_tokens_decoder"] = {rng.choice(["300", "x", "-1", "99999999999"]): {
                "content": _hostile(rng), "special": True}}
        else:
            _mutate_tree(doc, rng, rng.randint(1, 2))
        return doc
    _edit_json(d / "tokenizer_config.json", rng, fn)
    if rng.random() < 0.1:
        (d / "additional_chat_templates").mkdir(exist_ok=True)
        (d / "additional_chat_templates" / "x.jinja").write_bytes(b"\xff{{ 1 }}")
    return "tokenizer_config.json"


def _generation(d: Path, rng: random.Random) -> str:
    def fn(doc):
        doc[rng.choice(["temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                        "do_sample", "eos_token_id"])] = _hostile(rng)
        return doc
    _edit_json(d / "generation_config.json", rng, fn)
    return "generation_config.json"


FOLDER_MUTATIONS = [_config, _rope, _quant, _header, _index, _tokenizer_json, _tokenizer_config,
                    _generation]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _worker_folders() -> None:
    """Worker: one folder path per stdin line -> one JSON outcome per stdout line."""
    import torch

    import mlxr
    from mlxr.errors import MlxrError

    torch.set_num_threads(1)  # tiny models: threads only contend (10x slower on a busy box)

    for line in sys.stdin:
        d = Path(line.strip())
        try:
            m = mlxr.load(d, device="cpu", dtype="float32")
            list(m.generate([1, 2, 3], max_tokens=3))
            if (d / "tokenizer.json").is_file():
                m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                tokenize=True)
            # a model that loads must compute finite logits (its weights as mlx-lm made them)
            out = {"outcome": "ok" if m.logits([1, 2, 3]).isfinite().all() else "nan"}
        except MlxrError as e:
            out = {"outcome": "error", "error": f"{type(e).__name__}: {str(e)[:200]}"}
        except MemoryError:
            out = {"outcome": "oom"}
        except Exception as e:  # noqa: BLE001 -- what the fuzzer looks for
            out = {"outcome": "crash", "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(out), flush=True)


class _Worker:
    """A worker process, restarted after a hang or a death."""

    def __init__(self, mode: str):
        self.mode, self.proc = mode, None

    def start(self):
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
        self.proc = subprocess.Popen([sys.executable, __file__, f"worker-{self.mode}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=_limit_memory)

    def ask(self, line: str, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.stop()
            return {"outcome": "hang"}
        reply = self.proc.stdout.readline()
        if not reply:
            rc = self.proc.wait()
            self.proc = None
            return {"outcome": "oom" if rc in (-6, -9) else "crash", "error": f"exit {rc}"}
        return json.loads(reply)

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _base(family: str, out: Path) -> tuple[Path, list]:
    """A family's unmutated folder and its mutations: the generic ones, plus (beyond qwen3)
    fuzz_families' aimed at the family's own keys and tensors."""
    if family == "qwen3":
        import mlx_ref
        from hostile_models import make_folder

        return make_folder(mlx_ref, out), FOLDER_MUTATIONS
    import fuzz_families

    return fuzz_families.build_base(family, out), FOLDER_MUTATIONS + [
        (lambda d, rng, f=f: f(d, rng, _edit_json, _hostile)) for f in fuzz_families.MUTATIONS]


def _log(key: str, record: dict) -> None:
    """MLXR_FUZZ_LOG: every case's outcome, one JSON line each (a campaign's tally)."""
    if os.environ.get(key):
        with open(os.environ[key], "a") as log:
            log.write(json.dumps(record) + "\n")


def fuzz_folders(n: int, seed: int, families: tuple[str, ...] = ("qwen3",)) -> dict:
    """n cases for each family (its own random.Random(seed): the same cases whatever else
    runs), all in one worker process."""
    work = Path(tempfile.mkdtemp(prefix="mlxr-fuzz-"))
    worker = _Worker("folders")
    tally: dict[str, int] = {}
    by_family: dict[str, dict[str, int]] = {}
    findings = []
    start = time.monotonic()
    try:
        for family in families:
            rng = random.Random(seed)
            base, mutations = _base(family, work / family)
            first = worker.ask(str(base), 120)  # warm up: imports, first load
            if first["outcome"] != "ok":  # the unmutated folder must load
                findings.append({"family": family, "case": "base", **first})
            counts = by_family.setdefault(family, {})
            for i in range(n):
                d = work / f"case{i}"
                shutil.copytree(base, d)
                kinds = [rng.choice(mutations)(d, rng) for _ in range(rng.randint(1, 3))]
                t0 = time.monotonic()
                out = worker.ask(str(d), CASE_TIMEOUT)
                out["seconds"] = round(time.monotonic() - t0, 3)
                for t in (tally, counts):
                    t[out["outcome"]] = t.get(out["outcome"], 0) + 1
                record = {"family": family, "case": i, "mutations": kinds, **out}
                _log("MLXR_FUZZ_LOG", record)
                if out["outcome"] not in ("ok", "error"):
                    findings.append(record)
                    if os.environ.get("MLXR_FUZZ_KEEP"):  # a folder to reproduce it
                        shutil.copytree(d, Path(os.environ["MLXR_FUZZ_KEEP"]) / f"{family}-{i}")
                shutil.rmtree(d, ignore_errors=True)
    finally:
        worker.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"kind": "folders", "families": list(families), "tried": n * len(families),
            "seed": seed, "outcomes": tally, "by_family": by_family, "findings": findings,
            "seconds": round(time.monotonic() - start, 1)}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "worker-folders":
        _worker_folders()
    else:
        sys.path[:0] = [str(ROOT), str(HERE)]
        n, seed = int(sys.argv[2]), int(sys.argv[3])
        if mode == "folders":
            family = sys.argv[5] if sys.argv[4:5] == ["--family"] else "qwen3"
            if family == "all":
                import fuzz_families

                family = ",".join(fuzz_families.FAMILIES)
            print(json.dumps(fuzz_folders(n, seed, tuple(family.split(",")))))
        elif mode == "sweep":  # tests/fuzz_sweep.py: every single edit of one kind
            import fuzz_families
            import fuzz_sweep

            family = sys.argv[5] if sys.argv[4:5] == ["--family"] else "all"
            names = fuzz_families.FAMILIES if family == "all" else family.split(",")
            print(json.dumps(fuzz_sweep.sweep(tuple(names))))
        else:
            import fuzz_requests

            print(json.dumps(fuzz_requests.fuzz_requests(n, seed)))
