"""Helpers for the server tests: chat-capable copies of the bundled model and a real `mlxr serve`
process on an ephemeral loopback port."""

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BUNDLED = Path(__file__).resolve().parents[1] / "mlxr" / "bundled" / "stories260K"


def model_without_template(tmp: Path, name: str) -> Path:
    """A copy of the bundled story model without its chat template (a plain base model)."""
    d = tmp / name
    shutil.copytree(BUNDLED, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return d


def model_with_template(tmp: Path, name: str, template: str) -> Path:
    """A copy of the bundled story model whose tokenizer_config carries `template` (in place of
    the bundled chat_template.jinja, which would take precedence)."""
    d = model_without_template(tmp, name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    # tool prompts outgrow 512 tokens with this byte-level vocabulary; RoPE runs past it fine
    conf = json.loads((d / "config.json").read_text())
    conf["max_position_embeddings"] = 16384
    (d / "config.json").write_text(json.dumps(conf))
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path | str | None, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlxr", "serve"] + ([str(model)] if model else [])
        cmd += ["--port", str(self.port), "--log-level", "warning", "--dtype", "float32", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1], env=env)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read().decode()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metric(self, name: str, **headers) -> float:
        text = httpx.get(self.url + "/metrics", headers=headers).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)
