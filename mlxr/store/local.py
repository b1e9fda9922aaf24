"""The local model store: the standard Hugging Face cache, shared with every other tool.

A hub name `ORG/REPO[@REVISION]` lives in `<cache>/models--ORG--REPO/snapshots/<commit>/`, with
`refs/<branch-or-tag>` naming the commit (the layout huggingface_hub writes and reads). The cache is
`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, read at call time.

This module never touches the network: finding, describing, listing and removing models. The Hub
side (pull, search) is `mlxr.store.hub`.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import bounded_json
from ..errors import MlxrError, ModelFormatError

# ORG/REPO with an optional @revision (branch, tag or commit), as the Hub spells repo ids.
_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache() -> Path:
    """The Hugging Face hub cache directory, resolved from the environment now."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def parse_name(name: str) -> tuple[str, str | None] | None:
    """`ORG/REPO[@REV]` -> (repo_id, revision or None); None if `name` is not a hub name."""
    m = _NAME.match(name)
    if not m or ".." in m["repo"] or m["repo"].endswith((".", "-")):
        return None
    return m["repo"], m["rev"]


def repo_dir(repo_id: str, cache: Path | None = None) -> Path:
    return (cache or hub_cache()) / ("models--" + repo_id.replace("/", "--"))


def commit_for(repo_id: str, revision: str | None, cache: Path | None = None) -> str | None:
    """The commit a revision points to in the cache (None if unknown locally)."""
    root = repo_dir(repo_id, cache)
    rev = revision or "main"
    if _COMMIT.match(rev):
        return rev if (root / "snapshots" / rev).is_dir() else None
    ref = root / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        return commit if _COMMIT.match(commit) else None
    if revision is None:  # no refs/main (e.g. pulled by commit): the only snapshot, if just one
        snaps = sorted(p.name for p in (root / "snapshots").glob("*") if p.is_dir())
        if len(snaps) == 1:
            return snaps[0]
    return None


def local_snapshot(repo_id: str, revision: str | None = None,
                   cache: Path | None = None) -> Path | None:
    """The snapshot directory of a pulled model, or None if it is not (completely) in the cache."""
    commit = commit_for(repo_id, revision, cache)
    if commit is None:
        return None
    snap = repo_dir(repo_id, cache) / "snapshots" / commit
    return snap if is_complete(snap) else None


def is_complete(path: Path) -> bool:
    """Config present and every weight file the index names present (no download in progress)."""
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(bounded_json.read_file(index)["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((path / s).is_file() for s in shards)
    return any(path.glob("*.safetensors"))


# -- formats ------------------------------------------------------------------------------------

def explain_unsupported(path: Path) -> None:
    """Raise ModelFormatError saying what a directory is and what mlxr would need, if it is not an
    MLX / safetensors model of a supported architecture. Reads only file names and config.json."""
    from ..config import SUPPORTED

    path = Path(path)
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    st = [n for n in names if n.endswith(".safetensors")]
    gguf = [n for n in names if n.lower().endswith(".gguf")]
    pt = [n for n in names
          if re.fullmatch(r"(pytorch_model|model|consolidated).*\.(bin|pt|pth)", n)]
    need = ("mlxr runs MLX / Hugging Face safetensors checkpoints (mlx-community repos); "
            "find one with `mlxr search`")
    if not st and gguf:
        raise ModelFormatError(
            f"{path}: GGUF model ({', '.join(sorted(gguf)[:3])}), the llama.cpp format; {need}, or "
            "convert the original Hugging Face model with `mlx_lm.convert --hf-path ORG/REPO -q`")
    if not st and pt:
        raise ModelFormatError(
            f"{path}: PyTorch pickle weights only ({', '.join(sorted(pt)[:3])}); mlxr reads "
            "safetensors only (pickles can run code): convert with `mlx_lm.convert --hf-path "
            "DIR -q`, or save with transformers `save_pretrained(DIR, safe_serialization=True)`")
    if not (path / "config.json").is_file():
        raise ModelFormatError(f"{path}: no config.json, not a model directory; {need}")
    try:
        raw = bounded_json.read_file(path / "config.json")
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path / 'config.json'}: unreadable ({e})") from None
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    if mt not in SUPPORTED:
        arch = ", ".join(raw.get("architectures") or []) if isinstance(raw, dict) else ""
        raise ModelFormatError(
            f"{path}: architecture {mt!r}{f' ({arch})' if arch else ''} is not supported; "
            f"mlxr runs the decoders {', '.join(SUPPORTED)}: pick an MLX conversion of "
            "one of those (`mlxr search`)")
    if not st:
        raise ModelFormatError(f"{path}: no *.safetensors weight files; {need}")


# -- describing ---------------------------------------------------------------------------------

def dir_size(path: Path) -> int:
    """Bytes of the files of a directory (following the cache's snapshot symlinks)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def quant_summary(raw: dict) -> str:
    """One line for a config.json's quantization block ("4-bit affine g64", "none" ...)."""
    q = raw.get("quantization") or raw.get("quantization_config")
    if not isinstance(q, dict) or not ("bits" in q or "mode" in q):
        dtype = raw.get("torch_dtype") or raw.get("dtype")
        return f"none ({dtype})" if dtype else "none"
    from ..config import QUANT_DEFAULTS

    mode = q.get("mode") or "affine"
    bits, group = QUANT_DEFAULTS.get(mode, (None, None))
    bits, group = q.get("bits") or bits, q.get("group_size") or group
    s = f"{bits}-bit {mode}" if mode == "affine" else f"{mode}"
    s += f" g{group}" if group else ""
    n = sum(1 for v in q.values() if isinstance(v, (dict, bool)))
    return s + (f" (+{n} per-layer overrides)" if n else "")


@dataclass
class LocalModel:
    name: str  # ORG/REPO[@REV]
    path: Path
    size: int
    architecture: str
    quantization: str
    status: str  # "ok" | "incomplete" | "unsupported: ..."


def _summary(path: Path) -> tuple[str, str, str]:
    try:
        raw = bounded_json.read_file(path / "config.json")
    except (OSError, ValueError):
        return "?", "?", "incomplete" if not (path / "config.json").exists() else "bad config.json"
    arch, quant = str(raw.get("model_type", "?")), quant_summary(raw)
    try:
        explain_unsupported(path)
    except ModelFormatError as e:
        return arch, quant, "unsupported: " + str(e).split(": ", 1)[-1].split(";")[0]
    return arch, quant, "ok" if is_complete(path) else "incomplete"


def local_model(name: str, path: Path) -> LocalModel:
    """One model directory as `mlxr list` shows it."""
    return LocalModel(name, path, dir_size(path), *_summary(path))


def list_local(cache: Path | None = None) -> list[LocalModel]:
    """Every model snapshot in the cache with a config.json (other tools' repos included)."""
    cache = cache or hub_cache()
    out = []
    for root in sorted(cache.glob("models--*--*")):
        repo_id = root.name[len("models--"):].replace("--", "/", 1)
        refs = {}
        for ref in sorted((root / "refs").rglob("*")) if (root / "refs").is_dir() else []:
            if ref.is_file():
                refs.setdefault(ref.read_text().strip(), []).append(
                    ref.relative_to(root / "refs").as_posix())
        for snap in sorted(p for p in (root / "snapshots").glob("*") if p.is_dir()):
            if not (snap / "config.json").exists() and not any(snap.iterdir()):
                continue
            names = refs.get(snap.name, [])
            rev = "" if "main" in names else "@" + (names[0] if names else snap.name[:12])
            out.append(local_model(repo_id + rev, snap))
    return out


def describe(path: Path) -> dict:
    """Everything `mlxr show` prints about a model directory (reads no weight data)."""
    from ..config import load_config
    from ..text.tokenizer import load_chat_template

    path = Path(path)
    explain_unsupported(path)
    raw = bounded_json.read_file(path / "config.json")
    cfg, _ = load_config(path)
    info: dict = {
        "path": str(path), "architecture": cfg.model_type,
        "architectures": raw.get("architectures") or [],
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "intermediate_size": cfg.intermediate_size, "context_length": cfg.context_length,
        "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": cfg.torch_dtype,
        "quantization": quant_summary(raw), "overrides": {},
    }
    if cfg.quant is not None:
        d = cfg.quant.default
        info["quantization"] = (f"{d.bits}-bit {d.mode} group {d.group_size}"
                                if d.mode == "affine"
                                else f"{d.mode} ({d.bits}-bit, group {d.group_size})")
        info["overrides"] = {k: (None if v is None
                                 else f"{v.bits}-bit {v.mode} group {v.group_size}")
                             for k, v in sorted(cfg.quant.overrides.items())}
    try:
        tmpl = load_chat_template(path)
    except MlxrError:
        tmpl = None
    text = tmpl if isinstance(tmpl, str) else "\n".join((tmpl or {}).values())
    info["chat_template"] = bool(text)
    info["tools"] = bool(text) and bool(re.search(r"\btools\b", text))
    info["thinking"] = bool(re.search(r"enable_thinking|<think>|reasoning_content|<\|channel\|>",
                                      text))
    info["files"] = sorted((p.relative_to(path).as_posix(), p.stat().st_size)
                           for p in path.rglob("*") if p.is_file())
    info["size"] = sum(s for _, s in info["files"])
    return info


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def remove(repo_id: str, revision: str | None = None, cache: Path | None = None) -> list[Path]:
    """Delete a model from the cache: the whole repo, or one revision's snapshot (through
    huggingface_hub's own cache manager, which frees blobs no other revision uses)."""
    from huggingface_hub import scan_cache_dir

    cache = cache or hub_cache()
    root = repo_dir(repo_id, cache)
    if not root.is_dir():
        raise MlxrError(f"{repo_id}: not in the model cache ({cache}); see `mlxr list`")
    locks = cache / ".locks" / root.name
    if revision is None:
        shutil.rmtree(root)
        shutil.rmtree(locks, ignore_errors=True)
        return [root]
    commit = commit_for(repo_id, revision, cache)
    if commit is None:
        raise MlxrError(f"{repo_id}@{revision}: revision not in the model cache; see `mlxr list`")
    scan_cache_dir(cache).delete_revisions(commit).execute()
    for ref in (root / "refs").rglob("*") if (root / "refs").is_dir() else []:
        if ref.is_file() and ref.read_text().strip() == commit:
            ref.unlink()
    if not root.exists():  # that was the last revision
        shutil.rmtree(locks, ignore_errors=True)
    return [root / "snapshots" / commit]
