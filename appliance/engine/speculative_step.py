"""Speculative decoding inside a step (StepAPI's half; the policy is speculative.py's).

Before the forward pass a speculating sequence's decode row [last token] grows into
[last token, d1 .. dk] (docs/engine.md, "Speculative decoding"); after it, row i's logits go
through the sequence's Sampler as a plain step's would (Engine._accept, once per row, in
order), until a row's token is not the drafted one or the sequence ends. What the rejected
rows wrote is then put back: K/V and their scales, the probe and bound rows of sparse
attention, and the blocks taken for them, so that the pool is exactly as if they had never
been computed, and the prefix cache only ever names blocks of emitted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.engine.kv_cache import RowsBackup
from appliance.engine.speculative import SpeculativeStats

if TYPE_CHECKING:
    from appliance.engine.engine import Sequence, TokenEvent
    from appliance.engine.steps import _Work


@dataclass
class Draft:
    """A decode row's drafted tokens and what undoes their rows."""

    tokens: list[int]
    backup: RowsBackup
    keep_blocks: int            # blocks the sequence held before room was made for the draft


class SpeculativeSteps:
    """Engine methods that add drafted rows to a step and verify them."""

    def _add_drafts(self, work: list["_Work"]) -> bool:
        """Give each speculating decode row its draft (in place); True if any row got one.

        Drafts only use room plain decoding does not need this step: the blocks every decode row
        needs are reserved first, in the order a step without drafts reserves them, and a draft
        takes only free blocks (never an idle cached one, which it would evict)."""
        decoding = [w for w in work if not w.prefill]
        speculating = [w for w in decoding if w.seq.speculation is not None]
        if not speculating:
            return False
        for w in decoding:
            self.cache.reserve(w.seq.blocks, w.pos_start + 1)
        bs = self.cache.block_size
        free = len(self.cache.pool.free)
        share = self.step_costs.row_share(len(decoding))
        drafted = False
        for w in speculating:
            seq = w.seq
            held = len(seq.blocks.blocks)
            # The step emits at most len(draft) + 1 tokens, and the last row must stay in the context.
            limit = min(seq.params.max_tokens - len(seq.output_ids) - 1,
                        self.max_context - w.pos_start - 2,
                        (held + free) * bs - w.pos_start - 1)
            tokens = seq.speculation.draft(seq.prompt_ids, seq.output_ids, limit, share)
            if not tokens:
                continue
            end = w.pos_start + 1 + len(tokens)
            self.cache.reserve(seq.blocks, end)
            free -= len(seq.blocks.blocks) - held
            w.draft = Draft(tokens, self.cache.save_rows(seq.blocks, w.pos_start + 1, end), held)
            w.token_ids = w.token_ids + tokens
            w.logits = 1 + len(tokens)
            drafted = True
        return drafted

    def _verify(self, w: "_Work", logits, step_s: float, stats: SpeculativeStats) -> list[tuple["Sequence", "TokenEvent"]]:
        """The tokens of a drafted row, one logits row at a time; its rejected rows undone."""
        seq, draft = w.seq, w.draft
        out, accepted = [], 0
        for i in range(len(draft.tokens) + 1):
            seq.blocks.length = w.pos_start + 1 + i          # what a plain step's row i would see
            guess = draft.tokens[i] if i < len(draft.tokens) else None
            event = self._accept(seq, logits[i], step_s, guess)
            out.append((seq, event))
            if guess is None or event.token_id != guess:
                break
            accepted += 1
            if seq.done:
                break
        for _, event in out:                                  # the step's time, shared by its tokens
            event.step_s = step_s / len(out)
        # The last emitted token is not in the KV cache yet (the next step writes it), as in a plain step.
        self.cache.undo_rows(seq.blocks, draft.backup, w.pos_start + len(out), draft.keep_blocks)
        seq.speculation.record(len(draft.tokens), accepted)
        stats.add(len(draft.tokens), accepted)
        return out
