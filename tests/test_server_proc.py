"""The engine in its own process: `mlxr serve --engine-process on` end to end with the official
openai client (streams, concurrency, grammar, disconnects, metrics, load failure, the child's exit
with the server), and `ProcEngine` alone (greedy equal to the model, errors, engine faults)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server_helpers import BUNDLED, Server, free_port, model_with_template

import mlxr
from mlxr.engine import EngineRequest
from mlxr.engine.proc_engine import ProcEngine
from mlxr.errors import MlxrError
from mlxr.text.sampling import SamplingParams

MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, assets):
    tpl = (assets / "chat-templates/llamacpp-jinja/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    model = model_with_template(tmp_path_factory.mktemp("m"), "story-chat", tpl)
    s = Server(model, "--engine-process", "on", "--max-num-seqs", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="story-chat", **kw)


def engine_child(pid: int) -> int:
    """The pid of the server's engine process (its spawned child that is not the resource
    tracker)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmd:
                return int(child)
    raise AssertionError("no engine process")


def test_health_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "story-chat",
                                                         "loaded": ["story-chat"]}
    text = httpx.get(server.url + "/metrics").text
    for name in ("mlxr_ready 1", "mlxr_kv_cache_blocks_total", "mlxr_num_requests_running",
                 "mlxr_time_to_first_token_seconds_bucket"):
        assert name in text
    assert server.metric("mlxr_kv_cache_blocks_total") > 0
    assert engine_child(server.proc.pid)


def test_chat_and_completions(client):
    whole = chat(client)
    msg = whole.choices[0]
    assert msg.message.content and msg.finish_reason in ("stop", "length")
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        msg.message.content
    assert chunks[-2].choices[0].finish_reason == msg.finish_reason
    r = client.completions.create(model="story-chat", prompt="Once upon a time", max_tokens=12,
                                  temperature=0, logprobs=2)  # logprobs cross the pipe too
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 12 and "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_concurrent_streams_equal_alone(server):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [f"Story number {i} about a {w}." for i, w in
               enumerate(["cat", "dog", "bird", "fish"] * 3)]

    async def one(p):
        s = await aclient.chat.completions.create(
            model="story-chat", messages=[{"role": "user", "content": p}], max_tokens=20,
            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    async def main():
        alone = [await one(p) for p in prompts]
        return alone, await asyncio.gather(*(one(p) for p in prompts))
    alone, together = asyncio.run(main())
    assert all(alone) and together == alone


def test_grammar_crosses_to_the_engine(client):
    """json_schema and a forced tool call: the grammar is rebuilt in the engine process."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}
    r = chat(client, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    d = json.loads(r.choices[0].message.content)
    assert set(d) == {"name", "age"} and 0 <= d["age"] <= 120 and len(d["name"]) <= 10
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"]}}}
    r = chat(client, tools=[tool], tool_choice="required", max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_disconnect_frees_blocks(server):
    body = {"model": "story-chat", "messages": MSGS, "max_tokens": 16000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
        assert server.metric("mlxr_kv_cache_blocks_used") > 0
        t = time.time()
    while server.metric("mlxr_kv_cache_blocks_used") > 0 and time.time() < t + 10:
        time.sleep(0.05)
    assert server.metric("mlxr_kv_cache_blocks_used") == 0
    assert server.metric("mlxr_num_requests_running") == 0
    assert time.time() - t < 5  # aborted, not run to max_tokens


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_engine_exits_with_the_server(server):
    """Killed without a chance to clean up, the server leaves no engine process behind: the
    child sees its request pipe close."""
    child = engine_child(server.proc.pid)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.time() + 20
    while alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def test_load_failure_stops_the_server(tmp_path):
    """The weights fail to load in the engine process (the server process itself only read
    config.json): `serve` exits 1 with one error line naming the file, no traceback from either
    process, instead of staying up to answer every request with a 500."""
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(BUNDLED, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    r = subprocess.run([sys.executable, "-m", "mlxr", "serve", str(d), "--port", str(free_port()),
                        "--engine-process", "on", "--log-level", "warning"], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.splitlines() == [r.stderr.strip()]  # one line
    assert r.stderr.startswith("error: ") and "model.safetensors" in r.stderr


# -- ProcEngine without HTTP ----------------------------------------------------------------------

def boom(generated_ids, logits):
    """A picklable logits processor (the engine process imports it) that fails the step."""
    raise RuntimeError("boom")


@pytest.fixture(scope="module")
def engine():
    eng = ProcEngine(BUNDLED, {"device": "cpu", "dtype": "float32"}, max_num_seqs=4,
                     stream_interval=2)
    eng.wait_ready()
    yield eng
    eng.close()
    assert eng.proc.exitcode == 0


def test_proc_engine(engine):
    model = mlxr.load(BUNDLED, device="cpu", dtype="float32")
    tok = model.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", "The sun", "A big dog", "Lily")]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def collect(ids, **kw):
        outs = []
        async for out in engine.generate(EngineRequest(ids, kw.pop("params", greedy), **kw)):
            outs.append(out)
        return outs

    async def main():
        got = await asyncio.gather(*(collect(p) for p in prompts))
        with pytest.raises(MlxrError, match="outside the vocabulary"):
            await collect([10 ** 6])
        with pytest.raises(MlxrError, match="cannot be sent"):
            await collect(prompts[0], logits_processor=lambda ids, x: x)
        with pytest.raises(MlxrError, match="engine failure: RuntimeError: boom"):
            await collect(prompts[0], logits_processor=boom)
        return got, await collect(prompts[1])
    got, again = asyncio.run(main())
    for p, outs in zip(prompts, got):
        assert [t for o in outs for t in o.token_ids] == \
            list(model.generate(p, max_tokens=12, temperature=0, ignore_eos=True))
        assert len(outs) < 12 and outs[-1].finish_reason == "length"  # interval 2: merged
    assert [t for o in again for t in o.token_ids] == [t for o in got[1] for t in o.token_ids]
    assert engine.stats()["kv_blocks_used"] == 0 and engine.ready


def test_proc_engine_leaving_early_aborts(engine):
    """Both of ProcEngine's request frames (ProcEngine._request): a consumer that leaves a
    stream after its first output, and an embeddings call cancelled while it runs, get their
    requests aborted in the child (blocks freed, nothing running) and their mailboxes dropped;
    a request that ran to its end sends no abort."""
    endless = SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True)

    async def settled():
        t0 = time.monotonic()
        while engine.stats()["running"] or engine.stats()["kv_blocks_used"]:
            assert time.monotonic() - t0 < 20, engine.stats()
            await asyncio.sleep(0.02)

    async def main():
        async for _ in engine.generate(EngineRequest([1, 400, 403], endless)):
            break
        await settled()
        sent = []
        send = engine._send
        engine._send = lambda msg: sent.append(msg[0]) or send(msg)
        try:
            outs = [o async for o in engine.generate(EngineRequest([1, 400], SamplingParams(
                max_tokens=3, temperature=0, ignore_eos=True)))]
            assert outs[-1].finish_reason == "length" and sent == ["add"]
            sent.clear()
            task = asyncio.create_task(engine.embed([[1, 400, 403] * 80] * 64))
            await asyncio.sleep(0)  # the task sent its texts and waits for the first
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sent == ["embed", "abort"]
        finally:
            del engine._send
        await settled()
    asyncio.run(main())
    assert engine._streams == {} and engine.stats()["kv_blocks_used"] == 0


def test_messages_framing():
    """The reader splits what Connection.send wrote (a long message goes out in two writes),
    several messages per read or one in many pieces."""
    import multiprocessing as mp
    import threading

    from mlxr.engine.proc_engine import _messages

    sent = [("a", 1), list(range(8000)), {"b": "x" * 100}]
    r, w = mp.Pipe(duplex=False)
    for m in sent:
        w.send(m)
    w.close()
    assert [m for msgs in _messages(r.fileno()) for m in msgs] == sent
    r, w = mp.Pipe(duplex=False)
    data = b""
    for m in sent:
        a, b = mp.Pipe(duplex=False)
        b.send(m)
        b.close()
        data += os.read(a.fileno(), 1 << 20)

    def trickle():
        for i in range(0, len(data), 7):
            os.write(w.fileno(), data[i:i + 7])
        w.close()
    t = threading.Thread(target=trickle)
    t.start()
    assert [m for msgs in _messages(r.fileno()) for m in msgs] == sent
    t.join()


def test_engine_process_death_fails_streams():
    """The engine process dies mid-stream: the stream ends in an engine failure, the engine
    reports itself not ready (so /health says error), and new requests fail at once."""
    eng = ProcEngine(BUNDLED, {"device": "cpu", "dtype": "float32"})
    eng.wait_ready()
    params = SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True)

    async def main():
        n = 0
        with pytest.raises(MlxrError, match="engine failure: the engine process exited"):
            async for out in eng.generate(EngineRequest([1, 400, 403], params)):
                n += len(out.token_ids)
                if n >= 3:
                    os.kill(eng.proc.pid, signal.SIGKILL)
        with pytest.raises(MlxrError, match="engine failure"):
            await anext(eng.generate(EngineRequest([1, 400], params)))
    asyncio.run(main())
    assert not eng.ready and "code -9" in eng.error
    eng.close()


def test_serve_bench_null_engine_process():
    """serve_bench's stand-in engine served from a child process (ProcEngine.child_main)."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "benchmarks/serve_bench.py", "stories260K", "--clients",
                        "4", "--tokens", "6", "--procs", "1", "--null-engine",
                        "--engine-process", "on"], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (res,) = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["output_tokens"] == 24 and res["engine_process_cpu_us_per_token"] >= 0
