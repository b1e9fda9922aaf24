"""The `mlxr` command: Ollama-style verbs, one module per verb group.

Each module exposes `register(subparsers)`, which adds its verbs with `set_defaults(func=...)`;
`func(args) -> int` is the exit code. User errors print one line and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from ..errors import MlxrError

# Verb modules, in the order `mlxr --help` lists them.
VERB_MODULES = ["run", "serve", "bench", "harness", "store"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="mlxr", description="Run MLX model files on NVIDIA GPUs "
                                "and CPUs.")
    p.add_argument("--version", action="version", version=f"mlxr {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in VERB_MODULES:
        import_module(f"{__name__}.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (MlxrError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
