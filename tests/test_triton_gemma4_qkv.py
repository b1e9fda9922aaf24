"""Gemma 4's q/k/v glue in one launch (`add_norm_qkv_rope.split_qkv_norm_rope_write`,
MLXR_GEMMA4_QKV_FUSED=1) vs its reference composition, in the CPU interpreter, and the decode
steps built on it (the single request's graph step and the slot pool's batched step) vs the
eager forward.

Tolerances: q and k as `qkv_rope_write`'s (tests/test_triton_layer.py: a norm with a weight
is two rounding points before RoPE); v is an RMSNorm, fp32 within 1e-5 relative + 1e-6, bf16
within two of the interpreter's truncating ulps (the normed value and the product with the
weight). Untouched cache slots are bit exact. The decoder steps: float32 logits within 1e-4 of
each step's range (tests/decode_checks.py's incremental-path bound).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from decode_checks import assert_static_step_equals_eager, ids_of, run_all  # noqa: E402
from hybrid_configs import FAMILIES  # noqa: E402
from test_triton_fused import check, gen  # noqa: E402
from test_triton_layer import check_rope_out  # noqa: E402

import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.engine import EngineRequest, LLMEngine  # noqa: E402
from mlxr.engine.slot_caches import SlotCaches  # noqa: E402
from mlxr.ops import reference as R  # noqa: E402
from mlxr.ops.layer import add_norm_qkv_rope as L  # noqa: E402
from mlxr.text.sampling import SamplingParams  # noqa: E402

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

DTYPES = (torch.float32, torch.bfloat16)
# N, H, K, D, R: Gemma's sliding layers rotate all features; its full layers are 512 wide
# with proportional RoPE (a quarter rotated); GQA and MHA
SHAPES = [(1, 4, 2, 32, 16), (3, 2, 1, 64, 8), (2, 4, 1, 512, 64)]


def case(seed, dtype, n, h, kh, d, r, k_eq_v, shared, v_weight, s=11):
    g = gen(seed)
    q = (torch.randn(n, h * d + 8, generator=g) * 2).to(dtype)[:, 3:3 + h * d]  # strided
    kv = None if shared else (torch.randn(n, kh * d * (1 if k_eq_v else 2), generator=g)
                              * 2).to(dtype)
    qn = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)
    kn = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)
    vn = {"none": None, "ones": torch.ones(d, dtype=dtype),
          "random": (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)}[v_weight]
    ang = torch.rand(n, r, generator=g) * 50
    kc = torch.randn(kh, s, d, generator=g).to(dtype)
    vc = torch.randn(kh, s, d, generator=g).to(dtype)
    slots = torch.randperm(s, generator=g)[:n]
    return q, kv, qn, kn, vn, ang.cos(), ang.sin(), kc, vc, slots


def run(op, c, h, kh, d, k_eq_v, positions=None, tables=None):
    q, kv, qn, kn, vn, cos, sin, kc, vc, slots = c
    kc, vc = kc.clone(), vc.clone()
    if tables is not None:
        cos, sin = tables
    out = op(q, kv, h, kh, d, qn, kn, vn, 1e-6, cos, sin, False, k_eq_v,
             None if kv is None else kc, None if kv is None else vc,
             None if kv is None else slots, positions)
    return out, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_eq_v", [False, True])
@pytest.mark.parametrize("v_weight", ["ones", "random", "none"])
@pytest.mark.parametrize("n,h,kh,d,r", SHAPES)
def test_split_qkv_norm_rope_write(dtype, k_eq_v, v_weight, n, h, kh, d, r):
    c = case(("g4qkv", str(dtype), k_eq_v, v_weight, n, h, kh, d, r), dtype, n, h, kh, d, r,
             k_eq_v, False, v_weight)
    q_f, kc_f, vc_f = run(L.split_qkv_norm_rope_write, c, h, kh, d, k_eq_v)
    q_r, kc_r, vc_r = run(R.split_qkv_norm_rope_write, c, h, kh, d, k_eq_v)
    slots = c[-1]
    check_rope_out(q_f, q_r, r, False, 2)
    check_rope_out(kc_f[:, slots].transpose(0, 1), kc_r[:, slots].transpose(0, 1), r, False, 2)
    v_f, v_r = vc_f[:, slots], vc_r[:, slots]
    if v_weight == "none":  # copied as the projection gave it
        assert torch.equal(v_f, v_r)
    elif dtype == torch.float32:
        check(v_f, v_r, 1e-5, 1e-6)
    else:
        check(v_f, v_r, 2 * 2**-7, 2**-20)
    if k_eq_v and v_weight != "none":  # v is k's columns normed, not rotated: not k's values
        assert not torch.equal(v_f, kc_f[:, slots])
    kept = torch.ones(kc_f.shape[1], dtype=torch.bool)
    kept[slots] = False
    assert torch.equal(kc_f[:, kept], c[7][:, kept])
    assert torch.equal(vc_f[:, kept], c[8][:, kept])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_shared_layer_writes_nothing(dtype):
    """kv None: q alone (grid of the q heads), equal to the reference's q."""
    c = case(("g4qkv-shared", str(dtype)), dtype, 2, 4, 2, 32, 16, False, True, "ones")
    q_f, _, _ = run(L.split_qkv_norm_rope_write, c, 4, 2, 32, False)
    q_r, _, _ = run(R.split_qkv_norm_rope_write, c, 4, 2, 32, False)
    check_rope_out(q_f, q_r, 16, False, 2)


def test_kv_shared_dummies_type_the_kv_branch(monkeypatch):
    """The compiler types the kv programs' branch even where none runs (the interpreter
    never does): a KV-shared launch's dummy slots must be an integer tensor, else CUDA
    fails to compile `slot * stride` (seen on an H100 in session 26)."""
    seen = {}
    real = L._qkv_rope_write_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen["slots"] = args[7]
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(L, "_qkv_rope_write_kernel", Spy())
    c = case(("g4qkv-dummy",), torch.bfloat16, 1, 4, 2, 32, 16, False, True, "ones")
    run(L.split_qkv_norm_rope_write, c, 4, 2, 32, False)
    assert not seen["slots"].dtype.is_floating_point
    assert seen["slots"].dtype in (torch.int32, torch.int64)


def test_positions_index_the_tables():
    """Whole cos / sin tables and device positions: the same bits as the rows gathered."""
    c = case("g4qkv-pos", torch.float32, 3, 2, 1, 64, 8, False, False, "ones")
    ang = torch.rand(40, 8, generator=gen("g4qkv-pos-ang")) * 50
    pos = torch.tensor([37, 2, 19])
    a = run(L.split_qkv_norm_rope_write, c, 2, 1, 64, False, pos, (ang.cos(), ang.sin()))
    b = run(L.split_qkv_norm_rope_write, c, 2, 1, 64, False, None,
            (ang.cos()[pos], ang.sin()[pos]))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.fixture(params=["gemma4_text", "gemma4"])
def model(request, tmp_path_factory, make_checkpoint):
    """Both with KV-shared layers; gemma4 with k = v on its full layers too."""
    path = make_checkpoint.write_hybrid(FAMILIES[request.param],
                                        tmp_path_factory.mktemp(request.param), None)
    m = mlxr.load(path, device="cpu", dtype="float32")
    spec = m.decoder.spec
    shared = any(src != i for i, src in enumerate(spec.kv_source))
    assert shared and any(spec.k_eq_v) == (request.param == "gemma4")
    return m


def _kernel_dispatch(monkeypatch) -> list:
    """ops.split_qkv_norm_rope_write on the kernel (as on CUDA with the switch on); the
    calls, by whether the layer wrote K/V."""
    calls = []

    def fused(*a):
        calls.append(a[1] is not None)
        return L.split_qkv_norm_rope_write(*a)

    monkeypatch.setattr(ops, "split_qkv_norm_rope_write", fused)
    return calls


def test_graph_step_on_the_fused_kernel(model, monkeypatch):
    calls = _kernel_dispatch(monkeypatch)
    rng = random.Random(3)
    assert_static_step_equals_eager(model.decoder, [rng.randrange(320) for _ in range(16)],
                                    prefill=10)
    assert True in calls and False in calls  # layers with their own K/V and KV-shared ones


def test_batched_slot_step_on_the_fused_kernel(model, monkeypatch):
    """The slot pool's static batched step (`forward_batch_static`, captured on CUDA) through
    the engine, three requests joining and leaving, one past the sliding window: each output
    equals its request generated alone on the composed ops."""
    prompts = [[random.Random(n).randrange(320) for _ in range(n)] for n in (3, 12, 7)]
    lengths = [6, 4, 8]
    alone = [list(model.generate(p, max_tokens=n, ignore_eos=True))
             for p, n in zip(prompts, lengths)]
    calls = _kernel_dispatch(monkeypatch)
    engine = LLMEngine(model, paged_decode=True, max_num_seqs=3)
    assert isinstance(engine.seq_caches, SlotCaches)
    reqs = [EngineRequest(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    assert [ids_of(o) for o in run_all(engine, reqs)] == alone
    assert True in calls
