"""Tensor parallelism on the CPU (gloo, 2 and 4 processes that mlxr starts itself): tiny
random models made and quantized by mlx-lm, TP=N against the single-process model.

Tolerance: the ranks compute the same float32 math as one process; only sums are regrouped
(o_proj's and down_proj's input columns are reduced in N partial sums, then all-reduced, and
their bias is added after or before that sum), i.e. a summation-order difference, the same
kind test_parity.py allows between mlxr and mlx-lm: logits within 1e-3 of each position's
logit range (measured here: 4e-7 to 2.5e-6 of the range), greedy tokens equal wherever
TP=1's top two logits are further apart than twice that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

mlx_ref = pytest.importorskip("mlx_ref")

import mlxr  # noqa: E402
from decode_checks import run_ids  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.errors import ModelFormatError  # noqa: E402
from mlxr.parallel import TensorParallelError  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

F32_TOL = 1e-3
TIE_TOL = 2 * F32_TOL
GEN = 12
os.environ["NCCL_NVLS_ENABLE"] = "0"  # every process this file starts (the ranks inherit it)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, quant) -> model directory, made on first use; loaded models are cached."""
    root = tmp_path_factory.mktemp("tp")
    made: dict = {}

    def get(family: str, quant: str) -> Path:
        if (family, quant) not in made:
            made[family, quant] = mlx_ref.make_model(root / f"{family}-{quant}", family, quant)
        return made[family, quant]

    return get


@pytest.fixture(scope="module")
def loaded(models):
    """(family, quant, N) -> a float32 CPU model over N ranks (closed at the module's end)."""
    cache: dict = {}

    def get(family: str, quant: str, world: int):
        key = (family, quant, world)
        if key not in cache:
            cache[key] = mlxr.load(models(family, quant), device="cpu", dtype="float32",
                                   tensor_parallel=world)
        return cache[key]

    yield get
    for m in cache.values():
        m.close()


def _check_logits(one: torch.Tensor, many: torch.Tensor) -> None:
    a, b = one.numpy(), many.numpy()
    scale = mlx_ref.logit_range(a)
    err = np.abs(a - b).max(-1)
    assert (err <= F32_TOL * scale).all(), f"max {float((err / scale).max()):.2e} of the range"
    clear = mlx_ref.top2_margin(a) > TIE_TOL * scale
    assert (a.argmax(-1) == b.argmax(-1))[clear].all()


@pytest.mark.parametrize("family,quant,world", [
    ("llama_tp", "q4g64", 2), ("llama_tp", "q4g64", 4), ("llama_tp", "q8g64", 2),
    ("qwen3", "bf16", 2), ("mixtral", "q4g64", 2), ("qwen3_moe", "bf16", 4),
    ("gpt_oss", "bf16", 2), ("laguna", "bf16", 2), ("phi3", "q4g64", 2)])
def test_logits_and_greedy_equal_one_process(loaded, family, quant, world):
    """Teacher-forced float32 logits and greedy decode (prefill, then one token at a time
    through the KV cache) of N ranks equal the single-process model's: dense 4-/8-bit with
    an untied head, biases and, at N=4, KV heads replicated; a tied bf16 head with q/k norms;
    mixture-of-experts 4-bit (mixtral), at 4 ranks beside a dense layer (qwen3_moe), with
    attention sinks and expert biases (gpt-oss), per-layer head counts, a head gate and a
    shared expert (laguna); fused qkv_proj and gate_up_proj cut in three / two row ranges
    (phi3, 4-bit)."""
    one, many = loaded(family, quant, 1), loaded(family, quant, world)
    prompt = mlx_ref.stable_prompt(family, quant, mlx_ref.BASE["vocab_size"])
    greedy = list(one.generate(prompt, max_tokens=GEN, ignore_eos=True))
    _check_logits(one.logits(prompt + greedy), many.logits(prompt + greedy))
    assert list(many.generate(prompt, max_tokens=GEN, ignore_eos=True)) == greedy


@pytest.mark.parametrize("family,world", [("llama_tp", 4), ("phi3", 2)])
def test_a_rank_reads_only_its_slices(models, family, world, monkeypatch):
    """Building a rank's decoder never reads a split tensor whole (those come through
    safetensors' get_slice), and its split weights hold ~1/N of each tensor's bytes."""
    from mlxr.checkpoint import Checkpoint, open_checkpoint
    from mlxr.config import load_config
    from mlxr.models.loader import build_decoder
    from mlxr.parallel.plan import make_plan
    from mlxr.parallel.sharded_checkpoint import ShardedCheckpoint

    path = models(family, "q4g64")
    config, _ = load_config(path)
    whole: list[str] = []
    read = Checkpoint.load
    monkeypatch.setattr(Checkpoint, "load", lambda self, name: whole.append(name) or
                        read(self, name))
    with open_checkpoint(path) as ckpt:
        plan = make_plan(config, world, world - 1)
        view = ShardedCheckpoint(ckpt, plan)
        build_decoder(view, plan.local, torch.float32, torch.device("cpu"))
        split = [n for n, info in view.tensors.items() if info.shape != ckpt.tensors[n].shape]
        assert split and not set(split) & set(whole)
        for n in split:
            full, mine = ckpt.tensors[n].nbytes, view.tensors[n].nbytes
            assert mine * world == full or (n.split(".")[-2] in ("k_proj", "v_proj")
                                            and mine * config.num_kv_heads == full)


def test_one_rank_is_the_plain_load(models):
    """tensor_parallel=1 is today's load: the same decoder class, bit-identical logits."""
    path = models("llama_tp", "q4g64")
    plain = mlxr.load(path, device="cpu", dtype="float32")
    one = mlxr.load(path, device="cpu", dtype="float32", tensor_parallel=1)
    assert type(one.decoder) is type(plain.decoder)
    ids = mlx_ref.stable_prompt("llama_tp", "q4g64", mlx_ref.BASE["vocab_size"])
    assert torch.equal(one.logits(ids), plain.logits(ids))


def test_splits_that_cut_groups_or_heads_are_refused(models):
    """Before any worker starts: a split through a quantization group names the tensor; a
    head count that does not divide names the key."""
    q4 = models("qwen3", "q4g64")  # o_proj's 128 inputs in groups of 64: 4 ranks cut them
    cut = r"o_proj.*128 input columns at 0..32 would cut a quantization group of 64"
    with pytest.raises(ModelFormatError, match=cut):
        mlxr.load(q4, device="cpu", dtype="float32", tensor_parallel=4)
    with pytest.raises(ModelFormatError, match="num_key_value_heads = 2 neither splits"):
        mlxr.load(q4, device="cpu", dtype="float32", tensor_parallel=3)
    with pytest.raises(mlxr.MlxrError, match="tensor_parallel=0"):
        mlxr.load(q4, device="cpu", tensor_parallel=0)


@pytest.mark.parametrize("paged", [None, True])
def test_engine_batch_equals_one_process(loaded, paged):
    """The serving engine over 2 ranks (continuous batching, small prefill chunks, with
    paged=True the paged decode step) gives the single-process engine's greedy tokens."""
    prompts = [mlx_ref.stable_prompt("llama_tp", str(n), mlx_ref.BASE["vocab_size"], n)
               for n in (5, 17, 11)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def run(world):
        engine = LLMEngine(loaded("llama_tp", "q4g64", world), max_num_seqs=3,
                           max_num_batched_tokens=13, paged_decode=paged)
        return run_ids(engine, [EngineRequest(p, params) for p in prompts])

    assert run(2) == run(1)


def test_a_dead_worker_is_a_clear_error_within_seconds(models):
    """SIGKILL one follower: rank 0's next call fails at once naming the rank and its exit;
    the other followers are stopped (no process left waiting in a collective)."""
    m = mlxr.load(models("llama_tp", "q4g64"), device="cpu", dtype="float32", tensor_parallel=4)
    procs = m.decoder._team.procs
    try:
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 2 \(pid \d+\) died \(exit code -9"):
            m.logits([1, 2, 3])
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 10
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(p.poll() is not None for p in procs)
    finally:
        m.close()


DRIVER = """
import os, sys, mlxr
m = mlxr.load(sys.argv[1], device="cpu", dtype="float32", tensor_parallel=2)
print(" ".join(str(p.pid) for p in m.decoder._team.procs), flush=True)
m.logits([1, 2, 3])
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_workers_end_with_rank_zero(models, how):
    """A script that loads a TP model (no __main__ guard) and exits, or is SIGKILLed, leaves
    no worker behind: stopped at exit, or ending themselves when rank 0 is gone."""
    cwd = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", DRIVER, str(models("llama_tp", "q4g64")), how],
                         capture_output=True, text=True, cwd=cwd, timeout=120)
    assert out.returncode == (0 if how == "exit" else -9), out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))


def _alive(pid: int) -> bool:
    """Running (a zombie that its new parent has not reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read(path: Path) -> bytes:
    """A /proc file's bytes, or b"" when its thread or process has exited since it was listed
    (a server's threads come and go while the test walks them)."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        for child in _read(task / "children").split():
            out += [int(child), *_children(int(child))]
    return out


def _workers(pid: int) -> list[int]:
    return [c for c in _children(pid)
            if b"mlxr.parallel.worker" in _read(Path(f"/proc/{c}/cmdline"))]


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_server_answers_over_two_ranks(engine_process):
    """`mlxr serve --tensor-parallel 2 --device cpu` (the engine in the server process, or
    in its engine process, as rank 0) answers the openai client with the single-process
    model's greedy text, and leaves no worker behind when it stops."""
    import openai
    from test_server_helpers import BUNDLED, Server

    s = Server(BUNDLED, "--tensor-parallel", "2", "--device", "cpu", "--engine-process",
               engine_process)
    try:
        workers = _workers(s.proc.pid)
        assert len(workers) == 1
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        got = client.completions.create(model=Path(BUNDLED).name, prompt="Once upon a time",
                                        max_tokens=16, temperature=0)
    finally:
        s.stop()
    model = mlxr.load(BUNDLED, device="cpu", dtype="float32")
    want = "".join(c.text for c in model.stream("Once upon a time", max_tokens=16,
                                                temperature=0))
    assert got.choices[0].text == want
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, workers))


def test_a_stalled_worker_times_out_with_a_clear_error(models, monkeypatch):
    """SIGSTOP one follower (alive, never answering): the step's collective times out after
    MLXR_TP_TIMEOUT seconds, and rank 0 raises one error saying the ranks are out of step;
    the followers are ended."""
    monkeypatch.setenv("MLXR_TP_TIMEOUT", "3")
    m = mlxr.load(models("llama_tp", "q4g64"), device="cpu", dtype="float32", tensor_parallel=2)
    procs = m.decoder._team.procs
    try:
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="out of step"):
            m.logits([1, 2, 3])
        assert time.monotonic() - t0 < 3 + 10
        with pytest.raises(TensorParallelError, match="out of step"):
            m.logits([1, 2, 3])
        assert all(p.poll() is not None for p in procs)
    finally:
        m.close()


def test_ctrl_c_stops_mlxr_run_and_its_workers():
    """Ctrl-C (SIGINT) while `mlxr run --tensor-parallel 2` generates: the reply stops at the
    end of the step in flight, the process exits, and its worker with it."""
    from test_server_helpers import BUNDLED

    cmd = [sys.executable, "-m", "mlxr", "run", str(BUNDLED), "Once upon a time", "--device",
           "cpu", "--tensor-parallel", "2", "--max", "400"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         cwd=Path(__file__).resolve().parents[1],
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.read(8)  # generating
        workers = _workers(p.pid)
        assert len(workers) == 1
        p.send_signal(signal.SIGINT)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode in (0, 130), p.stdout.read().decode()[-2000:]
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, workers))
