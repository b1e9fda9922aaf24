"""Model names -> model directories: the one resolver behind `mlxr.load`, every CLI verb and
`mlxr serve`, so that a name works the same everywhere.

A name is, in this order: a directory; a bundled model (`stories260K`, shipped in the package);
a short alias (`qwen3`, `llama3.2:3b`; see ALIASES) standing for an mlx-community repo; or a Hub
name `ORG/REPO[@REVISION]` pulled into the Hugging Face cache. Resolving never downloads.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from .errors import MlxrError, NotDownloadedError

BUNDLED = Path(__file__).resolve().parent / "bundled"
DEFAULT_MODEL = "stories260K"

# Ollama-style short names -> MLX conversions on the Hub (4-bit, instruction-tuned, of families
# mlxr runs). `NAME` alone is the smallest size; `NAME:SIZE` picks one. Lookup ignores case and a
# `:latest` tag. Kept small on purpose: any other repo is reachable by its ORG/REPO name.
ALIASES: dict[str, str] = {
    "qwen3": "mlx-community/Qwen3-0.6B-4bit",
    "qwen3:0.6b": "mlx-community/Qwen3-0.6B-4bit",
    "qwen3:1.7b": "mlx-community/Qwen3-1.7B-4bit",
    "qwen3:4b": "mlx-community/Qwen3-4B-4bit",
    "qwen3:8b": "mlx-community/Qwen3-8B-4bit",
    "qwen2.5": "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    "qwen2.5:0.5b": "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    "qwen2.5:7b": "mlx-community/Qwen2.5-7B-Instruct-4bit",
    "llama3.2": "mlx-community/Llama-3.2-1B-Instruct-4bit",
    "llama3.2:1b": "mlx-community/Llama-3.2-1B-Instruct-4bit",
    "llama3.2:3b": "mlx-community/Llama-3.2-3B-Instruct-4bit",
    "llama3.1": "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
    "llama3.1:8b": "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
    "gemma3:1b": "mlx-community/gemma-3-1b-it-4bit",  # the larger gemma3 sizes are multimodal
    "gemma2": "mlx-community/gemma-2-2b-it-4bit",
    "gemma2:2b": "mlx-community/gemma-2-2b-it-4bit",
    "mistral": "mlx-community/Mistral-7B-Instruct-v0.3-4bit",
    "mistral:7b": "mlx-community/Mistral-7B-Instruct-v0.3-4bit",
    "phi3.5": "mlx-community/Phi-3.5-mini-instruct-4bit",
}


def bundled_models() -> list[Path]:
    """The model directories shipped inside the package, by name."""
    return sorted(p for p in BUNDLED.iterdir() if (p / "config.json").is_file())


def expand_alias(name: str) -> str:
    """`qwen3` -> `mlx-community/Qwen3-0.6B-4bit`; any other name is returned unchanged."""
    key = name.strip().lower()
    key = key.removesuffix(":latest")
    return ALIASES.get(key, name)


def suggest_alias(text: str) -> str | None:
    """The alias closest to `text` (a mistyped or unknown short name), as `alias (repo)`."""
    key = text.strip().lower()
    if not key:
        return None
    # A query naming a family ("qwen", "llama") matches the aliases that start with it.
    starts = sorted((a for a in ALIASES if a.startswith(key) or key.startswith(a.split(":")[0])),
                    key=lambda a: (len(a), a))
    close = starts or difflib.get_close_matches(key, list(ALIASES), n=1, cutoff=0.6)
    return f"{close[0]} ({ALIASES[close[0]]})" if close else None


def _hint(name: str) -> str:
    near = suggest_alias(name)
    return f"; did you mean {near}?" if near else ""


def resolve_model(name: str | Path | None) -> Path:
    """A model argument -> its directory (or a bare .onnx file): none = the default bundled model,
    a directory, a bundled name, an alias or a Hub name already pulled into the Hugging Face
    cache (never downloads).
    Raises NotDownloadedError for a Hub name (or alias) that `mlxr pull` would fetch."""
    from .store.local import hub_cache, local_snapshot, parse_name, repo_dir

    if name is None or str(name) == "":
        return BUNDLED / DEFAULT_MODEL
    name = str(name)
    p = Path(name).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix == ".onnx"):  # a bare ONNX decoder file too
        return p
    if "/" not in name and (BUNDLED / name / "config.json").is_file():
        return BUNDLED / name
    if p.exists():
        raise MlxrError(f"{name}: not a model directory")
    full = expand_alias(name)
    shown = name if full == name else f"{name} ({full})"
    hub = parse_name(full)
    if hub is not None:
        snap = local_snapshot(*hub)
        if snap is not None:
            return snap
        if repo_dir(hub[0]).is_dir():
            raise NotDownloadedError(f"{shown}: not completely downloaded (in {hub_cache()}): "
                                     f"run `mlxr pull {name}` to finish it", name)
        raise NotDownloadedError(f"model {shown} is not downloaded: run `mlxr pull {name}`", name)
    bundled = ", ".join(p.name for p in bundled_models())
    raise MlxrError(f"model {name!r} not found: give a model directory, a Hub name ORG/REPO, an "
                    f"alias such as qwen3 (`mlxr list --aliases`) or a bundled model ({bundled})"
                    f"{_hint(name)}")
