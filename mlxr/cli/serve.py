"""`mlxr serve [MODEL]`: an OpenAI- and Ollama-compatible server (chat, completions, responses,
models, health, metrics; Ollama's /api/*) over continuous batching. Closed by default: binds
127.0.0.1, checks Host and Origin, and requires --api-key to bind anywhere else. Serves only the
model it was started with and never downloads or deletes one, unless started with --allow-pull /
--allow-delete (Ollama's /api/pull and /api/delete, on the Hugging Face cache).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .common import add_model_flags, add_parallel_flag, resolve_model


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _port(text: str) -> int:
    """A TCP port to listen on: 1..65535 (0, "any free port", would leave clients guessing)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a TCP port: give 1..65535")
    return n


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model directory, bundled name, alias or pulled Hub "
                   "name (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; "
                   "anything but loopback requires --api-key)")
    p.add_argument("--port", type=_port, default=8080, help="TCP port to listen on, 1..65535")
    p.add_argument("--api-key", default=os.environ.get("MLXR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $MLXR_API_KEY)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="browser Origin allowed to call the API (repeatable; '*' for any)")
    p.add_argument("--served-model-name", help="model id clients use (default: the directory "
                   "name)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16,
                   help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (chunked prefill; default: engine's choice)")
    p.add_argument("--max-queued", type=int, default=64,
                   help="waiting requests before 429")
    p.add_argument("--stream-interval", type=_positive_int, default=None, metavar="N",
                   help="hand each stream its tokens every N engine steps (default: 1 up to 64 "
                   "running streams, then one step more per 64)")
    p.add_argument("--engine-process", choices=["auto", "on", "off"], default="auto",
                   help="run the engine in its own process, so that the HTTP work and the "
                   "engine's Python do not share one GIL (default: auto, on with CUDA)")
    p.add_argument("--max-connections", type=_positive_int, default=256,
                   help="concurrent client connections (more are answered 503)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=4 << 20,
                   help="largest request body accepted (bytes; larger gets 413)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send its request headers")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send its request body")
    p.add_argument("--allow-pull", action="store_true",
                   help="let clients download Hub models into the cache (Ollama's /api/pull)")
    p.add_argument("--allow-delete", action="store_true",
                   help="let clients delete Hub models from the cache (Ollama's /api/delete)")
    p.add_argument("--allow-client-chat-template", action="store_true",
                   help="let clients send chat_template_kwargs.chat_template (Jinja source, run "
                        "sandboxed and bounded in the server; off by default)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="server log verbosity")
    add_model_flags(p)
    add_parallel_flag(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..server import run

    from ..store.local import parse_name

    path = resolve_model(args.model)  # local only: serve never downloads
    # a Hub model is called by its name, not by its snapshot directory (a commit id)
    hub_name = args.model if args.model and not Path(args.model).expanduser().exists() \
        and parse_name(args.model) else None
    run(path, host=args.host, port=args.port, api_key=args.api_key,
        allow_origins=args.allow_origin, model_id=args.served_model_name or hub_name,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_queued=args.max_queued,
        max_connections=args.max_connections, max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        device=args.device, dtype=args.dtype, tensor_parallel=args.tensor_parallel,
        log_level=args.log_level,
        stream_interval=args.stream_interval, engine_process=args.engine_process,
        allow_pull=args.allow_pull, allow_delete=args.allow_delete,
        allow_client_chat_template=args.allow_client_chat_template)
    return 0
