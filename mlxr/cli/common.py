"""Helpers shared by the CLI verbs: help formatting, device/dtype flags and model resolution
(names themselves are resolved by `mlxr.names`, shared with the Python API)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import NotDownloadedError
from ..names import BUNDLED, DEFAULT_MODEL, expand_alias, resolve_model

__all__ = ["BUNDLED", "DEFAULT_MODEL", "HelpFormatter", "add_model_flags", "add_parallel_flag",
           "apply_threads", "check_device", "confirm", "ensure_model", "resolve_model"]


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
    p.add_argument("--threads", type=_threads, default=None, metavar="N",
                   help="CPU threads for torch's kernels (default: one per core; on a busy "
                        "machine fewer can be faster)")


def _threads(text: str) -> int:
    """--threads: a whole number from 1 to 1024 (argparse turns the ValueError into its
    one-line usage error)."""
    n = int(text)
    if not 1 <= n <= 1024:
        raise ValueError(text)
    return n


def apply_threads(threads: int | None) -> None:
    """Set torch's CPU thread count (and OMP_NUM_THREADS, so an engine process started from
    here gets the same count) when --threads was given."""
    if threads is None:
        return
    import os

    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def add_parallel_flag(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel N: the model split over N ranks that mlxr starts itself (one GPU
    each on CUDA, N CPU processes with --device cpu)."""
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N GPUs (N CPU processes with --device cpu), "
                        "Megatron-style (docs/tensor_parallel.md)")


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
