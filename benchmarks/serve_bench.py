"""Output tokens/s of `mlxr serve` under 1, 8, 64, 256 concurrent streaming clients.

    python benchmarks/serve_bench.py MODEL [--clients 1,8,64,256] [--tokens 64] [--device cpu]

Starts a real server process on a loopback port, then for each concurrency level runs that many
simultaneous streaming /v1/completions requests (distinct prompts, EOS ignored, fixed length)
and reports generated tokens / wall time, plus time to first token. Bounded: one round per
level, each request `--tokens` long. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
              tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    ttft, n = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = ttft or time.perf_counter() - t0
                    n += 1
    return n, ttft or 0.0


async def level(url: str, clients: int, tokens: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, url, model, f"Story {i}: once upon a time",
                                         tokens) for i in range(clients)))
        wall = time.perf_counter() - t0
    pieces = sum(n for n, _ in res)
    return {"clients": clients, "wall_s": round(wall, 3),
            "output_tok_s": round(clients * tokens / wall, 1), "streamed_pieces": pieces,
            "ttft_p50_s": round(statistics.median(t for _, t in res), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,8,64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    levels = [int(c) for c in a.clients.split(",")]
    port = free_port()
    cmd = [sys.executable, "-m", "mlxr", "serve", a.model, "--port", str(port),
           "--max-num-seqs", str(max(levels)), "--max-queued", str(max(levels) * 2),
           "--max-connections", str(max(levels) * 2 + 8), "--log-level", "warning"]
    if a.device:
        cmd += ["--device", a.device]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        asyncio.run(level(url, 1, 4))  # warm-up
        out = [asyncio.run(level(url, c, a.tokens)) for c in levels]
    finally:
        proc.terminate()
        proc.wait(30)
    for r in out:
        print(f"{r['clients']:4d} clients: {r['output_tok_s']:10.1f} output tok/s  "
              f"(wall {r['wall_s']} s, TTFT p50 {r['ttft_p50_s']} s)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
