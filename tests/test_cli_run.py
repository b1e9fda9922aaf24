"""`mlxr run` and the text API on the bundled real model, driven as a person would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mlxr
from mlxr.cli.common import BUNDLED

STORY = BUNDLED / "stories260K"


@pytest.fixture(scope="module")
def author_text(assets) -> str:
    """Karpathy's published greedy output of stories260K (run.c, temperature 0)."""
    md = (assets / "models" / "stories260K" / "stories260K.md").read_text()
    block = md.split("-t 0.0\n", 1)[1].split("```", 1)[0]
    return block.strip()


def run_cli(*args, input=None, env=None, timeout=120):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "mlxr", *args], input=input, text=True,
                          capture_output=True, timeout=timeout, env=e)


def test_api_greedy_reproduces_author_text(author_text):
    model = mlxr.load(STORY, device="cpu")
    tok = model.tokenizer
    text = "".join(c.text for c in model.stream([tok.bos_token_id], max_tokens=200,
                                                temperature=0))
    # 200 tokens end mid-text: the generated text must be an exact prefix of the author's.
    assert len(text) > 450
    assert author_text.startswith(text), text
    # and the ids equal the author's text tokenized (first 20 are in the asset manifest)
    ids = list(model.generate([1], max_tokens=20))
    assert ids == [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426,
                   338, 401, 396, 267, 337]


def test_api_text_prompt_and_bundled_8bit_agree():
    fp = mlxr.load(STORY, device="cpu", dtype="float32")
    q8 = mlxr.load(BUNDLED / "stories260K-8bit", device="cpu", dtype="float32")
    a = list(fp.generate("Once upon a time", max_tokens=100))
    b = list(q8.generate("Once upon a time", max_tokens=100))
    assert a == b and len(a) == 100


def test_run_one_shot_reproduces_author_text(author_text):
    r = run_cli("run", "stories260K", "", "--temp", "0", "--max", "200", "--verbose")
    assert r.returncode == 0, r.stderr
    out = r.stdout.rstrip("\n")
    assert len(out) > 450 and author_text.startswith(out)
    assert re.search(r"prompt tokens:\s+1\b", r.stderr)
    assert re.search(r"generated tokens:\s+200\b", r.stderr)
    assert re.search(r"decode:\s+[\d.]+ tok/s", r.stderr)


def test_run_default_model_and_stdin_prompt():
    r = run_cli("run", "", "-", "--temp", "0", "--max", "12", input="Once upon a time")
    assert r.returncode == 0, r.stderr
    model = mlxr.load(STORY, device="cpu")
    want = "".join(c.text for c in model.stream("Once upon a time", max_tokens=12,
                                                temperature=0))
    assert r.stdout.rstrip("\n") == want


def test_run_seed_reproducible():
    args = ("run", "stories260K", "Once upon a time", "--temp", "1.0", "--max", "40")
    a = run_cli(*args, "--seed", "7").stdout
    b = run_cli(*args, "--seed", "7").stdout
    c = run_cli(*args, "--seed", "8").stdout
    assert a == b and a != c


@pytest.mark.parametrize("args,msg", [
    (("run", "no/such/model", "hi"), "not found"),
    (("run", "stories260K", "hi", "--top-p", "2"), "top_p"),
    (("run", "stories260K", "hi", "--temp", "-1"), "temperature"),
])
def test_run_bad_input_clear_error(args, msg):
    r = run_cli(*args)
    assert r.returncode == 1
    assert msg in r.stderr and "Traceback" not in r.stderr


def test_run_missing_tokenizer_and_too_long_prompt(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        (d / f).write_bytes((STORY / f).read_bytes())
    r = run_cli("run", str(d), "hi")
    assert r.returncode == 1 and "tokenizer" in r.stderr.lower() and "Traceback" not in r.stderr
    (d / "tokenizer.json").write_text("{not json")
    r = run_cli("run", str(d), "hi")
    assert r.returncode == 1 and "tokenizer.json" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("run", "stories260K", "Once upon a time " * 200)  # > 512-token context
    assert r.returncode == 1 and "context" in r.stderr and "Traceback" not in r.stderr


def test_run_template_that_raises(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in STORY.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message is "
        "required') }}{% endif %}{{ messages[0].content }}")
    r = run_cli("run", str(d), "hi")
    assert r.returncode == 1 and "a system message is required" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("run", str(d), "hi", "--system", "Once upon a time", "--max", "5")
    assert r.returncode == 0, r.stderr


def _greedy(prompt: str, n: int) -> str:
    model = mlxr.load(STORY, device="cpu")
    return "".join(c.text for c in model.stream(prompt, max_tokens=n, temperature=0))


def test_api_loads_the_names_the_cli_takes():
    assert mlxr.load("stories260K", device="cpu").path == STORY
    assert mlxr.validate("stories260K-8bit").model_type == "llama"
    with pytest.raises(mlxr.MlxrError, match="bundled model \\(stories260K, stories260K-8bit"):
        mlxr.load("stories261K")


def test_run_options_before_the_prompt():
    r = run_cli("run", "stories260K", "--temp", "0", "--max", "12", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == _greedy("Once upon a time", 12)


@pytest.mark.parametrize("args", [("-",), ("stories260K",), ()])
def test_run_reads_a_piped_prompt_without_banner(args):
    """`mlxr run -`, and a piped stdin without a prompt, answer the piped text once (its final
    newline, echo's, dropped): no banner, no '>>>' in the output."""
    r = run_cli("run", *args, "--temp", "0", "--max", "12", input="Once upon a time\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == _greedy("Once upon a time", 12)


def test_run_checks_the_tokenizer_before_loading_weights(tmp_path):
    """No tokenizer: one line naming the folder, before the weights are read (these are not even
    valid: reading them first would fail on the safetensors header instead)."""
    d = tmp_path / "no-tokenizer"
    d.mkdir()
    (d / "config.json").write_bytes((STORY / "config.json").read_bytes())
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    r = run_cli("run", str(d), "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert f"error: {d}: no tokenizer files (expected tokenizer.json" in r.stderr


def test_show_and_set_speak_plainly(capsys):
    from mlxr.cli.run import Session
    from mlxr.text.sampling import SamplingParams

    model = mlxr.load(STORY, device="cpu")
    session = Session(model, model.sampling_params(SamplingParams(max_tokens=50, seed=3)),
                      None, False)
    session.command("/show")
    out = capsys.readouterr().out
    assert "SamplingParams(" not in out and "None" not in out
    rows = dict(line.split(None, 1) for line in out.splitlines())
    assert rows == {"temp": "0", "top_p": "off", "top_k": "off", "min_p": "off",
                    "repeat_penalty": "off", "seed": "3", "max": "50", "system": "(none)"}
    for line, want in [
        ("/set temp abc", "error: /set temp: expected a number >= 0 (0 = greedy), got 'abc'"),
        ("/set temp -1", "error: /set temp: expected a number >= 0 (0 = greedy), got '-1'"),
        ("/set top_p 2", "error: /set top_p: expected a number in (0, 1] (1 = off), got '2'"),
        ("/set top_k 1.5", "error: /set top_k: expected a whole number >= 0 (0 = off), got "
         "'1.5'"),
        ("/set max 0", "error: /set max: expected a whole number >= 1 (tokens per answer), got "
         "'0'"),
        ("/set temp 0.7", "Set temp to 0.7."),
    ]:
        session.command(line)
        assert capsys.readouterr().out.strip() == want
    session.command("/set system Be brief.")
    capsys.readouterr()
    session.command("/show")
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["temp"] == "0.7" and rows["system"] == "Be brief."


pexpect = pytest.importorskip("pexpect")


def _spawn(*args, home: Path):
    env = dict(os.environ, MLXR_HOME=str(home), TERM="dumb")
    return pexpect.spawn(sys.executable, ["-m", "mlxr", "run", *args], env=env,
                         encoding="utf-8", timeout=60)


def test_interactive_chat_history_ctrl_c_and_bye(tmp_path):
    """A chat model (the story model with a minimal template): history is kept across turns,
    Ctrl-C stops an answer without leaving, /bye leaves."""
    d = tmp_path / "chat"
    d.mkdir()
    for f in STORY.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    # Each turn's prompt shows the whole conversation, so the history is visible in /show-free
    # form: the template renders user turns as "U:<text>" and the assistant turns verbatim.
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }} "
        "{% else %}{{ m.content }} {% endif %}{% endfor %}")
    child = _spawn(str(d), "--temp", "0", "--max", "8", "--verbose", home=tmp_path)
    child.expect(">>> ")
    child.sendline("Once upon a time")
    child.expect(r"prompt tokens:\s+(\d+)")
    first = int(child.match.group(1))
    child.expect(">>> ")
    child.sendline("The end")
    child.expect(r"prompt tokens:\s+(\d+)")
    second = int(child.match.group(1))
    assert second > first + 8  # the second prompt carries the first turn and its answer
    child.expect(">>> ")
    child.sendline("/set max 100000")
    child.expect("Set max")
    child.expect(">>> ")
    child.sendline("Lily")
    child.expect("Lily\r\n")  # the echo of the line
    child.expect(r"\w")  # the answer has started streaming
    child.sendintr()
    child.expect(">>> ", timeout=30)  # still in the session
    child.sendline("/clear")
    child.expect("Cleared")
    child.expect(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert (tmp_path / "history").is_file()  # readline history persisted


def test_interactive_ctrl_d_leaves(tmp_path):
    child = _spawn("stories260K", "--max", "5", home=tmp_path)
    child.expect("chat")  # the bundled model's story template
    child.expect(">>> ")
    child.sendline("Once upon a time")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
