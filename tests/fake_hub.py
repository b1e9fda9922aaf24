"""A fake Hugging Face Hub on loopback: the subset of the Hub API that huggingface_hub uses for
model info, file metadata/download and model search, with fault injection for tests.

Endpoints (as huggingface_hub calls them, see hf_api.model_info / list_models and
file_download.get_hf_file_metadata / http_get):

- GET  /api/models/{repo}[/revision/{rev}][?blobs=true] -> {id, sha, siblings[+lfs], config...}
- GET  /api/models?search=&filter=&pipeline_tag=&author=&limit=&expand= -> [{id, ...}]
- HEAD/GET /{repo}/resolve/{rev}/{file} -> X-Repo-Commit, ETag (git blob id) or X-Linked-Etag
  (LFS sha256) + X-Linked-Size, Content-Length, Accept-Ranges; GET honours `Range: bytes=N-`.

Errors carry the Hub's X-Error-Code / X-Error-Message headers (RepoNotFound, RevisionNotFound,
GatedRepo, "Invalid credentials in Authorization header").
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

VALID_TOKEN = "hf_valid_test_token"


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    private: bool = False
    gated: bool = False
    tags: list[str] = field(default_factory=lambda: ["mlx", "safetensors"])
    pipeline_tag: str | None = "text-generation"
    downloads: int = 0
    safetensors_params: dict | None = None

    @property
    def sha(self) -> str:
        h = hashlib.sha1(self.repo_id.encode())
        for name in sorted(self.files):
            h.update(name.encode() + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name.endswith((".safetensors", ".gguf", ".bin"))

    def etag(self, name: str) -> str:
        data = self.files[name]
        if self.is_lfs(name):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob id

    def config(self) -> dict | None:
        try:
            raw = json.loads(self.files["config.json"])
        except (KeyError, ValueError):
            return None
        return {k: raw[k] for k in ("architectures", "model_type") if k in raw}


@dataclass
class Fault:
    drop_after: int | None = None  # send this many bytes of the body, then cut the connection
    drops: int = 1  # how many GETs are cut
    then_status: int | None = None  # after the drops, answer every request for the file with this
    corrupt: bool = False  # serve different bytes than the metadata describes


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.faults: dict[str, Fault] = {}  # "repo/file" -> Fault
        self.requests: list[tuple[str, str, dict]] = []  # (method, path+query, headers)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_dir(self, repo_id: str, path: Path, extra: dict[str, bytes] | None = None,
                **kw) -> Repo:
        files = {p.relative_to(path).as_posix(): p.read_bytes()
                 for p in sorted(Path(path).rglob("*")) if p.is_file()}
        files.update(extra or {})
        return self.add(repo_id, files, **kw)

    def add(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        repo = Repo(repo_id, files, **kw)
        self.repos[repo_id] = repo
        return repo

    def resolves(self, method: str | None = None) -> list[tuple[str, str, dict]]:
        return [r for r in self.requests if "/resolve/" in r[1] and method in (None, r[0])]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        # -- plumbing ---------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj, status: int = 200, headers: dict | None = None) -> None:
            self._send(status, json.dumps(obj).encode(),
                       {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: str | None, message: str, **headers) -> None:
            h = {"X-Error-Message": message, **headers}
            if code:
                h["X-Error-Code"] = code
            self._json({"error": message}, status, h)

        def _auth(self, repo: Repo) -> bool:
            """Check the token; answer the error and return False when access is refused."""
            auth = self.headers.get("Authorization")
            if auth and auth != f"Bearer {VALID_TOKEN}":
                self._error(401, None, "Invalid credentials in Authorization header")
                return False
            if repo.private and not auth:
                self._error(401, "RepoNotFound", "Invalid username or password.")
                return False
            return True

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                if self.headers.get("Authorization") not in (None, f"Bearer {VALID_TOKEN}"):
                    self._error(401, None, "Invalid credentials in Authorization header")
                elif self.headers.get("Authorization"):
                    self._error(404, "RepoNotFound", "Repository not found")
                else:
                    self._error(401, "RepoNotFound", "Invalid username or password.")
                return None
            return repo if self._auth(repo) else None

        # -- routes -----------------------------------------------------------------------------
        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            url = urlparse(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            if path.startswith("/api/models") or "/resolve/" in path:  # not telemetry & co
                hub.requests.append((self.command, self.path,
                                     {k.lower(): v for k, v in self.headers.items()}))
            if path == "/api/models":
                return self._search(query)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
            if m:
                return self._info(m[1], m[2], query)
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._file(m[1], m[2], m[3])
            self._error(404, None, "not found")

        def _info(self, repo_id, rev, query):
            repo = self._repo(repo_id)
            if repo is None:
                return
            if rev not in (None, "main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            blobs = query.get("blobs") == ["True"] or query.get("blobs") == ["true"]
            siblings = []
            for name, data in sorted(repo.files.items()):
                s = {"rfilename": name}
                if blobs:
                    s.update(size=len(data), blobId=hashlib.sha1(
                        b"blob %d\0" % len(data) + data).hexdigest())
                    if repo.is_lfs(name):
                        s["lfs"] = {"size": len(data), "sha256": repo.etag(name),
                                    "pointerSize": 134}
                siblings.append(s)
            self._json({"id": repo.repo_id, "_id": "x", "modelId": repo.repo_id,
                        "sha": repo.sha, "private": repo.private, "gated": repo.gated and "auto",
                        "tags": repo.tags, "pipeline_tag": repo.pipeline_tag,
                        "library_name": "mlx", "downloads": repo.downloads, "likes": 0,
                        "config": repo.config(), "siblings": siblings})

        def _search(self, query):
            def q(k):
                return (query.get(k) or [None])[0]

            hits = list(hub.repos.values())
            if q("search"):
                hits = [r for r in hits if q("search").lower() in r.repo_id.lower()]
            for tag in query.get("filter", []):
                hits = [r for r in hits if tag in r.tags]
            if q("pipeline_tag"):
                hits = [r for r in hits if r.pipeline_tag == q("pipeline_tag")]
            if q("author"):
                hits = [r for r in hits if r.repo_id.split("/")[0] == q("author")]
            hits = [r for r in hits if not r.private]
            if q("sort") == "downloads":
                hits.sort(key=lambda r: -r.downloads)
            hits = hits[: int(q("limit") or 1000)]
            out = []
            for r in hits:
                item = {"id": r.repo_id, "_id": "x", "downloads": r.downloads, "likes": 1,
                        "tags": r.tags, "pipeline_tag": r.pipeline_tag, "library_name": "mlx"}
                if r.safetensors_params:
                    item["safetensors"] = {"parameters": r.safetensors_params,
                                           "total": sum(r.safetensors_params.values())}
                out.append(item)
            self._json(out)

        def _file(self, repo_id, rev, name):
            repo = self._repo(repo_id)
            if repo is None:
                return
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + rev,
                                   **{"X-Repo-Commit": repo.sha})
            if repo.gated and self.headers.get("Authorization") != f"Bearer {VALID_TOKEN}":
                return self._error(403, "GatedRepo", "Access to model is restricted.")
            if name not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found",
                                   **{"X-Repo-Commit": repo.sha})
            data = repo.files[name]
            fault = hub.faults.get(f"{repo_id}/{name}")
            headers = {"X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if repo.is_lfs(name):
                headers.update({"X-Linked-Etag": f'"{repo.etag(name)}"',
                                "X-Linked-Size": str(len(data)), "ETag": f'"{repo.etag(name)}"'})
            else:
                headers["ETag"] = f'"{repo.etag(name)}"'
            if self.command == "HEAD":
                return self._head(data, headers)
            if fault and fault.drops <= 0 and fault.then_status:
                return self._error(fault.then_status, None, "Service unavailable")
            if fault and fault.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            rng = self.headers.get("Range")
            if rng:
                m = re.fullmatch(r"bytes=(\d+)-", rng.strip())
                start = int(m[1])
                if start >= len(data):
                    return self._error(416, None, "Range Not Satisfiable")
            body = data[start:]
            self.send_response(206 if rng else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault and fault.drop_after is not None and fault.drops > 0:
                fault.drops -= 1
                self.wfile.write(body[: fault.drop_after])
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            self.wfile.write(body)

        def _head(self, data, headers):
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()

    return Handler
