"""The request half of mlxr's fuzzer (tests/fuzz_hostile.py has the folders and the shared
worker plumbing): the bundled model served in-process (ASGI, AsyncEngine) in a worker process
gets mutated bodies on every generation route, in concurrent batches beside a valid canary
request. Outcomes by status class; a 5xx, a hang or a failed canary is a finding.

    python tests/fuzz_requests.py requests N SEED    # one JSON summary line on stdout
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

from fuzz_hostile import CASE_TIMEOUT, DEEP, HERE, ROOT, _dumps, _limit_memory, _mutate_tree

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "Once", "max_tokens": 3},
    "/v1/responses": {"input": "Once", "max_output_tokens": 3},
    "/api/chat": {"model": "m", "messages": [{"role": "user", "content": "Once"}],
                  "stream": False, "options": {"num_predict": 3}},
    "/api/generate": {"model": "m", "prompt": "Once", "stream": False,
                      "options": {"num_predict": 3}},
}
FIELDS = {
    "temperature": [1e-300, -1, 1e300, 2], "top_p": [0, 10**400, 1e-300], "top_k": [-1, 2**63],
    "seed": [-1, 2**70], "stop": [[""] * 100, 7, ["x" * 5000]], "logit_bias": [{"x": 1},
                                                                               {"1": 1e300}],
    "tools": [[{"type": "function"}], "x",
              [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]],
    "tool_choice": [{"type": "function", "function": "f"}, 7, "required"],
    "chat_template_kwargs": [{"chat_template": "{{ 1 }}"}, {"tokenize": True}, {"tools": 1},
                             {"x": DEEP}, "x"],
    "response_format": [{"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}},
                        {"type": "json_object"}, 5],
    "messages": [[{"role": "assistant", "content": "", "tool_calls": "x"}],
                 [{"role": "assistant", "tool_calls": [{"function": "f"}]}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": "\ud800"}], []],
    "input": [[{"role": "user", "content": 5}], ["x"], [{"type": "function_call", "name": 7}]],
    "text": [{"format": "json"}, {"format": {"type": "json_schema", "schema": 5}}],
    "max_tokens": [2**40, 0, -5], "logprobs": [True, 99], "top_logprobs": [30, 5],
    "options": [{"num_predict": -2, "temperature": 1e-300}, {"top_k": "x"}, 7],
}


def _mutate_body(route: str, rng: random.Random) -> bytes:
    body = json.loads(json.dumps(ROUTES[route]))
    r = rng.random()
    if r < 0.55:
        for key in rng.sample(list(FIELDS), rng.randint(1, 3)):
            body[key] = rng.choice(FIELDS[key])
    elif r < 0.85:
        body = _mutate_tree(body, rng, rng.randint(1, 3))
    raw = _dumps(body).encode()
    if r >= 0.85:
        cut = rng.choice(["truncate", "deep", "surrogate", "garbage", "number"])
        raw = {"truncate": raw[:rng.randrange(len(raw))],
               "deep": b'{"x": ' + b"[" * 2000 + b"]" * 2000 + b"}",
               "surrogate": raw.replace(b"Once", b"\\udc80"),
               "garbage": bytes(rng.randrange(256) for _ in range(64)),
               "number": raw.replace(b"3", b"9" * 500, 1)}[cut]
    return raw


def _worker_requests(n: int, seed: int) -> None:
    """Worker: serve the bundled model in-process and fuzz its ASGI app; print the summary."""
    import asyncio

    import httpx

    from mlxr.server import SecurityConfig, ServerState, create_app

    bundled = ROOT / "mlxr" / "bundled" / "stories260K"
    state = ServerState(bundled, "m", {"max_num_seqs": 8}, {"device": "cpu",
                                                             "dtype": "float32"}, "off")
    app = create_app(state, SecurityConfig(), load_in_background=False)
    state.load()
    rng = random.Random(seed)
    tally: dict[str, int] = {}
    findings: list = []

    async def one(client, route: str, raw: bytes) -> int:
        r = await client.post(route, content=raw, headers={"Content-Type": "application/json"})
        return r.status_code

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     timeout=CASE_TIMEOUT) as client:
            done = 0
            while done < n:
                batch = [(route, _mutate_body(route, rng))
                         for route in rng.choices(list(ROUTES), k=min(7, n - done))]
                canary = ("/v1/completions", json.dumps(ROUTES["/v1/completions"]).encode())
                try:
                    codes = await asyncio.wait_for(asyncio.gather(
                        *(one(client, r, b) for r, b in [*batch, canary]),
                        return_exceptions=True), CASE_TIMEOUT)
                except TimeoutError:
                    tally["hang"] = tally.get("hang", 0) + len(batch)
                    findings.append({"hang": [r for r, _ in batch]})
                    done += len(batch)
                    continue
                for (route, raw), code in zip(batch, codes):
                    key = (f"{code // 100}xx" if isinstance(code, int)
                           else f"exception {type(code).__name__}")
                    tally[key] = tally.get(key, 0) + 1
                    if not isinstance(code, int) or code >= 500:
                        findings.append({"route": route, "status": str(code),
                                         "body": raw[:300].decode("utf-8", "replace")})
                if codes[-1] != 200:
                    findings.append({"canary": str(codes[-1])})
                tally["canary ok"] = tally.get("canary ok", 0) + (codes[-1] == 200)
                done += len(batch)

    start = time.monotonic()
    asyncio.run(main())
    print(json.dumps({"kind": "requests", "tried": n, "seed": seed, "outcomes": tally,
                      "findings": findings, "seconds": round(time.monotonic() - start, 1)}))


def fuzz_requests(n: int, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    timeout = 120 + n * 2.0
    try:
        p = subprocess.run([sys.executable, __file__, "worker-requests", str(n), str(seed)],
                           capture_output=True, text=True, env=env, timeout=timeout,
                           preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return {"kind": "requests", "tried": n, "seed": seed, "outcomes": {"hang": 1},
                "findings": ["the request worker ran past its timeout"]}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"kind": "requests", "tried": n, "seed": seed, "outcomes": {"crash": 1},
                "findings": [f"worker exit {p.returncode}: {p.stderr[-2000:]}"]}
    return json.loads(lines[-1])


if __name__ == "__main__":
    if sys.argv[1] == "worker-requests":
        _worker_requests(int(sys.argv[2]), int(sys.argv[3]))
    else:
        print(json.dumps(fuzz_requests(int(sys.argv[2]), int(sys.argv[3]))))
