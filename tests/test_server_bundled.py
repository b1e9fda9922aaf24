"""`mlxr serve` out of the box, on the bundled model as a new user meets it: the log says what
is loading and when it is ready, a model that cannot load stops the server with one line, ports
outside 0-65535 are refused, and every chat API works offline through the bundled model's story
chat template (a base model without a template still gets a 400 that says so)."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_helpers import BUNDLED, Server, free_port, model_without_template

import mlxr

ROOT = Path(__file__).resolve().parents[1]
STORY = "Once upon a time"


class LoggedServer:
    """`mlxr serve` (the bundled model) at log level info, its log lines collected as they come."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxr", "serve", "--port", str(self.port), "--dtype",
             "float32", "--log-level", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, cwd=ROOT)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float = 90) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if text in line:
                    return t
            assert self.proc.poll() is None, "\n".join(x for _, x in self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the log: {self.lines}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server():
    s = LoggedServer()
    try:
        s.wait_for("ready on")
        yield s
    finally:
        s.stop()


def test_log_says_loading_then_ready(server):
    t_loading = server.wait_for("loading stories260K")
    t_ready = server.wait_for(f"ready on http://127.0.0.1:{server.port}")
    assert t_loading <= t_ready
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_pull_and_delete_are_off_by_default(server):
    body = json.dumps({"model": "mlx-community/Qwen3-0.6B-4bit"}).encode()
    r = httpx.post(server.url + "/api/pull", content=body)
    assert r.status_code == 403 and "--allow-pull" in r.json()["error"]
    r = httpx.request("DELETE", server.url + "/api/delete", content=body)
    assert r.status_code == 403 and "--allow-delete" in r.json()["error"]


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_model_that_cannot_load_stops_the_server(tmp_path, engine_process):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(BUNDLED, d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": -4}))
    r = subprocess.run([sys.executable, "-m", "mlxr", "serve", str(d), "--port", str(free_port()),
                        "--engine-process", engine_process], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "config.json" in last and "hidden_size" in last
    assert "loading broken" in r.stderr and "ready on" not in r.stderr


def test_port_outside_range_is_refused():
    """The server side refuses it, whatever the CLI checks: the OS resolver would wrap 99999 to
    34463 (65536 to a random port) and serve there. In a child process: serving would block."""
    code = ("from mlxr.server import run\nfrom mlxr.errors import MlxrError\n"
            "for port in (99999, 65536, -1):\n"
            "    try:\n        run(%r, port=port)\n"
            "    except MlxrError as e:\n        print(e)\n" % str(BUNDLED))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"port {p} is not a TCP port (0-65535)"
                                     for p in (99999, 65536, -1)]


# -- the bundled model's chat template ------------------------------------------------------------

def test_template_is_plain_continuation():
    """One user message renders as the plain completion of its text (same ids); turns are joined
    into one story; system messages are left out. mlx-lm (the oracle) reads the same ids."""
    from mlx_lm import load as mlx_load

    tok = mlxr.load_tokenizer(BUNDLED)
    one = [{"role": "user", "content": STORY}]
    assert tok.apply_chat_template(one, tokenize=True) == tok.encode(STORY)
    turns = [{"role": "system", "content": "Be brief."}, *one,
             {"role": "assistant", "content": " there was a cat. "},
             {"role": "user", "content": "The cat ran."}]
    assert tok.apply_chat_template(turns) == "<s>Once upon a time there was a cat. The cat ran."
    _, ref = mlx_load(str(BUNDLED))
    for msgs in (one, turns):
        assert list(ref.apply_chat_template(msgs, add_generation_prompt=True)) == \
            tok.apply_chat_template(msgs, tokenize=True)


def chat(server, **kw):
    body = dict({"model": "stories260K", "max_tokens": 12, "temperature": 0,
                 "messages": [{"role": "user", "content": STORY}]}, **kw)
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def test_chat_apis_work_out_of_the_box(server):
    plain = httpx.post(server.url + "/v1/completions", json={
        "prompt": STORY, "max_tokens": 12, "temperature": 0}, timeout=60).json()
    r = chat(server)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    r = httpx.post(server.url + "/v1/responses", json={
        "model": "stories260K", "input": STORY, "max_output_tokens": 12, "temperature": 0},
        timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == plain["choices"][0]["text"]
    r = httpx.post(server.url + "/api/chat", json={
        "model": "stories260K", "messages": [{"role": "user", "content": STORY}],
        "stream": False, "options": {"num_predict": 12, "temperature": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == plain["choices"][0]["text"]


def test_structured_output(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    r = chat(server, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "who", "schema": schema}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"name"}


def test_run_one_shot_is_the_story_continuation():
    """`mlxr run` on the bundled model chats through the template: one prompt is continued as
    plain completion would."""
    r = subprocess.run([sys.executable, "-m", "mlxr", "run", "stories260K", STORY, "--temp", "0",
                        "--max", "12"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    model = mlxr.load(BUNDLED, device="cpu")
    want = model.tokenizer.decode(list(model.generate(STORY, max_tokens=12, temperature=0)))
    assert r.stdout.strip() == want.strip()


def test_base_model_without_template_is_400(tmp_path):
    """A model that is not the bundled one and ships no template: no default template is made
    up (a base model has no chat format to guess); chat answers 400 saying so."""
    s = Server(model_without_template(tmp_path, "base"))
    try:
        for path, body in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/responses", {"input": "hi"})):
            r = httpx.post(s.url + path, json=body, timeout=60)
            assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    finally:
        s.stop()
