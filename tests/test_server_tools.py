"""Tool-call parsers and the reasoning split: whole-text results, and the same events whatever
the streaming split (fuzzed)."""

import json
import random

import pytest

from mlxr.server.tools import OutputSplitter, ReasoningSplitter, detect_family, parse_all


def stream(text, family, reasoning=False, start=False, seed=0, tools=True):
    rng = random.Random(seed)
    sp = OutputSplitter(family, reasoning, start, tools=tools)
    evs, i = [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        evs += sp.feed(text[i:i + k])
        i += k
    evs += sp.flush()
    content = "".join(e[1] for e in evs if e[0] == "content")
    thought = "".join(e[1] for e in evs if e[0] == "reasoning")
    calls = {}
    for e in evs:
        if e[0] == "call":
            calls[e[1]] = {"id": e[2], "name": e[3], "arguments": ""}
        elif e[0] == "args":
            calls[e[1]]["arguments"] += e[2]
    return content, thought, [calls[i] for i in sorted(calls)]


CASES = [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"units": {"t": "c"}}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}'
               "\n</tool_call>", "Sure.",
     [("get_weather", {"city": "Paris", "units": {"t": "c"}}), ("f", {})]),
    ("hermes", '<tool_call>{"arguments": {"x": "}{\\"]"}, "name": "g"}</tool_call>', "",
     [("g", {"x": '}{"]'})]),
    ("hermes", "no tools here, just <tool text", "no tools here, just <tool text", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3", '{"name": "search", "parameters": {"q": "a b"}}', "", [("search", {"q": "a b"})]),
    ("llama3", '<|python_tag|>{"name": "s", "parameters": {"q": 1}}; {"name": "t", '
               '"parameters": {}}', "", [("s", {"q": 1}), ("t", {})]),
    ("llama3", "{not a call} text", "{not a call} text", []),
    ("llama3", "Hello there", "Hello there", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"k": [1, 2]}}, {"name": "b", '
                '"arguments": {"s": "x"}}]', "", [("a", {"k": [1, 2]}), ("b", {"s": "x"})]),
    ("mistral", '[TOOL_CALLS]lookup[ARGS]{"id": 3}', "", [("lookup", {"id": 3})]),
    ("mistral", "Plain answer.", "Plain answer.", []),
]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_tool_parsers(family, text, content, calls):
    c, _, got = parse_all(text, family)
    assert c.strip() == content
    assert [(g["name"], json.loads(g["arguments"])) for g in got] == calls
    for seed in range(25):
        c2, _, got2 = stream(text, family, seed=seed)
        assert c2.strip() == content, seed
        assert [(g["name"], json.loads(g["arguments"])) for g in got2] == calls, seed
        assert all(g["id"].startswith("call_") for g in got2)


def test_reasoning_split():
    text = "<think>\nLet me think: 2+2.\n</think>\n\nThe answer is 4."
    for seed in range(20):
        c, r, _ = stream(text, None, reasoning=True, seed=seed, tools=False)
        assert c == "The answer is 4." and r.strip() == "Let me think: 2+2."
    # the prompt opened the block already
    c, r, _ = stream("thinking...</think>Done", None, reasoning=True, start=True, tools=False)
    assert (c, r) == ("Done", "thinking...")
    # a later <think> is content
    c, r, _ = stream("Hi <think>x</think>", None, reasoning=True, tools=False)
    assert c == "Hi <think>x</think>" and r == ""
    # an unfinished block stays reasoning
    sp = ReasoningSplitter()
    assert sp.feed("<think>abc") + sp.flush() == [("reasoning", "abc")]


def test_reasoning_then_tools():
    text = '<think>need weather</think><tool_call>{"name": "w", "arguments": {"c": 1}}</tool_call>'
    c, r, calls = stream(text, "hermes", reasoning=True, seed=3)
    assert c == "" and r == "need weather" and calls[0]["name"] == "w"


def test_fuzz_never_raises():
    rng = random.Random(1)
    alphabet = list('{}[]",:\\ abn') + ["<tool_call>", "</tool_call>", '"name"', '"arguments"',
                                        "[TOOL_CALLS]", "[ARGS]", "<think>", "</think>"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for fam in ("hermes", "llama3", "mistral"):
            stream(text, fam, reasoning=True, seed=rng.randint(0, 99))


def test_detect_family(assets):
    d = assets / "chat-templates" / "llamacpp-jinja"
    assert detect_family((d / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()) == "hermes"
    assert detect_family((d / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()) == "llama3"
    assert detect_family((d / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()) == \
        "mistral"
    assert detect_family("{{ messages }}") is None
