"""Model store verbs: pull, search, list, show, rm."""

from __future__ import annotations

import argparse
import sys

from ..errors import MlxrError


def register(sub) -> None:
    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub",
                       description="Download ORG/REPO[@REVISION] (or an alias such as qwen3, see "
                       "`mlxr list --aliases`) into the Hugging Face cache (only the files a "
                       "model needs), verify and validate it. Interrupted downloads resume.")
    p.add_argument("model", metavar="ORG/REPO[@REVISION]", help="Hub model name or alias")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("search", help="search the Hub for MLX text-generation models")
    p.add_argument("query", nargs="?", default="", help="words of the repo name (default: all)")
    p.add_argument("-n", "--limit", type=int, default=20, help="results to show at most")
    p.add_argument("--author", default=None, help="only this user/organisation "
                   "(e.g. mlx-community)")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("list", aliases=["ls"], help="list bundled and downloaded models",
                       description="The models `mlxr run` takes by name: the bundled ones and "
                       "those in the Hugging Face cache.")
    p.add_argument("--aliases", action="store_true",
                   help="list the short names (qwen3, llama3.2, ...) and their Hub repos instead")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="describe a model: config, quantization, template, files")
    p.add_argument("model", metavar="MODEL", help="ORG/REPO[@REV], an alias, a directory or a "
                   "bundled name")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="remove a downloaded model from the cache")
    p.add_argument("model", metavar="ORG/REPO[@REVISION]", help="downloaded Hub model or alias")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_rm)


def cmd_pull(args: argparse.Namespace) -> int:
    from ..store.hub import pull

    pull(args.model, show_progress=not args.quiet)
    return 0


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_search(args: argparse.Namespace) -> int:
    from ..store.hub import search
    from ..names import expand_alias, suggest_alias
    from ..store.local import human

    full = expand_alias(args.query)
    if full != args.query:
        print(f"{args.query} is an alias of {full} (`mlxr pull {args.query}`)", file=sys.stderr)
    hits = search(args.query, limit=args.limit, author=args.author)
    if not hits:
        near = suggest_alias(args.query)
        hint = f"; try the alias {near}" if near else ""
        print(f"no MLX text-generation models match {args.query!r}{hint}", file=sys.stderr)
        return 0
    _table([[h.repo_id, human(h.size) if h.size else "?", h.quantization or "?",
             f"{h.downloads:,}" if h.downloads is not None else "?"] for h in hits],
           ["NAME", "SIZE", "QUANT", "DOWNLOADS"])
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from ..names import ALIASES, bundled_models
    from ..store.local import hub_cache, human, list_local, local_model

    if args.aliases:
        _table([[a, repo] for a, repo in ALIASES.items()], ["ALIAS", "HUB MODEL"])
        return 0
    bundled = [local_model(p.name, p) for p in bundled_models()]
    models = list_local()
    _table([[m.name, human(m.size), m.architecture, m.quantization,
             "bundled" if m.status == "ok" and m in bundled else m.status, str(m.path)]
            for m in bundled + models], ["NAME", "SIZE", "ARCH", "QUANT", "STATUS", "PATH"])
    if not models:
        print(f"no downloaded models in {hub_cache()} (get one with `mlxr pull ORG/REPO` or an "
              "alias, see `mlxr list --aliases`)", file=sys.stderr)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from ..onnx.folder import is_onnx_model
    from ..store.local import describe, human
    from .common import resolve_model

    path = resolve_model(args.model)
    if is_onnx_model(path):  # graph, claim report (each declined op, how many, why)
        from ..onnx.load import describe as describe_onnx

        print(f"model         {args.model}")
        for line in describe_onnx(path):
            print(line)
        return 0
    d = describe(path)
    yn = {True: "yes", False: "no", None: "auto"}
    print(f"model         {args.model}")
    print(f"path          {d['path']}")
    print(f"architecture  {d['architecture']} ({', '.join(d['architectures']) or '-'})")
    print(f"parameters    {d['layers']} layers, hidden {d['hidden_size']}, heads {d['heads']} "
          f"(kv {d['kv_heads']}, dim {d['head_dim']}), mlp {d['intermediate_size']}, "
          f"vocab {d['vocab_size']}")
    print(f"context       {d['context_length']}")
    print(f"tied embed    {yn[d['tie_word_embeddings']]}")
    print(f"dtype         {d['dtype'] or '?'}")
    print(f"quantization  {d['quantization']}")
    for k, v in d["overrides"].items():
        print(f"  {k}: {v or 'not quantized'}")
    print(f"chat template {yn[d['chat_template']]}")
    print(f"tools         {yn[d['tools']]}")
    print(f"thinking      {yn[d['thinking']]}")
    print(f"files         {len(d['files'])}, {human(d['size'])}")
    for f, s in d["files"]:
        print(f"  {f:<40} {human(s):>10}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from ..names import expand_alias
    from ..store.local import dir_size, human, parse_name, remove, repo_dir
    from .common import confirm

    hub = parse_name(expand_alias(args.model))
    if hub is None:
        raise MlxrError(f"{args.model}: rm takes a downloaded Hub model (ORG/REPO[@REVISION], "
                        "see `mlxr list`); delete local directories yourself")
    repo_id, revision = hub
    root = repo_dir(repo_id)
    if not root.is_dir():
        raise MlxrError(f"{args.model}: not downloaded (see `mlxr list`)")
    what = f"{args.model} ({human(dir_size(root))}, {root})"
    if not confirm(f"remove {what}?", args.yes):
        if not args.yes and not sys.stdin.isatty():
            raise MlxrError(f"not removing {args.model}: confirm with --yes")
        print("not removed", file=sys.stderr)
        return 1
    remove(repo_id, revision)
    print(f"removed {args.model}", file=sys.stderr)
    return 0
