"""The arena's correctness gate (issue #28) on the MoE families: a 512-token prompt, 64
teacher-forced steps and the exact tie rule, against a golden `mlxr golden` records from the
CPU float32 reference path.

Per family (tiny mlx-lm-made models in their shipped quant modes, Laguna in its NVFP4 recipe):
1. mlxr's reference path passes the gate against mlx-lm's own golden (same prompt, same 64
   steps): the golden it records is mlx-lm's computation, not only its own;
2. the MoE kernels (the Triton interpreter here; CUDA's path) pass the gate against the golden
   recorded from the reference path, teacher-forced over all 64 steps and free-running over
   the harness's default 16;
3. the gate can fail: the same check against the golden with one greedy token changed reports
   that position.
"""

from __future__ import annotations

import copy
import random

import pytest

import mlxr
from mlxr.cli import main
from mlxr.harness import goldens

mlx_ref = pytest.importorskip("mlx_ref")

PROMPT, STEPS = 512, 64
CASES = [("laguna", "laguna_nvfp4"), ("gpt_oss", "mxfp4")]


def _mlx_lm_golden(path, prompt: list[int]) -> dict:
    import mlx_lm

    ref = mlx_ref.reference(path, prompt, max_tokens=STEPS)
    ident = goldens.identity(path, "float32", "cpu", source="mlx-lm", version=mlx_lm.__version__)
    return goldens.build_golden(prompt, ref.greedy, ref.logits32, ident, 5)


@pytest.mark.parametrize("family,quant", CASES)
def test_arena_gate(family, quant, tmp_path, monkeypatch):
    path = mlx_ref.make_model(tmp_path / family, family, quant)
    rng = random.Random(f"arena-{family}")
    prompt = [rng.randrange(mlx_ref.BASE["vocab_size"]) for _ in range(PROMPT)]
    out = tmp_path / "golden.json"
    assert main(["golden", str(path), "--prompt-ids", ",".join(map(str, prompt)),
                 "--tokens", str(STEPS), "--top-k", "5", "--out", str(out)]) in (0, None)
    golden = goldens.load_golden(out)
    assert len(golden["prompt_ids"]) == PROMPT and len(golden["greedy"]) == STEPS

    # 1. the reference path against mlx-lm's golden
    reference = mlxr.load(path, device="cpu", dtype="float32")
    res = goldens.check_golden(reference, _mlx_lm_golden(path, prompt), free_run=None)
    assert res.ok, f"reference vs mlx-lm: {res.first.describe()}"

    # 2. the MoE kernels against the reference path's golden
    monkeypatch.setenv("MLXR_MOE", "stacked")
    candidate = mlxr.load(path, device="cpu", dtype="float32")
    blocks = [ly.moe for ly in candidate.decoder.layers if getattr(ly, "moe", None) is not None]
    assert blocks and all(b.quant is not None for b in blocks), "experts not on the kernels"
    for b in blocks:
        b.kernels = True
    res = goldens.check_golden(candidate, golden)
    assert res.ok, f"kernels vs reference golden: {res.first.describe()}"
    assert res.free_run_match == goldens.DEFAULT_FREE_RUN

    # 3. the gate fails where a token differs
    bad = copy.deepcopy(golden)
    step = STEPS // 2
    bad["greedy"][step] = (bad["greedy"][step] + 1) % mlx_ref.BASE["vocab_size"]
    bad["positions"][step]["token"] = bad["greedy"][step]
    fails, _, _ = goldens.gate_logits(
        bad, candidate.logits(bad["prompt_ids"] + bad["greedy"][:-1]).numpy())
    assert step in fails, "a changed golden token must fail the teacher-forced gate"
