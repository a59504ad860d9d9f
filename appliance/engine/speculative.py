"""Speculative decoding from the sequence's own tokens (docs/engine.md, "Speculative decoding").

A decode step costs about one read of the weights, whatever few rows it computes. When an
answer copies its context (a quoted passage, an edited function, JSON that repeats field
names), the next tokens can be guessed from the tokens so far, and K guessed tokens are
checked in the same forward pass as the one token a step computes anyway: the sequence's
step carries rows [last token, d1 .. dK], row i's logits decide whether d(i+1) is what the
model would have produced, and every token up to the first miss, plus the model's own token
at the miss, lands in that one step.

- Drafting (PromptLookup): the longest n-gram (ngram_max down to ngram_min tokens) that ends
  the sequence and occurred before it, in the prompt or the output; the draft is what
  followed its latest occurrence (llama.cpp's lookup decoding, vLLM's `[ngram]` method).
- Verifying: each row's token goes through the Sampler exactly as without speculation
  (Sampler.verify), in order, so greedy output is identical and sampled output has the same
  distribution (and, with a seed, the same tokens).
- Backing off (Speculation.draft_length): drafting k tokens costs k extra rows; a row costs
  a share rho of what a step costs per token (StepCosts measures it). With acceptance a
  (per position, given the one before was accepted) the i-th drafted token is kept with
  probability a**i, so drafting position i pays while a**i > rho: k = floor(log rho / log a).
  Below a = rho the sequence stops drafting and only probes one token every PROBE_EVERY
  steps, so a free-writing answer pays at most rho / PROBE_EVERY of a step for it.

Light on purpose (no numpy): the server validates requests' `speculative` with SpeculativeConfig.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from appliance.options import MAX_DRAFT_TOKENS

METHODS = ("prompt_lookup",)
MAX_NGRAM = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What a request (or the server's default) asks of speculative decoding."""

    method: str = "prompt_lookup"
    num_tokens: int = 4            # drafted tokens verified per step, at most
    ngram_min: int = 2             # shortest n-gram a draft may follow
    ngram_max: int = 4             # longest n-gram tried first
    adaptive: bool = True          # draft fewer (or none) when drafts stop paying

    def __post_init__(self):
        checks = [
            (self.method in _DRAFTERS, f"method must be one of {', '.join(_DRAFTERS)}, not {self.method!r}"),
            (_is_int(self.num_tokens) and 1 <= self.num_tokens <= MAX_DRAFT_TOKENS,
             f"num_tokens must be an integer between 1 and {MAX_DRAFT_TOKENS}"),
            (_is_int(self.ngram_min) and 1 <= self.ngram_min <= MAX_NGRAM,
             f"ngram_min must be an integer between 1 and {MAX_NGRAM}"),
            (_is_int(self.ngram_max) and 1 <= self.ngram_max <= MAX_NGRAM,
             f"ngram_max must be an integer between 1 and {MAX_NGRAM}"),
            (not _is_int(self.ngram_min) or not _is_int(self.ngram_max) or self.ngram_min <= self.ngram_max,
             "ngram_min must not be more than ngram_max"),
            (isinstance(self.adaptive, bool), "adaptive must be true or false"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def coerce(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict of its fields, or a number of tokens (0: off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, bool):
            raise ValueError("speculative must be a mapping of its fields or a number of tokens")
        if isinstance(value, int):
            return cls(num_tokens=value) if value else None
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"unknown speculative field {unknown[0]!r} "
                                 f"(known: {', '.join(cls.__dataclass_fields__)})")
            return cls(**value)
        raise ValueError("speculative must be a mapping of its fields or a number of tokens")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class PromptLookup:
    """Drafts from the latest earlier occurrence of the longest n-gram that ends the sequence.

    tables[n - ngram_min]: n-gram (a tuple of ids) -> end (exclusive) of its latest occurrence
    among those ending before the sequence's last position; filled incrementally, so a step
    costs O(ngram_max - ngram_min) lookups after the prompt was indexed once.
    """

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tables: list[dict[tuple, int]] = [{} for _ in range(ngram_min, ngram_max + 1)]
        self.indexed = 0             # n-grams ending at positions < indexed are in the tables

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest n-gram ending `tokens` before; and n (0: none)."""
        end = len(tokens)
        lo, hi = self.ngram_min, self.ngram_max
        for stop in range(max(self.indexed, lo), end):
            for n in range(lo, min(hi, stop) + 1):
                self.tables[n - lo][tuple(tokens[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end)
        for n in range(min(hi, end), lo - 1, -1):
            at = self.tables[n - lo].get(tuple(tokens[end - n:]))
            if at is not None:
                draft: list[int] = []
                for i in range(k):
                    # Past the end, the copy goes on from its own draft: a loop repeats itself.
                    j = at + i
                    draft.append(tokens[j] if j < end else draft[j - end])
                return draft, n
        return [], 0


_DRAFTERS = {"prompt_lookup": lambda config: PromptLookup(config.ngram_min, config.ngram_max)}


def register_drafter(method: str, factory) -> None:
    """Another way of drafting (factory(config) -> an object with propose(tokens, k) -> (draft, key)):
    the benchmark replays a recorded acceptance pattern through one."""
    _DRAFTERS[method] = factory


class Speculation:
    """One sequence's drafting: its drafter, what its drafts achieved, and how long they should be.

    acceptance[key]: EMA of "drafted position accepted, given the one before was", per kind of
    match (the n-gram length for prompt lookup: a 4-gram match in a copied passage and a 2-gram
    one in free text are accepted at very different rates).
    """

    PRIOR = 0.5                 # acceptance before any draft of that kind was checked
    WEIGHT = 0.2                # EMA weight of one checked position
    PROBE_EVERY = 16            # backed off: one drafted token per this many steps with a match

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.drafter = _DRAFTERS[config.method](config)
        self.acceptance: dict[int, float] = {}
        self.drafted = 0            # tokens drafted and verified, over the sequence's life
        self.accepted = 0           # of those, emitted as drafted
        self.steps = 0              # verification steps
        self.since_probe = 0        # backed-off steps with a match since the last draft
        self.key = 0                # the kind of match the pending draft came from
        self.tokens: list[int] = []  # the sequence's tokens as far as drafting has seen them

    def draft(self, prompt_ids: list[int], output_ids: list[int], limit: int, row_share: float) -> list[int]:
        """The tokens to verify this step (at most `limit`): none when drafting does not pay."""
        if limit <= 0:
            return []
        # The drafter reads one list that grows with the output (copying prompt + output each
        # step cost O(context)).
        if not self.tokens:
            self.tokens = list(prompt_ids)
        self.tokens += output_ids[len(self.tokens) - len(prompt_ids):]
        draft, key = self.drafter.propose(self.tokens, min(limit, self.config.num_tokens))
        if not draft:
            return []
        k = self.draft_length(key, row_share)
        if k == 0:
            self.since_probe += 1
            if self.since_probe < self.PROBE_EVERY:
                return []
            k = 1
        self.since_probe = 0
        self.key = key
        return draft[:k]

    def draft_length(self, key: int, row_share: float) -> int:
        """Tokens worth drafting from a match of this kind when a row costs row_share of a token."""
        k = self.config.num_tokens
        if not self.config.adaptive:
            return k
        a = self.acceptance.get(key, self.PRIOR)
        if a <= row_share:
            return 0
        if a >= 1.0 or row_share <= 0.0:
            return k
        return min(k, int(math.log(row_share) / math.log(a)))

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: `accepted` of its `drafted` tokens were emitted as drafted."""
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        a = self.acceptance.get(self.key, self.PRIOR)
        for i in range(min(drafted, accepted + 1)):      # positions past the first miss say nothing
            a += self.WEIGHT * ((1.0 if i < accepted else 0.0) - a)
        self.acceptance[self.key] = a


class StepCosts:
    """What a decode step costs as W + c * rows, from the steps the engine measured.

    mean[rows]: EMA of the wall time of decode steps with that many rows (no prompt rows);
    c and W come from a least-squares line through them. Until two row counts are measured,
    a row is taken to cost PRIOR_ROW_SHARE of a one-row step.
    """

    PRIOR_ROW_SHARE = 0.25
    KEEP = 0.9                  # EMA memory per observation
    MAX_ROWS = 256

    def __init__(self):
        self.mean: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if not 0 < rows <= self.MAX_ROWS or seconds <= 0.0:
            return
        old = self.mean.get(rows)
        self.mean[rows] = seconds if old is None else self.KEEP * old + (1 - self.KEEP) * seconds
        self.count[rows] = self.count.get(rows, 0) + 1

    def fit(self) -> tuple[float, float] | None:
        """(W, c) in seconds, or None while fewer than two row counts were measured."""
        if len(self.mean) < 2:
            return None
        weights = {r: min(self.count[r], 20) for r in self.mean}
        total = sum(weights.values())
        mx = sum(w * r for r, w in weights.items()) / total
        my = sum(w * self.mean[r] for r, w in weights.items()) / total
        var = sum(w * (r - mx) ** 2 for r, w in weights.items())
        cov = sum(w * (r - mx) * (self.mean[r] - my) for r, w in weights.items())
        c = max(0.0, cov / var)
        return max(my - c * mx, 1e-6), c

    def row_share(self, batch: int) -> float:
        """rho: one more row's cost over the time a token costs in a plain step of `batch` rows."""
        fitted = self.fit()
        if fitted is None:
            return self.PRIOR_ROW_SHARE
        w, c = fitted
        return min(1.0, c * max(1, batch) / (w + c * max(1, batch)))


@dataclass
class SpeculativeStats:
    """One step's verified drafts (plain data; appliance/telemetry/metrics.py publishes them).

    drafted[i] / accepted[i]: drafts that had a token at position i + 1, and those whose token
    there was accepted (position i + 1 is only reached when 1..i were).
    """

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    sequences: int = 0          # sequences that verified a draft in the step

    def add(self, n_drafted: int, n_accepted: int) -> None:
        grow = n_drafted - len(self.drafted)
        if grow > 0:
            self.drafted += [0] * grow
            self.accepted += [0] * grow
        for i in range(n_drafted):
            self.drafted[i] += 1
            self.accepted[i] += int(i < n_accepted)
        self.sequences += 1

    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)
