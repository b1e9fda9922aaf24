"""The `mlxr` command: Ollama-style verbs, one module per verb group.

Each module exposes `register(subparsers)`, which adds its verbs with `set_defaults(func=...)`;
`func(args) -> int` is the exit code. User errors print one line and exit 1, never a traceback.
Options go anywhere on the line (`mlxr run MODEL --max 4 "prompt"`), as with Ollama.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from ..errors import MlxrError
from .common import HelpFormatter, apply_threads, check_device

# Verb modules, in the order `mlxr --help` lists them.
VERB_MODULES = ["run", "serve", "bench", "harness", "store"]


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The top-level parser and each verb's parser by name (aliases included)."""
    from .. import __version__

    p = Parser(prog="mlxr", description="Run MLX model files on NVIDIA GPUs and CPUs.",
               formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"mlxr {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in VERB_MODULES:
        import_module(f"{__name__}.{name}").register(sub)
    for verb in sub.choices.values():
        verb.formatter_class = HelpFormatter  # every option's help shows its default
    return p, dict(sub.choices)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line. A verb's options and positionals may be intermixed: the verb's own
    parser reads the rest of the line with `parse_intermixed_args` (argparse cannot intermix
    across subparsers, so the verb is found first: the top level has no options but -h and
    --version)."""
    parser, verbs = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in verbs:
        return parser.parse_args(argv)  # help, version, or argparse's error for a bad verb
    args = verbs[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not getattr(args, "func", None):
        build_parser()[0].print_help()
        return 2
    try:
        check_device(getattr(args, "device", None))
        apply_threads(getattr(args, "threads", None))
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (MlxrError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
