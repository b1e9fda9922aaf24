"""The Hugging Face Hub side of the model store: `pull` and `search`, through huggingface_hub.

`pull` writes the standard cache layout (`blobs/<etag>`, `snapshots/<commit>/<file>` symlinks,
`refs/<revision>`), so every other tool sees what mlxr downloaded and the other way round. It uses
huggingface_hub for everything on the wire (repo info, file metadata, the resumable HTTP GET with
its retries, auth headers, error types) and adds what `hf_hub_download` does not do:

- resume across runs: a download in progress is `blobs/<etag>.incomplete`, kept when the
  transfer fails or is interrupted, and continued with an HTTP Range request by the next pull
  (huggingface_hub itself only resumes within one call);
- SHA-256 verification of every LFS (weight) file against the Hub's metadata before it enters the
  cache (a mismatching file is deleted);
- a free-space check before the first byte, one progress bar per file plus a total bar.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

from .. import bounded_json
from ..errors import MlxrError, ModelFormatError
from ..names import expand_alias
from .local import explain_unsupported, hub_cache, human, local_snapshot, repo_dir

DEFAULT_ENDPOINT = "https://huggingface.co"

# The files a model needs: config, tokenizer, weights (+ small docs).
WANTED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
          "added_tokens.json", "chat_template.jinja", "chat_template.json", "*.safetensors",
          "model.safetensors.index.json", "README.md", "LICENSE*", "*.tiktoken"]
DISK_MARGIN = 64 << 20  # keep this much free beyond the download


class ChecksumError(MlxrError):
    """A downloaded file's SHA-256 differs from the Hub's LFS metadata."""


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.upper() in {"1", "ON", "YES", "TRUE"} or constants.is_offline_mode()


def check_reachable(timeout: float = 3.0) -> None:
    """Fail fast, in one line, when the Hub's host cannot be reached at all (no network, no DNS,
    nothing listening): huggingface_hub retries connection errors five times with backoff, ~25 s
    of waiting before the same answer. Skipped behind a proxy, which does the connecting."""
    proxies = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
    if any(os.environ.get(k) or os.environ.get(k.lower()) for k in proxies):
        return
    url = urlparse(endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise MlxrError(f"cannot reach the Hugging Face Hub at {endpoint()} ({e}); check the "
                        "connection, or set HF_HUB_OFFLINE=1 to use cached models only") from None


def wanted(filename: str) -> bool:
    return "/" not in filename and any(fnmatch(filename, pat) for pat in WANTED)


def _httpx():
    """The HTTP client module huggingface_hub uses (httpx2 since 2.x, httpx in 1.x)."""
    try:
        import httpx2
    except ImportError:  # pragma: no cover - huggingface_hub 1.x
        import httpx as httpx2
    return httpx2


def _net_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for HTTP status errors and network failures."""
    return (_httpx().HTTPError, OSError)  # HfHubHTTPError and OfflineModeIsEnabled are OSErrors


def hub_error(e: Exception, name: str) -> MlxrError:
    """A huggingface_hub / HTTP exception -> one user-readable MlxrError."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = name.split("@")[0]
    url = f"{endpoint()}/{repo}"
    login = "log in with `hf auth login` or set HF_TOKEN"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError):
        return MlxrError(f"{name} is gated: accept its terms at {url} with your account, "
                         f"then {login}")
    if isinstance(e, RevisionNotFoundError):
        return MlxrError(f"{name}: revision not found in {repo} (see {url}/tree/main)")
    if isinstance(e, RepositoryNotFoundError) and status == 401:
        if get_token():
            return MlxrError(f"{name}: unauthorized (401): not found, or your token has no "
                             f"access to it ({url})")
        return MlxrError(f"{name}: unauthorized (401): no such model, or it is private or "
                         f"gated ({url}); check the name (`mlxr search`) or {login}")
    if isinstance(e, RepositoryNotFoundError) or status == 404:
        return MlxrError(f"{name}: model not found on the Hub ({url}); check the name "
                         f"(`mlxr search`), or if it is private, {login}")
    if status == 401:
        if get_token():
            return MlxrError(f"{name}: unauthorized (401): the Hub rejected your token; "
                             f"check HF_TOKEN or `hf auth login`")
        return MlxrError(f"{name}: unauthorized (401): the model is private or gated; {login}")
    if status == 403:
        return MlxrError(f"{name}: forbidden (403): your token has no read access to {repo}")
    if isinstance(e, OfflineModeIsEnabled):
        return MlxrError(f"{name}: HF_HUB_OFFLINE is set: no Hub access (unset it to download)")
    if isinstance(e, (_httpx().TransportError, ConnectionError)):
        return MlxrError(f"cannot reach the Hugging Face Hub at {endpoint()} "
                         f"({type(e).__name__}: {e}); check the connection, or set "
                         "HF_HUB_OFFLINE=1 to use cached models only")
    if isinstance(e, HfHubHTTPError):
        return MlxrError(f"{name}: Hub error: {str(e).strip().splitlines()[0]}")
    return MlxrError(f"{name}: {type(e).__name__}: {e}")


@dataclass
class PullResult:
    path: Path
    downloaded: list[str]  # files fetched by this pull (empty: already complete)
    architecture: str
    quantization: str


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _progress_classes(total: int, initial: int, show: bool):
    """(per-file tqdm class for http_get, total bar) -- huggingface_hub's tqdm, so that
    HF_HUB_DISABLE_PROGRESS_BARS and non-TTY output are honoured."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    disable = (False if os.environ.get("TQDM_POSITION") == "-1" else None) if show else True
    total_bar = hf_tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc="total",
                        disable=disable, position=0, leave=True)

    class FileBar(hf_tqdm):
        def __init__(self, *a, **kw):
            if not show:
                kw["disable"] = True
            kw.setdefault("position", 1)
            kw.setdefault("leave", False)
            super().__init__(*a, **kw)

        def update(self, n=1):
            total_bar.update(n)
            return super().update(n)

    return FileBar, total_bar


def _reporting(bar_class, report: Callable[[int], None]):
    """`bar_class`, also telling `report` the bytes of the file present after each update (a
    disabled tqdm bar does not count them itself)."""

    class ReportingBar(bar_class):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.present = kw.get("initial") or 0  # http_get starts a resumed file there
            report(self.present)

        def update(self, n=1):
            self.present += n or 0
            report(self.present)
            return super().update(n)

    return ReportingBar


def _link(blob: Path, pointer: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks (some Windows setups): copy, as huggingface_hub does
        shutil.copyfile(blob, pointer)


def _fetch(repo_id: str, commit: str, filename: str, sha256: str | None, name: str,
           bar_class, log) -> None:
    """One file into blobs/ + snapshots/<commit>/, resuming a previous partial download."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    ep = endpoint()
    storage = repo_dir(repo_id)
    url = hf_hub_url(repo_id, filename, revision=commit, endpoint=ep)
    meta = get_hf_file_metadata(url, endpoint=ep)
    if not meta.etag or not meta.commit_hash:
        raise MlxrError(f"{endpoint()} does not answer like the Hugging Face Hub (no ETag / "
                        "X-Repo-Commit header); check HF_ENDPOINT")
    blob = storage / "blobs" / meta.etag
    partial = blob.with_name(meta.etag + ".incomplete")
    lock = hub_cache() / ".locks" / storage.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists() and sha256 is not None and sha256_file(blob) != sha256:
            blob.unlink()  # corrupt blob from an earlier run or another tool: fetch it again
        if not blob.exists():
            headers = build_hf_headers()
            if urlparse(meta.location).netloc != urlparse(url).netloc:
                headers.pop("authorization", None)  # signed CDN URL: the token stays on the Hub
            fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o666)
            with os.fdopen(fd, "r+b") as f:
                have = f.seek(0, os.SEEK_END)
                if meta.size is not None and have > meta.size:
                    f.truncate(0)
                    have = f.seek(0)
                if have:
                    log(f"  resuming {filename} at {human(have)}")
                http_get(meta.location, f, resume_size=have, headers=headers,
                         expected_size=meta.size, displayed_filename=filename,
                         tqdm_class=bar_class)
            if sha256 is not None and (got := sha256_file(partial)) != sha256:
                partial.unlink()
                raise ChecksumError(
                    f"{name}: {filename} failed SHA-256 verification (expected {sha256}, got "
                    f"{got}); the file was deleted, run `mlxr pull {name}` again")
            os.replace(partial, blob)
    _link(blob, storage / "snapshots" / commit / filename)


def pull(name: str, *, show_progress: bool = True, log=None,
         progress: Callable[[str, str, int, int], None] | None = None) -> PullResult:
    """Download (or complete) model `ORG/REPO[@REV]` (or an alias, see mlxr.names) into the HF
    cache, verify and validate it.
    `progress(filename, digest, total, completed)` hears each file's bytes as they arrive (the
    server's /api/pull streams them); `digest` is "sha256:<hex>" for weight (LFS) files and
    "sha1:<git blob id>" for the others, the ids the Hub gives."""
    from huggingface_hub import HfApi

    from ..config import SUPPORTED
    from .local import parse_name

    if log is None:
        from huggingface_hub.utils import tqdm as hf_tqdm

        def log(msg):  # above the progress bars
            hf_tqdm.write(msg, file=sys.stderr)
    name = expand_alias(name)
    parsed = parse_name(name)
    if parsed is None:
        raise MlxrError(f"{name!r} is not a Hub model name (ORG/REPO[@REVISION])")
    repo_id, revision = parsed
    if offline():
        snap = local_snapshot(repo_id, revision)
        if snap is None:
            raise MlxrError(f"{name}: not in the local cache ({hub_cache()}) and HF_HUB_OFFLINE "
                            "is set: unset HF_HUB_OFFLINE to download it")
        log(f"{name}: HF_HUB_OFFLINE is set; using the cached copy (not checked for updates)")
        return _finish(name, snap, [], log)

    check_reachable()
    try:
        info = HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision,
                                                     files_metadata=True)
    except _net_errors() as e:
        raise hub_error(e, name) from None
    commit = info.sha
    if not commit or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise MlxrError(f"{endpoint()}: no commit id for {name}; check HF_ENDPOINT")
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = sorted(f for f in siblings if wanted(f))

    # Say what is wrong before downloading gigabytes we cannot run.
    names = list(siblings)
    if not any(f.endswith(".safetensors") for f in files):
        gguf = [f for f in names if f.lower().endswith(".gguf")]
        pt = [f for f in names if re.search(r"\.(bin|pt|pth)$", f)]
        kind = ("a GGUF repo (llama.cpp format)" if gguf else
                "PyTorch pickle weights only (.bin)" if pt else "no *.safetensors weights")
        raise ModelFormatError(f"{name}: {kind}; mlxr runs MLX / safetensors checkpoints "
                               "(mlx-community repos): find one with `mlxr search`")
    mt = (info.config or {}).get("model_type") if isinstance(info.config, dict) else None
    if mt is not None and mt not in SUPPORTED:
        raise ModelFormatError(f"{name}: architecture {mt!r} is not supported (mlxr runs "
                               f"{', '.join(SUPPORTED)}); pick an MLX conversion of one of those")

    storage = repo_dir(repo_id)
    snap = storage / "snapshots" / commit
    if revision is None or revision != commit:
        ref = storage / "refs" / (revision or "main")
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)

    def size_of(f):
        s = siblings[f]
        return s.lfs.size if s.lfs else (s.size or 0)

    todo = [f for f in files if not (snap / f).exists()]
    if not todo:
        log(f"{name}: up to date ({commit[:12]}, {len(files)} files)")
        return _finish(name, snap, [], log)

    def partial_size(f):
        s = siblings[f]
        etag = s.lfs.sha256 if s.lfs else s.blob_id
        p = storage / "blobs" / f"{etag}.incomplete"
        return p.stat().st_size if etag and p.is_file() else 0

    total = sum(size_of(f) for f in files)
    have = sum(size_of(f) for f in files if f not in todo) + sum(partial_size(f) for f in todo)
    need = total - have
    free = _free_bytes(storage)
    if need + DISK_MARGIN > free:
        raise MlxrError(f"{name}: not enough disk space in {hub_cache()}: needs {human(need)} "
                        f"more, {human(free)} free")
    log(f"pulling {name} ({commit[:12]}): {len(todo)} of {len(files)} files, "
        f"{human(need)} to download")
    bar_class, total_bar = _progress_classes(total, have, show_progress)
    try:
        for f in todo:
            s = siblings[f]
            bars = bar_class
            if progress is not None:
                digest = f"sha256:{s.lfs.sha256}" if s.lfs else f"sha1:{s.blob_id}"
                bars = _reporting(bar_class, partial(progress, f, digest, size_of(f)))
            _fetch(repo_id, commit, f, s.lfs.sha256 if s.lfs else None, name, bars, log)
            if progress is not None:  # also when the blob was already there (no transfer)
                progress(f, digest, size_of(f), size_of(f))
            log(f"  {f:<36} {human(size_of(f)):>10}" + ("  sha256 ok" if s.lfs else ""))
    except _net_errors() as e:
        err = hub_error(e, name)
        status = getattr(getattr(e, "response", None), "status_code", None) or 0
        if isinstance(e, _httpx().TransportError) or status >= 500 or status in (408, 429):
            raise MlxrError(f"{err}\ndownload interrupted; what was received is kept: run "
                            f"`mlxr pull {name}` again to resume") from None
        raise err from None
    finally:
        total_bar.close()
    return _finish(name, snap, todo, log)


def _finish(name, snap, downloaded, log) -> PullResult:
    from ..model import validate
    from .local import quant_summary

    explain_unsupported(snap)
    cfg = validate(snap)
    quant = quant_summary(bounded_json.read_file(snap / "config.json"))
    log(f"{name}: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"context {cfg.context_length}, quantization {quant}")
    log(f"ready: {snap}")
    return PullResult(snap, downloaded, cfg.model_type, quant)


# -- search -------------------------------------------------------------------------------------

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2,
                "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
_QUANT_NAME = re.compile(r"(?i)(?:^|[-_])((?:\d+|mixed[-_]?\d+[-_]\d+)[-_]?bit|bf16|fp16|f16|"
                         r"mxfp4|nvfp4|mxfp8|dwq|awq|fp8)(?=$|[-_])")


@dataclass
class SearchHit:
    repo_id: str
    downloads: int | None
    likes: int | None
    size: int | None  # bytes of weights, estimated from the Hub's safetensors metadata
    quantization: str | None


def search(query: str, *, limit: int = 20, author: str | None = None) -> list[SearchHit]:
    """Hub search limited to MLX-format text-generation repos, most downloaded first."""
    from huggingface_hub import HfApi

    if offline():
        raise MlxrError("HF_HUB_OFFLINE is set: search needs the Hub (see `mlxr list` for "
                        "local models)")
    check_reachable()
    try:
        models = list(HfApi(endpoint=endpoint()).list_models(
            search=query or None, filter="mlx", pipeline_tag="text-generation", author=author,
            sort="downloads", limit=limit,
            expand=["downloads", "likes", "tags", "safetensors", "library_name",
                    "pipeline_tag"]))
    except _net_errors() as e:
        raise hub_error(e, f"search {query!r}") from None
    hits = []
    for m in models:
        size = quant = None
        params = getattr(m.safetensors, "parameters", None) or {}
        if params:
            size = sum(n * _DTYPE_BYTES.get(k.upper(), 2) for k, n in params.items())
        qm = _QUANT_NAME.search(m.id.split("/")[-1])
        if qm:
            quant = qm.group(1).lower()
        elif params:
            quant = "quantized" if "U32" in params else "/".join(sorted(params)).lower()
        hits.append(SearchHit(m.id, m.downloads, m.likes, size, quant))
    return hits
