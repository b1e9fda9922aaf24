"""The command line itself: options anywhere, help with defaults, one-line usage errors, --device
and --port checks, bench defaults that fit the model, make_checkpoint's tokenizer copy."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mlxr
from mlxr.cli import build_parser, main, parse_args
from mlxr.cli.bench import fit_lengths
from mlxr.cli.common import BUNDLED, HelpFormatter
from mlxr.errors import TokenizerError

STORY = BUNDLED / "stories260K"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,want", [
    (["run", "stories260K", "--max", "4", "Once"],
     dict(model="stories260K", prompt="Once", max_tokens=4)),
    (["run", "--temp", "0", "stories260K", "--seed", "1", "Once", "--verbose"],
     dict(model="stories260K", prompt="Once", temperature=0.0, seed=1, verbose=True)),
    (["serve", "--port", "9000", "stories260K", "--device", "cpu", "other"],
     dict(model=["stories260K", "other"], port=9000, device="cpu")),
    (["stop", "--host", "http://127.0.0.1:9", "stories260K"],
     dict(model="stories260K", host="http://127.0.0.1:9")),
    (["bench", "-p", "8", "stories260K", "-n", "4"],
     dict(model="stories260K", prompt_len=8, num_tokens=4)),
    (["golden", "--prompt", "x", "stories260K", "--out", "g.json"],
     dict(model="stories260K", prompt="x", out="g.json")),
    (["check", "stories260K", "--tie-tol", "0.5", "g.json", "--free-run", "3"],
     dict(model="stories260K", golden="g.json", tie_tol=0.5, free_run=3)),
    (["bench-pair", "--pairs", "3", "stories260K", "--tokens", "4"],
     dict(model="stories260K", pairs=3, tokens=4)),
    (["pull", "-q", "qwen3"], dict(model="qwen3", quiet=True)),
    (["search", "-n", "3", "qwen", "--author", "mlx-community"],
     dict(query="qwen", limit=3, author="mlx-community")),
    (["ls", "--aliases"], dict(aliases=True)),
    (["rm", "qwen3", "-y"], dict(model="qwen3", yes=True)),
])
def test_options_go_anywhere_for_every_verb(argv, want):
    args = parse_args(argv)
    assert args.command == argv[0]
    assert {k: getattr(args, k) for k in want} == want


def test_every_verb_is_covered_and_every_argument_has_help():
    _, verbs = build_parser()
    assert set(verbs) == {"run", "serve", "ps", "stop", "bench", "golden", "check", "bench-pair",
                          "pull", "search", "list", "ls", "show", "rm"}
    for name, parser in verbs.items():
        fmt = HelpFormatter(parser.prog)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"mlxr {name} {action.option_strings or action.dest}: no help"
            # Every default worth knowing is stated: argparse's or the help's own words.
            if action.default not in (None, False, [], ""):
                assert "default" in fmt._get_help_string(action), (name, action.dest)
    text = " ".join(verbs["serve"].format_help().split())
    assert "(default: 8080)" in text and "(default: 127.0.0.1" in text


def test_golden_help_agrees_with_its_flags(capsys):
    _, verbs = build_parser()
    text = " ".join(verbs["golden"].format_help().split())
    assert "(default: CPU float32" in text  # what the description promises ...
    assert "--device {cpu,cuda} compute device (default: cpu)" in text  # ... the flags say too
    assert "(default: float32;" in text
    with pytest.raises(SystemExit) as e:  # a prompt is required, in one line
        main(["golden", "stories260K", "--out", "g.json"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "one of the arguments --prompt-file --prompt --prompt-ids is required" in err


@pytest.mark.parametrize("port", ["99999", "0", "-1", "65536", "http"])
def test_serve_refuses_bad_ports_in_one_line(port, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("mlxr serve: error: argument --port:") and "Traceback" not in err


def test_serve_accepts_the_port_range():
    assert parse_args(["serve", "--port", "1"]).port == 1
    assert parse_args(["serve", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("argv", [
    ["run", "stories260K", "hi"], ["serve"], ["bench"], ["golden", "--prompt", "x", "--out", "g"],
    ["check", "stories260K", "g.json"], ["bench-pair"],
])
def test_device_cuda_without_cuda_is_one_line(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*argv, "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CUDA is not available" in err, err
    assert "--device cpu" in err
    with pytest.raises(mlxr.MlxrError, match="CUDA is not available"):
        mlxr.load("stories260K", device="cuda")


@pytest.mark.parametrize("bad", ["0", "-2", "two", "100000"])
def test_threads_refuses_bad_counts_in_one_line(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--threads", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "argument --threads" in err and "Traceback" not in err


def test_threads_sets_torch_and_omp(monkeypatch):
    """--threads N reaches torch's pool and OMP_NUM_THREADS (an engine process inherits it)."""
    from mlxr.cli.common import apply_threads

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert parse_args(["run", "stories260K", "hi", "--threads", "1"]).threads == 1
    try:
        apply_threads(1)
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        apply_threads(None)  # not given: nothing changes
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_bench_defaults_fit_the_context():
    assert fit_lengths(None, None, 4096) == (512, 128, None)
    p, n, note = fit_lengths(None, None, 512)
    assert (p, n) == (256, 64) and "using -p 256 -n 64" in note
    assert fit_lengths(500, None, 512)[:2] == (500, 8)  # only the default is cut
    assert fit_lengths(600, 128, 512) == (600, 128, None)  # given: cmd_bench refuses them
    r = subprocess.run([sys.executable, "-m", "mlxr", "bench", "--repeats", "1"], text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "note: -p 512 -n 128 exceed the model's 512-token context" in r.stderr
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["prompt_tokens"] == 256 and res["decode_tokens"] == 64
    assert main(["bench", "-p", "512", "-n", "128", "--device", "cpu"]) == 1


def test_make_checkpoint_copies_only_tokenizer_files(tmp_path, make_checkpoint):
    mc = make_checkpoint
    src = tmp_path / "model"
    shutil.copytree(STORY, src)
    (src / "chat_template.jinja").write_text("{{ messages[0].content }}")
    out = tmp_path / "out"
    out.mkdir()
    copied = mc.copy_tokenizer(src, out)
    assert sorted(p.name for p in out.iterdir()) == copied
    assert "tokenizer.json" in copied and "chat_template.jinja" in copied
    assert not [n for n in copied if n.endswith(".safetensors") or n == "config.json"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"x")
    with pytest.raises(TokenizerError, match=f"{bare}: no tokenizer files"):
        mc.copy_tokenizer(bare, out)
