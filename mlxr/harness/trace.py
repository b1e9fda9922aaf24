"""Chrome / Perfetto traces of a run, switched on by the environment.

    MLXR_TRACE=run.json mlxr run ...        per-step spans (prefill, each decode step)
    MLXR_TRACE_KERNELS=1                     also torch-profiler events (ops, CUDA kernel launches)
    MLXR_TRACE_SYNC=1                        synchronize CUDA at the end of each span, so a span's
                                             duration is the GPU work, not the launch time

Open the file in https://ui.perfetto.dev or chrome://tracing. The file is written at interpreter
exit (or by `stop()`).

API: `with span("decode"):` times a block. When MLXR_TRACE is unset `span` is a module-level
function that returns one shared no-op context manager: nothing is recorded, allocated or
timed (the cost is one call). `instrument(decoder)` wraps a decoder's forward so every call
becomes a "prefill" or "decode" span (for code paths without their own spans).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time

_NULL = contextlib.nullcontext()

ENABLED = False
_path: str | None = None
_events: list[dict] = []
_profiler = None
_sync = False
_lock = threading.Lock()


def _null_span(name: str, args: dict | None = None):
    return _NULL


class _Span:
    __slots__ = ("args", "name", "rf", "t0")

    def __init__(self, name: str, args: dict | None):
        self.name, self.args, self.rf = name, args, None

    def __enter__(self):
        if _profiler is not None:
            import torch

            self.rf = torch.profiler.record_function(self.name)
            self.rf.__enter__()
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        if _sync:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        t1 = time.perf_counter_ns()
        if self.rf is not None:
            self.rf.__exit__(*exc)
        ev = {"name": self.name, "ph": "X", "cat": "mlxr", "ts": self.t0 / 1e3,
              "dur": (t1 - self.t0) / 1e3, "pid": os.getpid(), "tid": threading.get_native_id()}
        if self.args:
            ev["args"] = self.args
        with _lock:
            _events.append(ev)
        return False


def _live_span(name: str, args: dict | None = None):
    return _Span(name, args)


span = _null_span


def enabled() -> bool:
    return ENABLED


def mark(name: str, args: dict | None = None) -> None:
    """An instant event (a vertical line in the viewer)."""
    if not ENABLED:
        return
    ev = {"name": name, "ph": "i", "s": "p", "ts": time.perf_counter_ns() / 1e3,
          "pid": os.getpid(), "tid": threading.get_native_id()}
    if args:
        ev["args"] = args
    with _lock:
        _events.append(ev)


def complete(name: str, t0_ns: int, t1_ns: int, args: dict | None = None) -> None:
    """A span whose start and end were measured elsewhere (perf_counter_ns)."""
    if not ENABLED:
        return
    ev = {"name": name, "ph": "X", "cat": "mlxr", "ts": t0_ns / 1e3, "dur": (t1_ns - t0_ns) / 1e3,
          "pid": os.getpid(), "tid": threading.get_native_id()}
    if args:
        ev["args"] = args
    with _lock:
        _events.append(ev)


def start(path: str, kernels: bool = False, sync: bool = False) -> None:
    """Start recording to `path` (what MLXR_TRACE does at import)."""
    global ENABLED, _path, _profiler, _sync, span
    if ENABLED:
        stop()
    _path, _sync, ENABLED, span = str(path), sync, True, _live_span
    _events.clear()
    if kernels:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        _profiler = profile(activities=acts, record_shapes=False)
        _profiler.__enter__()


def stop() -> str | None:
    """Stop recording and write the trace file; returns its path (None when not enabled)."""
    global ENABLED, _profiler, span
    if not ENABLED:
        return None
    ENABLED, span = False, _null_span
    events = list(_events)
    _events.clear()
    meta = {"name": "process_name", "ph": "M", "pid": os.getpid(),
            "args": {"name": f"mlxr {os.getpid()}"}}
    out = {"traceEvents": [meta] + events, "displayTimeUnit": "ms"}
    if _profiler is not None:
        prof, _profiler = _profiler, None
        prof.__exit__(None, None, None)
        tmp = f"{_path}.torch.json"
        prof.export_chrome_trace(tmp)
        try:
            with open(tmp) as f:
                torch_trace = json.load(f)
        finally:
            os.unlink(tmp)
        # The profiler's events have their own time base; our spans are in it too (as
        # record_function "user_annotation" events), so its trace is the one to write.
        torch_trace.setdefault("traceEvents", []).append(meta)
        out = torch_trace
    with open(_path, "w") as f:
        json.dump(out, f)
    return _path


def instrument(decoder):
    """Wrap `decoder.forward` so each call is a span: "prefill" for the first call on a new
    cache or a multi-token input, "decode" (with its step number) otherwise. A no-op when
    tracing is off."""
    if not ENABLED or getattr(decoder, "_mlxr_traced", False):
        return decoder
    inner = decoder.forward
    state = {"n": 0, "cache": None}

    def forward(ids, cache, last_only=False, *a, **kw):
        n = int(ids.shape[-1]) if hasattr(ids, "shape") else len(ids)
        if n > 1 or cache is not state["cache"]:  # a new cache starts with a prefill
            state["n"], state["cache"] = 0, cache
            with span("prefill", {"tokens": n}):
                return inner(ids, cache, last_only, *a, **kw)
        state["n"] += 1
        with span("decode", {"step": state["n"]}):
            return inner(ids, cache, last_only, *a, **kw)

    decoder.forward = forward
    decoder._mlxr_traced = True
    return decoder


if os.environ.get("MLXR_TRACE"):
    start(os.environ["MLXR_TRACE"], kernels=os.environ.get("MLXR_TRACE_KERNELS", "") not in
          ("", "0"), sync=os.environ.get("MLXR_TRACE_SYNC", "") not in ("", "0"))
    atexit.register(stop)
