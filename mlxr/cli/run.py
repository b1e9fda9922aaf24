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

from ..errors import MlxrError
from ..text.sampling import SamplingParams
from .common import add_model_flags, confirm, ensure_model, resolve_model

HELP = """Commands:
  /set temp|top_p|top_k|min_p|repeat_penalty|seed|max VALUE   change a sampling parameter
  /set system TEXT   set the system prompt (chat models)
  /show              show the current parameters
  /clear             forget the conversation
  /bye               leave (or Ctrl-D); Ctrl-C stops an answer
"""

# /set names -> SamplingParams fields and their types
SETTABLE = {"temp": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
            "min_p": ("min_p", float), "repeat_penalty": ("repetition_penalty", float),
            "seed": ("seed", int), "max": ("max_tokens", int)}


def register(sub) -> None:
    p = sub.add_parser("run", help="run a model: answer PROMPT, or chat interactively",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model directory (default: the bundled model)")
    p.add_argument("prompt", nargs="?", help="prompt text ('-' reads standard input)")
    p.add_argument("--temp", type=float, dest="temperature",
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--max", type=int, dest="max_tokens", help="maximum tokens to generate")
    p.add_argument("--system", help="system prompt (chat models)")
    p.add_argument("--verbose", action="store_true", help="print token counts and speeds")
    p.add_argument("--yes", "-y", action="store_true",
                   help="pull a missing Hub model without asking")
    add_model_flags(p)
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

    def answer(self, text: str, out=sys.stdout) -> str:
        """Stream the answer to `text`; Ctrl-C stops it early (kept in the history so far)."""
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
            print(f"{self.params}\nsystem: {self.system!r}")
        elif cmd == "/set" and len(parts) == 3 and parts[1] == "system":
            self.system = parts[2]
            print("Set the system prompt.")
        elif cmd == "/set" and len(parts) == 3 and parts[1] in SETTABLE:
            field, typ = SETTABLE[parts[1]]
            try:
                params = replace(self.params, **{field: typ(parts[2])})
                params.validate(self.model.config.vocab_size)
            except (ValueError, MlxrError) as e:
                print(f"error: {e}")
            else:
                self.params = params
                print(f"Set {parts[1]} to {parts[2]}.")
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

    try:
        path = resolve_model(args.model)
    except MlxrError as e:
        # A Hub name not downloaded yet: pull it after asking (or with --yes).
        if "mlxr pull" not in str(e) or not confirm(f"{args.model} is not downloaded. Pull it "
                                                    "now?", args.yes):
            raise
        path = ensure_model(args.model, allow_pull=True)
    model = mlxr.load(path, device=args.device, dtype=args.dtype)
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
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    session.answer(text)
    return 0
