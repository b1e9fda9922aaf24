"""Helpers shared by the CLI verbs: model resolution and device/dtype flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import MlxrError

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"
DEFAULT_MODEL = "stories260K"


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="compute device (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default bfloat16; float32 is the exact reference mode)")


def resolve_model(name: str | None) -> Path:
    """A model argument -> its directory: none = the bundled model, a path, a bundled name, or a
    hub name `ORG/REPO[@REV]` already pulled into the Hugging Face cache (never downloads)."""
    from ..store.local import hub_cache, local_snapshot, parse_name, repo_dir

    if not name:
        return BUNDLED / DEFAULT_MODEL
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if (BUNDLED / name).is_dir():
        return BUNDLED / name
    if p.exists():
        raise MlxrError(f"{name}: not a model directory")
    hub = parse_name(name)
    if hub is not None:
        snap = local_snapshot(*hub)
        if snap is not None:
            return snap
        if repo_dir(hub[0]).is_dir():
            raise MlxrError(f"{name}: not completely downloaded (in {hub_cache()}): run "
                            f"`mlxr pull {name}` to finish it")
        raise MlxrError(f"model {name!r} is not downloaded: run `mlxr pull {name}`")
    raise MlxrError(f"model {name!r} not found: give a model directory, a Hub name ORG/REPO "
                    f"(bundled: {', '.join(sorted(d.name for d in BUNDLED.iterdir()))})")


def ensure_model(name: str | None, allow_pull: bool) -> Path:
    """Like resolve_model, but a hub name missing locally is pulled when `allow_pull` (what `run`
    does after asking or with --yes; `serve` passes False). The directory is checked to be a
    supported format (GGUF, .bin-only or unknown architectures are explained)."""
    from ..store.local import explain_unsupported, parse_name

    try:
        path = resolve_model(name)
    except MlxrError:
        if name is None or parse_name(name) is None or Path(name).expanduser().exists():
            raise
        if not allow_pull:
            raise
        from ..store.hub import pull

        path = pull(name).path
    explain_unsupported(path)
    return path


def confirm(question: str, assume_yes: bool = False) -> bool:
    """Ask a yes/no question on the terminal; without a terminal only `assume_yes` says yes."""
    import sys

    if assume_yes:
        return True
    if not sys.stdin.isatty():
        return False
    try:
        return input(f"{question} [y/N] ").strip().lower() in {"y", "yes"}
    except EOFError:
        return False
