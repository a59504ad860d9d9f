"""A sequence's blocks in the pool: taken from the prefix cache where its tokens were seen before,
reserved for what prefill must compute, and offered back to the cache as they fill.

The engine calls attach() when a sequence starts or resumes after a preemption, load() while
its cached start is read from disk, commit() after every forward pass that wrote its rows,
and the pool's release() when it ends or is preempted.
"""
from __future__ import annotations

import numpy as np

from appliance.engine.kv_cache import PagedKVCache, PromptImportance
from appliance.engine.prefix_cache import Hit, PrefixCache, image_digest
from appliance.errors import KVCacheFullError


def tokens_at(seq, start: int, end: int) -> list[int]:
    """The token ids at KV positions [start, end) of a sequence: its prompt, then its output."""
    n = len(seq.prompt_ids)
    if end <= n:
        return seq.prompt_ids[start:end]
    return seq.prompt_ids[start:n] + seq.output_ids[max(0, start - n):end - n]


def image_extras(vision, block_size: int):
    """extras(j) -> bytes for a multimodal prompt: the content of the images whose tokens fall in
    block j (every image token has the same id, so the ids alone cannot tell two images apart)."""
    if vision is None or not vision.images:
        return lambda j: b""
    digests = [image_digest(img.pixel_values, img.grid_thw) for img in vision.images]
    # Image i's tokens are the prompt rows whose index into the image tokens falls in its span.
    bounds, token = [], 0
    for img in vision.images:
        rows = np.nonzero((vision.image_index >= token) & (vision.image_index < token + img.n_tokens))[0]
        bounds.append((int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0))
        token += img.n_tokens

    def extras(j: int) -> bytes:
        lo, hi = j * block_size, (j + 1) * block_size
        return b"".join(d for d, (a, b) in zip(digests, bounds) if a < hi and b > lo)

    return extras


class SequenceCache:
    def __init__(self, cache: PagedKVCache, prefix: PrefixCache | None, n_layers: int, sparse: bool):
        self.cache = cache
        self.prefix = prefix
        self.n_layers = n_layers
        self.sparse = sparse
        self.bs = cache.block_size

    # ---- start and resume ---------------------------------------------------------
    def attach(self, seq, keep_available: int = 0) -> None:
        """Blocks for a new or preempted sequence: its cached start, then room for the rest of what
        prefill must compute (all or nothing: KVCacheFullError leaves the pool as it was)."""
        b = seq.blocks
        resume = bool(seq.output_ids)
        target = len(seq.prompt_ids) + max(0, len(seq.output_ids) - 1)
        hit = Hit()
        if self.prefix is not None:
            # A new prompt keeps at least its last token to compute: its logits give the first token.
            limit = (target if resume else target - 1) // self.bs
            names = self.prefix.names(b, tokens_at(seq, 0, limit * self.bs), self._extras(seq), limit)
            hit = self.prefix.match(names, limit)
        b.blocks = list(hit.blocks)
        b.length = len(hit.blocks) * self.bs
        try:
            self.cache.reserve(b, target, keep_available)
        except KVCacheFullError:
            self.cache.release(b)
            raise
        b.prefill_to = target
        b.registered = len(hit.blocks)
        b.cached_tokens = b.length
        b.pending = hit if hit.disk else None
        if self.sparse:
            b.importance = PromptImportance(np.zeros((self.n_layers, len(seq.prompt_ids)), np.float32),
                                            base=hit.importance)
        if self.prefix is not None and not resume:
            self.prefix.count_query(target, 0, 0)
            if b.pending is None:
                self.prefix.count_query(0, b.cached_tokens, 0)

    def _extras(self, seq):
        if seq.blocks.extras is None:
            seq.blocks.extras = image_extras(seq.vision, self.bs)
        return seq.blocks.extras

    # ---- the disk part of a hit -----------------------------------------------------
    def load(self, seq, max_blocks: int | None = None) -> int:
        """Read up to max_blocks more of the sequence's cached start from disk; returns how many.
        When the last is read (or one cannot be), the hit is final: its blocks are named in the
        pool and the sequence's length covers them."""
        b, hit = seq.blocks, seq.blocks.pending
        first = len(hit.blocks) + len(hit.loaded)
        names = hit.disk[len(hit.loaded):][:max_blocks]
        parent = b.names[first - 1] if first else self.prefix.root
        tokens = [tokens_at(seq, j * self.bs, (j + 1) * self.bs) for j in range(first, first + len(names))]
        read = self.prefix.load(names, b.blocks[first:first + len(names)], tokens, parent)
        hit.loaded.extend(read)
        if len(read) < len(names) or len(hit.loaded) == len(hit.disk):
            self._finish_load(seq)
        return len(read)

    def _finish_load(self, seq) -> None:
        b, hit = seq.blocks, seq.blocks.pending
        n_memory = len(hit.blocks)
        end = n_memory + len(hit.loaded)
        importance = None
        if self.sparse:
            usable = [n_memory + i + 1 for i, m in enumerate(hit.loaded)
                      if m.importance is not None and m.importance.shape == (self.n_layers, n_memory + i + 1)]
            end = usable[-1] if usable else hit.memory_usable
            if usable:
                importance = hit.loaded[end - n_memory - 1].importance
            elif end:
                importance = self.prefix.pool.meta[hit.blocks[end - 1]].importance
            # Memory blocks past the fallback are shared: this sequence computes into fresh ones.
            for j in range(end, n_memory):
                self.prefix.pool.drop(b.blocks[j])
                b.blocks[j] = self.prefix.pool.take()
            b.importance.base = importance
        for j in range(n_memory, end):
            meta = hit.loaded[j - n_memory]
            self.prefix.register(b.blocks[j], b.names[j], meta.parent, meta.tokens, meta.importance)
        b.length = end * self.bs
        b.registered = end
        b.cached_tokens = b.length
        b.pending = None
        if not seq.output_ids:
            self.prefix.count_query(0, b.cached_tokens, max(0, end - n_memory) * self.bs)

    # ---- after a forward pass ---------------------------------------------------------
    def commit(self, seq, chunk_end: bool) -> None:
        """Offer the blocks that filled up to the prefix cache; chunk_end: a prefill chunk just
        ended here, so under sparse attention the prefix's importance is known at this point."""
        if self.prefix is None:
            return
        b = seq.blocks
        n_full = b.length // self.bs
        if n_full > b.registered:
            names = self.prefix.names(b, tokens_at(seq, 0, n_full * self.bs), self._extras(seq), n_full)
            for j in range(b.registered, n_full):
                if not self.prefix.cacheable(j, (j + 1) * self.bs <= b.prefill_to):
                    break
                parent = names[j - 1] if j else self.prefix.root
                self.prefix.register(b.blocks[j], names[j], parent, tokens_at(seq, j * self.bs, (j + 1) * self.bs))
            b.registered = n_full
        if (self.sparse and chunk_end and n_full and b.length % self.bs == 0
                and b.length <= min(b.prefill_to, b.importance.tokens.shape[1])):
            self.prefix.add_importance(b.names[n_full - 1], b.importance.prefix_block_sums(n_full, self.bs))
