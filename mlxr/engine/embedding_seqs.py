"""Embedding requests inside the serving engine.

Each text of an embeddings request is a sequence that is only prefilled: the scheduler packs its
tokens into the same steps as the generation requests' prompts and decodes (chunked under the
step's token budget, its KV in the shared paged pool while it runs), and when its last chunk has
run it leaves the engine with its pooled, L2-normalised final-norm hidden state: the last token
(Qwen3-Embedding), the mean of all tokens, or the first (`cls`), as `mlxr.embed` pools them.

The texts of one request share a `group` (the scheduler counts a request once against the
queue limit however many of its texts wait).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch

from ..errors import MlxrError
from .scheduler import Sequence

POOLINGS = ("last", "mean", "cls")
_groups = itertools.count()


@dataclass
class EmbeddingOutput:
    """One text's embedding: float32 [E] on the CPU, L2-normalised; `index` is the text's
    position in its request."""

    index: int
    vector: torch.Tensor
    prompt_tokens: int


class EmbeddingSeq(Sequence):
    """A text to embed: prefilled in chunks, pooled as its chunks run, never decoded."""

    def __init__(self, ids: list[int], index: int, pooling: str, group: int,
                 emit: Callable[[object], None]):
        super().__init__(list(ids), len(ids))
        self.index, self.pooling, self.emit = index, pooling, emit
        self.group = group
        # mean and first-token pooling need every token's hidden state: no prefix-cache reuse
        # (a reused block's tokens are not recomputed); the last token is always recomputed
        self.reuse_prefix = pooling == "last"
        self.pooled: torch.Tensor | None = None  # float32 [E]: the sum (mean) or the row

    def wanted_rows(self, row0: int, start: int, n: int) -> list[int]:
        """Rows of the step's flattened tokens whose hidden states this chunk's pooling needs
        (its tokens are rows [row0, row0 + n), positions [start, start + n))."""
        if self.pooling == "mean":
            return list(range(row0, row0 + n))
        if self.pooling == "cls":
            return [row0] if start == 0 else []
        return [row0 + n - 1] if start + n == len(self.token_ids) else []

    def pool(self, start: int, h: torch.Tensor) -> None:
        """Fold in the hidden states h float32 [r, E] of the rows `wanted_rows` gave for the
        chunk that began at position `start` (0 after a preemption: pooling starts over)."""
        if start == 0:
            self.pooled = None
        if h.shape[0] == 0:
            return
        if self.pooling == "mean":
            s = h.sum(0)
            self.pooled = s if self.pooled is None else self.pooled + s
        else:
            self.pooled = h[0]

    def output(self) -> EmbeddingOutput:
        v = self.pooled / len(self.token_ids) if self.pooling == "mean" else self.pooled
        v = torch.nn.functional.normalize(v, dim=-1).cpu()
        return EmbeddingOutput(self.index, v, len(self.token_ids))


def check_inputs(seqs: Seq[Seq[int]], pooling: str, vocab_size: int, context: int,
                 pool_tokens: int) -> None:
    """The request's token lists, checked: a MlxrError naming the first bad input's index."""
    if pooling not in POOLINGS:
        raise MlxrError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    if not seqs:
        raise MlxrError("input must not be empty")
    for i, s in enumerate(seqs):
        if not s:
            raise MlxrError(f"input[{i}] is empty")
        if len(s) > context:
            raise MlxrError(f"input[{i}] has {len(s)} tokens; the model's context is {context}")
        if len(s) > pool_tokens:
            raise MlxrError(f"input[{i}] has {len(s)} tokens; the KV cache holds {pool_tokens}")
        if any(not 0 <= t < vocab_size for t in s):
            raise MlxrError(f"input[{i}]: token ids must be inside the vocabulary "
                            f"(0..{vocab_size - 1})")


def new_group(seqs: Seq[Seq[int]], pooling: str,
              emit: Callable[[object], None]) -> list[EmbeddingSeq]:
    """One request's texts as sequences of one group; each emits its EmbeddingOutput (or the
    error that ended it) through `emit`."""
    g = next(_groups)
    return [EmbeddingSeq(list(s), i, pooling, g, emit) for i, s in enumerate(seqs)]


def pool_step(chunks: list[tuple[EmbeddingSeq, int, int]],
              hidden: torch.Tensor) -> list[EmbeddingSeq]:
    """After a step: each (sequence, chunk start, number of its wanted rows) takes its rows of
    `hidden` float32 [R, E] (in that order); returns the sequences whose last chunk ran (their
    num_computed already advanced)."""
    done, at = [], 0
    for seq, start, r in chunks:
        seq.pool(start, hidden[at:at + r])
        at += r
        if seq.num_computed == len(seq.token_ids):
            done.append(seq)
    return done
