"""llama-bench and `mlxr bench` on one shape, alternating, and the table of both.

Absolute CPU figures move from machine to machine and with the load of a shared box, so the
claim is the ratio of two runs made back to back in one process, with the 1-minute load
average read before each run printed beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3600  # one bench call; a hung one is an error, never a wait forever


@dataclass(frozen=True)
class Run:
    """One bench call's result: tok/s of a `prompt`-token prefill and of decoding."""

    shape: str
    side: str  # "llama.cpp" or "mlxr"
    threads: int | None
    round: int
    prefill: float
    decode: float
    load: float  # 1-minute load average just before the call


def llama_bench_cmd(bins: Path, gguf: Path, device: str, threads: int | None, repeats: int,
                    prompt: int, gen: int) -> list[str]:
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-p", str(prompt), "-n", str(gen),
           "-r", str(repeats), "-o", "jsonl"]
    if device == "cuda":
        return [*cmd, "-ngl", "99", "-fa", "1"]
    return [*cmd, "-ngl", "0"] + (["-t", str(threads)] if threads else [])


def mlxr_bench_cmd(model: Path, device: str, threads: int | None, repeats: int, prompt: int,
                   gen: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlxr", "bench", str(model), "-p", str(prompt), "-n", str(gen),
           "--device", device, "--repeats", str(repeats)]
    return cmd + (["--threads", str(threads)] if threads and device == "cpu" else [])


def parse_llama_bench(out: str) -> tuple[float, float]:
    """(prefill, decode) tok/s from llama-bench's jsonl: one object per test, the prompt
    test with n_gen 0 and the generation test with n_prompt 0."""
    pp = tg = None
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["n_gen"] == 0:
            pp = float(r["avg_ts"])
        elif r["n_prompt"] == 0:
            tg = float(r["avg_ts"])
    if pp is None or tg is None:
        raise ValueError(f"llama-bench printed no prompt and generation results:\n{out[-2000:]}")
    return pp, tg


def parse_mlxr_bench(out: str) -> tuple[float, float]:
    """(prefill, decode) tok/s from `mlxr bench`'s last line, one JSON object."""
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError(f"mlxr bench printed no JSON result:\n{out[-2000:]}")
    r = json.loads(lines[-1])
    return float(r["prefill_tok_s"]), float(r["decode_tok_s"])


def bench_env() -> dict[str, str]:
    """This checkout first on the path (mlxr bench runs this tree's mlxr)."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), path) if p))


def run_once(cmd: list[str], parse) -> tuple[tuple[float, float], float]:
    load = os.getloadavg()[0]
    r = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), timeout=TIMEOUT_S)
    if r.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({r.returncode}):\n"
                         f"{(r.stdout + r.stderr)[-3000:]}")
    return parse(r.stdout), load


def alternate(shape: str, gguf: Path, mlx: Path, bins: Path, device: str,
              threads: list[int | None], rounds: int, repeats: int, prompt: int,
              gen: int) -> list[Run]:
    """`rounds` rounds, each: for each thread count, llama-bench then mlxr bench."""
    runs = []
    for rnd in range(1, rounds + 1):
        for t in threads:
            for side, cmd, parse in (
                    ("llama.cpp", llama_bench_cmd(bins, gguf, device, t, repeats, prompt, gen),
                     parse_llama_bench),
                    ("mlxr", mlxr_bench_cmd(mlx, device, t, repeats, prompt, gen),
                     parse_mlxr_bench)):
                print(f"  {shape} t={t} round {rnd} {side}: {' '.join(cmd)}", flush=True)
                (pp, tg), load = run_once(cmd, parse)
                runs.append(Run(shape, side, t, rnd, pp, tg, load))
                print(f"  {shape} t={t} round {rnd} {side:9s}: prefill {pp:9.1f} "
                      f"decode {tg:8.1f} tok/s (load {load:.1f})", flush=True)
    return runs


def fmt(x: float) -> str:
    return f"{x:,.1f}" if x < 10_000 else f"{x:,.0f}"


def format_table(runs: list[Run], prompt: int, gen: int) -> str:
    """Markdown: per shape and thread count, each phase's figures round by round
    (`a / b`), the ratio mlxr / llama.cpp of the rounds' medians, and the loads."""
    head = ("| shape | threads | phase | llama.cpp tok/s | mlxr tok/s | mlxr / llama.cpp "
            "| load (llama.cpp; mlxr) |\n|---|---|---|---|---|---|---|")
    rows = [head]
    keys = list(dict.fromkeys((r.shape, r.threads) for r in runs))
    for shape, t in keys:
        side = {s: [r for r in runs if (r.shape, r.threads, r.side) == (shape, t, s)]
                for s in ("llama.cpp", "mlxr")}
        if not side["llama.cpp"] or not side["mlxr"]:
            continue
        loads = "; ".join(" / ".join(f"{r.load:.1f}" for r in side[s]) for s in side)
        for phase, n in (("prefill", prompt), ("decode", gen)):
            vals = {s: [getattr(r, phase) for r in side[s]] for s in side}
            ratio = statistics.median(vals["mlxr"]) / statistics.median(vals["llama.cpp"])
            rows.append(f"| {shape} | {t or '-'} | {phase} {n} | "
                        f"{' / '.join(map(fmt, vals['llama.cpp']))} | "
                        f"{' / '.join(map(fmt, vals['mlxr']))} | {ratio:.2f}x | {loads} |")
    return "\n".join(rows)
