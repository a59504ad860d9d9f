"""Sampling rules and stop strings."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.engine.sampling import Sampler, SamplingParams, TextStream, top_indices


def test_greedy_picks_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    assert Sampler(SamplingParams(temperature=0.0), [])(logits) == 1


def test_same_seed_same_tokens():
    logits = np.random.default_rng(1).normal(size=100).astype(np.float32)
    draw = lambda seed: [Sampler(SamplingParams(seed=seed), [])(logits) for _ in range(1)] + \
        [s(logits) for s in [Sampler(SamplingParams(seed=seed), [])] for _ in range(20)]
    assert draw(42) == draw(42)
    assert draw(42) != draw(43)


def test_top_k_one_is_greedy():
    logits = np.random.default_rng(2).normal(size=50).astype(np.float32)
    s = Sampler(SamplingParams(top_k=1, seed=0), [])
    assert all(s(logits) == int(np.argmax(logits)) for _ in range(20))


def test_top_p_and_min_p_restrict_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    top_p = Sampler(SamplingParams(top_p=0.7, seed=0), [])
    assert {top_p(logits) for _ in range(200)} == {0, 1}
    min_p = Sampler(SamplingParams(min_p=0.5, seed=0), [])
    assert {min_p(logits) for _ in range(200)} == {0, 1}


def _by_the_definition(params: SamplingParams, x: np.ndarray, rng) -> int:
    """top_k, then top_p and min_p over the whole sorted distribution, drawn in sorted order:
    what the sampler's partial searches must reproduce draw for draw."""
    order = np.argsort(-x, kind="stable")[: params.top_k or None]
    probs = np.exp(x[order].astype(np.float64) - x[order[0]])
    probs /= probs.sum()
    cut = probs.size
    if params.top_p < 1.0:
        cut = min(cut, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        cut = min(cut, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    return int(order[rng.choice(cut, p=probs[:cut] / probs[:cut].sum())])


@pytest.mark.parametrize("spread", (8.0, 1.0, 0.05))     # a nucleus of a few, of hundreds, of all
@pytest.mark.parametrize("knobs", (dict(top_p=0.9), dict(top_p=0.95, min_p=0.05), dict(min_p=0.2),
                                   dict(top_k=40, top_p=0.8)))
def test_top_p_and_min_p_draw_as_the_full_sort_would(spread, knobs):
    """The sampler looks for top_p's and min_p's tokens among the largest logits first; the
    tokens and their probabilities, hence every seeded draw, are those of sorting them all."""
    rng = np.random.default_rng(3)
    for trial in range(6):
        x = (rng.standard_normal(5000) * spread).astype(np.float32)
        params = SamplingParams(seed=trial, **knobs)
        ours, reference_rng = Sampler(params, []), np.random.default_rng(trial)
        assert [ours(x) for _ in range(8)] == [_by_the_definition(params, x, reference_rng) for _ in range(8)]


def test_top_indices_are_the_stable_sorts_first():
    """logprobs' top tokens without a full sort: the same indices in the same order, ties by index."""
    rng = np.random.default_rng(4)
    for x in (rng.standard_normal(3000).astype(np.float32),
              np.round(rng.standard_normal(3000), 1).astype(np.float32),        # many ties
              np.where(rng.random(3000) < 0.995, -np.inf, 1.0).astype(np.float32)):   # masked
        for k in (1, 5, 20, 3000):
            assert top_indices(x, k).tolist() == np.argsort(-x, kind="stable")[:k].tolist()


def test_repetition_penalty_discourages_seen_tokens():
    logits = np.array([2.0, 1.9, 0.0], np.float32)
    assert Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.5), [0])(logits) == 1


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                                 dict(min_p=2), dict(repetition_penalty=0), dict(logprobs=21)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


class CharTokenizer:
    """Token i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def stream(text: str, stop):
    s = TextStream(CharTokenizer(), tuple(stop))
    out = []
    for ch in text:
        out.append(s.push(ord(ch)))
        if s.stopped:
            break
    out.append(s.flush())
    return "".join(out), s.stopped


def test_stop_string_cut_and_never_emitted():
    assert stream("hello END world", ["END"]) == ("hello ", True)


def test_partial_stop_is_released_at_the_end():
    assert stream("hello EN", ["END"]) == ("hello EN", False)


def test_text_streams_without_stops():
    assert stream("abc", []) == ("abc", False)
