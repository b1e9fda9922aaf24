"""The serving engine: requests in, per-step outputs out.

`LLMEngine.step()` runs one scheduled batch through the decoder and turns the logits of every
sequence that reached the end of its pending tokens into a sampled token, text and (at the end)
a finish reason; the texts of embeddings requests (embedding_seqs.py) run in the same steps and
leave with their pooled final hidden state. `mlxr.engine.async_engine.AsyncEngine` drives it
from a background thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .. import ops
from ..errors import MlxrError
from ..generate import TextStream, check_prompt
from ..harness import trace
from ..models.decoder import Decoder, PagedBatch, Step, span_for, write_slots_for
from ..text.sampling import Sampler, SamplingParams
from .decode_graphs import PagedDecodeRunner, supported
from .embedding_seqs import EmbeddingSeq, check_inputs, new_group, pool_step
from .kv_cache import BlockManager, KVPool
from .memory import (blocks_in_budget, free_memory_blocks, pool_plan, sequence_caches_plan,
                     snapshot_budget, tensor_bytes)
from .scheduler import Scheduler, Sequence
from .seq_caches import SequenceCaches
from .slot_caches import SlotCaches


class QueueFullError(MlxrError):
    """Too many requests are waiting; retry after `retry_after` seconds."""

    def __init__(self, msg: str, retry_after: int = 1):
        super().__init__(msg)
        self.retry_after = retry_after


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class EngineRequest:
    """What a client asks for: prompt ids, sampling, optional logprobs and a logits processor
    (e.g. a grammar mask: f(generated_ids, logits [V] float32) -> logits). Special tokens are
    left out of the text unless asked for (tool-call parsers need markers such as Mistral's
    [TOOL_CALLS] or Llama's <|python_tag|>)."""

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None
    logits_processor: Callable | None = None
    skip_special_tokens: bool = True


@dataclass
class RequestOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None


class _Request(Sequence):
    """A Sequence plus what turns its logits into outputs."""

    def __init__(self, req: EngineRequest, sampler: Sampler, out: TextStream,
                 emit: Callable[[RequestOutput], None]):
        super().__init__(list(req.prompt_ids), len(req.prompt_ids))
        self.req, self.sampler, self.out, self.emit = req, sampler, out, emit
        self.prompt_cached = 0


class LLMEngine:
    """Continuous batching over one model (synchronous; AsyncEngine drives it from a thread).

    Steps in which every scheduled sequence decodes one token run through a PagedDecodeRunner
    (`paged_decode`: None = on CUDA where the step can be captured in graphs, True = also
    eagerly elsewhere, for tests); other steps (prefill chunks) run `Decoder.forward_step`.
    The hybrid families decode through a HybridDecodeRunner over one slot pool (slot_caches)
    under the same switch (False: per-sequence caches, the batched step run eagerly).

    The KV pool: `num_blocks`, else what `memory_budget` (bytes for weights and pool together,
    the model server's share for this model) leaves after the measured weights (MemoryBudgetError
    below memory.MIN_POOL_TOKENS), else a share of the free memory (`memory_fraction`); never
    more than max_num_seqs full contexts. The hybrid families have no paged pool: their blocks
    meter the positions of per-sequence caches, sized the same way by what those caches, their
    recurrent states and the prefix snapshots may hold (memory.sequence_caches_plan); a slot
    pool is allocated up front and holds at most that (its full layers' K/V in those blocks,
    each position once)."""

    def __init__(self, model, max_num_seqs: int = 16, max_num_batched_tokens: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None,
                 memory_fraction: float | None = None, paged_decode: bool | None = None,
                 prefix_snapshot_bytes: int | None = None, memory_budget: int | None = None):
        self.model, self.decoder = model, model.decoder
        self.block_size = block_size
        # batched decode's 4-bit kernel needs its own weight copy (QuantWeight.add_batch_copy):
        # built before the KV pool is sized from the free memory
        for qw in self.decoder.quant_weights():
            qw.add_batch_copy()
        # measured once (the model server's memory budget counts them): bytes per device
        self.weights_bytes = sum(tensor_bytes(self.decoder).values())
        c = self.decoder.config
        # hybrid families: caches per sequence (seq_caches: made as they run; slot_caches: the
        # slots of one preallocated pool), no shared paged KV pool; prefix caching by state
        # snapshots within prefix_snapshot_bytes (default 512 MiB on CUDA, 64 MiB on CPU)
        hybrid = hasattr(self.decoder, "new_cache")
        snapshots = snapshot_budget(self.decoder.device, prefix_snapshot_bytes) \
            if getattr(self.decoder, "cache_snapshots", False) else 0
        capture = supported(self.decoder) and not hybrid
        use_paged = capture if paged_decode is None or hybrid else paged_decode
        # hybrids with a static batched step keep their caches in one slot pool, decoded by
        # captured graphs (slot_caches; paged_decode as for the dense models), on by default
        # since scripts/hybrid_engine_gpu.py passed on an H100 (session 23: 64 streams 1,539
        # output tok/s against 208.5 at 8 on per-sequence caches); MLXR_HYBRID_SLOTS=0 gives
        # the per-sequence caches back. The CPU tests pass paged_decode.
        slotted = hybrid and hasattr(self.decoder, "forward_batch_static") and (
            supported(self.decoder) and os.environ.get("MLXR_HYBRID_SLOTS", "1") != "0"
            if paged_decode is None else paged_decode)
        # hybrids: the blocks meter the positions their per-sequence caches hold (and what
        # those caches and the snapshots may hold in all is what the budget counts; a slot
        # pool holds at most that: its full layers' K/V are the blocks themselves, once)
        plan = sequence_caches_plan(c, self.decoder.dtype, block_size, max_num_seqs,
                                    snapshots) if hybrid else \
            pool_plan(c, self.decoder.dtype, block_size, max_num_seqs)
        n = num_blocks
        if not n:
            n = free_memory_blocks(plan, self.decoder.device, memory_fraction) \
                if memory_budget is None else \
                blocks_in_budget(plan, memory_budget, self.weights_bytes,
                                 int(use_paged or slotted), model.path.name)
        self.seq_caches = None if not hybrid else \
            SequenceCaches(self.decoder, block_size, snapshots) if not slotted else \
            SlotCaches(self.decoder, block_size, snapshots, n, max_num_seqs,
                       min(c.context_length, n * block_size), supported(self.decoder))
        # one extra block when decoding in buckets: the padding rows' trash block
        self.pool = None if hybrid else KVPool(c.num_layers, c.num_kv_heads, c.head_dim,
                                               n + use_paged, block_size, self.decoder.dtype,
                                               self.decoder.device)
        self.blocks = BlockManager(n, block_size, prefix_caching=not hybrid)
        self.paged = None
        if use_paged:
            with torch.inference_mode():
                args = (self.pool, n, max_num_seqs, min(c.context_length, n * block_size),
                        capture)
                # a tensor-parallel rank 0 makes one that every rank runs
                make = getattr(self.decoder, "paged_runner", None)
                self.paged = make(*args) if make else PagedDecodeRunner(self.decoder, *args)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if self.decoder.device.type == "cuda" else 256
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens,
                                   self.seq_caches.resume if hybrid else None)
        # embeddings need the final norm's hidden states: the plain decoder's forward_step
        self.embeds = not hybrid and type(self.decoder) is Decoder
        self.eos_ids = set(model.eos_token_ids)
        self.lock = threading.Lock()
        # the paged pool's bytes; a hybrid's caches are made per sequence: the most they
        # and the snapshots may hold (what the model server's budget counts)
        self.kv_cache_bytes = self.pool.nbytes if self.pool is not None else plan.bytes(n)

    def add(self, req: EngineRequest, emit: Callable[[RequestOutput], None]) -> _Request:
        """Validate and queue a request; `emit` receives its outputs (from the engine thread)."""
        c = self.model.config
        params = self.model.sampling_params(req.params)
        params.validate(c.vocab_size)
        check_prompt(req.prompt_ids, c.vocab_size, c.context_length)
        pool_tokens = len(self.blocks.blocks) * self.block_size
        if len(req.prompt_ids) >= pool_tokens:
            raise MlxrError(f"the prompt has {len(req.prompt_ids)} tokens; the KV cache holds "
                            f"{pool_tokens}")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise MlxrError("logprobs must be between 0 and 20")
        req = replace(req, params=params)
        max_tokens = min(params.max_tokens, c.context_length - len(req.prompt_ids),
                         pool_tokens - len(req.prompt_ids))
        try:
            detok = self.model.tokenizer.detokenizer(req.skip_special_tokens)
        except (OSError, ValueError):
            detok = None
        out = TextStream(detok, params, self.eos_ids, max_tokens)
        r = _Request(req, Sampler(params, c.vocab_size), out, emit)
        with self.lock:
            self.scheduler.add(r)
        return r

    def add_embeddings(self, seqs: list[list[int]], pooling: str,
                       emit: Callable[[object], None]) -> list[EmbeddingSeq]:
        """Validate and queue an embeddings request's token lists (MlxrError naming the bad
        input's index); `emit` receives each text's EmbeddingOutput (from the engine thread)."""
        if not self.embeds:
            raise MlxrError(f"{self.model.path.name}: embeddings need a plain decoder (not a "
                            "hybrid family, tensor-parallel or ONNX model)")
        c = self.model.config
        check_inputs(seqs, pooling, c.vocab_size, c.context_length,
                     len(self.blocks.blocks) * self.block_size)
        group = new_group(seqs, pooling, emit)
        with self.lock:
            for seq in group:
                self.scheduler.add(seq)
        return group

    def abort(self, seq: _Request) -> None:
        seq.aborted = True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> dict:
        s, b = self.scheduler, self.blocks
        out = {"running": len(s.running), "waiting": len(s.waiting),
               "kv_blocks_total": len(b.blocks), "kv_blocks_used": len(b.blocks) - b.num_free,
               "prefix_cache_queries": b.queries, "prefix_cache_hits": b.hits,
               "preemptions": s.num_preemptions, "weights_bytes": self.weights_bytes,
               "kv_cache_bytes": self.kv_cache_bytes}
        if self.seq_caches is not None:  # blocks resumed from state snapshots
            sc = self.seq_caches
            out.update(prefix_cache_queries=sc.queries, prefix_cache_hits=sc.hits,
                       prefix_snapshots=len(sc.snapshots), prefix_snapshot_bytes=sc.snapshots.used)
        return out

    def step(self) -> None:
        """Run one batch and emit outputs for every sequence that produced a token."""
        with self.lock:
            for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting)
                        if s.aborted]:
                self.scheduler.finish(seq)
            batch = self.scheduler.schedule()
            if self.seq_caches is not None:  # cancelled / preempted ones leave here
                self.seq_caches.release_all_but(self.scheduler.running)
        if not batch:
            return
        if self.seq_caches is not None:
            self._sequence_cache_step(batch)
            return
        if self.paged is not None and all(n == 1 and s.num_computed + 1 == len(s.token_ids)
                                          and s.group is None for s, n in batch):
            self._decode_step([s for s, _ in batch])
            return
        ids, spans, slots, rows, sampling = [], [], [], [], []
        pooled: list[tuple[EmbeddingSeq, int, int]] = []  # (text, chunk start, its rows)
        pool_rows: list[int] = []
        paged = self.paged is not None
        positions, tiles = [], []
        for s, (seq, n) in enumerate(batch):
            start = seq.num_computed
            if seq.num_generated == 0:
                seq.prompt_cached = seq.num_cached_tokens
            if paged:
                tiles.append((s, len(ids), start, n))
                positions += range(start, start + n)
            else:
                spans.append(span_for(seq.block_table, self.block_size, start, n, "cpu"))
            ids += seq.token_ids[start:start + n]
            slots += write_slots_for(seq.block_table, self.block_size, start, n)
            if isinstance(seq, EmbeddingSeq):
                want = seq.wanted_rows(len(ids) - n, start, n)
                pooled.append((seq, start, len(want)))
                pool_rows += want
            elif start + n == len(seq.token_ids):
                rows.append(len(ids) - 1)
                sampling.append(seq)
        dev = self.decoder.device
        for sp in spans:
            if sp.slots is not None:
                sp.slots = sp.slots.to(dev)
        step = Step(spans, torch.tensor(slots, dtype=torch.long, device=dev),
                    torch.tensor(rows + pool_rows, dtype=torch.long, device=dev))
        if paged:
            step.paged = self._paged_batch([seq for seq, _ in batch], tiles, positions)
        with torch.inference_mode(), trace.span("step", {"sequences": len(batch),
                                                         "tokens": len(ids)}):
            logits, hidden = self._forward(torch.tensor(ids), step, len(rows), bool(pooled))
            host = self._needs_host(sampling)
            greedy = logits.argmax(dim=-1).tolist()
            want = [r for r, h in enumerate(host) if h]
            host_logits = logits[torch.tensor(want, device=dev)].cpu() if want else []
        for seq, n in batch:
            seq.num_computed += n
            self.blocks.register(seq, seq.num_computed)
        self._emit_all(sampling, host, greedy, dict(zip(want, host_logits)))
        if pooled:
            done = pool_step(pooled, hidden)
            with self.lock:
                for seq in done:
                    self.scheduler.finish(seq)
            for seq in done:
                seq.emit(seq.output())

    def _forward(self, ids: torch.Tensor, step: Step, n_logits: int,
                 pooling: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits float32 [n_logits, V], hidden float32 [R - n_logits, E] | None) of a step
        whose wanted rows are the sampling rows, then (with `pooling`) the embedding texts'."""
        if not pooling:  # the generation path, as it always ran
            return self.decoder.forward_step(ids, step, self.pool), None
        x = self.decoder.forward_step(ids, step, self.pool, hidden=True)  # [R, E]
        d = self.decoder
        logits = d.cap_logits(d.head(x[:n_logits]).float()) if n_logits else \
            x.new_empty((0, d.config.vocab_size), dtype=torch.float32)
        return logits, x[n_logits:].float()

    def _sequence_cache_step(self, batch: list[tuple[_Request, int]]) -> None:
        """A step of a hybrid-family model: each sequence's chunk through its own cache."""
        for seq, _ in batch:
            if seq.num_generated == 0:
                seq.prompt_cached = seq.num_cached_tokens
        with torch.inference_mode(), trace.span("step", {"sequences": len(batch)}):
            sampling, logits = self.seq_caches.run(batch)
            host = self._needs_host(sampling)
            greedy = logits.argmax(dim=-1).tolist()
            host_logits = {r: logits[r].cpu() for r, h in enumerate(host) if h}
        for seq, n in batch:
            seq.num_computed += n
        self._emit_all(sampling, host, greedy, host_logits)
        with self.lock:  # finished ones leave here
            self.seq_caches.release_all_but(self.scheduler.running)

    def _paged_batch(self, seqs: list[_Request], tiles: list[tuple], positions: list[int]):
        """The step as the paged attention kernel reads it: block tables [S, W] (padded with
        block 0, never read past a sequence's length), row tiles, positions of the new tokens."""
        dev, c = self.decoder.device, self.decoder.config
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table))
                               for seq in seqs], dtype=torch.int32)
        items = ops.paged_items(tiles, ops.prefill_tile(c.num_heads, c.num_kv_heads))
        return PagedBatch(tables.to(dev), items.to(dev),
                          torch.tensor(positions, dtype=torch.long, device=dev), self.paged.rope)

    @staticmethod
    def _needs_host(seqs: list[_Request]) -> list[bool]:
        """Which sequences need their logits row on the host (anything but a plain argmax)."""
        return [not (s.sampler.plain_argmax and s.req.logits_processor is None
                     and s.req.logprobs is None) for s in seqs]

    def _emit_all(self, seqs: list[_Request], host: list[bool], greedy: list[int],
                  logits: dict) -> None:
        """Choose each sequence's token (device greedy or host sampling), detokenize them all
        in one batched call per skip-special setting, then emit."""
        chosen = [self._choose_or_fail(seq, logits[row]) if host[row] else (greedy[row], None)
                  for row, seq in enumerate(seqs)]
        failed = [row for row, c in enumerate(chosen) if isinstance(c, BaseException)]
        for row in failed:  # that sequence ends with its error; the batch goes on
            with self.lock:
                self.scheduler.finish(seqs[row])
            seqs[row].emit(chosen[row])
        if failed:
            seqs = [seq for row, seq in enumerate(seqs) if row not in failed]
            chosen = [c for row, c in enumerate(chosen) if row not in failed]
        pieces: list[str | None] = [None] * len(seqs)
        for skip in (True, False):
            rows, windows, counts = [], [], []
            for row, seq in enumerate(seqs):
                detok = seq.out.detok
                if seq.out.wants_text(chosen[row][0]) and detok.skip_special_tokens == skip:
                    w = detok.windows(chosen[row][0])
                    rows.append(row)
                    windows += w
                    counts.append(len(w))
            if rows:
                texts = self.model.tokenizer.decode_batch(windows, skip)
                at = 0
                for row, n in zip(rows, counts):
                    pieces[row] = seqs[row].out.detok.accept(texts[at:at + n])
                    at += n
        for row, seq in enumerate(seqs):
            token, lps = chosen[row]
            seq.token_ids.append(token)
            out_ids, text, finish = seq.out.push(token, pieces[row])
            if finish:
                with self.lock:
                    self.scheduler.finish(seq)
            seq.emit(RequestOutput(out_ids, text, finish, seq.prompt_len, seq.num_generated,
                                   seq.prompt_cached, lps if out_ids else None))

    @classmethod
    def _choose_or_fail(cls, seq: _Request, logits: torch.Tensor) -> tuple | MlxrError:
        """`_choose`, or the error that ends this sequence alone (a logits processor or the
        sampler raising on one row must not fail the other sequences of the step)."""
        try:
            return cls._choose(seq, logits)
        except Exception as e:  # noqa: BLE001 -- reported to that request as an engine failure
            err = MlxrError(f"engine failure: {type(e).__name__}: {e}")
            err.__cause__ = e
            return err

    @staticmethod
    def _choose(seq: _Request, logits: torch.Tensor) -> tuple[int, list | None]:
        """Sample from a logits row [V] (processor, penalties, sampling) plus its logprobs."""
        if seq.req.logits_processor is not None:
            logits = seq.req.logits_processor(seq.token_ids[seq.prompt_len:], logits)
        token = seq.sampler(logits, seq.token_ids)
        lps = None
        if seq.req.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            top = []
            if seq.req.logprobs:
                v, i = lp.topk(seq.req.logprobs)
                top = [(int(a), float(b)) for a, b in zip(i, v)]
            lps = [TokenLogprob(token, float(lp[token]), top)]
        return token, lps

    def _decode_step(self, seqs: list[_Request]) -> None:
        """One token for each sequence through the paged decode runner: plain-greedy rows take
        the argmax chosen on the device; the others get their logits row on the host."""
        host = self._needs_host(seqs)
        with torch.inference_mode(), trace.span("decode", {"sequences": len(seqs)}):
            greedy, logits = self.paged.run(seqs, host)
        for seq in seqs:
            seq.num_computed += 1
            self.blocks.register(seq, seq.num_computed)
        self._emit_all(seqs, host, greedy, logits)
