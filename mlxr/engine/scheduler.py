"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step mixes decodes (one token per running sequence) with chunks of prompts still being
prefilled, under a token budget, so a long prompt never stalls the streams already running.
A request joins at the next step; finished ones leave. When the KV pool runs out, the newest
running sequence is preempted (its blocks freed, recomputed later from its tokens).

An embeddings request's texts (`group` set: prefill only, see embedding_seqs.py) queue in the
same FIFO and share the token budget, but do not count against `max_num_seqs` (that bounds the
decode batch; they never decode) and count as one waiting request per group.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from .kv_cache import BlockManager

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    token_ids: list[int]  # prompt + generated
    prompt_len: int
    id: int = field(default_factory=lambda: next(_ids))
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_hashed: int = 0  # leading blocks entered in the prefix cache (BlockManager.register)
    num_computed: int = 0  # tokens whose KV is in the cache
    arrival: float = field(default_factory=time.monotonic)
    finished: bool = False
    aborted: bool = False
    group: int | None = None  # the embeddings request this text belongs to (None: generation)
    reuse_prefix: bool = True  # may start from cached prefix blocks (BlockManager.allocate)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 resume=None):
        """resume(seq) -> tokens restored from elsewhere than the block manager's prefix cache
        (the hybrids' state snapshots), asked at each admission."""
        self.blocks, self.resume = blocks, resume
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._waiting_groups: Counter[int] = Counter()  # group -> its texts in `waiting`
        self._running_decoders = 0  # running sequences that are not embedding texts

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.group is not None:
            self._waiting_groups[seq.group] += 1

    def waiting_requests(self) -> int:
        """Requests waiting: one per generation sequence, one per embeddings request."""
        grouped = sum(self._waiting_groups.values())
        return len(self.waiting) - grouped + len(self._waiting_groups)

    def _left_waiting(self, seq: Sequence) -> None:
        if seq.group is not None:
            self._waiting_groups[seq.group] -= 1
            if not self._waiting_groups[seq.group]:
                del self._waiting_groups[seq.group]

    def _run(self, seq: Sequence) -> None:
        self.running.append(seq)
        self._running_decoders += seq.group is None

    def _stop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._running_decoders -= seq.group is None
        self.blocks.free_seq(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self._stop(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        if seq.group is not None:
            self._waiting_groups[seq.group] += 1
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.finished = True
        if seq in self.running:
            self._stop(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self._left_waiting(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, number of its pending tokens to compute) pairs."""
        budget = self.max_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        # Running sequences first (decodes, then unfinished prefill chunks), oldest first.
        preempted: set[Sequence] = set()  # (a set: `in self.running` per sequence is O(n^2))
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq in preempted or budget == 0:
                continue
            # Room for the tokens to compute; preempt the newest others until there is.
            while len(seq.token_ids) > len(seq.block_table) * self.blocks.block_size \
                    and self.blocks.num_free == 0:
                victim = max((s for s in self.running if s is not seq), key=lambda s: s.arrival,
                             default=None)
                if victim is None:
                    break
                batch = [(s, n) for s, n in batch if s is not victim]
                self._preempt(victim)
                preempted.add(victim)
            if len(seq.token_ids) > len(seq.block_table) * self.blocks.block_size:
                if self.blocks.num_free == 0:
                    continue
                self.blocks.append(seq)
            n = min(seq.num_pending, budget)
            batch.append((seq, n))
            budget -= n
        # Then admit waiting requests while there is budget, a sequence slot and KV room.
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.group is None and self._running_decoders >= self.max_num_seqs:
                break
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self._left_waiting(seq)
            self.blocks.allocate(seq)
            if self.resume is not None:
                seq.num_cached_tokens = self.resume(seq)
            seq.num_computed = seq.num_cached_tokens
            self._run(seq)
            n = min(seq.num_pending, budget)
            batch.append((seq, n))
            budget -= n
        return batch
