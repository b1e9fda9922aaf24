"""Checks and drivers the decode-path suites share: a serving engine run to completion, and the
CUDA-graph decode step's form (`forward_static`) against the eager step."""

from __future__ import annotations

import torch

from mlxr.engine import EngineRequest, LLMEngine
from mlxr.engine.kv_cache import new_cache


def run_all(engine: LLMEngine, reqs: list[EngineRequest]) -> list[list]:
    """Add every request, step until the engine is idle; each request's RequestOutputs."""
    outs: list[list] = [[] for _ in reqs]
    for i, r in enumerate(reqs):
        engine.add(r, outs[i].append)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 10_000
    return outs


def ids_of(outs: list) -> list[int]:
    """The token ids of one request's RequestOutputs, in order."""
    return [t for o in outs for t in o.token_ids]


def run_ids(engine: LLMEngine, reqs: list[EngineRequest]) -> list[list[int]]:
    """`run_all`, each request's outputs as its token ids."""
    return [ids_of(out) for out in run_all(engine, reqs)]


def assert_static_step_equals_eager(dec, seq: list[int], prefill: int = 20,
                                    rtol_range: float = 1e-4) -> None:
    """Prefill seq[:prefill] into two caches, then step the rest one token at a time: eager
    `forward` on one, `forward_static` (device positions, whole-capacity attention under a
    mask) on the other; the logits agree within rtol_range of each step's logit range."""
    eager, static = new_cache(dec, 64), new_cache(dec, 64)
    tables = {}
    for rope in dec.ropes:
        tables.setdefault(id(rope.spec), rope.cos_sin(0, 64))
    with torch.inference_mode():
        dec.forward(torch.tensor(seq[:prefill]), eager, last_only=True)
        dec.forward(torch.tensor(seq[:prefill]), static, last_only=True)
        for p in range(prefill, len(seq)):
            want = dec.forward(torch.tensor([seq[p]]), eager, last_only=True)[0]
            got = dec.forward_static(torch.tensor([seq[p]]), torch.tensor([p]), static.pool,
                                     tables)[0]
            assert torch.allclose(got, want, rtol=0,
                                  atol=rtol_range * float(want.max() - want.min()))


def counted(monkeypatch, module, name: str) -> list:
    """Wrap module.name so each call appends to the returned list (how often a path ran)."""
    calls: list = []
    fn = getattr(module, name)

    def wrapped(*a, **kw):
        calls.append(1)
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)
    return calls
