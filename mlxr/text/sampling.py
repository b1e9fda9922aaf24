"""Sampling parameters and the next-token sampler.

`SamplingParams` is the user-facing request (OpenAI / mlx-lm style names); `Sampler` turns one
position's logits into a token id. The logit pipeline, in order:

1. **logit_bias** -- ``logits[id] += bias`` (OpenAI style; a large negative bias such as -100
   effectively bans a token, a large positive one forces it).
2. **repetition_penalty** ``p`` (mlx-lm / HF CTRL style) -- over the *distinct* token ids among
   the last ``repetition_context_size`` entries of ``token_ids``: positive logits are divided by
   ``p``, negative ones multiplied by ``p``. Each id is penalised once however often it occurs.
3. **presence_penalty / frequency_penalty** (OpenAI style) -- ``logit -= presence * (count > 0)
   + frequency * count``, where ``count`` is how often the id occurs in *all* of ``token_ids``
   passed (prompt and generated tokens alike; pass only generated tokens to get OpenAI's exact
   behaviour). Negative values reward repetition.
4. **temperature == 0** -- greedy: the token is ``argmax`` of the logits after steps 1-3 (ties go
   to the lowest id, as ``torch.argmax``); steps 5-8 are skipped.
5. **temperature** -- logits are divided by the temperature.
6. **top_k** -- keep the ``k`` highest logits (ties at the k-th value are all kept); 0 or None
   disables it.
7. **top_p** (nucleus) -- on the softmax of what is left, keep the smallest set of the most
   probable tokens whose cumulative probability is ``>= top_p`` (equal probabilities are ranked
   by lower id first); the top token is always kept.
   1.0 or None disables it.
8. **min_p** -- keep tokens whose probability is ``>= min_p * (max probability)``; 0 or None
   disables it.
9. Sample from the softmax of the remaining logits with ``torch.multinomial`` and the sampler's
   own ``torch.Generator`` (seeded from ``seed``, so the same seed gives the same tokens).

Masked tokens get ``-inf`` and can never be drawn. `Sampler.process` returns the logits after
all of the above that apply (for greedy: after steps 1-3 only). On the sampling path the logits
are first shifted so that their maximum is 0 (softmax / log-softmax are unchanged by this).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mlxr.errors import MlxrError
from mlxr.text.stops import StopMatcher

__all__ = ["SamplingParams", "Sampler", "StopMatcher"]

# Upper bounds on sizes, to turn absurd requests into clear errors instead of hangs / OOM.
MAX_TOKENS_LIMIT = 1 << 24
MAX_CONTEXT_SIZE_LIMIT = 1 << 24
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 4096
MAX_STOP_TOKEN_IDS = 1024
# Ranges the float32 sampler computes without inf / NaN: logits shifted to <= 0, divided by a
# temperature that is a normal float32 (1e-300 is 0 in float32: 0/0 = NaN), stay finite or
# -inf; penalties and biases far past any useful value would turn rows into inf - inf.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e6
MAX_PENALTY = 1e3
MAX_LOGIT_BIAS = 1e6


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to pick each token. See the module docstring for semantics.

    ``None`` fields mean "not set by the request": `with_defaults` fills them from the model's
    generation_config.json, and anything still ``None`` is neutral (disabled). A ``temperature``
    still ``None`` at sampling time means greedy (the same as ``with_defaults({})``).
    """

    max_tokens: int = 256
    temperature: float | None = None  # None: from generation_config.json; 0: greedy
    top_k: int | None = None  # 0 / None: disabled
    top_p: float | None = None  # 1.0 / None: disabled
    min_p: float | None = None  # 0 / None: disabled
    repetition_penalty: float | None = None  # 1.0 / None: disabled
    repetition_context_size: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def with_defaults(self, generation_config: Mapping | None) -> SamplingParams:
        """Fill the ``None`` fields from a generation_config.json dict; explicit values win.

        Keys read: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
        ``do_sample`` (keys that are missing or ``null`` count as unset).

        Temperature, when the request leaves it ``None``:

        * ``do_sample`` is ``false`` -> 0 (greedy; as transformers does, whatever ``temperature``
          says);
        * ``do_sample`` is ``true`` -> the config's ``temperature``, else 1.0;
        * ``do_sample`` absent -> the config's ``temperature`` if given (the model authors'
          recommended setting), else 0 (greedy).

        Fields the config does not set stay ``None`` (neutral): no implicit top_k=50 etc.
        """
        gc = dict(generation_config or {})

        def get(key: str, kind):
            v = gc.get(key)
            if v is None:
                return None
            ok = _is_int(v) if kind is int else _is_real(v)
            if kind is int and not ok and _is_real(v) and float(v).is_integer():
                v, ok = int(v), True
            if ok and kind is float and abs(v) > 1e30:  # also a 400-digit int: no OverflowError
                ok = False
            if not ok:
                raise MlxrError(
                    f"generation_config.json: {key!r} must be a {kind.__name__}, got {v!r:.40}"
                )
            return kind(v)

        do_sample = gc.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise MlxrError(
                f"generation_config.json: 'do_sample' must be a bool, got {do_sample!r}"
            )

        updates: dict = {}
        if self.temperature is None:
            t = get("temperature", float)
            if do_sample is False:
                updates["temperature"] = 0.0
            elif do_sample is True:
                updates["temperature"] = 1.0 if t is None else t
            else:
                updates["temperature"] = 0.0 if t is None else t
        for key, kind in (
            ("top_k", int),
            ("top_p", float),
            ("min_p", float),
            ("repetition_penalty", float),
        ):
            if getattr(self, key) is None:
                v = get(key, kind)
                if v is not None:
                    updates[key] = v
        return replace(self, **updates) if updates else self

    def validate(self, vocab_size: int) -> None:
        """Raise `MlxrError` (a ValueError) naming the first bad field; return None if all ok."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise MlxrError(f"vocab_size must be a positive int, got {vocab_size!r}")

        def bad(field: str, why: str, value) -> MlxrError:
            return MlxrError(f"{field}: {why}, got {value!r}")

        def check_int(field: str, lo: int, hi: int, optional: bool = False):
            v = getattr(self, field)
            if v is None and optional:
                return
            if not _is_int(v):
                raise bad(field, "must be an int", v)
            if not lo <= v <= hi:
                raise bad(field, f"must be in [{lo}, {hi}]", v)

        def check_real(field: str, optional: bool = False) -> float | None:
            v = getattr(self, field)
            if v is None and optional:
                return None
            if not _is_real(v) or not math.isfinite(v):
                raise bad(field, "must be a finite number", v)
            return float(v)

        check_int("max_tokens", 1, MAX_TOKENS_LIMIT)

        t = check_real("temperature", optional=True)
        if t is not None and not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise bad("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                      f"{MAX_TEMPERATURE:g}]", t)

        check_int("top_k", 0, 1 << 31, optional=True)

        p = check_real("top_p", optional=True)
        if p is not None and not 0 < p <= 1:
            raise bad("top_p", "must be in (0, 1]", p)

        m = check_real("min_p", optional=True)
        if m is not None and not 0 <= m <= 1:
            raise bad("min_p", "must be in [0, 1]", m)

        r = check_real("repetition_penalty", optional=True)
        if r is not None and not 1 / MAX_PENALTY <= r <= MAX_PENALTY:
            raise bad("repetition_penalty", f"must be in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                      r)
        check_int("repetition_context_size", 0, MAX_CONTEXT_SIZE_LIMIT)

        for field in ("presence_penalty", "frequency_penalty"):
            if abs(check_real(field)) > MAX_PENALTY:
                raise bad(field, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                          getattr(self, field))

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise bad("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
            for k, v in self.logit_bias.items():
                if not _is_int(k) or not 0 <= k < vocab_size:
                    raise MlxrError(
                        f"logit_bias: token id {k!r} is not an int in [0, {vocab_size})"
                    )
                if not _is_real(v) or not abs(v) <= MAX_LOGIT_BIAS:
                    raise MlxrError(f"logit_bias[{k}]: bias must be a number in "
                                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r}")

        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            raise bad("seed", "must be an int in [0, 2**64)", self.seed)

        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, Sequence):
            raise bad("stop", "must be a sequence of strings", stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings", len(stop))
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise bad(f"stop[{i}]", "must be a non-empty string", s)
            if len(s) > MAX_STOP_STRING_LEN:
                raise bad(f"stop[{i}]", f"must be at most {MAX_STOP_STRING_LEN} chars", len(s))

        ids = self.stop_token_ids
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise bad("stop_token_ids", "must be a sequence of ints", ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", len(ids))
        for i, tid in enumerate(ids):
            if not _is_int(tid) or not 0 <= tid < vocab_size:
                raise bad(f"stop_token_ids[{i}]", f"must be an int in [0, {vocab_size})", tid)

        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool", self.ignore_eos)

    def stop_token_set(self, eos_token_ids: Sequence[int] = ()) -> frozenset[int]:
        """Token ids that end generation: ``stop_token_ids`` plus the EOS ids unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return frozenset(ids)


class Sampler:
    """Picks the next token from one position's logits; see the module docstring for the order.

    Owns a ``torch.Generator`` on ``device`` seeded with ``params.seed`` (a random seed when
    ``None``), so a fresh Sampler with the same seed and the same logits gives the same tokens.
    ``params`` should already have been through `SamplingParams.with_defaults`; it is validated
    here.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, device: str | torch.device = "cpu"):
        params.validate(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if params.seed is None:
            self.generator.seed()
        else:
            # torch takes seeds in [-2**63, 2**64); keep the full validated range.
            self.generator.manual_seed(params.seed)

        p = params
        self.temperature = 0.0 if p.temperature is None else float(p.temperature)
        self.top_k = p.top_k if p.top_k and p.top_k < vocab_size else None
        self.top_p = p.top_p if p.top_p is not None and p.top_p < 1.0 else None
        self.min_p = p.min_p if p.min_p else None
        self.rep_penalty = (
            p.repetition_penalty
            if p.repetition_penalty is not None
            and p.repetition_penalty != 1.0
            and p.repetition_context_size > 0
            else None
        )
        self._bias_ids: Tensor | None = None
        self._bias_vals: Tensor | None = None
        if p.logit_bias:
            items = sorted(p.logit_bias.items())
            self._bias_ids = torch.tensor(
                [k for k, _ in items], dtype=torch.long, device=self.device
            )
            self._bias_vals = torch.tensor(
                [float(v) for _, v in items], dtype=torch.float32, device=self.device
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing applied before the argmax (no bias, no penalties): the token is
        the argmax of the raw logits, so it can be chosen where the logits are (on the GPU)."""
        p = self.params
        return (self.greedy and self._bias_ids is None and self.rep_penalty is None
                and not p.presence_penalty and not p.frequency_penalty)

    def _ids(self, token_ids: Sequence[int]) -> Tensor:
        t = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).to(self.device)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise MlxrError(f"token_ids: ids must be in [0, {self.vocab_size})")
        return t

    def _penalize(self, logits: Tensor, token_ids: Sequence[int]) -> Tensor:
        """Steps 1-3: logit bias, repetition penalty, presence/frequency penalties."""
        if logits.numel() != self.vocab_size:
            raise MlxrError(
                f"logits: expected {self.vocab_size} values for one position, "
                f"got shape {tuple(logits.shape)}"
            )
        x = logits.reshape(-1).to(device=self.device, dtype=torch.float32, copy=True)
        p = self.params
        if self._bias_ids is not None:
            x.index_add_(0, self._bias_ids, self._bias_vals)
        if self.rep_penalty is not None and len(token_ids):
            recent = self._ids(token_ids[-p.repetition_context_size :]).unique()
            sel = x[recent]
            x[recent] = torch.where(sel < 0, sel * self.rep_penalty, sel / self.rep_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(token_ids):
            counts = torch.bincount(self._ids(token_ids), minlength=self.vocab_size).to(x.dtype)
            if p.frequency_penalty:
                x -= p.frequency_penalty * counts
            if p.presence_penalty:
                x -= p.presence_penalty * (counts > 0).to(x.dtype)
        return x

    def _filter(self, x: Tensor) -> Tensor:
        """Steps 5-8 on penalised logits: temperature, top-k, top-p, min-p (in place)."""
        ninf = float("-inf")
        # Shift by the max first so that tiny temperatures cannot overflow to +inf.
        x -= x.max()
        if self.temperature != 1.0:
            x /= self.temperature
        if self.top_k is not None:
            kth = torch.topk(x, self.top_k).values[-1]
            x.masked_fill_(x < kth, ninf)
        if self.top_p is not None:
            probs = torch.softmax(x, dim=-1)
            sorted_p, order = torch.sort(probs, descending=True, stable=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly better tokens
            drop_sorted = before >= self.top_p
            drop_sorted[0] = False  # always keep the top token
            drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
            x.masked_fill_(drop, ninf)
        if self.min_p is not None:
            probs = torch.softmax(x, dim=-1)
            x.masked_fill_(probs < self.min_p * probs.max(), ninf)
        return x

    def process(self, logits: Tensor, token_ids: Sequence[int]) -> Tensor:
        """The float32 [V] logits after every step that applies (masked tokens are -inf).

        Greedy (temperature 0): after bias and penalties only. The input is not modified.
        """
        x = self._penalize(logits, token_ids)
        if self.greedy:
            return x
        return self._filter(x)

    def __call__(self, logits: Tensor, token_ids: Sequence[int]) -> int:
        """Pick the next token id given this position's logits and all previous token ids."""
        x = self._penalize(logits, token_ids)
        if self.greedy:
            return int(torch.argmax(x))
        if torch.isnan(x).any():
            raise MlxrError("logits: NaN values, cannot sample")
        if not torch.isfinite(x.max()):
            # All -inf (or a +inf): fall back to the top token(s) deterministically.
            return int(torch.argmax(x))
        x = self._filter(x)
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
