"""Sampling at temperature 1 with speculative decoding draws from the model's own distribution.

Four tokens are sampled (top_k 4, so 4**4 = 256 possible answers) from the tiny model, 2000
times with different seeds, every decode step verifying the model's greedy guess of the next two
tokens: a draft accepted, rejected at its first or second token, and the rows after a rejection
rolled back all occur. The counts of the answers are compared with their exact probabilities
(products of the model's softmax over its top 4 logits, from one forward pass per prefix) by a
chi-square goodness-of-fit test: answers expected fewer than 5 times share one bin, and the
statistic must stay below the 0.999 quantile of chi-square with (bins - 1) degrees of freedom
(a false alarm once in a thousand runs; the seeds are fixed, so a run repeats exactly). The test
also shows it would catch the classic mistake, resampling from p instead of the residual after a
rejection, at this number of samples.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from appliance import Engine
from appliance.engine import speculative
from appliance.engine.sampling import SamplingParams

TOP_K = 4
ANSWER = 4                  # tokens per sample
SAMPLES = 2000
BATCH = 250                 # sequences per batched step
Z_999 = 3.090232            # the standard normal's 0.999 quantile


def chi2_quantile_999(df: int) -> float:
    """Wilson-Hilferty: the 0.999 quantile of chi-square(df), within 1% for df >= 10."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_999 * math.sqrt(c)) ** 3


def top_k_probs(logits: np.ndarray) -> dict[int, float]:
    """The sampler's distribution at temperature 1 with top_k: softmax over the k largest logits."""
    keep = np.argsort(-logits.astype(np.float64), kind="stable")[:TOP_K]
    x = logits[keep].astype(np.float64)
    p = np.exp(x - x.max())
    return {int(t): float(v) for t, v in zip(keep, p / p.sum())}


class Exact:
    """The model's distribution of each next token after the prompt and some answer tokens."""

    def __init__(self, engine, prompt):
        self.engine, self.prompt, self.memo = engine, list(prompt), {}

    def __call__(self, answer: tuple) -> dict[int, float]:
        if answer not in self.memo:
            self.memo[answer] = top_k_probs(self.engine.logits(self.prompt + list(answer))[-1])
        return self.memo[answer]

    def greedy(self, answer: tuple, n: int) -> list[int]:
        out = []
        for _ in range(n):
            p = self(answer + tuple(out))
            out.append(max(p, key=p.get))
        return out

    def joint(self) -> dict[tuple, float]:
        probs = {(): 1.0}
        for _ in range(ANSWER):
            probs = {a + (t,): q * pt for a, q in probs.items() for t, pt in self(a).items()}
        return probs


class GreedyGuess:
    """Drafts the model's own greedy continuation of what was sampled so far."""

    def __init__(self, exact: Exact, n_prompt: int):
        self.exact, self.n_prompt = exact, n_prompt

    def propose(self, tokens, k):
        return self.exact.greedy(tuple(tokens[self.n_prompt:]), k), 0


def chi_square(counts: dict[tuple, int], probs: dict[tuple, float], n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom), answers expected fewer than 5 times pooled in one bin."""
    big = [a for a, p in probs.items() if n * p >= 5]
    rest_p = 1.0 - sum(probs[a] for a in big)
    rest_n = n - sum(counts.get(a, 0) for a in big)
    stat = sum((counts.get(a, 0) - n * probs[a]) ** 2 / (n * probs[a]) for a in big)
    bins = len(big)
    if rest_p * n >= 5:
        stat += (rest_n - n * rest_p) ** 2 / (n * rest_p)
        bins += 1
    return stat, bins - 1


@pytest.fixture(scope="module")
def setup(tiny_qwen3_dir):
    engine = Engine.load(tiny_qwen3_dir, max_context=256, kv_cache_tokens=16384, progress=False, threads=1)
    prompt = engine.tokenizer.encode("Once upon a time there was")
    return engine, prompt, Exact(engine, prompt)


def sample(engine, prompt, exact, monkeypatch) -> tuple[dict[tuple, int], int, int]:
    monkeypatch.setitem(speculative._DRAFTERS, "greedy_guess", lambda config: GreedyGuess(exact, len(prompt)))
    spec = {"method": "greedy_guess", "num_tokens": 2, "adaptive": False}
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for first in range(0, SAMPLES, BATCH):
        seqs = [engine.start(prompt, SamplingParams(max_tokens=ANSWER, temperature=1.0, top_k=TOP_K, seed=seed,
                                                    ignore_eos=True, speculative=spec))
                for seed in range(first, first + BATCH)]
        engine.step([], [(s, len(prompt)) for s in seqs])
        while not all(s.done for s in seqs):
            engine.step([s for s in seqs if not s.done])
        for s in seqs:
            answer = tuple(s.output_ids)
            counts[answer] = counts.get(answer, 0) + 1
            drafted += s.speculation.drafted
            accepted += s.speculation.accepted
            engine.release(s)
    return counts, drafted, accepted


@pytest.mark.slow
def test_temperature_one_with_speculation_matches_the_model(setup, monkeypatch):
    engine, prompt, exact = setup
    probs = exact.joint()
    assert sum(probs.values()) == pytest.approx(1.0) and len(probs) == TOP_K ** ANSWER
    counts, drafted, accepted = sample(engine, prompt, exact, monkeypatch)
    assert sum(counts.values()) == SAMPLES and set(counts) <= set(probs)
    # the drafts are tested, not waved through: a good share of them is rejected
    assert 0.1 * drafted < accepted < 0.9 * drafted
    stat, df = chi_square(counts, probs, SAMPLES)
    threshold = chi2_quantile_999(df)
    assert df >= 40
    print(f"chi-square {stat:.1f}, threshold {threshold:.1f}, df {df}, drafts accepted {accepted}/{drafted}")
    assert stat < threshold, f"chi-square {stat:.1f} >= {threshold:.1f} (df {df})"


def test_the_chi_square_test_catches_resampling_from_p(setup):
    """The broken rule (after a rejected draft, sample from p instead of the residual) puts
    p(d) + (1 - p(d)) p(d) on a drafted token: at SAMPLES answers the statistic is far past
    the threshold."""
    engine, prompt, exact = setup
    probs = exact.joint()
    rng = np.random.default_rng(0)
    counts: dict[tuple, int] = {}
    for _ in range(SAMPLES):
        answer: tuple = ()
        while len(answer) < ANSWER:
            # a step: the draft is the greedy guess of the next two tokens (at most what remains - 1)
            guess = exact.greedy(answer, min(2, ANSWER - len(answer) - 1))
            for d in guess + [None]:
                p = exact(answer)
                tokens, weights = zip(*p.items())
                if d is not None and rng.random() < p[d]:
                    answer += (d,)
                    continue
                answer += (tokens[rng.choice(len(tokens), p=np.array(weights) / sum(weights))],)   # not the residual
                break
        counts[answer] = counts.get(answer, 0) + 1
    stat, df = chi_square(counts, probs, SAMPLES)
    print(f"broken rule: chi-square {stat:.1f}, threshold {chi2_quantile_999(df):.1f}, df {df}")
    assert stat > 2 * chi2_quantile_999(df)


def test_wilson_hilferty_quantiles():
    # scipy.stats.chi2.ppf(0.999, df) for df = 10, 50, 200: 29.588, 86.661, 267.541
    for df, want in ((10, 29.588), (50, 86.661), (200, 267.541)):
        assert chi2_quantile_999(df) == pytest.approx(want, rel=1e-2)

