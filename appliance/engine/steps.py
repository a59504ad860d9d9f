"""The step API: how the rows of many sequences go through one forward pass (Engine's half).

A step runs one token of every decoding sequence and the next prompt chunk of every sequence
still in prefill, in one batch (one GEMM per weight matrix): a long prompt enters beside
running streams a chunk at a time instead of stopping them (docs/engine.md, "Steps"). A
sequence's prompt starts from what the prefix cache holds (sequence_cache.py); a preempted
sequence gives its blocks back and later resumes where it stopped.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from appliance.engine import stats as profiler
from appliance.engine.batch import Batch, Segment
from appliance.engine.sampling import SamplingParams
from appliance.engine.sequence_cache import tokens_at
from appliance.engine.speculative import SpeculativeStats
from appliance.engine.speculative_step import Draft, SpeculativeSteps

if TYPE_CHECKING:
    from appliance.engine.engine import Sequence, TokenEvent


@dataclass
class _PrefillClock:
    """Time a prompt spent in the steps that computed it (a share of each shared step)."""

    t0: float
    gemm_s: float = 0.0
    attn_s: float = 0.0


@dataclass
class _Work:
    """Rows of one sequence in a forward pass."""

    seq: "Sequence"
    token_ids: list[int]
    pos_start: int
    logits: int = 1           # how many of the last rows need logits (0: a prompt chunk mid-way)
    prefill: bool = False     # prompt rows (block-sparse attention chooses blocks differently)
    draft: Draft | None = None  # speculative decoding: the tokens after the first, to verify


class StepAPI(SpeculativeSteps):
    """Engine methods that run steps (start / step / prefill / decode / preempt / resume / release)."""

    def start(self, prompt_ids: list[int], params: SamplingParams, images: list | None = None,
              keep_available: int = 0) -> Sequence:
        """A new sequence, holding the prefix cache's blocks for the start of its prompt and room
        for the rest (all or nothing: KVCacheFullError if the pool cannot give that and still keep
        `keep_available` blocks for others). images: for a multimodal model, one per image
        placeholder of the prompt (anything prepare_image takes); their tokens are expanded here
        and encoded before the first chunk that needs them."""
        seq = self._new_sequence(prompt_ids, params, images)
        self.sequences.attach(seq, keep_available)
        return seq

    def step(self, decode: list[Sequence], prefill: list[tuple[Sequence, int]] = ()) -> list[tuple[Sequence, TokenEvent]]:
        """One batched forward pass: the next token of every sequence in `decode`, and for each
        (sequence, n) in `prefill` the next chunk of at most n prompt tokens (or of its cached start
        read from disk). A sequence whose prompt completes gets its first token. A decoding sequence
        with speculative decoding on may get several tokens (speculative_step.py).

        Returns (sequence, event) for every token: decoders first, in order."""
        t0 = time.perf_counter()
        timer = profiler.StepTimer()
        work = [_Work(s, [s.output_ids[-1]], s.n_context) for s in decode if not s.done]
        shared = bool(work) or len(prefill) > 1
        for seq, n in prefill:
            chunk = self._next_chunk(seq, n, shared)
            if chunk is not None:
                work.append(chunk)
        if not work:
            return []
        drafted = self._add_drafts(work)
        logits = self._forward(work, timer)
        total = time.perf_counter() - t0
        rows = sum(len(w.token_ids) for w in work)
        out, row, spec = [], 0, SpeculativeStats()
        for w in work:
            seq = w.seq
            if w.draft is not None:
                out += self._verify(w, logits[row:row + w.logits], total, spec)
                row += w.logits
                self.sequences.commit(seq, chunk_end=False)
                continue
            self.sequences.commit(seq, chunk_end=w.prefill)
            if w.prefill:
                clock = seq.prefill_clock
                clock.gemm_s += timer.gemm_s * len(w.token_ids) / rows
                clock.attn_s += timer.attn_s * len(w.token_ids) / rows
                seq.prefilled = seq.n_context >= seq.blocks.prefill_to
            if not w.logits:
                continue
            event = self._accept(seq, logits[row], total)
            row += 1
            if w.prefill:
                event.prefill_s, event.cached_tokens = self._prompt_done(seq), seq.blocks.cached_tokens
            out.append((seq, event))
        decoded = [w.seq.n_context for w in work if not w.prefill]
        if decoded:
            if len(decoded) == len(work):
                self.step_costs.observe(rows, total)
            tokens = []
            if drafted:
                got = collections.Counter(id(s) for s, _ in out)
                tokens = [got[id(w.seq)] for w in work if not w.prefill]
            self._emit(profiler.DecodeStats(batch=len(decoded), n_context=max(decoded), total_s=total,
                                            gemm_s=timer.gemm_s, attn_s=timer.attn_s, contexts=decoded,
                                            tokens=tokens))
        for seq, event in out:
            if seq.speculation is not None:
                event.draft_tokens, event.accepted_draft_tokens = seq.speculation.drafted, seq.speculation.accepted
        if spec.sequences:
            self._emit(spec)
        return out

    def _next_chunk(self, seq: Sequence, n: int, shared: bool) -> _Work | None:
        """The rows of seq's prompt this step computes (None: nothing to compute this step)."""
        b = seq.blocks
        if seq.prefill_clock is None:
            seq.prefill_clock = _PrefillClock(time.perf_counter())
        if b.pending is not None:
            # Reading disk blocks is this step's share of the work for this sequence; alone, read all.
            self.sequences.load(seq, self.disk_blocks_per_step if shared else None)
            if b.pending is not None:
                return None
        start = b.length
        end = min(b.prefill_to, start + max(1, n))
        if end <= start:             # a resumed sequence the prefix cache gave back whole
            seq.prefilled = True
            return None
        if self.sparse is not None:
            # Chunks end on block boundaries: sparse prefill chooses blocks per block of queries,
            # so a chunk cut mid-block would choose differently from a cold prefill. With the prefix
            # cache the last full block ends a chunk too: there its prefix's importance is known, and
            # the same prompt again can start from it (docs/engine.md, "Prefix cache").
            bs = self.cache.block_size
            if end < b.prefill_to:
                end = end - end % bs if end - end % bs > start else min(b.prefill_to, start - start % bs + bs)
            elif self.prefix is not None and (b.prefill_to - 1) // bs * bs > start:
                end = (b.prefill_to - 1) // bs * bs
        if seq.vision is not None and seq.vision.embeds is None and (seq.vision.image_index[start:] >= 0).any():
            self._encode_images(seq)
        fresh = not seq.output_ids
        return _Work(seq, tokens_at(seq, start, end), start, logits=int(fresh and end == b.prefill_to),
                     prefill=True)

    def _prompt_done(self, seq: Sequence) -> float:
        """The first token is out: report the prompt's prefill; returns its wall time."""
        clock, seq.prefill_clock = seq.prefill_clock, None
        total = time.perf_counter() - clock.t0
        self._emit(profiler.PrefillStats(n_tokens=seq.n_context - seq.blocks.cached_tokens, n_context=seq.n_context,
                                         total_s=total, gemm_s=clock.gemm_s, attn_s=clock.attn_s))
        return total

    def prefill(self, seq: Sequence) -> TokenEvent | None:
        """Compute the prompt (what the prefix cache does not hold) in chunks; the first token.
        (None for a sequence resumed after preemption: it goes on decoding its last token.)"""
        while not seq.prefilled:
            out = self.step([], [(seq, self.prefill_chunk)])
            if out:
                return out[0][1]
        return None

    def decode(self, seqs: list[Sequence]) -> list[TokenEvent]:
        """One token for each running sequence, in one batched forward pass."""
        return [event for _, event in self.step(seqs)]

    def blocks_to_grow(self, decode: list[Sequence]) -> int:
        """Blocks a step decoding these sequences takes from the pool."""
        bs = self.cache.block_size
        return sum(1 for s in decode if s.n_context + 1 > len(s.blocks.blocks) * bs)

    def preempt(self, seq: Sequence) -> None:
        """Give back a running sequence's blocks (its full ones stay in the prefix cache) without
        ending it: resume() later recomputes what the cache no longer holds, and decoding goes on
        where it stopped."""
        self.cache.release(seq.blocks)
        seq.blocks.pending = None
        seq.prefilled = False
        seq.prefill_clock = None

    def resume(self, seq: Sequence, keep_available: int = 0) -> None:
        """Blocks again for a preempted sequence (as start: all or nothing, KVCacheFullError)."""
        self.sequences.attach(seq, keep_available)
        seq.prefilled = seq.n_context >= seq.blocks.prefill_to and seq.blocks.pending is None

    def _encode_images(self, seq: Sequence) -> None:
        """The vision tower over the sequence's images, once, before its prompt is computed."""
        if seq.vision is None or seq.vision.embeds is not None:
            return
        t0 = time.perf_counter()
        timer = profiler.StepTimer()
        self.model.encode_images(seq.vision, timer)
        self._emit(profiler.VisionStats(n_images=len(seq.vision.images),
                                        n_patches=sum(len(i.pixel_values) for i in seq.vision.images),
                                        n_tokens=seq.vision.n_image_tokens,
                                        total_s=time.perf_counter() - t0, gemm_s=timer.gemm_s,
                                        attn_s=timer.attn_s))

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq.blocks)
        seq.blocks.pending = None
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    # ---- the forward pass ------------------------------------------------------
    def _forward(self, work: list[_Work], timer, rows: str = "asked") -> np.ndarray:
        """Run rows of several sequences through the model; logits of the rows each _Work asks for
        (its last `logits` rows, in work order), or of every row (rows="all")."""
        # Reserve for every sequence before any length moves: a KVCacheFullError then leaves
        # all sequences as they were (extra reserved blocks are harmless and reused next step).
        for w in work:
            self.cache.reserve(w.seq.blocks, w.pos_start + len(w.token_ids))
        segments, tokens, positions, row = [], [], [], 0
        for w in work:
            n = len(w.token_ids)
            w.seq.blocks.length = w.pos_start + n
            table, blockpos, count = w.seq.blocks.views(self.cache.block_size)
            qpos = np.arange(w.pos_start, w.pos_start + n, dtype=np.int32)
            segments.append(Segment(w.seq.blocks, row, row + n, w.pos_start, table, blockpos, count, qpos,
                                    vision=w.seq.vision, prefill=w.prefill))
            tokens += w.token_ids
            positions.append(qpos)
            row += n
        batch = Batch(np.asarray(tokens, dtype=np.intp), np.concatenate(positions), segments)
        hidden = self.model.forward(batch, self.attention, timer)
        if rows == "all":
            return self.model.logits(hidden, timer)
        picked = [r for s, w in zip(segments, work) for r in range(s.row_end - w.logits, s.row_end)]
        if not picked:
            return hidden[:0]
        return self.model.logits(hidden[picked], timer)
