"""The chunked gated delta rule (issue 29, `ops/recurrent/gated_delta_chunked.py`) on one GPU
call, under 2 minutes (--budget, 90 s: parts that would start later print SKIP). Each part runs in
its own try/except: a failure prints FAIL and the next part runs.

    PYTHONPATH=. python scripts/gdn_chunked_gpu.py DIR          # CUDA: DIR holds checkpoints
    PYTHONPATH=. python scripts/gdn_chunked_gpu.py DIR --tiny   # CPU, Triton interpreter
    (--only check | kernel | model: one part)

1. check: the chunked kernel vs the sequential one (`gated_delta_scan.gated_delta`, mlx-lm's
   order) at the qwen3.5-0.8b/2b layer shape (Hk = Hv = 16, Dk = Dv = 128) and qwen3-next's
   (Hv = 32), float32 and bf16, T = 100 (not a multiple of 64), 512, 4096, a non-zero start
   state: the worst output and final-state differences (of the max |ref|) against the bound
   derived in tests/gdn_chunk_bound.py; tf32x3 / tf32 products at T = 512 (tf32: reported
   only, its bound says nothing).
2. kernel: time per layer call (CUDA events, median of 10) at the 0.8b/2b shape, bf16, B = 1,
   T = 512 and 4096: sequential vs chunked configs (precision, BLOCK_V, warps); the default
   config's two launches profiled apart.
3. model: qwen3.5-2b and 0.8b (make_checkpoint, 4-bit g64, full depth, DIR/graph-<shape>, the
   same folders as hybrid_gpu_perf.py), `mlxr bench -p 512 -n 128`'s measurement in process:
   MLXR_GDN_CHUNKED=1 and 0 alternating, a warm-up round then the median of 3 (prefill and
   decode tok/s); the last prompt token's logits, chunked vs sequential (of the range); greedy
   tokens equal (a first difference allowed only at a near-tie of the sequential path's
   logits: top-2 margin under 10% of the range, hybrid_gpu_check's rule).
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.ops.recurrent import gated_delta_chunked as KC  # noqa: E402
from mlxr.ops.recurrent import gated_delta_scan as KS  # noqa: E402
from mlxr.ops.recurrent import reference as R  # noqa: E402
from gdn_chunk_bound import U32, chunked_bound  # noqa: E402

ULP, TIE = 2.0**-7, 0.1
UNITS = {"ieee": U32, "tf32x3": 2.0**-20, "tf32": None}  # tf32x3: assumed ~4x float32's
FAILED: list[str] = []
T0 = time.perf_counter()
BUDGET = [90.0]


def part(name: str):
    """Run fn, printing FAIL (and going on) if it raises, SKIP if past the budget."""
    def wrap(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            if t - T0 > BUDGET[0]:
                print(f"SKIP {name}: past the {BUDGET[0]:.0f} s budget", flush=True)
                return
            try:
                fn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - one part's failure must not stop the rest
                FAILED.append(name)
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
        return run
    return wrap


def operands(heads, t, dtype, dev, seed=0):
    """q, k (l2-normed as the mixer gives them), v, g, beta, a start state, as the mixer
    passes them (q, k, v strided views of one projection)."""
    hk, hv, dk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(1, t, 2 * hk * dk + hv * dv, generator=gen).to(dtype).to(dev)
    q, k, v = proj.split([hk * dk, hk * dk, hv * dv], -1)
    q, k = R.l2norm_qk(q.reshape(1, t, hk, dk), k.reshape(1, t, hk, dk))
    gate = (torch.rand(1, t, hv, generator=gen) * 0.9 + 0.05).to(dev)
    beta = torch.rand(1, t, hv, generator=gen).to(dtype).to(dev)
    state = (torch.randn(1, hv, dv, dk, generator=gen) * 0.5).to(dev)
    return q, k, v.reshape(1, t, hv, dv), gate, beta, state


def _with_precision(prec: str):
    os.environ["MLXR_GDN_CHUNK_PRECISION"] = prec


def check_one(name, heads, t, dtype, dev, prec) -> None:
    q, k, v, g, beta, state = operands(heads, t, dtype, dev)
    s_seq, s_chk = state.clone(), state.clone()
    y_seq = KS.gated_delta(q, k, v, g, beta, s_seq).float()
    _with_precision(prec)
    y_chk = KC.gated_delta_chunked(q, k, v, g, beta, s_chk).float()
    unit = UNITS[prec]
    s_tol, y_tol, terms = chunked_bound(q, k, v, g, beta, state, R.CHUNK, unit or U32)
    y_err, s_err = (y_chk - y_seq).abs(), float((s_chk - s_seq).abs().max())
    y_bound = y_tol + (ULP * y_seq.abs() if dtype == torch.bfloat16 else 0.0)
    ok = bool((y_err <= y_bound).all()) and s_err <= s_tol
    verdict = "info" if unit is None else ("ok" if ok else "FAIL")
    if verdict == "FAIL":
        FAILED.append(f"check {name} {dtype} T={t} {prec}")
    differ = float((y_chk != y_seq).float().mean())
    print(f"{name:15s} {str(dtype)[6:]:8s} T={t:5d} {prec:6s}: out max diff "
          f"{float(y_err.max()):.2e} ({float(y_err.max() / y_seq.abs().max()):.1e} of max|y|, "
          f"{differ:.1%} differ), state {s_err:.2e} ({s_err / float(s_seq.abs().max()):.1e} "
          f"of max); bound state {s_tol:.1e} (kappa {terms['kappa']:.2f}, M "
          f"{terms['M']:.2f})  {verdict}", flush=True)


@part("check")
def check_part(dev: str, tiny: bool) -> None:
    if tiny:
        cases = [("tiny gqa2", (2, 4, 32, 48), t, p) for t in (5, 100) for p in ("ieee",)]
    else:
        big = (16, 16, 128, 128)
        cases = [("qwen3.5", big, t, "ieee") for t in (100, 512, 4096)]
        cases += [("qwen3-next", (16, 32, 128, 128), 512, "ieee")]
        cases += [("qwen3.5", big, 512, p) for p in ("tf32x3", "tf32")]
    for name, heads, t, prec in cases:
        for dtype in (torch.float32, torch.bfloat16):
            check_one(name, heads, t, dtype, dev, prec)
    _with_precision("ieee")


def _time_ms(fn, reps: int = 10) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e))
    return statistics.median(times)


CONFIGS = [("ieee", 32, (8, 4)), ("ieee", 64, (8, 4)), ("ieee", 32, (4, 4)),
           ("tf32x3", 32, (8, 4)), ("tf32", 32, (8, 4)), ("tf32", 64, (8, 8))]


@part("kernel")
def kernel_part(dev: str, tiny: bool) -> None:
    if tiny:
        print("kernel timing: CUDA only (the interpreter's times mean nothing)", flush=True)
        return
    heads = (16, 16, 128, 128)
    for t in (512, 4096):
        q, k, v, g, beta, state = operands(heads, t, torch.bfloat16, dev)
        seq = _time_ms(lambda: KS.gated_delta(q, k, v, g, beta, state))
        line = [f"T={t:5d} bf16 per layer: sequential {seq * 1e3:8.1f} us"]
        for prec, bv, warps in CONFIGS:
            if time.perf_counter() - T0 > BUDGET[0] / 2:
                line.append("(rest skipped: budget)")
                break
            _with_precision(prec)
            ms = _time_ms(lambda: KC.gated_delta_chunked(q, k, v, g, beta, state, bv, warps))
            line.append(f"{prec}/bv{bv}/w{warps[0]}{warps[1]} {ms * 1e3:.1f} us "
                        f"({seq / ms:.1f}x)")
        print("; ".join(line), flush=True)
        _with_precision("ieee")
        from gpu_timing import kernel_families
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            KC.gated_delta_chunked(q, k, v, g, beta, state)
            torch.cuda.synchronize()
        fam = {n: round(us, 1) for n, (c, us) in kernel_families(prof).items()}
        print(f"  default config's kernels (us): {fam}", flush=True)


def _make_checkpoint():
    spec = importlib.util.spec_from_file_location("make_checkpoint",
                                                  ROOT / "benchmarks" / "make_checkpoint.py")
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    return mc


def model_part(out: Path, dev: str, tiny: bool) -> None:
    mc = _make_checkpoint()
    for shape in ["tiny-qwen3_5"] if tiny else ["qwen3.5-2b", "qwen3.5-0.8b"]:
        part(f"model {shape}")(_model_shape)(mc, out, shape, dev, tiny)
    os.environ.pop("MLXR_GDN_CHUNKED", None)


def _model_shape(mc, out: Path, shape: str, dev: str, tiny: bool) -> None:
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
        _measure(model, shape, tiny)
    finally:
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()


def _last_logits(model, prompt: list[int], chunked: bool) -> torch.Tensor:
    os.environ["MLXR_GDN_CHUNKED"] = "1" if chunked else "0"
    cache = new_cache(model.decoder, len(prompt) + 8)
    with torch.inference_mode():
        return model.decoder.forward(torch.tensor(prompt), cache, last_only=True)[0].float()


def _near_tie_same(model, prompt, chunked, sequential) -> bool:
    first = next((i for i, (a, b) in enumerate(zip(chunked, sequential)) if a != b), None)
    if first is None:
        return len(chunked) == len(sequential)
    logits = _last_logits(model, prompt + sequential[:first], False)
    top = logits.topk(2).values
    return float(top[0] - top[1]) < TIE * float(logits.max() - logits.min())


def _measure(model, shape: str, tiny: bool) -> None:
    prompt_len, new, reps = (70, 3, 1) if tiny else (512, 128, 3)
    rng = random.Random(0)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]
    pre: dict[bool, list] = {True: [], False: []}
    dec: dict[bool, list] = {True: [], False: []}
    toks: dict[bool, list] = {}
    for r in range(reps + (not tiny)):  # CUDA's first round: warm-up (compile, capture)
        for on in (True, False):
            os.environ["MLXR_GDN_CHUNKED"] = "1" if on else "0"
            ids, stats = [], None
            for chunk in model.stream(prompt, max_tokens=new, temperature=0, ignore_eos=True):
                ids += chunk.token_ids
                stats = chunk.stats
            toks.setdefault(on, ids)
            if r or tiny:
                pre[on].append(stats.prefill_tps)
                dec[on].append(stats.decode_tps)
    a, b = _last_logits(model, prompt, True), _last_logits(model, prompt, False)
    rel = float((a - b).abs().max() / (b.max() - b.min()))
    same = _near_tie_same(model, prompt, toks[True], toks[False])
    if not same:
        FAILED.append(f"model {shape} tokens")
    med = statistics.median
    print(f"{shape} -p {prompt_len} -n {new}: prefill chunked {med(pre[True]):9.1f} tok/s, "
          f"sequential {med(pre[False]):9.1f} tok/s ({med(pre[True]) / med(pre[False]):.2f}x); "
          f"decode {med(dec[True]):7.1f} / {med(dec[False]):7.1f} tok/s (median of {reps}); "
          f"last logits chunked vs sequential {rel:.1e} of the range; greedy tokens same "
          f"(near-tie rule) {same}  {'ok' if same else 'FAIL'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tiny", action="store_true", help="CPU, interpreter, tiny shapes")
    ap.add_argument("--only", choices=("check", "kernel", "model"), help="run one part")
    ap.add_argument("--budget", type=float, default=90.0,
                    help="seconds after which parts not yet started are skipped")
    a = ap.parse_args()
    BUDGET[0] = a.budget
    dev = "cpu" if a.tiny else "cuda"
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --tiny on the CPU)")
    if a.tiny:
        from mlxr.ops.layer import norm_rope_act
        ops._fast = lambda x: True  # every op on the Triton kernels (the interpreter)
        ops._fused = norm_rope_act
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "check"):
        check_part(dev, a.tiny)
    if a.only in (None, "kernel"):
        kernel_part(dev, a.tiny)
    if a.only in (None, "model"):
        model_part(a.dir, dev, a.tiny)
    print(f"done in {time.perf_counter() - T0:.0f} s: "
          f"{'FAIL ' + ', '.join(FAILED) if FAILED else 'all ok'}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
