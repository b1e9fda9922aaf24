"""The model manager: which models are loaded, loading the one a request names, unloading idle
ones and evicting the least recently used under a memory budget (what Ollama's scheduler does).

Each loaded model keeps its own continuous-batching engine (AsyncEngine on a thread, or
ProcEngine in a process). A model stays loaded `keep_alive` seconds after its last activity
(the request's `keep_alive`, else the server's `--keep-alive`; None = forever, 0 = unload once
idle). A model is "active" while its engine has requests running or waiting; only idle models
are unloaded or evicted.

Memory: the budget is per device (bytes, `--memory-budget`; None = no limit). Before a load the
new model is estimated from its weight files plus its KV pool (`sizer`: the smallest pool worth
serving with and the full one, max_num_seqs whole contexts; for the hybrid families, what their
per-sequence caches and prefix snapshots may hold: engine.memory.sequence_caches_plan). Idle
models are evicted, least recently used first, until the full size fits, or while the smallest
does not; the engine is
then built with what the budget leaves (`loader(path, share)`: it sizes its pool to the share
less its measured weights). A model that does not fit even with the smallest pool is refused
with a MemoryBudgetError (HTTP 507, naming the sizes and the budget). After the load the
engine's measured bytes (`LLMEngine.stats()`: weights, KV pool) replace the estimate.

Loads run one at a time on a thread; requests for a model being loaded wait for it, and a model
that fails to load answers each of its waiters with the error (a later request tries again).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MemoryBudgetError, MlxrError, NotDownloadedError
from .protocol import APIError

log = logging.getLogger("mlxr.server")

SWEEP_SECONDS = 0.25  # how often idle models are looked at
EVICT_WAIT_SECONDS = 60.0  # a load waits this long for busy models to become evictable
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
DURATION = {"": 1, "s": 1, "m": 60, "h": 3600, "ms": 1e-3}


def parse_size(text: str) -> int:
    """"8GB", "512m", "1073741824" -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (give bytes, or e.g. 512MB, 8GB)")
    return int(float(m[1]) * UNITS[m[2]])


def parse_keep_alive(value) -> float | None:
    """Ollama's keep_alive: seconds as a number, or "5m", "1h", "30s", "0"; negative = forever
    (None)."""
    if value is None or isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration, not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(value))
        if not m:
            raise ValueError(f"keep_alive {value!r} is not a duration (e.g. 30s, 5m, 1h, -1)")
        seconds = float(m[1]) * DURATION[m[2] or ""]
    return None if seconds < 0 else seconds


@dataclass
class Loaded:
    """One model the manager knows: loading (ready not set), or loaded (model, engine set).
    Passed to render.* as their `state` (they read model_id and metrics)."""

    model_id: str
    path: Path
    metrics: object
    device: str = "cpu"
    model: object = None
    engine: object = None
    error: str | None = None
    error_status: int = 500  # 507 when the memory budget refused it
    estimate: int = 0  # bytes, from the weight files, until measured
    kv_least: int = 0  # bytes: the smallest KV pool (before the load; memory.pool_plan)
    kv_full: int = 0  # bytes: the full KV pool
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    keep_alive: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    load_seconds: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)
    waiters: list = field(default_factory=list)  # (loop, future) of requests waiting for it

    @property
    def size(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes if self.engine else self.estimate

    @property
    def expires_at(self) -> float | None:
        """Wall-clock time of the idle unload (None: never)."""
        if self.keep_alive is None:
            return None
        return time.time() + max(0.0, self.last_used + self.keep_alive - time.monotonic())

    def busy(self) -> bool:
        if self.engine is None:
            return True
        s = self.engine.stats()
        return bool(s.get("running", 0) or s.get("waiting", 0))


def default_budget(device: str | None) -> int:
    """--memory-budget auto: 90% of the GPU's memory on CUDA, 75% of the RAM on CPU."""
    from ..model import _pick_device

    dev = _pick_device(device)
    if dev.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(dev).total_memory * 0.9)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 * 3 // 4
    return 8 << 30


def weight_file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class ModelManager:
    """`loader(path, share) -> (model, engine)` builds one model's engine within `share` bytes
    (None: no budget; ServerState.build_engine); `resolve(name) -> (model_id, path)` maps a
    request's model name (raises APIError 404); `sizer(path) -> (least, full)` gives a model's
    smallest and full KV pool in bytes (None: 0, 0)."""

    def __init__(self, loader, resolve, metrics, device: str, keep_alive: float | None = 300.0,
                 memory_budget: int | None = None, sizer=None):
        self.loader, self.resolve, self.metrics = loader, resolve, metrics
        self.sizer = sizer or (lambda path: (0, 0))
        self.device, self.default_keep_alive, self.budget = device, keep_alive, memory_budget
        self.models: dict[str, Loaded] = {}
        self.lock = threading.Lock()  # guards self.models
        self.load_lock = threading.Lock()  # one load (and its evictions) at a time
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()

    # -- loading ---------------------------------------------------------------------------

    def load_sync(self, name: str | None, keep_alive: float | None = None,
                  pin: bool = False) -> Loaded:
        """Load (or find) a model on this thread; raise MlxrError if it fails. `pin`: never
        unloaded when idle (a model named on the command line)."""
        entry, start = self._entry(name, None if pin else keep_alive, pin)
        if start:
            self._load(entry, report=False)  # the caller reports it (the runner: one line)
        entry.ready.wait()
        if entry.error:
            raise MlxrError(entry.error)
        return entry

    async def acquire(self, name: str | None, keep_alive=None) -> Loaded:
        """The loaded model a request names (loading it if needed), marked as just used.
        keep_alive: the request's (Ollama's duration forms), None = the server's default."""
        ka = self.default_keep_alive if keep_alive is None else self.keep_alive_seconds(keep_alive)
        while True:
            entry = await self._wait_for(name, ka)
            if entry.error or entry.engine is not None:
                break  # else it was unloaded (evicted, stopped) just now: load it again
        if entry.error and entry.error_status == 507:
            raise APIError(507, f"the model {entry.model_id!r} does not fit: {entry.error}",
                           "server_error", code="memory_budget_exceeded")
        if entry.error:
            raise APIError(500, f"the model {entry.model_id!r} failed to load: {entry.error}",
                           "server_error", code="model_load_failed")
        entry.last_used = time.monotonic()
        if keep_alive is not None:  # the request's own keep_alive replaces the entry's
            entry.keep_alive = ka
        return entry

    async def _wait_for(self, name: str | None, keep_alive: float | None) -> Loaded:
        """The entry for `name` once its load ended (starting the load if nobody has)."""
        entry, start = self._entry(name, keep_alive, False)
        if entry.ready.is_set():
            return entry
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.lock:
            waiting = not entry.ready.is_set()
            if waiting:
                entry.waiters.append((loop, fut))
        if start:
            threading.Thread(target=self._load, args=(entry,), daemon=True,
                             name="mlxr-load").start()
        if waiting:
            await fut
        return entry

    @staticmethod
    def keep_alive_seconds(value) -> float | None:
        try:
            return parse_keep_alive(value)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error", "keep_alive") from None

    def _entry(self, name: str | None, keep_alive: float | None,
               pin: bool) -> tuple[Loaded, bool]:
        """The entry for `name` and whether the caller must start its load. A name already
        in the table (the resolver returns names as their ids) skips the resolver's lookups in
        the model directories: they are paid once per load, not once per request."""
        if name:
            with self.lock:
                entry = self.models.get(name.removesuffix(":latest"))
            if entry is not None:
                return entry, False
        model_id, path = self.resolve(name)
        with self.lock:
            entry = self.models.get(model_id)
            if entry is not None:
                return entry, False
            entry = Loaded(model_id, Path(path), self.metrics, self.device,
                           estimate=weight_file_bytes(path),
                           keep_alive=None if pin else keep_alive)
            self.models[model_id] = entry
            return entry, True

    def _load(self, entry: Loaded, report: bool = True) -> None:
        with self.load_lock:
            t0 = time.monotonic()
            log.info("loading %s (%s)", entry.model_id, entry.path)
            try:
                if self.budget is not None:
                    entry.kv_least, entry.kv_full = self.sizer(entry.path)
                share = self._make_room(entry, entry.estimate + entry.kv_full,
                                        entry.estimate + entry.kv_least)
                model, engine = self.loader(entry.path, share)
                stats = engine.stats()
                entry.weights_bytes = int(stats.get("weights_bytes", 0)) or entry.estimate
                entry.kv_cache_bytes = int(stats.get("kv_cache_bytes", 0))
                entry.model, entry.engine = model, engine
                entry.load_seconds = time.monotonic() - t0
                self._make_room(entry, 0, 0)  # measured now: evict more if it is over
                log.info("loaded %s in %.2f s: weights %d bytes, KV cache %d bytes (%s)",
                         entry.model_id, entry.load_seconds, entry.weights_bytes,
                         entry.kv_cache_bytes, entry.device)
            except Exception as e:  # each waiter gets it; the server serves the others
                log.debug("loading %s failed", entry.path, exc_info=True)
                entry.error = str(e) if isinstance(e, MlxrError) else f"{type(e).__name__}: {e}"
                entry.error_status = 507 if isinstance(e, MemoryBudgetError) else 500
                if report:
                    log.error("loading %s failed: %s", entry.model_id, entry.error)
                with self.lock:
                    if self.models.get(entry.model_id) is entry:
                        del self.models[entry.model_id]  # the next request tries again
            entry.last_used = time.monotonic()
            with self.lock:
                entry.ready.set()
                waiters, entry.waiters = entry.waiters, []
            for loop, fut in waiters:
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    loop.call_soon_threadsafe(_resolve, fut)
            self._ensure_sweeper()

    def _make_room(self, entry: Loaded, want: int, least: int) -> int | None:
        """Evict idle models (least recently used first) until the loaded ones plus `want`
        bytes fit the budget, or while not even `least` fits (waiting for busy ones up to
        EVICT_WAIT_SECONDS); returns the bytes the budget leaves `entry` (None: no budget)."""
        if self.budget is None:
            return None
        if max(entry.size if entry.engine else 0, least) > self.budget:
            raise MemoryBudgetError(
                f"{entry.model_id} needs at least {least} bytes ({entry.estimate} of weight "
                f"files and a KV pool of {entry.kv_least}), more than the memory budget of "
                f"{self.budget} bytes (--memory-budget)")
        deadline = time.monotonic() + EVICT_WAIT_SECONDS
        while True:
            with self.lock:
                others = [e for e in self.models.values() if e is not entry and e.engine]
            used = sum(e.size for e in others) + (entry.size if entry.engine else 0)
            if used + want <= self.budget:
                return self.budget - used
            idle = sorted((e for e in others if not e.busy()), key=lambda e: e.last_used)
            if idle:
                log.info("evicting %s (least recently used) to fit %s in the memory budget",
                         idle[0].model_id, entry.model_id)
                self.unload(idle[0].model_id)
                continue
            if used + least <= self.budget:  # the rest is busy: a smaller KV pool
                return self.budget - used
            if time.monotonic() > deadline:
                raise MemoryBudgetError(
                    f"{entry.model_id} needs at least {least} bytes; the memory budget of "
                    f"{self.budget} bytes has {self.budget - used} left while the loaded "
                    "models are busy (--memory-budget)")
            time.sleep(0.1)

    # -- unloading -------------------------------------------------------------------------

    def unload(self, model_id: str) -> bool:
        """Stop a model's engine and drop it; False if it is not loaded."""
        with self.lock:
            entry = self.models.get(model_id)
            if entry is None or entry.engine is None:
                return False
            del self.models[model_id]
        t0 = time.monotonic()
        entry.engine.close()
        entry.model = entry.engine = None
        gc.unfreeze()  # the server froze the loaded heap (app.freeze_heap): let it go
        gc.collect()
        gc.freeze()
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        log.info("unloaded %s in %.2f s", model_id, time.monotonic() - t0)
        return True

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, daemon=True,
                                             name="mlxr-keep-alive")
            self._sweeper.start()

    def _sweep(self) -> None:
        """Unload models idle past their keep_alive. A busy model counts as used now, so its
        keep_alive runs from the end of its last request."""
        while not self._stop.wait(SWEEP_SECONDS):
            now = time.monotonic()
            with self.lock:
                entries = [e for e in self.models.values() if e.engine is not None]
            for e in entries:
                if e.busy():
                    e.last_used = now
                elif e.keep_alive is not None and now - e.last_used >= e.keep_alive:
                    log.info("%s idle for %.1f s (keep_alive): unloading", e.model_id,
                             now - e.last_used)
                    self.unload(e.model_id)

    def loaded(self) -> list[Loaded]:
        with self.lock:
            return [e for e in self.models.values() if e.engine is not None]

    def close(self) -> None:
        self._stop.set()
        for e in self.loaded():
            self.unload(e.model_id)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def not_found(name: str, why: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist ({why})", "invalid_request_error",
                    "model", "model_not_found")


def resolver(pinned: dict[str, Path]):
    """`resolve(name) -> (model_id, path)` over the models named on the command line
    (`pinned`: id -> path; their directory names too), the bundled models, aliases and pulled
    Hub names. Never a filesystem path from a request: clients name models, not files."""
    from ..names import BUNDLED, expand_alias, resolve_model
    from ..store.local import parse_name

    def resolve(name: str | None) -> tuple[str, Path]:
        if not name:
            if pinned:
                return next(iter(pinned.items()))
            raise APIError(400, "model is required (this server loads models on demand)",
                           "invalid_request_error", "model")
        name = name.removesuffix(":latest")
        if name in pinned:
            return name, pinned[name]
        for mid, path in pinned.items():
            if name in (path.name, str(path)):
                return mid, path
        bundled = "/" not in name and (BUNDLED / name / "config.json").is_file()
        if not bundled and parse_name(expand_alias(name)) is None:
            raise not_found(name, "give a bundled model, an alias or a pulled Hub name ORG/REPO")
        try:
            return name, resolve_model(name)
        except NotDownloadedError as e:
            raise not_found(name, str(e)) from None
        except MlxrError as e:
            raise not_found(name, str(e).split(":")[0]) from None

    return resolve
