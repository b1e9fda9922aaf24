"""The streamed wire formats over merged (multi-token) engine outputs, without a server process:
chat and completion SSE chunks keep the OpenAI framing whatever the split of the text into
outputs, tool calls and reasoning come out the same, the prebuilt chunk templates encode
exactly as json.dumps would; and serve_bench's smoke run."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import mlxr
from mlxr.cli.common import BUNDLED
from mlxr.engine.engine import RequestOutput
from mlxr.server import ollama, render
from mlxr.server.jobs import Job
from mlxr.server.metrics import Metrics
from mlxr.text.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TOOL_TEXT = ('<think>The user wants "weather" — ünïcödé\\n\ttabs.</think>\n\nLet me check.'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"P\\""}}\n'
             "</tool_call>")


@pytest.fixture(scope="module")
def model():
    return mlxr.load(BUNDLED / "stories260K", device="cpu", dtype="float32")


def outputs(text: str, cuts: list[int], finish: str = "stop") -> list[RequestOutput]:
    """The text as engine outputs split at `cuts` (one token id per character)."""
    edges = [0, *cuts, len(text)]
    outs, n = [], 0
    for a, b in zip(edges, edges[1:]):
        n += b - a
        outs.append(RequestOutput(list(range(a, b)), text[a:b], None, 5, n, 0))
    outs[-1].finish_reason = finish
    return outs


async def _drain(agen) -> list[str]:
    return [x async for x in agen]


def stream(model, fn, job, outs) -> list[str]:
    state = SimpleNamespace(model_id="m", metrics=Metrics())
    gen = render.Gen(state, job, "chat")

    async def agen():
        for o in outs:
            yield o
    gen.agen = agen()
    return asyncio.run(_drain(fn(state, model, job, gen, None)))


def sse_objects(chunks: list[str]) -> list[dict]:
    body = "".join(chunks)
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    objs = []
    for ev in events[:-1]:
        assert ev.startswith("data: ")
        d = json.loads(ev[6:])
        assert render.sse(d) == ev + "\n\n"  # templates encode exactly as json.dumps
        objs.append(d)
    return objs


def chat_result(objs: list[dict]) -> dict:
    head, *body, usage = objs
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({(o["id"], o["created"], o["object"]) for o in objs}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert all(o["usage"] is None for o in objs[:-1])
    finishes = [o["choices"][0]["finish_reason"] for o in body]
    assert not any(finishes[:-1]) and body[-1]["choices"][0]["delta"] == {}
    content = "".join(o["choices"][0]["delta"].get("content", "") for o in body)
    thought = "".join(o["choices"][0]["delta"].get("reasoning_content", "") for o in body)
    calls = {}
    for o in body:
        for tc in o["choices"][0]["delta"].get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += tc["function"].get("name") or ""
            c["arguments"] += tc["function"].get("arguments") or ""
    return {"content": content, "reasoning": thought, "finish": finishes[-1],
            "calls": [calls[i] for i in sorted(calls)], "chunks": len(body)}


def chat_job(**kw) -> Job:
    return Job([1, 2, 3], SamplingParams(max_tokens=500), include_usage=True, **kw)


@pytest.mark.parametrize("kw", [{}, {"family": "hermes", "reasoning": True}])
def test_chat_stream_same_whatever_the_merging(model, kw):
    per_char = chat_result(sse_objects(stream(model, render.chat_stream, chat_job(**kw),
                                              outputs(TOOL_TEXT, list(range(1, len(TOOL_TEXT)))))))
    for cuts in ([], [7], [30, 31, 90], [len(TOOL_TEXT) - 3]):
        merged = chat_result(sse_objects(stream(model, render.chat_stream, chat_job(**kw),
                                                outputs(TOOL_TEXT, cuts))))
        assert merged["chunks"] <= len(cuts) + 2
        assert {k: v for k, v in merged.items() if k != "chunks"} == \
            {k: v for k, v in per_char.items() if k != "chunks"}
    if kw:
        assert per_char["calls"] == [{"name": "get_weather",
                                      "arguments": '{"city": "Paris \\"P\\""}'}]
        assert per_char["content"] == "Let me check." and per_char["finish"] == "tool_calls"
        assert per_char["reasoning"].startswith("The user wants")
    else:
        assert per_char["content"] == TOOL_TEXT and per_char["finish"] == "stop"


def test_completion_stream_merged(model):
    text = 'Once "upon" a — time\n\x01'
    runs = []
    for cuts in (list(range(1, len(text))), [], [5, 6]):
        job = Job([1, 2], SamplingParams(max_tokens=50), include_usage=True)
        objs = sse_objects(stream(model, render.completion_stream, job,
                                  outputs(text, cuts, "length")))
        assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == len(text)
        body = objs[:-1]
        assert [o["choices"][0]["finish_reason"] for o in body] == \
            [None] * (len(body) - 1) + ["length"]
        assert all(o["object"] == "text_completion" and o["usage"] is None for o in body)
        runs.append("".join(o["choices"][0]["text"] for o in body))
        assert len(body) == len(cuts) + 1
    assert runs == [text] * 3


def test_ollama_stream_merged(model):
    def run(cuts):
        state = SimpleNamespace(model_id="m", metrics=Metrics())
        job = Job([1, 2], SamplingParams(max_tokens=50))
        gen = render.Gen(state, job, "ollama_generate")

        async def agen():
            for o in outputs("Once upon a time", cuts, "length"):
                yield o
        gen.agen = agen()
        lines = [json.loads(x) for x in asyncio.run(_drain(ollama._stream(
            state, model, job, gen, "generate", 0.0)))]
        assert lines[-1]["done"] and lines[-1]["eval_count"] == 16
        assert not any(x["done"] for x in lines[:-1])
        return "".join(x["response"] for x in lines), len(lines)

    assert run([]) == ("Once upon a time", 2)
    assert run(list(range(1, 16))) == ("Once upon a time", 17)


def test_serve_bench_smoke():
    """The benchmark end to end on the bundled model: 2 streams over 2 client processes; the
    token count comes from the streams' usage."""
    r = subprocess.run([sys.executable, "benchmarks/serve_bench.py", "stories260K", "--clients",
                        "2", "--tokens", "5", "--procs", "2", "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (res,) = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["clients"] == 2 and res["output_tokens"] == 10 and res["output_tok_s"] > 0
    assert 1 <= res["streamed_pieces"] <= 10 and res["ttft_p50_s"] > 0
