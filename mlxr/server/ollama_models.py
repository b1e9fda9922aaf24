"""Ollama's model-management routes: `GET /api/tags`, `POST /api/show`, `GET /api/ps`,
`POST /api/pull` and `DELETE /api/delete`, in Ollama's request and response shapes.

/api/tags lists every model this server can load by name (those on its command line, the
bundled ones, the complete Hub models in the cache); /api/ps the loaded ones, with their measured
bytes (weights and KV cache), device and expiry (models_manager.py). Names are mlxr's (a
directory name, the --served-model-name, or a Hub name ORG/REPO[@REV]); Ollama's default tag
":latest" is accepted and dropped.

/api/pull downloads a Hub model into the shared Hugging Face cache (mlxr.store.hub.pull, as
`mlxr pull`) and streams Ollama's NDJSON progress: {"status"} lines, then per file {"status",
"digest", "total", "completed"}, then {"status": "success"} (or an {"error"} line). /api/delete
removes a Hub model from the cache (mlxr.store.local.remove, as `mlxr rm`), never the model being
served. Both change the machine (network, disk), so each is off unless `serve` was started with
its flag: --allow-pull, --allow-delete (separate: letting clients fetch models is not letting
them destroy any). Off, they answer 403 in Ollama's error shape. A pulled model can be loaded
by name right away; a loaded one cannot be deleted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the (string) annotations here

from ..errors import MlxrError
from ..store.local import describe
from .protocol import APIError, _Req, bad_request

# generation_config.json keys -> Ollama's parameter names (/api/show "parameters")
PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "repetition_penalty": "repeat_penalty"}
MAX_LICENSE_CHARS = 64 * 1024
NEVER_EXPIRES = "9999-12-31T23:59:59Z"  # the model stays loaded for the server's lifetime


class NameRequest(_Req):
    model: str = ""
    name: str = ""  # what Ollama clients sent before "model"
    verbose: bool | None = None  # /api/show: nothing more to show
    stream: bool | None = True  # /api/pull
    insecure: bool | None = None  # /api/pull: the Hub is reached over HTTPS regardless


def _name(req: NameRequest) -> str:
    name = (req.model or req.name).removesuffix(":latest")
    if not name:
        raise bad_request("model is required", "model")
    return name


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@cache
def parameter_count(path: Path) -> int:
    """Parameters from the safetensors headers (no weight data read). A packed quantized weight
    (U32) holds 32 / bits values per element; its scales and biases are not parameters."""
    from ..checkpoint import open_checkpoint
    from ..config import load_config

    cfg, _ = load_config(path)
    with open_checkpoint(path) as ckpt:
        tensors = ckpt.tensors
    n = 0
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        packed = tensors.get(module + ".weight")
        if leaf in ("scales", "biases", "global_scale") and packed and packed.dtype == "U32":
            continue
        count = 1
        for d in t.shape:
            count *= d
        if leaf == "weight" and t.dtype == "U32" and cfg.quant is not None:
            spec = cfg.quant.overrides.get(module, cfg.quant.default) or cfg.quant.default
            count = count * 32 // spec.bits
        n += count
    return n


def human_count(n: int) -> str:
    """Ollama's parameter_size style: 8.0B, 596.0M, 260.0K."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


@cache
def digest(path: Path) -> str:
    """An id for the model files, cheap to compute: sha256 over config.json and the weight
    files' names and sizes (mlxr has no Ollama manifest to hash; not a hash of the weights)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def weights_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def details(path: Path, info: dict) -> dict:
    return {"parent_model": "", "format": "mlx", "family": info["architecture"],
            "families": [info["architecture"]],
            "parameter_size": human_count(parameter_count(path)),
            "quantization_level": info["quantization"]}


def _describe(path: Path) -> dict:
    from ..store.local import describe

    try:
        return describe(path)
    except MlxrError as e:
        raise APIError(500, f"cannot read the model: {e}", "server_error") from None


def show(state, path: Path, info: dict) -> dict:
    from ..text.tokenizer import load_chat_template

    arch = info["architecture"]
    gen = {}
    if (path / "generation_config.json").is_file():
        gen = json.loads((path / "generation_config.json").read_text())
    params = "\n".join(f"{PARAMETERS[k]:<24} {gen[k]}" for k in PARAMETERS if k in gen)
    try:
        template = load_chat_template(path)
    except MlxrError:
        template = None
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    lic = next((p for p in sorted(path.glob("LICENSE*")) if p.is_file()), None)
    out = {
        "modelfile": f"# mlxr serves model directories, not Modelfiles\nFROM {path}\n" + "".join(
            f"PARAMETER {line}\n" for line in params.splitlines()),
        "parameters": params,
        "template": template or "",
        "details": details(path, info),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": parameter_count(path),
            f"{arch}.context_length": info["context_length"],
            f"{arch}.embedding_length": info["hidden_size"],
            f"{arch}.block_count": info["layers"],
            f"{arch}.feed_forward_length": info["intermediate_size"],
            f"{arch}.attention.head_count": info["heads"],
            f"{arch}.attention.head_count_kv": info["kv_heads"],
            f"{arch}.attention.key_length": info["head_dim"],
            f"{arch}.vocab_size": info["vocab_size"],
        },
        "capabilities": ["completion"] + (["tools"] if info["tools"] else []) + (
            ["thinking"] if info["thinking"] else []),
        "modified_at": _iso((path / "config.json").stat().st_mtime),
    }
    if lic is not None:
        out["license"] = lic.read_text(errors="replace")[:MAX_LICENSE_CHARS]
    return out


def _cache_name(name: str) -> tuple[str, str | None]:
    from ..store.local import parse_name

    hub = parse_name(name)
    if hub is None:
        raise bad_request(f"{name!r} is not a Hub model name (ORG/REPO[@REVISION])", "model")
    return hub


def _forbidden(flag: str, what: str) -> APIError:
    return APIError(403, f"{what} is disabled on this server (start `mlxr serve` with {flag} to "
                    "allow it)", "permission_error")


async def _pull_lines(name: str):
    """NDJSON progress lines of one pull, from the pulling thread through a queue."""
    from ..store.hub import pull

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(obj: dict) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, obj)

    def work() -> None:
        try:
            pull(name, show_progress=False, log=lambda msg: put({"status": msg.strip()}),
                 progress=lambda f, dg, total, done: put({"status": f"pulling {f}", "digest": dg,
                                                         "total": total, "completed": done}))
            put({"status": "success"})
        except (MlxrError, OSError) as e:
            put({"error": str(e).splitlines()[0]})
        except Exception as e:  # noqa: BLE001 -- the stream ends with an error line
            put({"error": f"pull failed: {type(e).__name__}: {e}"})

    yield {"status": "pulling manifest"}
    task = asyncio.ensure_future(asyncio.to_thread(work))
    while True:
        obj = await queue.get()
        yield obj
        if "error" in obj or obj.get("status") == "success":
            break
    await task


def local_models(state) -> list[tuple[str, Path]]:
    """Every model this server can load by name: those named on its command line, then the
    bundled ones, then the Hub models pulled into the cache (complete ones)."""
    from ..names import bundled_models
    from ..store.local import list_local

    out = dict(state.pinned)
    seen = {p.resolve() for p in out.values()}
    for p in bundled_models():
        if p.resolve() not in seen:
            out.setdefault(p.name, p)
    for m in list_local():
        if m.status == "ok" and m.path.resolve() not in seen:
            out.setdefault(m.name, m.path)
    return list(out.items())


def register(app, state, parse_body) -> None:
    """Add the model-management routes to `app`; `parse_body(cls, body: bytes)` is app.py's
    validating parser. APIErrors raised here are answered in Ollama's shape by app.py's handler
    (as on every /api/ path)."""
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    async def parse(request: Request) -> NameRequest:
        return parse_body(NameRequest, await request.body())

    def tag(name: str, path: Path) -> dict | None:
        try:
            info = describe(path)
        except MlxrError:
            return None  # unreadable or unsupported: not offered
        return {"name": name, "model": name, "modified_at": _iso(
                    (path / "config.json").stat().st_mtime), "size": weights_size(path),
                "digest": digest(path), "details": details(path, info)}

    @app.get("/api/tags")
    async def tags():
        return {"models": [t for t in await asyncio.to_thread(
            lambda: [tag(n, p) for n, p in local_models(state)]) if t]}

    @app.post("/api/show")
    async def show_route(request: Request):
        req = await parse(request)
        mid, path = state.models.resolve(_name(req))
        return show(state, path, _describe(path))

    @app.get("/api/ps")
    async def ps():
        out = []
        for e in state.models.loaded():
            info = _describe(e.path)
            expires = e.expires_at
            out.append({"name": e.model_id, "model": e.model_id, "size": e.size,
                        "digest": digest(e.path), "details": details(e.path, info),
                        "expires_at": NEVER_EXPIRES if expires is None else _iso(expires),
                        "size_vram": e.size if e.device == "cuda" else 0,
                        "context_length": info["context_length"],
                        # mlxr's own: where the bytes are and how long the load took
                        "device": e.device, "weights_bytes": e.weights_bytes,
                        "kv_cache_bytes": e.kv_cache_bytes,
                        "load_seconds": round(e.load_seconds, 3)})
        return {"models": out}

    @app.post("/api/pull")
    async def pull_route(request: Request):
        req = await parse(request)
        name = _name(req)
        if not state.allow_pull:
            raise _forbidden("--allow-pull", "pulling models")
        _cache_name(name)
        lines = _pull_lines(name)
        if req.stream is False:
            last = {}
            async for last in lines:
                pass
            if "error" in last:
                return JSONResponse(last, 500)
            return last
        return StreamingResponse((json.dumps(x) + "\n" async for x in lines),
                                 media_type="application/x-ndjson")

    @app.delete("/api/delete")
    async def delete_route(request: Request):
        from ..store.local import remove, repo_dir

        req = await parse(request)
        name = _name(req)
        if not state.allow_delete:
            raise _forbidden("--allow-delete", "deleting models")
        repo_id, revision = _cache_name(name)
        root = repo_dir(repo_id)
        if not root.is_dir():
            raise APIError(404, f"model {name!r} not found")
        if any(root.resolve() in e.path.resolve().parents for e in state.models.loaded()):
            raise APIError(409, f"model {name!r} is loaded: this server is serving it "
                           "(`mlxr stop` it first)")
        try:
            await asyncio.to_thread(remove, repo_id, revision)
        except MlxrError as e:
            raise APIError(404, str(e)) from None
        return Response(status_code=200)
