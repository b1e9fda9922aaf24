"""Tests for mlxr.text.sampling (SamplingParams, Sampler) and mlxr.text.stops (StopMatcher)."""

import math
import random

import pytest
import torch

from mlxr.errors import MlxrError
from mlxr.text.sampling import Sampler, SamplingParams
from mlxr.text.stops import StopMatcher

NINF = float("-inf")

# Known distribution, deliberately not sorted by id.
PROBS = [0.15, 0.5, 0.05, 0.2, 0.1]  # id order; sorted: 1 (.5), 3 (.2), 0 (.15), 4 (.1), 2 (.05)
LOGITS = torch.log(torch.tensor(PROBS, dtype=torch.float32))


def kept(x: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(x.tolist()) if v != NINF}


def draw(sampler: Sampler, logits: torch.Tensor, n: int, token_ids=()) -> list[int]:
    return [sampler(logits, token_ids) for _ in range(n)]


def assert_frequencies(draws: list[int], probs: dict[int, float], sigmas: float = 5.0):
    """Every token's count is within `sigmas` binomial std devs of n*p; others never drawn."""
    n = len(draws)
    counts = {t: draws.count(t) for t in set(draws)}
    assert set(counts) <= {t for t, p in probs.items() if p > 0}, counts
    for t, p in probs.items():
        c = counts.get(t, 0)
        sd = math.sqrt(n * p * (1 - p))
        assert abs(c - n * p) <= sigmas * sd + 1, (t, c, n * p, sd)


def renorm(ids) -> dict[int, float]:
    z = sum(PROBS[i] for i in ids)
    return {i: PROBS[i] / z for i in ids}


# ----------------------------------------------------------------------------- masks (exact)


@pytest.mark.parametrize(
    "k, expected", [(1, {1}), (2, {1, 3}), (3, {0, 1, 3}), (4, {0, 1, 3, 4}), (5, set(range(5)))]
)
def test_top_k_mask(k, expected):
    s = Sampler(SamplingParams(temperature=1.0, top_k=k), 5)
    assert kept(s.process(LOGITS, [])) == expected


def test_top_k_zero_and_large_disabled_and_ties_kept():
    for k in (0, 5, 100):
        assert kept(Sampler(SamplingParams(temperature=1.0, top_k=k), 5).process(LOGITS, [])) == {
            0, 1, 2, 3, 4
        }
    tied = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    assert kept(Sampler(SamplingParams(temperature=1.0, top_k=2), 5).process(tied, [])) == {0, 2, 3}


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (1e-6, {1}),  # top token always kept
        (0.4, {1}),
        (0.6, {1, 3}),  # 0.5 < 0.6 <= 0.7
        (0.75, {1, 3, 0}),  # 0.7 < 0.75 <= 0.85
        (0.9, {1, 3, 0, 4}),  # 0.85 < 0.9 <= 0.95
        (0.97, {0, 1, 2, 3, 4}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_mask(top_p, expected):
    s = Sampler(SamplingParams(temperature=1.0, top_p=top_p), 5)
    out = s.process(LOGITS, [])
    assert kept(out) == expected
    # Kept logits are unchanged (temperature 1 only shifts by the max).
    ref = LOGITS - LOGITS.max()
    for i in expected:
        assert out[i].item() == pytest.approx(ref[i].item(), abs=1e-6)


def test_top_p_exact_boundary_smallest_set():
    # Four equal probabilities of exactly 0.25: the smallest set reaching 0.5 has two tokens;
    # ties are broken towards the lower id.
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5), 4)
    assert kept(s.process(torch.zeros(4), [])) == {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.75), 4)
    assert kept(s.process(torch.zeros(4), [])) == {0, 1, 2}


@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.0, {0, 1, 2, 3, 4}),
        (0.05, {0, 1, 2, 3, 4}),  # threshold 0.025
        (0.15, {0, 1, 3, 4}),  # threshold 0.075
        (0.25, {0, 1, 3}),  # threshold 0.125
        (0.5, {1}),  # threshold 0.25
        (1.0, {1}),
    ],
)
def test_min_p_mask(min_p, expected):
    s = Sampler(SamplingParams(temperature=1.0, min_p=min_p), 5)
    assert kept(s.process(LOGITS, [])) == expected


def test_filters_compose_in_order():
    # top_k=4 drops id 2; renormalised cumulative mass before each token (1, 3, 0, 4):
    # 0, .526, .737, .895 -> top_p=0.8 keeps {1, 3, 0}; renormalised again: .588, .235, .176
    # -> min_p=0.35 (threshold .206) keeps {1, 3}.
    s = Sampler(SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.35), 5)
    assert kept(s.process(LOGITS, [])) == {1, 3}
    # top_k applies before top_p: top_p=0.99 alone would keep everything.
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=0.99), 5)
    assert kept(s.process(LOGITS, [])) == {1, 3}


def test_temperature_applied_before_filters():
    # At temperature 0.5 probs become p^2 / sum: .0225,.25,.0025,.04,.01 (sum .325)
    # -> .769, .123, .069, ... top_p=0.8 keeps {1, 3}; at temperature 1 it would keep {1, 3, 0}.
    cold = Sampler(SamplingParams(temperature=0.5, top_p=0.8), 5)
    assert kept(cold.process(LOGITS, [])) == {1, 3}
    assert kept(Sampler(SamplingParams(temperature=1.0, top_p=0.8), 5).process(LOGITS, [])) == {
        0, 1, 3
    }


def test_process_does_not_modify_input():
    x = LOGITS.clone()
    Sampler(
        SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.5, logit_bias={0: 3.0}), 5
    ).process(x, [0, 1])
    assert torch.equal(x, LOGITS)


# ------------------------------------------------------------------- sampling frequencies


N = 20_000


def test_sampling_matches_softmax_without_filters():
    s = Sampler(SamplingParams(temperature=1.0, seed=0), 5)
    assert_frequencies(draw(s, LOGITS, N), dict(enumerate(PROBS)))


@pytest.mark.parametrize(
    "params, ids",
    [
        (dict(top_k=3), [0, 1, 3]),
        (dict(top_p=0.75), [0, 1, 3]),
        (dict(top_p=0.6), [1, 3]),
        (dict(min_p=0.15), [0, 1, 3, 4]),
    ],
)
def test_sampling_frequencies_with_masks(params, ids):
    s = Sampler(SamplingParams(temperature=1.0, seed=1, **params), 5)
    assert_frequencies(draw(s, LOGITS, N), renorm(ids))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_frequencies_with_temperature(temperature):
    s = Sampler(SamplingParams(temperature=temperature, seed=2), 5)
    expected = torch.softmax(LOGITS / temperature, -1).tolist()
    assert_frequencies(draw(s, LOGITS, N), dict(enumerate(expected)))


def test_temperature_effect():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold = draw(Sampler(SamplingParams(temperature=0.05, seed=3), 4), logits, 2000)
    hot = draw(Sampler(SamplingParams(temperature=100.0, seed=3), 4), logits, 8000)
    assert cold.count(0) == 2000  # p(other) ~ e^-20
    for t in range(4):  # near uniform
        assert abs(hot.count(t) / 8000 - 0.25) < 0.03
    # process: log-softmax of processed logits == log-softmax(logits / T)
    out = Sampler(SamplingParams(temperature=0.7), 4).process(logits, [])
    ref = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(torch.log_softmax(out, -1), ref, atol=1e-6)


def test_tiny_temperature_does_not_overflow():
    logits = torch.tensor([10.0, 9.0, -5.0])
    s = Sampler(SamplingParams(temperature=1e-30, seed=0), 3)
    assert draw(s, logits, 20) == [0] * 20


# ------------------------------------------------------------------------------ seeds


def test_same_seed_same_sequence_different_seeds_differ():
    logits = torch.zeros(1000)
    a = draw(Sampler(SamplingParams(temperature=1.0, seed=1234), 1000), logits, 200)
    b = draw(Sampler(SamplingParams(temperature=1.0, seed=1234), 1000), logits, 200)
    c = draw(Sampler(SamplingParams(temperature=1.0, seed=4321), 1000), logits, 200)
    assert a == b
    assert a != c
    # Filtered sampling is reproducible too, and unaffected by other global RNG use.
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    s1 = Sampler(p, 1000)
    r1 = [s1(x, []) for _ in range(100)]
    torch.manual_seed(999)
    s2 = Sampler(p, 1000)
    r2 = []
    for _ in range(100):
        torch.rand(3)
        r2.append(s2(x, []))
    assert r1 == r2


def test_large_seed_accepted():
    s = Sampler(SamplingParams(temperature=1.0, seed=2**64 - 1), 10)
    assert 0 <= s(torch.zeros(10), []) < 10


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    s = Sampler(SamplingParams(temperature=0.0, top_k=1, top_p=0.1), 32000)
    for _ in range(20):
        x = torch.randn(32000, generator=g)
        assert s(x, []) == int(torch.argmax(x))
    # ties -> lowest id
    tied = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert Sampler(SamplingParams(temperature=0), 5)(tied, []) == 1
    # None temperature (no defaults applied) is greedy too
    assert Sampler(SamplingParams(), 5)(LOGITS, []) == 1


def test_greedy_is_argmax_of_penalized_logits():
    p = SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.2,
                       frequency_penalty=0.1, logit_bias={7: 0.5})
    s = Sampler(p, 64)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(64, generator=g)
        ids = torch.randint(0, 64, (30,), generator=g).tolist()
        assert s(x, ids) == int(torch.argmax(s.process(x, ids)))
    # and the penalty actually changes the decision
    x = torch.tensor([1.0, 0.9, 0.0])
    assert Sampler(SamplingParams(temperature=0), 3)(x, [0]) == 0
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.5), 3)(x, [0]) == 1


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_exact():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), 5)
    # ids 0 and 1 (0 twice: penalised once); positives divided, negatives multiplied
    assert s.process(x, [0, 1, 0]).tolist() == [1.0, -4.0, 1.0, 0.5, -1.0]
    assert s.process(x, []).tolist() == x.tolist()


def test_repetition_context_size():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0, repetition_context_size=2), 5)
    assert s.process(x, [0, 1, 2]).tolist() == [2.0, -4.0, 0.5, 0.5, -1.0]
    p0 = SamplingParams(temperature=0, repetition_penalty=2.0, repetition_context_size=0)
    s0 = Sampler(p0, 5)
    assert s0.process(x, [0, 1, 2]).tolist() == x.tolist()


def test_presence_frequency_penalties_exact():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5])
    s = Sampler(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25), 4)
    # counts: 0 -> 3, 2 -> 1
    out = s.process(x, [0, 2, 0, 0]).tolist()
    assert out == [2.0 - 0.5 - 0.75, -2.0, 1.0 - 0.5 - 0.25, 0.5]
    # negative penalties reward
    s = Sampler(SamplingParams(temperature=0, presence_penalty=-1.0), 4)
    assert s.process(x, [1]).tolist() == [2.0, -1.0, 1.0, 0.5]


def test_penalty_order_bias_then_repetition_then_presence():
    x = torch.tensor([1.0, 0.5, -1.0])
    p = SamplingParams(temperature=0, logit_bias={1: 1.5, 2: -2.0}, repetition_penalty=2.0,
                       presence_penalty=0.25, frequency_penalty=0.5)
    out = Sampler(p, 3).process(x, [1, 2, 2])
    # id1: (0.5+1.5)/2 - 0.25 - 0.5 = 0.25 ; id2: (-1-2)*2 - 0.25 - 1.0 = -7.25
    assert out.tolist() == [1.0, 0.25, -7.25]


def test_logit_bias_ban_and_force():
    x = torch.zeros(6)
    s = Sampler(SamplingParams(temperature=1.0, seed=5, logit_bias={2: -100, 4: -100.0}), 6)
    d = draw(s, x, 5000)
    assert 2 not in d and 4 not in d
    assert_frequencies(d, {0: 0.25, 1: 0.25, 3: 0.25, 5: 0.25})
    s = Sampler(SamplingParams(temperature=0, logit_bias={5: 2.0}), 6)
    assert s(torch.tensor([1.0, 1.5, 0.0, 0.0, 0.0, 0.0]), []) == 5
    s = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={3: 100}), 6)
    assert set(draw(s, x, 200)) == {3}


def test_bad_token_ids_and_logits_shape():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.1), 5)
    with pytest.raises(MlxrError, match="token_ids"):
        s(LOGITS, [7])
    with pytest.raises(MlxrError, match="logits"):
        s(torch.zeros(6), [])


# ------------------------------------------------------------------------ with_defaults


def test_with_defaults_sampling_config():
    p = SamplingParams().with_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    assert p.temperature == 0.6 and p.top_p == 0.9
    assert p.top_k is None and p.min_p is None and p.repetition_penalty is None


def test_with_defaults_greedy_config():
    assert SamplingParams().with_defaults({"do_sample": False}).temperature == 0.0
    # do_sample false wins over a temperature in the config (as in transformers)
    assert SamplingParams().with_defaults({"do_sample": False, "temperature": 0.7}).temperature == 0


def test_with_defaults_other_cases():
    assert SamplingParams().with_defaults({}).temperature == 0.0
    assert SamplingParams().with_defaults({"do_sample": True}).temperature == 1.0
    assert SamplingParams().with_defaults({"temperature": 0.7}).temperature == 0.7
    gc = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
          "repetition_penalty": 1.05, "max_new_tokens": 5, "eos_token_id": [1, 2]}
    p = SamplingParams().with_defaults(gc)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (
        0.6, 20, 0.95, 0.0, 1.05
    )
    assert p.max_tokens == 256
    # explicit request values win
    q = SamplingParams(temperature=0.0, top_k=5, top_p=0.5).with_defaults(gc)
    assert (q.temperature, q.top_k, q.top_p, q.min_p) == (0.0, 5, 0.5, 0.0)
    # null keys are unset; integral floats OK for top_k
    r = SamplingParams().with_defaults({"do_sample": True, "temperature": None, "top_k": 40.0})
    assert r.temperature == 1.0 and r.top_k == 40 and isinstance(r.top_k, int)
    with pytest.raises(MlxrError, match="top_p"):
        SamplingParams().with_defaults({"top_p": "high"})


# ----------------------------------------------------------------------------- validate


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_context_size=-1), "repetition_context_size"),
        (dict(logit_bias={100: 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={3: float("-inf")}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10**12), "max_tokens"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty"),
        (dict(seed=-1), "seed"),
        (dict(stop=("",)), "stop"),
        (dict(stop=("x",) * 1000), "stop"),
        (dict(stop_token_ids=(100,)), "stop_token_ids"),
    ],
)
def test_validate_errors(kwargs, field):
    p = SamplingParams(**kwargs)
    with pytest.raises(MlxrError, match=field) as ei:
        p.validate(100)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(MlxrError):
        Sampler(p, 100)


def test_validate_ok():
    SamplingParams().validate(100)
    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=0.0, logit_bias={0: -100, 99: 100},
                   stop=("a", "bc"), stop_token_ids=(0, 99), seed=0).validate(100)


def test_stop_token_set():
    assert SamplingParams(stop_token_ids=(5,)).stop_token_set([2]) == {2, 5}
    assert SamplingParams(stop_token_ids=(5,), ignore_eos=True).stop_token_set([2]) == {5}


# --------------------------------------------------------------------------- StopMatcher


def run(m: StopMatcher, pieces) -> tuple[str, bool]:
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_split_over_three_pieces():
    m = StopMatcher(["<|end|>"])
    assert m.feed("Hello <|") == ("Hello ", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d|> trailing") == ("", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_held_text_released_when_not_a_stop():
    m = StopMatcher(["<|end|>"])
    assert m.feed("a <|") == ("a ", False)
    assert m.feed("x") == ("<|x", False)
    assert m.feed("<") == ("", False)
    assert m.flush() == "<"
    assert m.flush() == ""


def test_overlapping_prefix():
    m = StopMatcher(["abab"])
    outs = [m.feed(c) for c in "abaabab"]
    assert "".join(t for t, _ in outs) == "aba"
    assert outs[-1][1] is True and not any(s for _, s in outs[:-1])
    assert run(StopMatcher(["abab"]), ["abaabab"]) == ("aba", True)
    assert run(StopMatcher(["abab"]), ["ab", "aab", "ab"]) == ("aba", True)


def test_multiple_stops():
    assert run(StopMatcher(["STOP", "\n\n"]), ["one\n", "\ntwo STOP"]) == ("one", True)
    assert run(StopMatcher(["STOP", "\n\n"]), ["one ST", "OP\n\n"]) == ("one ", True)
    # the stop that completes first wins, whatever the chunking
    for pieces in (["xabcd"], list("xabcd"), ["xa", "bcd"]):
        assert run(StopMatcher(["abcd", "bc"]), pieces) == ("xa", True)


def test_no_false_hold_after_flush():
    m = StopMatcher(["</s>"])
    assert m.feed("end </") == ("end ", False)
    assert m.flush() == "</"
    assert m.pending == ""
    assert run(StopMatcher(["</s>"]), ["a", "<", "/"]) == ("a</", False)


def test_no_stops_passthrough_and_bad_stops():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""
    with pytest.raises(MlxrError):
        StopMatcher([""])


def test_stop_matcher_chunking_invariant():
    rng = random.Random(0)
    stops = ["aba", "bb", "abcab", "ca"]
    for _ in range(300):
        text = "".join(rng.choice("abcx") for _ in range(rng.randint(0, 25)))
        ref = run(StopMatcher(stops), list(text))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert run(StopMatcher(stops), pieces) == ref, (text, pieces)
        # reference: earliest-ending occurrence of any stop
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        expected = (text[: min(ends)[1]], True) if ends else (text, False)
        assert ref == expected, text


def test_plain_argmax_only_without_logit_processing():
    from mlxr.text.sampling import Sampler, SamplingParams

    assert Sampler(SamplingParams(temperature=0), 8).plain_argmax
    assert Sampler(SamplingParams(), 8).plain_argmax  # unset temperature is greedy
    for kw in ({"temperature": 0.7}, {"temperature": 0, "logit_bias": {1: 2.0}},
               {"temperature": 0, "repetition_penalty": 1.1},
               {"temperature": 0, "presence_penalty": 0.5},
               {"temperature": 0, "frequency_penalty": 0.5}):
        assert not Sampler(SamplingParams(**kw), 8).plain_argmax, kw
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.0), 8).plain_argmax
