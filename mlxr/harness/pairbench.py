"""Paired A/B benchmark: baseline (A) and candidate (B), each in its own process, timed alternately.

Each side is a persistent worker process (its own environment, PYTHONPATH / mlxr checkout,
interpreter and extra worker arguments) that loads the model once and warms up. The driver then
asks A, B, A, B, ... for one generation each (same prompt ids, same token count, EOS ignored),
so slow drift of the machine hits both sides alike. A sample is the per-phase minimum of
`--repeat` generations (interference only adds time). Per phase (prefill, decode) the speedup is
median(A seconds per token) / median(B seconds per token) over the N pairs, with the min/max of
the per-pair ratios as the spread; the score is decode_speedup**0.75 * prefill_speedup**0.25.
A phase below its floor (default 0.95) is a regression: exit code 1.

The worker uses only mlxr's public API (`mlxr.load`, `Model.stream`), so it also drives older
checkouts. Test hook: MLXR_TEST_DELAY_MS=<ms> in a side's environment makes that worker sleep
that long in every decoder forward call (wrapped in the worker, never in the engine).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import MlxrError

TAG = "@@mlxr-pair "

# Runs as `python -c WORKER [args]` with cwd = the side's checkout, so `import mlxr` is that
# side's mlxr. Protocol: a JSON config line in, "run" lines in; TAG-prefixed JSON lines out.
WORKER = r'''
import argparse, json, os, sys, time
TAG = "@@mlxr-pair "
def say(obj):
    sys.stdout.write(TAG + json.dumps(obj) + "\n"); sys.stdout.flush()
ap = argparse.ArgumentParser(prog="mlxr-pair-worker")
ap.add_argument("--device", default=None)
ap.add_argument("--dtype", default=None)
ap.add_argument("--threads", type=int, default=None)
opts = ap.parse_args()
cfg = json.loads(sys.stdin.readline())
import torch, mlxr
if opts.threads:
    torch.set_num_threads(opts.threads)
t0 = time.perf_counter()
model = mlxr.load(cfg["model"], device=opts.device, dtype=opts.dtype)
load_s = time.perf_counter() - t0
try:  # per-step spans under MLXR_TRACE (checkouts that have mlxr.harness.trace)
    from mlxr.harness import trace
    trace.instrument(model.decoder)
except ImportError:
    pass
delay = float(os.environ.get("MLXR_TEST_DELAY_MS", "0") or 0) / 1e3
if delay > 0:  # test hook: a slower "engine", injected here and never in mlxr itself
    inner = model.decoder.forward
    def slow_forward(*a, **kw):
        time.sleep(delay)
        return inner(*a, **kw)
    model.decoder.forward = slow_forward
def once():
    t = time.perf_counter(); first = None; toks = []; last = None
    for c in model.stream(cfg["prompt_ids"], max_tokens=cfg["tokens"], temperature=0.0,
                          ignore_eos=True):
        if first is None:
            first = time.perf_counter()
        toks += c.token_ids; last = c
    end = time.perf_counter()
    st = getattr(last, "stats", None)
    pre = getattr(st, "prefill_s", None) or (first - t)
    dec = getattr(st, "decode_s", None) or (end - first)
    return {"prefill_s": pre, "decode_s": dec, "prompt_tokens": len(cfg["prompt_ids"]),
            "generation_tokens": len(toks), "tokens": toks}
for _ in range(cfg["warmup"]):
    once()
say({"ready": True, "load_s": load_s, "mlxr_version": getattr(mlxr, "__version__", "?"),
     "mlxr_file": mlxr.__file__, "device": str(model.device),
     "dtype": str(model.dtype).replace("torch.", ""), "threads": torch.get_num_threads()})
def sample():
    # One timed sample: the per-phase minimum of `repeat` generations. Interference from other
    # processes only ever adds time (a preemption costs a whole scheduler tick), so the minimum
    # is the least noisy estimate of the undisturbed time (as timeit does).
    rs = [once() for _ in range(cfg["repeat"])]
    r = dict(rs[-1])
    for k in ("prefill_s", "decode_s"):
        r[k] = min(x[k] for x in rs)
    return r
for line in sys.stdin:
    if line.strip() != "run":
        break
    say(sample())
'''


def parse_env(items: list[str] | None) -> dict[str, str]:
    env = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise MlxrError(f"--a-env/--b-env {item!r}: expected KEY=VALUE")
        env[key] = val
    return env


class Side:
    """One configuration's worker process."""

    def __init__(self, name: str, env: dict[str, str], path: str | None, python: str | None,
                 extra: list[str]):
        self.name = name
        root = Path(path).resolve() if path else Path(__file__).resolve().parents[2]
        if not (root / "mlxr" / "__init__.py").is_file():
            raise MlxrError(f"side {name}: {root} is not an mlxr checkout (no mlxr/__init__.py)")
        full = dict(os.environ)
        full.pop("MLXR_TEST_DELAY_MS", None)  # only a side's own --x-env sets the test hook
        full["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in full.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        if full.get("MLXR_TRACE"):  # one trace file per side: run.json -> run.A.json, run.B.json
            t = Path(full["MLXR_TRACE"])
            full["MLXR_TRACE"] = str(t.with_name(f"{t.stem}.{name}{t.suffix or '.json'}"))
        full.update(env)
        self.desc = {"env": env, "path": str(root) if path else "(this checkout)",
                     "python": python or "(this interpreter)", "args": extra}
        self.errf = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([python or sys.executable, "-c", WORKER, *extra],
                                     cwd=root, env=full, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.errf, text=True)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def recv(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        self.proc.wait()
        self.errf.seek(0)
        err = self.errf.read().strip().splitlines()
        raise MlxrError(f"side {self.name} worker exited ({self.proc.returncode}): "
                        f"{err[-1] if err else 'no output'}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait()
        self.errf.close()


def _prompt_ids(model_dir: Path, n: int) -> list[int]:
    """A deterministic synthetic prompt of n ids (BOS, then a spread over the vocabulary)."""
    from ..config import load_config

    cfg, _ = load_config(model_dir)
    v = cfg.vocab_size
    bos = cfg.bos_token_id if getattr(cfg, "bos_token_id", None) is not None else 1
    return [int(bos)] + [(7 + 31 * i) % v for i in range(1, n)]


def summarize(a_runs: list[dict], b_runs: list[dict], floors: dict[str, float]) -> dict:
    """Per-phase paired-median speedups (B over A), spread, score, and floor verdicts."""
    phases = {}
    for phase, count in (("prefill", "prompt_tokens"), ("decode", "generation_tokens")):
        def per_tok(r, phase=phase, count=count):
            n = r[count] - (1 if phase == "decode" else 0)  # the first token is the prefill's
            return r[f"{phase}_s"] / max(n, 1)

        a = [per_tok(r) for r in a_runs]
        b = [per_tok(r) for r in b_runs]
        ratios = [x / y if y > 0 else float("inf") for x, y in zip(a, b)]
        ma, mb = statistics.median(a), statistics.median(b)
        sp = ma / mb if mb > 0 else float("inf")
        phases[phase] = {"a_median_s_per_token": ma, "b_median_s_per_token": mb,
                         "a_tps": 1 / ma if ma else 0.0, "b_tps": 1 / mb if mb else 0.0,
                         "speedup": sp, "min": min(ratios), "max": max(ratios),
                         "floor": floors[phase], "pass": sp >= floors[phase]}
    score = phases["decode"]["speedup"] ** 0.75 * phases["prefill"]["speedup"] ** 0.25
    same = all(x["tokens"] == y["tokens"] for x, y in zip(a_runs, b_runs))
    return {"pairs": len(a_runs), "phases": phases, "score": score, "tokens_identical": same,
            "pass": all(p["pass"] for p in phases.values())}


def run_pairs(model_dir: Path, a: dict, b: dict, pairs: int = 7, warmup: int = 2,
              repeat: int = 1, prompt_ids: list[int] | None = None, prompt_tokens: int = 64,
              tokens: int = 32,
              floors: dict[str, float] | None = None) -> dict:
    """Run the paired benchmark; a/b: dicts with env, path, python, args."""
    if pairs < 1 or repeat < 1 or tokens < 2:
        raise MlxrError("--pairs and --repeat must be at least 1, --tokens at least 2")
    floors = floors or {"prefill": 0.95, "decode": 0.95}
    ids = prompt_ids or _prompt_ids(model_dir, prompt_tokens)
    cfg = json.dumps({"model": str(model_dir), "prompt_ids": ids, "tokens": tokens,
                      "warmup": warmup, "repeat": repeat})
    sides = []
    try:
        for name, spec in (("A", a), ("B", b)):
            sides.append(Side(name, spec.get("env", {}), spec.get("path"), spec.get("python"),
                              spec.get("args", [])))
        info = []
        for s in sides:  # both load concurrently, then warm up (one at a time is not needed:
            s.send(cfg)  # neither is timed yet)
        for s in sides:
            info.append(s.recv())
        runs = {"A": [], "B": []}
        for _ in range(pairs):
            for s in sides:  # A then B, strictly one at a time
                s.send("run")
                runs[s.name].append(s.recv())
    finally:
        for s in sides:
            s.close()
    out = summarize(runs["A"], runs["B"], floors)
    out.update({"model": model_dir.name, "prompt_tokens": len(ids), "tokens": tokens,
                "warmup": warmup, "repeat": repeat,
                "sides": {s.name: {**s.desc, **{k: v for k, v in i.items() if k != "ready"}}
                          for s, i in zip(sides, info)},
                "runs": {k: [{x: y for x, y in r.items() if x != "tokens"} for r in v]
                         for k, v in runs.items()}})
    return out


def format_table(res: dict) -> str:
    lines = [(f"paired benchmark: {res['model']}, {res['prompt_tokens']} prompt tokens, "
              f"{res['tokens']} generated, {res['pairs']} pairs (A B A B ...), "
              f"sample = min of {res['repeat']}"),
             (f"{'phase':<8} {'A tok/s':>10} {'B tok/s':>10} {'speedup':>8} {'min':>7} "
              f"{'max':>7} {'floor':>6}  verdict")]
    for name, p in res["phases"].items():
        lines.append(f"{name:<8} {p['a_tps']:>10.1f} {p['b_tps']:>10.1f} {p['speedup']:>8.3f} "
                     f"{p['min']:>7.3f} {p['max']:>7.3f} {p['floor']:>6.2f}  "
                     f"{'ok' if p['pass'] else 'REGRESSION'}")
    lines.append(f"score (decode^0.75 * prefill^0.25): {res['score']:.3f}   "
                 f"tokens identical: {'yes' if res['tokens_identical'] else 'NO'}   "
                 f"{'PASS' if res['pass'] else 'FAIL'}")
    return "\n".join(lines)


PAIR_DEFAULTS = {"pairs": 7, "warmup": 2, "repeat": 1, "prompt_tokens": 64, "prompt_ids": None,
                 "tokens": 32, "floor": 0.95, "prefill_floor": None, "decode_floor": None,
                 "json": None}


def add_pair_args(p) -> None:
    """The paired-benchmark flags (shared by `mlxr bench-pair` and `mlxr bench --pair`).

    Flags the parser already has (say `bench`'s own --tokens or --json) are left to it; run_pair
    reads them by name, falling back to PAIR_DEFAULTS."""
    have = set(getattr(p, "_option_string_actions", {}))

    def add(flag, **kw):
        if flag not in have:
            p.add_argument(flag, **kw)

    add("--pairs", type=int, default=7, help="number of A/B pairs (median over them)")
    add("--warmup", type=int, default=2, help="untimed runs per side before timing")
    add("--repeat", type=int, default=1,
        help="generations per timed sample (the sample is their per-phase minimum)")
    add("--prompt-tokens", type=int, default=64, help="synthetic prompt length")
    add("--prompt-ids", default=None, help="explicit prompt ids (comma separated)")
    add("--tokens", type=int, default=32, help="tokens generated per run")
    for s in ("a", "b"):
        who = "baseline" if s == "a" else "candidate"
        add(f"--{s}-env", action="append", metavar="K=V",
            help=f"environment variable for the {who} process (repeatable)")
        add(f"--{s}-path", default=None,
            help=f"mlxr checkout (repo root) the {who} imports (default: this one)")
        add(f"--{s}-python", default=None, help=f"interpreter for the {who} (default: this one)")
        add(f"--{s}-args", default="",
            help=f"extra worker args for the {who}, e.g. '--device cpu --dtype float32 "
                 "--threads 4'")
    add("--floor", type=float, default=0.95,
        help="lowest acceptable speedup B/A of both phases")
    add("--prefill-floor", type=float, default=None,
        help="lowest acceptable prefill speedup B/A (default: --floor)")
    add("--decode-floor", type=float, default=None,
        help="lowest acceptable decode speedup B/A (default: --floor)")
    add("--json", default=None, metavar="FILE",
        help="write the result as JSON ('-': print JSON instead of the table)")


def run_pair(args) -> int:
    """Run the paired benchmark from parsed args (see add_pair_args); exit code 0 / 1."""
    from ..cli.common import resolve_model

    def opt(name):
        v = getattr(args, name, None)
        return PAIR_DEFAULTS.get(name) if v is None else v

    model_dir = resolve_model(getattr(args, "model", None))
    common = []
    for flag in ("device", "dtype"):
        if getattr(args, flag, None):
            common += [f"--{flag}", str(getattr(args, flag))]
    sides = {}
    for s in ("a", "b"):
        sides[s] = {"env": parse_env(getattr(args, f"{s}_env", None)),
                    "path": getattr(args, f"{s}_path", None),
                    "python": getattr(args, f"{s}_python", None),
                    "args": common + shlex.split(getattr(args, f"{s}_args", None) or "")}
    ids = None
    if opt("prompt_ids"):
        try:
            ids = [int(t) for t in str(opt("prompt_ids")).replace(",", " ").split()]
        except ValueError:
            raise MlxrError(f"--prompt-ids {opt('prompt_ids')!r}: not integers") from None
    floor = opt("floor")
    floors = {ph: floor if opt(f"{ph}_floor") is None else opt(f"{ph}_floor")
              for ph in ("prefill", "decode")}
    res = run_pairs(model_dir, sides["a"], sides["b"], pairs=opt("pairs"), warmup=opt("warmup"),
                    repeat=opt("repeat"), prompt_ids=ids, prompt_tokens=opt("prompt_tokens"),
                    tokens=opt("tokens"), floors=floors)
    out = opt("json")
    if out == "-":
        print(json.dumps(res, indent=1))
    else:
        print(format_table(res))
        if out:
            Path(out).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["pass"] else 1
