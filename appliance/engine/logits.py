"""Per-sequence logit processing: what one request asks of its own row of logits.

Each running sequence carries the processors its request asked for, built once when it
starts (`build`); the batched decode step hands every sequence its row of logits
(float32[vocab]) and that sequence's Sampler runs its processors on it in place, in order:

  soft      repetition, presence and frequency penalties, logit_bias, the min_tokens ban
            of end tokens: they move logits;
  hard      the close of a thought that used up its budget, a grammar (engine/grammar.py):
            they decide which tokens may come next at all, and win over the soft ones
            (Sampler falls back to the raw logits under the hard mask alone when the soft
            ones left nothing allowed).

A processor has `apply(x) -> int | None` (edit x in place; return a token to force it) and
`accept(token)` (after the token is chosen). A sequence that asked for nothing carries an
empty tuple: its step costs what it cost before any of this existed.
"""
from __future__ import annotations

import numpy as np

THOUGHT_STATES = ("allowed", "open")


class _GrowingCounts:
    """Token ids with a count each, as arrays that grow in place (amortised O(1) per token).
    ids: intp[n], counts: float32[n]."""

    def __init__(self):
        self._ids = np.zeros(64, np.intp)
        self._counts = np.zeros(64, np.float32)
        self._where: dict[int, int] = {}

    def add(self, token: int) -> None:
        at = self._where.get(token)
        if at is None:
            at = len(self._where)
            if at == self._ids.size:
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._where[token] = at
            self._ids[at] = token
        self._counts[at] += 1.0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, token: int) -> bool:
        return token in self._where

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:len(self._where)]

    @property
    def counts(self) -> np.ndarray:
        return self._counts[:len(self._where)]


class RepetitionPenalty:
    """CTRL / Hugging Face: every token seen in the prompt or the output so far has a positive
    logit divided by the penalty and a negative one multiplied by it."""

    hard = False

    def __init__(self, penalty: float, prompt_ids):
        self.penalty = np.float32(penalty)
        self.seen = _GrowingCounts()
        for t in dict.fromkeys(int(t) for t in prompt_ids):
            self.seen.add(t)

    def apply(self, x: np.ndarray) -> None:
        if len(self.seen):
            idx = self.seen.ids
            vals = x[idx]
            x[idx] = np.where(vals > 0, vals / self.penalty, vals * self.penalty)

    def accept(self, token: int) -> None:
        if token not in self.seen:
            self.seen.add(token)


class OccurrencePenalties:
    """OpenAI's presence and frequency penalties, over the generated tokens only:
    logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty."""

    hard = False

    def __init__(self, presence: float, frequency: float):
        self.presence = np.float32(presence)
        self.frequency = np.float32(frequency)
        self.generated = _GrowingCounts()

    def apply(self, x: np.ndarray) -> None:
        if len(self.generated):
            x[self.generated.ids] -= self.generated.counts * self.frequency + self.presence

    def accept(self, token: int) -> None:
        self.generated.add(token)


class LogitBias:
    """OpenAI's logit_bias: a fixed amount added to given token ids (-100 all but bans one)."""

    hard = False

    def __init__(self, bias: dict[int, float]):
        self.ids = np.fromiter(bias.keys(), np.intp, len(bias))
        self.values = np.fromiter(bias.values(), np.float32, len(bias))

    def apply(self, x: np.ndarray) -> None:
        x[self.ids] += self.values

    def accept(self, token: int) -> None:
        pass


class MinTokens:
    """The end tokens (EOS, stop_token_ids) are banned until min_tokens have been generated."""

    hard = False

    def __init__(self, min_tokens: int, end_ids):
        self.min_tokens = min_tokens
        self.end_ids = np.fromiter(sorted(set(end_ids)), np.intp)
        self.generated = 0

    def apply(self, x: np.ndarray) -> None:
        if self.generated < self.min_tokens:
            x[self.end_ids[self.end_ids < x.size]] = -np.inf

    def accept(self, token: int) -> None:
        self.generated += 1


class Thought:
    """Where a sequence stands with respect to its thought (`<think>` ... `</think>`).

    state "open": the prompt opened the thought (the template wrote `<think>`);
    "allowed": the model may open one with its first token. Kept last in the processor list,
    so the others see the state before each token when they accept it.
    """

    hard = False

    def __init__(self, start_id: int, end_id: int, state: str):
        if state not in THOUGHT_STATES:
            raise ValueError(f"thinking must be one of {', '.join(THOUGHT_STATES)}, not {state!r}")
        self.start_id, self.end_id = start_id, end_id
        self.inside = state == "open"
        self.may_open = state == "allowed"
        self.length = 0            # tokens thought so far (without the tags)

    def apply(self, x: np.ndarray) -> None:
        pass

    def accept(self, token: int) -> None:
        if self.inside:
            if token == self.end_id:
                self.inside = False
            else:
                self.length += 1
        elif self.may_open and token == self.start_id:
            self.inside = True
        self.may_open = False


class ThinkingBudget:
    """After `budget` thought tokens the thought is closed for the model: the newline the
    template keeps before `</think>` (unless the last token ended one), `</think>`, then the
    blank line the template puts before the answer, forced one token a step."""

    hard = True

    def __init__(self, budget: int, thought: Thought, close_ids: list[int], newline_ids: list[int],
                 ends_line):
        self.budget = budget
        self.thought = thought
        self.close_ids = list(close_ids)        # </think> and the blank line after it
        self.newline_ids = list(newline_ids)
        self.ends_line = ends_line              # token id -> does its text end with a newline
        self.forcing: list[int] = []
        self.last: int | None = None

    def apply(self, x: np.ndarray) -> int | None:
        if not self.forcing and self.thought.inside and self.thought.length >= self.budget:
            lead = [] if self.last is not None and self.ends_line(self.last) else self.newline_ids
            self.forcing = lead + self.close_ids
        return self.forcing[0] if self.forcing else None

    def accept(self, token: int) -> None:
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
        self.last = token


def build(params, prompt_ids, tokenizer=None) -> tuple:
    """The processors a sequence's SamplingParams ask for, in the order they run."""
    procs: list = []
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenalty(params.repetition_penalty, prompt_ids))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OccurrencePenalties(params.presence_penalty, params.frequency_penalty))
    if params.logit_bias:
        procs.append(LogitBias(params.logit_bias))
    if params.min_tokens:
        eos = () if tokenizer is None or params.ignore_eos else tokenizer.eos_token_ids
        procs.append(MinTokens(params.min_tokens, set(eos) | set(params.stop_token_ids)))
    thought = None
    tags = getattr(tokenizer, "think_token_ids", None)
    if params.thinking is not None and tags is not None and (
            params.max_thinking_tokens is not None or params.grammar is not None):
        thought = Thought(tags[0], tags[1], params.thinking)
    if thought is not None and params.max_thinking_tokens is not None:
        # a grammar holds what follows the thought, blank line included
        after = [] if params.grammar is not None else tokenizer.encode("\n\n")
        procs.append(ThinkingBudget(params.max_thinking_tokens, thought,
                                    [tags[1]] + after, tokenizer.encode("\n"),
                                    lambda t: tokenizer.decode([t], skip_special_tokens=False).endswith("\n")))
    if params.grammar is not None:
        procs.append(params.grammar.constraint(tokenizer, thought))
    if thought is not None:
        procs.append(thought)
    return tuple(procs)
