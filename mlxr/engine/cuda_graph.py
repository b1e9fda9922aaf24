"""CUDA-graph decode for one sequence: one graph replay per token, the next step enqueued before
the host reads the sampled token.

The captured step is `Decoder.forward_static` (every index on the device) plus greedy token
selection: it writes the argmax into the step's own input buffer and advances the position, so
replay k+1 can be launched before token k has crossed to the host. Non-greedy sampling reads the
captured logits back and feeds the chosen id in (one host round trip per token).
"""

from __future__ import annotations

import torch

from .kv_cache import SequenceCache


def graphable(decoder) -> bool:
    """CUDA decoders whose RoPE does not depend on the sequence length (dynamic NTK does)."""
    return decoder.device.type == "cuda" and not any(
        (r.spec.scaling or {}).get("rope_type") == "dynamic" for r in decoder.ropes)


class GraphDecoder:
    """A captured decode step bound to one SequenceCache (slot = position)."""

    def __init__(self, decoder, cache: SequenceCache):
        self.decoder, self.cache = decoder, cache
        cap, dev = cache.capacity, decoder.device
        self.ids = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.key_pos = torch.arange(cap, device=dev)
        self.tables = {}
        for rope in decoder.ropes:
            if id(rope.spec) not in self.tables:
                self.tables[id(rope.spec)] = rope.cos_sin(0, cap)
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=True)  # ring of sampled ids
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # compile / autotune every kernel outside the capture
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self._body()

    def _body(self) -> None:
        self.logits = self.decoder.forward_static(self.ids, self.pos, self.cache.pool,
                                                  self.tables, self.key_pos)
        self.next_id = self.logits[0].argmax().view(1)
        self.ids.copy_(self.next_id)
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
        self.host[0].copy_(self.next_id[0], non_blocking=True)
        self.events[0].record()
        for k in range(n):
            if k + 1 < n:
                self.graph.replay()
                self.host[(k + 1) % 2].copy_(self.next_id[0], non_blocking=True)
                self.events[(k + 1) % 2].record()
            self.events[k % 2].synchronize()
            yield int(self.host[k % 2])

    def logits_for(self, token: int, position: int) -> torch.Tensor:
        """Logits [V] of `token` at `position` (non-greedy sampling path)."""
        self.start(token, position)
        self.graph.replay()
        return self.logits[0]


class GraphCache:
    """Per-decoder pool of (SequenceCache, GraphDecoder) by capacity bucket, so repeated
    requests reuse both the KV memory and the captured graph."""

    def __init__(self):
        self.entries: dict[int, tuple[SequenceCache, GraphDecoder | None]] = {}

    def get(self, decoder, length: int, make_cache) -> tuple[SequenceCache, GraphDecoder | None]:
        cap = 256
        while cap < length:
            cap *= 2
        if cap not in self.entries:
            cache = make_cache(decoder, cap)
            graph = GraphDecoder(decoder, cache) if graphable(decoder) else None
            self.entries[cap] = (cache, graph)
        cache, graph = self.entries[cap]
        cache.length = 0
        return cache, graph
