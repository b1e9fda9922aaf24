"""The fused gated DeltaNet decode step (issue 29) on one GPU call, under 3 minutes. Each part
runs in its own try/except: a failure prints FAIL and the next part runs.

    PYTHONPATH=. python scripts/hybrid_gpu_perf.py DIR          # CUDA: DIR holds checkpoints
    PYTHONPATH=. python scripts/hybrid_gpu_perf.py DIR --tiny   # CPU, Triton interpreter
    (--only kernel | decode: one part)

1. kernel: `recurrent.gated_delta_decode` (one launch) vs its twin (the reference ops composed)
   at the qwen3.5-0.8b / 2b layer shape (Hk = Hv = 16, Dk = Dv = 128, conv 4; both sizes share
   it) and qwen3-next's (Hv = 32: GQA ratio 2), float32 and bf16, B = 1 and 8, three steps
   with the states carried: worst output / state difference against test_triton_gdn_decode's
   bounds, then the time per step in a CUDA graph of the kernel, of the op-by-op path
   (MLXR_GDN_FUSED=0's: the conv and recurrence kernels beside torch ops) and of the twin.
2. decode: the qwen3.5-0.8b and qwen3.5-2b shapes (make_checkpoint, 4-bit g64, full depth,
   DIR/graph-<shape>, bf16) in the CUDA graph (MLXR_HYBRID_GRAPHS=1), prompt 512, 128 tokens,
   MLXR_GDN_FUSED=1 and 0 alternating (each path's graph captured once in the warm-up round,
   put back when the path is selected), median of 3; kernels per eager
   decode step (counted as benchmarks/gpu/gpu_profile.py does); greedy tokens fused == unfused
   (a first difference allowed only at a near-tie: top-2 margin of the unfused path's eager
   logits under 10% of the range, hybrid_gpu_check's rule).
--tiny: the same parts at tiny shapes on the CPU (hybrid_configs' qwen3_5; ops forced onto
the Triton kernels as the tests force them; aten ops + Triton launches per step counted
instead of kernels).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
os.environ.setdefault("MLXR_HYBRID_GRAPHS", "1")
import mlxr  # noqa: E402
from mlxr import generate, ops  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.ops.recurrent import gated_delta_decode as K  # noqa: E402
from mlxr.ops.recurrent import reference as R  # noqa: E402

ULP, TIE = 2.0**-7, 0.1
FAILED: list[str] = []


def part(name: str):
    """Run fn, printing FAIL (and going on) if it raises."""
    def wrap(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                fn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - one part's failure must not stop the rest
                FAILED.append(name)
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
        return run
    return wrap


def old_path(proj, conv_state, ssm_state, conv_w, a_log, dt_bias, norm_w, heads, eps):
    """The mixer's op-by-op decode step (MLXR_GDN_FUSED=0): ops.conv1d_silu and ops.gated_delta
    (Triton on CUDA) between the reference's torch ops."""
    hk, hv, dk, dv = heads
    bsz, key, val = proj.shape[0], hk * dk, hv * dv
    qkv, z, b, a = proj[:, None].split([2 * key + val, val, hv, hv], -1)
    mixed, new_conv = ops.conv1d_silu(qkv, conv_state, conv_w)
    conv_state.copy_(new_conv)
    q, k, v = mixed.split([key, key, val], -1)
    q, k = R.l2norm_qk(q.reshape(bsz, 1, hk, dk), k.reshape(bsz, 1, hk, dk))
    g, beta = R.delta_gates(a, b, a_log, dt_bias)
    y = ops.gated_delta(q, k, v.reshape(bsz, 1, hv, dv), g, beta, ssm_state)
    return R.rms_norm_gated(y, z.reshape(bsz, 1, hv, dv), norm_w, eps).reshape(bsz, val)


def _operands(heads, dtype, bsz, dev, seed=0):
    hk, hv, dk, dv = heads
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    layer = ((torch.randn(c, 4, generator=g) * 0.5).to(dtype), torch.randn(hv, generator=g) * 0.5,
             torch.randn(hv, generator=g).to(dtype), (1 + 0.1 * torch.randn(dv, generator=g)
                                                      ).to(dtype))
    states = (torch.randn(bsz, 3, c, generator=g).to(dtype),
              torch.randn(bsz, hv, dv, dk, generator=g) * 0.3)
    projs = [torch.randn(bsz, c + hv * dv + 2 * hv, generator=g).to(dtype) for _ in range(3)]
    to = lambda ts: [t.to(dev) for t in ts]  # noqa: E731
    return to(layer), to(states), to(projs)


def _steps(fn, heads, dtype, bsz, dev):
    (conv, a_log, dt, norm), (cs, ss), projs = _operands(heads, dtype, bsz, dev)
    outs = [fn(p, cs, ss, conv, a_log, dt, norm, heads, 1e-6) for p in projs]
    return torch.stack(outs).float().cpu(), ss.cpu()


def _time_us(fn, heads, dtype, bsz, dev) -> float:
    (conv, a_log, dt, norm), (cs, ss), projs = _operands(heads, dtype, bsz, dev)
    if dev != "cuda":
        return float("nan")
    from gpu_timing import graph_time_us
    return graph_time_us([lambda: fn(projs[0], cs, ss, conv, a_log, dt, norm, heads, 1e-6)])


@part("kernel")
def kernel_part(dev: str, tiny: bool) -> None:
    shapes = ({"tiny gqa2": (2, 4, 32, 48)} if tiny else
              {"qwen3.5-0.8b/2b": (16, 16, 128, 128), "qwen3-next": (16, 32, 128, 128)})
    for name, heads in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            for bsz in (1, 2) if tiny else (1, 8):
                y, s = _steps(K.gated_delta_decode, heads, dtype, bsz, dev)
                y_ref, s_ref = _steps(R.gated_delta_decode, heads, dtype, bsz, dev)
                s_err = float((s - s_ref).abs().max() / s_ref.abs().max())
                y_err = (y - y_ref).abs()
                # 3 steps of sums over <= Dk = 128 terms, each off by <= n 2^-24 of the sum
                # of |terms| (test_triton_gdn_decode's derivation at these sizes)
                rel = 3 * max(heads[2], heads[3]) * 2.0**-24
                tol = rel * y_ref.abs().max() + 1e-6
                if dtype == torch.bfloat16:
                    tol = tol + 4 * ULP * y_ref.abs()
                differ = float((y != y_ref).float().mean())
                ok = (s_err <= rel and bool((y_err <= tol).all())
                      and (differ <= 0.02 or dtype == torch.float32))
                if not ok:
                    FAILED.append(f"kernel {name}")
                us = [_time_us(f, heads, dtype, bsz, dev)
                      for f in (K.gated_delta_decode, old_path, R.gated_delta_decode)]
                print(f"{name:16s} {str(dtype)[6:]:8s} B={bsz}: out err "
                      f"{float(y_err.max() / y_ref.abs().max()):.1e} of max, {differ:.1%} "
                      f"differ; state err {s_err:.1e}  {'ok' if ok else 'FAIL'}  | per step: "
                      f"fused {us[0]:.1f} us, op-by-op {us[1]:.1f} us, twin {us[2]:.1f} us",
                      flush=True)


class _OpCount(TorchDispatchMode):
    """The CPU stand-in for kernels per step: aten ops dispatched plus Triton launches (run by
    the interpreter, whose own aten ops are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter

        run = self._run = interpreter.GridExecutor.__call__
        counter = self

        def launch(grid_exec, *a, **kw):
            counter.ops[f"triton {grid_exec.fn.__name__}"] += 1
            counter.inside += 1
            try:
                return run(grid_exec, *a, **kw)
            finally:
                counter.inside -= 1

        interpreter.GridExecutor.__call__ = launch
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime import interpreter

        interpreter.GridExecutor.__call__ = self._run
        return super().__exit__(*exc)


def step_ops(dec, cache, pos: int, dev: str) -> tuple[int, list]:
    """(kernels per eager forward_static step on CUDA, aten ops + Triton launches on the CPU;
    the top 6)."""
    tables = {id(r.spec): r.cos_sin(0, cache.capacity) for r in dec.ropes}
    tok, p = torch.tensor([5], device=dev), torch.tensor([pos], device=dev)
    with torch.inference_mode():
        dec.forward_static(tok, p, cache.pool, tables)
        if dev == "cuda":
            from gpu_timing import kernel_families
            torch.cuda.synchronize()
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                dec.forward_static(tok, p, cache.pool, tables)
                torch.cuda.synchronize()
            fam = kernel_families(prof)
            return sum(c for c, _ in fam.values()), [(k, c) for k, (c, _) in fam.items()][:6]
        with _OpCount() as cnt:
            dec.forward_static(tok, p, cache.pool, tables)
        return sum(cnt.ops.values()), cnt.ops.most_common(6)


def _near_tie_same(model, prompt, fused, unfused) -> bool:
    """fused == unfused, or their first difference is at a near-tie of the unfused path's
    eager logits."""
    first = next((i for i, (a, b) in enumerate(zip(fused, unfused)) if a != b), None)
    if first is None:
        return len(fused) == len(unfused)
    dec = model.decoder
    os.environ["MLXR_GDN_FUSED"] = "0"
    cache = new_cache(dec, len(prompt) + first + 8)
    with torch.inference_mode():
        logits = dec.forward(torch.tensor(prompt + unfused[:first]), cache, last_only=True)[0]
    top = logits.float().topk(2).values
    return float(top[0] - top[1]) < TIE * float(logits.max() - logits.min())


_captured: dict = {}  # (decoder, fused) -> its GraphCache: each path captured once


def _set_fused(model, on: bool) -> None:
    """Select the path; the decode graphs captured with it are put back (a graph replays the
    kernels it recorded, whatever the flag says later)."""
    dec = model.decoder
    if dec in generate._graphs:
        _captured[(id(dec), os.environ.get("MLXR_GDN_FUSED") != "0")] = generate._graphs.pop(dec)
    os.environ["MLXR_GDN_FUSED"] = "1" if on else "0"
    if (id(dec), on) in _captured:
        generate._graphs[dec] = _captured[(id(dec), on)]


def _make_checkpoint():
    spec = importlib.util.spec_from_file_location("make_checkpoint",
                                                  ROOT / "benchmarks" / "make_checkpoint.py")
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    return mc


def decode_part(out: Path, dev: str, tiny: bool) -> None:
    mc = _make_checkpoint()
    for shape in ["tiny-qwen3_5"] if tiny else ["qwen3.5-0.8b", "qwen3.5-2b"]:
        part(f"decode {shape}")(_decode_shape)(mc, out, shape, dev, tiny)
    os.environ.pop("MLXR_GDN_FUSED", None)


def _decode_shape(mc, out: Path, shape: str, dev: str, tiny: bool) -> None:
    prompt_len, new, reps = (6, 3, 1) if tiny else (512, 128, 3)
    path = out / f"graph-{shape}"
    if not (path / "config.json").is_file():
        print(f"writing {path} ...", flush=True)
        if tiny:
            from hybrid_configs import FAMILIES
            mc.write_hybrid(copy.deepcopy(FAMILIES["qwen3_5"]), path, (4, 64, "affine"))
        else:
            mc.write(shape, path, 4, 64, "affine")
    model = mlxr.load(path, device=dev, **({"dtype": "float32"} if tiny else {}))
    try:
        _measure(model, shape, dev, tiny, prompt_len, new, reps)
    finally:
        generate._graphs.pop(model.decoder, None)
        _captured.clear()
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()


def _measure(model, shape: str, dev: str, tiny: bool, prompt_len: int, new: int,
             reps: int) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]
    tps: dict[bool, list] = {True: [], False: []}
    toks: dict[bool, list] = {}
    for k in range(reps + (not tiny)):  # CUDA's first round: warm-up (compile, capture)
        for on in (True, False):
            _set_fused(model, on)
            ids, stats = [], None
            for chunk in model.stream(prompt, max_tokens=new, temperature=0, ignore_eos=True):
                ids += chunk.token_ids
                stats = chunk.stats
            toks.setdefault(on, ids)
            if k or tiny:
                tps[on].append(stats.decode_tps)
    counts = {}
    for on in (True, False):
        _set_fused(model, on)
        cache = new_cache(model.decoder, prompt_len + 8)
        with torch.inference_mode():
            model.decoder.forward(torch.tensor(prompt), cache, last_only=True)
        counts[on] = step_ops(model.decoder, cache, prompt_len, dev)
    same = _near_tie_same(model, prompt, toks[True], toks[False])
    if not same:
        FAILED.append(f"decode {shape} tokens")
    unit = "kernels" if dev == "cuda" else "ops"
    print(f"{shape} decode {new} (graph {'on' if dev == 'cuda' else 'off: CPU'}): fused "
          f"{statistics.median(tps[True]):8.1f} tok/s, op-by-op "
          f"{statistics.median(tps[False]):8.1f} tok/s (median of {reps}); {unit} per "
          f"step fused {counts[True][0]}, op-by-op {counts[False][0]}; greedy tokens "
          f"same (near-tie rule) {same}  {'ok' if same else 'FAIL'}", flush=True)
    print(f"  top {unit} fused: {counts[True][1]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tiny", action="store_true", help="CPU, interpreter, tiny shapes")
    ap.add_argument("--only", choices=("kernel", "decode"), help="run one part")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --tiny on the CPU)")
    if a.tiny:
        from mlxr.ops.layer import norm_rope_act
        ops._fast = lambda x: True  # every op on the Triton kernels (the interpreter)
        ops._fused = norm_rope_act
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.only != "decode":
        kernel_part(dev, a.tiny)
    if a.only != "kernel":
        decode_part(a.dir, dev, a.tiny)
    print(f"done: {'FAIL ' + ', '.join(FAILED) if FAILED else 'all ok'}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
