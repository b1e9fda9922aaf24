"""`mlxr run [MODEL] [PROMPT]`: one-shot streamed answer, or an interactive chat.

Chat models (a chat template in the model directory) get the template's prompt format; models
without one (such as the bundled story model) run as plain text completion: the prompt is
continued as written, and each interactive line is a fresh completion.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import MlxrError, NotDownloadedError
from ..text.sampling import SamplingParams
from .common import add_model_flags, add_parallel_flag, confirm, ensure_model, resolve_model

HELP = """Commands:
  /set temp|top_p|top_k|min_p|repeat_penalty|seed|max VALUE   change a sampling parameter
  /set system TEXT   set the system prompt (chat models)
  /show              show the current parameters
  /clear             forget the conversation
  /bye               leave (or Ctrl-D); Ctrl-C stops an answer
"""

# /set names -> (SamplingParams field, type, what a valid value is)
SETTABLE = {"temp": ("temperature", float, "a number >= 0 (0 = greedy)"),
            "top_p": ("top_p", float, "a number in (0, 1] (1 = off)"),
            "top_k": ("top_k", int, "a whole number >= 0 (0 = off)"),
            "min_p": ("min_p", float, "a number in [0, 1] (0 = off)"),
            "repeat_penalty": ("repetition_penalty", float, "a number > 0 (1 = off)"),
            "seed": ("seed", int, "a whole number"),
            "max": ("max_tokens", int, "a whole number >= 1 (tokens per answer)")}


def register(sub) -> None:
    p = sub.add_parser("run", help="run a model: answer PROMPT, or chat interactively",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model directory, bundled name, alias (qwen3, "
                   "llama3.2, ...) or pulled Hub name ORG/REPO (default: the bundled model)")
    p.add_argument("prompt", nargs="?", help="prompt text; '-' reads standard input, as does "
                   "a piped standard input without a prompt (default: chat interactively)")
    unset = "default: the model's generation_config.json, else off"
    p.add_argument("--temp", type=float, dest="temperature",
                   help="sampling temperature, 0 = greedy (default: the model's "
                   "generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, help=f"nucleus sampling mass in (0, 1] ({unset})")
    p.add_argument("--top-k", type=int, help=f"sample among the k likeliest tokens ({unset})")
    p.add_argument("--min-p", type=float, help=f"drop tokens below min_p x the top "
                   f"probability ({unset})")
    p.add_argument("--repeat-penalty", type=float, help=f"penalty > 1 on recent tokens ({unset})")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--max", type=int, dest="max_tokens", help="maximum tokens to generate "
                   "(default: until EOS or the end of the context)")
    p.add_argument("--system", help="system prompt (chat models; default: none)")
    p.add_argument("--verbose", action="store_true", help="print token counts and speeds")
    p.add_argument("--yes", "-y", action="store_true",
                   help="pull a missing Hub model without asking")
    add_model_flags(p)
    add_parallel_flag(p)
    p.set_defaults(func=cmd_run)


class Session:
    """A loaded model plus the conversation and the current sampling parameters."""

    def __init__(self, model, params: SamplingParams, system: str | None, verbose: bool):
        self.model, self.params, self.system, self.verbose = model, params, system, verbose
        self.tokenizer = model.tokenizer
        self.chat = self.tokenizer.chat_template is not None
        self.history: list[dict] = []

    def prompt_ids(self, text: str) -> list[int]:
        if not self.chat:
            return self.tokenizer.encode(text, add_special_tokens=True)
        msgs = ([{"role": "system", "content": self.system}] if self.system else [])
        msgs += self.history + [{"role": "user", "content": text}]
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)

    def answer(self, text: str) -> str:
        """Stream the answer to `text`; Ctrl-C stops it early (kept in the history so far)."""
        out = sys.stdout
        pieces, stats = [], None
        try:
            ids = self.prompt_ids(text)
            for chunk in self.model.stream(ids, self.params):
                out.write(chunk.text)
                out.flush()
                pieces.append(chunk.text)
                stats = chunk.stats
        except KeyboardInterrupt:
            out.write("\n")
        reply = "".join(pieces)
        if reply and not reply.endswith("\n"):
            out.write("\n")
        if self.chat:
            self.history += [{"role": "user", "content": text},
                             {"role": "assistant", "content": reply}]
        if self.verbose and stats is not None:
            print(f"prompt tokens:    {stats.prompt_tokens}\n"
                  f"generated tokens: {stats.generation_tokens}\n"
                  f"prefill:          {stats.prefill_tps:.1f} tok/s\n"
                  f"decode:           {stats.decode_tps:.1f} tok/s", file=sys.stderr)
        return reply

    def describe(self) -> str:
        """What /show prints: one `name value` line per /set setting, then the system prompt."""
        p = self.params
        off = "off"
        rows = [("temp", "from the model" if p.temperature is None else f"{p.temperature:g}"),
                ("top_p", off if p.top_p in (None, 1.0) else f"{p.top_p:g}"),
                ("top_k", off if not p.top_k else str(p.top_k)),
                ("min_p", off if not p.min_p else f"{p.min_p:g}"),
                ("repeat_penalty", off if p.repetition_penalty in (None, 1.0)
                 else f"{p.repetition_penalty:g}"),
                ("seed", "random" if p.seed is None else str(p.seed)),
                ("max", str(p.max_tokens)),
                ("system", "(none)" if not self.system else self.system)]
        return "\n".join(f"{k:<15} {v}" for k, v in rows)

    def command(self, line: str) -> bool:
        """Handle a /command; False means leave."""
        parts = line.split(maxsplit=2)
        cmd = parts[0]
        if cmd in ("/bye", "/exit", "/quit"):
            return False
        if cmd == "/clear":
            self.history.clear()
            print("Cleared the conversation.")
        elif cmd == "/show":
            print(self.describe())
        elif cmd == "/set" and len(parts) == 3 and parts[1] == "system":
            self.system = parts[2]
            print("Set the system prompt.")
        elif cmd == "/set" and len(parts) == 3 and parts[1] in SETTABLE:
            name, text = parts[1], parts[2]
            field, typ, valid = SETTABLE[name]
            try:
                params = replace(self.params, **{field: typ(text)})
                params.validate(self.model.config.vocab_size)
            except (ValueError, MlxrError):
                print(f"error: /set {name}: expected {valid}, got {text!r}")
            else:
                self.params = params
                print(f"Set {name} to {text}.")
        else:
            print(HELP, end="")
        return True


def _readline_setup() -> None:
    try:
        import readline
    except ImportError:  # line editing is a convenience; input() works without it
        return
    path = Path(os.environ.get("MLXR_HOME", Path.home() / ".mlxr")) / "history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            readline.read_history_file(path)
        import atexit

        atexit.register(readline.write_history_file, path)
    except OSError:
        pass


def interactive(session: Session) -> int:
    _readline_setup()
    mode = "chat" if session.chat else "text completion (no chat template)"
    print(f"mlxr {session.model.path.name}: {mode}. /? for help, /bye or Ctrl-D to leave.")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl-D or /bye to leave.")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                return 0
            continue
        try:
            session.answer(line)
        except MlxrError as e:  # e.g. the conversation outgrew the context: keep the session
            print(f"error: {e}")


def cmd_run(args) -> int:
    import mlxr

    from ..config import load_config
    from ..onnx.folder import is_onnx_model
    from ..text.tokenizer import check_tokenizer_files

    if args.model == "-" and args.prompt is None:  # `mlxr run -`: the default model, stdin
        args.model, args.prompt = None, "-"
    if args.prompt is None and not sys.stdin.isatty():
        args.prompt = "-"  # piped input is the prompt (as with Ollama), not an interactive chat
    try:
        path = resolve_model(args.model)
    except NotDownloadedError as e:
        # A Hub name or alias not downloaded yet: pull it after asking (or with --yes).
        if not confirm(f"{e.name} is not downloaded. Pull it now?", args.yes):
            raise
        path = ensure_model(args.model, allow_pull=True)
    if not is_onnx_model(path):  # the config, then the tokenizer: both before any weights
        load_config(path)
        check_tokenizer_files(path)  # run needs text
    model = mlxr.load(path, device=args.device, dtype=args.dtype,
                      tensor_parallel=args.tensor_parallel)
    fields = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
    kw = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    if args.repeat_penalty is not None:
        kw["repetition_penalty"] = args.repeat_penalty
    # Without --max, answers run to EOS or the end of the context (generation clamps to it).
    kw.setdefault("max_tokens", model.config.context_length)
    params = model.sampling_params(SamplingParams(**kw))
    params.validate(model.config.vocab_size)
    session = Session(model, params, args.system, args.verbose)
    if args.prompt is None:
        return interactive(session)
    # A piped prompt's final newline (echo's) is not part of it.
    text = sys.stdin.read().removesuffix("\n") if args.prompt == "-" else args.prompt
    session.answer(text)
    return 0
