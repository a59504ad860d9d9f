"""Choosing the next token, and turning tokens into text deltas that respect stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from appliance.engine import logits as logits_processing


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    logprobs: int | None = None     # None: none; n: the chosen token's plus the n most likely
    ignore_eos: bool = False
    presence_penalty: float = 0.0   # OpenAI's, over generated tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit
    min_tokens: int = 0             # EOS, stop_token_ids and stop strings wait this long
    stop_token_ids: tuple[int, ...] | list[int] = ()
    max_thinking_tokens: int | None = None          # the thought is closed after this many tokens
    # None: no thought handling; "allowed": the model may open a thought with its first token;
    # "open": the prompt opened it (engine/logits.py)
    thinking: str | None = None
    grammar: object = None          # an appliance.engine.grammar.Grammar the output must match
    # speculative decoding: an appliance.engine.speculative.SpeculativeConfig, a dict of its
    # fields or a number of drafted tokens; None: off
    speculative: object = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        bias = self.logit_bias or {}
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be between 0 and 100"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2"),
            (all(int(k) >= 0 and -100.0 <= v <= 100.0 for k, v in bias.items()),
             "logit_bias maps token ids (>= 0) to values between -100 and 100"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be between 0 and max_tokens"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids (>= 0)"),
            (self.max_thinking_tokens is None or self.max_thinking_tokens >= 0,
             "max_thinking_tokens must be >= 0"),
            (self.thinking in (None, "allowed", "open"), "thinking must be None, 'allowed' or 'open'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.logit_bias = {int(k): float(v) for k, v in bias.items()} or None


def top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' indices, largest first, ties by index: the first k of a stable
    sort of -x, without sorting the whole vocabulary (10-20 ms a token for 150K logits)."""
    if k >= x.size:
        return np.argsort(-x, kind="stable")[:k]
    kth = x[np.argpartition(-x, k - 1)[k - 1]]
    ties_and_above = np.flatnonzero(x >= kth)          # every index the stable sort could pick
    return ties_and_above[np.argsort(-x[ties_and_above], kind="stable")][:k]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


class Sampler:
    """Per-sequence sampling: its random generator (seeded) and the logit processors its
    request asked for (engine/logits.py), run on the sequence's own row of logits."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], tokenizer=None):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.processors = logits_processing.build(params, prompt_ids, tokenizer)

    def __call__(self, logits: np.ndarray) -> int:
        # Processors edit a copy of the row; without any it is only read (no copy of 150K floats a
        # token for every sequence of a batch).
        x = logits.astype(np.float32, copy=bool(self.processors))
        token = self._process(x, logits) if self.processors else None
        if token is None:
            token = int(np.argmax(x)) if self.params.temperature == 0.0 else \
                self._sample(x / np.float32(self.params.temperature))
        for proc in self.processors:
            proc.accept(token)
        return token

    def verify(self, logits: np.ndarray, draft: int) -> tuple[int, bool]:
        """(token, accepted) for a row whose next token was drafted (speculative decoding): the
        same processors and choice as __call__, so a drafted position is exactly a plain one.

        The rejection-sampling rule for a draft q and the model's distribution p (after every
        processor, temperature, top-k/top-p/min-p) accepts the drafted d with probability
        min(1, p(d) / q(d)) and, on a rejection, samples from the residual max(0, p - q)
        normalised. A lookup draft is a point mass, q(d) = 1: d is accepted with probability
        p(d), and the residual is p with d removed, p(x) / (1 - p(d)) for x != d. Drawing one x
        from p and accepting iff x == d has exactly that law: P(d) = p(d), and
        P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x) otherwise; so the token is simply sampled
        as always (the argmax at temperature 0) and compared with the draft. It draws the same
        random numbers as __call__: a seeded request gives the same tokens with speculation as
        without, and the processors (penalties, a grammar matcher) advance by the emitted token
        only, one row at a time."""
        token = self(logits)
        return token, token == draft

    def _process(self, x: np.ndarray, raw: np.ndarray) -> int | None:
        """Run the processors on x in place; a token when one of them forces it."""
        for proc in self.processors:
            forced = proc.apply(x)
            if forced is not None:
                return int(forced)
        if x.max() == -np.inf:
            # the soft processors banned every token the hard ones allow: the hard ones decide alone
            x[:] = raw
            for proc in self.processors:
                if proc.hard:
                    proc.apply(x)
            if x.max() == -np.inf:
                return int(np.argmax(raw))
        return None

    def _sample(self, x: np.ndarray) -> int:
        """A token from softmax(x), restricted by top_k, then top_p and min_p (their mass and
        ratios over the top_k tokens, or over the whole vocabulary without top_k), drawn in
        order of decreasing probability. Sorting 150K logits took 10-20 ms a token; the tokens
        top_p and min_p keep are found among the largest few instead (below)."""
        p = self.params
        if p.top_k and p.top_k < x.size:
            order = top_indices(x, p.top_k)
            logits = x[order].astype(np.float64)
            probs = np.exp(logits - logits[0])
            return self._draw(order, probs / probs.sum())
        weights = np.exp(x.astype(np.float64) - float(x.max()))
        if p.top_p >= 1.0 and p.min_p <= 0.0:
            # the whole distribution: no order needed to draw from it
            return int(self.rng.choice(x.size, p=weights / weights.sum()))
        total = weights.sum()
        for n in _CANDIDATES:
            order = top_indices(x, n)
            probs = weights[order] / total
            if order.size == x.size or self._cut(probs) < n:
                return self._draw(order, probs)
        raise AssertionError("unreachable: the last candidate set is the vocabulary")

    def _cut(self, probs: np.ndarray) -> int:
        """How many of the most likely tokens (probs sorted, normalised over the support) top_p
        and min_p keep: at most probs.size, which means "maybe more" for a partial list."""
        p = self.params
        cut = probs.size
        if p.top_p < 1.0:
            # the smallest prefix whose mass reaches top_p (always at least one token)
            cut = min(cut, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            cut = min(cut, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        return cut

    def _draw(self, order: np.ndarray, probs: np.ndarray) -> int:
        cut = self._cut(probs)
        probs = probs[:cut] / probs[:cut].sum()
        return int(order[self.rng.choice(cut, p=probs)])


# How many of the largest logits to look among for top_p / min_p's tokens before all of them: a
# chat model's nucleus is rarely more than a few hundred tokens (a flat one costs two partitions more).
_CANDIDATES = (64, 1024, 1 << 62)


@dataclass
class TextStream:
    """Incremental detokenization with stop strings.

    Text is released only when it is final: not an incomplete UTF-8 sequence, and
    not a tail that could still grow into a stop string. When a stop string
    appears, the text before it is released and the stream is finished. Stop strings
    are looked for only once min_tokens tokens are in (vLLM's min_tokens).
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    emitted: int = 0          # characters of the decoded text already released
    stopped: bool = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        if len(self.ids) < self.min_tokens:
            delta = text[self.emitted:]
            self.emitted = len(text)
            return delta
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.stopped = True
                delta = text[self.emitted:at] if at > self.emitted else ""
                self.emitted = max(self.emitted, at)
                return delta
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        end = max(self.emitted, len(text) - hold)
        delta = text[self.emitted:end]
        self.emitted = end
        return delta

    def flush(self) -> str:
        """At the end (length or EOS): release what was held back for a possible stop string."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta
