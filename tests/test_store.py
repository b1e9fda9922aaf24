"""Model store: pull / search / list / show / rm against a fake Hub on loopback (no internet).

The fake Hub (tests/fake_hub.py) serves real model files: the bundled stories260K and a tiny
model made and saved by mlx-lm. huggingface_hub does the talking; HF_ENDPOINT points at the fake,
HF_HOME at a temporary directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from fake_hub import VALID_TOKEN, FakeHub, Fault
from huggingface_hub import constants

from mlxr.cli import main
from mlxr.cli.common import BUNDLED, ensure_model, resolve_model
from mlxr.errors import MlxrError, ModelFormatError

STORIES = BUNDLED / "stories260K"
NAME = "mlxr-test/stories260K"
CHUNK = 1 << 16
CUT = 4 * CHUNK + 1000  # the server cuts the weights file after this many bytes
BUNDLED_NAMES = ["stories260K", "stories260K-8bit"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    h = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
              "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    # No token from this machine's login, no offline flag from the import-time environment.
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # huggingface_hub writes what it receives in chunks of this size (10 MB by default); small
    # chunks let a 1 MB test file be cut and resumed mid-way.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A qwen3 model saved by mlx-lm with a mixed per-layer recipe, plus tokenizer files and a
    chat template that takes tools and has a thinking switch."""
    from mlx_ref import make_model

    out = make_model(tmp_path_factory.mktemp("tiny") / "m", "qwen3", "mixed")
    shutil.copy(STORIES / "tokenizer.json", out / "tokenizer.json")
    tmpl = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}"
            "{% endfor %}{% if enable_thinking %}<think>{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": tmpl}))
    return out


def cache(tmp_path) -> Path:
    return tmp_path / "hf" / "hub"


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def same_files(snap: Path, src: Path, names) -> None:
    for n in names:
        assert (snap / n).read_bytes() == (src / n).read_bytes(), n


# -- pull -----------------------------------------------------------------------------------------

def test_pull_bundled_model(hub, tmp_path, capsys):
    repo = hub.add_dir(NAME, STORIES, extra={"pytorch_model.bin": b"\0" * 64,
                                             "onnx/model.onnx": b"x", "flax_model.msgpack": b"y"})
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 0, err
    root = cache(tmp_path) / "models--mlxr-test--stories260K"
    snap = root / "snapshots" / repo.sha
    assert resolve_model(NAME) == snap
    assert (root / "refs" / "main").read_text() == repo.sha
    # Only what a model needs; each file a symlink to its blob, weights named by their sha256.
    assert sorted(p.name for p in snap.iterdir()) == sorted(p.name for p in STORIES.iterdir())
    same_files(snap, STORIES, [p.name for p in STORIES.iterdir()])
    weights = snap / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().name == repo.etag("model.safetensors")
    assert not list(root.rglob("*.incomplete"))
    assert "llama" in err and "quantization none" in err and "sha256 ok" in err
    # Other tools see the download through huggingface_hub's own cache lookup.
    found = huggingface_hub.try_to_load_from_cache(NAME, "config.json", cache_dir=cache(tmp_path))
    assert Path(found) == snap / "config.json"


def test_pull_mlx_lm_model(hub, tiny_model, capsys):
    name = "mlx-community/tiny-qwen3-mixed"
    hub.add_dir(name, tiny_model)
    rc, _, err = run(capsys, "pull", name)
    assert rc == 0, err
    assert "qwen3" in err and "4-bit affine g64 (+" in err
    snap = resolve_model(name)
    same_files(snap, tiny_model, [p.name for p in tiny_model.iterdir()])
    import mlxr

    assert mlxr.validate(snap).model_type == "qwen3"


def test_pull_complete_model_is_a_noop(hub, tmp_path, capsys):
    hub.add_dir(NAME, STORIES)
    assert run(capsys, "pull", NAME)[0] == 0
    blobs = {p: p.stat().st_mtime_ns for p in (cache(tmp_path)).rglob("blobs/*")}
    hub.requests.clear()
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 0 and "up to date" in err
    assert hub.resolves() == []  # no file metadata, no download: one repo-info call
    assert [r[1].split("?")[0] for r in hub.requests] == [f"/api/models/{NAME}"]
    assert {p: p.stat().st_mtime_ns for p in (cache(tmp_path)).rglob("blobs/*")} == blobs


def test_resume_after_connection_drop(hub, capsys):
    """The server cuts the connection mid-file: the download continues with a Range request."""
    hub.add_dir(NAME, STORIES)
    hub.faults[f"{NAME}/model.safetensors"] = Fault(drop_after=CUT)
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 0, err
    gets = [r for r in hub.resolves("GET") if r[1].endswith("model.safetensors")]
    assert len(gets) == 2 and "range" not in gets[0][2]
    assert gets[1][2]["range"] == f"bytes={4 * CHUNK}-"  # the whole chunks received
    same_files(resolve_model(NAME), STORIES, ["model.safetensors"])


def test_resume_across_runs(hub, tmp_path, capsys):
    """A pull that dies mid-file keeps what it received; the next pull continues from there."""
    hub.add_dir(NAME, STORIES)
    hub.faults[f"{NAME}/model.safetensors"] = Fault(drop_after=CUT, then_status=503)
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 1 and f"run `mlxr pull {NAME}` again to resume" in err
    assert "Traceback" not in err.split("\nerror: ")[1]  # one message (logging may warn before)
    partial = list(cache(tmp_path).rglob("*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size == 4 * CHUNK
    with pytest.raises(MlxrError, match="not completely downloaded"):
        resolve_model(NAME)

    hub.faults.clear()
    hub.requests.clear()
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 0, err
    assert "resuming model.safetensors" in err
    gets = [r for r in hub.resolves("GET") if r[1].endswith("model.safetensors")]
    assert [g[2].get("range") for g in gets] == [f"bytes={4 * CHUNK}-"]
    same_files(resolve_model(NAME), STORIES, ["model.safetensors"])
    assert not list(cache(tmp_path).rglob("*.incomplete"))


def test_checksum_mismatch_is_detected_and_not_kept(hub, tmp_path, capsys):
    repo = hub.add_dir(NAME, STORIES)
    hub.faults[f"{NAME}/model.safetensors"] = Fault(corrupt=True)
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 1 and "SHA-256" in err and "model.safetensors" in err
    root = cache(tmp_path) / "models--mlxr-test--stories260K"
    assert not (root / "blobs" / repo.etag("model.safetensors")).exists()
    assert not list(root.rglob("*.incomplete"))
    assert not (root / "snapshots" / repo.sha / "model.safetensors").exists()
    hub.faults.clear()
    assert run(capsys, "pull", NAME)[0] == 0
    same_files(resolve_model(NAME), STORIES, ["model.safetensors"])


def test_not_found_unauthorized_gated_messages(hub, monkeypatch, capsys):
    hub.add_dir("acme/private", STORIES, private=True)
    hub.add_dir("acme/gated", STORIES, gated=True)
    hub.add_dir(NAME, STORIES)

    def fails(name, *needles):
        rc, _, err = run(capsys, "pull", name)
        assert rc == 1 and err.splitlines()[-1].startswith("error: "), err
        for n in needles:
            assert n in err, err

    # Without a token the Hub answers 401 for a missing repo as for a private one.
    fails("nobody/nothing", "unauthorized (401)", "hf auth login")
    fails("acme/private", "unauthorized (401)", "private", "HF_TOKEN")
    fails("acme/gated", "is gated", "accept its terms")
    fails(f"{NAME}@v9", "revision not found")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_valid_token")
    fails("acme/private", "unauthorized (401)", "rejected your token")
    monkeypatch.setenv("HF_TOKEN", VALID_TOKEN)
    fails("nobody/nothing", "model not found on the Hub", "mlxr search")
    rc, _, err = run(capsys, "pull", "acme/private")
    assert rc == 0, err


def test_offline(hub, monkeypatch, capsys):
    hub.add_dir(NAME, STORIES)
    assert run(capsys, "pull", NAME)[0] == 0
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 0 and "HF_HUB_OFFLINE" in err and "llama" in err
    rc, _, err = run(capsys, "pull", "acme/other")
    assert rc == 1 and "HF_HUB_OFFLINE" in err and "not in the local cache" in err
    rc, _, err = run(capsys, "search", "qwen")
    assert rc == 1 and "HF_HUB_OFFLINE" in err
    assert hub.requests == []


def test_disk_space_checked_before_download(hub, monkeypatch, capsys):
    import mlxr.store.hub

    hub.add_dir(NAME, STORIES)
    monkeypatch.setattr(mlxr.store.hub, "_free_bytes", lambda path: 10_000)
    rc, _, err = run(capsys, "pull", NAME)
    assert rc == 1 and "not enough disk space" in err and "1.1 MB" in err
    assert hub.resolves() == []


def test_hf_hub_cache_env_is_respected(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    hub.add_dir(NAME, STORIES)
    assert run(capsys, "pull", NAME)[0] == 0
    assert resolve_model(NAME).is_relative_to(tmp_path / "elsewhere")
    assert not cache(tmp_path).exists()


# -- search ---------------------------------------------------------------------------------------

def test_search(hub, capsys):
    for rid, dl, params, kw in [
        ("mlx-community/Qwen3-4B-4bit", 500, {"U32": 500_000_000, "BF16": 100_000_000}, {}),
        ("mlx-community/Qwen3-0.6B-bf16", 900, {"BF16": 600_000_000}, {}),
        ("someone/Qwen3-4B-GGUF", 5000, None, {"tags": ["gguf"]}),
        ("mlx-community/Qwen3-VL-2B-4bit", 700, None, {"pipeline_tag": "image-text-to-text"}),
        ("mlx-community/Llama-3.2-1B-Instruct-4bit", 800, None, {}),
    ]:
        hub.add(rid, {"config.json": b"{}"}, downloads=dl, safetensors_params=params, **kw)
    rc, out, err = run(capsys, "search", "qwen3")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "QUANT", "DOWNLOADS"]
    assert [ln.split() for ln in lines[1:]] == [
        ["mlx-community/Qwen3-0.6B-bf16", "1.2", "GB", "bf16", "900"],
        ["mlx-community/Qwen3-4B-4bit", "2.2", "GB", "4bit", "500"],
    ]
    (query,) = [r[1] for r in hub.requests if r[1].startswith("/api/models?")]
    assert "filter=mlx" in query and "pipeline_tag=text-generation" in query
    rc, out, _ = run(capsys, "search", "--author", "nobody", "qwen3")
    assert rc == 0 and out == ""


# -- list / show / rm -----------------------------------------------------------------------------

def test_list_show_rm_roundtrip(hub, tiny_model, tmp_path, capsys):
    name = "mlx-community/tiny-qwen3-mixed"
    hub.add_dir(name, tiny_model)
    hub.add_dir(NAME, STORIES)
    assert run(capsys, "pull", name)[0] == 0
    assert run(capsys, "pull", NAME)[0] == 0
    snap = resolve_model(name)

    rc, out, _ = run(capsys, "list")
    assert rc == 0
    rows = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert set(rows) == {name, NAME, *BUNDLED_NAMES}
    assert "qwen3" in rows[name] and "4-bit affine g64" in rows[name] and str(snap) in rows[name]
    assert "llama" in rows[NAME] and "none (float32)" in rows[NAME]

    rc, out, _ = run(capsys, "show", name)
    assert rc == 0
    assert "architecture  qwen3" in out and "context       4096" in out
    assert "quantization  4-bit affine group 64" in out
    assert "model.layers.1.self_attn.v_proj: 8-bit affine group 64" in out
    assert "chat template yes" in out and "tools         yes" in out and "thinking      yes" in out
    assert "model.safetensors" in out and "config.json" in out
    rc, out, _ = run(capsys, "show", NAME)
    assert "chat template yes" in out and "tools         no" in out  # the story template

    # rm asks; without a terminal and without --yes nothing is removed.
    rc, _, err = run(capsys, "rm", name)
    assert rc == 1 and "--yes" in err and snap.is_dir()
    rc, _, err = run(capsys, "rm", "--yes", name)
    assert rc == 0 and not (cache(tmp_path) / "models--mlx-community--tiny-qwen3-mixed").exists()
    with pytest.raises(MlxrError, match=f"run `mlxr pull {name}`"):
        resolve_model(name)
    rc, out, _ = run(capsys, "list")
    assert [ln.split()[0] for ln in out.splitlines()[1:]] == [*BUNDLED_NAMES, NAME]
    rc, _, err = run(capsys, "rm", "-y", name)
    assert rc == 1 and "not downloaded" in err


def test_ensure_model(hub, capsys):
    hub.add_dir(NAME, STORIES)
    with pytest.raises(MlxrError, match=f"mlxr pull {NAME}"):
        ensure_model(NAME, allow_pull=False)
    path = ensure_model(NAME, allow_pull=True)
    assert path == resolve_model(NAME) and (path / "model.safetensors").is_file()
    assert ensure_model(None, allow_pull=False) == STORIES
    assert ensure_model("stories260K", allow_pull=False) == STORIES
    assert ensure_model(str(STORIES), allow_pull=False) == STORIES


def test_list_shows_bundled_models(hub, capsys):
    """The bundled models `run` takes by name are listed, with an empty cache too."""
    rc, out, err = run(capsys, "list")
    assert rc == 0
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    assert list(rows) == BUNDLED_NAMES
    assert rows["stories260K"][3:5] == ["llama", "none"] and "bundled" in rows["stories260K"]
    assert "8-bit" in rows["stories260K-8bit"] and "bundled" in rows["stories260K-8bit"]
    assert "no downloaded models" in err and "--aliases" in err


# -- aliases --------------------------------------------------------------------------------------

ALIAS_REPO = "mlx-community/Qwen3-0.6B-4bit"


def test_alias_table_is_listed_and_well_formed(capsys):
    from mlxr.names import ALIASES
    from mlxr.store.local import parse_name

    assert 10 <= len(set(ALIASES.values())) <= 15
    assert ALIASES["qwen3"] == ALIASES["qwen3:0.6b"] == ALIAS_REPO
    assert ALIASES["llama3.2"] == "mlx-community/Llama-3.2-1B-Instruct-4bit"
    for alias, repo in ALIASES.items():
        assert parse_name(repo) == (repo, None) and repo.startswith("mlx-community/"), repo
        assert parse_name(alias) is None, alias  # never mistaken for a Hub name
    rc, out, _ = run(capsys, "list", "--aliases")
    rows = dict(ln.split() for ln in out.splitlines()[1:])
    assert rc == 0 and rows == ALIASES


def test_alias_resolves_for_pull_run_show_rm_and_load(hub, tmp_path, capsys):
    import mlxr

    hub.add_dir(ALIAS_REPO, STORIES)
    # Not pulled yet: the message names the repo and the command, for the CLI and the API alike.
    with pytest.raises(MlxrError, match=r"qwen3 \(mlx-community/Qwen3-0.6B-4bit\) is not "
                       r"downloaded: run `mlxr pull qwen3`"):
        mlxr.load("qwen3")
    rc, _, err = run(capsys, "run", "qwen3", "hi")
    assert rc == 1 and "mlxr pull qwen3" in err
    rc, _, err = run(capsys, "pull", "qwen3")
    assert rc == 0, err
    snap = resolve_model(ALIAS_REPO)
    assert resolve_model("qwen3") == resolve_model("Qwen3:latest") == snap
    assert mlxr.load("qwen3:0.6b", device="cpu").path == snap
    rc, out, err = run(capsys, "run", "qwen3", "--max", "3", "Once")
    assert rc == 0 and out.strip(), err
    rc, out, _ = run(capsys, "show", "qwen3")
    assert rc == 0 and f"path          {snap}" in out
    rc, _, err = run(capsys, "rm", "qwen3", "--yes")
    assert rc == 0 and not snap.exists()


def test_unknown_short_name_suggests_an_alias(capsys):
    with pytest.raises(MlxrError, match=r"did you mean qwen3 \(mlx-community/Qwen3-0.6B-4bit\)"):
        resolve_model("qwen")
    with pytest.raises(MlxrError, match=r"did you mean llama3\.2"):
        resolve_model("lama3.2")
    with pytest.raises(MlxrError, match="not found") as e:
        resolve_model("xyzzy")
    assert "did you mean" not in str(e.value)


def test_search_suggests_an_alias(hub, capsys):
    hub.add(ALIAS_REPO, {"config.json": b"{}"}, downloads=5)
    rc, out, err = run(capsys, "search", "qwen3")
    assert rc == 0 and ALIAS_REPO in out
    assert f"qwen3 is an alias of {ALIAS_REPO}" in err
    rc, out, err = run(capsys, "search", "qwen3.5")  # nothing on this Hub matches
    assert rc == 0 and out == ""
    assert f"no MLX text-generation models match 'qwen3.5'; try the alias qwen3 ({ALIAS_REPO})" \
        in err


def test_search_and_pull_fail_fast_when_the_hub_is_unreachable(hub, monkeypatch, capsys):
    """Nothing listens at the endpoint: one line at once, not huggingface_hub's five retries
    with backoff (~25 s)."""
    import socket
    import time

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for argv in (["search", "qwen3"], ["pull", NAME]):
        t = time.monotonic()
        rc, _, err = run(capsys, *argv)
        assert time.monotonic() - t < 5
        assert rc == 1 and "cannot reach the Hugging Face Hub" in err
        assert len(err.strip().splitlines()) == 1 + (argv[1] == "qwen3"), err


# -- unsupported formats --------------------------------------------------------------------------

def _dir(tmp_path, name, files) -> Path:
    d = tmp_path / name
    d.mkdir()
    for f, data in files.items():
        (d / f).write_bytes(data)
    return d


def test_unsupported_local_formats_are_explained(tmp_path, capsys):
    cfg = (STORIES / "config.json").read_bytes()
    cases = {
        "gguf": ({"model-Q4_K_M.gguf": b"GGUF"}, "GGUF model"),
        "bin": ({"config.json": cfg, "pytorch_model.bin": b"\0"}, "PyTorch pickle weights only"),
        "mamba": ({"config.json": b'{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}',
                   "model.safetensors": b"\0"}, "architecture 'mamba' (MambaForCausalLM) is not"),
    }
    for name, (files, needle) in cases.items():
        d = _dir(tmp_path, name, files)
        rc, _, err = run(capsys, "show", str(d))
        assert rc == 1 and needle in err, err
        with pytest.raises(ModelFormatError, match=r"\(mlx-community|mlx_lm.convert|supported"):
            ensure_model(str(d), allow_pull=False)


def test_unsupported_hub_repos_refused_before_download(hub, capsys):
    hub.add("acme/Model-GGUF", {"model-Q4_K_M.gguf": b"GGUF" * 100, "README.md": b"hi"})
    hub.add("acme/mamba-mlx", {"config.json": b'{"model_type": "mamba"}',
                               "model.safetensors": b"\0" * 100})
    rc, _, err = run(capsys, "pull", "acme/Model-GGUF")
    assert rc == 1 and "GGUF" in err and "mlxr search" in err
    rc, _, err = run(capsys, "pull", "acme/mamba-mlx")
    assert rc == 1 and "'mamba' is not supported" in err
    assert hub.resolves() == []


def test_pull_and_rm_by_commit(hub, tmp_path, capsys):
    repo = hub.add_dir(NAME, STORIES)
    assert run(capsys, "pull", f"{NAME}@{repo.sha}")[0] == 0
    root = cache(tmp_path) / "models--mlxr-test--stories260K"
    assert not (root / "refs" / "main").exists()  # a commit is not a ref
    rc, out, _ = run(capsys, "list")
    assert out.splitlines()[1 + len(BUNDLED_NAMES)].split()[0] == f"{NAME}@{repo.sha[:12]}"
    assert resolve_model(f"{NAME}@{repo.sha}") == root / "snapshots" / repo.sha
    rc, _, err = run(capsys, "rm", "--yes", f"{NAME}@{repo.sha}")
    assert rc == 0, err
    assert not root.exists() and not (cache(tmp_path) / ".locks" / root.name).exists()
