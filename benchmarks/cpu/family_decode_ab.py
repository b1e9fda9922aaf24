"""CPU decode of any family (the hybrids' `forward`, the dense and MoE decoders' lean step): the
lean paths against the generic ones in one process, alternating, in process CPU time, plus the
share of a step spent in torch's int4 kernel.

    PYTHONPATH=. python benchmarks/cpu/family_decode_ab.py MODEL_DIR [--prompt 64] [--steps 6]
        [--rounds 6] [--threads 1] [--arm NAME:VAR=VALUE,VAR=VALUE ...]

Each path's cache gets the same random prompt; each round decodes `steps` random tokens on each
path (env MLXR_CPU_DECODE, read per step, and the env of extra `--arm`s, e.g. `--arm
torch_gdn:MLXR_CPU_GDN=0`; the order flipped every round) and keeps the median step.
A model with MoE layers gets one more arm, "per_expert": the lean step with the experts' calls
one by one (MLXR_CPU_EXPERTS=0) instead of `mlxr.ops.cpu.experts`' one call per layer; its
logits must equal the lean arm's.
Process CPU time counts the work done, not the waits for a core, so with one thread the figures
hold on the shared dev box (with two, OpenMP's spinning counts too). Then the int4 kernel's
calls of one lean step are recorded and replayed alone: their CPU time is the step's matmul
share on torch's kernel; with mlxr's compiled kernels the GEMV calls of a lean step are timed
in place instead (the LM head, the other projections, the MoE layers' expert calls). Prints
the medians, the ratios, whether the logits were equal, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mlxr
from mlxr.engine.kv_cache import new_cache


def _cache(dec, capacity: int):
    return dec.new_cache(capacity) if hasattr(dec, "new_cache") else new_cache(dec, capacity)


class _Int4Calls(TorchDispatchMode):
    """Records the int4 kernel's calls (also those of closures holding the kernel itself)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._weight_int4pack_mm_for_cpu.default:
            self.calls.append((args[0].clone(), *args[1:]))
        return func(*args, **(kwargs or {}))


def int4_share(dec, cache, token: torch.Tensor, repeats: int = 3) -> float:
    """CPU seconds of the int4 kernel calls one decode step makes, replayed alone (min over
    `repeats`)."""
    with _Int4Calls() as rec:
        dec.forward(token, cache, last_only=True)
    mm = torch._weight_int4pack_mm_for_cpu
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        for c in rec.calls:
            mm(*c)
        best = min(best, time.process_time() - t)
    return best


def kernel_share(dec, cache, token: torch.Tensor, repeats: int = 3) -> dict[str, float]:
    """CPU seconds one lean decode step spends in mlxr's compiled GEMVs (min over `repeats`
    steps), by call: the LM head, the other projections (`native.I4Matmul`: attention, the
    router, a dense MLP, experts called one by one) and the MoE layers' one expert call
    (`experts.I4Experts`)."""
    from mlxr.ops.cpu import experts, native

    head = getattr(getattr(dec.head, "weight", None), "ckern", None)
    best: dict[str, float] = {}
    for _ in range(repeats):
        got = {"head": 0.0, "gemv": 0.0, "experts": 0.0}
        saved = {cls: cls.__call__ for cls in (native.I4Matmul, experts.I4Experts)}

        def timed(cls):
            def call(self, *args):
                c = time.process_time()
                out = saved[cls](self, *args)
                key = "experts" if cls is experts.I4Experts else "head" if self is head \
                    else "gemv"
                got[key] += time.process_time() - c
                return out
            return call

        for cls in saved:
            cls.__call__ = timed(cls)
        try:
            dec.forward(token, cache, last_only=True)
        finally:
            for cls, fn in saved.items():
                cls.__call__ = fn
        best = {k: min(v, best.get(k, float("inf"))) for k, v in got.items()}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME:VAR=VALUE,...: one more lean path with this env (read per step)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dec = mlxr.load(a.model, device="cpu").decoder
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, dec.config.vocab_size, (a.prompt,), generator=g)
    paths = {"generic": {"MLXR_CPU_DECODE": "0"}, "lean": {"MLXR_CPU_DECODE": "1"}}
    for arm in a.arm:
        name, env = arm.split(":", 1)
        paths[name] = {"MLXR_CPU_DECODE": "1", **dict(kv.split("=", 1) for kv in env.split(","))}
    if any(getattr(layer, "moe", None) is not None for layer in dec.layers):
        paths["per_expert"] = {"MLXR_CPU_DECODE": "1", "MLXR_CPU_EXPERTS": "0"}
    keys = {k for env in paths.values() for k in env}
    base = {k: os.environ.get(k) for k in keys}

    def setenv(p: str) -> None:
        for k in keys:
            v = paths[p].get(k, base[k])
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    caches = {p: _cache(dec, a.prompt + a.rounds * a.steps + 8) for p in paths}
    times: dict[str, list[float]] = {p: [] for p in paths}
    equal = {p: True for p in paths if p != "generic"}
    one_call_equal = True  # per_expert's logits == lean's
    diff = {p: 0.0 for p in equal}  # max |logit - generic's| over the logits' range
    with torch.inference_mode():
        for p in paths:
            setenv(p)
            dec.forward(prompt, caches[p], last_only=True)
        for r in range(a.rounds):
            tokens = torch.randint(0, dec.config.vocab_size, (a.steps, 1), generator=g)
            got = {}
            for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                setenv(p)
                ts = []
                for t in tokens:
                    c = time.process_time()
                    got[p] = dec.forward(t, caches[p], last_only=True)
                    ts.append(time.process_time() - c)
                times[p].append(statistics.median(ts))
            ref = got["generic"]
            for p in equal:
                equal[p] &= torch.equal(got[p], ref)
                diff[p] = max(diff[p], float((got[p] - ref).abs().max() / (ref.max() - ref.min())))
            one_call_equal &= torch.equal(got["lean"], got.get("per_expert", got["lean"]))
        setenv("lean")
        mm_s = int4_share(dec, caches["lean"], tokens[0])
        ks = kernel_share(dec, caches["lean"], tokens[0])
    ms = {p: 1e3 * statistics.median(v) for p, v in times.items()}
    for p, v in ms.items():
        print(f"{p:8s} {v:7.2f} ms/step CPU  (round medians "
              f"{[round(1e3 * x, 1) for x in times[p]]})")
    for p in equal:
        print(f"{p} / generic: {ms['generic'] / ms[p]:.2f}x; logits equal: {equal[p]} (max "
              f"diff {diff[p]:.2e} of the range)")
    print(f"torch's int4 kernel {1e3 * mm_s:.1f} ms of the lean step, the rest "
          f"{ms['lean'] - 1e3 * mm_s:.1f}; load {os.getloadavg()[0]:.2f}")
    print("mlxr's GEMVs in the lean step: " + ", ".join(f"{k} {1e3 * v:.2f} ms"
                                                        for k, v in ks.items())
          + f"; the rest {ms['lean'] - 1e3 * sum(ks.values()):.2f} ms")
    if "per_expert" in ms:
        print(f"lean (one expert call per layer) / per_expert: "
              f"{ms['per_expert'] / ms['lean']:.3f}x; logits equal: {one_call_equal}")
    print(json.dumps({**{f"ms_{p}": v for p, v in ms.items()}, "ms_int4": 1e3 * mm_s,
                      **{f"ms_{k}": 1e3 * v for k, v in ks.items()},
                      "load": os.getloadavg()[0], "threads": a.threads, "prompt": a.prompt,
                      "logits_equal": equal, "logits_diff": diff,
                      "one_call_equal": one_call_equal}))


if __name__ == "__main__":
    main()
