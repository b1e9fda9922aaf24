"""`mlxr ps` and `mlxr stop MODEL`: the models a running `mlxr serve` has loaded, and unloading
one (Ollama's verbs, over the server's /api/ps and /api/generate with keep_alive 0)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from datetime import datetime

from ..errors import MlxrError
from ..store.local import human


def register(sub) -> None:
    for name, fn, text in (("ps", cmd_ps, "list the models a running server has loaded"),
                           ("stop", cmd_stop, "unload a model from a running server")):
        p = sub.add_parser(name, help=text, description=__doc__)
        if name == "stop":
            p.add_argument("model", help="the loaded model's name (as `mlxr ps` shows it)")
        p.add_argument("--host", default=os.environ.get("MLXR_HOST", "http://127.0.0.1:8080"),
                       help="the server's URL (default: $MLXR_HOST or http://127.0.0.1:8080)")
        p.add_argument("--api-key", default=os.environ.get("MLXR_API_KEY"),
                       help="the server's API key (default: $MLXR_API_KEY)")
        p.set_defaults(func=fn)


def call(args, method: str, path: str, body: dict | None = None) -> dict:
    """One JSON request to the server; its error message (Ollama's shape) as an MlxrError."""
    url = args.host.rstrip("/")
    url = url if "://" in url else "http://" + url
    req = urllib.request.Request(url + path, method=method, data=None if body is None else
                                 json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error")
        except ValueError:
            msg = None
        raise MlxrError(f"{url}: {msg or e}") from None
    except (urllib.error.URLError, OSError) as e:
        raise MlxrError(f"cannot reach the server at {url} ({getattr(e, 'reason', e)}): is "
                        "`mlxr serve` running? (--host)") from None


def _until(expires: str) -> str:
    if expires.startswith("9999"):
        return "Forever"
    t = datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
    left = t - time.time()
    return "Stopping..." if left <= 0 else f"{left:.0f} s from now" if left < 120 else \
        f"{left / 60:.0f} minutes from now"


def cmd_ps(args) -> int:
    rows = [["NAME", "SIZE", "WEIGHTS", "KV CACHE", "DEVICE", "LOADED IN", "UNTIL"]]
    for m in call(args, "GET", "/api/ps")["models"]:
        rows.append([m["name"], human(m["size"]), human(m.get("weights_bytes", 0)),
                     human(m.get("kv_cache_bytes", 0)), m.get("device", "?"),
                     f"{m.get('load_seconds', 0):.2f} s", _until(m["expires_at"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_stop(args) -> int:
    loaded = [m["name"] for m in call(args, "GET", "/api/ps")["models"]]
    name = args.model.removesuffix(":latest")
    if name not in loaded:
        raise MlxrError(f"model {name!r} is not loaded (loaded: {', '.join(loaded) or 'none'})")
    t0 = time.monotonic()
    call(args, "POST", "/api/generate", {"model": name, "keep_alive": 0})
    print(f"stopped {name} ({time.monotonic() - t0:.2f} s)")
    return 0
