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
    """A model argument -> its directory: none = the bundled model, a path, or a bundled name."""
    if name is None:
        return BUNDLED / DEFAULT_MODEL
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if (BUNDLED / name).is_dir():
        return BUNDLED / name
    if p.exists():
        raise MlxrError(f"{name}: not a model directory")
    raise MlxrError(f"model {name!r} not found: give a model directory "
                    f"(bundled: {', '.join(sorted(d.name for d in BUNDLED.iterdir()))})")
