"""Single-sequence generation: prefill the prompt, then decode one token per step.

This is the one stream of events the CLI consumes (and that the serving engine mirrors): each
step yields a `Chunk` with the new token ids, the text safe to show so far, and at the end a
finish reason and timing statistics.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .engine.cuda_graph import GraphCache
from .engine.kv_cache import new_cache
from .errors import ContextLengthError
from .harness import trace
from .models.decoder import Decoder
from .text.sampling import Sampler, SamplingParams, StopMatcher

# Captured decode graphs (and their KV caches) per CUDA decoder, reused across requests.
_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Stats:
    """Token counts and wall times of one generation (seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes from the prefill; the decode rate counts the steps after it.
        n = self.generation_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


@dataclass
class Chunk:
    """One step of output: token ids produced, text now safe to emit, finish reason at the end."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS / stop id / stop string) or "length"
    stats: Stats = field(default_factory=Stats)


class TextStream:
    """Sampled tokens -> what to emit: token ids, text (detokenized, stop strings cut and never
    shown) and, at the end, the finish reason. Shared by the single-request generator and the
    serving engine, so both stop the same way."""

    def __init__(self, detokenizer, params: SamplingParams, eos_ids: Sequence[int],
                 max_tokens: int):
        self.detok, self.max_tokens = detokenizer, max_tokens
        self.stop_ids = params.stop_token_set(eos_ids)
        self.stops = StopMatcher(params.stop)
        self.count = 0

    def _flush(self) -> tuple[str, bool]:
        text, stopped = self.stops.feed(self.detok.flush() if self.detok is not None else "")
        return (text if stopped else text + self.stops.flush()), stopped

    def wants_text(self, token: int) -> bool:
        """Whether `push(token)` detokenizes it (else it stops, or there is no detokenizer)."""
        return self.detok is not None and token not in self.stop_ids

    def push(self, token: int, piece: str | None = None) -> tuple[list[int], str, str | None]:
        """(ids to emit, text to emit, finish reason or None) for the next sampled token.
        `piece`: its new text when the caller already ran the detokenizer (`windows` +
        `accept`, batched across streams) for a token that `wants_text`."""
        self.count += 1
        if token in self.stop_ids:
            # Like mlx-lm, the EOS / stop token itself is not part of the output.
            return [], self._flush()[0], "stop"
        if piece is None:
            piece = self.detok.add(token) if self.detok is not None else ""
        text, stopped = self.stops.feed(piece)
        if stopped:
            return [token], text, "stop"
        if self.count >= self.max_tokens:
            more, stopped = self._flush()
            return [token], text + more, "stop" if stopped else "length"
        return [token], text, None


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, context: int) -> None:
    """Reject empty prompts, ids outside the embedding table and prompts past the context."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    bad = [i for i in prompt_ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    if len(prompt_ids) >= context:
        raise ContextLengthError(
            f"the prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens")


def stream_generate(decoder: Decoder, prompt_ids: Sequence[int], params: SamplingParams,
                    eos_ids: Sequence[int] = (), detokenizer=None) -> Iterator[Chunk]:
    """Generate from `prompt_ids`, yielding a Chunk per token (text needs a detokenizer)."""
    c = decoder.config
    check_prompt(prompt_ids, c.vocab_size, c.context_length)
    params.validate(c.vocab_size)
    max_tokens = min(params.max_tokens, c.context_length - len(prompt_ids))
    # Token selection where the logits are: on CUDA only the chosen id crosses to the host (a
    # [V] float32 row to copy and a CPU sort for top-p cost more than the decode step itself).
    sampler = Sampler(params, c.vocab_size, device=decoder.device)
    out = TextStream(detokenizer, params, eos_ids, max_tokens)
    stats = Stats(prompt_tokens=len(prompt_ids))
    history = [int(i) for i in prompt_ids]
    need = len(history) + max_tokens
    prefill = None
    if decoder.device.type == "cuda":
        graphs = _graphs.setdefault(decoder, GraphCache())
        cache, graph = graphs.get(decoder, need, new_cache)
        prefill = graphs.prefill_graph(decoder, cache, len(history))
    else:
        cache, graph = new_cache(decoder, need), None

    def tokens():
        """Sampled tokens; the consumer appends each to `history` before asking for the next.
        With MLXR_TRACE set, `decoder.forward` calls are spans (mlxr.load instruments it) and
        so is each CUDA-graph prefill and decode step here."""
        if prefill is not None:
            with trace.span("prefill", {"tokens": len(history), "graph": prefill.bucket}):
                logits = prefill.run(history)[0]
        else:
            logits = decoder.forward(torch.tensor(history), cache, last_only=True)[0]
        token = sampler(logits, history)
        yield token
        if graph is not None and sampler.plain_argmax:
            steps = graph.greedy(token, len(history) - 1, max_tokens - 1)
            while True:
                with trace.span("decode"):
                    token = next(steps, None)
                if token is None:
                    return
                yield token
        for _ in range(max_tokens - 1):
            if graph is not None:
                with trace.span("decode"):
                    logits = graph.logits_for(token, len(history) - 1)
            else:
                logits = decoder.forward(torch.tensor([token]), cache, last_only=True)[0]
            token = sampler(logits, history)
            yield token

    t0 = time.perf_counter()
    with torch.inference_mode():
        for n, token in enumerate(tokens()):
            if n == 0:
                stats.prefill_s = time.perf_counter() - t0
                t1 = time.perf_counter()
            stats.generation_tokens = n + 1
            history.append(token)
            ids, text, finish = out.push(token)
            if finish:
                stats.decode_s = time.perf_counter() - t1
            yield Chunk(ids, text, finish, stats)
            if finish:
                return
