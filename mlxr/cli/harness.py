"""Correctness and speed gates: `mlxr golden`, `mlxr check`, `mlxr bench-pair`."""

from __future__ import annotations

import json
import sys

from ..errors import MlxrError
from .common import add_model_flags, resolve_model


def register(sub) -> None:
    p = sub.add_parser("golden", help="record a golden token file (greedy + top-k logits)",
                       description="Record the prompt ids, greedy continuation and per-position "
                       "top-k logits of a model (default: CPU float32, the reference path).")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory or name, as for `mlxr run` (default: the bundled model)")
    _prompt_flags(p)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens to record")
    p.add_argument("--top-k", type=int, default=10, help="logits kept per position")
    p.add_argument("--out", required=True, help="golden JSON file to write")
    add_model_flags(p, device="cpu", dtype="float32")
    p.set_defaults(func=golden_cmd)

    p = sub.add_parser("check", help="gate a model against a golden file (exit 0/1)",
                       description="Teacher-forced gate (argmax = golden token, or a golden tie "
                       "within --tie-tol that includes ours) and free-run gate (the first K greedy "
                       "tokens must match exactly).")
    p.add_argument("model", help="model directory or name, as for `mlxr run`")
    p.add_argument("golden", help="golden JSON file")
    p.add_argument("--tie-tol", type=float, default=None,
                   help="absolute logit tolerance of a true tie (default 1e-6)")
    p.add_argument("--free-run", type=int, default=None, metavar="K",
                   help="greedy tokens that must match exactly (default 16; -1: all; 0: off)")
    p.add_argument("--ignore-identity", action="store_true",
                   help="check even if config/weights differ from the golden's model")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    add_model_flags(p, dtype="the golden file's dtype")
    p.set_defaults(func=check_cmd)

    from ..harness.pairbench import add_pair_args, run_pair

    p = sub.add_parser("bench-pair", help="paired A/B benchmark of two configurations",
                       description="Baseline A and candidate B in separate processes, timed "
                       "alternately; per-phase speedups, score, floors (exit 1 on regression).")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory or name, as for `mlxr run` (default: the bundled model)")
    add_pair_args(p)
    add_model_flags(p)
    p.set_defaults(func=run_pair)


def _prompt_flags(p) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-file", default=None,
                   help="prompt text file, or .json with a list of token ids")
    g.add_argument("--prompt", default=None, help="prompt text")
    g.add_argument("--prompt-ids", default=None, help="prompt token ids, comma separated")


def golden_cmd(args) -> int:
    import mlxr

    from ..harness import goldens

    path = resolve_model(args.model)
    model = mlxr.load(path, device=args.device or "cpu", dtype=args.dtype or "float32")
    if args.tokens < 1:
        raise MlxrError("--tokens must be at least 1")
    ids = goldens.read_prompt(model, args.prompt_file, args.prompt, args.prompt_ids)
    g = goldens.make_golden(model, ids, tokens=args.tokens, top_k=args.top_k)
    goldens.save_golden(g, args.out)
    print(f"wrote {args.out}: {len(ids)} prompt tokens, {len(g['greedy'])} greedy tokens, "
          f"top-{g['top_k']} ({g['identity']['device']}, {g['identity']['dtype']})")
    return 0


def check_cmd(args) -> int:
    import mlxr

    from ..harness import goldens, trace

    path = resolve_model(args.model)
    g = goldens.load_golden(args.golden)
    problems = goldens.check_identity(g, path)
    if problems and not args.ignore_identity:
        raise MlxrError(f"{args.golden}: {'; '.join(problems)} (--ignore-identity to check "
                        "anyway)")
    for msg in problems:
        print(f"warning: {msg}", file=sys.stderr)
    model = mlxr.load(path, device=args.device, dtype=args.dtype or g["identity"].get("dtype"))
    trace.instrument(model.decoder)  # per-step spans when MLXR_TRACE is set; else a no-op
    tol = goldens.DEFAULT_TIE_TOL if args.tie_tol is None else args.tie_tol
    k = goldens.DEFAULT_FREE_RUN if args.free_run is None else args.free_run
    res = goldens.check_golden(model, g, tie_tol=tol, free_run=None if k < 0 else k)
    where = f"{model.device.type}, {str(model.dtype).replace('torch.', '')}"
    print(f"teacher-forced: {res.positions - len(res.teacher_failures)}/{res.positions} "
          f"positions pass ({len(res.ties_accepted)} by the tie rule, tol {tol:g}) [{where}]")
    if res.free_run:
        print(f"free-run: {res.free_run_match}/{res.free_run} greedy tokens match")
    if res.first is not None:
        print(res.first.describe())
    if res.free_div is not None and res.free_div is not res.first:
        print(res.free_div.describe())
    print("PASS" if res.ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.to_json(), f, indent=1)
    return 0 if res.ok else 1
