"""Helpers shared by the CLI verbs: help formatting, device/dtype flags and model resolution
(names themselves are resolved by `mlxr.names`, shared with the Python API)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import NotDownloadedError
from ..names import BUNDLED, DEFAULT_MODEL, expand_alias, resolve_model

__all__ = ["BUNDLED", "DEFAULT_MODEL", "HelpFormatter", "add_model_flags", "check_device",
           "confirm", "ensure_model", "resolve_model"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default (unless its help already says it, or it has none), keeps
    multi-line descriptions (module docstrings) as written and wraps one-line ones."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, [], "") or "default" in text:
            return text
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_model_flags(p: argparse.ArgumentParser, device: str = "cuda when available, else cpu",
                    dtype: str = "bfloat16") -> None:
    """--device and --dtype; `device`/`dtype` say what the verb uses when they are not given."""
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help=f"compute device (default: {device})")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help=f"compute dtype (default: {dtype}; float32 is the exact reference mode)")


def check_device(device: str | None) -> None:
    """Refuse --device cuda up front, in one line, when this torch has no usable GPU (before a
    verb loads anything or starts a server)."""
    if device is not None:
        from ..model import _pick_device

        _pick_device(device)


def ensure_model(name: str | None, allow_pull: bool) -> Path:
    """Like resolve_model, but a Hub name or alias missing locally is pulled when `allow_pull`
    (what `run` does after asking or with --yes; `serve` passes False). The directory is checked
    to be a supported format (GGUF, .bin-only or unknown architectures are explained)."""
    from ..onnx.folder import is_onnx_model
    from ..store.local import explain_unsupported

    try:
        path = resolve_model(name)
    except NotDownloadedError:
        if not allow_pull:
            raise
        from ..store.hub import pull

        path = pull(expand_alias(name)).path
    if not is_onnx_model(path):  # ONNX decoders are validated by mlxr.onnx at load
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
