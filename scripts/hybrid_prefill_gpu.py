"""The hybrids' padded prefill CUDA graph (issue 29, `cuda_graph.PaddedPrefillGraph`) on one
GPU call: checked against the eager prefill, then timed. Each part runs in its own try/except
(a failure prints FAIL and the next part runs); parts that would start past --budget are
skipped (printed SKIP).

    PYTHONPATH=. python scripts/hybrid_prefill_gpu.py DIR --budget 500   # CUDA, H200
    PYTHONPATH=. python scripts/hybrid_prefill_gpu.py DIR --tiny         # CPU smoke run

DIR holds the checkpoints (written there first if missing: make_checkpoint.py gemma-4-e2b and
qwen3.5-2b, 4-bit g64, random weights; --tiny: narrow ones; --shapes picks them).

1. gdn kernel (first: it needs no checkpoint): the sequential gated-delta kernel at the
   qwen3.5 layer shape (Hk = Hv = 16, Dk = Dv = 128), T = 512, bf16, with
   the old launch (MLXR_GDN_PREFETCH=0, 32 rows: 64 programs of 16 heads x 128 / 32 rows),
   prefetching at 32 rows, today's default (prefetch, 1024 / Dk = 8 rows), then prefetching
   with MLXR_GDN_BLOCK_V 16 / 8 / 4 / 2 x MLXR_GDN_WARPS 4 / 2 / 1: us per call, bitwise ==
   the old launch (session 22 on an H100: all but 2 rows x 4 warps; prefetch changes no
   arithmetic). Fewer rows: more programs, fewer shuffles a step.
Then per model:
2. float32 (its eager logits the bf16 lines' reference): the check of 4 at n = 37 and 300
   with a float32 load (bound 1e-4 of the range: the math is equal, whatever bf16 rounding
   does).
3. attn: `ops.attention` at the model's prefill shapes, T = 37 (unaligned) and 64 rows, vs
   float32 math of the same bf16 inputs: rel = max |diff| / max |ref| (bf16 rounding ~4e-3).
   A bad rel at 37 but not 64 would make the eager prefill the wrong side.
4. check, bf16, n in 1, 7, 37, 100, 300, 512 (one GraphCache for all, as the engine keeps
   it): eager `forward` of n tokens vs the captured graph (`graph`) and vs `forward_padded`
   run uncaptured on the same bucket (`nocap`); |diff| / logit range of the prefill's last
   logits; `cap==nocap` must be 0 (capture is exact); then 8 greedy decode steps
   (`forward_static`, the decode graph's body) after each prefill, each path feeding its own
   tokens: the tokens must agree (`greedy 9/9`), or differ first where the eager logits'
   top-2 margin is under `TIE` of the range (a near-tie: printed `tie`), or the graph's
   logits are no further from the float32 eager ones than the bf16 eager logits are
   (`noise`: M-dependent bf16 rounding, 37 rows vs a 64-row bucket, which a random 35-layer
   model amplifies: on the CPU the tiny E2B gives 5.5e-2 of the range at n = 100 in bf16 and
   2e-5 in float32). Last, n = 37 replayed again after the other buckets and an eager prompt
   on the same cache: `replay==first` must be 0.
5. time: prefill of 37 and 512 tokens, eager `forward` vs graph replay (CUDA events, median of
   7 after 2 warm-ups); tok/s; qwen with MLXR_GDN_PREFETCH 0 and 1 (logits bitwise equal).

What to look for: every check line `ok` (or `tie` / `noise`, see 4); `cap==nocap 0`; the
time lines' graph column; the gdn lines' us and bitwise flags.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ["MLXR_HYBRID_PREFILL_GRAPHS"] = "1"
import hybrid_tables  # noqa: E402
import make_checkpoint  # noqa: E402

import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.engine import cuda_graph  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402

LENGTHS = (1, 7, 37, 100, 300, 512)
CAP = 1024
TIE = 0.1  # scripts/hybrid_gpu_perf.py's near-tie rule
START = time.perf_counter()
BUDGET = [600.0]


def part(name: str, est: float, fn, *args) -> None:
    """Run fn(*args) unless it would start with less than `est` seconds of budget left."""
    left = BUDGET[0] - (time.perf_counter() - START)
    if left < est:
        print(f"SKIP {name} ({left:.0f} s left)", flush=True)
        return
    t = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 -- report and go on to the next part
        traceback.print_exc()
        print(f"FAIL {name}", flush=True)
    print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)


def checkpoint(root: Path, shape: str, tiny: bool) -> Path:
    path = root / (f"tiny-{shape}" if tiny else shape)
    if (path / "config.json").exists():
        return path
    cfg = copy.deepcopy(make_checkpoint.SHAPES[shape])
    if tiny and shape.startswith("gemma"):
        cfg = hybrid_tables.narrow_gemma4(cfg)
        cfg["text_config"]["sliding_window"] = 32  # rings wrap within the larger buckets
    elif tiny:
        from hybrid_configs import FAMILIES
        cfg = copy.deepcopy(FAMILIES["qwen3_5"])
    t = time.perf_counter()
    make_checkpoint.write_hybrid(cfg, path, (4, 64, "affine"))
    print(f"wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def rel_range(got: torch.Tensor, want: torch.Tensor) -> float:
    rng = (want.amax(-1) - want.amin(-1)).clamp_min(1e-30)
    return float(((got.float() - want.float()).abs().amax(-1) / rng).max())


def attn_part(dec) -> None:
    """ops.attention at the decoder's layer shapes vs float32 math of the same inputs."""
    c, dev = dec.config, dec.device
    spec = getattr(dec, "spec", None)
    shapes = set()
    for i in range(c.num_layers):
        if hasattr(spec, "head_dims"):  # gemma4
            shapes.add((spec.kv_heads[i], spec.head_dims[i], c.layer_window[i]))
        elif getattr(spec, "layer_types", ["full_attention"])[i] == "full_attention":
            shapes.add((c.num_kv_heads, c.head_dim, None))
    g = torch.Generator(device=dev).manual_seed(0)
    for kh, d, w in sorted(shapes, key=str):
        for t in (37, 64):
            q = torch.randn(t, c.num_heads, d, generator=g, device=dev, dtype=dec.dtype)
            k = torch.randn(kh, t, d, generator=g, device=dev, dtype=dec.dtype)
            v = torch.randn(kh, t, d, generator=g, device=dev, dtype=dec.dtype)
            with torch.inference_mode():
                out = ops.attention(q, k, v, 0, 0, c.attn_scale, w).float()
                rep = c.num_heads // kh
                kf = k.float().repeat_interleave(rep, 0)
                vf = v.float().repeat_interleave(rep, 0)
                s = torch.einsum("thd,hsd->hts", q.float() * c.attn_scale, kf)
                pos = torch.arange(t, device=dev)
                mask = pos[None, :] <= pos[:, None]
                if w is not None:
                    mask &= pos[:, None] - pos[None, :] < w
                p = torch.softmax(s.masked_fill(~mask, -torch.inf), -1)
                ref = torch.einsum("hts,hsd->thd", p, vf)
            r = float((out - ref).abs().max() / ref.abs().max())
            print(f"attn kv={kh} D={d} window={w} T={t}: rel {r:.2e} "
                  f"{'ok' if r < 2e-2 else 'FAIL'}", flush=True)


def greedy(dec, logits: torch.Tensor, prompt: list[int], cache, steps: int = 8):
    """The prompt's greedy continuation from its last logits: (tokens, logits per step)."""
    tables = {id(r.spec): r.cos_sin(0, cache.capacity) for r in dec._rope_kinds} \
        if hasattr(dec, "_rope_kinds") else {id(r.spec): r.cos_sin(0, cache.capacity)
                                             for r in dec.ropes}
    toks, outs = [int(logits.argmax())], [logits]
    for p in range(len(prompt), len(prompt) + steps):
        ids = torch.tensor([toks[-1]], device=dec.device)
        outs.append(dec.forward_static(ids, torch.tensor([p], device=dec.device), cache,
                                       tables)[0])
        toks.append(int(outs[-1].argmax()))
    return toks, torch.stack(outs).float()


def tie_ok(a: list[int], b: list[int], logits: torch.Tensor) -> str:
    """'ok' if equal; 'tie' if they first differ where the eager logits' top-2 margin is
    under TIE of the range; else 'FAIL'."""
    if a == b:
        return "ok"
    j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    row = logits[j]
    top = row.topk(2).values
    return "tie" if float(top[0] - top[1]) < TIE * float(row.max() - row.min()) else "FAIL"


def check_part(path: Path, dev: str, dtype: str, lengths, refs: dict) -> None:
    """refs: n -> float32 eager logits (filled by a float32 run, read by a bf16 one)."""
    m = mlxr.load(path, device=dev, dtype=dtype)
    dec = m.decoder
    if not hasattr(dec, "forward_padded"):
        print(f"check {path.name}: no forward_padded (not padded: SKIP)")
        return
    if dev == "cuda" and dtype != "float32":
        attn_part(dec)
    graphs = cuda_graph.GraphCache()
    cache, _ = graphs.get(dec, CAP, new_cache)
    vocab, f32 = m.config.vocab_size, dtype == "float32"
    first = None
    with torch.inference_mode():
        for n in lengths:
            prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
            plain = new_cache(dec, CAP)
            want = dec.forward(prompt, plain, last_only=True)[0]
            bucket = cuda_graph.prefill_bucket(n, CAP)
            ids = torch.zeros(bucket, dtype=torch.long, device=dec.device)
            ids[:n] = prompt.to(dec.device)
            row = torch.tensor([n - 1], device=dec.device)
            nocap = dec.forward_padded(ids, row, new_cache(dec, CAP))[0]
            if dev == "cuda":
                pg = graphs.prefill_graph(dec, cache, n)
                assert isinstance(pg, cuda_graph.PaddedPrefillGraph), "no padded graph"
                got, gcache = pg.run(prompt.tolist())[0].clone(), cache
            else:
                gcache = new_cache(dec, CAP)
                got = dec.forward_padded(ids, row, gcache)[0]
                gcache.length = n
            if n == 37:
                first = got.clone()
            wt, wl = greedy(dec, want, prompt.tolist(), plain)
            gt, gl = greedy(dec, got, prompt.tolist(), gcache)
            d_pre, d_dec = rel_range(got, want), rel_range(gl[1:], wl[1:])
            same = sum(a == b for a, b in zip(wt, gt))
            exact = ""
            if f32:
                refs[n] = want.cpu()
                verdict = "ok" if max(d_pre, d_dec) <= 1e-4 else "FAIL"
            else:
                verdict = tie_ok(wt, gt, wl)
                if n in refs:  # how far each bf16 prefill is from the float32 one
                    e, g = (rel_range(x.cpu(), refs[n]) for x in (want, got))
                    exact = f"; vs float32 eager {e:.2e} graph {g:.2e}"
                    if verdict == "FAIL" and g <= 1.5 * e:
                        verdict = "noise"  # no further from exact than eager's own rounding
            print(f"check {path.name} {dtype} n={n} bucket={bucket}: prefill |diff|/range "
                  f"graph {d_pre:.2e} nocap {rel_range(nocap, want):.2e} cap==nocap "
                  f"{float((got - nocap).abs().max()):.1e}; decode {d_dec:.2e}; greedy "
                  f"{same}/9 {verdict}{exact}", flush=True)
        if dev == "cuda" and first is not None:
            cache.length = 0  # an eager prompt on the same cache (within its capacity)
            dec.forward(torch.arange(700) % vocab, cache, last_only=True)
            again = graphs.prefill_graph(dec, cache, 37).run(
                torch.randint(0, vocab, (37,), generator=torch.Generator().manual_seed(37))
                .tolist())[0]
            d = float((again - first).abs().max())
            print(f"check {path.name} {dtype} replay==first (n=37, after the other buckets "
                  f"and an eager prompt): {d:.1e} {'ok' if d == 0 else 'FAIL'}", flush=True)
    del m, dec, graphs, cache
    if dev == "cuda":
        torch.cuda.empty_cache()


def events_ms(fn, warm: int = 2, reps: int = 7) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gdn_part() -> None:
    """The sequential gated-delta kernel at the qwen3.5 layer shape (Hk = Hv = 16, Dk = Dv =
    128), T = 512, bf16: each load order (MLXR_GDN_PREFETCH) and value block
    (MLXR_GDN_BLOCK_V) against the old launch, bit for bit, and its time."""
    from mlxr.ops.recurrent import gated_delta_scan as scan

    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, d = 512, 16, 128
    proj = torch.randn(1, t, 3 * h * d, generator=g, device="cuda").bfloat16()
    q, k, v = proj.split([h * d] * 3, -1)
    q, k = (x.reshape(1, t, h, d) / x.reshape(1, t, h, d).float().norm(dim=-1, keepdim=True)
            .bfloat16() for x in (q, k))
    v = v.reshape(1, t, h, d)
    gate = torch.rand(1, t, h, generator=g, device="cuda") * 0.9 + 0.05
    beta = torch.rand(1, t, h, generator=g, device="cuda").bfloat16()
    state = torch.randn(1, h, d, d, generator=g, device="cuda") * 0.5
    base = None
    configs = [("0", "32", ""), ("1", "32", ""), ("1", "", "")] + [  # the old launch first
        ("1", b, w) for b in ("16", "8", "4", "2") for w in ("4", "2", "1")]
    for flag, block, warps in configs:
        os.environ["MLXR_GDN_PREFETCH"], os.environ["MLXR_GDN_BLOCK_V"] = flag, block
        os.environ["MLXR_GDN_WARPS"] = warps
        s = state.clone()
        y = scan.gated_delta(q, k, v, gate, beta, s)
        if base is None:
            base = y, s
        same = torch.equal(y, base[0]) and torch.equal(s, base[1])
        worst = float((y.float() - base[0].float()).abs().max())
        us = events_ms(lambda: scan.gated_delta(q, k, v, gate, beta, state.clone())) * 1e3
        rows, nw = scan.launch_shape(d)
        print(f"gdn T=512 prefetch={flag} block_v={rows}{'' if block else ' (default)'} "
              f"warps={nw}: "
              f"{us:.0f} us (incl. a 1 MB state copy), bitwise == old launch: {same} "
              f"(max |dy| {worst:.1e})", flush=True)
    for name in ("MLXR_GDN_PREFETCH", "MLXR_GDN_BLOCK_V", "MLXR_GDN_WARPS"):
        os.environ.pop(name)


def time_part(path: Path, flags=("0",)) -> None:
    """Prefill of 37 and 512 tokens, eager vs graph, per MLXR_GDN_PREFETCH flag (each
    with its own graphs); the 512 logits of the flags compared bit for bit."""
    m = mlxr.load(path, device="cuda", dtype="bfloat16")
    dec = m.decoder
    if not hasattr(dec, "forward_padded"):
        print(f"time {path.name}: no forward_padded (SKIP)")
        return
    logits = []
    with torch.inference_mode():
        for flag in flags:
            os.environ["MLXR_GDN_PREFETCH"] = flag
            graphs = cuda_graph.GraphCache()
            cache, _ = graphs.get(dec, CAP, new_cache)
            for n in (37, 512):
                prompt = torch.randint(0, m.config.vocab_size, (n,),
                                       generator=torch.Generator().manual_seed(n))
                plain = new_cache(dec, CAP)

                def eager(d=dec, ids=prompt, c=plain):
                    c.length = 0
                    return d.forward(ids, c, last_only=True)

                pg = graphs.prefill_graph(dec, cache, n)
                toks = prompt.tolist()
                e, g = events_ms(eager), events_ms(lambda: pg.run(toks))
                print(f"time {path.name} gdn_prefetch={flag} prefill {n}: eager {e:.2f} ms "
                      f"({n / e * 1e3:,.0f} tok/s) graph {g:.2f} ms ({n / g * 1e3:,.0f} "
                      f"tok/s) x{e / g:.2f}", flush=True)
            logits.append(eager().clone())
            del graphs, cache
    if len(logits) > 1:
        print(f"time {path.name}: eager 512 logits prefetch 0 == 1 bitwise: "
              f"{torch.equal(logits[0], logits[1])}", flush=True)
    os.environ.pop("MLXR_GDN_PREFETCH", None)
    del m, dec
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds; stop before it")
    ap.add_argument("--tiny", action="store_true", help="CPU, narrow checkpoints (smoke run)")
    ap.add_argument("--shapes", default="gemma-4-e2b,qwen3.5-2b",
                    help="make_checkpoint shapes, comma-separated, in order")
    ap.add_argument("--skip", default="", help="parts to leave out: gdn,float32,check,time")
    a = ap.parse_args()
    skip = set(a.skip.split(",")) - {""}
    BUDGET[0] = a.budget
    dev = "cpu" if a.tiny else "cuda"
    a.dir.mkdir(parents=True, exist_ok=True)
    if dev == "cuda" and "gdn" not in skip:  # needs no checkpoint: first, for a short budget
        part("gdn kernel", 20, gdn_part)
    for shape in a.shapes.split(","):
        path = checkpoint(a.dir, shape, a.tiny)
        refs: dict = {}
        if "float32" not in skip:
            part(f"float32 {shape}", 120, check_part, path, dev, "float32", (37, 300), refs)
        if "check" not in skip:
            part(f"check {shape}", 90, check_part, path, dev, "bfloat16", LENGTHS, refs)
        if dev == "cuda" and "time" not in skip:
            qwen = shape.startswith("qwen")
            part(f"time {shape}", 60 if qwen else 40, time_part, path,
                 ("0", "1") if qwen else ("0",))
    print(f"total {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
