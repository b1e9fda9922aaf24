"""`mlxr serve` end to end with the official openai client (sync and async, streaming and not),
against a real server process on loopback serving the bundled story model with a Qwen2.5
(tool-capable, ChatML) chat template."""

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest
from test_server_helpers import Server, model_with_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                              "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}
MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, assets):
    tpl = (assets / "chat-templates/llamacpp-jinja/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    model = model_with_template(tmp_path_factory.mktemp("m"), "story-chat", tpl)
    s = Server(model, "--max-num-seqs", "32", "--max-queued", "256",
               "--max-num-batched-tokens", "1024")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="story-chat", **kw)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == ["story-chat"]
    assert client.models.retrieve("story-chat").id == "story-chat"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_chat_stream_matches_whole(client):
    whole = chat(client)
    msg = whole.choices[0]
    assert whole.object == "chat.completion" and msg.message.role == "assistant"
    assert msg.finish_reason in ("stop", "length") and msg.message.content
    u = whole.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == msg.finish_reason and not any(finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == msg.message.content


def test_completions(client):
    r = client.completions.create(model="story-chat", prompt="Once upon a time", max_tokens=16,
                                  temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 16 and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    s = list(client.completions.create(model="story-chat", prompt="Once upon a time",
                                       max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(x.choices[0].text for x in s if x.choices) == c.text
    assert s[-1].usage.completion_tokens == 16


def test_responses(client):
    r = client.responses.create(model="story-chat", input="Tell me a story.",
                                max_output_tokens=20, temperature=0)
    assert r.status == "incomplete" and r.output_text and r.usage.output_tokens == 20
    events = list(client.responses.create(model="story-chat", input="Tell me a story.",
                                          max_output_tokens=20, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        r.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_tools(client, choice):
    r = chat(client, tools=[WEATHER], tool_choice=choice, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(chat(client, tools=[WEATHER], tool_choice=choice, max_tokens=64, stream=True))
    calls = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            d = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            d["name"] += tc.function.name or ""
            d["arguments"] += tc.function.arguments or ""
            if tc.id:
                d["id"] = tc.id
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call goes back in as history with its result
    follow = chat(client, tools=[WEATHER], messages=MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.content is not None


def test_responses_tools(client):
    r = client.responses.create(model="story-chat", input="Weather in Paris?",
                                tools=[{"type": "function", **WEATHER["function"]}],
                                tool_choice="required", max_output_tokens=64)
    fc = next(o for o in r.output if o.type == "function_call")
    assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] in ("Paris", "Rome")


def test_json_schema(client):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}
    r = chat(client, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                               "strict": True}})
    d = json.loads(r.choices[0].message.content)
    assert set(d) == {"name", "age"} and 0 <= d["age"] <= 120 and len(d["name"]) <= 10


def test_chat_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 8 and all(len(t.top_logprobs) == 3 for t in lp)
    assert "".join(t.token for t in lp) == r.choices[0].message.content
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in lp)


def test_multi_turn_cached_tokens(client):
    msgs = [{"role": "system", "content": "You tell short stories about animals. " * 4},
            {"role": "user", "content": "A story about a dog."}]
    first = chat(client, messages=msgs, max_tokens=16)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And a cat?"}]
    second = chat(client, messages=msgs, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_and_seed(client):
    text = chat(client, max_tokens=32).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    r = chat(client, max_tokens=32, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]
    a = chat(client, temperature=1.0, seed=7, max_tokens=24).choices[0].message.content
    b = chat(client, temperature=1.0, seed=7, max_tokens=24).choices[0].message.content
    c = chat(client, temperature=1.0, seed=8, max_tokens=24).choices[0].message.content
    assert a == b and a != c


def test_errors_map_to_client_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=10 ** 6)
    with pytest.raises(openai.BadRequestError):
        chat(client, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSGS)
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def _stream(aclient, content, max_tokens=24):
    s = await aclient.chat.completions.create(
        model="story-chat", messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])


def test_async_and_concurrency(aclient, server):
    prompts = [f"Story number {i} about a {w}." for i, w in
               enumerate(["cat", "dog", "bird", "fish"] * 8)]

    async def main():
        whole = await aclient.chat.completions.create(
            model="story-chat", messages=MSGS, max_tokens=12, temperature=0)
        assert whole.choices[0].message.content == await _stream(aclient, MSGS[0]["content"], 12)
        alone = [await _stream(aclient, p) for p in prompts[:8]]
        together = await asyncio.gather(*[_stream(aclient, p) for p in prompts])
        return alone, together
    alone, together = asyncio.run(main())
    assert len(together) == 32 and all(together)
    assert together[:8] == alone


def test_non_streaming_disconnect_cancels(server):
    """A non-streaming client that gives up is cancelled too: its blocks are freed at once and
    the request counts as cancelled, instead of generating max_tokens for nobody."""
    key = 'mlxr_requests_total{route="chat",outcome="cancelled"}'

    def cancelled():
        try:
            return server.metric(key)
        except KeyError:
            return 0.0

    before = cancelled()
    body = {"model": "story-chat", "messages": MSGS, "max_tokens": 16000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    t = time.time()
    while (server.metric("mlxr_kv_cache_blocks_used") > 0 or cancelled() == before) \
            and time.time() < t + 10:
        time.sleep(0.05)
    assert server.metric("mlxr_kv_cache_blocks_used") == 0
    assert cancelled() == before + 1
    assert time.time() - t < 5  # aborted, not run to max_tokens


def test_disconnect_frees_blocks(server):
    body = {"model": "story-chat", "messages": MSGS, "max_tokens": 16000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()  # (a dropped iterator closes the response)
        for _ in range(8):
            next(lines)
        assert server.metric("mlxr_kv_cache_blocks_used") > 0
        t = time.time()
    deadline = t + 10
    while server.metric("mlxr_kv_cache_blocks_used") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("mlxr_kv_cache_blocks_used") == 0
    assert server.metric("mlxr_num_requests_running") == 0
    assert time.time() - t < 5  # aborted, not run to max_tokens


def test_metrics(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("mlxr_num_requests_running", "mlxr_time_to_first_token_seconds_bucket",
                 "mlxr_time_per_output_token_seconds_count", "mlxr_prompt_tokens_total",
                 "mlxr_generation_tokens_total", "mlxr_prefix_cache_hit_rate",
                 "mlxr_kv_cache_usage_ratio"):
        assert name in text


def test_bounded_load(server, capsys):
    n, conc = 48, 8
    lat = []

    async def one(c, i):
        t = time.perf_counter()
        r = await c.post("/v1/completions", json={"prompt": f"Tom had {i} apples",
                                                  "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        lat.append(time.perf_counter() - t)

    async def main():
        sem = asyncio.Semaphore(conc)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def guarded(i):
                async with sem:
                    await one(c, i)
            t = time.perf_counter()
            await asyncio.gather(*[guarded(i) for i in range(n)])
            return time.perf_counter() - t
    wall = asyncio.run(main())
    lat.sort()
    with capsys.disabled():
        print(f"\nload: {n} requests, {conc} concurrent: {n / wall:.1f} req/s, "
              f"p50 {statistics.median(lat) * 1000:.0f} ms, "
              f"p99 {lat[min(n - 1, int(n * 0.99))] * 1000:.0f} ms")
    assert len(lat) == n and wall < 120
