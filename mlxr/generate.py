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

from .errors import ContextLengthError
from .engine.cuda_graph import GraphCache
from .engine.kv_cache import new_cache
from .models.decoder import Decoder
from .sampling import Sampler, SamplingParams, StopMatcher


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
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    sampler = Sampler(params, c.vocab_size, device="cpu")
    stops = StopMatcher(params.stop)
    stats = Stats(prompt_tokens=len(prompt_ids))
    history = [int(i) for i in prompt_ids]
    need = len(history) + max_tokens
    if decoder.device.type == "cuda":
        cache, graph = _graphs.setdefault(decoder, GraphCache()).get(decoder, need, new_cache)
    else:
        cache, graph = new_cache(decoder, need), None
    greedy = params.temperature == 0 and not params.logit_bias and (
        params.repetition_penalty in (None, 1.0)) and not params.presence_penalty and (
        not params.frequency_penalty)

    def tokens():
        """Sampled tokens; the consumer appends each to `history` before asking for the next."""
        logits = decoder.forward(torch.tensor(history), cache, last_only=True)[0]
        token = sampler(logits.cpu(), history)
        yield token
        if graph is not None and greedy:
            yield from graph.greedy(token, len(history) - 1, max_tokens - 1)
            return
        for _ in range(max_tokens - 1):
            if graph is not None:
                logits = graph.logits_for(token, len(history) - 1)
            else:
                logits = decoder.forward(torch.tensor([token]), cache, last_only=True)[0]
            token = sampler(logits.cpu(), history)
            yield token

    t0 = time.perf_counter()
    with torch.inference_mode():
        for n, token in enumerate(tokens()):
            if n == 0:
                stats.prefill_s = time.perf_counter() - t0
                t1 = time.perf_counter()
            stats.generation_tokens = n + 1
            history.append(token)
            if token in stop_ids:
                tail = detokenizer.flush() if detokenizer is not None else ""
                text, _ = stops.feed(tail)
                stats.decode_s = time.perf_counter() - t1
                # Like mlx-lm, the EOS / stop token itself is not part of the output.
                yield Chunk([], text + stops.flush(), "stop", stats)
                return
            piece = detokenizer.add(token) if detokenizer is not None else ""
            text, stopped = stops.feed(piece)
            if stopped:
                stats.decode_s = time.perf_counter() - t1
                yield Chunk([token], text, "stop", stats)
                return
            if n == max_tokens - 1:
                tail = detokenizer.flush() if detokenizer is not None else ""
                more, stopped = stops.feed(tail)
                stats.decode_s = time.perf_counter() - t1
                yield Chunk([token], text + more + ("" if stopped else stops.flush()),
                            "stop" if stopped else "length", stats)
                return
            yield Chunk([token], text, None, stats)
