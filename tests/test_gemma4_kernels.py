"""Gemma 4 (gemma4_text) on the attention kernels, as on CUDA (the Triton interpreter here),
against its torch path, with the full-attention layers 512 wide as Gemma 4 ships them (the
tiny config's other sizes stay small: the interpreter's cost grows with the tile, 512 is
still a few seconds): the decode graph's step (`forward_static`: `attention_at` over the
whole capacity, sliding rings through their clamped positions, KV-shared layers reading their
source's buffers, scale 1.0) and the serving engine's batched decode (`forward_batch`: the
padded K/V through the paged decode kernel). float32 logits within 1e-4 of each step's range
(the incremental-path bound of tests/decode_checks.py: the same math in other op shapes and
summation orders; the kernels' attention is within 1e-5 of max|v| of the reference)."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

pytest.importorskip("triton")

from decode_checks import assert_static_step_equals_eager  # noqa: E402
from hybrid_configs import FAMILIES  # noqa: E402

import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.models import gemma4  # noqa: E402
from mlxr.models.padded_attention import padded_decode_attention  # noqa: E402
from mlxr.ops.kv_attention import masked  # noqa: E402

WIDE = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory, make_checkpoint):
    cfg = copy.deepcopy(FAMILIES["gemma4_text"])
    cfg["global_head_dim"] = WIDE
    path = make_checkpoint.write_hybrid(cfg, tmp_path_factory.mktemp("gemma4-wide"), None)
    m = mlxr.load(path, device="cpu", dtype="float32")
    assert max(m.decoder.spec.head_dims) == WIDE
    return m


def _seq(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(320) for _ in range(n)]


def test_graph_step_on_the_attention_kernel(model, monkeypatch):
    calls = []

    def kernel(*a, **k):
        calls.append(a[0].shape[-1])
        return masked.attention_at(*a, **k)

    monkeypatch.setattr(ops, "attention_at", kernel)
    assert_static_step_equals_eager(model.decoder, _seq(22, 1), prefill=12)
    assert WIDE in calls and min(calls) < WIDE  # full and sliding layers took the kernel


def test_batched_decode_on_the_paged_kernel(model, monkeypatch):
    dec = model.decoder
    prompts = [_seq(n, n) for n in (3, 14, 9)]  # 14 > the window of 8: a wrapped ring

    def step(kernels: bool) -> torch.Tensor:
        monkeypatch.setattr(gemma4, "padded_decode_attention",
                            functools.partial(padded_decode_attention, kernels=kernels))
        caches = [new_cache(dec, 32) for _ in prompts]
        with torch.inference_mode():
            for c, p in zip(caches, prompts):
                dec.forward(torch.tensor(p), c, last_only=True)
            out = [dec.forward_batch(torch.tensor([5, 6, 7]), caches)]
            out.append(dec.forward_batch(torch.tensor([8, 9, 10]), caches))
        return torch.cat(out)

    want, got = step(False), step(True)
    rng = (want.max(-1).values - want.min(-1).values)[:, None]
    assert ((got - want).abs() <= 1e-4 * rng).all(), float(((got - want).abs() / rng).max())
