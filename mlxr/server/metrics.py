"""Server metrics in the Prometheus text format (no client library needed).

Request counters and the TTFT / time-per-output-token / end-to-end latency histograms are
measured at the HTTP layer; running/waiting, KV usage and the prefix cache come from the engine.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram("mlxr_time_to_first_token_seconds",
                              "Time from request arrival to the first output token.", TTFT_BUCKETS)
        self.tpot = Histogram("mlxr_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("mlxr_request_latency_seconds", "End-to-end request latency.",
                             E2E_BUCKETS)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_prompt_tokens": 0}
        self.requests: dict[tuple[str, str], int] = {}  # (route, outcome) -> count

    def request_done(self, route: str, outcome: str, prompt: int = 0, completion: int = 0,
                     cached: int = 0, ttft: float | None = None, e2e: float | None = None) -> None:
        with self.lock:
            self.requests[(route, outcome)] = self.requests.get((route, outcome), 0) + 1
            self.counters["prompt_tokens"] += prompt
            self.counters["generation_tokens"] += completion
            self.counters["cached_prompt_tokens"] += cached
            if ttft is not None:
                self.ttft.observe(ttft)
                if e2e is not None and completion > 1:
                    self.tpot.observe((e2e - ttft) / (completion - 1))
            if e2e is not None:
                self.e2e.observe(e2e)

    def render(self, engine_stats: dict | None, ready: bool) -> str:
        s = engine_stats or {}
        lines = ["# HELP mlxr_ready 1 when the model is loaded and serving.",
                 "# TYPE mlxr_ready gauge", f"mlxr_ready {int(ready)}"]

        def gauge(name, help, v):
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {v}"])

        gauge("mlxr_num_requests_running", "Requests in the running batch.", s.get("running", 0))
        gauge("mlxr_num_requests_waiting", "Requests waiting for admission.", s.get("waiting", 0))
        total, used = s.get("kv_blocks_total", 0), s.get("kv_blocks_used", 0)
        gauge("mlxr_kv_cache_blocks_total", "KV cache blocks.", total)
        gauge("mlxr_kv_cache_blocks_used", "KV cache blocks in use.", used)
        gauge("mlxr_kv_cache_usage_ratio", "Fraction of KV blocks in use.",
              f"{used / total:.6f}" if total else 0)
        q, h = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        for name, v in (("queries", q), ("hits", h)):
            lines += [f"# HELP mlxr_prefix_cache_{name}_total Prefix cache {name} (tokens).",
                      f"# TYPE mlxr_prefix_cache_{name}_total counter",
                      f"mlxr_prefix_cache_{name}_total {v}"]
        gauge("mlxr_prefix_cache_hit_rate", "Prefix cache hits / queries.",
              f"{h / q:.6f}" if q else 0)
        with self.lock:
            for k, v in self.counters.items():
                lines += [f"# HELP mlxr_{k}_total Total {k.replace('_', ' ')}.",
                          f"# TYPE mlxr_{k}_total counter", f"mlxr_{k}_total {v}"]
            lines += ["# HELP mlxr_requests_total Finished HTTP requests by route and outcome.",
                      "# TYPE mlxr_requests_total counter"]
            for (route, outcome), v in sorted(self.requests.items()):
                lines.append(f'mlxr_requests_total{{route="{route}",outcome="{outcome}"}} {v}')
            for hist in (self.ttft, self.tpot, self.e2e):
                lines += hist.render()
        return "\n".join(lines) + "\n"
