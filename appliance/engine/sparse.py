"""Block-sparse attention (docs/engine.md, "Block-sparse attention"): read k blocks, not the whole context.

Decode, per layer and kv head (the group's query heads choose together, so a KV
block is still read once per group):
  1. probe: each block's score is a max of q . K over the group's query heads and
     - probe_mode "strided" (docs/engine.md): over `probe` sampled rows, every
       (block // probe)-th (max, not first: a needle can sit mid-block);
     - probe_mode "bound" (the default): over all rows, for the k blocks whose key bound
       q+ . max + q- . min (two stored rows per block, an upper bound of every q . K in it)
       is highest; other blocks score -inf. Why: a retrieval head's needle is one row, and
       sampling 8 of 32 misses it 3 times in 4 (the demo model recalled 0.53 of facts at
       2048 tokens with strided probes, 0.80 with the bound, the same as exact attention),
       and the bound reads 2 rows of a block where strided reads 8, so the probe stops
       growing the cost with the context (bench/README.md);
  2. importance: (k+1)//2 blocks are reserved first by the attention mass their tokens
     received during prefill (summed over the layer's queries and heads), ties to the
     lower block index;
  3. top-k fill: the other slots go to the best probe scores, ties to the lower index;
  4. recency: the block holding the current position replaces the lowest-scoring
     probe-selected block if it was not chosen (reserved blocks are never displaced);
  5. exact attention over the chosen blocks only (softmax renormalized over them).
Gate: only when seq_len > 2 * block. Decode also keeps exact attention until the context holds
more than 3k blocks (SparseConfig.decodes_sparse): before that exact attention is faster.

Prefill works on query chunks of one KV block each: a chunk keeps its own block and
the previous one, and fills the rest of its k by probing with the chunk's mean query.
The same attention pass records, per layer, the attention mass every prompt token receives.
"""
from __future__ import annotations

import numpy as np

from appliance.engine.attention import ExactAttention
from appliance.engine.kv_cache import PagedKVCache
from appliance.engine.batch import Batch, Segment
from appliance.kernels.dispatch import kernels
# The block choice's numpy definition (the compiled kernels' select is held to it bit for bit).
from appliance.kernels.reference import select as select_blocks  # noqa: F401 (re-exported)
from appliance.options import SparseConfig  # noqa: F401 (re-exported: the engine API takes it)


def block_importance(token_importance: np.ndarray | None, nb: int, block: int) -> np.ndarray | None:
    """Per-block sums of one layer's token importance float[n_tokens] (blocks past it: 0)."""
    if token_importance is None:
        return None
    padded = np.zeros(nb * block, np.float32)
    n = min(len(token_importance), nb * block)
    padded[:n] = token_importance[:n]
    return padded.reshape(nb, block).sum(axis=1)


class SparseAttention(ExactAttention):
    def __init__(self, cache: PagedKVCache, head_dim: int, n_layers: int, config: SparseConfig):
        super().__init__(cache, head_dim)
        if cache.block_size != config.block:
            raise ValueError(f"sparse block {config.block} must equal the KV block size {cache.block_size}")
        self.config = config
        self.n_layers = n_layers
        if config.probe_mode == "bound":
            cache.enable_bound_rows()
        # A compact copy of the probed rows pays when they are strided; with probe >= block every
        # row is probed and the slab itself is one contiguous run.
        elif config.block // config.probe > 1:
            cache.enable_probe_rows(config.probe)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: Batch) -> np.ndarray:
        out = np.empty(q.shape, np.float32)
        self.write_step(layer, k, v, batch, lists=False)
        for seg in batch.segments:
            rows = slice(seg.row_start, seg.row_end)
            if seg.prefill:
                self._prefill(layer, q[rows], seg, out[rows])
            elif seg.row_end - seg.row_start == 1:
                self._decode(layer, q[rows], seg, out[rows])
            else:
                # Verification rows of a speculative step: each chooses its blocks as a one-row
                # decode step at its position would (the later rows' K/V are written, not seen).
                for i in range(seg.row_start, seg.row_end):
                    self._decode(layer, q[i:i + 1], _row_view(seg, i - seg.row_start, self.config.block),
                                 out[i:i + 1])
        return out.reshape(q.shape[0], -1)

    # ---- decode ------------------------------------------------------------
    def _decode(self, layer: int, q: np.ndarray, seg: Segment, out: np.ndarray) -> None:
        nb = len(seg.table)
        seq_len = int(seg.qpos[-1]) + 1
        if not self.config.decodes_sparse(seq_len, nb):
            self.attend(layer, q, seg, out, seg.table, seg.blockpos, seg.count)
            return
        scores = self._probe(layer, np.ascontiguousarray(q), seg.table, seg.count)
        chosen = kernels.select(scores, self._block_importance(layer, seg.blocks, nb), self.config.k)
        self._attend_chosen(layer, q, seg, out, chosen, seg.table, seg.count)

    # ---- prefill -----------------------------------------------------------
    def _prefill(self, layer: int, q: np.ndarray, seg: Segment, out: np.ndarray) -> None:
        bs = self.config.block
        importance = seg.blocks.importance.tokens[layer] if seg.blocks.importance is not None else None
        first = seg.pos_start
        row = 0
        # Queries whose own block is among the first k (or under the gate) keep every block:
        # exact attention, in one call. Chunk by chunk it ran 16 small calls per layer at 512
        # tokens, twice the time on 2 threads. Per query the arithmetic is the same.
        dense_until = max(self.config.k, 2) * bs
        if first < dense_until:
            row = min(len(q), dense_until - first)
            visible = (first + row - 1) // bs + 1
            sub = Segment(seg.blocks, 0, row, first, seg.table[:visible], seg.blockpos[:visible],
                          seg.count[:visible], np.ascontiguousarray(seg.qpos[:row]))
            self.attend(layer, np.ascontiguousarray(q[:row]), sub, out[:row], sub.table, sub.blockpos,
                        sub.count, importance)
        while row < len(q):
            pos = first + row
            own = pos // bs
            end = min(len(q), row + (own + 1) * bs - pos)          # the rest of this KV block's queries
            chunk = slice(row, end)
            visible = own + 1
            # The segment's K/V are all written already; qpos hides each query's future rows.
            table, count = seg.table[:visible], seg.count[:visible]
            qc = np.ascontiguousarray(q[chunk])
            sub = Segment(seg.blocks, 0, end - row, pos, table, seg.blockpos[:visible], count,
                          np.ascontiguousarray(seg.qpos[chunk]))
            # Own block and the previous one are always kept; the rest by probing the older ones.
            older = visible - 2
            scores = self._probe(layer, qc.mean(axis=0, keepdims=True), table[:older], count[:older])
            chosen = np.ones((scores.shape[0], visible), dtype=bool)
            chosen[:, :older] = kernels.select(scores, None, self.config.k - 2)
            self._attend_chosen(layer, qc, sub, out[chunk], chosen, table, count, importance)
            row = end

    # ---- helpers -----------------------------------------------------------
    def _block_importance(self, layer: int, blocks, nb: int) -> np.ndarray | None:
        """float32[nb]: the prompt's importance per block for decode (blocks past the prompt: 0)."""
        imp = blocks.importance
        if imp is None:
            return None
        if imp.block_sums is None or imp.block_sums.shape[1] < nb:
            # Made once, then again only when the context doubles: a pool sized by memory holds far
            # more blocks than one sequence reaches, so room for all of them cost more than it saved.
            prompt_blocks = -(-imp.tokens.shape[1] // self.config.block)
            width = max(nb, prompt_blocks, 2 * (imp.block_sums.shape[1] if imp.block_sums is not None else 0))
            imp.block_sums = np.stack([block_importance(row, width, self.config.block) for row in imp.tokens])
            if imp.base is not None:             # the cached prefix's share (prefix_cache.py)
                imp.block_sums[:, :imp.base.shape[1]] += imp.base
        return imp.block_sums[layer, :nb]

    def _probe(self, layer: int, q: np.ndarray, table: np.ndarray, count: np.ndarray) -> np.ndarray:
        c = self.cache
        ks = c.k_scale[layer] if c.k_scale is not None else None
        if self.config.probe_mode == "bound":
            return kernels.attention_probe_bound(c.kind, q, c.k[layer], ks, c.bound_k[layer],
                                                 c.bound_k_scale[layer], table, count, self.config.k,
                                                 self.scale)
        pk = c.probe_k[layer] if c.probe_k is not None else None
        pks = c.probe_k_scale[layer] if c.probe_k_scale is not None else None
        return kernels.attention_probe(c.kind, q, c.k[layer], ks, table, count, self.config.probe,
                                       self.scale, pk=pk, pks=pks)

    def _attend_chosen(self, layer, q, seg, out, chosen, table, count, importance=None) -> None:
        """Exact attention over each head's chosen blocks (and, in prefill, the importance they get
        from the same pass: recording it in a second scoring pass cost more than the attention)."""
        n_kv = chosen.shape[0]
        idx = np.nonzero(chosen)[1].reshape(n_kv, -1).astype(np.int32)   # sorted per head
        self.attend(layer, q, seg, out, np.ascontiguousarray(table[idx]), idx,
                    np.ascontiguousarray(count[idx]), importance)


def _row_view(seg: Segment, i: int, block: int) -> Segment:
    """Row i of a decode segment as the segment of a one-row step at that row's position."""
    pos = int(seg.qpos[i])
    visible = pos // block + 1
    count = seg.count[:visible].copy()
    count[-1] = pos - (visible - 1) * block + 1
    return Segment(seg.blocks, 0, 1, pos, seg.table[:visible], seg.blockpos[:visible], count,
                   seg.qpos[i:i + 1], vision=seg.vision)


def make_attention(cache: PagedKVCache, head_dim: int, n_layers: int, sparse: SparseConfig | None):
    if sparse is None:
        return ExactAttention(cache, head_dim)
    return SparseAttention(cache, head_dim, n_layers, sparse)

