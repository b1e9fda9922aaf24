"""Model store verbs: pull, search, list, show, rm."""

from __future__ import annotations

import argparse
import sys

from ..errors import MlxrError


def register(sub) -> None:
    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub",
                       description="Download ORG/REPO[@REVISION] into the Hugging Face cache "
                       "(only the files a model needs), verify and validate it. Interrupted "
                       "downloads resume.")
    p.add_argument("model", metavar="ORG/REPO[@REVISION]")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("search", help="search the Hub for MLX text-generation models")
    p.add_argument("query", nargs="?", default="")
    p.add_argument("-n", "--limit", type=int, default=20)
    p.add_argument("--author", default=None, help="only this user/organisation "
                   "(e.g. mlx-community)")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("list", aliases=["ls"], help="list downloaded models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="describe a model: config, quantization, template, files")
    p.add_argument("model", metavar="MODEL", help="ORG/REPO[@REV], a directory or a bundled name")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="remove a downloaded model from the cache")
    p.add_argument("model", metavar="ORG/REPO[@REVISION]")
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
    from ..store.local import human

    hits = search(args.query, limit=args.limit, author=args.author)
    if not hits:
        print(f"no MLX text-generation models match {args.query!r}", file=sys.stderr)
        return 0
    _table([[h.repo_id, human(h.size) if h.size else "?", h.quantization or "?",
             f"{h.downloads:,}" if h.downloads is not None else "?"] for h in hits],
           ["NAME", "SIZE", "QUANT", "DOWNLOADS"])
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from ..store.local import hub_cache, human, list_local

    models = list_local()
    if not models:
        print(f"no models in {hub_cache()} (get one with `mlxr pull ORG/REPO`)", file=sys.stderr)
        return 0
    _table([[m.name, human(m.size), m.architecture, m.quantization, m.status, str(m.path)]
            for m in models], ["NAME", "SIZE", "ARCH", "QUANT", "STATUS", "PATH"])
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from ..store.local import describe, human
    from .common import resolve_model

    d = describe(resolve_model(args.model))
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
    from ..store.local import dir_size, human, parse_name, remove, repo_dir
    from .common import confirm

    hub = parse_name(args.model)
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
