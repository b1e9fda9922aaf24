"""The split-K / pair-parallel decode MoE kernels (mlxr.ops.moe.decode_split) under the CPU
interpreter, against the decode kernels' torch twins on fresh random stacked experts.

The split kernels differ from the fused ones only in the order of each row's fp32 sums (K in
chunks, the chunks added in order): the decode tests' bounds (tests/test_triton_moe_decode.py:
2*K*2^-24 * A per row, carried through the activation and the combine) hold unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_decode import check_down, check_gate_up

from mlxr.ops.moe import decode_split as S

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

# (mode, bits, group, global scale), config: K = 128 holds 2 (g64), 4 (g32), 8 (g16) groups
GATE_UP_CASES = [(("affine", 4, 64, False), S.DecodeConfig(16, 2, 4)),
                 (("nvfp4", 4, 16, True), S.DecodeConfig(16, 4, 2)),
                 (("mxfp8", 8, 32, False), S.DecodeConfig(None, 4, 4)),
                 (("affine", 3, 32, False), S.DecodeConfig(16, 3, 4))]  # 3 -> 2 chunks
DOWN_CASES = [(("affine", 8, 32, False), S.DecodeConfig(16, 1, 4)),  # pair-parallel, no split
              (("mxfp4", 4, 32, False), S.DecodeConfig(16, 4, 4)),
              (("nvfp4", 4, 16, True), S.DecodeConfig(None, 8, 4)),
              (("affine", 6, 64, False), S.DecodeConfig(16, 2, 4)),
              (("dense", 16, 0, False), S.DecodeConfig(16, 2, 4))]  # one group: no K split


def test_chunks_divide_the_groups():
    assert S.chunks(2048, 64, 8) == 8
    assert S.chunks(768, 64, 8) == 6  # 12 groups: the largest divisor <= 8
    assert S.chunks(128, 64, 3) == 2
    assert S.chunks(128, 128, 4) == 1
    assert S.chunks(128, 32, 0) == 1


@pytest.mark.parametrize("q_args,cfg", GATE_UP_CASES)
def test_gate_up_split(q_args, cfg):
    check_gate_up(q_args, "silu", 3, 2, 5 + q_args[1] + q_args[2], k=128,
                  fn=lambda *a: S.moe_gate_up_split(*a, config=cfg))


def test_gate_up_split_swiglu_bias():
    cfg = S.DecodeConfig(16, 2, 4)
    check_gate_up(("mxfp4", 4, 32, False), "swiglu_oai", 2, 3, 7, bias=True,
                  fn=lambda *a: S.moe_gate_up_split(*a, config=cfg))


@pytest.mark.parametrize("q_args,cfg", DOWN_CASES)
def test_down_split(q_args, cfg):
    check_down(q_args, 2, 3, 29 + q_args[1] * q_args[2],
               fn=lambda *a: S.moe_down_split(*a, config=cfg))


def test_down_split_bias_scale_bf16_weights():
    cfg = S.DecodeConfig(16, 2, 4)
    check_down(("affine", 4, 64, False), 3, 2, 7, torch.bfloat16, 2.5, bias=True,
               fn=lambda *a: S.moe_down_split(*a, config=cfg))
    check_down(("nvfp4", 4, 16, True), 1, 8, 9, scale=0.75, experts=10,
               fn=lambda *a: S.moe_down_split(*a, config=cfg))


def _last_group_doubled(q):
    """The stack with every row's last group of scales doubled (what a kernel that dropped
    or misplaced the last K chunk would disagree with)."""
    s = q.scales.clone()
    s[..., -1] = s[..., -1] * 2 if s.is_floating_point() else s[..., -1] + 8
    return dataclasses.replace(q, scales=s) if dataclasses.is_dataclass(q) else q._replace(
        scales=s)


def test_mutation_is_caught():
    """The bound is tight enough to see a wrong last chunk: the kernel fed a stack whose last
    group differs from the twin's fails the check."""
    cfg = S.DecodeConfig(16, 2, 4)
    with pytest.raises(AssertionError):
        check_down(("affine", 4, 64, False), 2, 2, 3,
                   fn=lambda h, ids, w, q, od, sc: S.moe_down_split(
                       h, ids, w, _last_group_doubled(q), od, sc, config=cfg))


def test_configs_from_env(monkeypatch):
    monkeypatch.delenv("MLXR_MOE_GATE_UP", raising=False)
    assert S.gate_up_config() == S.GATE_UP_DEFAULT
    monkeypatch.setenv("MLXR_MOE_GATE_UP", "8,4,2")
    monkeypatch.setenv("MLXR_MOE_DOWN", "0,1,8")
    monkeypatch.setenv("MLXR_MOE_DECODE_MAX_PAIRS", "64")
    assert S.gate_up_config() == S.DecodeConfig(8, 4, 2)
    assert S.down_config() == S.DecodeConfig(None, 1, 8)
    assert S.decode_max_pairs() == 64
