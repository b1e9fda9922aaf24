"""scripts/moe_gpu_perf.py's choice of defaults from its sweep (pure Python; the script's
--dry-run runs every section under the interpreter, minutes: not in CI): the decode configs
with the least time at T = 1, 2, the decode crossover, the fewest pairs where mm wins."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("moe_gpu_perf",
                                                  ROOT / "scripts" / "moe_gpu_perf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summarize_picks_defaults():
    m = _script()
    g0, d0 = m.GATE_UP_CFGS[0], m.DOWN_CFGS[0]
    g, d = m.GATE_UP_CFGS[5], m.DOWN_CFGS[3]
    base = f"dec g{m.cfg_name(g0)} d{m.cfg_name(d0)}"

    def dec(t):  # the split gate/up and pair-parallel down faster at T = 1, 2
        return {base: 3.0 * t, f"dec g{m.cfg_name(g)} d{m.cfg_name(d0)}": 2.0 * t,
                f"dec g{m.cfg_name(g0)} d{m.cfg_name(d)}": 2.5 * t}

    best = {1: {"triton": 9.0, "mm": 20.0, **dec(1)}, 2: {"triton": 9.0, "mm": 20.0, **dec(2)},
            8: {"triton": 9.0, "mm": 20.0, base: 10.0}, 64: {"triton": 30.0, "mm": 12.0},
            512: {"triton": 90.0, "mm": 15.0}}
    p = m.summarize("x", best, 8)
    assert p["gate_up"] == m.cfg_name(g) and p["down"] == m.cfg_name(d)
    assert p["decode_max_pairs"] == 16  # T = 2 (x k = 8) the last decode win
    assert p["mm_min_pairs"] == 512  # T = 64: mm first faster than triton


def _kernels_script():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("moe_gpu_kernels",
                                                  ROOT / "scripts" / "moe_gpu_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_abs_stack_of_dense_experts_is_abs_w(dtype):
    """The bound helper of the GPU checks: a dense stack's |W| keeps its shape and values (it
    once masked float bits as fp4/fp8 codes: a bf16 stack changed shape and the H100's check
    raised)."""
    import torch

    from mlxr import ops

    k = _kernels_script()
    w = torch.randn(3, 8, 16).to(getattr(torch, dtype))
    a = k.abs_stack(ops.moe_dense_experts(w))
    assert a.w.shape == w.shape and torch.equal(a.w, w.abs())
