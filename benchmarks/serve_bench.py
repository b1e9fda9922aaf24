"""Output tokens/s of `mlxr serve` under 1, 8, 64, 256 concurrent streaming clients.

    python benchmarks/serve_bench.py MODEL [--clients 1,8,64,256] [--tokens 64] [--device cpu]
                                           [--procs N] [--rounds R] [--engine-process on]
                                           [--route chat]

Starts a real server process on a loopback port, then for each concurrency level runs that many
simultaneous streaming /v1/completions requests (or /v1/chat/completions with --route chat: one
user message; the model needs a chat template) (distinct prompts, EOS ignored, fixed length,
`stream_options.include_usage`) and reports output tokens (from each stream's final usage) per
wall second, requests per wall second, time to first token and inter-token latency (per request:
time from its first to its last token / (tokens - 1); median over requests). With --rounds R
each level runs R times and the median round is reported. The last line is JSON.

The client must not be what limits the number: the streams of a level are spread over `--procs`
worker processes (default min(8, cores)), started together at a barrier, each reading its
share on one asyncio loop with a plain socket and a C HTTP parser (httptools; h11 when httptools
is missing) -- no httpx per stream, whose per-line Python cost alone caps one process at a few
thousand chunks/s. The server's own CPU time per output token and per request is reported too
(Linux); with few tokens per request (--tokens 2) the latter is the server's per-request cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# -- HTTP/1.1 response bodies from a socket (client side) -----------------------------------------

class _Response:
    """Feed raw bytes, get de-chunked body pieces; `status` and `done` once known. httptools'
    C parser when it is installed, else h11 (a uvicorn dependency, always there)."""

    def __init__(self):
        self.status, self.done, self.pieces = None, False, []
        try:
            import httptools
        except ImportError:
            import h11

            self._h11, self._conn = h11, h11.Connection(h11.CLIENT)
            self._conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
            self._conn.send(h11.EndOfMessage())
        else:
            self._h11, self._p = None, httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_headers_complete(self):
        self.status = self._p.get_status_code()

    def on_body(self, body: bytes):
        self.pieces.append(body)

    def on_message_complete(self):
        self.done = True

    def feed(self, data: bytes) -> list[bytes]:
        if self._h11 is None:
            self._p.feed_data(data)
        else:
            h11 = self._h11
            self._conn.receive_data(data)
            while True:
                ev = self._conn.next_event()
                if ev is h11.NEED_DATA or ev is h11.PAUSED:
                    break
                if isinstance(ev, h11.Response):
                    self.status = ev.status_code
                elif isinstance(ev, h11.Data):
                    self.pieces.append(bytes(ev.data))
                elif isinstance(ev, h11.EndOfMessage):
                    self.done = True
                    break
        out, self.pieces = self.pieces, []
        return out


async def _http(method: str, port: int, path: str, body: bytes | None = None):
    """Send one request on a new connection: (reader, writer, time sent); the caller reads."""
    reader, writer = await asyncio.open_connection(HOST, port)
    head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAccept: */*\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    return reader, writer, time.perf_counter()


async def one_stream(port: int, model: str, prompt: str, tokens: int, route: str) -> dict:
    chat = route == "chat"
    req = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
           "ignore_eos": True, "stream_options": {"include_usage": True}}
    req.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    reader, writer, t0 = await _http("POST", port, "/v1/chat/completions" if chat else
                                     "/v1/completions", json.dumps(req).encode())
    resp, buf = _Response(), b""
    first = last = None
    chunks, usage, error = 0, None, None
    try:
        while not resp.done:
            data = await reader.read(1 << 16)
            if not data:
                break
            now = time.perf_counter()
            for piece in resp.feed(data):
                buf += piece
            if resp.status is not None and resp.status != 200:
                continue  # read the error body to the end
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                d = json.loads(ev[6:])
                if "error" in d:
                    error = d["error"]
                elif d.get("choices") and (d["choices"][0]["delta"].get("content") if chat
                                           else d["choices"][0].get("text")):
                    first = first or now
                    last = now
                    chunks += 1
                elif d.get("usage"):
                    usage = d["usage"]
    finally:
        writer.close()
    if resp.status != 200 or error or usage is None:
        raise RuntimeError(f"HTTP {resp.status}: {error or buf[:300]!r}")
    n = usage["completion_tokens"]
    return {"tokens": n, "chunks": chunks, "ttft": (first or now) - t0,
            "itl": (last - first) / (n - 1) if first and n > 1 else None}


async def _streams(port: int, model: str, prompts: list[str], tokens: int, route: str) -> list:
    return await asyncio.gather(*(one_stream(port, model, p, tokens, route) for p in prompts),
                                return_exceptions=True)


def _worker(conn, barriers, port: int, model: str, route: str) -> None:
    """A client process: for each (n, prompts, tokens) it is sent, wait at the n-process barrier
    with the others, run its streams concurrently, send back (per-stream results, end time)."""
    while (task := conn.recv()) is not None:
        n, prompts, tokens = task
        barriers[n].wait(600)  # a worker that never arrives breaks it: no hang
        res = asyncio.run(_streams(port, model, prompts, tokens, route))
        end = time.perf_counter()
        conn.send(([r if isinstance(r, dict) else repr(r) for r in res], end))


class Clients:
    """`procs` worker processes kept for every level."""

    def __init__(self, procs: int, port: int, model: str, route: str = "completions"):
        ctx = mp.get_context("spawn")
        self.procs = procs
        self.barriers = {n: ctx.Barrier(n + 1) for n in range(1, procs + 1)}
        self.pipes, self.workers = [], []
        for _ in range(procs):
            a, b = ctx.Pipe()
            # one barrier per worker count: a level with fewer streams than procs uses fewer
            w = ctx.Process(target=_worker, args=(b, self.barriers, port, model, route),
                            daemon=True)
            w.start()
            self.pipes.append(a)
            self.workers.append(w)

    def level(self, clients: int, tokens: int, tag: str = "") -> tuple[list, float]:
        k = min(self.procs, clients)
        shares = [[f"Story {i}{tag}: once upon a time" for i in range(j, clients, k)]
                  for j in range(k)]
        for j in range(k):
            self.pipes[j].send((k, shares[j], tokens))
        self.barriers[k].wait(600)
        t0 = time.perf_counter()
        res, ends = [], []
        for j in range(k):
            r, end = self.pipes[j].recv()
            res += r
            ends.append(end)
        bad = [r for r in res if not isinstance(r, dict)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {clients} streams failed: {bad[0]}")
        return res, max(ends) - t0

    def close(self):
        for p in self.pipes:
            p.send(None)
        for w in self.workers:
            w.join(5)


def child_pids(pid: int) -> list[int]:
    """A process's live children (the server's: its engine process, multiprocessing's idle
    resource tracker)."""
    from pathlib import Path

    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except OSError:
        return []


def cpu_seconds(pid: int, others: list[int]) -> tuple[float, float | None] | None:
    """CPU seconds (user + system) of a process, and of `others` together (its engine process;
    None without)."""
    from pathlib import Path

    def one(p):
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        return one(pid), sum(one(k) for k in others) if others else None
    except (OSError, ValueError, IndexError):
        return None


def summarize(clients: int, res: list[dict], wall: float,
              cpu: tuple[float, float | None] | None) -> dict:
    toks = sum(r["tokens"] for r in res)
    itl = sorted(r["itl"] for r in res if r["itl"] is not None)
    out = {"clients": clients, "wall_s": round(wall, 3), "output_tok_s": round(toks / wall, 1),
           "requests_s": round(len(res) / wall, 1),
           "output_tokens": toks, "streamed_pieces": sum(r["chunks"] for r in res),
           "ttft_p50_s": round(statistics.median(r["ttft"] for r in res), 3),
           "itl_p50_ms": round(statistics.median(itl) * 1e3, 2) if itl else None,
           "itl_p99_ms": round(itl[min(len(itl) - 1, int(len(itl) * 0.99))] * 1e3, 2)
           if itl else None}
    if cpu is not None:  # the whole server: HTTP process + engine process when it has one
        total = cpu[0] + (cpu[1] or 0)
        out["server_cpu_s"] = round(total, 3)
        out["server_cpu_us_per_token"] = round(total / toks * 1e6, 1)
        out["server_cpu_ms_per_request"] = round(total / len(res) * 1e3, 3)
        if cpu[1] is not None:
            out["engine_process_cpu_us_per_token"] = round(cpu[1] / toks * 1e6, 1)
    return out


def wait_ready(port: int, proc) -> str:
    import http.client

    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            c = http.client.HTTPConnection(HOST, port, timeout=2)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            if r.status == 200:
                c.request("GET", "/v1/models")
                return json.loads(c.getresponse().read())["data"][0]["id"]
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


# -- --null-engine: the server path alone --------------------------------------------------------

class NullSeq:
    def __init__(self, req, emit):
        self.req, self.emit, self.n, self.aborted = req, emit, 0, False


class NullLLMEngine:
    """An LLMEngine stand-in whose step costs nothing but one output per running request,
    `host_s` of Python with the GIL held (the engine's host share) and a sleep of `step_s` (the
    GPU's time, GIL released)."""

    def __init__(self, step_s: float, host_s: float):
        import threading

        self.step_s, self.host_s = step_s, host_s
        self.lock, self.running = threading.Lock(), []
        self.scheduler = type("Scheduler", (), {"waiting": [], "running": self.running,
                                                "waiting_requests": lambda _: 0})()

    def add(self, req, emit):
        seq = NullSeq(req, emit)
        with self.lock:
            self.running.append(seq)
        return seq

    def abort(self, seq):
        seq.aborted = True

    def has_work(self):
        return bool(self.running)

    def stats(self):
        return {"running": len(self.running), "waiting": 0}

    def step(self):
        from mlxr.engine.engine import RequestOutput

        with self.lock:
            batch = list(self.running)
        for seq in batch:
            seq.n += 1
            done = seq.aborted or seq.n >= seq.req.params.max_tokens
            if done:
                with self.lock:
                    self.running.remove(seq)
            if not seq.aborted:
                seq.emit(RequestOutput([400], " word", "length" if done else None,
                                       len(seq.req.prompt_ids), seq.n, 0, None))
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass
        time.sleep(self.step_s)


def _null_child(path, load_kw, engine_kw, rx, tx) -> None:
    """ProcEngine's child serving a NullLLMEngine (load_kw: its step_s and host_s)."""
    from mlxr.engine.proc_engine import _ChildEngine

    eng = _ChildEngine(None, tx, engine=NullLLMEngine(**load_kw), **engine_kw)
    tx.send(("ready", eng.engine.stats()))
    eng.serve(rx)


def null_engine_server(model_path: str, port: int, max_seqs: int, step_s: float,
                       stream_interval: int | None = None, host_s: float = 0.0,
                       engine_process: bool = False):
    """`mlxr serve`'s app, uvicorn protocol and loop in this process over a NullLLMEngine driven
    by AsyncEngine (or, with `engine_process`, by ProcEngine from a child process): the ceiling
    of everything between the engine step and the socket on this CPU. Returns the uvicorn server,
    the thread it runs on and the engine process's pid (None in-process)."""
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import uvicorn

    import mlxr
    from mlxr.cli.common import BUNDLED
    from mlxr.engine import AsyncEngine
    from mlxr.engine.proc_engine import ProcEngine
    from mlxr.server.app import ServerState, create_app, freeze_heap
    from mlxr.server.security import SecurityConfig, deadline_protocol

    path = Path(model_path)
    if not path.is_dir() and (BUNDLED / model_path).is_dir():
        path = BUNDLED / model_path
    null = {"step_s": step_s, "host_s": host_s}
    kw = {"max_queued": max_seqs * 2, "stream_interval": stream_interval}
    if engine_process:
        class NullProcEngine(ProcEngine):
            child_main = staticmethod(_null_child)
        eng = NullProcEngine(path, null, **kw)
        eng.wait_ready()
    else:
        eng = AsyncEngine(None, engine=NullLLMEngine(**null), **kw)
    state = ServerState(path, path.name, {}, {})
    state.models.loader = lambda _, _budget: (mlxr.load(path, weights=False), eng)  # the stand-in
    app = create_app(state, SecurityConfig(), load_in_background=False)
    state.load()
    freeze_heap()
    srv = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, http=deadline_protocol(10),
                                        limit_concurrency=max_seqs * 2 + 8, log_level="warning",
                                        lifespan="off", server_header=False, ws="none"))
    thread = threading.Thread(target=srv.run, daemon=True, name="null-engine-server")
    thread.start()
    return srv, thread, eng.proc.pid if engine_process else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,8,64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--procs", type=int, default=min(8, os.cpu_count() or 1),
                    help="client worker processes (default min(8, cores))")
    ap.add_argument("--rounds", type=int, default=1, help="runs per level; the median is kept")
    ap.add_argument("--route", choices=["completions", "chat"], default="completions",
                    help="/v1/completions (a prompt) or /v1/chat/completions (one user message)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for `mlxr serve` (repeatable)")
    ap.add_argument("--engine-process", choices=["auto", "on", "off"], default=None,
                    help="`mlxr serve --engine-process` (default: the server's, auto); with "
                    "--null-engine, on runs the stand-in engine in a child process")
    ap.add_argument("--null-engine", action="store_true",
                    help="serve from this process over a no-cost engine stand-in: the ceiling of "
                    "the server path (HTTP, SSE, handoff) alone; MODEL gives the tokenizer")
    ap.add_argument("--null-stream-interval", type=int, default=None,
                    help="with --null-engine: AsyncEngine's stream_interval (default: auto)")
    ap.add_argument("--null-host-ms", type=float, default=0.0,
                    help="with --null-engine: Python work per step with the GIL held (the "
                    "engine's host share)")
    ap.add_argument("--null-step-ms", type=float, default=0.0,
                    help="with --null-engine: the time each step sleeps (the GPU's share)")
    a = ap.parse_args()
    levels = [int(c) for c in a.clients.split(",")]
    port = free_port()
    cmd = [sys.executable, "-m", "mlxr", "serve", a.model, "--port", str(port),
           "--max-num-seqs", str(max(levels)), "--max-queued", str(max(levels) * 2),
           "--max-connections", str(max(levels) * 2 + 8), "--log-level", "warning",
           *a.server_arg]
    if a.device:
        cmd += ["--device", a.device]
    if a.engine_process:
        cmd += ["--engine-process", a.engine_process]
    if a.null_engine:
        srv, thread, engine_pid = null_engine_server(
            a.model, port, max(levels), a.null_step_ms / 1e3, a.null_stream_interval,
            a.null_host_ms / 1e3, a.engine_process == "on")
        proc = type("InProcess", (), {"pid": os.getpid(), "returncode": None,
                                      "poll": lambda self: None,
                                      # uvloop must be stopped before the interpreter exits: a
                                      # timer firing in its finalization crashes it
                                      "wait": lambda self, t: thread.join(t),
                                      "terminate": lambda self: setattr(srv, "should_exit", 1)})()
    else:
        proc = subprocess.Popen(cmd, env=dict(os.environ))
    clients = None
    out = []
    try:
        model = wait_ready(port, proc)
        # (with --null-engine this process's other children are the client workers)
        engines = ([engine_pid] if engine_pid else []) if a.null_engine else child_pids(proc.pid)
        clients = Clients(max(1, a.procs), port, model, a.route)
        clients.level(1, 4, " warm")
        for c in levels:
            rounds = []
            for r in range(a.rounds):
                cpu0 = cpu_seconds(proc.pid, engines)
                res, wall = clients.level(c, a.tokens, f".{r}")
                cpu1 = cpu_seconds(proc.pid, engines)
                rounds.append(summarize(c, res, wall, None if None in (cpu0, cpu1) else (
                    cpu1[0] - cpu0[0], cpu1[1] - cpu0[1] if engines else None)))
            rounds.sort(key=lambda x: x["output_tok_s"])
            out.append(rounds[len(rounds) // 2])
    finally:
        if clients is not None:
            clients.close()
        proc.terminate()
        proc.wait(30)
    for r in out:
        print(f"{r['clients']:4d} clients: {r['output_tok_s']:10.1f} output tok/s, "
              f"{r['requests_s']} requests/s  (wall {r['wall_s']} s, TTFT p50 "
              f"{r['ttft_p50_s']} s, ITL p50 {r['itl_p50_ms']} ms, {r['streamed_pieces']} "
              f"chunks for {r['output_tokens']} tokens, server CPU "
              f"{r.get('server_cpu_us_per_token')} us/token, "
              f"{r.get('server_cpu_ms_per_request')} ms/request, engine process "
              f"{r.get('engine_process_cpu_us_per_token')})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
