"""CUDA graphs for one sequence: the decode step (one replay per token, the next step enqueued
before the host reads the sampled token) and the prompt's prefill (one replay per prompt).

The captured decode step is `Decoder.forward_static` (every index on the device) plus greedy
token selection: it writes the argmax into the step's own input buffer and advances the
position, so replay k+1 can be launched before token k has crossed to the host. Non-greedy
sampling reads the captured logits back and feeds the chosen id in (one host round trip per
token).

Prefill graphs: a prompt of n tokens runs as a captured forward over a bucket of B >= n tokens
(`PREFILL_BUCKETS`), padded at the end. Without the graph a prefill is host-bound on small
models: ~550 launches, each paying Python and Triton's launcher (Qwen3-0.6B, 512 tokens: 3.2 ms
of GPU work in ~19 ms of wall time on the H200). The padding is harmless: attention is causal,
so rows < n never see it; its K/V lands in cache slots >= n, which decode overwrites before any
query can see them (decode attends to positions <= its own); only row n-1's logits are taken.
Env `MLXR_PREFILL_GRAPHS=0` turns them off (eager prefill, as before).
"""

from __future__ import annotations

import logging
import os

import torch

from ..models.decoder import SeqSpan, Step

log = logging.getLogger(__name__)

# Prompt lengths with a prefill graph: doubling up to 256 tokens (short prompts are host-bound,
# padding them costs little), then steps of at most 1.5x (the padding costs at most half a
# prompt of compute; from ~1k tokens on the GPU time, not the host, dominates anyway).
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)

from .kv_cache import SequenceCache


def graphable(decoder) -> bool:
    """CUDA decoders whose RoPE does not depend on the sequence length (dynamic NTK does),
    whose MoE blocks run the MoE kernels (`capturable`: the torch path groups tokens by
    expert on the host), and that do not say they cannot be captured (`graphable = False`).
    Attention sinks are captured: the Triton attention kernels take them, and the reference
    attention builds its masks on the device. The hybrid families' single-sequence decode
    step is capturable too (`forward_static` over a HybridCache: states updated in place)."""
    dev = decoder.device
    return dev.type == "cuda" and getattr(decoder, "graphable", True) and not any(
        (r.spec.scaling or {}).get("rope_type") == "dynamic" for r in decoder.ropes) and all(
        layer.moe is None or layer.moe.capturable(dev) for layer in decoder.layers) and \
        _new_capture_allowed(decoder)


def _new_capture_allowed(decoder) -> bool:
    """MoE and hybrid decode steps are captured by default; `MLXR_MOE_GRAPHS=0` /
    `MLXR_HYBRID_GRAPHS=0` turn their capture off (eager steps, for A/B runs; for the
    serving engine's hybrids also its slot pool: the per-sequence caches as before). Both graphs ran
    on the H200 (scripts/moe_gpu_check.py, scripts/hybrid_gpu_check.py): captured logits within
    1.5e-6 (MoE, float32) and equal (hybrids, bf16) to the eager step's, greedy tokens the same,
    the serving engine's captured paged MoE decode batched == alone. A hybrid decoder is one
    whose config carries an `arch` spec (mlxr.config.hybrid)."""
    hybrid = getattr(getattr(decoder, "config", None), "arch", None) is not None
    if hybrid and os.environ.get("MLXR_HYBRID_GRAPHS") == "0":
        return False
    return all(layer.moe is None for layer in decoder.layers) or \
        os.environ.get("MLXR_MOE_GRAPHS") != "0"


def capture(body, pool=None, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `body()` (into the graph memory pool `pool` if given), after `warmups`
    eager runs on a side stream: every kernel compiled / autotuned and the allocator warmed
    outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmups):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        body()
    return graph


class GraphDecoder:
    """A captured decode step bound to one SequenceCache (slot = position), or one HybridCache
    (its `pool` is itself; the step updates its recurrent states in place)."""

    def __init__(self, decoder, cache: SequenceCache):
        self.decoder, self.cache = decoder, cache
        cap, dev = cache.capacity, decoder.device
        self.ids = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tables = {}
        for rope in decoder.ropes:
            if id(rope.spec) not in self.tables:
                self.tables[id(rope.spec)] = rope.cos_sin(0, cap)
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=True)  # ring of sampled ids
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.graph = capture(self._body, warmups=2)

    def _body(self) -> None:
        self.logits = self.decoder.forward_static(self.ids, self.pos, self.cache.pool,
                                                  self.tables)
        # the argmax lands in the step's own input (no copy launch): the host's read of token k
        # is enqueued before replay k + 1, which overwrites it
        torch.argmax(self.logits[0], dim=0, keepdim=True, out=self.ids)
        self.pos.add_(1)

    def start(self, token: int, position: int) -> None:
        """The next replay decodes `token` at `position`."""
        self.ids.fill_(token)
        self.pos.fill_(position)

    def greedy(self, first: int, position: int, n: int):
        """Yield up to n greedy tokens after `first` (at `position`); the caller may stop
        early. Replay k+1 is enqueued before token k is read."""
        self.start(first, position)
        self.graph.replay()
        self.host[0].copy_(self.ids[0], non_blocking=True)
        self.events[0].record()
        for k in range(n):
            if k + 1 < n:
                self.graph.replay()
                self.host[(k + 1) % 2].copy_(self.ids[0], non_blocking=True)
                self.events[(k + 1) % 2].record()
            self.events[k % 2].synchronize()
            yield int(self.host[k % 2])

    def logits_for(self, token: int, position: int) -> torch.Tensor:
        """Logits [V] of `token` at `position` (non-greedy sampling path)."""
        self.start(token, position)
        self.graph.replay()
        return self.logits[0]


class PrefillGraph:
    """A captured prefill of `bucket` tokens at positions [0, bucket) of one SequenceCache,
    returning the logits [1, V] of row `n - 1` for a prompt of n <= bucket tokens."""

    def __init__(self, decoder, cache: SequenceCache, bucket: int, pool):
        dev = decoder.device
        self.decoder, self.cache, self.bucket = decoder, cache, bucket
        self.ids = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.row = torch.zeros(1, dtype=torch.long, device=dev)
        self.host = torch.zeros(bucket, dtype=torch.long, pin_memory=True)
        self.step = Step([SeqSpan(0, bucket, slot_range=(0, bucket))],
                         torch.arange(bucket, device=dev), self.row)
        # The captured RoPE gathers read the rope tables' current storage: hold it, in case a
        # later, longer request makes a Rope grow (replace) its table.
        self.tables = [r.cos_sin(0, bucket) for r in decoder.ropes]
        self.graph = capture(self._body, pool)

    def _body(self) -> None:
        self.logits = self.decoder.forward_step(self.ids, self.step, self.cache.pool)

    def run(self, prompt: list[int]) -> torch.Tensor:
        """Prefill `prompt` (1 <= n <= bucket tokens); logits float32 [1, V] of its last token
        (valid until the next replay)."""
        n = len(prompt)
        # The previous replay has finished (its token was read), so the pinned buffer is free.
        self.host[:n] = torch.tensor(prompt, dtype=torch.long)
        self.host[n:] = 0
        self.ids.copy_(self.host, non_blocking=True)
        self.row.fill_(n - 1)
        self.graph.replay()
        self.cache.length = n
        return self.logits


class PaddedPrefillGraph(PrefillGraph):
    """A PrefillGraph of a decoder whose prompt runs `forward` rather than `forward_step` (the
    hybrids, over their HybridCache): the captured body is `forward_padded`, the padded
    prompt at positions [0, bucket) and the logits of the device row. Every index tensor the
    body uses is made inside it, so the graph owns it (none is cached on the cache)."""

    def _body(self) -> None:
        self.logits = self.decoder.forward_padded(self.ids, self.row, self.cache)


def padded_prefill(decoder, cache, bucket: int) -> bool:
    """Whether a decoder without `forward_step` prefills `bucket` tokens in a graph: it pads
    safely there (`pads_fit`: no MoE layer, room for the bucket; the padded rows leave every
    ring slot and recurrent state as the unpadded prompt leaves them), unless
    `MLXR_HYBRID_PREFILL_GRAPHS=0`. On by default since scripts/hybrid_prefill_gpu.py passed
    on an H100 (session 23): float32 logits equal to the eager prefill's (0 of the range at
    n = 37 and 300), capture exact; in bf16 a prompt shorter than its bucket goes through
    kernels of the bucket's row count, so its logits round differently (as the dense
    models' prefill graphs do), which moved greedy tokens only at near-ties of the random
    checkpoints."""
    return (os.environ.get("MLXR_HYBRID_PREFILL_GRAPHS", "1") != "0"
            and hasattr(decoder, "forward_padded") and decoder.pads_fit(cache, bucket))


def prefill_bucket(n: int, capacity: int) -> int | None:
    """The prefill graph bucket for an n-token prompt in a cache of `capacity` slots."""
    if os.environ.get("MLXR_PREFILL_GRAPHS", "1") == "0":
        return None
    return next((b for b in PREFILL_BUCKETS if n <= b <= capacity), None)


class GraphCache:
    """Per-decoder pool of (SequenceCache, GraphDecoder, prefill graphs) by capacity bucket, so
    repeated requests reuse the KV memory and the captured graphs. The graphs of one entry share
    one memory pool (they never run concurrently), so its memory is the largest graph's, not
    the sum."""

    def __init__(self):
        self.entries: dict[int, tuple[SequenceCache, GraphDecoder | None]] = {}
        self.prefill: dict[tuple[int, int], PrefillGraph | None] = {}
        self.pools: dict[int, object] = {}

    def get(self, decoder, length: int, make_cache) -> tuple[SequenceCache, GraphDecoder | None]:
        cap = 256
        while cap < length:
            cap *= 2
        if cap not in self.entries:
            cache = make_cache(decoder, cap)
            # a decoder that captures its own way (a tensor-parallel rank 0: every rank)
            make = getattr(decoder, "graph_decoder", None)
            graph = make(cache) if make is not None else \
                GraphDecoder(decoder, cache) if graphable(decoder) else None
            self.entries[cap] = (cache, graph)
        cache, graph = self.entries[cap]
        cache.length = 0
        return cache, graph

    def prefill_graph(self, decoder, cache: SequenceCache, n: int) -> PrefillGraph | None:
        """The prefill graph for an n-token prompt into `cache` (from `get`), captured on first
        use; None where there is none (no bucket, not graphable, a decoder whose prefill is
        not captured (`prefill_graphs` False: a tensor-parallel rank 0), or the capture
        failed: that bucket then stays eager, with a warning)."""
        bucket = prefill_bucket(n, cache.capacity)
        # hybrids without `forward_step` prefill eagerly, but for those that pad safely
        # (`padded_prefill`: `forward_padded` keeps the padding out of rings and states)
        if bucket is None or not graphable(decoder) or not getattr(decoder, "prefill_graphs",
                                                                   True):
            return None
        kind = PrefillGraph if hasattr(decoder, "forward_step") else \
            PaddedPrefillGraph if padded_prefill(decoder, cache, bucket) else None
        if kind is None:
            return None
        key = (cache.capacity, bucket)
        if key not in self.prefill:
            pool = self.pools.setdefault(cache.capacity, torch.cuda.graph_pool_handle())
            try:
                self.prefill[key] = kind(decoder, cache, bucket, pool)
            except Exception as e:  # noqa: BLE001 -- e.g. an op that cannot be captured: eager
                log.warning("prefill graph for %d tokens not captured (%s); running eager",
                            bucket, e)
                self.prefill[key] = None
        return self.prefill[key]
