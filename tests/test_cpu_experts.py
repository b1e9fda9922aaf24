"""One token's selected MoE experts in one C call (`mlxr.ops.cpu.experts`, `i4moe_run`) on
fresh random data: bit for bit the per-expert calls it replaces (`native.i4mm`, then
`fused.act_mul`, then `native.i4mm` per selected expert: each already tested against its
twin), close to its torch twin (`twins.i4_experts`, float32 sums in another order: a few bf16
ulps after two GEMVs and the activation), ids checked, and the MoE decode step of a tiny
mlx-lm model equal with the one call on and off (`MLXR_CPU_EXPERTS`), the call taken."""

from __future__ import annotations

import pytest
import torch

from mlxr.ops.cpu import experts, fused, native, twins

from test_cpu_kernels import _int4_copy

pytestmark = pytest.mark.skipif(not experts.serves(64, 64, 64, "silu"),
                                reason="i4mm not built for this CPU")


def _experts(x_count, e, f, group, pairs, g):
    """x_count random experts: ([(gate_up copy, pairs)], [(down copy, pairs)])."""
    def one(n, k):
        packed, sb, sz = _int4_copy(n, k, group, g)
        return packed, sz if pairs == "zeros" else sb

    return [one(2 * f, e) for _ in range(x_count)], [one(e, f) for _ in range(x_count)]


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("pairs", ["zeros", "biases", "tiles"])
@pytest.mark.parametrize("k", [1, 4])
def test_i4_experts_equal_the_per_expert_calls(group, pairs, k):
    g = torch.Generator().manual_seed(group + k)
    e, f, x_count = 256, 384, 6
    gate_up, down = _experts(x_count, e, f, group, pairs, g)
    x = (torch.randn(1, e, generator=g) * torch.randn(1, e, generator=g).exp()).to(torch.bfloat16)
    ids = torch.randperm(x_count, generator=g)[:k]
    got = experts.i4_experts(x, ids, gate_up, down, group, "silu", pairs)
    tab = fused.act_table("silu")
    loop = torch.cat([native.i4mm(fused.act_mul(native.i4mm(x, *gate_up[i], group,
                                                            torch.bfloat16, pairs), tab),
                                  *down[i], group, torch.bfloat16, pairs)
                      for i in ids.tolist()])
    assert torch.equal(got, loop)
    want = twins.i4_experts(x, ids, gate_up, down, group, "silu", pairs).float()
    scale = want.abs().amax(-1, keepdim=True)
    diff = (got.float() - want).abs()
    assert (diff <= 2 ** -5 * scale).all(), (diff / scale).max()
    assert (diff <= 2 ** -7 * want.abs()).float().mean() >= 0.9  # most within one bf16 ulp
    other = twins.i4_experts(x, ids.flip(0) if k > 1 else (ids + 1) % x_count, gate_up, down,
                             group, "silu", pairs).float()
    assert not ((got.float() - other).abs() <= 2 ** -5 * scale).all()


def test_i4_experts_checks_its_inputs():
    g = torch.Generator().manual_seed(1)
    gate_up, down = _experts(3, 128, 64, 64, "zeros", g)
    kern = experts.I4Experts(gate_up, down, 64, "silu")
    x = torch.randn(1, 128, generator=g).to(torch.bfloat16)
    for bad in ([0, 3], [-1]):
        with pytest.raises(ValueError, match="out of range"):
            kern(x, torch.tensor(bad))
    with pytest.raises(ValueError):
        kern(x.float(), torch.tensor([0]))
    with pytest.raises(ValueError):
        experts.I4Experts(gate_up, down, 64, "gelu_tanh")  # no table for this activation
    with pytest.raises(ValueError):
        experts.I4Experts(gate_up, down[:2], 64, "silu")


@pytest.mark.parametrize("family", ["qwen3_moe", "laguna"])
def test_moe_decode_equal_with_the_one_call(family, tmp_path, monkeypatch):
    """Six greedy bf16 decode steps of a tiny mlx-lm MoE model with the one call (default) and
    with the per-expert calls (MLXR_CPU_EXPERTS=0): logits equal bit for bit, and the one
    call ran for every MoE layer of every step."""
    import mlxr

    path = pytest.importorskip("mlx_ref").make_model(tmp_path, family, "q4g64")
    model = mlxr.load(path, device="cpu", dtype="bfloat16")
    dec = model.decoder
    calls: list = []
    orig = experts.I4Experts.__call__

    def counted(self, x, ids):
        calls.append(1)
        return orig(self, x, ids)

    monkeypatch.setattr(experts.I4Experts, "__call__", counted)
    from mlxr.engine.kv_cache import new_cache

    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MLXR_CPU_EXPERTS", flag)
        cache, rows = new_cache(dec, 64), []
        with torch.inference_mode():
            logits = dec.forward(torch.tensor([(7 * i + 3) % 300 for i in range(13)]), cache,
                                 last_only=True)
            for _ in range(6):
                logits = dec.forward(logits.argmax(-1).reshape(1), cache, last_only=True)
                rows.append(logits)
        out[flag] = torch.cat(rows)
        if flag == "0":
            assert not calls
    assert torch.equal(out["0"], out["1"])
    n_moe = sum(la.moe is not None for la in dec.layers)
    assert len(calls) == 6 * n_moe > 0
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths: the call is not taken
    with torch.inference_mode():
        dec.forward(torch.tensor([5]), new_cache(dec, 8), last_only=True)
    assert len(calls) == 6 * n_moe
